"""The nftables text of the node's sandbox network (see corral.node.network for the
design): the base table and one sandbox's sets, chain and elements, as pure functions of
their inputs so that the text can be read and tested on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from corral.policy.network import Compiled
from corral.spec import sandbox_local

__all__ = [
    "SbNet",
    "admit_commands",
    "base_table",
    "key",
    "new_mark",
    "sandbox_batch",
    "veth_name",
]

_MAX_ANSWER_ADDRS = 32


def veth_name(sandbox_id: str) -> str:
    """Host-side veth of a sandbox (IFNAMSIZ is 16 with the NUL: 'cv' + the id's 12-char
    local part, unique per host whichever node of the host owns it)."""
    return "cv" + sandbox_local(sandbox_id)


def key(sandbox_id: str) -> str:
    """The sandbox's key in the node's nft sets and maps (the id's local part)."""
    return sandbox_local(sandbox_id)


@dataclass
class SbNet:
    sid: str
    address: str
    policy: Compiled
    mark: int
    handed: dict[str, tuple[float, set[str]]] = field(default_factory=dict)
    """address -> (expiry, names it was handed out for)."""


def base_table(t: str, gw: str, net: str, w: str) -> str:
    """The base table ``t`` (gateway ``gw``, subnet ``net``, denial window ``w``)."""
    return f"""
add table inet {t}
add set inet {t} veths {{ type ifname; }}
add set inet {t} ifaddr {{ type ifname . ipv4_addr; }}
add set inet {t} denied {{ type ipv4_addr . ipv4_addr . inet_proto . inet_service; flags dynamic,timeout; timeout {w}; size 65536; }}
add set inet {t} denied_other {{ type ipv4_addr . ipv4_addr . inet_proto; flags dynamic,timeout; timeout {w}; size 16384; }}
add map inet {t} out {{ type ifname : verdict; }}
add chain inet {t} guard
add chain inet {t} deny
add chain inet {t} sb_input
add chain inet {t} sb_forward
add chain inet {t} pre {{ type filter hook prerouting priority -300; policy accept; }}
add chain inet {t} input {{ type filter hook input priority -5; policy accept; }}
add chain inet {t} forward {{ type filter hook forward priority -5; policy accept; }}
add chain inet {t} post {{ type nat hook postrouting priority srcnat; policy accept; }}
flush map inet {t} out
flush set inet {t} veths
flush set inet {t} ifaddr
flush chain inet {t} guard
flush chain inet {t} deny
flush chain inet {t} sb_input
flush chain inet {t} sb_forward
flush chain inet {t} pre
flush chain inet {t} input
flush chain inet {t} forward
flush chain inet {t} post
add rule inet {t} pre iifname @veths jump guard
add rule inet {t} guard meta nfproto ipv6 counter drop
add rule inet {t} guard iifname . ip saddr @ifaddr return
add rule inet {t} guard counter drop
add rule inet {t} deny meta l4proto {{ tcp, udp }} add @denied {{ ip saddr . ip daddr . meta l4proto . th dport }} counter drop
add rule inet {t} deny add @denied_other {{ ip saddr . ip daddr . meta l4proto }} counter drop
add rule inet {t} input iifname @veths jump sb_input
add rule inet {t} sb_input ip daddr {gw} udp dport 53 accept
add rule inet {t} sb_input goto deny
add rule inet {t} forward iifname @veths jump sb_forward
add rule inet {t} forward oifname @veths ct state established,related accept
add rule inet {t} forward oifname @veths counter drop
add rule inet {t} sb_forward ip daddr {{ {net}, 0.0.0.0/8, 127.0.0.0/8, 169.254.0.0/16, 224.0.0.0/3 }} goto deny
add rule inet {t} sb_forward iifname vmap @out
add rule inet {t} sb_forward goto deny
add rule inet {t} post ip saddr {net} oifname != @veths masquerade
"""


def sandbox_batch(t: str, sb: SbNet, create: bool, rules: bool = True) -> str:
    """nft commands that make the kernel match ``sb`` (its sets, chain, elements)."""
    k, v = key(sb.sid), veth_name(sb.sid)
    lines = []
    if create:
        lines += [
            f"add set inet {t} n_{k} {{ type ipv4_addr . inet_proto . inet_service; "
            "flags interval; auto-merge; }",
            f"add set inet {t} d_{k} {{ type ipv4_addr . inet_proto . inet_service; "
            "flags timeout; size 65536; }",
            f"add chain inet {t} s_{k}",
        ]
    if create or rules:
        m = sb.mark
        lines += [
            f"flush chain inet {t} s_{k}",
            f"add rule inet {t} s_{k} ct state established,related ct mark {m} accept",
            f"add rule inet {t} s_{k} ip daddr . meta l4proto . th dport @n_{k} "
            f"ct mark set {m} accept",
            f"add rule inet {t} s_{k} ip daddr . meta l4proto . th dport @d_{k} "
            f"ct mark set {m} accept",
            f"add rule inet {t} s_{k} goto deny",
        ]
    if create:
        lines += [
            f"add element inet {t} veths {{ {v} }}",
            f"add element inet {t} ifaddr {{ {v} . {sb.address} }}",
            f"add element inet {t} out {{ {v} : jump s_{k} }}",
        ]
    # Static entries, replaced whole.
    lines.append(f"flush set inet {t} n_{k}")
    static = sorted({f"{net} . {p} . {port}" for net, svc in sb.policy.cidrs for p, port in svc})
    if static:
        lines.append(f"add element inet {t} n_{k} {{ {', '.join(static)} }}")
    # Addresses handed out by the resolver: kept for names still allowed, with the
    # time they have left, opened for the ports the new policy gives those names.
    if not create:
        lines.append(f"flush set inet {t} d_{k}")
        now = time.monotonic()
        dyn = []
        for ip, (exp, names) in list(sb.handed.items()):
            left = int(exp - now)
            svc = {s for n in names for s in (sb.policy.ports_for(n) or [])}
            if left < 1 or not svc:
                del sb.handed[ip]
                continue
            dyn += [f"{ip} . {p} . {port} timeout {left}s" for p, port in sorted(svc)]
        if dyn:
            lines.append(f"add element inet {t} d_{k} {{ {', '.join(dyn)} }}")
    return "\n".join(lines)


def admit_commands(
    t: str, sb: SbNet, name: str, addrs: list[tuple[str, int]], min_ttl: int, max_ttl: int
) -> list[str]:
    """nft commands that open the ports ``name`` grants to the addresses the resolver just
    handed ``sb`` (each with the answer's TTL, clamped), and record them in ``sb.handed``."""
    services = sb.policy.ports_for(name) or []
    now = time.monotonic()
    if len(sb.handed) > 4096:  # bounded memory: forget what the kernel has expired
        sb.handed = {ip: v for ip, v in sb.handed.items() if v[0] > now}
    cmds = []
    set_name = f"d_{key(sb.sid)}"
    for ip, ttl in addrs[:_MAX_ANSWER_ADDRS]:
        ttl = max(min_ttl, min(max_ttl, ttl))
        exp, names = sb.handed.get(ip, (0.0, set()))
        names.add(name)
        sb.handed[ip] = (max(exp, now + ttl), names)
        for proto, port in services:
            e = f"{ip} . {proto} . {port}"
            # add (no-op if present), delete, add again: one transaction that leaves
            # exactly one element with the new timeout, present or not before.
            cmds.append(f"add element inet {t} {set_name} {{ {e} timeout 1s }}")
            cmds.append(f"delete element inet {t} {set_name} {{ {e} }}")
            cmds.append(f"add element inet {t} {set_name} {{ {e} timeout {ttl}s }}")
    return cmds


_mark_counter = [0]


def new_mark() -> int:
    """A connection mark no earlier policy of any sandbox on this host used."""
    _mark_counter[0] += 1
    return ((int(time.time()) & 0xFFFF) << 15 | (_mark_counter[0] & 0x7FFF)) or 1
