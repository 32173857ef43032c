"""Percentiles for benchmark figures.

Nearest-rank percentiles: the reported value is always one that was really measured
(no interpolation between two samples), which is what a p99 over a few hundred samples
should mean.

Example:
    >>> p50([3.0, 1.0, 2.0])
    2.0
    >>> summary_ms([0.010, 0.020, 0.030, 0.040])["p50_ms"]
    20.0
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import psutil

from corral.host import spawnd

__all__ = ["percentile", "p50", "p99", "summary_ms", "rate", "CpuMeter", "machine_busy_s"]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``.

    The smallest sample such that at least ``q`` percent of the samples are <= it.
    """
    if not values:
        raise ValueError("percentile of no samples: the scenario measured nothing")
    if not 0 < q <= 100:
        raise ValueError(f"percentile {q} is outside (0, 100]")
    ordered = sorted(values)
    # Rounding guards against 99/100*100 landing a hair above an integer.
    rank = math.ceil(round(q / 100 * len(ordered), 9))
    return ordered[max(rank, 1) - 1]


def p50(values: Sequence[float]) -> float:
    """Median by nearest rank (for an even count, the lower middle sample)."""
    return percentile(values, 50)


def p99(values: Sequence[float]) -> float:
    """99th percentile by nearest rank (the maximum when there are fewer than 100 samples)."""
    return percentile(values, 99)


def rate(count: int, wall_seconds: float) -> float:
    """Operations per second over a wall-clock interval, rounded to 2 decimals."""
    if wall_seconds <= 0:
        raise ValueError("rate over an empty interval")
    return round(count / wall_seconds, 2)


def summary_ms(seconds: Sequence[float]) -> dict[str, float | int]:
    """``{"p50_ms", "p99_ms", "min_ms", "max_ms", "n"}`` of latencies given in seconds."""
    return {
        "p50_ms": round(p50(seconds) * 1000, 2),
        "p99_ms": round(p99(seconds) * 1000, 2),
        "min_ms": round(min(seconds) * 1000, 2),
        "max_ms": round(max(seconds) * 1000, 2),
        "n": len(seconds),
    }


def machine_busy_s() -> float:
    """CPU seconds this machine has spent busy (all cores; not idle, not iowait)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - t.iowait


def host_init_s() -> float:
    """CPU seconds the host's init (pid 1) has used: in ``machine``, but not corral's. On
    the VMs corral is developed on, pid 1 is the VM's agent, whose CPU grows with the
    number of network namespaces on the host (one per sandbox): ~13% of a core with 1,500
    idle ones, more while they are made and removed."""
    if os.getpid() == 1:  # the bench is some namespace's init: nothing to tell apart
        return 0.0
    try:
        t = psutil.Process(1).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


class CpuMeter:
    """CPU time this process (the bench's embedded node and its client) and its waited-for
    children (corral-launch with the spawn server that starts it, runtimes) spend between :meth:`start` and :meth:`per_op`.

    CPU time, not wall time: robust on a loaded machine, where wall time measures the
    neighbours as much as corral.
    """

    def __init__(self) -> None:
        self.start()

    def start(self) -> CpuMeter:
        self._t0 = os.times()
        self._spawnd0 = spawnd.cpu_seconds()
        self._machine0 = machine_busy_s()
        self._init0 = host_init_s()
        return self

    def per_op(self, ops: int) -> dict[str, float]:
        """Milliseconds per operation: ``node`` (user+system of this process),
        ``children`` (user+system of exited children) and ``machine`` (every core's busy
        time: also the sandboxes' own processes, which are still running and so in
        neither, and the kernel's threads). On ``cores`` cores at most ``cores * 1000 /
        machine`` operations a second fit, whatever the code's latency. ``host_init``:
        the part of ``machine`` that the host's init spent (:func:`host_init_s`)."""
        machine = machine_busy_s() - self._machine0
        init = host_init_s() - self._init0
        t1, t0 = os.times(), self._t0
        node = (t1.user - t0.user) + (t1.system - t0.system)
        kids = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
        # The launchers the node's spawn server reaped (and the server), not in ours.
        kids += spawnd.cpu_seconds() - self._spawnd0
        n = max(ops, 1)
        return {
            "node": round(node * 1000 / n, 2),
            "children": round(kids * 1000 / n, 2),
            "machine": round(machine * 1000 / n, 2),
            "host_init": round(init * 1000 / n, 2),
        }
