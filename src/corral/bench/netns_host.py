"""A stand-in for a remote host: a network namespace joined to this one by a veth.

The far end of ``corral bench network`` and of the network tests (tests/integration/
nethosts.py): servers run inside the namespace on its address, sandboxes reach them over
the node's uplink, and nothing outside this machine is ever contacted. Everything made
here is removed by :meth:`NetnsHost.down`.

Example::

    host = NetnsHost(ns="corral-bench-netsrv", veth="cb0123456789",
                     host_ip="10.251.0.1", ip="10.251.0.2")
    host.up()
    try:
        http = host.serve_http(Path("/tmp/root"))
        assert wait_port(host.ip, 80)
        ...
    finally:
        http.kill()
        host.down()
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from corral.errors import HostError
from corral.host import mounts

__all__ = ["NetnsHost", "RUN_NETNS", "delete_netns", "release_run_netns", "wait_port"]

RUN_NETNS = Path("/run/netns")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def release_run_netns() -> None:
    """Undo what the first ``ip netns add`` on a host does besides the namespace: make
    /run/netns a shared bind mount of itself. Done only when no named namespace is left
    in it (anyone's), so the host's mount table is as a fresh boot left it; the next
    ``ip netns add`` makes the mount again."""
    if mounts.is_mountpoint(RUN_NETNS) and not any(RUN_NETNS.iterdir()):
        with contextlib.suppress(HostError):  # busy: a namespace was just mounted in it
            mounts.umount(RUN_NETNS)


def delete_netns(name: str, check: bool = False) -> None:
    """``ip netns del name`` (``check``: it must have been there), then
    :func:`release_run_netns`."""
    subprocess.run(["ip", "netns", "del", name], check=check, capture_output=True)
    release_run_netns()


@dataclass(frozen=True)
class NetnsHost:
    """Namespace ``ns`` with ``eth0`` at ``ip``/24, its veth peer ``veth`` at ``host_ip``/24
    on the host side (forwarding enabled on that interface only)."""

    ns: str
    veth: str
    host_ip: str
    ip: str
    default_route: bool = False
    """A default route via ``host_ip`` in the namespace, so its servers can answer
    addresses outside the /24."""

    def up(self) -> None:
        """Create the namespace and its link (what a crashed run left of them goes first)."""
        self.down()
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.veth)
        _ip("link", "set", self.veth, "up")
        Path(f"/proc/sys/net/ipv4/conf/{self.veth}/forwarding").write_text("1")
        _ip("-n", self.ns, "addr", "add", f"{self.ip}/24", "dev", "eth0")
        _ip("-n", self.ns, "link", "set", "eth0", "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")
        if self.default_route:
            _ip("-n", self.ns, "route", "add", "default", "via", self.host_ip)

    def down(self) -> None:
        """Remove the link and the namespace, if they are there."""
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
        delete_netns(self.ns)

    def spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """Run ``argv`` inside the namespace (output discarded); the caller ends it.

        ``nsenter --net`` joins the network namespace only: ``ip netns exec`` would also
        give the process a copy of the host's mount table, whose copies of sandbox and
        scratch mounts made meanwhile would then keep their filesystems (and loop devices)
        alive after the node unmounted them, until this process ends."""
        return subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.ns}", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def serve_http(self, root: Path, port: int = 80) -> subprocess.Popen[bytes]:
        """A static HTTP server of ``root`` on ``ip``:``port`` (see :func:`wait_port`)."""
        return self.spawn(
            [sys.executable, "-m", "http.server", str(port), "--bind", self.ip,
             "--directory", str(root)]
        )  # fmt: skip


def wait_port(ip: str, port: int, timeout: float = 15.0) -> bool:
    """Whether a TCP connect to ``ip``:``port`` succeeds within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((ip, port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False
