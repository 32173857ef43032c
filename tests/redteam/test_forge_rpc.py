"""The guest hunts for a control channel: sockets, PID 1's fds and memory, ptrace, kill.

Host-side canary servers listen on a unix socket in /tmp, an abstract unix socket and TCP
127.0.0.1; each answers a connection with a canary and records it. The guest tries every
unix socket it can find, every abstract name in its /proc/net/unix, a port range on
127.0.0.1 including the canary's port, PID 1's fds, /proc/1/mem, ptrace and SIGKILL of
PID 1. Nothing may reach a host server, and the init must keep answering.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.redteam.conftest import assert_healthy, new_canary, out, run


class CanaryServers:
    def __init__(self) -> None:
        self.canary = new_canary()
        self.hits: list[str] = []
        self.path = f"/tmp/corral-red-{secrets.token_hex(6)}.sock"
        self.abstract = f"\0corral-red-{secrets.token_hex(6)}"
        self.socks: list[socket.socket] = []
        for fam, addr in (
            (socket.AF_UNIX, self.path),
            (socket.AF_UNIX, self.abstract),
            (socket.AF_INET, ("127.0.0.1", 0)),
        ):
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.bind(addr)
            s.listen(16)
            s.settimeout(0.2)
            self.socks.append(s)
        os.chmod(self.path, 0o777)
        self.port = self.socks[2].getsockname()[1]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, args=(s,)) for s in self.socks]
        for t in self._threads:
            t.start()

    def _serve(self, s: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                c, _ = s.accept()
            except (TimeoutError, OSError):
                continue
            self.hits.append(repr(s.getsockname()))
            try:
                c.sendall(self.canary.encode())
            finally:
                c.close()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        for s in self.socks:
            s.close()
        os.unlink(self.path)


@pytest.fixture
def servers() -> Iterator[CanaryServers]:
    s = CanaryServers()
    try:
        yield s
    finally:
        s.close()


ATTACK = r"""
import ctypes, os, re, signal, socket
def report(what, how): print(what, how, flush=True)
paths = os.popen("find / -type s 2>/dev/null").read().split()
paths += [HOST_PATH, "/run/corral/api.sock", "/run/corral-test-red/api.sock"]
abstract = []
for line in open("/proc/net/unix").read().splitlines()[1:]:
    f = line.split()
    if len(f) >= 8 and f[7].startswith("@"):
        abstract.append("\0" + f[7][1:])
abstract += [HOST_ABSTRACT]
for a in paths + abstract:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(1)
    try:
        s.connect(a); report("unix", repr(a) + " CONNECTED " + repr(s.recv(64)))
    except OSError as e: report("unix", repr(a) + " " + type(e).__name__)
    s.close()
open_ports = []
for port in sorted(set(list(range(1, 1025)) + [2024, 5001, 5002, 8000, 8080, HOST_PORT])):
    s = socket.socket(); s.settimeout(0.5)
    try:
        s.connect(("127.0.0.1", port)); open_ports.append(port); s.recv(64)
    except OSError: pass
    s.close()
report("tcp_open", open_ports)
for fd in sorted(os.listdir("/proc/1/fd")):
    try:
        f = os.open("/proc/1/fd/" + fd, os.O_RDWR); report("fd", fd + " OPENED"); os.close(f)
    except OSError as e: report("fd", fd + " " + e.__class__.__name__)
try:
    with open("/proc/1/mem", "rb") as m: m.seek(0x400000); report("mem", m.read(16))
except OSError as e: report("mem", e.__class__.__name__)
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
for req, name in ((16, "attach"), (0x4206, "seize")):
    r = libc.ptrace(req, 1, None, None)
    report("ptrace_" + name, "0" if r == 0 else os.strerror(ctypes.get_errno()))
try:
    os.kill(1, signal.SIGKILL); report("kill", "sent")
except OSError as e: report("kill", e.__class__.__name__)
"""


async def test_no_channel_reaches_the_host(red_node, guest, servers):  # type: ignore[no-untyped-def]
    code = (
        ATTACK.replace("HOST_PATH", repr(servers.path))
        .replace("HOST_ABSTRACT", repr(servers.abstract))
        .replace("HOST_PORT", str(servers.port))
    )
    await guest.files.write("/tmp/attack.py", code)
    r = await run(guest, "python3 /tmp/attack.py", timeout=120)
    text = r.stdout.decode()
    assert r.exit_code == 0, out(r)
    assert "CONNECTED" not in text, out(r)
    assert "tcp_open []" in text, out(r)
    assert "OPENED" not in text, out(r)
    assert "mem PermissionError" in text, out(r)
    assert "ptrace_attach Operation not permitted" in text, out(r)
    assert "ptrace_seize Operation not permitted" in text, out(r)
    assert not servers.hits, f"HOLE: a guest reached the host canary servers: {servers.hits}"
    # SIGKILL from inside the pid namespace does not reach its init: it still answers
    await assert_healthy(red_node, guest)
    r = await run(guest, "kill -9 1; kill -SEGV 1; kill -TERM 1; sleep 0.2; echo still")
    assert r.stdout.endswith(b"still\n"), out(r)
    await assert_healthy(red_node, guest)
    assert (await guest.refresh()).state == "running"


async def test_init_discloses_nothing(guest):  # type: ignore[no-untyped-def]
    """PID 1 is non-dumpable: its environ, maps, fd targets, root and cwd are closed; its
    cmdline names only the in-sandbox path."""
    r = await run(
        guest,
        "for f in environ maps smaps root/ cwd/ stack syscall auxv; do "
        "  cat /proc/1/$f >/dev/null 2>&1 && echo OPEN $f; done; "
        "for f in /proc/1/fd/*; do readlink $f && echo OPEN $f; done 2>/dev/null; "
        "tr '\\0' ' ' </proc/1/cmdline; echo",
    )
    assert "OPEN" not in r.stdout.decode(), out(r)
    assert r.stdout.decode().strip() == "/.corral/init", out(r)
