"""Sandbox egress: default deny, named allowlists that change on a live sandbox.

A sandbox with no allowance keeps the loopback-only namespace its runtime made: no
interface, no route, no DNS. A sandbox with one gets, after start, a veth pair into its
namespace (``host/netlink.py``): ``eth0`` with an address of the node subnet and a default
route to the node's gateway address (on a port-less bridge), where the node resolver
(``node/resolver.py``) listens. Routed, no bridge: no L2 path between sandboxes.

All filtering is in the node's own nftables table (``inet <cgroup_subtree>``; it never
relies on other tables' policies, and removes itself on teardown):

* ``guard`` (prerouting): packets from a sandbox veth must carry that veth's address
  (``ifaddr`` set), IPv6 is dropped: the source address identifies the sandbox.
* ``sb_input``: a sandbox may reach exactly one port of the node, the resolver (UDP 53
  on the gateway); every other node address and port is dropped.
* ``sb_forward``: other sandboxes, link-local (cloud metadata), multicast: dropped; then
  the sandbox's own chain ``s_<id>`` admits destination . protocol . port found in its
  static set ``n_<id>`` (CIDRs from the policy) or its DNS set ``d_<id>`` (addresses the
  resolver handed to *this* sandbox, each with a timeout from the answer's TTL).
  Admitted flows get the sandbox's connection mark; a policy change that revokes something
  bumps the mark, so established flows to revoked destinations stop too.
* ``post`` (nat): masquerade what leaves.
* every drop goes through ``deny``, which adds (sandbox, address, protocol, port) to a
  dynamic timeout set; the node lists it twice a second and turns new entries into
  ``net_denied`` events. Bounded: one entry (one event) per tuple per ``deny_window``,
  at most 65536 entries; refused DNS lookups are ``dns_denied`` events, deduplicated the
  same way.

A policy update is one nft transaction (~1 ms), applied while the sandbox runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from corral.errors import CapacityError, HostError
from corral.host.netlink import Links
from corral.host.nft import Nft, NftError
from corral.node import uplinks
from corral.node.netrules import (
    SbNet,
    admit_commands,
    base_table,
    key,
    new_mark,
    sandbox_batch,
    veth_name,
)
from corral.node.resolver import Resolver
from corral.policy.network import Compiled, NetworkConfig
from corral.spec import NetworkPolicy

__all__ = ["NodeNetwork", "veth_name"]

log = logging.getLogger("corral.network")

EventSink = Callable[[str | None, str, dict[str, Any]], object]

_POLL_INTERVAL = 0.5


class NodeNetwork:
    """The node's sandbox network. Created cheaply; kernel objects appear on first use."""

    def __init__(
        self, cfg: NetworkConfig, subtree: str, state_dir: Path, add_event: EventSink
    ) -> None:
        self.cfg = cfg
        self.table = subtree
        self.dev = "cn" + hashlib.sha256(subtree.encode()).hexdigest()[:10]
        self.net = ipaddress.IPv4Network(cfg.subnet)
        self.gateway = cfg.gateway
        self.dir = state_dir / "net"
        self._add_event = add_event
        self._nft: Nft | None = None
        # The node's one libnftables context, made now while the node holds few fds
        # (host/nft.py, FD_SETSIZE): a context made after ~500 sandboxes could not be.
        # Also without permissions: gc and close remove an earlier run's table with it.
        self._ctx: Nft | None = None
        try:
            self._ctx = Nft()
        except HostError as e:  # made (or refused, clearly) on first use instead
            log.warning("network: %s", e.message)
        self._links: Links | None = None
        self._resolver: Resolver | None = None
        self._poller: asyncio.Task[None] | None = None
        self._sb: dict[str, SbNet] = {}
        self._by_addr: dict[str, str] = {}
        self._denied_seen: dict[tuple[Any, ...], float] = {}
        self._dns_seen: dict[tuple[str, str], float] = {}
        self._lock = asyncio.Lock()
        self._next_host = 2
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def _nft_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """One worker thread for nft transactions that overlap netlink work (libnftables
        releases the GIL while the kernel works); started on first use."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="corral-nft"
            )
        return self._executor

    # ------------------------------------------------------------------ config checks
    @property
    def enabled(self) -> bool:
        """Whether sandboxes of this node can be granted anything (permissions exist)."""
        return bool(self.cfg.permissions)

    def compile(self, policy: NetworkPolicy) -> Compiled:
        """Check a policy's names against the node's permissions (InvalidRequest if not)."""
        return Compiled.build(self.cfg, policy.allow, policy.deny)

    def mounts(self) -> list[dict[str, Any]]:
        """OCI mounts every sandbox gets: /etc/resolv.conf naming the node resolver (a
        sandbox granted egress later finds its resolver without a restart)."""
        if not self.enabled:
            return []
        self.dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        conf = self.dir / "resolv.conf"
        text = f"nameserver {self.gateway}\noptions timeout:1 attempts:2\n"
        if not conf.exists() or conf.read_text() != text:
            conf.write_text(text)
            conf.chmod(0o644)
        return [
            {
                "destination": "/etc/resolv.conf",
                "type": "bind",
                "source": str(conf),
                "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
            }
        ]

    # ------------------------------------------------------------------ lifecycle
    async def _start(self) -> None:
        """Table, gateway device, resolver and denial poller (idempotent)."""
        if self._nft is not None:
            return
        nft = self._ctx or Nft()
        try:
            links = await Links.open()
        except BaseException:
            if nft is not self._ctx:
                nft.close()
            raise
        self._nft, self._links = nft, links
        try:
            self._enable_uplinks()
            await links.ensure_gateway(self.dev, self.gateway)
            self._sync_table()
            for chain in self.foreign_forward_drops():
                # nftables runs every base chain of a hook: an accept here cannot override
                # a drop there (Docker's iptables FORWARD policy). Said loudly, not patched:
                # that table is not ours.
                log.warning(
                    "%s has policy drop on the forward hook: it will drop sandbox egress "
                    "unless it accepts traffic from %s",
                    chain,
                    self.cfg.subnet,
                )
            self._resolver = Resolver(
                (self.gateway, 53), self.cfg.upstream_servers(), _ResolverHooks(self)
            )
            await self._resolver.start()
        except BaseException:
            await self._stop(teardown=not self._sb)
            raise
        self._poller = asyncio.create_task(self._poll_forever(), name="corral-net-denials")

    async def _stop(self, teardown: bool) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
            self._poller = None
        if self._resolver is not None:
            await self._resolver.close()
            self._resolver = None
        if teardown:
            await self._teardown_kernel()
        if self._links is not None:
            await self._links.close()
            self._links = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._nft is not None and self._nft is not self._ctx:
            self._nft.close()
        self._nft = None

    async def close(self, keep: bool) -> None:
        """Stop the resolver; with ``keep`` (sandboxes stay running for the next node to
        adopt) leave veths and the table in place, else remove everything."""
        async with self._lock:
            try:
                if self._nft is None and not keep:
                    if self.enabled:  # leftovers of an earlier run; a node without any
                        await self._teardown_kernel()  # permission never made anything
                    return
                await self._stop(teardown=not keep)
            finally:
                if self._ctx is not None:
                    self._ctx.close()
                    self._ctx = None

    async def _teardown_kernel(self) -> None:
        """Remove the table, the gateway device and any veth of ours still there."""
        nft = self._nft or self._ctx or Nft()
        opened_nft = nft is not self._nft and nft is not self._ctx
        opened = self._links is None
        links = self._links or await Links.open()
        try:
            with contextlib.suppress(NftError):
                nft.run(f"delete table inet {self.table}")
            for sid in list(self._sb):
                with contextlib.suppress(HostError):
                    await links.delete(veth_name(sid))
            with contextlib.suppress(HostError):
                await links.delete(self.dev)
            self._restore_uplinks()
        finally:
            if opened_nft:
                nft.close()
            if opened:
                await links.close()
        self._sb.clear()
        self._by_addr.clear()

    # ------------------------------------------------------------------ per sandbox
    async def attach(self, sandbox_id: str, pid: int, policy: NetworkPolicy) -> str | None:
        """Give a running sandbox its policy; returns its address (None: no interface)."""
        compiled = self.compile(policy)
        if not compiled.any:
            return None
        t0 = time.perf_counter()
        async with self._lock:
            existing = self._sb.get(sandbox_id)
            if existing is not None:  # attached meanwhile (two concurrent first grants)
                self._apply(existing, compiled)
                return existing.address
            await self._start()
            address = self._allocate()
            sb = SbNet(sandbox_id, address, compiled, new_mark())
            self._sb[sandbox_id] = sb
            self._by_addr[address] = sandbox_id
            # The nft transaction (chain, sets, the veth's entries) runs in the node's nft
            # thread while this one wires the veth; the host end goes up only once the
            # kernel has the rules for it, so nothing passes unguarded.
            text = self._sandbox_batch(sb, create=True)
            job = self._nft_thread().submit(self._nft_run, text)
            rules = asyncio.wrap_future(job)
            try:
                assert self._links is not None
                await self._links.attach_veth(
                    veth_name(sandbox_id), pid, address, self.gateway, ready=rules
                )
            except BaseException:
                # _forget must not race the thread's transaction (even when cancelled);
                # a refusal nobody awaited is retrieved, not logged as lost.
                concurrent.futures.wait([job])
                rules.add_done_callback(lambda f: f.cancelled() or f.exception())
                await self._forget(sandbox_id)
                raise
        ms = round((time.perf_counter() - t0) * 1000, 3)
        self._add_event(sandbox_id, "network_attached", {"address": address, "ms": ms})
        return address

    async def update(
        self, sandbox_id: str, pid: int | None, address: str | None, policy: NetworkPolicy
    ) -> str | None:
        """Apply a new policy to a live sandbox, atomically; returns its address."""
        compiled = self.compile(policy)
        sb = self._sb.get(sandbox_id)
        if sb is None:
            if not compiled.any:
                return address
            if pid is None:
                raise HostError(f"sandbox {sandbox_id} has no init pid to attach a network to")
            return await self.attach(sandbox_id, pid, policy)
        async with self._lock:
            self._apply(sb, compiled)
        return sb.address

    def _apply(self, sb: SbNet, compiled: Compiled) -> None:
        """Make the kernel enforce ``compiled`` for ``sb``: one nft transaction, or none."""
        old_policy, old_mark = sb.policy, sb.mark
        # Anything taken away (a host, a port, a range, a new denial) ends the established
        # flows that no longer pass; pure additions leave them alone.
        revoked = (
            not set(map(_freeze, old_policy.hosts)) <= set(map(_freeze, compiled.hosts))
            or not set(map(_freeze, old_policy.cidrs)) <= set(map(_freeze, compiled.cidrs))
            or bool(set(compiled.denied_hosts) - set(old_policy.denied_hosts))
        )
        sb.policy = compiled
        if revoked:
            sb.mark = new_mark()
        try:
            self._nft_run(self._sandbox_batch(sb, create=False, rules=revoked))
        except BaseException:
            sb.policy, sb.mark = old_policy, old_mark  # the kernel kept the old one too
            raise

    async def detach(self, sandbox_id: str) -> None:
        """Remove a sandbox's veth, chain and sets (destroy)."""
        if sandbox_id not in self._sb:
            return
        async with self._lock:
            await self._forget(sandbox_id)

    async def _forget(self, sandbox_id: str) -> None:
        sb = self._sb.pop(sandbox_id, None)
        if sb is None:
            return
        self._by_addr.pop(sb.address, None)
        k, v = key(sandbox_id), veth_name(sandbox_id)
        t = self.table
        batch = [
            f"delete element inet {t} out {{ {v} }}",
            f"delete element inet {t} veths {{ {v} }}",
            f"delete element inet {t} ifaddr {{ {v} . {sb.address} }}",
            f"delete chain inet {t} s_{k}",
            f"delete set inet {t} n_{k}",
            f"delete set inet {t} d_{k}",
        ]
        if self._nft is not None:
            try:
                self._nft_run("\n".join(batch))
            except NftError:
                # Partly there (a create cut short): remove what exists, one by one.
                for cmd in batch:
                    with contextlib.suppress(NftError):
                        self._nft_run(cmd)
        if self._links is not None:
            with contextlib.suppress(HostError):
                await self._links.delete(v)

    async def adopt(self, sandboxes: Iterable[tuple[str, int | None, str, NetworkPolicy]]) -> None:
        """After a restart: take over (id, pid, address, policy) of running sandboxes that
        have an address, rebuild the table for them and drop what belongs to no one."""
        items = list(sandboxes)
        async with self._lock:
            for sid, _pid, address, policy in items:
                try:
                    compiled = self.compile(policy)
                except Exception:
                    compiled = Compiled(allow=[], deny=[])  # a permission the config lost
                self._sb[sid] = SbNet(sid, address, compiled, new_mark())
                self._by_addr[address] = sid
            if not self._sb:
                # Nothing to serve: remove leftovers of an earlier run, if any.
                if self.enabled:
                    await self._teardown_kernel()
                return
            await self._start()
            assert self._links is not None
            for sid, pid, address, _policy in items:
                if await self._links.index(veth_name(sid)) is None and pid:
                    try:
                        await self._links.attach_veth(veth_name(sid), pid, address, self.gateway)
                    except HostError as e:
                        log.warning("sandbox %s: could not re-attach its network: %s", sid, e)

    async def gc(self, live: set[str]) -> int:
        """Drop the network of sandboxes not in ``live``; with none left, the whole table,
        device and resolver. Returns how many sandbox networks were removed."""
        async with self._lock:
            stale = [sid for sid in self._sb if sid not in live]
            for sid in stale:
                await self._forget(sid)
            if not self._sb:
                await self._stop(teardown=True)  # also removes leftovers of a crashed run
            elif self._nft is not None:
                self._sync_table()
        return len(stale)

    def foreign_forward_drops(self) -> list[str]:
        """Base chains of other tables on the forward hook whose policy is drop."""
        if self._nft is None:
            return []
        out = []
        with contextlib.suppress(NftError):
            for item in self._nft.json("list chains").get("nftables", []):
                c = item.get("chain")
                if (
                    c
                    and c.get("hook") == "forward"
                    and c.get("policy") == "drop"
                    and not (c.get("family") == "inet" and c.get("table") == self.table)
                ):
                    out.append(f"{c.get('family')} {c.get('table')} {c.get('name')}")
        return out

    def snapshot(self, sandbox_id: str) -> dict[str, Any]:
        """What the kernel holds for a sandbox (tests, debugging): its set elements."""
        out: dict[str, Any] = {}
        if self._nft is None or sandbox_id not in self._sb:
            return out
        k = key(sandbox_id)
        for name in ("n", "d"):
            data = self._nft.json(f"list set inet {self.table} {name}_{k}")
            elems = []
            for item in data.get("nftables", []):
                for e in item.get("set", {}).get("elem", []) or []:
                    elems.append(e)
            out[name] = elems
        return out

    # ------------------------------------------------------------------ resolver hooks
    def allowed(self, source: str, name: str) -> bool:
        sid = self._by_addr.get(source)
        sb = self._sb.get(sid) if sid else None
        return sb is not None and sb.policy.ports_for(name) is not None

    async def admit(self, source: str, name: str, addrs: list[tuple[str, int]]) -> None:
        sid = self._by_addr.get(source)
        sb = self._sb.get(sid) if sid else None
        if sb is None:
            return
        cmds = admit_commands(self.table, sb, name, addrs, self.cfg.min_ttl, self.cfg.max_ttl)
        if cmds:
            async with self._lock:
                if sb.sid in self._sb:
                    self._nft_run("\n".join(cmds))

    def denied(self, source: str, name: str, qtype: str) -> None:
        sid = self._by_addr.get(source)
        now = time.monotonic()
        key = (source, name)
        if self._dns_seen.get(key, 0) > now:
            return
        if len(self._dns_seen) > 65536:
            self._dns_seen = {k: v for k, v in self._dns_seen.items() if v > now}
        self._dns_seen[key] = now + self.cfg.deny_window
        self._add_event(
            sid,
            "dns_denied",
            {"name": name[:253], "qtype": qtype, "source": source, "time": time.time()},
        )

    # ------------------------------------------------------------------ nft text
    def _nft_run(self, text: str) -> None:
        if self._nft is None:
            raise HostError("the node network is not started")
        self._nft.run(text)

    def _sync_table(self) -> None:
        """(Re)write the base table and every known sandbox's objects in one transaction;
        delete per-sandbox objects of sandboxes the node does not know."""
        assert self._nft is not None
        t, gw, net = self.table, self.gateway, self.cfg.subnet
        w = f"{max(1, round(self.cfg.deny_window * 1000))}ms"
        existing: set[str] = set()
        try:
            data = self._nft.json(f"list table inet {t}")
            for item in data.get("nftables", []):
                for kind in ("chain", "set"):
                    if kind in item:
                        existing.add(f"{kind} {item[kind]['name']}")
        except NftError:
            pass
        base = base_table(t, gw, net, w)
        parts = [base]
        known = {key(s) for s in self._sb}
        for sb in self._sb.values():
            parts.append(self._sandbox_batch(sb, create=True))
        for obj in sorted(existing):
            kind, name = obj.split(" ", 1)
            if name[:2] in ("s_", "n_", "d_") and name[2:] not in known:
                if kind == "chain":
                    parts.append(f"delete chain inet {t} {name}")
        for obj in sorted(existing):
            kind, name = obj.split(" ", 1)
            if kind == "set" and name[:2] in ("n_", "d_") and name[2:] not in known:
                parts.append(f"delete set inet {t} {name}")
        self._nft.run("\n".join(parts))

    def _sandbox_batch(self, sb: SbNet, create: bool, rules: bool = True) -> str:
        return sandbox_batch(self.table, sb, create, rules)

    # ------------------------------------------------------------------ denials
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(_POLL_INTERVAL)
            try:
                self.poll_denials()
            except Exception:
                log.exception("reading denied connections failed")

    def poll_denials(self) -> int:
        """Turn new entries of the denial sets into events; returns how many."""
        if self._nft is None:
            return 0
        now, wall = time.monotonic(), time.time()
        w = self.cfg.deny_window
        found = 0
        current: set[tuple[Any, ...]] = set()
        for set_name in ("denied", "denied_other"):
            data = self._nft.json(f"list set inet {self.table} {set_name}")
            for item in data.get("nftables", []):
                for e in item.get("set", {}).get("elem", []) or []:
                    elem = e.get("elem", e) if isinstance(e, dict) else e
                    val = elem.get("val", elem) if isinstance(elem, dict) else elem
                    fields = val.get("concat") if isinstance(val, dict) else None
                    if not fields:
                        continue
                    expires = elem.get("expires", w) if isinstance(elem, dict) else w
                    key = tuple(fields)
                    current.add(key)
                    if key in self._denied_seen:
                        continue
                    self._denied_seen[key] = now
                    found += 1
                    src, dst, proto = fields[0], fields[1], fields[2]
                    port = fields[3] if len(fields) > 3 else None
                    detail: dict[str, Any] = {
                        "addr": dst,
                        "proto": proto,
                        "source": src,
                        "time": round(wall - max(0.0, w - float(expires)), 3),
                    }
                    if port is not None:
                        detail["port"] = port
                    self._add_event(self._by_addr.get(src), "net_denied", detail)
        for key in list(self._denied_seen):
            if key not in current:
                del self._denied_seen[key]
        return found

    # ------------------------------------------------------------------ helpers
    def _allocate(self) -> str:
        used = self._by_addr
        hosts = self.net.num_addresses - 2
        for _ in range(hosts):
            n = self._next_host
            self._next_host = 2 if n + 1 > hosts else n + 1
            ip = str(self.net[n])
            if ip not in used and ip != self.gateway:
                return ip
        raise CapacityError(f"the node network {self.cfg.subnet} has no free address")

    def _enable_uplinks(self) -> None:
        uplinks.enable(self.cfg.uplinks, self.dir / "uplinks.json")

    def _restore_uplinks(self) -> None:
        uplinks.restore(self.dir / "uplinks.json")


class _ResolverHooks:
    def __init__(self, net: NodeNetwork) -> None:
        self._net = net

    def allowed(self, source: str, name: str) -> bool:
        return self._net.allowed(source, name)

    async def admit(self, source: str, name: str, addrs: list[tuple[str, int]]) -> None:
        await self._net.admit(source, name, addrs)

    def denied(self, source: str, name: str, qtype: str) -> None:
        self._net.denied(source, name, qtype)


def _freeze(item: tuple[str, list[tuple[str, str]]]) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (item[0], tuple(item[1]))
