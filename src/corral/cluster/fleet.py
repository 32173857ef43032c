"""``FleetClient``: one :class:`~corral.ops.NodeOps` over many nodes.

Per-sandbox calls go straight to the node the id names (``sb-<local>-<node>``), never
through a control plane. Creates are placed (:mod:`corral.cluster.placement`); fleet calls
(list, pause by labels, events, status, images) fan out to every node concurrently and
merge. Events merge by time into one page whose cursors hold every node's position, so
paging across the fleet loses nothing and repeats nothing.

Nodes are any NodeOps (HTTP clients of real nodes, FakeNodes in tests). :meth:`refresh`
asks every node for its status (the control loop calls it about once a second): a node
that has not answered for ``lost_after`` seconds is **lost**: nothing is placed there, and
its sandboxes are reported with state ``lost`` (their last known info) in ``sandbox_get``
and ``sandbox_list`` until it answers again. All of this is soft state, rebuilt by asking
the nodes.

Example:
    >>> fleet = FleetClient({"n1": FakeNode("n1"), "n2": FakeNode("n2")})  # doctest: +SKIP
    >>> await fleet.refresh()                                              # doctest: +SKIP
    >>> info = await fleet.sandbox_create(SandboxSpec(image="demo/base"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from corral.cluster.events import CONTROL_NODE, ControlEvents
from corral.cluster.placement import NodeReport, PlacementPolicy, Placer, place_and_create
from corral.errors import (
    CapacityError,
    CorralError,
    ImageNotFound,
    InvalidRequest,
    SandboxNotFound,
    TransportError,
)
from corral.ops import NodeOps, PtyStream, check_events_limit, cursor_positions
from corral.spec import (
    NODE_ID_RE,
    CallRequest,
    CallResult,
    DesktopInput,
    Event,
    EventSummary,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileStat,
    ForkRequest,
    ImageInfo,
    JudgeRequest,
    JudgeResult,
    LayerInfo,
    NodeStatus,
    ProcessInfo,
    PtyRequest,
    SandboxInfo,
    SandboxSpec,
    ShellInfo,
    encode_cursor,
    parse_sandbox_id,
)

__all__ = ["FleetClient", "CLUSTER_ID"]

CLUSTER_ID = CONTROL_NODE
"""``node_id`` of the fleet-wide :meth:`FleetClient.node_status` and of control-plane events
(no node may take it)."""

BurstHook = Callable[[SandboxSpec], Awaitable[None]]


class _Member:
    __slots__ = ("ops", "seen", "status", "lost", "draining", "known")

    def __init__(self, ops: NodeOps, now: float) -> None:
        self.ops = ops
        self.seen = now  # last answer (clock seconds)
        self.status: NodeStatus | None = None
        self.lost = False
        self.draining = False
        self.known: dict[str, SandboxInfo] = {}  # last info seen per sandbox (for `lost`)


class FleetClient(NodeOps):
    """NodeOps over ``nodes`` (node id -> its NodeOps); see the module docstring."""

    def __init__(
        self,
        nodes: Mapping[str, NodeOps],
        *,
        policy: PlacementPolicy | None = None,
        lost_after: float = 5.0,
        status_timeout: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        events: ControlEvents | None = None,
    ) -> None:
        now = clock()
        for nid in nodes:
            _check_node_id(nid)
        self._members = {nid: _Member(ops, now) for nid, ops in nodes.items()}
        self.placer = Placer(policy, seed=seed)
        self.lost_after = lost_after
        self._status_timeout = status_timeout
        self._clock = clock
        self._rr = itertools.count()
        self._in_cloud: dict[str, tuple[float, bool]] = {}  # image -> (checked at, present)
        self.log = events
        """The control plane's event log, when this fleet is the control plane's: node loss
        and return and burst on/off are recorded there, and :meth:`events` merges it in."""
        self._was_bursting = False
        self.cloud_store: str | None = None
        """The store directory the cloud pool reads. With no cloud node up, an image counts
        as present there when an on-prem node with that same store has it."""
        self.on_burst: BurstHook | None = None
        """Called (and awaited) when a create may burst and the cloud pool has no room:
        the control plane asks the autoscaler for a cloud node and waits for it here."""

    # ------------------------------------------------------------------ membership
    def add_node(self, node_id: str, ops: NodeOps) -> NodeOps | None:
        """A node joined, or came back under a new address: returns the NodeOps it
        replaces (the caller closes it), None for a new node."""
        _check_node_id(node_id)
        old = self._members.get(node_id)
        m = self._members[node_id] = _Member(ops, self._clock())
        if old is None:
            return None
        m.known, m.draining = old.known, old.draining  # what it ran, and the operator's word
        m.lost = old.lost  # still lost until the new address answers (then `node_back`)
        return old.ops

    def remove_node(self, node_id: str) -> NodeOps | None:
        """A node left for good (a released cloud node): forget it, so that it is never
        reported lost; returns its NodeOps (the caller closes it), None if unknown."""
        m = self._members.pop(node_id, None)
        self.placer.forget(node_id)
        return None if m is None else m.ops

    def drain(self, node_id: str, on: bool = True) -> None:
        """Place nothing more on the node (its sandboxes keep running)."""
        self._member(node_id).draining = on
        self._report(node_id)

    def draining_nodes(self) -> list[str]:
        return [nid for nid, m in self._members.items() if m.draining]

    def lost_nodes(self) -> list[str]:
        return [nid for nid, m in self._members.items() if m.lost]

    def node_ids(self) -> list[str]:
        return list(self._members)

    async def refresh(self) -> dict[str, NodeStatus | None]:
        """Ask every node for its status; feed the placer; mark silent nodes lost.

        Returns each node's status (None: it did not answer this time)."""
        ids = list(self._members)
        # A report holds the placements made before it was asked for, not those made while
        # it was on its way: the placer keeps those in its overlay (reported as of ``asked``).
        asked = self._clock()
        got = await asyncio.gather(*(self._status_of(nid) for nid in ids), return_exceptions=True)
        now = self._clock()
        out: dict[str, NodeStatus | None] = {}
        for nid, st in zip(ids, got, strict=True):
            m = self._members.get(nid)
            if m is None:
                continue
            was_lost = m.lost
            if isinstance(st, NodeStatus) and st.node_id == nid:
                m.seen, m.status, m.lost = now, st, False
                out[nid] = st
            else:
                # no answer, an error, or the wrong node behind the address: all count as silence
                out[nid] = None
                if now - m.seen >= self.lost_after:
                    m.lost = True
            self._report(nid, asked)
            if self.log is not None and m.lost != was_lost:
                if m.lost:
                    self.log.add("node_lost", node=nid, silent_s=round(now - m.seen, 1))
                else:
                    self.log.add("node_back", node=nid)
        self._note_burst()
        return out

    def _note_burst(self) -> None:
        """Record on-prem fill crossing the burst threshold, either way."""
        on = self.placer.bursting()
        if self.log is not None and on != self._was_bursting:
            self.log.add(
                "burst", state="on" if on else "off", fill=round(self.placer.onprem_fill(), 3)
            )
        self._was_bursting = on

    async def _status_of(self, nid: str) -> NodeStatus:
        return await asyncio.wait_for(
            self._members[nid].ops.node_status(), timeout=self._status_timeout
        )

    def _report(self, nid: str, at: float | None = None) -> None:
        m = self._members[nid]
        if m.status is None:
            rep = NodeReport(node_id=nid, draining=m.draining, lost=True)
        else:
            rep = NodeReport.from_status(m.status, draining=m.draining, lost=m.lost)
        self.placer.report(rep, self._clock() if at is None else at)

    def _member(self, node_id: str) -> _Member:
        m = self._members.get(node_id)
        if m is None:
            raise InvalidRequest(f"node {node_id!r} is not in the cluster ({self._names()})")
        return m

    def _names(self) -> str:
        return ", ".join(sorted(self._members)[:20]) or "no nodes"

    def _route(self, sandbox_id: str) -> NodeOps:
        try:
            _, nid = parse_sandbox_id(sandbox_id)
        except ValueError as exc:
            raise SandboxNotFound(str(exc)) from None
        m = self._members.get(nid)
        if m is None:
            raise SandboxNotFound(
                f"no sandbox {sandbox_id}: its node {nid} is not in the cluster ({self._names()})"
            )
        if m.lost:
            raise TransportError(
                f"sandbox {sandbox_id} is lost: its node {nid} has not answered for "
                f"{self._clock() - m.seen:.0f} s"
            )
        return m.ops

    def _live(self) -> list[tuple[str, _Member]]:
        return [(nid, m) for nid, m in self._members.items() if not m.lost]

    async def _fan(self, call: Callable[[NodeOps], Awaitable[Any]]) -> list[tuple[str, Any]]:
        """``call`` on every live node at once; each node's answer or exception."""
        live = self._live()
        got = await asyncio.gather(*(call(m.ops) for _, m in live), return_exceptions=True)
        return [(nid, r) for (nid, _), r in zip(live, got, strict=True)]

    def _remember(self, infos: list[SandboxInfo]) -> list[SandboxInfo]:
        for i in infos:
            m = self._members.get(i.node_id)
            if m is not None:
                if i.state == "destroyed":
                    m.known.pop(i.id, None)
                else:
                    m.known[i.id] = i
        return infos

    def _lost_infos(
        self, labels: dict[str, str] | None, silent: set[str] | None = None
    ) -> list[SandboxInfo]:
        """Last known sandboxes of lost nodes (and of ``silent`` ones, which did not answer
        this call), with state ``lost``."""
        want = (labels or {}).items()
        return [
            i.model_copy(update={"state": "lost", "detail": f"node {nid} stopped answering"})
            for nid, m in self._members.items()
            if m.lost or nid in (silent or ())
            for i in m.known.values()
            if want <= i.spec.labels.items()
        ]

    # ------------------------------------------------------------------ lifecycle
    async def sandbox_create(self, spec: SandboxSpec) -> SandboxInfo:
        async def create(nid: str, s: SandboxSpec) -> SandboxInfo:
            try:
                return await self._members[nid].ops.sandbox_create(s)
            except TransportError as exc:
                if _never_sent(exc):
                    # the node could not even be connected to: nothing was made there, so
                    # this is a refusal (re-placed elsewhere), not an ambiguous failure
                    raise CapacityError(f"node {nid} is unreachable: {exc.message}") from exc
                raise

        self._note_burst()
        may_burst = self.placer.bursting() and await self._in_cloud_store(spec.image)
        if (
            may_burst
            and self.on_burst is not None
            and spec.backend in (None, "container")
            and not self.placer.cloud_room(spec)
        ):
            await self.on_burst(spec)
        while True:
            try:
                info = await place_and_create(
                    self.placer, spec, create, self._clock, may_burst=may_burst
                )
                break
            except CapacityError:
                # a node that joined has not answered a status yet (a control plane just
                # started, a loaded host): ask again rather than refuse; it answers or is
                # marked lost after lost_after, which ends this
                if not any(m.status is None and not m.lost for m in self._members.values()):
                    raise
                await self.refresh()
        return self._remember([info])[0]

    async def _in_cloud_store(self, image: str) -> bool:
        """Whether the cloud pool's store has ``image`` (asked of one live cloud node,
        remembered for 30 s): only such creates may burst, so a cloud node never has to
        pull an image's layers in the middle of a burst."""
        now = self._clock()
        hit = self._in_cloud.get(image)
        if hit is not None and now - hit[0] < 30.0:
            return hit[1]
        pol = self.placer.policy
        cloud = [
            m
            for _, m in self._live()
            if m.status is not None and m.status.labels.get(pol.pool_label) == pol.cloud_pool
        ]
        if not cloud and self.cloud_store:
            # no cloud node up yet: an on-prem node reading the same store answers for it
            cloud = [
                m
                for _, m in self._live()
                if m.status is not None and m.status.store == self.cloud_store
            ]
        present = False
        if cloud:
            try:
                await cloud[0].ops.image_get(image)
                present = True
            except ImageNotFound:
                present = False
            except CorralError:
                return False  # unknown this time: do not burst, do not remember
        self._in_cloud[image] = (now, present)
        return present

    async def sandbox_get(self, sandbox_id: str) -> SandboxInfo:
        try:
            ops = self._route(sandbox_id)
        except TransportError:
            nid = parse_sandbox_id(sandbox_id)[1]
            known = self._members[nid].known.get(sandbox_id)
            if known is None:
                raise
            return known.model_copy(
                update={"state": "lost", "detail": f"node {nid} stopped answering"}
            )
        return self._remember([await ops.sandbox_get(sandbox_id)])[0]

    async def sandbox_destroy(self, sandbox_id: str) -> None:
        await self._route(sandbox_id).sandbox_destroy(sandbox_id)
        nid = parse_sandbox_id(sandbox_id)[1]
        self._members[nid].known.pop(sandbox_id, None)

    async def sandbox_list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        got = await self._fan(lambda o: o.sandbox_list(labels))
        out = self._remember(self._merge_lists(got))
        silent = {nid for nid, r in got if isinstance(r, TransportError)}
        return out + self._lost_infos(labels, silent)

    async def sandboxes_pause(self, labels: dict[str, str]) -> list[SandboxInfo]:
        if not labels:
            raise InvalidRequest("labels: name at least one label (e.g. job=...) to pause by")
        return self._remember(
            self._merge_lists(await self._fan(lambda o: o.sandboxes_pause(labels)))
        )

    async def sandboxes_resume(
        self, labels: dict[str, str], prefetch: bool = False
    ) -> list[SandboxInfo]:
        if not labels:
            raise InvalidRequest("labels: name at least one label (e.g. job=...) to resume by")
        got = await self._fan(lambda o: o.sandboxes_resume(labels, prefetch))
        return self._remember(self._merge_lists(got))

    @staticmethod
    def _merge_lists(got: list[tuple[str, object]]) -> list[SandboxInfo]:
        """The nodes' answers joined. A node that cannot be reached is left out (it is lost,
        or about to be: one dead node must not stop a fleet-wide list or a job's pause);
        any other error is raised, naming the node."""
        out: list[SandboxInfo] = []
        for nid, r in got:
            if isinstance(r, TransportError):
                continue
            if isinstance(r, BaseException):
                if isinstance(r, CorralError):
                    raise type(r)(f"node {nid}: {r.message}") from r
                raise r
            assert isinstance(r, list)
            out.extend(r)
        return out

    # ------------------------------------------------------------------ per sandbox
    async def sandbox_pause(self, sandbox_id: str, memory_snapshot: bool = False) -> SandboxInfo:
        return await self._route(sandbox_id).sandbox_pause(sandbox_id, memory_snapshot)

    async def sandbox_resume(self, sandbox_id: str, prefetch: bool = False) -> SandboxInfo:
        return await self._route(sandbox_id).sandbox_resume(sandbox_id, prefetch)

    async def sandbox_set_ttl(self, sandbox_id: str, ttl: float | None) -> SandboxInfo:
        return await self._route(sandbox_id).sandbox_set_ttl(sandbox_id, ttl)

    async def network_update(
        self, sandbox_id: str, allow: list[str] | None = None, deny: list[str] | None = None
    ) -> SandboxInfo:
        return await self._route(sandbox_id).network_update(sandbox_id, allow, deny)

    async def desktop_screenshot(self, sandbox_id: str) -> bytes:
        return await self._route(sandbox_id).desktop_screenshot(sandbox_id)

    async def desktop_input(self, sandbox_id: str, req: DesktopInput) -> None:
        await self._route(sandbox_id).desktop_input(sandbox_id, req)

    async def sandbox_snapshot(self, sandbox_id: str, name: str | None = None) -> ImageInfo:
        return await self._route(sandbox_id).sandbox_snapshot(sandbox_id, name)

    async def sandbox_fork(self, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        return self._remember(await self._route(sandbox_id).sandbox_fork(sandbox_id, req))

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await self._route(sandbox_id).exec(sandbox_id, req)

    async def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[ExecChunk | ExecResult]:
        async for item in self._route(sandbox_id).exec_stream(sandbox_id, req):
            yield item

    async def pty(self, sandbox_id: str, req: PtyRequest) -> PtyStream:
        return await self._route(sandbox_id).pty(sandbox_id, req)

    async def spawn(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        return await self._route(sandbox_id).spawn(sandbox_id, req)

    async def process_get(
        self, sandbox_id: str, process_id: str, wait: float | None = None
    ) -> ProcessInfo:
        return await self._route(sandbox_id).process_get(sandbox_id, process_id, wait)

    async def process_kill(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        await self._route(sandbox_id).process_kill(sandbox_id, process_id, signal)

    async def process_list(self, sandbox_id: str) -> list[ProcessInfo]:
        return await self._route(sandbox_id).process_list(sandbox_id)

    async def shell_open(
        self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ShellInfo:
        return await self._route(sandbox_id).shell_open(sandbox_id, cwd, env)

    async def shell_run(
        self,
        sandbox_id: str,
        shell_id: str,
        command: str,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        return await self._route(sandbox_id).shell_run(
            sandbox_id, shell_id, command, timeout, stdin
        )

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        await self._route(sandbox_id).shell_close(sandbox_id, shell_id)

    async def shell_interrupt(self, sandbox_id: str, shell_id: str) -> None:
        await self._route(sandbox_id).shell_interrupt(sandbox_id, shell_id)

    async def file_read(
        self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None
    ) -> bytes:
        return await self._route(sandbox_id).file_read(sandbox_id, path, offset, length)

    async def file_write(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, append: bool = False
    ) -> None:
        await self._route(sandbox_id).file_write(sandbox_id, path, data, mode, append)

    async def file_list(self, sandbox_id: str, path: str) -> list[FileStat]:
        return await self._route(sandbox_id).file_list(sandbox_id, path)

    async def file_stat(self, sandbox_id: str, path: str) -> FileStat:
        return await self._route(sandbox_id).file_stat(sandbox_id, path)

    async def file_remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self._route(sandbox_id).file_remove(sandbox_id, path, recursive)

    async def file_mkdir(
        self,
        sandbox_id: str,
        path: str,
        parents: bool = True,
        mode: int = 0o755,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        node = self._route(sandbox_id)
        await node.file_mkdir(sandbox_id, path, parents, mode, owner_uid, owner_gid)

    async def file_upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._route(sandbox_id).file_upload_tar(sandbox_id, path, data)

    async def file_download_tar(self, sandbox_id: str, path: str) -> bytes:
        return await self._route(sandbox_id).file_download_tar(sandbox_id, path)

    # ------------------------------------------------------------------ images
    async def image_get(self, name: str) -> ImageInfo:
        misses: list[str] = []
        for nid, m in self._live():
            try:
                return await m.ops.image_get(name)
            except ImageNotFound:
                misses.append(nid)
        raise ImageNotFound(f"no image {name!r} on any of {len(misses)} live nodes")

    async def image_list(self) -> list[ImageInfo]:
        seen: dict[tuple[str, str], ImageInfo] = {}
        for r in self._merge_any(await self._fan(lambda o: o.image_list())):
            seen.setdefault((r.name, r.digest), r)
        return list(seen.values())

    async def image_compose(
        self, name: str, layers: list[str], env: dict[str, str] | None = None, workdir: str = "/"
    ) -> ImageInfo:
        # every node: a later create may be placed anywhere (a shared store makes this cheap)
        got = self._merge_any(
            await self._fan(lambda o: _one(o.image_compose(name, layers, env, workdir)))
        )
        if not got:
            raise TransportError("no live node to compose the image on")
        return got[0]

    async def image_remove(self, name: str) -> None:
        for nid, r in await self._fan(lambda o: o.image_remove(name)):
            if isinstance(r, BaseException) and not isinstance(r, ImageNotFound):
                raise r

    async def layer_list(self) -> list[LayerInfo]:
        seen: dict[str, LayerInfo] = {}
        for r in self._merge_any(await self._fan(lambda o: o.layer_list())):
            seen.setdefault(r.digest, r)
        return list(seen.values())

    @staticmethod
    def _merge_any(got: list[tuple[str, Any]]) -> list[Any]:
        out: list[Any] = []
        for nid, r in got:
            if isinstance(r, BaseException):
                if isinstance(r, CorralError):
                    raise type(r)(f"node {nid}: {r.message}") from r
                raise r
            out.extend(r)
        return out

    # ------------------------------------------------------------------ events
    async def events(
        self,
        sandbox_id: str | None = None,
        after: str | None = None,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        limit: int = 1000,
    ) -> list[Event]:
        positions = cursor_positions(after)
        check_events_limit(limit)
        if sandbox_id is not None:
            return await self._route(sandbox_id).events(sandbox_id, after, labels, kinds, limit)
        cursor = after or None
        got = await asyncio.gather(
            self._fan(lambda o: o.events(None, cursor, labels, kinds, limit)),
            self._control_events(positions.get(CLUSTER_ID, 0), kinds, labels, limit),
        )
        pages = [*self._merge_per_node(got[0]), got[1]]
        # k-way merge by time keeps each node's own order; then re-stamp every cursor with
        # the fleet's positions as of that event, so any cursor resumes the whole fleet
        merged = heapq.merge(*pages, key=lambda e: e.time)
        pos = dict(positions)
        out: list[Event] = []
        for e in itertools.islice(merged, limit):
            pos[e.node_id] = e.id
            out.append(e.model_copy(update={"cursor": encode_cursor(pos)}))
        return out

    async def _control_events(
        self, position: int, kinds: list[str] | None, labels: dict[str, str] | None, limit: int
    ) -> list[Event]:
        """The control plane's events after ``position`` (none without a log); the cluster
        client asks the control-plane actor instead."""
        if self.log is None:
            return []
        return self.log.after(position, kinds=kinds, labels=labels, limit=limit)

    @staticmethod
    def _merge_per_node(got: list[tuple[str, object]]) -> list[list[Event]]:
        pages: list[list[Event]] = []
        for nid, r in got:
            if isinstance(r, BaseException):
                if isinstance(r, CorralError):
                    raise type(r)(f"node {nid}: {r.message}") from r
                raise r
            assert isinstance(r, list)
            pages.append(r)
        return pages

    async def events_summary(
        self,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        sandbox_id: str | None = None,
    ) -> EventSummary:
        if sandbox_id is not None:
            return await self._route(sandbox_id).events_summary(labels, kinds, sandbox_id)
        out = EventSummary(labels=dict(labels or {}))
        for nid, r in await self._fan(lambda o: o.events_summary(labels, kinds, None)):
            if isinstance(r, BaseException):
                raise r
            assert isinstance(r, EventSummary)
            out.sandboxes.update(r.sandboxes)
            for k, n in r.totals.items():
                out.totals[k] = out.totals.get(k, 0) + n
        return out

    # ------------------------------------------------------------------ status
    async def node_status(self) -> NodeStatus:
        """The fleet as one node (``node_id`` ``cluster``): sums of the live nodes'
        figures from the last :meth:`refresh`; ``labels`` counts nodes by state."""
        sts = [m.status for _, m in self._live() if m.status is not None]
        backends = {b.kind: b for st in sts for b in st.backends}
        return NodeStatus(
            node_id=CLUSTER_ID,
            version=sts[0].version if sts else "",
            cgroup_mode=sts[0].cgroup_mode if sts else "v2",
            sandboxes=sum(s.sandboxes for s in sts),
            running=sum(s.running for s in sts),
            paused=sum(s.paused for s in sts),
            state_dir="",
            store="",
            mounted_layers=sum(s.mounted_layers for s in sts),
            mem_total=sum(s.mem_total for s in sts),
            mem_available=sum(s.mem_available for s in sts),
            max_sandboxes=sum(s.max_sandboxes for s in sts),
            idle_capacity=sum(s.idle_capacity for s in sts),
            cpus=sum(s.cpus for s in sts),
            load1=sum(s.load1 for s in sts),
            scratch_total=sum(s.scratch_total for s in sts),
            scratch_free=sum(s.scratch_free for s in sts),
            labels={
                "nodes": str(len(self._members)),
                "lost": str(len(self.lost_nodes())),
                "draining": str(sum(m.draining for m in self._members.values())),
            },
            backends=list(backends.values()),
        )

    def statuses(self) -> dict[str, NodeStatus | None]:
        """Each node's last status (None: never answered)."""
        return {nid: m.status for nid, m in self._members.items()}

    # ------------------------------------------------------------------ fncall
    def _any_node(self) -> NodeOps:
        live = [m for _, m in self._live() if not m.draining]
        if not live:
            raise TransportError("no live node in the cluster to run the call")
        return live[next(self._rr) % len(live)].ops

    async def fncall_run(self, req: CallRequest) -> CallResult:
        return await self._any_node().fncall_run(req)

    async def fncall_judge(self, req: JudgeRequest) -> JudgeResult:
        return await self._any_node().fncall_judge(req)

    async def close(self) -> None:
        await asyncio.gather(
            *(m.ops.close() for m in self._members.values()), return_exceptions=True
        )


def _check_node_id(nid: str) -> None:
    if not NODE_ID_RE.fullmatch(nid) or nid == CLUSTER_ID:
        raise InvalidRequest(
            f"node id {nid[:40]!r} must be 1-16 of [0-9a-z] and not {CLUSTER_ID!r} "
            "(the control plane's own name in events)"
        )


def _never_sent(exc: TransportError) -> bool:
    """Whether a transport error certainly happened before the request reached the node
    (connection refused, no route): then the node did nothing."""
    import httpx

    return isinstance(exc.__cause__, httpx.ConnectError)


async def _one(coro: Awaitable[Any]) -> list[Any]:
    return [await coro]


_conforms: type[NodeOps] = FleetClient
