"""``corral bench placement``: the placement core alone, against simulated nodes.

What it answers: can one core of control plane decide fast enough for a DSec-sized burst
(32K sandboxes over 160 nodes), without errors and without pushing any node past its
capacity, when several placers work at once on stale reports?

The model: each simulated node admits like a real one (it refuses past its
``max_sandboxes`` with CapacityError and counts what it holds); ``placers`` independent
:class:`~corral.cluster.Placer` instances share the burst round-robin and never talk to
each other; every ``report_every`` decisions all nodes report to all placers (so between
reports each placer sees only its own placements: the overlay). Refusals are re-placed by
:func:`~corral.cluster.place_and_create`, as in the cluster. There is no I/O, so the
figures are the control plane's own cost; they say nothing about the network or the nodes.
"""

from __future__ import annotations

import time
from typing import Any

from corral.bench.stats import p50, p99
from corral.cluster import NodeReport, PlacementPolicy, Placer, place_and_create
from corral.errors import CapacityError
from corral.spec import SandboxInfo, SandboxSpec

__all__ = ["placement"]

_MIB = 1 << 20


class _SimNode:
    """Admission and figures of a node, with no sandboxes behind them."""

    __slots__ = ("node_id", "max", "live", "mem_total", "info")

    def __init__(self, node_id: str, max_sandboxes: int, spec: SandboxSpec) -> None:
        self.node_id, self.max, self.live = node_id, max_sandboxes, 0
        self.mem_total = 256 << 30
        # one answer reused: the bench times the placer, not model building
        self.info = SandboxInfo(
            id=f"sb-000000000000-{node_id}",
            state="running",
            image=spec.image,
            image_digest="",
            spec=spec,
            created_at=0.0,
            last_active_at=0.0,
            node_id=node_id,
        )

    def report(self) -> NodeReport:
        return NodeReport(
            node_id=self.node_id,
            max_sandboxes=self.max,
            sandboxes=self.live,
            cpus=64,
            load1=self.live / 100,
            mem_total=self.mem_total,
            mem_available=self.mem_total - (2 << 30) - self.live * int(1.4 * _MIB),
        )

    def admit(self) -> SandboxInfo:
        if self.live >= self.max:
            raise CapacityError(f"node {self.node_id} is full ({self.live}/{self.max})")
        self.live += 1
        return self.info


async def placement(
    nodes: int, sandboxes: int, capacity: int, placers: int, report_every: int, k: int
) -> dict[str, Any]:
    spec = SandboxSpec(image="bench/placement")
    sims = {f"n{i}": _SimNode(f"n{i}", capacity, spec) for i in range(nodes)}
    pol = PlacementPolicy(k=k)
    ps = [Placer(pol, seed=i) for i in range(placers)]
    clock = time.perf_counter

    def report_all() -> None:
        now = clock()
        reps = [s.report() for s in sims.values()]
        for p in ps:
            for r in reps:
                p.report(r, now)

    refusals = 0

    async def create(nid: str, s: SandboxSpec) -> SandboxInfo:
        nonlocal refusals
        try:
            return sims[nid].admit()
        except CapacityError:
            refusals += 1
            raise

    report_all()
    lat: list[float] = []
    errors = 0
    first_error = ""
    t0 = clock()
    for i in range(sandboxes):
        if i and i % report_every == 0:
            report_all()
        a = clock()
        try:
            await place_and_create(ps[i % placers], spec, create, clock)
        except CapacityError as exc:
            errors += 1
            first_error = first_error or exc.message
        lat.append(clock() - a)
    total = clock() - t0
    decisions = sandboxes + refusals
    held = sum(s.live for s in sims.values())
    out: dict[str, Any] = {
        "scenario": "placement",
        "nodes": nodes,
        "sandboxes": sandboxes,
        "capacity_per_node": capacity,
        "placers": placers,
        "report_every": report_every,
        "k": k,
        "placements_per_s": round(sandboxes / total, 1),
        "decisions_per_s": round(decisions / total, 1),
        "burst_admit_s": round(total, 3),
        "errors": errors,
        "refusals": refusals,
        "admitted": held,
        "overcommit_max": max(s.live - s.max for s in sims.values()),
        "fill_max": round(max(s.live for s in sims.values()) / capacity, 3),
        "fill_min": round(min(s.live for s in sims.values()) / capacity, 3),
        "p50_decision_ms": round(p50(lat) * 1000, 4),
        "p99_decision_ms": round(p99(lat) * 1000, 4),
    }
    if first_error:
        out["first_error"] = first_error
    return out
