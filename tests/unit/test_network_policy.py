"""Network policy: permission config, compile, and the SDK/API/CLI path (FakeNode)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from pydantic import ValidationError

import corral
from corral.errors import InvalidRequest
from corral.node import NodeConfig
from corral.policy.network import Compiled, NetworkConfig, Permission, match_host
from corral.testing import FakeNode
from tests.unit.test_cli import cli, fake  # noqa: F401 - fixtures
from tests.unit.test_sdk import client, short_dir, sync_client  # noqa: F401 - fixtures


def _cfg() -> NetworkConfig:
    return NetworkConfig(
        permissions={
            "pypi": Permission(hosts=["pkgs.test", "*.pkgs.test"], ports=[80, "8000-8010"]),
            "npm": Permission(hosts=["npm.test", "cdn.pkgs.test"], protocols=["tcp", "udp"]),
            "mirror": Permission(cidrs=["10.9.8.7", "10.1.0.0/16"], ports=["1-65535"]),
        }
    )


def test_host_patterns() -> None:
    assert match_host("pkgs.test", "pkgs.test")
    assert not match_host("pkgs.test", "x.pkgs.test")
    assert match_host("*.pkgs.test", "a.b.pkgs.test")
    assert not match_host("*.pkgs.test", "pkgs.test")
    assert not match_host("*.pkgs.test", "evilpkgs.test")


def test_compile_allow_deny_ports_and_cidrs() -> None:
    c = Compiled.build(_cfg(), ["pypi", "mirror"], ["npm"])
    assert c.any
    assert c.ports_for("PKGS.test.") == [("tcp", "80"), ("tcp", "8000-8010")]
    assert c.ports_for("files.pkgs.test") is not None
    assert c.ports_for("cdn.pkgs.test") is None  # matched by the denied permission: refused
    assert c.ports_for("npm.test") is None
    assert c.ports_for("other.test") is None
    assert sorted(n for n, _ in c.cidrs) == ["10.1.0.0/16", "10.9.8.7/32"]
    assert not Compiled.build(_cfg(), [], []).any
    assert not Compiled.build(_cfg(), ["npm"], ["npm"]).any  # deny wins
    with pytest.raises(InvalidRequest, match=r"unknown permission 'pip'.*mirror, npm, pypi"):
        Compiled.build(_cfg(), ["pip"], [])


def test_bad_operator_config_names_the_field() -> None:
    for bad, word in (
        ({"hosts": ["not a name"]}, "host"),
        ({"cidrs": ["10.0.0.0/33"]}, "cidr"),
        ({"ports": [0]}, "port"),
        ({"ports": ["80-70"]}, "port"),
        ({"ports": []}, "ports"),
        ({"protocols": ["icmp"]}, "protocols"),
    ):
        with pytest.raises(ValidationError, match=word):
            Permission(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="subnet"):
        NetworkConfig(subnet="10.0.0.1/16")


def test_node_config_from_toml(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "node.toml"
    p.write_text(
        "[node]\nstate_dir = '/tmp/x'\n"
        "[node.network]\nsubnet = '10.77.0.0/20'\nupstream = ['10.0.0.53:5353']\n"
        "[node.network.permissions.pypi]\nhosts = ['pkgs.test']\nports = [443]\n"
    )
    cfg = NodeConfig.from_toml(p)
    assert cfg.network.gateway == "10.77.0.1"
    assert cfg.network.upstream_servers() == [("10.0.0.53", 5353)]
    assert cfg.network.permissions["pypi"].services() == [("tcp", "443")]


def test_policy_model_validates_names() -> None:
    with pytest.raises(ValidationError, match="permission name"):
        corral.NetworkPolicy(allow=["no spaces"])
    assert corral.NetworkPolicy(allow=["a", "a"]).allow == ["a"]


async def test_create_and_update_through_every_transport(client: corral.AsyncClient) -> None:  # noqa: F811
    sb = await client.sandboxes.create(
        image="demo/python", network=corral.NetworkPolicy(allow=["pkgs"], deny=["npm"])
    )
    assert sb.info.spec.network.allow == ["pkgs"]
    policy = await sb.network.update(allow=["pkgs", "npm"])
    assert policy.allow == ["pkgs", "npm"] and policy.deny == ["npm"]  # deny kept
    assert sb.info.spec.network.allow == ["pkgs", "npm"]
    assert (await sb.network.update(allow=[], deny=[])).allow == []
    assert (await sb.refresh()).spec.network.allow == []
    assert (await sb.network.policy()).deny == []
    with pytest.raises(corral.InvalidRequest, match="unknown permission 'nope'"):
        await sb.network.update(allow=["nope"])
    with pytest.raises(corral.InvalidRequest, match="unknown permission"):
        await client.sandboxes.create(image="demo/python", network={"allow": ["nope"]})
    with pytest.raises(corral.InvalidRequest, match="permission name"):
        await sb.network.update(allow=["bad name"])


def test_sync_client_network(sync_client: corral.Client) -> None:  # noqa: F811
    sb = sync_client.sandboxes.create(image="demo/python", network={"allow": ["pkgs"]})
    assert sb.network.update(allow=["npm"]).allow == ["npm"]
    assert sb.refresh().spec.network.allow == ["npm"]


def test_cli_allow_and_network_command(fake: FakeNode) -> None:  # noqa: F811
    r = cli("sandbox", "create", "demo/python", "--allow", "pkgs", "--deny", "npm")
    assert r.exit_code == 0, r.stderr
    sid = r.stdout.strip()
    r = cli("sandbox", "network", sid)
    assert r.exit_code == 0 and "allow: pkgs" in r.stdout and "deny: npm" in r.stdout
    r = cli("sandbox", "network", sid, "--allow", "pkgs", "--allow", "npm", "--deny", "", "--json")
    assert r.exit_code == 2  # an empty name is refused, with a clear error
    assert "permission name" in r.stderr
    r = cli("sandbox", "network", sid, "--allow", "npm", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["allow"] == ["npm"]
    r = cli("sandbox", "network", sid, "--none")
    assert r.exit_code == 0 and "allow: -" in r.stdout
    r = cli("sandbox", "create", "demo/python", "--allow", "nope")
    assert r.exit_code == 2 and "unknown permission" in r.stderr


# ------------------------------------------------------------------ the node resolver
class _Policy:
    def __init__(self) -> None:
        self.admitted: list[tuple[str, str, list[tuple[str, int]]]] = []
        self.refused: list[tuple[str, str, str]] = []

    def allowed(self, source: str, name: str) -> bool:
        return name in ("ok.test", "big.test")

    async def admit(self, source: str, name: str, addrs: list[tuple[str, int]]) -> None:
        self.admitted.append((source, name, addrs))

    def denied(self, source: str, name: str, qtype: str) -> None:
        self.refused.append((source, name, qtype))


def _upstream() -> tuple[socket.socket, threading.Thread]:
    """A tiny upstream on loopback: ok.test -> 10.1.1.1, big.test -> 60 addresses."""
    from dnslib import RR, A, DNSRecord

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                data, addr = s.recvfrom(4096)
            except OSError:
                return
            q = DNSRecord.parse(data)
            r = q.reply()
            name = str(q.q.qname).rstrip(".")
            n = 60 if name == "big.test" else 1
            for i in range(n):
                r.add_answer(RR(q.q.qname, 1, rdata=A(f"10.1.{i}.1"), ttl=7))
            s.sendto(r.pack(), addr)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return s, t


async def _ask(addr: tuple[str, int], name: str, qtype: str = "A"):  # type: ignore[no-untyped-def]
    from dnslib import DNSRecord

    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    try:
        await loop.sock_connect(s, addr)
        await loop.sock_sendall(s, DNSRecord.question(name, qtype).pack())
        async with asyncio.timeout(5):
            return DNSRecord.parse(await loop.sock_recv(s, 65535))
    finally:
        s.close()


async def test_resolver_answers_only_allowed_names() -> None:
    from dnslib import QTYPE, RCODE

    from corral.node.resolver import Resolver

    up, _ = _upstream()
    policy = _Policy()
    res = Resolver(("127.0.0.1", 0), [up.getsockname()], policy)
    await res.start()
    try:
        r = await _ask(res.address, "ok.test")
        assert r.header.rcode == RCODE.NOERROR and [str(x.rdata) for x in r.rr] == ["10.1.0.1"]
        assert policy.admitted == [("127.0.0.1", "ok.test", [("10.1.0.1", 7)])]
        r = await _ask(res.address, "evil.test")
        assert r.header.rcode == RCODE.NXDOMAIN and not r.rr
        assert policy.refused == [("127.0.0.1", "evil.test", "A")]
        r = await _ask(res.address, "ok.test", "AAAA")  # IPv4 only: empty, not an error
        assert r.header.rcode == RCODE.NOERROR and not r.rr
        r = await _ask(res.address, "big.test")  # 60 records do not fit 512 bytes
        assert 0 < len(r.rr) < 60 and not r.header.tc and len(r.pack()) <= 512
        assert len(policy.admitted[-1][2]) == len(r.rr)  # only what was answered is opened
        assert all(x.rtype == QTYPE.A for x in r.rr)
    finally:
        await res.close()
        up.close()
