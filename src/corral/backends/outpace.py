"""How fast the node takes one sandbox's output off its init (``limits.output_rate``).

Every byte a sandbox prints through an exec or a stream crosses the node's own process:
its init frames it, the node reads it off the control socket, keeps it, and sends it on
to the client. That relay is one process for all the sandboxes of a node, so a sandbox
that prints as fast as it can (``yes`` asked for again and again with a 64 MiB cap) takes
the node's CPU and its event loop's time from every other sandbox and from the API: on
this 2-core node, an unpaced output flood of ~300 MiB/s raised a latency-class
neighbour's exec p99 and the API's p99 to 2.7-2.9x their idle figures (RELIABILITY.md).

:class:`OutputPace` is that sandbox's share: ``rate`` bytes a second over all its execs
and streams together (``Limits.output_rate``: 32 MiB/s unless the sandbox asks for
another, a 64 MiB answer in two seconds), after a burst of :data:`BURST_S` seconds' worth
taken at once (an ordinary exec that prints a few MiB after a quiet spell is never
slowed). The default is what kept both probes of ``corral bench neighbours`` within
1.3x of idle under a full-force flood on this 2-core node (64 MiB/s: up to 2.07x). A reader ahead
of the rate waits before it takes more; the init then stops reading the process's pipes
(its backpressure, ``HIGH_WATER``), and the process blocks in ``write``: the flood is
slowed at its source, nothing is dropped, and the exec's output cap and timeout apply as
before. The bookkeeping is a virtual clock (the time at which the bytes taken so far are
paid for), shared by the loop and the reader threads under a lock.

Example::

    pace = OutputPace()                     # one per sandbox
    wait = pace.take(len(body), 32 << 20)   # seconds to wait before reading more (0.0: go on)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["OutputPace", "BURST_S"]

BURST_S = 0.25
"""Seconds of the rate a sandbox may take at once after a quiet spell (8 MiB at the
default): the reader is never held up by an exec of ordinary size."""
MIN_WAIT_S = 0.01
"""Debts shorter than this are carried, not slept: a sleep (and the wake-up that takes the
GIL back) per frame cost the node more CPU than the bytes it held back."""


class OutputPace:
    """One sandbox's output budget (see the module docstring). The rate comes with each
    read (the node passes the sandbox's ``limits.output_rate`` to every exec and stream it
    relays); the clock is the sandbox's, so its concurrent execs share one budget."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._paid = float("-inf")
        """When the bytes taken so far are paid for."""
        self._lock = threading.Lock()
        self.waited = 0.0
        """Seconds readers were told to wait in all (what the pace held back)."""

    def take(self, n: int, rate: int) -> float:
        """Account ``n`` bytes just read, at ``rate`` bytes a second; the seconds the
        reader should wait before it reads more (0.0 while within the rate and burst)."""
        if rate <= 0:
            raise ValueError(f"output rate must be positive, not {rate}")
        now = self._clock()
        with self._lock:
            self._paid = max(self._paid, now - BURST_S) + n / rate
            wait = self._paid - now
            if wait < MIN_WAIT_S:
                return 0.0
            self.waited += wait
            return wait
