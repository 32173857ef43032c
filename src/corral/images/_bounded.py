"""Store calls with a deadline: a network filesystem that stops answering must not hang
the node.

When the servers of a FUSE or network filesystem go away, a ``stat`` or ``read`` on it
blocks in the kernel until the client gives up (MooseFS: minutes; an NFS hard mount:
forever), and SIGTERM does not interrupt it. The node reads the store from its event
loop (``store.image`` on every create), so one such call would freeze every sandbox's
exec too. Here each call runs in a daemon worker thread and the caller waits at most
``timeout`` seconds; past that it gets :class:`StoreUnavailable` and the worker is left
to finish whenever the filesystem answers. While that stuck call is still pending, later
calls fail at once instead of piling up more stuck threads. Workers wait for the next
call (up to ``_IDLE`` seconds) instead of ending: a thread started per call cost every
create a ``clone`` and a thread's setup on the event loop. A call that finds no idle
worker starts one, so concurrent callers still run side by side.

:meth:`Bounded.acall` is the same for a coroutine: the caller awaits the worker's answer
instead of blocking its thread on it, so an event loop goes on serving other requests
during the round trip (the node's ``sandbox_create`` looks its image up this way: on a
network store a blocking wait stalled every create and exec of the node for one round
trip per create).

Errors that mean "the transport is gone" (ENOTCONN of a dead FUSE daemon, EIO, ESTALE,
EHOSTDOWN...) become StoreUnavailable too; other errors pass through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from corral.errors import StoreUnavailable

__all__ = ["Bounded"]

T = TypeVar("T")
_IDLE = 60.0
"""Seconds a worker waits for another call before it ends."""

_GONE = frozenset(
    {errno.ENOTCONN, errno.EIO, errno.ESTALE, errno.EHOSTDOWN, errno.EHOSTUNREACH,
     errno.ETIMEDOUT, errno.ECONNREFUSED, errno.ECONNRESET, errno.ENETUNREACH}
)  # fmt: skip


class _Call:
    def __init__(self, fn: Callable[[], object], notify: Callable[[], None] | None = None) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.notify = notify
        """Called by the worker after ``done`` is set (an awaiting caller's wake-up)."""
        self.value: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        """Call ``fn``; the worker sets ``done`` afterwards."""
        try:
            self.value = self.fn()
        except BaseException as e:  # handed to the waiting caller
            self.error = e


class Bounded:
    """Run store I/O with a deadline (None: call directly, no thread)."""

    def __init__(self, root: str, timeout: float | None) -> None:
        self.root = root
        self.timeout = timeout
        self._stuck: _Call | None = None
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._idle = 0
        """Workers waiting for a call that no queued call has claimed yet."""
        self._lock = threading.Lock()

    def _submit(self, call: _Call) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._serve, name="corral-store-io", daemon=True).start()
        self._calls.put(call)

    def _serve(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=_IDLE)
            except queue.Empty:
                with self._lock:
                    if self._idle:  # unclaimed: no call is on its way to this worker
                        self._idle -= 1
                        return
                continue  # claimed just now: its call is being queued
            call.run()
            with self._lock:
                # Idle before the caller wakes: its next call then finds this worker
                # instead of starting another.
                self._idle += 1
            call.done.set()
            if call.notify is not None:
                call.notify()

    def _unavailable(self, what: str, why: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"the layer store at {self.root} is unavailable ({what}: {why}); check that its "
            f"filesystem is mounted and its servers are reachable. Sandboxes already running "
            f"keep their mounted layers"
        )

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, or StoreUnavailable if it takes longer than the timeout."""
        if self.timeout is None:
            return self._translate(what, fn)
        stuck = self._stuck
        if stuck is not None:
            if not stuck.done.is_set():
                raise self._unavailable(what, "an earlier call has not returned yet")
            self._stuck = None
        call = _Call(lambda: self._translate(what, fn))
        self._submit(call)
        if not call.done.wait(self.timeout):
            self._stuck = call
            raise self._unavailable(what, f"no answer within {self.timeout:g} s")
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]

    async def acall(self, what: str, fn: Callable[[], T]) -> T:
        """:meth:`call` for a coroutine: awaits the worker (the event loop runs on)."""
        if self.timeout is None:
            return await asyncio.to_thread(self._translate, what, fn)
        stuck = self._stuck
        if stuck is not None:
            if not stuck.done.is_set():
                raise self._unavailable(what, "an earlier call has not returned yet")
            self._stuck = None
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[None] = loop.create_future()

        def wake() -> None:  # on the worker: the loop may be closed by now
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, answered)

        call = _Call(lambda: self._translate(what, fn), wake)
        self._submit(call)
        try:
            await asyncio.wait_for(answered, self.timeout)
        except TimeoutError:
            self._stuck = call
            raise self._unavailable(what, f"no answer within {self.timeout:g} s") from None
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]

    def _translate(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except OSError as e:
            if e.errno in _GONE:
                raise self._unavailable(what, e.strerror or str(e)) from None
            raise


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # not cancelled by the caller's deadline meanwhile
        fut.set_result(None)
