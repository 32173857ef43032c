"""The attach path of ``host/netlink.py`` against real namespaces: what a sandbox's veth
looks like inside and out, that the host end stays down until the rules are in, and
that every failure leaves nothing behind.

Each test wires a throwaway network namespace (``unshare -n -U``, like a runtime's: owned
by its own user namespace) to a tagged gateway bridge; both are removed afterwards.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from corral.errors import HostError
from corral.host.netlink import Links
from tests.conftest import TAG

GW, ADDR = "10.216.0.1", "10.216.0.7"
BRIDGE = f"cnl{TAG[1:]}gw"
VETH = f"cvl{TAG[1:]}t"


def _ip(*args: str, pid: int | None = None) -> str:
    enter = ["nsenter", "-t", str(pid), "-n"] if pid else []
    return subprocess.run(
        [*enter, "ip", *args], capture_output=True, text=True, check=True, timeout=10
    ).stdout


def _exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


@pytest.fixture
def netns_pid() -> Iterator[int]:
    proc = subprocess.Popen(["unshare", "-n", "-U", "--map-root-user", "sleep", "120"])
    try:
        deadline = time.monotonic() + 10
        while _ip("-o", "link", pid=proc.pid).count(": lo:") == 0:  # ours, not the host's
            if time.monotonic() > deadline:
                raise RuntimeError("the test namespace did not appear")
            time.sleep(0.02)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
async def links() -> AsyncIterator[Links]:
    lk = await Links.open()
    try:
        await lk.ensure_gateway(BRIDGE, GW)
        yield lk
    finally:
        await lk.delete(VETH)
        await lk.delete(BRIDGE)
        await lk.close()
        assert not _exists(VETH) and not _exists(BRIDGE)


async def test_attach_wires_both_ends(links: Links, netns_pid: int) -> None:
    seen: list[str] = []

    async def rules_in() -> None:
        # Called while the rules would be committed: the host end must still be down.
        seen.append(_ip("-o", "link", "show", VETH))

    await links.attach_veth(VETH, netns_pid, ADDR, GW, ready=rules_in())
    assert seen and "state DOWN" in seen[0] and ",UP" not in seen[0].split(">")[0]

    inside = _ip("-o", "-4", "addr", "show", "eth0", pid=netns_pid)
    assert f"inet {ADDR}/32" in inside
    assert "UP" in _ip("-o", "link", "show", "eth0", pid=netns_pid).split(">")[0]
    route = _ip("route", "show", "default", pid=netns_pid)
    assert f"default via {GW} dev eth0" in route and "onlink" in route
    assert "inet6" not in _ip("-o", "addr", "show", "eth0", pid=netns_pid)

    host = _ip("-o", "link", "show", VETH).split(">")[0]
    assert "UP" in host
    assert f"{ADDR} dev {VETH} scope link src {GW}" in _ip("route", "show", f"{ADDR}/32")
    with open(f"/proc/sys/net/ipv4/conf/{VETH}/forwarding") as f:
        assert f.read().strip() == "1"
    with open(f"/proc/sys/net/ipv6/conf/{VETH}/disable_ipv6") as f:
        assert f.read().strip() == "1"

    # The wire works: the namespace reaches a listener on the gateway address.
    with socket.create_server((GW, 0)) as srv:
        port = srv.getsockname()[1]
        code = f"import socket; socket.create_connection(({GW!r}, {port}), timeout=5).close()"
        r = subprocess.run(
            ["nsenter", "-t", str(netns_pid), "-n", sys.executable, "-c", code],
            capture_output=True,
            timeout=20,
        )
        assert r.returncode == 0, r.stderr


async def test_rules_failing_leaves_no_veth(links: Links, netns_pid: int) -> None:
    async def refused() -> None:
        await asyncio.sleep(0)
        raise HostError("nft refused it")

    with pytest.raises(HostError, match="nft refused it"):
        await links.attach_veth(VETH, netns_pid, ADDR, GW, ready=refused())
    assert not _exists(VETH)
    assert "eth0" not in _ip("-o", "link", pid=netns_pid)


async def test_kernel_refusal_is_reported_and_undone(links: Links, netns_pid: int) -> None:
    # The namespace already has an eth0 (the kernel refuses a second one)...
    _ip("link", "add", "eth0", "type", "veth", "peer", "name", "other0", pid=netns_pid)
    with pytest.raises(HostError, match=VETH):
        await links.attach_veth(VETH, netns_pid, ADDR, GW)
    assert not _exists(VETH)
    # ...and a second attach of a name that exists on the host is refused the same way.
    _ip("link", "del", "eth0", pid=netns_pid)
    await links.attach_veth(VETH, netns_pid, ADDR, GW)
    with pytest.raises(HostError, match=VETH):
        await links.attach_veth(VETH, netns_pid, "10.216.0.8", GW)
    assert _exists(VETH)  # the first one is untouched
