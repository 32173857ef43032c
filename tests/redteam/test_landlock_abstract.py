"""Abstract unix sockets made outside the guest's landlock domain: unreachable.

An abstract socket has no file to protect it: anyone in the same network namespace can
connect by name. corral-init runs guest commands in a domain scoped against abstract
sockets, so a listener made by anything outside it (PID 1, a host process that enters
the sandbox's network namespace, a neighbour sharing a namespace) refuses the guest with
EPERM, while guest processes still reach each other's sockets across exec calls.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.redteam.conftest import new_canary, out, run

LISTEN = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(b"\0" + sys.argv[1].encode())
s.listen(8)
s.settimeout(float(sys.argv[2]))
print("listening", flush=True)
try:
    c, _ = s.accept()
    c.sendall(sys.argv[3].encode())
    print("accepted", flush=True)
except TimeoutError:
    print("nobody", flush=True)
"""

CONNECT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(b"\0" + sys.argv[1].encode())
    print("connected", s.recv(100).decode())
except OSError as e:
    print("refused", e.errno)
"""


async def test_guest_cannot_reach_host_abstract_socket(red_node, guest):  # type: ignore[no-untyped-def]
    if (await red_node.node_status()).landlock < 6:
        pytest.skip("no landlock scoping on this kernel")
    pid = (await red_node.sandbox_get(guest.id)).pid
    canary = new_canary()
    # A host process (outside every landlock domain) listening in the sandbox's own
    # network namespace: the strongest position a platform service could be in.
    host = subprocess.Popen(
        [
            "nsenter",
            f"--net=/proc/{pid}/ns/net",
            "--",
            sys.executable,
            "-c",
            LISTEN,
            "corral-red-host",
            "3",
            canary,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "listening"
        await guest.files.write("/tmp/connect.py", CONNECT)
        r = await run(guest, "python3 /tmp/connect.py corral-red-host")
        assert r.stdout.strip() == b"refused 1", out(r)  # EPERM: landlock scope
    finally:
        host.kill()
        rest, _ = host.communicate(timeout=30)
    assert "accepted" not in rest


async def test_guest_abstract_sockets_work_across_calls(guest):  # type: ignore[no-untyped-def]
    """The scope is the sandbox's one domain: a server started by one call serves
    clients of later calls, as without landlock."""
    await guest.files.write("/tmp/listen.py", LISTEN)
    await guest.files.write("/tmp/connect.py", CONNECT)
    server = await guest.spawn(["python3", "/tmp/listen.py", "guest-own", "20", "hello"])
    try:
        r = None
        for _ in range(100):
            r = await run(guest, "python3 /tmp/connect.py guest-own")
            if r.stdout.startswith(b"connected"):
                break
        assert r is not None and r.stdout.strip() == b"connected hello", out(r)
    finally:
        await server.kill()
