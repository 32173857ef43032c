"""Pause and resume against a real node: freezer, reclaim to a swap file, states, jobs.

The module's node adds a swap file in its own state dir (its path carries the test tag);
its fixture, after the module's last test, checks that closing the node removes it.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

import corral
from corral.host import swap as swapmod
from corral.node import Node
from corral.spec import ExecRequest, Limits, SandboxSpec
from tests.conftest import TAG
from tests.integration.conftest import assert_no_leaks, close_swap_node, node_config
from tests.integration.holder import HOLDER

STATE = Path(f"/var/lib/corral-test{TAG}-pause")
RUN = Path(f"/run/corral-test{TAG}-pause")
SUBTREE = f"corral-test{TAG}-pause"
SWAP_FILE = STATE / "swap" / "corral.swap"


def _cfg(**kw):  # type: ignore[no-untyped-def]
    return node_config(
        state_dir=STATE,
        run_dir=RUN,
        cgroup_subtree=SUBTREE,
        swap={"kind": "file", "size": "1GiB"},
        **kw,
    )


@pytest.fixture(scope="module")
async def pnode(images_ready):  # type: ignore[no-untyped-def]
    n = await Node.open(_cfg())
    await n.gc(everything=True)
    try:
        yield n
        # After the module's last test: closing the node turns off and removes its swap
        # file, and leaves nothing of it.
        await close_swap_node(n, SWAP_FILE, SUBTREE)
    finally:
        if not n.life.closed:
            for info in await n.sandbox_list():
                await n.sandbox_destroy(info.id)
            await n.close()
        shutil.rmtree(RUN, ignore_errors=True)


def _spec(**kw):  # type: ignore[no-untyped-def]
    return SandboxSpec(image="test/debian", limits=Limits(memory="256MiB", disk="256MiB"), **kw)


async def _sums(node: Node, sid: str) -> list[str]:
    return (await node.file_read(sid, "/tmp/sums")).decode().split()


async def _start_holder(node: Node, sid: str) -> None:
    await node.file_write(sid, "/tmp/holder.py", HOLDER.encode())
    await node.spawn(sid, ExecRequest(cmd=["python3", "/tmp/holder.py"]))
    for _ in range(300):
        r = await node.exec(sid, ExecRequest(cmd=["cat", "/tmp/sums"]))
        if r.ok and r.stdout.strip():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("holder did not start")


async def test_pause_reclaims_and_resume_keeps_state(pnode: Node):
    assert str(SWAP_FILE) in swapmod.active()
    info = await pnode.sandbox_create(_spec())
    sid = info.id
    await _start_holder(pnode, sid)
    await pnode.file_write(sid, "/work/kept.txt", b"kept\n")
    sh = await pnode.shell_open(sid)
    await pnode.shell_run(sid, sh.id, "cd /work && export K=v")
    before = (await pnode.sandbox_get(sid)).memory_resident
    assert before is not None and before > 60 << 20

    paused = await pnode.sandbox_pause(sid)
    assert paused.state == "paused"
    assert paused.memory_resident is not None and paused.memory_swapped is not None
    # The 64 MiB of random bytes left RAM for the swap file (kernel's cgroup figures).
    assert paused.memory_resident < before - (48 << 20), (before, paused.memory_resident)
    assert paused.memory_swapped > 48 << 20
    assert pnode.cgroups.is_frozen(sid)
    # the state survives a status read and the reaper
    await pnode.reap_once()
    assert (await pnode.sandbox_get(sid)).state == "paused"
    assert (await pnode.node_status()).paused >= 1

    resumed = await pnode.sandbox_resume(sid)
    assert resumed.state == "running"
    assert not pnode.cgroups.is_frozen(sid)
    pid = (await pnode.file_read(sid, "/tmp/holder.pid")).decode()
    r = await pnode.exec(sid, ExecRequest(cmd=["sh", "-c", f"kill -USR1 {pid}"]))
    assert r.ok, r.stderr
    deadline = time.monotonic() + 60  # swap-in of 64 MiB from disk on a loaded machine
    while len(sums := await _sums(pnode, sid)) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(sums) == 2 and sums[0] == sums[1]  # the process's memory is intact
    r = await pnode.shell_run(sid, sh.id, "echo $K; pwd; cat kept.txt")
    assert r.stdout == b"v\n/work\nkept\n"
    kinds = [e.kind for e in await pnode.events(sid)]
    assert "paused" in kinds and "resumed" in kinds
    await pnode.sandbox_destroy(sid)


async def test_request_resumes_transparently(pnode: Node):
    info = await pnode.sandbox_create(_spec())
    sid = info.id
    await pnode.file_write(sid, "/work/a.txt", b"a")
    assert (await pnode.sandbox_pause(sid)).state == "paused"
    r = await pnode.exec(sid, ExecRequest(cmd=["cat", "/work/a.txt"]))
    assert r.stdout == b"a"
    assert (await pnode.sandbox_get(sid)).state == "running"
    ev = [e for e in await pnode.events(sid) if e.kind == "resumed"]
    assert ev and ev[-1].detail["transparent"] is True
    # files API and spawn resume too
    await pnode.sandbox_pause(sid)
    assert await pnode.file_read(sid, "/work/a.txt") == b"a"
    assert (await pnode.sandbox_get(sid)).state == "running"
    await pnode.sandbox_pause(sid)
    p = await pnode.spawn(sid, ExecRequest(cmd=["true"]))
    assert (await pnode.process_get(sid, p.id, wait=10)).result.ok  # type: ignore[union-attr]
    await pnode.sandbox_destroy(sid)


async def test_requests_racing_a_pause(pnode: Node):
    """A request that arrives while the pause is freezing or reclaiming wins: it runs, the
    sandbox ends up running, and the kernel's freezer agrees with the reported state."""
    info = await pnode.sandbox_create(_spec())
    sid = info.id
    await _start_holder(pnode, sid)
    for delay in (0.0, 0.001, 0.01, 0.05, 0.2, 0.5):
        pause = asyncio.ensure_future(pnode.sandbox_pause(sid))
        await asyncio.sleep(delay)
        r = await pnode.exec(sid, ExecRequest(cmd=["echo", "ok"], timeout=60))
        assert r.stdout == b"ok\n", (delay, r)
        await pause
        state = (await pnode.sandbox_get(sid)).state
        assert state in ("running", "paused"), (delay, state)
        assert pnode.cgroups.is_frozen(sid) == (state == "paused"), (delay, state)
        if state == "paused":
            await pnode.sandbox_resume(sid)
    limit = pnode.cgroups._dir("memory", sid) / "memory.limit_in_bytes"
    if limit.exists():  # every reclaim, cut short or not, gave the limit back
        assert int(limit.read_text()) == 256 << 20
    sums = await _sums(pnode, sid)
    assert len(sums) == 1
    await pnode.sandbox_destroy(sid)


async def test_frozen_block_for_snapshots(pnode: Node):
    info = await pnode.sandbox_create(_spec())
    sid = info.id
    async with pnode.pauser.frozen(sid):
        assert pnode.cgroups.is_frozen(sid)
        assert (await pnode.sandbox_get(sid)).state == "running"
    assert not pnode.cgroups.is_frozen(sid)
    # paused: stays paused through the block; a request made meanwhile waits for its end
    await pnode.sandbox_pause(sid)
    async with pnode.pauser.frozen(sid):
        job = asyncio.ensure_future(pnode.exec(sid, ExecRequest(cmd=["echo", "late"])))
        await asyncio.sleep(0.3)
        assert not job.done() and pnode.cgroups.is_frozen(sid)
    assert (await asyncio.wait_for(job, 30)).stdout == b"late\n"
    assert (await pnode.sandbox_get(sid)).state == "running"
    await pnode.sandbox_destroy(sid)


async def test_destroy_paused_sandbox(pnode: Node):
    info = await pnode.sandbox_create(_spec())
    await pnode.spawn(info.id, ExecRequest(cmd=["sleep", "600"]))
    await pnode.sandbox_pause(info.id)
    await pnode.sandbox_destroy(info.id)
    assert info.id not in pnode.cgroups.list()


async def test_ttl_still_destroys_a_paused_sandbox(pnode: Node):
    info = await pnode.sandbox_create(_spec(ttl=2.0))
    await pnode.sandbox_pause(info.id)
    deadline = time.monotonic() + 30
    while info.id in {i.id for i in await pnode.sandbox_list()}:
        assert time.monotonic() < deadline, "a paused sandbox outlived its ttl"
        await asyncio.sleep(0.2)
    assert "ttl_expired" in [e.kind for e in await pnode.events(info.id)]
    assert info.id not in pnode.cgroups.list()


async def test_idle_pause(pnode: Node):
    info = await pnode.sandbox_create(_spec(idle_pause=1.0, idle_timeout=1.5))
    sid = info.id
    deadline = time.monotonic() + 30
    while (await pnode.sandbox_get(sid)).state != "paused":
        assert time.monotonic() < deadline, "not paused after 30 s idle"
        await asyncio.sleep(0.2)
    # idle_timeout does not destroy a paused sandbox
    await asyncio.sleep(2.5)
    assert (await pnode.sandbox_get(sid)).state == "paused"
    r = await pnode.exec(sid, ExecRequest(cmd=["echo", "back"]))
    assert r.stdout == b"back\n"
    await pnode.sandbox_destroy(sid)


async def test_job_pause_and_resume(pnode: Node):
    async with corral.AsyncClient(ops=pnode) as client:
        job = [
            await client.sandboxes.create(
                "test/busybox", labels={"job": "rl-42"}, limits={"memory": "64MiB"}
            )
            for _ in range(3)
        ]
        other = await client.sandboxes.create("test/busybox", labels={"job": "other"})
        paused = await client.sandboxes.pause(labels={"job": "rl-42"})
        assert sorted(s.id for s in paused) == sorted(s.id for s in job)
        assert all(s.info.state == "paused" for s in paused)
        assert (await other.refresh()).state == "running"
        resumed = await client.sandboxes.resume(labels={"job": "rl-42"})
        assert sorted(s.id for s in resumed) == sorted(s.id for s in job)
        for s in job:
            assert (await s.refresh()).state == "running"
            assert (await s.exec("echo ok")).stdout == b"ok\n"
        with pytest.raises(corral.errors.InvalidRequest):
            await client.sandboxes.pause(labels={})
        for s in [*job, other]:
            await s.destroy()


async def test_paused_survives_restart(images_ready):
    state = Path(f"/var/lib/corral-test{TAG}-pause2")
    run = Path(f"/run/corral-test{TAG}-pause2")
    cfg = node_config(state_dir=state, run_dir=run, cgroup_subtree=f"corral-test{TAG}-pause2")
    node = await Node.open(cfg)
    try:
        info = await node.sandbox_create(_spec())
        await node.file_write(info.id, "/work/x", b"x")
        await node.sandbox_pause(info.id)
    finally:
        await node.close()
    node = await Node.open(cfg)
    try:
        assert (await node.sandbox_get(info.id)).state == "paused"
        assert node.cgroups.is_frozen(info.id)
        assert (await node.sandbox_resume(info.id)).state == "running"
        assert await node.file_read(info.id, "/work/x") == b"x"
        # An agent killed mid-pause: frozen, memory limit still squeezed, state "pausing".
        node.cgroups.freeze(info.id)
        node.cgroups.set_memory(info.id, 32 << 20, 0)
        node.state.put_sandbox(node.table.need(info.id).model_copy(update={"state": "pausing"}))
    finally:
        await node.close()
    node = await Node.open(cfg)
    try:
        got = await node.sandbox_get(info.id)
        assert got.state == "running" and not node.cgroups.is_frozen(info.id)
        limit = node.cgroups._dir("memory", info.id) / "memory.limit_in_bytes"
        if limit.exists():
            assert int(limit.read_text()) == 256 << 20
        r = await node.exec(info.id, ExecRequest(cmd=["cat", "/work/x"]))
        assert r.stdout == b"x"
        await node.sandbox_destroy(info.id)
    finally:
        await node.close()
        shutil.rmtree(run, ignore_errors=True)
    assert_no_leaks(state, run, f"corral-test{TAG}-pause2")
    shutil.rmtree(state)  # nothing of it is mounted any more (checked just above)


async def test_zram_swap_added_and_removed(images_ready):
    state = Path(f"/var/lib/corral-test{TAG}-zram")
    run = Path(f"/run/corral-test{TAG}-zram")
    cfg = node_config(
        state_dir=state,
        run_dir=run,
        cgroup_subtree=f"corral-test{TAG}-zram",
        swap={"kind": "zram", "size": "256MiB"},
    )
    node = await Node.open(cfg)
    try:
        devs = (await node.node_status()).swap
        assert len(devs) == 1 and devs[0].startswith("/dev/zram") and devs[0] != "/dev/zram0"
        assert devs[0] in swapmod.active()
    finally:
        await node.close()
        shutil.rmtree(run, ignore_errors=True)
    assert devs[0] not in swapmod.active()
    assert not Path(f"/sys/block/{devs[0].removeprefix('/dev/')}").exists()
    assert not (state / "swap.json").exists()
    assert_no_leaks(state, run, f"corral-test{TAG}-zram")
    shutil.rmtree(state)


async def test_gc_removes_swap_a_crashed_node_left(images_ready):
    # What a node killed with its swap on leaves: an active area and its record.
    state = Path(f"/var/lib/corral-test{TAG}-swapgc")
    run = Path(f"/run/corral-test{TAG}-swapgc")
    state.mkdir(parents=True, exist_ok=True)
    dev = swapmod.add_file(state / "swap" / "corral.swap", 64 << 20)
    swapmod.SwapRecord(state / "swap.json").save([dev])
    zram = swapmod.add_zram(64 << 20)  # not recorded: another owner's; must stay
    try:
        cfg = node_config(state_dir=state, run_dir=run, cgroup_subtree=f"corral-test{TAG}-swapgc")
        node = await Node.open(cfg)  # swap "none": keeps what is on until teardown/gc
        try:
            assert dev.path in swapmod.active()
            await node.gc(everything=True)
            assert dev.path not in swapmod.active() and not Path(dev.path).exists()
            assert zram.path in swapmod.active()
        finally:
            await node.close()
            shutil.rmtree(run, ignore_errors=True)
    finally:
        swapmod.remove(zram)
        swapmod.remove(dev)
    assert_no_leaks(state, run, f"corral-test{TAG}-swapgc")
    shutil.rmtree(state)
