"""Named network permissions: operator configuration and what a sandbox's policy means.

The operator defines permissions by name in the node config (nothing is built in)::

    [node.network.permissions.pypi]
    hosts = ["pkgs.test", "*.pkgs.test"]    # exact names; "*." = any name below
    ports = [80, 443]                        # or "8000-8100"
    protocols = ["tcp"]

    [node.network.permissions.mirror]
    cidrs = ["10.250.3.0/24"]
    ports = ["1-65535"]

A sandbox asks for names (``NetworkPolicy(allow=["pypi"], deny=["npm"])``).
:class:`Compiled` turns that into what the node enforces: which DNS names its resolver
answers (with the protocols/ports their addresses are opened for) and which address ranges
are open without DNS. A name matched by a denied permission is refused even when an
allowed one matches it too.

Example:
    >>> cfg = NetworkConfig(permissions={"pkgs": Permission(hosts=["*.pkgs.test"])})
    >>> c = Compiled.build(cfg, ["pkgs"], [])
    >>> c.ports_for("files.pkgs.test"), c.ports_for("pkgs.test")
    ([('tcp', '80'), ('tcp', '443')], None)
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from corral.errors import InvalidRequest

__all__ = ["Permission", "NetworkConfig", "Compiled", "normalize_name", "match_host"]

_HOST_RE = re.compile(r"^(\*\.)?([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_-]{1,63}$")
_PORTS_RE = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?$")


class Permission(BaseModel):
    """One named permission: host names and/or address ranges, on some ports."""

    model_config = ConfigDict(extra="forbid")

    hosts: list[str] = Field(default_factory=list)
    """DNS names the node resolver answers: ``pkgs.test``, or ``*.example.test`` for any
    name below example.test (not example.test itself)."""
    cidrs: list[str] = Field(default_factory=list)
    """Address ranges open without DNS (IPv4), e.g. ``10.250.3.0/24`` or ``10.1.2.3``."""
    ports: list[int | str] = Field(default_factory=lambda: list[int | str]([80, 443]))
    """Destination ports: numbers or ``"low-high"`` ranges."""
    protocols: list[Literal["tcp", "udp"]] = Field(
        default_factory=lambda: list[Literal["tcp", "udp"]](["tcp"])
    )

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        out = []
        for h in v:
            n = normalize_name(h)
            if not _HOST_RE.match(n) or len(n) > 253:
                raise ValueError(f"host {h!r} is not a DNS name (or *.name)")
            out.append(n)
        return out

    @field_validator("cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        out = []
        for c in v:
            try:
                net = ipaddress.IPv4Network(c, strict=False)
            except ValueError:
                raise ValueError(f"cidr {c!r} is not an IPv4 address or network") from None
            out.append(str(net))
        return out

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int | str]) -> list[int | str]:
        if not v:
            raise ValueError("ports: at least one port or range (e.g. 443, '1-65535')")
        for p in v:
            lo, hi = _port_range(p)
            if not 1 <= lo <= hi <= 65535:
                raise ValueError(f"port {p!r} must be 1-65535 (a range low-high)")
        return v

    @field_validator("protocols")
    @classmethod
    def _protocols(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("protocols: at least one of tcp, udp")
        return v

    def services(self) -> list[tuple[str, str]]:
        """(protocol, port or ``lo-hi``) pairs, as nft set fields."""
        out: list[tuple[str, str]] = []
        for proto in self.protocols:
            for p in self.ports:
                lo, hi = _port_range(p)
                out.append((proto, str(lo) if lo == hi else f"{lo}-{hi}"))
        return out


def _port_range(p: int | str) -> tuple[int, int]:
    if isinstance(p, bool):
        return (0, 0)
    if isinstance(p, int):
        return (p, p)
    m = _PORTS_RE.match(p.strip())
    if not m:
        return (0, 0)
    lo = int(m.group(1))
    return (lo, int(m.group(2) or lo))


class NetworkConfig(BaseModel):
    """``[node.network]``: the node's sandbox network and its named permissions."""

    model_config = ConfigDict(extra="forbid")

    subnet: str = "10.213.0.0/16"
    """Private IPv4 range for sandbox addresses; its first address is the node's gateway
    and resolver. Must not overlap the networks the node reaches."""
    upstream: list[str] = Field(default_factory=list)
    """Resolvers the node forwards allowed lookups to (``addr`` or ``addr:port``); default:
    the nameservers of the host's /etc/resolv.conf."""
    permissions: dict[str, Permission] = Field(default_factory=dict)
    """Named permissions sandboxes may ask for (``allow=["pypi"]``)."""
    min_ttl: int = Field(30, ge=1, le=86400)
    """Shortest time an address handed out by the resolver stays open (a DNS TTL of 0
    would close it before the connection is made)."""
    max_ttl: int = Field(3600, ge=1, le=7 * 86400)
    """Longest time an address stays open after its lookup, whatever the TTL."""
    uplinks: list[str] | None = None
    """Host interfaces on which the node enables IPv4 forwarding for return traffic;
    default: those of the host's default routes. ``[]``: leave them as they are."""
    deny_window: float = Field(5.0, gt=0, le=3600)
    """Repeats of one denied (sandbox, address, port) within this many seconds are one
    event; this bounds the event rate a sandbox can cause."""

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, v: str) -> str:
        try:
            net = ipaddress.IPv4Network(v, strict=True)
        except ValueError as e:
            raise ValueError(f"subnet {v!r}: {e}") from None
        if not 8 <= net.prefixlen <= 28:
            raise ValueError("subnet: prefix length must be between /8 and /28")
        return str(net)

    @field_validator("permissions")
    @classmethod
    def _names(cls, v: dict[str, Permission]) -> dict[str, Permission]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise ValueError(f"permission name {name!r} must be 1-64 of [A-Za-z0-9_.-]")
        return v

    @property
    def gateway(self) -> str:
        return str(ipaddress.IPv4Network(self.subnet)[1])

    def upstream_servers(self) -> list[tuple[str, int]]:
        """The upstream resolvers as (address, port)."""
        items = self.upstream or _host_nameservers()
        out = []
        for s in items:
            host, _, port = s.rpartition(":") if s.count(":") == 1 else (s, "", "53")
            out.append((host or s, int(port or 53)))
        return out


def _host_nameservers() -> list[str]:
    try:
        with open("/etc/resolv.conf") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines:
        parts = ln.split()
        if len(parts) >= 2 and parts[0] == "nameserver" and ":" not in parts[1]:
            out.append(parts[1])
    return out


def normalize_name(name: str) -> str:
    """Lower case, without the root dot: the form names are compared in."""
    return name.strip().rstrip(".").lower()


def match_host(pattern: str, name: str) -> bool:
    """``pattern`` (``a.test`` or ``*.a.test``) matches the normalized ``name``."""
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern


@dataclass
class Compiled:
    """A sandbox's policy resolved against the node's permissions."""

    allow: list[str]
    deny: list[str]
    hosts: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)
    """(host pattern, services) of the allowed permissions."""
    denied_hosts: list[str] = field(default_factory=list)
    cidrs: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: NetworkConfig, allow: Sequence[str], deny: Sequence[str]) -> Compiled:
        """Check the names and compile; an unknown name is an InvalidRequest."""
        unknown = [n for n in [*allow, *deny] if n not in cfg.permissions]
        if unknown:
            known = ", ".join(sorted(cfg.permissions)) or "none are configured"
            raise InvalidRequest(
                f"network: unknown permission {', '.join(map(repr, unknown))} "
                f"(this node's permissions: {known})"
            )
        c = cls(allow=list(dict.fromkeys(allow)), deny=list(dict.fromkeys(deny)))
        for name in c.deny:
            c.denied_hosts.extend(cfg.permissions[name].hosts)
        for name in c.allow:
            if name in c.deny:
                continue
            perm = cfg.permissions[name]
            svc = perm.services()
            c.hosts.extend((h, svc) for h in perm.hosts)
            c.cidrs.extend((net, svc) for net in perm.cidrs)
        return c

    @property
    def any(self) -> bool:
        """Whether the sandbox may reach anything at all (else it gets no interface)."""
        return bool(self.hosts or self.cidrs)

    def ports_for(self, name: str) -> list[tuple[str, str]] | None:
        """Services the addresses of ``name`` are opened for, or None if it is refused."""
        n = normalize_name(name)
        if any(match_host(p, n) for p in self.denied_hosts):
            return None
        out: list[tuple[str, str]] = []
        for pattern, svc in self.hosts:
            if match_host(pattern, n):
                out.extend(s for s in svc if s not in out)
        return out or None
