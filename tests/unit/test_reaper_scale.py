"""The reaper's pass is O(due + died + sample), not O(live sandboxes) (corral.node.watch).

Counts of calls, not timings: a pass over many idle sandboxes asks a bounded number of
them "alive?", deadlines come off a heap, deaths come from pidfds.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from corral.node import reaper as reaper_mod
from corral.node.deadlines import SAMPLE, Deadlines, DeathWatch, next_deadline
from corral.spec import SandboxSpec
from corral.testing import FakeBackend, open_fake_node

SPEC = SandboxSpec(image="fake/base")


def _fake(node) -> FakeBackend:  # type: ignore[no-untyped-def]
    b = node.backend
    assert isinstance(b, FakeBackend)
    return b


async def test_a_pass_asks_a_bounded_sample_not_every_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 3 * SAMPLE
    async with open_fake_node(tmp_path, reaper_interval=3600, max_sandboxes=n + 1) as node:
        made = [await node.sandbox_create(SPEC) for _ in range(n)]
        fake = _fake(node)
        asked: list[str] = []
        real = fake.alive
        monkeypatch.setattr(fake, "alive", lambda sid: asked.append(sid) or real(sid))
        await node.reap_once()
        assert len(asked) == SAMPLE
        # round robin: three passes look at every sandbox exactly once
        await node.reap_once()
        await node.reap_once()
        assert sorted(asked) == sorted(i.id for i in made)


async def test_a_reported_death_is_handled_without_the_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reaper_mod, "SAMPLE", 0)
    async with open_fake_node(tmp_path, reaper_interval=3600) as node:
        dead = await node.sandbox_create(SPEC)
        quiet = await node.sandbox_create(SPEC)
        _fake(node).kill(dead.id)
        _fake(node).kill(quiet.id)  # dead too, but nothing reported it (sample is 0)
        node.reaper.deaths._exited(dead.id)  # what the pidfd's callback does
        await node.reap_once()
        left = {i.id for i in await node.sandbox_list()}
        assert left == {quiet.id}
        assert "died" in [e.kind for e in await node.events(sandbox_id=dead.id)]


async def test_ttl_and_idle_come_off_the_heap_only_when_due(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path, reaper_interval=3600) as node:
        for _ in range(20):
            await node.sandbox_create(SPEC)  # no deadline: never on the heap
        later = await node.sandbox_create(SPEC.model_copy(update={"ttl": 3600}))
        soon = await node.sandbox_create(SPEC.model_copy(update={"ttl": 1e-3}))
        assert len(node.reaper.deadlines) == 2
        deadline = time.time() + 0.01
        while time.time() < deadline:
            pass
        await node.reap_once()
        assert {i.id for i in await node.sandbox_list()} >= {later.id}
        assert soon.id not in {i.id for i in await node.sandbox_list()}
        assert len(node.reaper.deadlines) == 1


async def test_activity_moves_an_idle_deadline(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path, reaper_interval=3600) as node:
        sb = await node.sandbox_create(SPEC.model_copy(update={"idle_timeout": 3600}))
        d = node.reaper.deadlines
        # due now in the heap's eyes, but the sandbox was just active: re-armed, kept
        assert d.due(time.time() + 3601) == [sb.id]
        d.arm(sb.id, time.time())
        await node.reap_once()
        assert [i.id for i in await node.sandbox_list()] == [sb.id]
        assert len(d) == 1


def test_deadlines_keep_one_entry_per_sandbox() -> None:
    d = Deadlines()
    d.arm("a", 10.0)
    d.arm("a", 20.0)  # later: the earlier arming stands
    d.arm("a", 5.0)  # earlier: replaces it
    d.arm("b", 7.0)
    assert d.due(6.0) == ["a"]
    assert d.due(100.0) == ["b"]  # a's stale 10.0 entry is not returned
    assert len(d) == 0
    for i in range(1000):
        d.arm(f"s{i}", 1e9 + i)
        d.forget(f"s{i}")
    assert len(d._heap) <= 64 + 1  # forgotten entries are compacted, not kept for a day


async def test_next_deadline(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path, reaper_interval=3600) as node:
        plain = await node.sandbox_create(SPEC)
        both = await node.sandbox_create(SPEC.model_copy(update={"ttl": 100, "idle_timeout": 10}))
        assert next_deadline(plain) is None
        assert next_deadline(both) == both.last_active_at + 10
        paused = both.model_copy(update={"state": "paused"})
        assert next_deadline(paused) == both.expires_at  # idle clocks stop while paused


async def test_death_watch_reports_an_exit_through_the_loop() -> None:
    w = DeathWatch()
    p = subprocess.Popen(["sleep", "1000"])
    try:
        w.watch("sb-a", p.pid)
        w.watch("sb-a", p.pid)  # idempotent: one pidfd
        assert w.watched == 1 and w.reported() == []
        p.kill()
        p.wait()
        for _ in range(1000):  # readiness: the loop runs the pidfd's callback
            if w.reported():
                break
            await asyncio.sleep(0.01)
        assert w.reported() == ["sb-a"] and w.watched == 0
        w.forget("sb-a")
        assert w.reported() == [] and w.sample() == []
    finally:
        p.kill()
        w.close()


def test_security_flush_visits_only_sandboxes_with_denials(tmp_path: Path) -> None:
    from corral.node.security import SecurityLog
    from corral.node.state import StateStore

    st = StateStore(tmp_path / "s.db")
    log = SecurityLog(st.add_event, window=0.0)
    for i in range(500):
        log.seen(f"sb-{i}", {"pids_limit": 0, "oom_kill": 0})  # every live sandbox
    assert not log._noisy
    log.record("sb-7", "seccomp", "bpf", {"syscall": "bpf"})
    assert list(log._noisy) == ["sb-7"]
    assert log.flush() == 1
    assert log.flush() == 0  # quiet for a window (0 here): its entry goes, and the mark
    assert not log._noisy
    st.close()


def test_masked_directories_become_binds_of_one_empty_dir(tmp_path: Path) -> None:
    """No tmpfs superblock per masked directory (each would grow every memory cgroup of
    the host); files and absent paths stay the runtime's."""
    import os

    from corral.backends import oci
    from corral.policy.masks import MASKED_PATHS
    from corral.spec import Limits

    cfg = oci.build_config(
        rootfs=Path("/srv/sb/rootfs"),
        init_host_path=Path("/opt/init"),
        hostname="h",
        cgroups_path="/corral/x",
        limits=Limits(),
        mask_dir=tmp_path,
    )
    binds = {m["destination"]: m for m in cfg["mounts"] if m.get("source") == str(tmp_path)}
    dirs = {p for p in MASKED_PATHS if os.path.isdir(p) and not os.path.islink(p)}
    assert set(binds) == dirs
    assert all("ro" in m["options"] and m["type"] == "bind" for m in binds.values())
    assert set(cfg["linux"]["maskedPaths"]) == set(MASKED_PATHS) - dirs
    plain = oci.build_config(
        rootfs=Path("/srv/sb/rootfs"),
        init_host_path=Path("/opt/init"),
        hostname="h",
        cgroups_path="/corral/x",
        limits=Limits(),
    )
    assert plain["linux"]["maskedPaths"] == list(MASKED_PATHS)


def test_pidfds_stop_at_the_budget_and_the_ring_covers_the_rest() -> None:
    """Short of fds, a sandbox is watched by the sample only: the node never spends the
    fds a create needs on pidfds (10,000 sandboxes on a 20,000-fd node)."""
    me = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])
    try:

        async def run() -> None:
            w = DeathWatch(max_fds=1)
            try:
                w.watch("a", me.pid)
                w.watch("b", other.pid)
                assert w.watched == 1
                assert sorted(w.sample(2)) == ["a", "b"]  # both in the ring
                w.forget("a")
                w.watch("b", other.pid)  # a slot came free: a later watch takes it
                assert w.watched == 1
            finally:
                w.close()

        asyncio.run(run())
    finally:
        for p in (me, other):
            p.kill()
            p.wait()


def test_pidfd_budget_leaves_room_for_listener_fds_and_the_node() -> None:
    from corral.node.deadlines import RESERVED_FDS, pidfd_budget

    assert pidfd_budget(20000) == (20000 - RESERVED_FDS) // 2
    assert pidfd_budget(100) == 0
