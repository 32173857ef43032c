"""The cloud pool's scaler and the control-plane event log, over fake nodes (no Ray)."""

from __future__ import annotations

import json

import pytest

from corral.cluster import FleetClient
from corral.cluster.autoscale import CloudPool, CloudScaler
from corral.cluster.events import ControlEvents
from corral.errors import CapacityError, ImageNotFound, InvalidRequest
from corral.spec import NodeStatus, SandboxSpec
from corral.testing import FakeNode

SPEC = SandboxSpec(image="demo/base")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.t += s


class Shared(FakeNode):
    """A fake node reading the shared store ``/shared``."""

    async def node_status(self) -> NodeStatus:
        st = await super().node_status()
        return st.model_copy(update={"store": "/shared"})


class FakeScale:
    """The Ray side: a launch brings a cloud node up on the next poke (or never)."""

    def __init__(self, fleet: FleetClient, *, comes_up: bool = True) -> None:
        self.fleet, self.comes_up = fleet, comes_up
        self.requests: list[int] = []
        self.launched: list[str] = []
        self.released: list[str] = []
        self.scaler: CloudScaler | None = None
        self.nodes: dict[str, FakeNode] = {}

    def request(self, nodes: int) -> None:
        self.requests.append(nodes)

    def launch(self, name: str) -> None:
        self.launched.append(name)

    async def release(self, name: str, up: bool) -> bool:
        node = self.nodes.get(name)
        if node is not None and await node.sandbox_list():
            return False
        self.released.append(name)
        return True

    async def poke(self) -> None:
        assert self.scaler is not None
        for name in self.launched:
            if self.comes_up and name not in self.nodes and name not in self.released:
                nid = f"cl{len(self.nodes)}"
                self.nodes[name] = Shared(nid, max_sandboxes=3, labels={"pool": "cloud"})
                self.fleet.add_node(nid, self.nodes[name])
                self.scaler.seen(name, nid)
        await self.fleet.refresh()


def _pool(**kw: object) -> CloudPool:
    cfg = json.dumps({"labels": {"pool": "cloud"}})
    return CloudPool(node_config=cfg, store="/shared", **kw)  # type: ignore[arg-type]


async def _setup(
    comes_up: bool = True, **kw: object
) -> tuple[FleetClient, CloudScaler, FakeScale, ControlEvents, Clock]:
    clock = Clock()
    log = ControlEvents()
    onprem = Shared("p0", max_sandboxes=5, labels={"pool": "onprem"})
    fleet = FleetClient({"p0": onprem}, seed=3, events=log, clock=clock)
    ops = FakeScale(fleet, comes_up=comes_up)
    scaler = CloudScaler(fleet, _pool(**kw), ops, log, ops.poke, clock=clock, sleep=clock.sleep)
    ops.scaler = scaler
    await fleet.refresh()
    return fleet, scaler, ops, log, clock


async def test_burst_launches_a_cloud_node_and_idle_releases_it() -> None:
    fleet, scaler, ops, log, clock = await _setup(idle_after=10.0)
    first = [await fleet.sandbox_create(SPEC) for _ in range(4)]
    assert {i.node_id for i in first} == {"p0"} and ops.launched == []
    # 80% on-prem: the next create waits for a cloud node, then lands there
    got = await fleet.sandbox_create(SPEC)
    assert got.node_id == "cl0" and ops.launched == ["corral-node-cloud0"]
    assert ops.requests[-1] == 1
    # the cloud node has room: no second launch while it lasts
    more = [await fleet.sandbox_create(SPEC) for _ in range(2)]
    assert {i.node_id for i in more} == {"cl0"} and len(ops.launched) == 1
    # a cloud node holding sandboxes is never released, however long
    clock.t += 100
    await fleet.refresh()
    await scaler.tick()
    assert ops.released == []
    for i in [got, *more]:
        await fleet.sandbox_destroy(i.id)
    await fleet.refresh()
    await scaler.tick()  # empty from now
    clock.t += 11
    await scaler.tick()
    assert ops.released == ["corral-node-cloud0"] and ops.requests[-1] == 0
    assert "cl0" not in fleet.node_ids() and fleet.lost_nodes() == []
    kinds = [(e.kind, e.detail.get("action") or e.detail.get("state")) for e in log.after(0)]
    assert kinds == [
        ("burst", "on"),
        ("autoscale", "request"),
        ("autoscale", "joined"),
        ("autoscale", "release"),
    ]


async def test_no_cloud_node_in_time_goes_on_prem_then_fails_clearly() -> None:
    fleet, scaler, ops, log, clock = await _setup(comes_up=False, wait=5.0)
    for _ in range(4):
        await fleet.sandbox_create(SPEC)
    got = await fleet.sandbox_create(SPEC)  # waited 5 s for the cloud, then on-prem
    assert got.node_id == "p0" and len(ops.launched) == 1
    with pytest.raises(CapacityError, match="full"):
        await fleet.sandbox_create(SPEC)
    assert len(ops.launched) == 1  # one launch on its way is enough
    assert [e.detail["action"] for e in log.after(0, kinds=["autoscale"])] == [
        "request",
        "timeout",
        "timeout",
    ]
    clock.t += 100
    await scaler.tick()  # the launch that never came up is taken back
    assert ops.released == ["corral-node-cloud0"] and ops.requests[-1] == 0


async def test_images_missing_from_the_cloud_store_never_burst() -> None:
    fleet, scaler, ops, _, _ = await _setup()
    for _ in range(4):
        await fleet.sandbox_create(SPEC)
    with pytest.raises(ImageNotFound):
        await fleet.sandbox_create(SandboxSpec(image="demo/absent"))
    assert ops.launched == []


def test_pool_config_is_checked() -> None:
    with pytest.raises(InvalidRequest, match='pool = "cloud"'):
        CloudPool(node_config=json.dumps({"labels": {"pool": "onprem"}}))
    with pytest.raises(InvalidRequest, match="negative"):
        _pool(max_nodes=-1)
    assert CloudPool.from_json(_pool().to_json()) == _pool()


async def test_fleet_events_merge_control_plane_events_under_one_cursor() -> None:
    clock = Clock()
    log = ControlEvents()
    nodes = {n: FakeNode(n) for n in ("n0", "n1")}
    fleet = FleetClient(nodes, events=log, clock=clock, status_timeout=0.05, lost_after=1)  # type: ignore[arg-type]
    await fleet.refresh()
    a = await fleet.sandbox_create(SandboxSpec(image="demo/base", labels={"corral.job": "j1"}))
    log.add("lease_expired", job="j1", count=1)
    log.add("autoscale", action="request")
    page = await fleet.events(limit=1000)
    assert {e.node_id for e in page} == {"n0", "n1", "cluster"} or {e.node_id for e in page} >= {
        "cluster",
        a.node_id,
    }
    ctl = [e for e in page if e.node_id == "cluster"]
    assert [e.kind for e in ctl] == ["lease_expired", "autoscale"]
    # the cursor after everything resumes with nothing repeated, then picks up new ones
    assert await fleet.events(after=page[-1].cursor) == []
    log.add("node_lost", node="n9")
    nxt = await fleet.events(after=page[-1].cursor)
    assert [e.kind for e in nxt] == ["node_lost"]
    # filters: kinds, and a job label matches the job's control-plane events only
    assert [e.kind for e in await fleet.events(kinds=["autoscale"])] == ["autoscale"]
    by_job = await fleet.events(labels={"corral.job": "j1"})
    assert "lease_expired" in [e.kind for e in by_job] and "autoscale" not in [
        e.kind for e in by_job
    ]
    # a paged walk of limit 1 sees every event exactly once
    seen, cur = [], None
    while True:
        got = await fleet.events(after=cur, limit=1)
        if not got:
            break
        seen.append((got[0].node_id, got[0].id))
        cur = got[0].cursor
    assert len(seen) == len(set(seen)) == len(await fleet.events(limit=1000))


async def test_node_lost_and_back_are_control_plane_events() -> None:
    class Quiet(FakeNode):
        quiet = False

        async def node_status(self) -> NodeStatus:
            if self.quiet:
                raise ValueError("garbage")
            return await super().node_status()

    clock = Clock()
    log = ControlEvents()
    q = Quiet("q0")
    fleet = FleetClient({"q0": q, "ok": FakeNode("ok")}, events=log, clock=clock, lost_after=5)
    await fleet.refresh()
    q.quiet = True
    clock.t += 6
    await fleet.refresh()
    q.quiet = False
    await fleet.refresh()
    assert [(e.kind, e.detail["node"]) for e in log.after(0)] == [
        ("node_lost", "q0"),
        ("node_back", "q0"),
    ]


def test_control_event_ids_survive_a_restart_of_the_log() -> None:
    t = [100.0]
    before = ControlEvents(clock=lambda: t[0])
    cursor = before.add("burst", state="on").id
    t[0] += 1  # a restarted control plane: a new, empty log
    after = ControlEvents(clock=lambda: t[0])
    assert [e.kind for e in after.after(cursor)] == [] and after.add("x").id > cursor
    assert len(after.after(cursor)) == 1


def test_no_node_may_take_the_control_plane_name() -> None:
    with pytest.raises(InvalidRequest, match="cluster"):
        FleetClient({"cluster": FakeNode("cluster")})


def test_cloud_pool_cli_refuses_a_node_config_outside_the_cloud_pool(tmp_path: object) -> None:
    from pathlib import Path

    from typer.testing import CliRunner

    from corral.cli.app import app

    cfg = Path(str(tmp_path)) / "node.toml"
    cfg.write_text('[node]\nstate_dir = "/tmp/x"\n[node.labels]\npool = "onprem"\n')
    r = CliRunner().invoke(app, ["cluster", "cloud-pool", "--config", str(cfg)])
    assert r.exit_code != 0 and 'pool = "cloud"' in r.output


async def test_a_burst_larger_than_one_cloud_node_launches_another() -> None:
    import asyncio

    fleet, scaler, ops, log, clock = await _setup(max_nodes=3)
    for _ in range(4):
        await fleet.sandbox_create(SPEC)
    # 5 burst creates at once, cloud nodes of 3: two cloud nodes, all placed in the cloud
    got = await asyncio.gather(*(fleet.sandbox_create(SPEC) for _ in range(5)))
    assert {i.node_id for i in got} <= {"cl0", "cl1"} and len(ops.launched) == 2
    assert ops.requests[-1] == 2


async def test_a_lost_node_back_under_a_new_address_is_a_node_back_event() -> None:
    clock = Clock()
    log = ControlEvents()
    fleet = FleetClient({"a0": FakeNode("a0")}, events=log, clock=clock, lost_after=5)

    class Dead(FakeNode):
        async def node_status(self) -> NodeStatus:
            raise ValueError("no answer")

    await fleet.refresh()
    fleet.add_node("a0", Dead("a0"))  # its agent died
    clock.t += 6
    await fleet.refresh()
    fleet.add_node("a0", FakeNode("a0"))  # a new agent, a new address: lost until it answers
    assert fleet.lost_nodes() == ["a0"]
    await fleet.refresh()
    assert [e.kind for e in log.after(0, kinds=["node_lost", "node_back"])] == [
        "node_lost",
        "node_back",
    ]


async def test_reconfigured_pool_applies_to_later_launches() -> None:
    fleet, scaler, ops, _, _ = await _setup()
    other = FakeScale(fleet)
    other.scaler = scaler
    scaler.reconfigure(
        CloudPool(node_config=_pool().node_config, store="/elsewhere", max_nodes=0), other
    )
    assert fleet.cloud_store == "/elsewhere" and scaler.pool.max_nodes == 0
