"""Seccomp user notifications: the node learns of every interesting refused system call.

The sandbox's seccomp profile answers the calls worth an event with ``SCMP_ACT_NOTIFY``
(:mod:`corral.policy.seccomp`). The OCI runtime installs the filter with
``SECCOMP_FILTER_FLAG_NEW_LISTENER`` and sends the notification fd, together with the
container state as JSON, over the unix socket named by ``listenerPath``. One thread of the
node accepts those fds and serves all of them with one epoll: ``SECCOMP_IOCTL_NOTIF_RECV``
(which call, which arguments), a callback that records it, and ``SECCOMP_IOCTL_NOTIF_SEND``
with ``-EPERM``, the answer the filter's default action gives. The listener never lets a
call run and never reads the caller's memory, so there is no time-of-check race to win.

The guest's thread waits in the kernel until it is answered; a sandbox that makes more
than ``rate`` refused calls a second is simply not polled for a while (its callers wait,
killable), so a guest cannot burn the node's CPU through this thread.

A notification fd lives only in the process that holds it. ``on_fd`` is told of every fd
accepted, so the node can keep a dup in its fd holder (:mod:`corral.host.fdstore`) and a
later agent can :meth:`NotifyListener.watch` it again after a restart. Without that the
fds die with the agent; the kernel then answers the notifying calls ENOSYS (still
refused) and they are no longer recorded (see :meth:`NotifyListener.watched`).

Example::

    ln = NotifyListener(Path("/run/corral/seccomp.sock"), lambda sid, call: print(sid, call))
    ln.start()       # the path goes into the profile as listenerPath
    ...
    ln.close()
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NotifyListener", "SeccompCall", "syscall_name"]

log = logging.getLogger("corral.seccomp")

# struct seccomp_notif { u64 id; u32 pid; u32 flags; struct seccomp_data { int nr; u32 arch;
# u64 instruction_pointer; u64 args[6]; } } and struct seccomp_notif_resp { u64 id; s64 val;
# s32 error; u32 flags; }: the kernel ABI, stable since 5.0.
_NOTIF = struct.Struct("=QIIiIQ6Q")
_RESP = struct.Struct("=QqiI")
_IOC_RW = 3


def _iowr(nr: int, size: int) -> int:
    return (_IOC_RW << 30) | (size << 16) | (ord("!") << 8) | nr


_NOTIF_RECV = _iowr(0, _NOTIF.size)
_NOTIF_SEND = _iowr(1, _RESP.size)
_NOTIF_ID_VALID = (1 << 30) | (8 << 16) | (ord("!") << 8) | 2  # _IOW('!', 2, __u64)


@dataclass(frozen=True)
class SeccompCall:
    """One refused call as the kernel reported it."""

    nr: int
    arch: int
    args: tuple[int, ...]
    pid: int
    """Host pid of the caller (it may be gone by the time anyone looks)."""
    comm: str = ""
    """The caller's command name (``/proc/PID/comm``, at most 15 bytes, guest-chosen)."""

    @property
    def name(self) -> str:
        return syscall_name(self.arch, self.nr)


_libseccomp: ctypes.CDLL | None | bool = False
_names: dict[tuple[int, int], str] = {}


def syscall_name(arch: int, nr: int) -> str:
    """The system call's name (libseccomp's table, as the runtime uses), else ``syscall_NR``."""
    name = _names.get((arch, nr))
    if name is None:
        name = _names[(arch, nr)] = _resolve(arch, nr)
    return name


def _resolve(arch: int, nr: int) -> str:
    global _libseccomp
    if _libseccomp is False:
        found = ctypes.util.find_library("seccomp")
        try:
            _libseccomp = ctypes.CDLL(found or "libseccomp.so.2")
            _libseccomp.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
            _libseccomp.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
        except OSError:
            _libseccomp = None
    if _libseccomp:
        assert isinstance(_libseccomp, ctypes.CDLL)
        p = _libseccomp.seccomp_syscall_resolve_num_arch(arch, nr)
        if p:
            name = ctypes.string_at(p).decode()
            ctypes.CDLL(None).free(ctypes.c_void_p(p))
            return name
    return f"syscall_{nr}"


@dataclass
class _Watch:
    sandbox_id: str
    fd: int
    tokens: float
    stamp: float
    resume_at: float = 0.0
    paused: bool = field(default=False)


class NotifyListener:
    """Accepts seccomp notification fds on ``path`` and answers every call with EPERM.

    ``on_call(sandbox_id, call)`` runs on the listener thread before the answer; it must be
    quick and thread-safe. ``on_fd(sandbox_id, fd)`` (optional) runs on the listener thread
    for every fd the runtime hands over, before it is polled; the fd stays this listener's.
    ``rate``/``burst``: refused calls per second a sandbox gets answered before it has to
    wait (a token bucket).
    """

    def __init__(
        self,
        path: Path,
        on_call: Callable[[str, SeccompCall], None],
        *,
        on_fd: Callable[[str, int], None] | None = None,
        rate: float = 2000.0,
        burst: float = 500.0,
    ) -> None:
        self.path = path
        self.on_call = on_call
        self.on_fd = on_fd
        self.rate = rate
        self.burst = burst
        self._watches: dict[int, _Watch] = {}
        # The throttled ones, so that each wake-up of the thread looks at them only, not at
        # every sandbox's watch (O(live) per notification and per accepted runtime).
        self._paused: dict[int, _Watch] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._epoll = select.epoll()
        self._stop = False

    def start(self) -> None:
        """Bind ``path`` (mode 0600: only root, i.e. the runtime, may connect) and serve."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            s.bind(str(self.path))
        finally:
            os.umask(old)
        s.listen(128)
        s.setblocking(False)
        self._sock = s
        self._epoll.register(s.fileno(), select.EPOLLIN)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._serve, name="corral-seccomp", daemon=True)
        self._thread.start()

    def for_each(self, fn: Callable[[str, int], None]) -> None:
        """``fn(sandbox_id, fd)`` for every fd served, with the fds held open meanwhile."""
        with self._lock:
            for w in list(self._watches.values()):
                fn(w.sandbox_id, w.fd)

    def watched(self) -> set[str]:
        """Sandboxes whose notification fd this listener holds."""
        with self._lock:
            return {w.sandbox_id for w in self._watches.values()}

    def close(self) -> None:
        """Stop the thread and close every fd (their callers then get ENOSYS)."""
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for w in self._watches.values():
                with contextlib.suppress(OSError):
                    os.close(w.fd)
            self._watches.clear()
            self._paused.clear()
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._epoll.close()

    # -- the thread -----------------------------------------------------------------

    def _serve(self) -> None:
        assert self._sock is not None
        lfd = self._sock.fileno()
        while not self._stop:
            timeout = self._resume_due()
            try:
                ready = self._epoll.poll(timeout)
            except InterruptedError:
                continue
            for fd, mask in ready:
                if fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 64)
                elif fd == lfd:
                    self._accept()
                else:
                    self._serve_fd(fd, mask)

    def _resume_due(self) -> float:
        """Re-poll throttled sandboxes whose wait is over; seconds until the next one."""
        now = time.monotonic()
        nxt = -1.0
        with self._lock:
            for w in list(self._paused.values()):
                if w.resume_at <= now:
                    w.paused = False
                    del self._paused[w.fd]
                    with contextlib.suppress(OSError):
                        self._epoll.register(w.fd, select.EPOLLIN)
                else:
                    wait = w.resume_at - now
                    nxt = wait if nxt < 0 else min(nxt, wait)
        return nxt

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("seccomp listener: accept: %s", e)
                return
            with conn:
                try:
                    self._take(conn)
                except (OSError, ValueError) as e:
                    log.warning("seccomp listener: bad connection: %s", e)

    def _take(self, conn: socket.socket) -> None:
        """One runtime connection: the container state (JSON) and one fd (SCM_RIGHTS)."""
        conn.setblocking(True)
        # The runtime sends from inside the new sandbox's cgroup: a best-effort sandbox gets
        # idle CPU only, so with every CPU busy its few writes can take seconds. Giving up
        # after 2 s failed the container's setup (seen: "init did not come up" under load).
        conn.settimeout(30.0)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        fds = array.array("i")
        chunks: list[bytes] = []
        while True:
            data, anc, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(4 * fds.itemsize))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            if not data:
                break
            chunks.append(data)
            try:
                json.loads(b"".join(chunks))
                break  # complete (crun keeps the connection open until it exits)
            except ValueError:
                continue
        try:
            if uid != 0:
                raise ValueError(f"peer uid {uid} is not root")
            if len(fds) != 1:
                raise ValueError(f"expected one fd, got {len(fds)}")
            state = json.loads(b"".join(chunks))
            sandbox_id = str(state.get("metadata") or state["state"]["id"])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        fd = fds[0]
        os.set_inheritable(fd, False)
        if self.on_fd is not None:
            try:
                self.on_fd(sandbox_id, fd)
            except Exception:
                log.exception("seccomp listener: on_fd failed")
        self.watch(sandbox_id, fd)

    def watch(self, sandbox_id: str, fd: int) -> None:
        """Serve ``fd`` (a notification fd of ``sandbox_id``) from now on; the listener owns
        it. Notifications that arrived before are answered first (epoll is level-triggered)."""
        with self._lock:
            self._watches[fd] = _Watch(sandbox_id, fd, self.burst, time.monotonic())
        self._epoll.register(fd, select.EPOLLIN)
        if self._thread is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"w")

    def _serve_fd(self, fd: int, mask: int) -> None:
        with self._lock:
            w = self._watches.get(fd)
        if w is None:
            return
        if mask & select.EPOLLIN:
            buf = bytearray(_NOTIF.size)
            try:
                fcntl.ioctl(fd, _NOTIF_RECV, buf)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR):
                    return  # the caller died (or was interrupted) before we looked
                self._drop(w)
                return
            nid, pid, _flags, nr, arch, _ip, *args = _NOTIF.unpack(buf)
            try:
                with open(f"/proc/{pid}/comm", "rb") as f:
                    comm = f.read(64).strip().decode(errors="replace")
                # The caller waits for our answer, so the pid is still its own, unless it was
                # killed meanwhile: then the notification is no longer valid.
                fcntl.ioctl(fd, _NOTIF_ID_VALID, struct.pack("=Q", nid))
            except OSError:
                comm = ""
            try:
                self.on_call(w.sandbox_id, SeccompCall(nr, arch, tuple(args), pid, comm))
            except Exception:
                log.exception("seccomp listener: recording a call failed")
            with contextlib.suppress(OSError):  # ENOENT: the caller is gone
                fcntl.ioctl(fd, _NOTIF_SEND, bytearray(_RESP.pack(nid, 0, -errno.EPERM, 0)))
            self._charge(w)
        elif mask & (select.EPOLLHUP | select.EPOLLERR):
            self._drop(w)  # every process of the filter has exited

    def _charge(self, w: _Watch) -> None:
        now = time.monotonic()
        w.tokens = min(self.burst, w.tokens + (now - w.stamp) * self.rate) - 1
        w.stamp = now
        if w.tokens < 0:
            # Too many refused calls: stop polling this sandbox until a token is back.
            w.paused = True
            w.resume_at = now + (-w.tokens + 1) / self.rate
            with self._lock:
                self._paused[w.fd] = w
            with contextlib.suppress(OSError):
                self._epoll.unregister(w.fd)

    def _drop(self, w: _Watch) -> None:
        with self._lock:
            self._watches.pop(w.fd, None)
            self._paused.pop(w.fd, None)
        with contextlib.suppress(OSError):
            self._epoll.unregister(w.fd)
        with contextlib.suppress(OSError):
            os.close(w.fd)
