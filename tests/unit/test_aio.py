"""host/_aio.py: waiting on fds and reaping children from the event loop, and the spawn
server's receive when the loop wakes it with nothing to read."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from corral.host import _aio, spawnd


async def test_fd_ready_reads_writes_and_times_out() -> None:
    r, w = os.pipe()
    try:
        assert await _aio.fd_ready(r, timeout=0) is False  # nothing written yet
        assert await _aio.fd_ready(w, write=True) is True  # an empty pipe takes bytes
        os.write(w, b"x")
        assert await _aio.fd_ready(r, timeout=-1.0) is True  # ready: no wait needed
        # the callback is gone however each wait ended: the loop takes a new one
        loop = asyncio.get_running_loop()
        assert loop.remove_reader(r) is False
        assert loop.remove_writer(w) is False
    finally:
        os.close(r)
        os.close(w)


async def test_fd_ready_cancelled_removes_its_callback() -> None:
    r, w = os.pipe()
    try:
        task = asyncio.ensure_future(_aio.fd_ready(r))
        await asyncio.sleep(0)  # let it register
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asyncio.get_running_loop().remove_reader(r) is False
    finally:
        os.close(r)
        os.close(w)


async def test_reap_gives_the_exit_code_and_leaves_no_zombie() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    assert await _aio.reap(p.pid) == 7
    with pytest.raises(ChildProcessError):
        os.waitpid(p.pid, os.WNOHANG)  # reaped


async def test_reap_survives_the_callers_cancel() -> None:
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", "import os; os.read(0, 1)"], stdin=r)
    os.close(r)
    task = asyncio.ensure_future(_aio.reap(p.pid))
    await asyncio.sleep(0)  # let it register its pidfd
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    os.close(w)  # now the child ends; the pidfd's callback must still reap it
    for _ in range(100_000):  # loop turns, not time: the callback runs once the fd is ready
        if not os.path.exists(f"/proc/{p.pid}"):
            break
        await asyncio.sleep(0)
    else:
        pytest.fail("the cancelled reap() left the child unreaped")


async def test_spawnd_recv_retries_a_wakeup_with_nothing_to_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    real = _aio.fd_ready
    calls = 0

    async def spurious_first(fd: int, *, write: bool = False, timeout: float | None = None) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            return True  # woken with nothing queued: recvmsg gets EAGAIN, not end-of-file
        if calls == 2:
            b.send(b"later")
        return await real(fd, write=write, timeout=timeout)

    monkeypatch.setattr(spawnd, "fd_ready", spurious_first)
    with a, b:
        assert await spawnd._recv(a) == (b"later", -1)
    assert calls == 2
