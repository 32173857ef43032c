"""Keep seccomp notification fds across an agent restart: a tiny fd-holder process.

Why: a seccomp notification fd (:mod:`corral.host.seccomp_notify`) is handed to the agent
once, by the runtime, at create. Sandboxes outlive the agent (``Node.close`` keeps them,
``Node.open`` adopts them), but the fd does not: when the last fd of a listener is closed
the kernel answers that filter's notifying calls ENOSYS and nothing records them. Nothing
can get such an fd back later: ``pidfd_getfd`` needs a live process that still has it
(the old agent is gone; the guest's processes never had it, and must never get it), and
the runtime sends it only once.

So the node starts ``corral-fdstore``, a ~170-line static C program (built like
``corral-spawn``, :mod:`corral.host.cbuild`), detached from the agent (its own session,
cwd ``/``, stdio ``/dev/null``, every other fd closed). The agent sends it a dup of every
notification fd it accepts (``P <sandbox id>`` + the fd by SCM_RIGHTS: one non-blocking
``sendmsg`` per create, no round trip), tells it ``D <sandbox id>`` when the sandbox is
destroyed, and a newly started agent asks ``G`` and gets every fd back (``F <id>`` + fd
each, then ``E <count>``). Both processes then hold the same open file description; there
is one listener in the kernel, and only the agent polls it, receives notifications and
answers them (always EPERM, never CONTINUE). The holder never reads or answers a
notification: it only keeps the file open. Checked on this kernel (6.18): while only the
holder has the fd, a notifying call neither fails nor runs but waits in the kernel
(killable); the next agent's ``SECCOMP_IOCTL_NOTIF_RECV`` on the returned fd gets it (and
every later one), records it and answers EPERM (tests/redteam/test_seccomp_after_restart.py).

Consequence: between an agent's exit and the next agent's open, a guest's refused call
*waits* instead of failing; it is answered EPERM, and recorded, once the agent is back.
If no agent comes back the caller stays blocked (killable, and the sandbox stays usable
for every allowed call); ``corral node gc`` or the next open resolve that.

Who can reach it: the holder accepts connections only on ``run_dir/fdstore.sock``, which
the agent binds (mode 0600, root's run dir) and passes to it as fd 3; it checks the peer
is its own uid (SO_PEERCRED) and serves one agent at a time (a second connection waits in
the backlog until the first closes; the node's state-dir lock already allows only one
agent). The run dir is not in any sandbox's mount namespace, guests have their own network
namespace (so no abstract socket of the host either) and pid namespace, and may not call
``pidfd_getfd``/``ptrace`` at all (policy/seccomp.py), so no guest reaches the holder's fds.

Lifetime: the holder exits by itself when it holds nothing and no agent is connected (and
10 s after its start if no agent ever connected), so after the last sandbox is destroyed
and the node closed it is gone; :meth:`FdStore.close` waits for that. Its pid (and start
time) are recorded in ``run_dir/fdstore.pid``; :func:`end_stale` ends a holder the agent
cannot use (unreachable, not answering) by that pid, after checking ``/proc/PID`` is that
very process: the start time matches and its cmdline is ``corral-fdstore-*`` naming this
run dir's socket. It is never looked up by name. If the holder is gone (killed, or the
host rebooted, in which case the sandboxes are gone too) the node falls back to today's
behaviour: ENOSYS and a ``seccomp_unwatched`` event for each adopted sandbox. The holder
stays in the agent's cgroup: a service manager that kills the whole cgroup when the agent
stops (systemd's default ``KillMode=control-group``) kills it too; run the agent with
``KillMode=process`` to keep it.

Example::

    store, handed = FdStore.open(Path("/run/corral"), Path("/var/lib/corral/bin"))
    for sandbox_id, fds in handed.items(): ...   # the previous agent's fds
    store.put("sb-1", notify_fd)                  # a dup stays with the holder
    store.drop("sb-1")                            # destroyed
    store.close()                                 # holder exits if it holds nothing
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import logging
import os
import select
import socket
import threading
import time
from pathlib import Path

from corral.errors import HostError
from corral.host.cbuild import build_static

__all__ = [
    "SOURCE",
    "FdStore",
    "end_stale",
    "ensure_built",
    "holder_pid",
    "holder_socket",
    "is_holder",
]

log = logging.getLogger("corral.fdstore")

SOCK_NAME = "fdstore.sock"
PID_NAME = "fdstore.pid"
PROGRAM = "corral-fdstore"

SOURCE = r"""
/* corral-fdstore SOCKPATH: keeps seccomp notification fds across agent restarts (see
 * corral/host/fdstore.py). fd 3 is its listening SOCK_SEQPACKET socket, bound by the agent at
 * SOCKPATH (mode 0600); the path is an argument only so /proc/PID/cmdline says whose it is.
 * One agent at a time, one message per packet:
 *   "P <id>" + fd (SCM_RIGHTS)   keep the fd under id (several per id are fine)
 *   "D <id>"                     close every fd kept under id
 *   "G"                          reply "F <id>" + fd for every fd kept, then "E <count>"
 *   "N"                          reply "E <count>" (are you there?)
 * It never polls, receives or answers a notification: it only keeps the files open.
 * Exits when no agent is connected and nothing is kept (10 s after start if no agent came). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#define IDLEN 128
struct kept { char id[IDLEN]; int fd; };
static struct kept *kept;
static size_t nkept, cap;

static void keep(const char *id, int fd)
{
	if (nkept == cap) {
		size_t ncap = cap ? cap * 2 : 64;
		struct kept *k = realloc(kept, ncap * sizeof *k);
		if (!k) { close(fd); return; }
		kept = k;
		cap = ncap;
	}
	snprintf(kept[nkept].id, IDLEN, "%s", id);
	kept[nkept++].fd = fd;
}

static void drop(const char *id)
{
	size_t j = 0;
	for (size_t i = 0; i < nkept; i++) {
		if (strcmp(kept[i].id, id) == 0)
			close(kept[i].fd);
		else
			kept[j++] = kept[i];
	}
	nkept = j;
}

static int send_fd(int c, const char *msg, int fd)
{
	struct iovec iov = { (void *)msg, strlen(msg) };
	union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } u;
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	if (fd >= 0) {
		memset(&u, 0, sizeof u);
		mh.msg_control = u.buf;
		mh.msg_controllen = sizeof u.buf;
		struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	}
	return sendmsg(c, &mh, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

/* One message from the agent: 1 = handled, 0 = the agent is gone (or misbehaved). */
static int serve(int c)
{
	char msg[IDLEN + 8];
	union { char buf[CMSG_SPACE(8 * sizeof(int))]; struct cmsghdr align; } u;
	struct iovec iov = { msg, sizeof msg - 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1,
			     .msg_control = u.buf, .msg_controllen = sizeof u.buf };
	ssize_t n = recvmsg(c, &mh, MSG_CMSG_CLOEXEC);
	if (n <= 0)
		return n < 0 && errno == EINTR;
	msg[n] = 0;
	int fds[8], nfds = 0;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
			continue;
		int k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (int i = 0; i < k && nfds < 8; i++)
			memcpy(&fds[nfds++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
	}
	int ok = !(mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC));
	if (ok && msg[0] == 'P' && msg[1] == ' ' && msg[2] && strlen(msg + 2) < IDLEN && nfds == 1) {
		keep(msg + 2, fds[0]);
		return 1;
	}
	for (int i = 0; i < nfds; i++)
		close(fds[i]);
	if (!ok || nfds)
		return 0;
	if (msg[0] == 'D' && msg[1] == ' ') {
		drop(msg + 2);
		return 1;
	}
	if (msg[0] == 'N' && msg[1] == 0) {
		char line[32];
		snprintf(line, sizeof line, "E %zu", nkept);
		return send_fd(c, line, -1) == 0;
	}
	if (msg[0] == 'G' && msg[1] == 0) {
		char line[IDLEN + 8];
		for (size_t i = 0; i < nkept; i++) {
			snprintf(line, sizeof line, "F %s", kept[i].id);
			if (send_fd(c, line, kept[i].fd) < 0)
				return 0;
		}
		snprintf(line, sizeof line, "E %zu", nkept);
		return send_fd(c, line, -1) == 0;
	}
	return 0;
}

int main(int argc, char **argv)
{
	(void)argv;
	if (argc != 2)
		return 2;
	signal(SIGPIPE, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
	signal(SIGINT, SIG_IGN);
	signal(SIGQUIT, SIG_IGN);
	if (chdir("/") < 0)
		return 1;
	syscall(SYS_close_range, 4U, ~0U, 0U);
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	int lfd = 3, served = 0;
	for (;;) {
		if (served && nkept == 0)
			return 0;
		struct pollfd p = { lfd, POLLIN, 0 };
		int r = poll(&p, 1, served ? -1 : 10000);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return 1;
		if (r == 0) {
			if (nkept == 0)
				return 0;
			continue;
		}
		int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0)
			continue;
		served = 1;
		struct ucred cr;
		socklen_t len = sizeof cr;
		if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 && cr.uid == geteuid()) {
			struct timeval tv = { 5, 0 }; /* an agent that stops reading is dropped */
			setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
			while (serve(c))
				;
		}
		close(c);
	}
}
"""

CFLAGS = ("-static", "-O2", "-Wall", "-s")


def ensure_built(out_dir: Path) -> Path:
    """Compile corral-fdstore into ``out_dir`` unless this source version is there."""
    return build_static(PROGRAM, SOURCE.encode(), CFLAGS, out_dir)


# ------------------------------------------------------------------ finding the holder


def _starttime(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None  # dead, only its pid is left
    return int(fields[19])


def holder_socket(pid: int) -> str | None:
    """The socket ``pid`` serves if it is a corral-fdstore (by its cmdline), else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    if len(argv) < 2 or not os.path.basename(argv[0]).startswith(PROGRAM.encode() + b"-"):
        return None
    return argv[1].decode(errors="replace")


def is_holder(pid: int, run_dir: Path) -> bool:
    """Whether ``pid`` is a live corral-fdstore serving ``run_dir``'s socket."""
    return holder_socket(pid) == str(run_dir / SOCK_NAME) and _starttime(pid) is not None


def holder_pid(run_dir: Path) -> int | None:
    """The holder recorded in ``run_dir`` if it is still that process, else None."""
    try:
        pid_s, start_s = (run_dir / PID_NAME).read_text().split()
        pid, start = int(pid_s), int(start_s)
    except (OSError, ValueError):
        return None
    if _starttime(pid) != start or not is_holder(pid, run_dir):
        return None
    return pid


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait for ``pid`` to exit (and reap it if it is our child)."""
    try:
        pfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready = select.select([pfd], [], [], timeout)[0]
    finally:
        os.close(pfd)
    if ready:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return bool(ready)


def end_stale(run_dir: Path, keep: int | None = None) -> int | None:
    """End the holder recorded in ``run_dir`` (unless it is ``keep``): SIGKILL by its
    recorded pid once ``/proc`` shows it is that process. Returns the pid ended, if any."""
    pid = holder_pid(run_dir)
    if pid is None or pid == keep:
        return None
    log.warning("ending a stale seccomp fd holder (pid %d) of %s", pid, run_dir)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    _wait_gone(pid, 5.0)
    with contextlib.suppress(FileNotFoundError):
        (run_dir / PID_NAME).unlink()
    return pid


# ------------------------------------------------------------------ the agent's side


def _recv_all(s: socket.socket, timeout: float) -> dict[str, list[int]]:
    """Every fd the holder keeps, after a ``G`` (raises OSError/ValueError if it fails)."""
    got: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout
    try:
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            data, anc, flags, _ = s.recvmsg(256, socket.CMSG_SPACE(4 * 4), socket.MSG_CMSG_CLOEXEC)
            fds = array.array("i")
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            if not data:
                raise ConnectionError("the fd holder closed the connection")
            text = data.decode()
            if text.startswith("E ") and not fds:
                if int(text[2:]) != sum(len(v) for v in got.values()):
                    raise ValueError("the fd holder's count does not match what it sent")
                return got
            if not text.startswith("F ") or len(fds) != 1 or flags & socket.MSG_CTRUNC:
                for fd in fds:
                    os.close(fd)
                raise ValueError(f"unexpected message from the fd holder: {text[:40]!r}")
            got.setdefault(text[2:], []).append(fds[0])
    except BaseException:
        for fds_ in got.values():
            for fd in fds_:
                os.close(fd)
        raise
    finally:
        s.settimeout(None)


class FdStore:
    """The agent's connection to its fd holder. ``put``/``drop`` are thread-safe and never
    block; a holder that fails is given up (its sandboxes then fall back to ENOSYS and
    ``seccomp_unwatched`` at the next restart), the node keeps working."""

    def __init__(self, run_dir: Path, sock: socket.socket, pid: int | None) -> None:
        self.run_dir = run_dir
        self.pid = pid
        self._sock: socket.socket | None = sock
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # sandbox id -> fds the holder keeps for it

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @classmethod
    def open(cls, run_dir: Path, helper_dir: Path) -> tuple[FdStore, dict[str, list[int]]]:
        """Connect to this run dir's holder (starting one if there is none) and take back
        every fd it keeps, by sandbox id (the caller owns those fds)."""
        path = run_dir / SOCK_NAME
        pid = holder_pid(run_dir)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            s.settimeout(2.0)
            s.connect(str(path))
            s.sendall(b"G")
            handed = _recv_all(s, 5.0)
        except (OSError, ValueError) as e:
            s.close()
            if pid is not None or not isinstance(e, (FileNotFoundError, ConnectionRefusedError)):
                log.warning("seccomp fd holder of %s unusable (%s); starting a new one", run_dir, e)
            end_stale(run_dir)
            return cls._start(run_dir, helper_dir), {}
        store = cls(run_dir, s, pid)
        store._held = {sid: len(fds) for sid, fds in handed.items()}
        return store, handed

    @classmethod
    def _start(cls, run_dir: Path, helper_dir: Path) -> FdStore:
        exe = ensure_built(helper_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / SOCK_NAME
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            old = os.umask(0o177)
            try:
                lsock.bind(str(path))
            finally:
                os.umask(old)
            lsock.listen(8)
            # fd 3 in the holder; dup2 onto 3 clears CLOEXEC (unless it is 3 already).
            lfd = fcntl.fcntl(lsock.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
            try:
                pid = os.posix_spawn(
                    str(exe),
                    [str(exe), str(path)],
                    {},
                    file_actions=[
                        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDWR, 0),
                        (os.POSIX_SPAWN_DUP2, 0, 1),
                        (os.POSIX_SPAWN_DUP2, 0, 2),
                        (os.POSIX_SPAWN_DUP2, lfd, 3),
                    ],
                    setsid=True,
                    setsigmask=(),
                )
            finally:
                os.close(lfd)
            start = _starttime(pid)
            tmp = run_dir / f".{PID_NAME}.{os.getpid()}"
            tmp.write_text(f"{pid} {start}\n")
            os.replace(tmp, run_dir / PID_NAME)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                s.connect(str(path))  # queued in the backlog until the holder accepts
            except OSError as e:
                s.close()
                raise HostError(f"cannot reach the seccomp fd holder at {path}: {e}") from e
        finally:
            lsock.close()  # the holder has its own copy
        store = cls(run_dir, s, pid)
        # posix_spawn returns once the child's exec has replaced its memory, but before the
        # kernel has set its argv: /proc/PID/cmdline can read empty for a while, and
        # end_stale would not recognise the holder. An answer means it is in its main loop.
        if not store.ping(5.0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)  # our own child, just started
            _wait_gone(pid, 5.0)
            for name in (PID_NAME, SOCK_NAME):
                with contextlib.suppress(FileNotFoundError):
                    (run_dir / name).unlink()
            raise HostError(f"the seccomp fd holder started at {path} does not answer")
        return store

    def held(self) -> set[str]:
        """Sandboxes the holder keeps an fd of (as this agent told it)."""
        with self._lock:
            return set(self._held)

    def _send(self, msg: bytes, fd: int | None = None) -> bool:
        with self._lock:
            s = self._sock
            if s is None:
                return False
            anc = []
            if fd is not None:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            try:
                try:
                    s.sendmsg([msg], anc, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                except BlockingIOError:
                    # A burst of creates outran the holder: give it a moment, never more.
                    if not select.select([], [s], [], 1.0)[1]:
                        raise
                    s.sendmsg([msg], anc, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except OSError as e:
                log.warning(
                    "seccomp fd holder failed (%s): refused calls of running sandboxes will "
                    "not be recorded after an agent restart",
                    errno.errorcode.get(e.errno or 0, e),
                )
                self._sock = None
                s.close()
                return False
            return True

    def ping(self, timeout: float = 2.0) -> bool:
        """Whether the holder answers (and keeps as many fds as this agent gave it)."""
        with self._lock:
            s = self._sock
            if s is None:
                return False
            try:
                s.settimeout(timeout)
                s.sendall(b"N")
                reply = s.recv(64).decode()
                s.settimeout(None)
                n = int(reply[2:]) if reply.startswith("E ") else -1
            except (OSError, ValueError) as e:
                log.warning("seccomp fd holder %s does not answer: %s", self.pid, e)
                self._sock = None
                s.close()
                return False
            return n == sum(self._held.values())

    def put(self, sandbox_id: str, fd: int) -> None:
        """Give the holder a dup of ``fd`` (the caller keeps its own)."""
        if self._send(b"P " + sandbox_id.encode(), fd):
            with self._lock:
                self._held[sandbox_id] = self._held.get(sandbox_id, 0) + 1

    def drop(self, sandbox_id: str) -> None:
        """The holder closes every fd of ``sandbox_id`` (destroyed, or never adopted)."""
        with self._lock:
            had = self._held.pop(sandbox_id, None)
        if had:
            self._send(b"D " + sandbox_id.encode())

    def abandon(self) -> None:
        """Disconnect without waiting (the holder is being replaced)."""
        with self._lock:
            s, self._sock = self._sock, None
        if s is not None:
            s.close()

    def close(self, timeout: float = 5.0) -> None:
        """Disconnect. A holder that keeps nothing exits then: wait for it and remove its
        files; one that keeps fds stays for the next agent."""
        with self._lock:
            s, self._sock = self._sock, None
            empty = not self._held
        if s is not None:
            s.close()
        if not empty:
            return
        if self.pid is not None and not _wait_gone(self.pid, timeout):
            log.warning("seccomp fd holder %d did not exit; ending it", self.pid)
            end_stale(self.run_dir)
        # The agent holds the node's lock, so no other agent is starting a holder here.
        for name in (PID_NAME, SOCK_NAME):
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / name).unlink()
