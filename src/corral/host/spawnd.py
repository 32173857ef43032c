"""The node's spawn server: corral-launch started from a small fd table, not the node's.

Starting a program copies the starter's fd table into the child (``dup_fd``) and the exec
walks it to close the close-on-exec ones (``do_close_on_exec``). The node holds ~2 fds per
live sandbox, so a launch it ``posix_spawn``ed itself cost more with every sandbox alive
(the profile of ``bench scale``: 0.24 -> 0.94 ms per create from 0-200 to 600-800 live).
``corral-spawnd`` (``corral/init/corral-spawnd.c``), started at node start-up while the
node has few fds, forks the launcher from its own table instead: the node sends it the
launcher's arguments and the few fds a launch needs over a unix socketpair (SCM_RIGHTS),
and a reply socket on which the server writes the launcher's wait status when it exits.

What the server can do for whoever holds the socket is exactly what the node could do
before: run corral-launch (the one binary it was started with; never another program),
with an empty environment and only the fds sent. The socket is an anonymous socketpair,
close-on-exec in the node, so no other process can reach it.

Example::

    srv = SpawnServer(Path("/var/lib/corral/bin/corral-spawnd-…"), launcher_path)
    status = await srv.run(["-x", "/.corral/init", "--", ...], {3: ctl, 4: report_w})
    launch = await srv.submit(args, {3: ctl})   # in two steps: once submitted, the
    os.close(ctl)                               # server holds its own copy of ctl
    status = await srv.wait(launch)
    srv.close()
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import select
import signal
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from corral.errors import HostError
from corral.host import cbuild
from corral.host._aio import fd_ready

__all__ = ["SOURCE", "Launch", "SpawnServer", "cpu_seconds", "ensure_built"]

log = logging.getLogger("corral.spawnd")

SOURCE = Path(__file__).parent.parent / "init" / "corral-spawnd.c"
CFLAGS = ("-static", "-O2", "-Wall", "-s")
_FIRST, _NFDS = 3, 5  # the launcher's fds 3..7
_MAX_MSG = 65536
_RECV_FLAGS = socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC  # a received pidfd is CLOEXEC


SPAWN_TIMEOUT = 10.0
"""Seconds a spawn server may take to take a request (read it and start the launcher, or
report the launcher's end once it has ended). A server slower than that is hung (stopped,
or stuck): it is killed, the create fails with an error saying so, and the next request
starts a new server. Forking from a small fd table takes well under a millisecond; the
bound is for a server that will never answer, not for a slow one."""

_LIVE: list[SpawnServer] = []


def cpu_seconds() -> float:
    """CPU time (user + system) of this process's live spawn servers and the launchers they
    reaped: what ``os.times()``'s children times miss until a server is itself reaped (it
    then moves there, so the sum of both stays right). The benches' CPU per create."""
    return sum(s.cpu_seconds() for s in _LIVE)


def ensure_built(out_dir: Path) -> Path:
    """Compile corral-spawnd into ``out_dir`` unless this source version is there."""
    return cbuild.build_static("corral-spawnd", SOURCE.read_bytes(), CFLAGS, out_dir)


@dataclass(frozen=True)
class Launch:
    """A launcher run a spawn server took (:meth:`SpawnServer.submit`): what
    :meth:`SpawnServer.wait` needs to learn how it ended. It carries the server's pid
    itself, so a request always blames the server that took it (a later one may run by
    then), and nothing is left in the server for one that is dropped unwaited."""

    reply: socket.socket
    """Where the server answers: the launcher's pidfd, then its wait status. Closed by
    :meth:`SpawnServer.wait`, or by :meth:`close` when nobody will wait."""
    server_pid: int
    """The server that took the request: the one killed if it stops answering."""

    def close(self) -> None:
        """Drop the request unwaited (the launcher runs on; the server reaps it)."""
        self.reply.close()


class SpawnServer:
    """A running corral-spawnd, restarted on the next request if it died.

    Start it from the event loop's thread (the node's main thread): PR_SET_PDEATHSIG fires
    when the *thread* that started it exits, and a worker thread of ``asyncio.to_thread``
    may exit at any time."""

    def __init__(self, binary: Path, launcher: str, *, timeout: float = SPAWN_TIMEOUT) -> None:
        self.binary = str(binary)
        self.launcher = launcher
        self.timeout = timeout
        """See :data:`SPAWN_TIMEOUT`."""
        self._sock: socket.socket | None = None
        self._pid = -1
        self.restarts = 0
        self.hangs = 0
        """Servers killed because they did not answer in time (counted in restarts too)."""
        self._launched_cpu = 0.0
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._start()
        _LIVE.append(self)

    @property
    def pid(self) -> int:
        return self._pid

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            actions = [
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_DUP2, theirs.fileno(), _FIRST),
            ]
            argv = [self.binary, self.launcher, str(os.getpid())]
            # Safe: corral's own spawn server; only its socket (fd 3) and stdio cross.
            self._pid = os.posix_spawn(argv[0], argv, {}, file_actions=actions)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours

    def cpu_seconds(self) -> float:
        """CPU of the running server itself and of the launchers it reaped (see
        :func:`cpu_seconds`)."""
        own = 0.0
        if self._pid > 0:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(self._pid).cpu_times()
                own = t.user + t.system
        return own + self._launched_cpu

    def _reap(self) -> None:
        if self._pid > 0:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self._pid, 0)
            self._pid = -1
        # Its own and its launchers' CPU are in our children times now.
        self._launched_cpu = 0.0

    def close(self) -> None:
        """Stop the server: it exits at EOF on its socket (launchers running go on); one
        that has not within :attr:`timeout` (stopped, hung) is killed."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._pid > 0:
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(self._pid)
                try:
                    poll = select.poll()
                    poll.register(pidfd, select.POLLIN)
                    if not poll.poll(int(self.timeout * 1000)):
                        log.warning("corral-spawnd (pid %d) did not exit: killing it", self._pid)
                        os.kill(self._pid, signal.SIGKILL)  # Safe: our own child, reaped next
                finally:
                    os.close(pidfd)
        self._reap()
        with contextlib.suppress(ValueError):
            _LIVE.remove(self)

    async def _send(self, msg: bytes, fds: Sequence[int]) -> None:
        """One request, without blocking the event loop: the socket buffers ~25 requests
        of a launcher's size (~5 KB each), so a burst of creates while the server waits for
        CPU can find it full; senders then wait for room in turn."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        async with self._lock[1]:
            while True:
                if self._sock is None:  # killed as hung while this waited for the lock
                    self._start()
                sock = self._sock
                assert sock is not None
                try:
                    sock.sendmsg([msg], anc)
                    return
                except BlockingIOError:
                    # A full socket: the server is not reading (~25 requests are queued).
                    if not await fd_ready(sock.fileno(), write=True, timeout=self.timeout):
                        raise self._hung(self._pid, "taking a request") from None

    async def run(self, args: Sequence[str], fds: Mapping[int, int]) -> int:
        """:meth:`submit` then :meth:`wait`."""
        return await self.wait(await self.submit(args, fds))

    async def submit(self, args: Sequence[str], fds: Mapping[int, int]) -> Launch:
        """Start the launcher with ``args`` (after argv[0]) and ``fds`` ({target 3..7: our
        fd}); returns the :class:`Launch` to :meth:`wait` on. Once this returns the server
        holds its own copies of ``fds`` (the caller may close its ones; not before).

        HostError if the request cannot be sent (the server died twice in a row)."""
        if any(not _FIRST <= t < _FIRST + _NFDS for t in fds):
            raise HostError(f"spawnd: launcher fds must be {_FIRST}..{_FIRST + _NFDS - 1}")
        mask = 0
        for t in fds:
            mask |= 1 << (t - _FIRST)
        msg = struct.pack("=I", mask) + b"".join(a.encode() + b"\0" for a in args)
        if len(msg) >= _MAX_MSG:
            raise HostError(f"spawnd: launcher arguments too long ({len(msg)} bytes)")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            order = [theirs.fileno(), *(fds[t] for t in sorted(fds))]
            for attempt in (0, 1):
                if self._sock is None:
                    self._start()
                try:
                    await self._send(msg, order)
                    break
                except (BrokenPipeError, ConnectionResetError):
                    # It died (killed, or the node's socket closed): a new one, once.
                    log.warning("corral-spawnd (pid %d) is gone: restarting it", self._pid)
                    assert self._sock is not None
                    self._sock.close()
                    self._sock = None
                    self._reap()
                    self.restarts += 1
                    if attempt:
                        raise HostError("spawnd: the spawn server died twice") from None
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        return Launch(mine, self._pid)

    def _hung(self, pid: int, doing: str) -> HostError:
        """Kill server ``pid`` if it is still the current one (the next request starts a
        new one); the error for the request that found it hung."""
        if pid > 0 and pid == self._pid:
            log.warning(
                "corral-spawnd (pid %d) did not answer for %gs: killing it", pid, self.timeout
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # Safe: our own child (reaped just below)
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._reap()
            self.restarts += 1
            self.hangs += 1
        return HostError(
            f"spawnd: the spawn server (pid {pid}) did not answer within {self.timeout:g}s "
            f"{doing} (stopped or hung): it was killed, and the next create starts a new one"
        )

    async def wait(self, launch: Launch) -> int:
        """The launcher's exit status (as :func:`os.waitstatus_to_exitcode`) of a
        :meth:`submit`; closes its reply socket. HostError if the server could not run it,
        or died first: then only once the launcher itself has ended (its pidfd, which the
        server sent first), so the caller's undo finds what it made."""
        reply, pid = launch.reply, launch.server_pid
        pidfd = -1
        try:
            got = await _recv(reply, self.timeout)
            if got is None:
                raise self._hung(pid, "starting the launcher")
            out, pidfd = got
            if out == b"P":
                if pidfd >= 0:
                    # The launcher's run may take long (a create on idle CPU): the bound
                    # starts once it has ended and the server has to say so.
                    await _either(reply.fileno(), pidfd)
                got = await _recv(reply, self.timeout)
                if got is None:
                    raise self._hung(pid, "reporting the launcher's end")
                out = got[0]
                if not out and pidfd >= 0:
                    await fd_ready(pidfd)  # the launcher's end (the server's is known)
            if not out:
                raise HostError("spawnd: the spawn server died before the launcher finished")
        finally:
            reply.close()
            if pidfd >= 0:
                os.close(pidfd)
        text = out.decode(errors="replace")
        if text.startswith("X "):
            status, user_us, sys_us = (int(x) for x in text[2:].split())
            self._launched_cpu += (user_us + sys_us) / 1e6
            return os.waitstatus_to_exitcode(status)
        raise HostError(f"spawnd: {text.removeprefix('E ')}")


async def _either(a: int, b: int) -> None:
    """Until fd ``a`` or fd ``b`` is readable."""
    waits = [asyncio.ensure_future(fd_ready(a)), asyncio.ensure_future(fd_ready(b))]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def _recv(sock: socket.socket, timeout: float | None = None) -> tuple[bytes, int] | None:
    """One message from ``sock`` (b"" at EOF) and the fd it carried (-1: none; the caller
    closes it), waiting on the event loop; None if none came within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        left = None if deadline is None else max(deadline - loop.time(), 0.001)
        if not await fd_ready(sock.fileno(), timeout=left):
            return None
        try:
            data, anc, _, _ = sock.recvmsg(256, socket.CMSG_SPACE(4), _RECV_FLAGS)
            break
        except (BlockingIOError, InterruptedError):  # woken with nothing to read yet
            continue
        except OSError:  # the server's end is gone
            return b"", -1
    fds = array.array("i")
    for level, kind, blob in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(blob[: len(blob) - len(blob) % fds.itemsize])
    for extra in fds[1:]:
        os.close(extra)
    return data, fds[0] if fds else -1
