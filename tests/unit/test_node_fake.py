"""The real Node (state machine, admission, reaper, recovery, fork, pause) on FakeBackend.

No root and no kernel: corral.testing.FakeBackend runs "sandboxes" as directories and host
subprocesses, FakeCgroups flips freeze flags. What is checked here is the node's own logic.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from corral.errors import CapacityError, Conflict, HostError, InvalidRequest, SandboxNotFound
from corral.node.table import TRANSITIONS
from corral.spec import ExecRequest, ForkRequest, SandboxSpec, decode_cursor, parse_sandbox_id
from corral.testing import FakeBackend, open_fake_node

SPEC = SandboxSpec(image="fake/base")


def _fake(node) -> FakeBackend:  # type: ignore[no-untyped-def]
    b = node.backend
    assert isinstance(b, FakeBackend)
    return b


async def test_create_exec_destroy_and_ids_name_the_node(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path) as node:
        info = await node.sandbox_create(SPEC)
        assert parse_sandbox_id(info.id)[1] == node.node_id == info.node_id
        assert (info.state, info.backend) == ("running", "container")
        r = await node.exec(info.id, ExecRequest(cmd=["sh", "-c", "echo hi; exit 3"]))
        assert (r.stdout, r.exit_code, r.reason) == (b"hi\n", 3, "exited")
        await node.sandbox_destroy(info.id)
        assert (await node.sandbox_get(info.id)).state == "destroyed"
        with pytest.raises(SandboxNotFound, match="destroyed"):
            await node.exec(info.id, ExecRequest(cmd=["true"]))


async def test_admission(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path, max_sandboxes=2) as node:
        with pytest.raises(InvalidRequest, match="no 'microvm' backend .*container"):
            await node.sandbox_create(SPEC.model_copy(update={"backend": "microvm"}))
        a = await node.sandbox_create(SPEC)
        await node.sandbox_create(SPEC)
        with pytest.raises(CapacityError, match="full: 2 sandboxes"):
            await node.sandbox_create(SPEC)
        with pytest.raises(CapacityError, match="room for 0"):
            await node.sandbox_fork(a.id, ForkRequest(count=1))


async def test_failed_create_leaves_an_event_and_nothing_else(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path) as node:
        _fake(node).fail_creates = 1
        with pytest.raises(HostError, match="injected"):
            await node.sandbox_create(SPEC)
        assert await node.sandbox_list() == []
        assert [e.kind for e in await node.events()] == ["create_failed"]


async def test_fork_is_all_or_nothing(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path) as node:
        parent = await node.sandbox_create(SPEC)
        await node.file_write(parent.id, "/f", b"data")
        _fake(node).fail_creates = 1
        with pytest.raises(HostError, match="injected"):
            await node.sandbox_fork(parent.id, ForkRequest(count=4))
        assert [i.id for i in await node.sandbox_list()] == [parent.id]
        assert node.scratch.subvols() == [parent.id]  # no child and no work copy left
        kids = await node.sandbox_fork(parent.id, ForkRequest(count=3, labels={"k": "v"}))
        assert len(kids) == 3 and all(k.spec.labels == {"k": "v"} for k in kids)
        assert [await node.file_read(k.id, "/f") for k in kids] == [b"data"] * 3


async def test_pause_transparent_resume_and_transitions(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path) as node:
        info = await node.sandbox_create(SPEC.model_copy(update={"labels": {"job": "j"}}))
        assert (await node.sandbox_pause(info.id)).state == "paused"
        assert node.cgroups.is_frozen(info.id)
        r = await node.exec(info.id, ExecRequest(cmd=["true"]))  # resumes it first
        assert r.ok and (await node.sandbox_get(info.id)).state == "running"
        assert not node.cgroups.is_frozen(info.id)
        assert [i.id for i in await node.sandboxes_pause({"job": "j"})] == [info.id]
        assert [i.state for i in await node.sandboxes_resume({"job": "j"})] == ["running"]
        # the one table: a running sandbox cannot jump to resuming
        with pytest.raises(Conflict, match="cannot become resuming"):
            node.table.set_state(info.id, "resuming")
        assert "resuming" not in TRANSITIONS["running"]
        kinds = [e.kind for e in await node.events(sandbox_id=info.id)]
        assert kinds.count("paused") == 2 and kinds.count("resumed") == 2


async def test_a_destroy_overtakes_a_late_state_change(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path) as node:
        info = await node.sandbox_create(SPEC)
        node.table.set_state(info.id, "destroying")
        # a pause finishing after the destroy began must not write the sandbox back
        assert node.table.set_state(info.id, "pausing").state == "destroying"
        node.table.remove(info.id)  # as the destroy would at its end (close waits for it)


async def test_reaper_ttl_idle_and_dead(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path, reaper_interval=3600) as node:
        ttl = await node.sandbox_create(SPEC.model_copy(update={"ttl": 1e-3}))
        idle = await node.sandbox_create(SPEC.model_copy(update={"idle_timeout": 1e-3}))
        dead = await node.sandbox_create(SPEC)
        keep = await node.sandbox_create(SPEC)
        _fake(node).kill(dead.id)
        deadline = time.time() + 0.01
        while time.time() < deadline:  # past both (millisecond) deadlines
            pass
        await node.reap_once()
        assert [i.id for i in await node.sandbox_list()] == [keep.id]
        why = {e.sandbox_id: e.kind for e in await node.events(kinds=["ttl_expired"])}
        assert why == {ttl.id: "ttl_expired"}
        assert [e.kind for e in await node.events(sandbox_id=idle.id)][-1] == "idle_timeout"
        assert "died" in [e.kind for e in await node.events(sandbox_id=dead.id)]


async def test_recovery_adopts_survivors_and_reports_the_lost(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path) as node:
        alive = await node.sandbox_create(SPEC)
        gone = await node.sandbox_create(SPEC)
        paused = await node.sandbox_create(SPEC)
        await node.sandbox_pause(paused.id)
        _fake(node).kill(gone.id)
    # the backend's record of `gone` is lost with its agent: a restart cannot adopt it
    (tmp_path / "state" / "fake-backend" / gone.id).unlink()
    async with open_fake_node(tmp_path) as node:
        ids = {i.id: i.state for i in await node.sandbox_list()}
        # the fake freezer forgot its flags: the paused one is thawed and running again
        assert ids == {alive.id: "running", paused.id: "running"}
        assert (await node.sandbox_get(gone.id)).state == "destroyed"
        assert [e.kind for e in await node.events(sandbox_id=gone.id)][-1] == "lost"
        r = await node.exec(alive.id, ExecRequest(cmd=["true"]))
        assert r.ok


async def test_recovery_keeps_a_sandbox_held_in_a_memory_snapshot_paused(tmp_path: Path) -> None:
    """Its cgroup is not frozen (a microVM's VMM is gone, its state in a file), yet the
    restarted node asks the backend and keeps it paused; a frozen-cgroup pause whose freezer
    flag was lost runs again."""
    async with open_fake_node(tmp_path) as node:
        saved = await node.sandbox_create(SPEC)
        frozen = await node.sandbox_create(SPEC)
        for sid in (saved.id, frozen.id):
            await node.sandbox_pause(sid)
        _fake(node).hold_in_snapshot(saved.id)
        assert _fake(node).held_in_snapshot(saved.id)
        assert not _fake(node).held_in_snapshot(frozen.id)
    async with open_fake_node(tmp_path) as node:
        assert not node.cgroups.is_frozen(saved.id)
        ids = {i.id: i.state for i in await node.sandbox_list()}
        assert ids == {saved.id: "paused", frozen.id: "running"}


async def test_memory_snapshot_pause_is_the_backends_to_offer(tmp_path: Path) -> None:
    """The node asks the engine (Backend.memory_snapshots) before it pauses anything: one
    without refuses with a clear error and the sandbox runs on; one with saves it
    (pause_memory) and the resume brings it back (restore_memory)."""
    async with open_fake_node(tmp_path / "plain") as node:
        info = await node.sandbox_create(SPEC)
        with pytest.raises(InvalidRequest, match=r"memory_snapshot=True\): not for container"):
            await node.sandbox_pause(info.id, memory_snapshot=True)
        assert (await node.sandbox_get(info.id)).state == "running"
        assert not node.cgroups.is_frozen(info.id)
        assert "paused" not in [e.kind for e in await node.events(sandbox_id=info.id)]
    async with open_fake_node(tmp_path / "vm", memory_snapshots=True) as node:
        info = await node.sandbox_create(SPEC)
        paused = await node.sandbox_pause(info.id, memory_snapshot=True)
        assert paused.state == "paused" and _fake(node).held_in_snapshot(info.id)
        ev = [e for e in await node.events(sandbox_id=info.id) if e.kind == "paused"][-1]
        assert ev.detail["memory_snapshot"] is True
        assert (await node.sandbox_resume(info.id)).state == "running"
        assert not _fake(node).held_in_snapshot(info.id)


async def test_a_sandbox_carries_its_engines_accelerator(tmp_path: Path) -> None:
    """SandboxInfo.accel is the engine's Backend.accel: None for one without (containers)."""
    async with open_fake_node(tmp_path) as node:
        assert (await node.sandbox_create(SPEC)).accel is None
        _fake(node).accel = "tcg"  # as a VM engine's probe boot would find
        info = await node.sandbox_create(SPEC)
        assert info.accel == "tcg" and (await node.sandbox_get(info.id)).accel == "tcg"


async def test_wait_settled_asks_every_backend_within_the_time_given(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path) as node:
        assert await node.wait_settled(5.0)  # the fake prepares nothing in the background
        asked: list[float] = []

        async def not_yet(timeout: float) -> bool:
            asked.append(timeout)
            return False

        _fake(node).settle = not_yet  # type: ignore[method-assign]
        assert not await node.wait_settled(5.0)
        assert len(asked) == 1 and 0 <= asked[0] <= 5.0


async def test_events_page_with_an_opaque_cursor(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path) as node:
        for _ in range(5):
            await node.sandbox_create(SPEC)
        first = await node.events(limit=2)
        assert len(first) == 2 and all(e.node_id == node.node_id for e in first)
        rest = await node.events(after=first[-1].cursor)
        assert [e.id for e in first + rest] == [e.id for e in await node.events()]
        assert decode_cursor(rest[-1].cursor) == {node.node_id: rest[-1].id}
        assert await node.events(after=rest[-1].cursor) == []
        with pytest.raises(InvalidRequest, match="after"):
            await node.events(after="garbage")
        with pytest.raises(InvalidRequest, match="limit"):
            await node.events(limit=0)


async def test_the_node_times_its_operations_and_counts_errors(tmp_path: Path) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from corral.api import create_app

    async with open_fake_node(tmp_path) as node:
        info = await node.sandbox_create(SPEC.model_copy(update={"labels": {"job": "j1"}}))
        await node.exec(info.id, ExecRequest(cmd=["true"]))
        await node.sandbox_destroy(info.id)
        stats = await node.stats({"job": "j1"})
        assert {"create", "exec", "destroy"} <= set(stats.ops)
        assert {"admission", "network_attach"} <= set(stats.ops["create"].phases)
        assert {"queue", "agent_round_trip", "process_run"} <= set(stats.ops["exec"].phases)
        app = create_app(node)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://corral.test"
        ) as c:
            assert (await c.get(f"/v1/sandboxes/{info.id}x")).status_code == 404
            text = (await c.get("/metrics")).text
        errors = {
            s.labels.get("kind"): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "corral_errors_total"
        }
        assert errors.get("SandboxNotFound") == 1
