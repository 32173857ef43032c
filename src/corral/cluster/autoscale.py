"""The cloud pool, grown and shrunk through Ray's autoscaler.

The cluster config names a Ray node type per pool: on-prem nodes are the operator's, and
the cloud pool's node type (in Ray's ``available_node_types``) carries the custom resource
:attr:`CloudPool.resource`, one unit per node. That unit is what pins one corral node agent
to each cloud node, and what the control plane asks the autoscaler for.

**Growing.** When on-prem fill is at the burst threshold and a create that may burst (its
image is in the cloud pool's store, container work) finds no room in the cloud pool,
:meth:`CloudScaler.want` asks for one more cloud node: ``request_resources`` with one more
bundle of the resource, and a node agent actor (detached, named ``corral-node-cloudN``)
that needs one unit of it, so Ray starts it on the new node as soon as the autoscaler has
launched that. The agent opens a node with the pool's node config (``pool=cloud``), the
control plane discovers it like any agent, and the waiting creates are placed there. A
create waits at most :attr:`CloudPool.wait` seconds; then it is placed on-prem if there is
room, or fails with CapacityError.

**Shrinking.** A cloud node that has held no sandbox (and had no placement in flight) for
:attr:`CloudPool.idle_after` seconds is drained, its agent closes its node (and refuses if
a sandbox slipped in meanwhile), the agent actor is killed, and the request is lowered by
one bundle; Ray's autoscaler then removes the idle Ray node after its own
``idle_timeout_minutes``.

**Live cloud sandboxes are never lost to a scale-down**: a cloud node is released only
when it is empty. Sandboxes on it run until their job destroys them, their TTL/idle
reaper takes them, or their job's lease lapses (pause, then destroy after the grace);
the node then empties and is released. An operator who wants a node back sooner drains it
(``corral cluster drain``): no new work goes there, the rest ends as above.

Ray is not imported here: the Ray side (request, launch, release) is a :class:`ScaleOps`
the control-plane actor supplies, so the logic is tested with fakes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Protocol

from corral.cluster.events import ControlEvents
from corral.cluster.fleet import FleetClient
from corral.errors import InvalidRequest
from corral.spec import SandboxSpec

__all__ = ["CloudPool", "CloudScaler", "ScaleOps", "CLOUD_AGENT_PREFIX"]

CLOUD_AGENT_PREFIX = "corral-node-cloud"
"""Names of cloud agents: this plus a number (they are node agents like the others)."""


@dataclass(frozen=True, slots=True)
class CloudPool:
    """The cloud pool of a cluster config (``[cluster.pools.cloud]``)."""

    node_config: str
    """The :class:`corral.node.NodeConfig` (JSON) of the node each cloud agent opens; its
    labels must say ``pool = "cloud"``."""
    node_type: str = "corral.cloud"
    """The Ray node type (``available_node_types``) of cloud nodes, for the operator."""
    resource: str = "corral-pool-cloud"
    """The custom resource a cloud node type carries, 1 per node."""
    max_nodes: int = 4
    """At most this many cloud nodes (keep it at or under the node type's ``max_workers``)."""
    idle_after: float = 60.0
    """Seconds a cloud node stays empty before it is released."""
    wait: float = 180.0
    """Seconds a burst create waits for a new cloud node before going on-prem."""
    store: str | None = None
    """The store directory the cloud pool reads (for eligibility before a cloud node is up)."""

    def __post_init__(self) -> None:
        if self.max_nodes < 0 or self.idle_after < 0 or self.wait < 0:
            raise InvalidRequest("cloud pool: max_nodes, idle_after and wait cannot be negative")
        labels = json.loads(self.node_config).get("labels", {})
        if labels.get("pool") != "cloud":
            raise InvalidRequest(
                f'cloud pool: its node config must carry the label pool = "cloud" (it has {labels})'
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CloudPool:
        return cls(**json.loads(text))


class ScaleOps(Protocol):
    """The Ray side of scaling (the control-plane actor implements it)."""

    def request(self, nodes: int) -> None:
        """Ask the autoscaler for ``nodes`` cloud nodes in all (``request_resources``)."""

    def launch(self, name: str) -> None:
        """Start agent ``name``, needing one unit of the pool's resource (so on a new node)."""

    async def release(self, name: str, up: bool) -> bool:
        """Close agent ``name``'s node and kill the agent; False (and nothing done) when
        the node holds a sandbox. ``up``: the agent serves a node (else it never started:
        just kill it)."""


class CloudScaler:
    """Grows and shrinks the cloud pool of ``fleet`` (see the module docstring).

    ``poke``: makes the control plane look for new agents and refresh node reports now (a
    waiting create calls it, at most every half second)."""

    def __init__(
        self,
        fleet: FleetClient,
        pool: CloudPool,
        ops: ScaleOps,
        log: ControlEvents,
        poke: Callable[[], Awaitable[object]],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.fleet, self.pool, self._ops, self.log = fleet, pool, ops, log
        self._poke_fn, self._clock, self._sleep = poke, clock, sleep
        self._agents: dict[str, str | None] = {}  # agent name -> node id once it is up
        self._launched_at: dict[str, float] = {}
        self._idle_since: dict[str, float] = {}
        self._released: set[str] = set()
        self._next = 0
        self._waiters = 0
        self._poked = -1.0
        self._poke_lock = asyncio.Lock()
        fleet.on_burst = self.want
        fleet.cloud_store = pool.store

    def reconfigure(self, pool: CloudPool, ops: ScaleOps) -> None:
        """A new pool config: later launches and releases follow it; nodes up stay."""
        self.pool, self._ops = pool, ops
        self.fleet.cloud_store = pool.store

    # ------------------------------------------------------------------ membership
    def adopt(self, names: list[str]) -> None:
        """Agents found running (a restarted control plane): count them as launched."""
        added = False
        for name in names:
            if name.startswith(CLOUD_AGENT_PREFIX) and name not in self._agents:
                added = True
                self._agents[name] = None
                self._launched_at[name] = self._clock()
                tail = name[len(CLOUD_AGENT_PREFIX) :]
                if tail.isdigit():
                    self._next = max(self._next, int(tail) + 1)
        if added:
            self._ops.request(len(self._agents))

    def seen(self, name: str, node_id: str) -> None:
        """Agent ``name`` is up and serves node ``node_id``."""
        if name in self._agents and self._agents[name] is None:
            self._agents[name] = node_id
            self.log.add("autoscale", action="joined", agent=name, node=node_id)

    def released(self, name: str) -> bool:
        """Whether agent ``name`` was released (discovery must not take it back)."""
        return name in self._released

    def nodes(self) -> dict[str, str | None]:
        return dict(self._agents)

    # ------------------------------------------------------------------ growing
    async def want(self, spec: SandboxSpec) -> None:
        """A create may burst and the cloud pool is full: have a cloud node started unless
        one is on its way, and wait (at most ``pool.wait``) until there is room for it."""
        self._waiters += 1
        try:
            deadline = self._clock() + self.pool.wait
            while not self.fleet.placer.cloud_room(spec):
                # launch when nothing is on its way: at first, and again when the node that
                # came filled up before this create got a place on it
                if None not in self._agents.values():
                    if len(self._agents) >= self.pool.max_nodes:
                        return  # at the pool's size: on-prem if room, else CapacityError
                    self._launch()
                if self._clock() >= deadline:
                    self.log.add("autoscale", action="timeout", waited_s=self.pool.wait)
                    return
                await self._sleep(0.25)
                await self._poke()
        finally:
            self._waiters -= 1

    def _launch(self) -> None:
        name = f"{CLOUD_AGENT_PREFIX}{self._next}"
        self._next += 1
        self._agents[name] = None
        self._launched_at[name] = self._clock()
        self._ops.request(len(self._agents))
        self._ops.launch(name)
        self.log.add("autoscale", action="request", agent=name, nodes=len(self._agents))

    async def _poke(self) -> None:
        async with self._poke_lock:
            if self._clock() - self._poked >= 0.5:
                self._poked = self._clock()
                await self._poke_fn()

    # ------------------------------------------------------------------ shrinking
    async def tick(self) -> None:
        """Release cloud nodes empty for ``pool.idle_after`` and launches that never came
        up within ``pool.wait``; the control loop calls it every round."""
        now = self._clock()
        for name, nid in list(self._agents.items()):
            if nid is None:
                if now - self._launched_at.get(name, now) > self.pool.wait + 30 and (
                    not self._waiters
                ):
                    await self._release(name, None, why="never came up")
                continue
            if self._waiters or not self._empty(nid):
                self._idle_since.pop(name, None)
                continue
            since = self._idle_since.setdefault(name, now)
            if now - since >= self.pool.idle_after:
                await self._release(name, nid, why="idle")

    def _empty(self, nid: str) -> bool:
        st = self.fleet.statuses().get(nid)
        if st is None or st.sandboxes:
            return False
        try:
            return self.fleet.placer.expected(nid) == 0
        except KeyError:
            return False

    async def _release(self, name: str, nid: str | None, why: str) -> None:
        if nid is not None:
            self.fleet.drain(nid)  # no placement from here on
        if not await self._ops.release(name, up=nid is not None):
            if nid is not None:
                self.fleet.drain(nid, False)
            self._idle_since.pop(name, None)
            return
        del self._agents[name]
        self._launched_at.pop(name, None)
        self._idle_since.pop(name, None)
        self._released.add(name)
        if nid is not None:
            old = self.fleet.remove_node(nid)
            if old is not None:
                await old.close()
        self._ops.request(len(self._agents))
        self.log.add("autoscale", action="release", agent=name, node=nid, why=why)
