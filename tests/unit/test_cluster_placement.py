"""The placement core: filters, power-of-k, the overlay, node refusals and retries."""

from __future__ import annotations

import pytest

from corral.cluster import NodeReport, PlacementPolicy, Placer, place_and_create
from corral.errors import CapacityError, InvalidRequest, TransportError
from corral.spec import SandboxInfo, SandboxSpec

SPEC = SandboxSpec(image="demo/base")


def _placer(*reps: NodeReport, **pol: int) -> Placer:
    p = Placer(PlacementPolicy(**pol), seed=7)  # type: ignore[arg-type]
    for r in reps:
        p.report(r, now=0.0)
    return p


def test_filters_backend_labels_draining_lost() -> None:
    p = _placer(
        NodeReport(node_id="vm", backends=frozenset({"microvm"}), default_backend="microvm"),
        NodeReport(node_id="cloud", labels={"pool": "cloud"}),
        NodeReport(node_id="onprem", labels={"pool": "onprem"}),
        NodeReport(node_id="gone", labels={"pool": "onprem"}, lost=True),
        NodeReport(node_id="drain", labels={"pool": "onprem"}, draining=True),
    )
    want_onprem = SandboxSpec(image="x", labels={"corral.node/pool": "onprem"})
    assert {p.place(want_onprem, 1.0) for _ in range(20)} == {"onprem"}
    want_vm = SandboxSpec(image="x", backend="microvm")
    assert p.place(want_vm, 1.0) == "vm"
    with pytest.raises(CapacityError, match="backend gpu"):
        p.place(SandboxSpec(image="x", backend="gpu"), 1.0)


def test_memory_and_scratch_floors() -> None:
    mib = 1 << 20
    p = _placer(
        NodeReport(node_id="low", mem_total=8 << 30, mem_available=100 * mib),
        NodeReport(node_id="noscratch", scratch_total=1 << 30, scratch_free=10 * mib),
        NodeReport(node_id="ok", mem_total=8 << 30, mem_available=4 << 30),
    )
    assert {p.place(SPEC, 1.0) for _ in range(30)} == {"ok"}


def test_no_nodes_and_all_lost_say_so() -> None:
    with pytest.raises(CapacityError, match="no nodes"):
        Placer().place(SPEC, 0.0)
    with pytest.raises(CapacityError, match="lost or draining"):
        _placer(NodeReport(node_id="a", lost=True)).place(SPEC, 0.0)
    with pytest.raises(InvalidRequest):
        PlacementPolicy(k=0)


def test_overlay_spreads_a_burst_between_reports() -> None:
    # reports say every node is empty; without the overlay a burst would pile on one
    p = _placer(*(NodeReport(node_id=f"n{i}", max_sandboxes=10) for i in range(4)))
    for _ in range(40):
        p.place(SPEC, now=1.0)
    assert [p.expected(f"n{i}") for i in range(4)] == [10, 10, 10, 10]
    with pytest.raises(CapacityError, match="full"):
        p.place(SPEC, now=1.0)


def test_report_absorbs_overlay_up_to_its_time() -> None:
    p = _placer(NodeReport(node_id="a", max_sandboxes=100))
    for t in (1.0, 2.0, 3.0):
        p.place(SPEC, now=t)
    # the node reports at t=2.5 holding the two placements made before then
    p.report(NodeReport(node_id="a", max_sandboxes=100, sandboxes=2), now=2.5)
    assert p.expected("a") == 3


def test_power_of_k_prefers_the_less_loaded() -> None:
    p = _placer(
        NodeReport(node_id="busy", max_sandboxes=100, sandboxes=90),
        NodeReport(node_id="idle", max_sandboxes=100, sandboxes=0),
        k=2,
    )
    # with both sampled (k=2 of 2, with replacement) the idle one wins whenever it is seen
    got = [p.place(SPEC, now=1.0) for _ in range(30)]
    assert got.count("idle") > got.count("busy")


def test_refusal_marks_full_until_next_report() -> None:
    p = _placer(NodeReport(node_id="a", max_sandboxes=5), NodeReport(node_id="b", max_sandboxes=5))
    first = p.place(SPEC, 1.0)
    p.refused(first)
    other = "b" if first == "a" else "a"
    assert {p.place(SPEC, 1.0) for _ in range(4)} == {other}
    p.report(NodeReport(node_id=first, max_sandboxes=5), now=2.0)
    assert first in {p.place(SPEC, 2.0) for _ in range(6)}


class _Node:
    """Admission like a real node: refuses past its own max."""

    def __init__(self, node_id: str, max_sandboxes: int) -> None:
        self.node_id, self.max, self.live = node_id, max_sandboxes, 0

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        if self.live >= self.max:
            raise CapacityError(f"node {self.node_id} is full")
        self.live += 1
        return SandboxInfo(
            id=f"sb-{self.live:012d}-{self.node_id}",
            state="running",
            image=spec.image,
            image_digest="",
            spec=spec,
            created_at=0,
            last_active_at=0,
            node_id=self.node_id,
        )


async def test_refusal_replaces_elsewhere_never_twice() -> None:
    nodes = {"a": _Node("a", 0), "b": _Node("b", 3)}  # a's report says room; a refuses
    p = _placer(NodeReport(node_id="a", max_sandboxes=3), NodeReport(node_id="b", max_sandboxes=3))

    async def create(nid: str, spec: SandboxSpec) -> SandboxInfo:
        return await nodes[nid].create(spec)

    got = [await place_and_create(p, SPEC, create, lambda: 1.0) for _ in range(3)]
    assert {i.node_id for i in got} == {"b"} and nodes["b"].live == 3
    with pytest.raises(CapacityError):
        await place_and_create(p, SPEC, create, lambda: 1.0)
    assert nodes["a"].live == 0 and nodes["b"].live == 3


async def test_bounded_retries_and_ambiguous_errors_not_retried() -> None:
    reps = [NodeReport(node_id=f"n{i}", max_sandboxes=9) for i in range(6)]
    p = _placer(*reps, retries=2)
    calls: list[str] = []

    async def refuse(nid: str, spec: SandboxSpec) -> SandboxInfo:
        calls.append(nid)
        raise CapacityError(f"node {nid} is full")

    with pytest.raises(CapacityError, match="3 nodes refused"):
        await place_and_create(p, SPEC, refuse, lambda: 1.0)
    assert len(calls) == 3 and len(set(calls)) == 3

    p2 = _placer(*reps)
    calls.clear()

    async def cut(nid: str, spec: SandboxSpec) -> SandboxInfo:
        calls.append(nid)
        raise TransportError("connection reset")

    with pytest.raises(TransportError):
        await place_and_create(p2, SPEC, cut, lambda: 1.0)
    assert len(calls) == 1  # may have been made: never tried on another node
    assert p2.expected(calls[0]) == 0  # the overlay was undone


def test_burst_only_eligible_container_work_above_threshold() -> None:
    vm = frozenset({"container", "microvm"})
    p = _placer(
        NodeReport(node_id="op", max_sandboxes=10, sandboxes=8, backends=vm),
        NodeReport(node_id="cl", max_sandboxes=10, labels={"pool": "cloud"}, backends=vm),
    )
    assert p.onprem_fill() == 0.8 and p.bursting()
    assert p.place(SPEC, 1.0) == "op"  # not eligible (image not in the cloud store)
    assert p.place(SPEC, 1.0, may_burst=True) == "cl"
    assert p.place(SandboxSpec(image="x", backend="microvm"), 1.0, may_burst=True) == "op"
    # the cloud full: eligible work falls back on-prem rather than failing
    p.report(NodeReport(node_id="cl", max_sandboxes=1, sandboxes=1, labels={"pool": "cloud"}), 2.0)
    p.report(NodeReport(node_id="op", max_sandboxes=10, sandboxes=8, backends=vm), 2.0)
    assert p.place(SPEC, 2.0, may_burst=True) == "op"
