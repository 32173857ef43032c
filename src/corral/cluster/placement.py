"""Placement: which node gets the next sandbox. Pure logic, no I/O, no Ray.

The shape is DSec's (paper §7), and each step is here for a reason:

1. **Filter by capability.** A node is a candidate only if it has the spec's backend, carries
   every label the request needs, is neither draining nor lost, and its reported free memory
   and scratch, less what this placer has sent it since, stay above the policy's floors.
2. **Power-of-k choices on load.** Sample ``k`` candidates at random and take the least
   loaded. Scanning all nodes for the minimum makes every placer pick the same node between
   two reports (a herd); k random samples spread the load almost as well at O(k) per decision.
3. **Overlay of own recent placements.** Node reports lag. Each placer remembers the
   placements it made after a node's last report and adds them to that node's load, so a
   burst does not land on one node that still looks empty. Placers never coordinate: each
   only knows its own overlay, and the node's own admission catches what they overcommit.
4. **The node keeps the final word.** A node may refuse (``CapacityError``); the refusal
   marks that node full in this placer until its next report and the request is placed
   elsewhere, a bounded number of times (:func:`place_and_create`). Only a definite refusal
   is retried: an error that leaves it unknown whether the node made the sandbox (a timeout,
   a dropped connection) is raised, never retried, so a sandbox is never made twice.

Everything takes ``now`` from the caller, so tests and the placement bench drive time.

Example:
    >>> p = Placer(seed=1)
    >>> p.report(NodeReport(node_id="n1", max_sandboxes=2), now=0.0)
    >>> p.place(SandboxSpec(image="demo/base"), now=0.0)
    'n1'
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from corral.errors import CapacityError, InvalidRequest
from corral.spec import NodeStatus, SandboxInfo, SandboxSpec

__all__ = [
    "NodeReport",
    "PlacementPolicy",
    "Placer",
    "place_and_create",
    "NODE_LABEL_PREFIX",
]

NODE_LABEL_PREFIX = "corral.node/"
"""Spec labels starting with this prefix are placement constraints on node labels:
``{"corral.node/pool": "onprem"}`` places only on nodes labelled ``pool=onprem``."""


@dataclass(frozen=True, slots=True)
class NodeReport:
    """What a placer needs of a node's :class:`~corral.spec.NodeStatus` (plus liveness).

    ``max_sandboxes`` 0 means the node sets no limit of its own; the placer then takes
    ``PlacementPolicy.default_capacity``. ``mem_total``/``scratch_total`` 0 mean the node
    does not report them, and their floors are not applied.
    """

    node_id: str
    max_sandboxes: int = 0
    sandboxes: int = 0
    cpus: int = 0
    load1: float = 0.0
    mem_total: int = 0
    mem_available: int = 0
    scratch_total: int = 0
    scratch_free: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    backends: frozenset[str] = frozenset({"container"})
    default_backend: str = "container"
    draining: bool = False
    lost: bool = False

    @classmethod
    def from_status(
        cls, st: NodeStatus, *, draining: bool = False, lost: bool = False
    ) -> NodeReport:
        ok = frozenset(b.kind for b in st.backends if b.ok) or frozenset({st.default_backend})
        return cls(
            node_id=st.node_id,
            max_sandboxes=st.max_sandboxes,
            sandboxes=st.sandboxes,
            cpus=st.cpus,
            load1=st.load1,
            mem_total=st.mem_total,
            mem_available=st.mem_available,
            scratch_total=st.scratch_total,
            scratch_free=st.scratch_free,
            labels=dict(st.labels),
            backends=ok,
            default_backend=st.default_backend,
            draining=draining,
            lost=lost,
        )


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """Knobs of a placer; the defaults suit container sandboxes."""

    k: int = 2
    """Candidates sampled per decision (power-of-k choices)."""
    default_capacity: int = 3200
    """Sandboxes a node that reports no ``max_sandboxes`` is taken to hold."""
    sandbox_memory: int = 2 << 20
    """Host memory one new sandbox is expected to take (idle containers measured ~1.4 MiB);
    subtracted from a node's reported free memory for each overlaid placement."""
    sandbox_scratch: int = 1 << 20
    """Scratch bytes one new sandbox is expected to take at first."""
    min_mem_free: int = 256 << 20
    """A node whose free memory (less overlay) would fall below this gets no more."""
    min_scratch_free: int = 256 << 20
    """Likewise for the scratch filesystem."""
    load_weight: float = 0.25
    """How much the host's load per CPU counts next to its sandbox fill (0..1 each)."""
    retries: int = 3
    """Re-placements after node refusals before the request fails."""
    burst_at: float = 0.8
    """On-prem fill (sandboxes expected / capacity, over on-prem nodes) from which creates
    that may burst go to the cloud pool."""
    pool_label: str = "pool"
    """Node label naming its pool; nodes without it count as on-prem."""
    cloud_pool: str = "cloud"
    """The value of ``pool_label`` that marks cloud nodes: they get only bursts (and specs
    that ask for that pool by a ``corral.node/pool`` constraint)."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise InvalidRequest(f"placement k must be at least 1, not {self.k}")
        if self.retries < 0:
            raise InvalidRequest(f"placement retries cannot be negative ({self.retries})")


class _NodeView:
    """One node as this placer sees it: the last report plus its own placements since."""

    __slots__ = ("report", "at", "overlay", "full")

    def __init__(self, report: NodeReport, at: float) -> None:
        self.report = report
        self.at = at
        self.overlay: deque[float] = deque()  # times of own placements not yet reported
        self.full = False  # refused by the node since its last report

    def capacity(self, policy: PlacementPolicy) -> int:
        return self.report.max_sandboxes or policy.default_capacity

    def expected(self) -> int:
        return self.report.sandboxes + len(self.overlay)


class Placer:
    """One placement instance; several may run at once without talking to each other.

    Feed it node reports (:meth:`report`, :meth:`forget`), ask it for a node
    (:meth:`place`), and tell it how the node answered (:meth:`refused`, :meth:`failed`).
    """

    def __init__(self, policy: PlacementPolicy | None = None, *, seed: int | None = None) -> None:
        self.policy = policy or PlacementPolicy()
        self._nodes: dict[str, _NodeView] = {}
        self._rng = random.Random(seed)
        # candidates per (backend, node-label constraints), rebuilt on the next decision
        # after any report changes what a node is or has
        self._eligible: dict[
            tuple[str | None, tuple[tuple[str, str], ...], bool], list[_NodeView]
        ] = {}
        # on-prem fill, recounted after reports change it, kept up by own placements between
        self._onprem_dirty = True
        self._onprem_cap = 0
        self._onprem_used = 0

    # ------------------------------------------------------------------ reports
    def report(self, rep: NodeReport, now: float) -> None:
        """A node's fresh report, taken at ``now``: placements made before it are in it."""
        self._onprem_dirty = True
        view = self._nodes.get(rep.node_id)
        if view is None:
            self._nodes[rep.node_id] = _NodeView(rep, now)
            self._eligible.clear()
            return
        old = view.report
        view.report, view.at, view.full = rep, now, False
        while view.overlay and view.overlay[0] <= now:
            view.overlay.popleft()
        if (old.labels, old.backends, old.draining, old.lost, old.default_backend) != (
            rep.labels,
            rep.backends,
            rep.draining,
            rep.lost,
            rep.default_backend,
        ):
            self._eligible.clear()

    def forget(self, node_id: str) -> None:
        """Drop a node (it left the cluster)."""
        if self._nodes.pop(node_id, None) is not None:
            self._eligible.clear()
            self._onprem_dirty = True

    def nodes(self) -> list[NodeReport]:
        return [v.report for v in self._nodes.values()]

    def expected(self, node_id: str) -> int:
        """Sandboxes the node is expected to hold: its report plus this placer's overlay."""
        return self._nodes[node_id].expected()

    def onprem_fill(self) -> float:
        """Expected sandboxes / capacity over the live on-prem nodes (1.0 when none)."""
        if self._onprem_dirty:
            pol, cap, used = self.policy, 0, 0
            for v in self._nodes.values():
                if self._is_onprem(v) and not v.report.lost and not v.report.draining:
                    cap += v.capacity(pol)
                    used += v.expected()
            self._onprem_cap, self._onprem_used, self._onprem_dirty = cap, used, False
        return self._onprem_used / self._onprem_cap if self._onprem_cap else 1.0

    def bursting(self) -> bool:
        """Whether on-prem fill has reached ``burst_at`` (eligible creates go to the cloud)."""
        return self.onprem_fill() >= self.policy.burst_at

    def _is_onprem(self, v: _NodeView) -> bool:
        return v.report.labels.get(self.policy.pool_label) != self.policy.cloud_pool

    def cloud_room(self, spec: SandboxSpec) -> bool:
        """Whether some live cloud node that fits ``spec`` can still take one (as far as this
        placer knows): when not, a burst create waits for the autoscaler."""
        return any(
            not v.full and v.expected() < v.capacity(self.policy) and self._room(v)
            for v in self._candidates(spec, cloud=True)
        )

    def free_slots(self, spec: SandboxSpec | None = None) -> int:
        """Sandboxes the eligible nodes can still take, as far as this placer knows."""
        spec = spec or SandboxSpec(image="-")
        cands = self._candidates(spec) + self._candidates(spec, cloud=True)
        return sum(max(0, v.capacity(self.policy) - v.expected()) for v in set(cands) if not v.full)

    # ------------------------------------------------------------------ decisions
    def place(
        self,
        spec: SandboxSpec,
        now: float,
        exclude: Iterable[str] = (),
        *,
        may_burst: bool = False,
    ) -> str:
        """The node for ``spec``; the placement is overlaid on it at once.

        CapacityError (naming why) when no node can take it; ``exclude``: nodes already
        tried for this request. ``may_burst``: the spec's image is in the cloud pool's
        store; container work then goes to the cloud pool once on-prem fill reaches
        ``burst_at`` (and back on-prem if the cloud has no room). VM work never bursts."""
        cloud = may_burst and spec.backend in (None, "container") and self.bursting()
        if cloud:
            try:
                return self._place(self._candidates(spec, cloud=True), spec, now, exclude)
            except CapacityError:
                pass
        return self._place(self._candidates(spec), spec, now, exclude)

    def _place(
        self, cands: list[_NodeView], spec: SandboxSpec, now: float, exclude: Iterable[str]
    ) -> str:
        if not cands:
            raise CapacityError(self._why_none(spec))
        skip = set(exclude)
        pol = self.policy
        best: _NodeView | None = None
        best_score = 0.0
        # k samples first; if all k are unusable, fall back to a scan of every candidate,
        # so a nearly full fleet still finds its last free slots
        n = len(cands)
        picks = [cands[self._rng.randrange(n)] for _ in range(min(pol.k, n))]
        for scan in (picks, cands):
            for v in scan:
                if v.full or v.report.node_id in skip:
                    continue
                cap = v.capacity(pol)
                exp = v.expected()
                if exp >= cap or not self._room(v):
                    continue
                rep = v.report
                score = exp / cap
                if rep.cpus:
                    score += pol.load_weight * min(1.0, rep.load1 / rep.cpus)
                if best is None or score < best_score:
                    best, best_score = v, score
            if best is not None:
                break
        if best is None:
            raise CapacityError(self._why_full(len(cands), skip))
        best.overlay.append(now)
        if not self._onprem_dirty and self._is_onprem(best):
            self._onprem_used += 1
        return best.report.node_id

    def refused(self, node_id: str) -> None:
        """The node refused the last placement on it (full): undo it, and place nothing
        more there until its next report."""
        v = self._nodes.get(node_id)
        if v is not None:
            if v.overlay:
                v.overlay.pop()
            v.full = True
            self._onprem_dirty = True

    def failed(self, node_id: str) -> None:
        """A placement on the node did not produce a sandbox (a bad request): undo it."""
        v = self._nodes.get(node_id)
        if v is not None and v.overlay:
            v.overlay.pop()
            self._onprem_dirty = True

    # ------------------------------------------------------------------ helpers
    def _room(self, v: _NodeView) -> bool:
        pol, rep, extra = self.policy, v.report, len(v.overlay) + 1
        if rep.mem_total and rep.mem_available - extra * pol.sandbox_memory < pol.min_mem_free:
            return False
        return not (
            rep.scratch_total
            and rep.scratch_free - extra * pol.sandbox_scratch < pol.min_scratch_free
        )

    def _candidates(self, spec: SandboxSpec, cloud: bool = False) -> list[_NodeView]:
        """Nodes that fit ``spec``: the cloud pool's with ``cloud``; else, unless the spec
        names a pool itself, the on-prem ones."""
        need = tuple(
            sorted(
                (k[len(NODE_LABEL_PREFIX) :], val)
                for k, val in spec.labels.items()
                if k.startswith(NODE_LABEL_PREFIX)
            )
        )
        key = (spec.backend, need, cloud)
        got = self._eligible.get(key)
        if got is None:
            pol = self.policy
            names_pool = any(k == pol.pool_label for k, _ in need)
            got = [
                v
                for v in self._nodes.values()
                if _fits(v.report, spec.backend, need)
                and (names_pool or self._is_onprem(v) != cloud)
            ]
            self._eligible[key] = got
        return got

    def _why_none(self, spec: SandboxSpec) -> str:
        if not self._nodes:
            return "no nodes in the cluster: start one (corral cluster up) or wait for it"
        live = [r for r in self.nodes() if not r.lost and not r.draining]
        if not live:
            return f"all {len(self._nodes)} nodes are lost or draining"
        want = spec.backend or "the default backend"
        cons = {k: v for k, v in spec.labels.items() if k.startswith(NODE_LABEL_PREFIX)}
        return f"no node fits: none of {len(live)} live nodes has backend {want}" + (
            f" and labels {cons}" if cons else ""
        )

    def _why_full(self, n: int, skip: set[str]) -> str:
        tried = f" ({len(skip)} refused this request)" if skip else ""
        return (
            f"all {n} nodes that fit are full or low on memory/scratch{tried}; "
            f"retry later or add nodes"
        )


def _fits(rep: NodeReport, backend: str | None, need: tuple[tuple[str, str], ...]) -> bool:
    if rep.lost or rep.draining:
        return False
    if (backend or rep.default_backend) not in rep.backends:
        return False
    return all(rep.labels.get(k) == v for k, v in need)


async def place_and_create(
    placer: Placer,
    spec: SandboxSpec,
    create: Callable[[str, SandboxSpec], Awaitable[SandboxInfo]],
    clock: Callable[[], float],
    *,
    may_burst: bool = False,
) -> SandboxInfo:
    """Place ``spec`` and ask the chosen node to create it; on a refusal (CapacityError
    from the node) place it elsewhere, at most ``policy.retries`` more times.

    Any other error is raised as is, after undoing the overlay: a transport error may mean
    the node made the sandbox anyway, and retrying elsewhere could make it twice."""
    tried: list[str] = []
    last: CapacityError | None = None
    for _ in range(placer.policy.retries + 1):
        try:
            node = placer.place(spec, clock(), exclude=tried, may_burst=may_burst)
        except CapacityError as exc:
            if last is None:
                raise
            raise CapacityError(f"{exc.message}; last refusal: {last.message}") from None
        try:
            return await create(node, spec)
        except CapacityError as exc:
            placer.refused(node)
            tried.append(node)
            last = exc
        except BaseException:
            placer.failed(node)
            raise
    assert last is not None
    raise CapacityError(
        f"{len(tried)} nodes refused the sandbox ({', '.join(tried)}); last: {last.message}"
    )
