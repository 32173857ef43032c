"""FleetClient over fake nodes: routing by id, fan-out, merged event cursors, node loss."""

from __future__ import annotations

import asyncio

import pytest

import corral
from corral.cluster import FleetClient
from corral.errors import CapacityError, InvalidRequest, SandboxNotFound, TransportError
from corral.spec import ExecRequest, NodeStatus, SandboxSpec
from corral.testing import FakeNode

SPEC = SandboxSpec(image="demo/base", labels={"job": "j"})


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Silent(FakeNode):
    """A node whose status call can be made to hang (a partition) or answer garbage."""

    mode = "ok"

    async def node_status(self) -> NodeStatus:
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode == "garbage":
            raise ValueError("not json")
        return await super().node_status()


async def _fleet(n: int = 3, **kw: object) -> tuple[FleetClient, list[Silent], Clock]:
    clock = Clock()
    nodes = [Silent(f"n{i}", max_sandboxes=50) for i in range(n)]
    fleet = FleetClient(
        {x.node_id: x for x in nodes},
        clock=clock,
        seed=1,
        status_timeout=0.05,
        **kw,  # type: ignore[arg-type]
    )
    await fleet.refresh()
    return fleet, nodes, clock


async def test_sdk_over_fleet_routes_each_call_to_its_node() -> None:
    fleet, nodes, _ = await _fleet()
    async with corral.AsyncClient(ops=fleet) as client:
        sbs = [await client.sandboxes.create(image="demo/base") for _ in range(9)]
        assert {s.info.node_id for s in sbs} == {"n0", "n1", "n2"}
        for sb in sbs:
            r = await sb.exec(["echo", sb.id])
            assert r.stdout == f"{sb.id}\n".encode()
            await sb.files.write("/f", b"x")
            assert sb.id in {i.id for i in await nodes[int(sb.info.node_id[1])].sandbox_list()}
        assert len(await client.sandboxes.list()) == 9


async def test_bad_and_foreign_ids_are_not_found() -> None:
    fleet, _, _ = await _fleet()
    with pytest.raises(SandboxNotFound, match="not a sandbox id"):
        await fleet.sandbox_get("nope")
    with pytest.raises(SandboxNotFound, match="node zz is not in the cluster"):
        await fleet.exec("sb-000000000000-zz", ExecRequest(cmd=["true"]))
    with pytest.raises(InvalidRequest):
        FleetClient({"Bad_Id": FakeNode("n1")})


async def test_pause_by_labels_spans_nodes() -> None:
    fleet, _, _ = await _fleet()
    made = [await fleet.sandbox_create(SPEC) for _ in range(6)]
    await fleet.sandbox_create(SandboxSpec(image="demo/base", labels={"job": "other"}))
    paused = await fleet.sandboxes_pause({"job": "j"})
    assert {i.id for i in paused} == {i.id for i in made}
    assert len({i.node_id for i in paused}) == 3
    assert len(await fleet.sandboxes_resume({"job": "j"})) == 6


async def test_events_merge_and_page_over_the_fleet_without_loss() -> None:
    fleet, _, _ = await _fleet()
    made = [await fleet.sandbox_create(SPEC) for _ in range(7)]
    for info in made:
        await fleet.sandbox_pause(info.id)
    seen: list[tuple[str, int]] = []
    after = None
    while True:
        page = await fleet.events(after=after, limit=4)
        if not page:
            break
        assert [e.time for e in page] == sorted(e.time for e in page)
        seen += [(e.node_id, e.id) for e in page]
        after = page[-1].cursor
    assert len(seen) == len(set(seen)) == 14  # created + paused per sandbox, each once
    with pytest.raises(InvalidRequest, match="after"):
        await fleet.events(after="garbage")
    summary = await fleet.events_summary(labels={"job": "j"})
    assert summary.totals == {"created": 7, "paused": 7}


async def test_silent_node_is_lost_then_placed_around_then_back() -> None:
    fleet, nodes, clock = await _fleet(lost_after=10.0)
    made = [await fleet.sandbox_create(SPEC) for _ in range(6)]
    on_n1 = [i for i in made if i.node_id == "n1"]
    assert on_n1
    nodes[1].mode = "hang"
    clock.t = 5.0
    await fleet.refresh()
    assert fleet.lost_nodes() == []  # silent, but not yet for lost_after
    clock.t = 10.0
    await fleet.refresh()
    assert fleet.lost_nodes() == ["n1"]
    got = await fleet.sandbox_get(on_n1[0].id)
    assert got.state == "lost" and "n1" in got.detail
    states = {i.id: i.state for i in await fleet.sandbox_list({"job": "j"})}
    assert {states[i.id] for i in on_n1} == {"lost"} and len(states) == 6
    with pytest.raises(TransportError, match="is lost"):
        await fleet.exec(on_n1[0].id, ExecRequest(cmd=["true"]))
    for _ in range(10):
        assert (await fleet.sandbox_create(SPEC)).node_id != "n1"
    st = await fleet.node_status()
    assert st.node_id == "cluster" and st.labels["lost"] == "1"
    nodes[1].mode = "ok"
    clock.t = 11.0
    await fleet.refresh()
    assert fleet.lost_nodes() == []
    assert (await fleet.sandbox_get(on_n1[0].id)).state == "running"


async def test_garbage_answer_counts_as_silence_and_drain_stops_placement() -> None:
    fleet, nodes, clock = await _fleet(lost_after=1.0)
    nodes[0].mode = "garbage"
    clock.t = 2.0
    await fleet.refresh()
    assert fleet.lost_nodes() == ["n0"]
    fleet.drain("n2")
    assert {(await fleet.sandbox_create(SPEC)).node_id for _ in range(8)} == {"n1"}
    fleet.drain("n1")
    with pytest.raises(CapacityError, match="lost or draining"):
        await fleet.sandbox_create(SPEC)


async def test_node_refusal_is_replaced_on_another_node() -> None:
    fleet, nodes, _ = await _fleet()
    nodes[0].max_sandboxes = 1  # smaller than its last report said: the node refuses
    await nodes[0].sandbox_create(SandboxSpec(image="demo/base"))  # full behind the placer's back
    got = [await fleet.sandbox_create(SPEC) for _ in range(20)]
    assert {i.node_id for i in got} <= {"n1", "n2"}
    assert len(await nodes[0].sandbox_list()) == 1


def test_cluster_room_imports_no_ray() -> None:
    import subprocess
    import sys

    code = "import corral, corral.cluster, sys; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_quota_error_is_429_with_retry_after_over_http() -> None:
    import httpx

    from corral.api.app import create_app
    from corral.errors import JobQuotaExceeded

    class Quota(FakeNode):
        async def sandbox_create(self, spec: SandboxSpec) -> object:  # type: ignore[override]
            raise JobQuotaExceeded("job 'j' is over its rate", retry_after=2.5)

    app = create_app(Quota("q1"), token=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.post("/v1/sandboxes", json={"image": "demo/base"})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["kind"] == "JobQuotaExceeded"


async def test_bursting_to_the_cloud_pool_above_80_percent() -> None:
    onprem = [FakeNode(f"p{i}", max_sandboxes=10, labels={"pool": "onprem"}) for i in range(2)]
    cloud = FakeNode("c1", max_sandboxes=100, labels={"pool": "cloud"})
    fleet = FleetClient({n.node_id: n for n in [*onprem, cloud]}, seed=5)
    await fleet.refresh()
    first = [await fleet.sandbox_create(SPEC) for _ in range(16)]
    assert {i.node_id for i in first} <= {"p0", "p1"}  # below 80%: on-prem only
    assert fleet.placer.bursting()
    # an image the cloud store lacks stays on-prem even now
    await cloud.image_remove("demo/python")
    py = await fleet.sandbox_create(SandboxSpec(image="demo/python"))
    assert py.node_id in {"p0", "p1"}
    later = [await fleet.sandbox_create(SPEC) for _ in range(10)]
    assert {i.node_id for i in later} == {"c1"}
    # a spec may ask for a pool itself; and the group room counts the cloud
    pinned = SandboxSpec(image="demo/base", labels={"corral.node/pool": "onprem"})
    assert (await fleet.sandbox_create(pinned)).node_id in {"p0", "p1"}
    assert fleet.placer.free_slots() == (20 - 18) + (100 - 10)


async def test_unreachable_node_is_replaced_but_ambiguous_errors_are_not() -> None:
    import httpx

    class Down(FakeNode):
        calls = 0
        cause: Exception = httpx.ConnectError("refused")

        async def sandbox_create(self, spec: SandboxSpec) -> object:  # type: ignore[override]
            self.calls += 1
            raise TransportError("cannot reach the node") from self.cause

    down = Down("d1")
    fleet = FleetClient({"d1": down, "ok": FakeNode("ok")}, seed=2)
    await fleet.refresh()
    got = [await fleet.sandbox_create(SPEC) for _ in range(6)]
    assert {i.node_id for i in got} == {"ok"} and down.calls == 1  # then marked full
    down.cause = httpx.ReadTimeout("no answer")  # the node may have made it: never retried
    await fleet.refresh()
    with pytest.raises(TransportError):
        for _ in range(20):
            await fleet.sandbox_create(SPEC)


async def test_fleet_list_and_pause_survive_an_unreachable_node() -> None:
    class Gone(FakeNode):
        down = False

        async def sandbox_list(self, labels: dict[str, str] | None = None) -> list:  # type: ignore[override]
            if self.down:
                raise TransportError("cannot reach the node")
            return await super().sandbox_list(labels)

        async def sandboxes_pause(self, labels: dict[str, str]) -> list:  # type: ignore[override]
            if self.down:
                raise TransportError("cannot reach the node")
            return await super().sandboxes_pause(labels)

    gone = Gone("g1")
    fleet = FleetClient({"g1": gone, "ok": FakeNode("ok")}, seed=4)
    await fleet.refresh()
    made = [await fleet.sandbox_create(SPEC) for _ in range(8)]
    on_gone = {i.id for i in made if i.node_id == "g1"}
    assert on_gone
    gone.down = True  # not yet marked lost: the call itself finds it silent
    listed = {i.id: i.state for i in await fleet.sandbox_list({"job": "j"})}
    assert len(listed) == 8 and {listed[i] for i in on_gone} == {"lost"}
    paused = await fleet.sandboxes_pause({"job": "j"})
    assert {i.id for i in paused} == {i.id for i in made} - on_gone


async def test_a_create_before_the_first_status_asks_the_nodes_instead_of_refusing() -> None:
    class Slow(FakeNode):
        answers = 0

        async def node_status(self) -> NodeStatus:
            self.answers += 1
            if self.answers == 1:
                await asyncio.Event().wait()  # the first status round times out
            return await super().node_status()

    clock = Clock()
    slow = Slow("s0")
    fleet = FleetClient({"s0": slow}, clock=clock, status_timeout=0.05, lost_after=5)
    await fleet.refresh()  # no answer yet: placed nowhere, but not lost either
    info = await fleet.sandbox_create(SPEC)
    assert info.node_id == "s0"
    # a node that never answers is lost after lost_after and the create then fails clearly
    hung = Silent("h0")
    hung.mode = "hang"
    fleet = FleetClient({"h0": hung}, clock=clock, status_timeout=0.05, lost_after=5)
    asked = fleet.refresh

    async def later_refresh() -> dict[str, NodeStatus | None]:
        clock.t += 6  # each round a while later
        return await asked()

    fleet.refresh = later_refresh  # type: ignore[method-assign]
    with pytest.raises(CapacityError, match="lost"):
        await fleet.sandbox_create(SPEC)
