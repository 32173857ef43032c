"""Sandbox egress against real namespaces: default deny, named allowlists, live updates.

Test hosts (``tests/integration/nethosts.py``) live in their own network namespaces:
pkgs.test (a simple package index), npm.test, and a resolver knowing both. Only they,
the node's own gateway address and loopback are ever targeted.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from dnslib import DNSRecord  # type: ignore[import-untyped]

from corral.errors import CorralError, InvalidRequest
from corral.node import Node
from corral.node.network import veth_name
from corral.spec import Event, ExecRequest, Limits, NetworkPolicy, SandboxSpec
from tests.conftest import TAG
from tests.integration.conftest import node_config, open_node
from tests.integration.nethosts import DNS_IP, NPM_IP, PKGS_IP, TestHosts, network_config

STATE = Path(f"/var/lib/corral-test{TAG}-net")
RUN = Path(f"/run/corral-test{TAG}-net")
SUBTREE = f"corral-test{TAG}-net"
SMALL = Limits(memory="256MiB", disk="512MiB", pids=256)

FETCH = (
    "import sys, urllib.request\n"
    "try:\n"
    "    print(urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).read().decode())\n"
    "except Exception as e:\n"
    "    print('FAILED', type(e).__name__, e); sys.exit(3)\n"
)
CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(); s.settimeout(float(sys.argv[3]))\n"
    "try:\n"
    "    s.connect((sys.argv[1], int(sys.argv[2]))); print('CONNECTED')\n"
    "except Exception as e:\n"
    "    print('FAILED', type(e).__name__); sys.exit(3)\n"
)


def _cfg(**kw):  # type: ignore[no-untyped-def]
    return node_config(
        state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, network=network_config(**kw)
    )


def _table_exists() -> bool:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    return f"inet {SUBTREE}" in out


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def hosts():  # type: ignore[no-untyped-def]
    with TestHosts() as h:
        yield h


@pytest.fixture(scope="module")
async def net_node(images_ready, hosts):  # type: ignore[no-untyped-def]
    async with open_node(_cfg()) as n:
        dev = n.network.dev
        yield n
    assert not _table_exists(), "the node's nft table outlived it"
    assert not _link_exists(dev), "the node's gateway device outlived it"


async def _create(node: Node, allow: list[str], deny: list[str] | None = None) -> str:
    spec = SandboxSpec(
        image="test/debian", limits=SMALL, network=NetworkPolicy(allow=allow, deny=deny or [])
    )
    return (await node.sandbox_create(spec)).id


async def _py(node: Node, sid: str, script: str, *args: str, timeout: float = 30):  # type: ignore[no-untyped-def]
    return await node.exec(sid, ExecRequest(cmd=["python3", "-c", script, *args], timeout=timeout))


async def _fetch(node: Node, sid: str, url: str, timeout: float = 2.0) -> tuple[bool, str]:
    r = await _py(node, sid, FETCH, url, str(timeout))
    return r.ok, r.stdout.decode(errors="replace")


async def _connect(node: Node, sid: str, ip: str, port: int, timeout: float = 1.0) -> bool:
    r = await _py(node, sid, CONNECT, ip, str(port), str(timeout))
    return b"CONNECTED" in r.stdout


async def _events(node: Node, sid: str, kind: str, wait: float = 4.0) -> list[Event]:
    """Events of ``kind``; denials are read from the kernel twice a second."""
    deadline = time.monotonic() + wait
    while True:
        evs = [e for e in await node.events(sid) if e.kind == kind]
        if evs or time.monotonic() > deadline:
            return evs
        await asyncio.sleep(0.2)


async def test_default_is_no_network_at_all(net_node: Node) -> None:
    sid = await _create(net_node, [])
    try:
        r = await net_node.exec(sid, ExecRequest(cmd=["cat", "/proc/net/dev"]))
        ifaces = [ln.split(":")[0].strip() for ln in r.stdout.decode().splitlines()[2:]]
        assert ifaces == ["lo"]
        assert not _link_exists(veth_name(sid))
        assert (await net_node.sandbox_get(sid)).address is None
        ok, out = await _fetch(net_node, sid, "http://pkgs.test/simple/")
        assert not ok and "FAILED" in out
        assert not await _connect(net_node, sid, PKGS_IP, 80)
    finally:
        await net_node.sandbox_destroy(sid)


async def test_unknown_permission_is_refused(net_node: Node) -> None:
    with pytest.raises(InvalidRequest, match="unknown permission 'nope'.*pkgs"):
        await _create(net_node, ["nope"])
    assert not [i for i in await net_node.sandbox_list() if i.state == "creating"]


async def test_pip_installs_from_allowed_index_and_nothing_else(
    net_node: Node, hosts: TestHosts
) -> None:
    sid = await _create(net_node, ["pkgs"], deny=["npm"])
    try:
        info = await net_node.sandbox_get(sid)
        assert info.address and info.spec.network.allow == ["pkgs"]
        assert _link_exists(veth_name(sid))
        r = await net_node.exec(
            sid,
            ExecRequest(
                cmd=[
                    "python3", "-m", "pip", "install", "--no-cache-dir",
                    "--disable-pip-version-check", "--break-system-packages",
                    "--index-url", "http://pkgs.test/simple/", "--trusted-host", "pkgs.test",
                    "tinypkg",
                ],
                timeout=120,
            ),
        )  # fmt: skip
        assert r.ok, r.stdout.decode()[-2000:] + r.stderr.decode()[-2000:]
        r = await _py(net_node, sid, "import tinypkg; print(tinypkg.MARKER)")
        assert r.stdout == b"installed-from-pkgs-test\n"

        # npm.test: neither by name (NXDOMAIN from the node resolver) nor by address
        r = await _py(net_node, sid, "import socket; socket.gethostbyname('npm.test')")
        assert not r.ok and b"gaierror" in r.stderr
        ok, out = await _fetch(net_node, sid, f"http://{NPM_IP}/")
        assert not ok and "npm-test-secret" not in out
        dns = await _events(net_node, sid, "dns_denied")
        assert any(e.detail["name"] == "npm.test" for e in dns)
        denied = await _events(net_node, sid, "net_denied")
        assert any(e.detail["addr"] == NPM_IP and e.detail["port"] == 80 for e in denied)
        e = next(e for e in denied if e.detail["addr"] == NPM_IP)
        assert e.sandbox_id == sid and abs(float(e.detail["time"]) - time.time()) < 30  # type: ignore[arg-type]
        # an allowed name, but another port: not opened
        assert not await _connect(net_node, sid, PKGS_IP, 8080)
    finally:
        await net_node.sandbox_destroy(sid)
    assert not _link_exists(veth_name(sid))


async def test_no_node_ports_no_metadata_no_outside_resolver(
    net_node: Node, hosts: TestHosts
) -> None:
    gw = net_node.network.gateway
    # listeners on the node's own addresses, that a sandbox must not reach
    servers = []
    for ip in (gw, "10.250.1.1"):
        servers.append(await asyncio.start_server(lambda r, w: w.close(), ip, 18080))
    sid = await _create(net_node, ["pkgs"])
    try:
        assert (await _fetch(net_node, sid, "http://pkgs.test/simple/"))[0]  # the path works
        for ip, port in ((gw, 18080), ("10.250.1.1", 18080), (gw, 53), (gw, 22)):
            assert not await _connect(net_node, sid, ip, port), (ip, port)
        assert not await _connect(net_node, sid, "169.254.169.254", 80)
        # DNS straight to another resolver: dropped (it never sees the query)
        before = len(hosts.dns_queries())
        query = DNSRecord.question("pkgs.test").pack().hex()
        r = await _py(
            net_node,
            sid,
            "import socket, sys\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1.5)\n"
            "s.sendto(bytes.fromhex(sys.argv[1]), (sys.argv[2], 53))\n"
            "try:\n    s.recv(512); print('ANSWERED')\n"
            "except Exception as e:\n    print('FAILED', type(e).__name__)\n",
            query,
            DNS_IP,
        )
        assert b"FAILED" in r.stdout
        assert len(hosts.dns_queries()) == before
        denied = await _events(net_node, sid, "net_denied")
        seen = {(e.detail["addr"], e.detail.get("port")) for e in denied}
        for want in ((gw, 18080), ("10.250.1.1", 18080), ("169.254.169.254", 80), (DNS_IP, 53)):
            deadline = time.monotonic() + 30  # generous: the kernel log is read twice a second
            while want not in seen and time.monotonic() < deadline:
                await asyncio.sleep(0.3)
                denied = await _events(net_node, sid, "net_denied")
                seen = {(e.detail["addr"], e.detail.get("port")) for e in denied}
            assert want in seen, (want, seen)
    finally:
        for s in servers:
            s.close()
        await net_node.sandbox_destroy(sid)


async def test_sandboxes_cannot_reach_each_other(net_node: Node) -> None:
    a, b = await _create(net_node, ["pkgs"]), await _create(net_node, ["pkgs"])
    try:
        b_addr = (await net_node.sandbox_get(b)).address
        assert b_addr
        await net_node.spawn(
            b, ExecRequest(cmd=["python3", "-m", "http.server", "8000", "--bind", "0.0.0.0"])
        )
        # ready once the kernel lists the socket as listening (port 8000 = 0x1F40, state 0A)
        wait = "until grep -q ':1F40 00000000:0000 0A' /proc/net/tcp; do sleep 0.05; done"
        r = await net_node.exec(b, ExecRequest(cmd=["sh", "-c", wait], timeout=120))
        assert r.ok
        assert await _connect(net_node, b, "127.0.0.1", 8000)  # it listens
        assert not await _connect(net_node, a, b_addr, 8000)
        denied = await _events(net_node, a, "net_denied")
        assert any(e.detail["addr"] == b_addr for e in denied)
    finally:
        await net_node.sandbox_destroy(a)
        await net_node.sandbox_destroy(b)


async def test_cidr_permission_opens_an_address_without_dns(net_node: Node) -> None:
    sid = await _create(net_node, ["pkgsip"])
    try:
        ok, out = await _fetch(net_node, sid, f"http://{PKGS_IP}/simple/")
        assert ok and "tinypkg" in out
        r = await _py(net_node, sid, "import socket; socket.gethostbyname('pkgs.test')")
        assert not r.ok  # no host names in that permission
        assert not await _connect(net_node, sid, NPM_IP, 80)
    finally:
        await net_node.sandbox_destroy(sid)


async def test_live_update_grants_and_revokes(net_node: Node) -> None:
    sid = await _create(net_node, ["pkgs"])
    try:
        bg = await net_node.spawn(sid, ExecRequest(cmd=["sleep", "600"]))
        ok, _ = await _fetch(net_node, sid, "http://npm.test/")
        assert not ok
        # in effect on return (how fast is a bench figure: `corral bench network`,
        # policy_update_ms_*)
        info = await net_node.network_update(sid, allow=["pkgs", "npm"])
        assert info.spec.network.allow == ["pkgs", "npm"]
        ok, out = await _fetch(net_node, sid, "http://npm.test/")
        assert ok and "npm-test-secret" in out, out
        # revoke everything: the next connection fails, even to an address resolved before
        await net_node.network_update(sid, allow=[])
        assert (await net_node.sandbox_get(sid)).spec.network.allow == []
        assert not await _connect(net_node, sid, PKGS_IP, 80)
        assert not await _connect(net_node, sid, NPM_IP, 80)
        r = await _py(net_node, sid, "import socket; socket.gethostbyname('pkgs.test')")
        assert not r.ok
        # grant again: works, and the sandbox's processes were never disturbed
        await net_node.network_update(sid, allow=["pkgs"])
        ok, _ = await _fetch(net_node, sid, "http://pkgs.test/simple/")
        assert ok
        p = await net_node.process_get(sid, bg.id)
        assert p.running
        kinds = [e.kind for e in await net_node.events(sid)]
        assert kinds.count("network_updated") == 3
        with pytest.raises(InvalidRequest, match="unknown permission"):
            await net_node.network_update(sid, allow=["nope"])
    finally:
        await net_node.sandbox_destroy(sid)


async def test_grant_to_a_sandbox_created_without_network(net_node: Node) -> None:
    sid = await _create(net_node, [])
    try:
        assert not _link_exists(veth_name(sid))
        info = await net_node.network_update(sid, allow=["pkgs"])
        assert info.address and _link_exists(veth_name(sid))
        ok, out = await _fetch(net_node, sid, "http://pkgs.test/simple/")
        assert ok and "tinypkg" in out
    finally:
        await net_node.sandbox_destroy(sid)
    assert not _link_exists(veth_name(sid))


async def test_many_sandboxes_with_policies(net_node: Node) -> None:
    await _many(net_node, 16)


@pytest.mark.heavy
async def test_200_sandboxes_with_policies(net_node: Node) -> None:
    await _many(net_node, 200)


async def _many(node: Node, n: int) -> None:
    gate = asyncio.Semaphore(8)

    async def one(i: int) -> str:
        async with gate:
            return await _create(node, ["pkgs"] if i % 2 else ["npm"])

    ids = await asyncio.gather(*(one(i) for i in range(n)))
    try:
        addrs = {(await node.sandbox_get(s)).address for s in ids}
        assert len(addrs) == n and None not in addrs

        async def check(i: int, sid: str) -> tuple[bool, bool]:
            async with gate:
                good = "http://pkgs.test/simple/" if i % 2 else "http://npm.test/"
                bad = f"http://{NPM_IP}/" if i % 2 else f"http://{PKGS_IP}/simple/"
                return (await _fetch(node, sid, good, 5))[0], (await _fetch(node, sid, bad, 1))[0]

        results = await asyncio.gather(*(check(i, s) for i, s in enumerate(ids)))
        assert all(good for good, _ in results), results
        assert not any(bad for _, bad in results), results
    finally:
        await asyncio.gather(*(node.sandbox_destroy(s) for s in ids))
    assert not any(_link_exists(veth_name(s)) for s in ids)


async def test_restart_adopts_the_network_and_close_removes_it(
    net_node: Node, hosts: TestHosts
) -> None:
    """A second node on its own state dir: close with a live sandbox keeps its network,
    the next open adopts it; destroy + close remove every trace."""
    state, run, sub = Path(f"{STATE}2"), Path(f"{RUN}2"), f"{SUBTREE}2"
    cfg = node_config(
        state_dir=state,
        run_dir=run,
        cgroup_subtree=sub,
        network=network_config(subnet="10.212.8.0/24"),
    )
    node = await Node.open(cfg)
    dev = node.network.dev
    try:
        sid = await _create(node, ["pkgs"])
        ok, _ = await _fetch(node, sid, "http://pkgs.test/simple/")
        assert ok
    finally:
        await node.close()
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert f"inet {sub}" in tables and _link_exists(veth_name(sid))
    node = await Node.open(cfg)
    try:
        ok, _ = await _fetch(node, sid, "http://pkgs.test/simple/")
        assert ok, "the adopted sandbox lost its network"
        assert not await _connect(node, sid, NPM_IP, 80)
        await node.network_update(sid, allow=["npm"])
        ok, _ = await _fetch(node, sid, "http://npm.test/")
        assert ok
        await node.sandbox_destroy(sid)
    finally:
        await node.close()
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert f"inet {sub}" not in tables
    assert not _link_exists(dev) and not _link_exists(veth_name(sid))
    shutil.rmtree(run, ignore_errors=True)


async def test_gc_removes_the_network_of_a_lost_sandbox(net_node: Node) -> None:
    sid = await _create(net_node, ["pkgs"])
    # forget it as a crash would; gc kills what it does not know and drops its network
    net_node.table.remove(sid)
    removed = await net_node.gc()
    assert removed["networks"] == 1
    assert not _link_exists(veth_name(sid))
    assert not _table_exists()  # nothing else of the node needed it


async def test_forged_source_addresses_are_dropped(net_node: Node) -> None:
    """The guest cannot change its address (no CAP_NET_ADMIN); if it could, a forged
    source (another sandbox's address) must still not reach the resolver or the outside:
    the sandbox is identified by its veth. Simulated from the host with ip(8) inside the
    sandbox's network namespace."""
    a, b = await _create(net_node, ["pkgs"]), await _create(net_node, ["npm"])
    try:
        pid = (await net_node.sandbox_get(a)).pid
        b_addr = (await net_node.sandbox_get(b)).address
        assert pid and b_addr
        subprocess.run(
            ["nsenter", "-t", str(pid), "-n", "ip", "addr", "add", f"{b_addr}/32", "dev", "eth0"],
            check=True,
        )
        # npm.test is allowed for b, not for a: asked with b's address from a's veth
        query = DNSRecord.question("npm.test").pack().hex()
        r = await _py(
            net_node,
            a,
            "import socket, sys\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1.5)\n"
            "s.bind((sys.argv[3], 0))\n"
            "s.sendto(bytes.fromhex(sys.argv[1]), (sys.argv[2], 53))\n"
            "try:\n    s.recv(512); print('ANSWERED')\n"
            "except Exception as e:\n    print('FAILED', type(e).__name__)\n",
            query,
            net_node.network.gateway,
            b_addr,
        )
        assert b"FAILED" in r.stdout, r.stdout
        # had the resolver taken the forged query for b's, it would have opened npm.test's
        # address for b: b's DNS set is still empty
        assert net_node.network.snapshot(b)["d"] == []
        # and b's own lookups still work
        ok, out = await _fetch(net_node, b, "http://npm.test/")
        assert ok and "npm-test-secret" in out
    finally:
        await net_node.sandbox_destroy(a)
        await net_node.sandbox_destroy(b)


async def test_a_foreign_forward_drop_policy_is_reported(net_node: Node) -> None:
    """corral never edits other tables; it names the one that will drop its traffic."""
    table = f"corral-test{TAG}-foreign"
    sid = await _create(net_node, ["pkgs"])  # the network is up
    subprocess.run(
        ["nft", "add table ip " + table + " ; add chain ip " + table
         + " fwdchain { type filter hook forward priority 0 ; policy drop ; }"],
        check=True,
    )  # fmt: skip
    try:
        assert f"ip {table} fwdchain" in net_node.network.foreign_forward_drops()
    finally:
        subprocess.run(["nft", "delete", "table", "ip", table], check=True)
        await net_node.sandbox_destroy(sid)
    assert f"ip {table} fwdchain" not in net_node.network.foreign_forward_drops()


HOLD = (
    "import os, socket, sys, time\n"
    "s = socket.create_connection(('npm.test', 80), timeout=5)\n"
    "open('/tmp/held', 'w').close()\n"
    "while not os.path.exists('/tmp/go'):\n"
    "    time.sleep(0.02)\n"
    "s.settimeout(3)\n"
    "try:\n"
    "    s.sendall(b'GET / HTTP/1.0\\r\\nHost: npm.test\\r\\n\\r\\n')\n"
    "    print('GOT' if b'npm-test-secret' in s.recv(65536) + s.recv(65536) else 'EMPTY')\n"
    "except OSError as e:\n"
    "    print('NONE', type(e).__name__)\n"
)


@pytest.mark.parametrize("revoke", [False, True])
async def test_open_connections_follow_the_policy(net_node: Node, revoke: bool) -> None:
    """A connection opened while npm was allowed keeps working when an update keeps npm
    (the process is not disturbed) and stops when npm is revoked."""
    sid = await _create(net_node, ["pkgs", "npm"])
    try:
        p = await net_node.spawn(sid, ExecRequest(cmd=["python3", "-c", HOLD]))
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(CorralError):
                await net_node.file_stat(sid, "/tmp/held")
                break
            assert time.monotonic() < deadline, "the connection was not opened"
            await asyncio.sleep(0.05)
        await net_node.network_update(sid, allow=["pkgs"] if revoke else ["pkgs", "npm", "pkgsip"])
        await net_node.file_write(sid, "/tmp/go", b"")
        r = await net_node.process_get(sid, p.id, wait=20)
        assert r.result is not None
        out = r.result.stdout.decode() or r.stdout.decode()
        assert ("NONE" in out) if revoke else ("GOT" in out), out
    finally:
        await net_node.sandbox_destroy(sid)
