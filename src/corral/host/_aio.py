"""Waiting on kernel file descriptors from the event loop: one place for the loop's reader
and writer callbacks, so that each waiter removes its callback however it ends.

- :func:`fd_ready`: until an fd is readable (a pidfd: its process has ended; a socket: data
  or end-of-file) or writable, optionally for at most some seconds.
- :func:`reap`: a child's exit code, from its pidfd, without a thread.

The loop allows one reader and one writer callback per fd: two coroutines must not wait on
the same fd and direction at once (each caller here owns its fd).
"""

from __future__ import annotations

import asyncio
import os
import select


async def fd_ready(fd: int, *, write: bool = False, timeout: float | None = None) -> bool:
    """Wait until ``fd`` is readable (or writable with ``write``); False if ``timeout``
    seconds passed first (a timeout of 0 or less only looks). Cancelling the caller removes
    the callback."""
    if timeout is not None and timeout <= 0:
        poll = select.poll()
        poll.register(fd, select.POLLOUT if write else select.POLLIN)
        return bool(poll.poll(0))
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    add, remove = (
        (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    )
    add(fd, wake)
    try:
        if timeout is None:
            await done
            return True
        async with asyncio.timeout(timeout):
            await done
        return True
    except TimeoutError:
        return False
    finally:
        remove(fd)


async def reap(pid: int, *, unknown: int = -1) -> int:
    """Wait for our child ``pid`` to exit and reap it: its exit code (as
    :func:`os.waitstatus_to_exitcode`), or ``unknown`` if someone else's ``waitpid(-1)``
    reaped it first. Cancelling the caller does not stop the reaping: the pidfd's callback
    reaps the child whenever it ends, so no zombie is left. Kernels without pidfds (before
    5.3) wait in a thread."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        return os.waitstatus_to_exitcode(status)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def exited() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = unknown
        if not done.done():
            done.set_result(code)

    loop.add_reader(pidfd, exited)
    return await asyncio.shield(done)
