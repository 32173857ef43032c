"""resume(prefetch=True) against a real node: a paused sandbox's swapped memory comes back
into RAM within the resume call (cgroup swap figure), and its contents are intact.

The module's node adds a swap file in its own state dir (its path carries the test tag);
its fixture, after the module's last test, closes the node and checks that the swap file
is gone.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

import corral
from corral.node import Node
from corral.spec import Event, ExecRequest, Limits, SandboxSpec
from tests.conftest import TAG
from tests.integration.conftest import close_swap_node, node_config
from tests.integration.holder import HOLDER

STATE = Path(f"/var/lib/corral-test{TAG}-prefetch")
RUN = Path(f"/run/corral-test{TAG}-prefetch")
SUBTREE = f"corral-test{TAG}-prefetch"
SWAP_FILE = STATE / "swap" / "corral.swap"
MIB = 1 << 20


@pytest.fixture(scope="module")
async def pnode(images_ready):  # type: ignore[no-untyped-def]
    cfg = node_config(
        state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, swap={"kind": "file", "size": "1GiB"}
    )
    n = await Node.open(cfg)
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


async def _holder_sandbox(node: Node, **labels: str) -> str:
    spec = SandboxSpec(
        image="test/debian", limits=Limits(memory="256MiB", disk="256MiB"), labels=labels
    )
    sid = (await node.sandbox_create(spec)).id
    await node.file_write(sid, "/tmp/holder.py", HOLDER.encode())
    await node.spawn(sid, ExecRequest(cmd=["python3", "/tmp/holder.py"]))
    for _ in range(300):
        r = await node.exec(sid, ExecRequest(cmd=["cat", "/tmp/sums"]))
        if r.ok and r.stdout.strip():
            return sid
        await asyncio.sleep(0.1)
    raise AssertionError("holder did not start")


async def _swapped(node: Node, sid: str) -> int:
    """Bytes of the sandbox's memory out in swap (not in RAM). cgroup v1 (this machine)
    uncharges a swap slot when its page enters the swap cache; v2 keeps it charged until
    the slot is freed, so there the swap cache is taken off (not run here: hybrid host)."""
    swapped = node.cgroups.memory_usage(sid)[1]
    if node.cgroups.mode == "v2":
        stat = node.cgroups.control_file("memory", sid, "memory.stat").read_text().split()
        cached = dict(zip(stat[::2], stat[1::2], strict=True)).get("swapcached", "0")
        swapped -= int(cached)
    return swapped


async def _paused(node: Node, sid: str) -> int:
    """Pause; returns the bytes the kernel reports in swap for the sandbox."""
    info = await node.sandbox_pause(sid)
    assert info.state == "paused"
    swapped = await _swapped(node, sid)
    assert swapped > 48 * MIB, swapped  # the 64 MiB of random bytes went to the swap file
    return swapped


async def _checksums(node: Node, sid: str) -> list[str]:
    """Have the holder hash its buffer again; its sums, first (at start) to last."""
    assert len((await node.file_read(sid, "/tmp/sums")).split()) == 1
    pid = (await node.file_read(sid, "/tmp/holder.pid")).decode()
    r = await node.exec(sid, ExecRequest(cmd=["sh", "-c", f"kill -USR1 {pid}"]))
    assert r.ok, r.stderr
    deadline = time.monotonic() + 60  # swap-in from disk on a loaded machine
    while time.monotonic() < deadline:
        sums = (await node.file_read(sid, "/tmp/sums")).decode().split()
        if len(sums) >= 2:
            return sums
        await asyncio.sleep(0.05)
    raise AssertionError("holder did not report a second checksum")


def _last_resumed(events: list[Event]) -> Event:
    got = [e for e in events if e.kind == "resumed"]
    assert got, [e.kind for e in events]
    return got[-1]


async def test_prefetch_brings_swapped_memory_back(pnode: Node):
    sid = await _holder_sandbox(pnode)
    swapped = await _paused(pnode, sid)

    resident = pnode.cgroups.memory_usage(sid)[0]
    info = await pnode.sandbox_resume(sid, prefetch=True)
    # Read right when the call returns, before anything in the sandbox touched its memory
    # (the holder sleeps): the pages are back in RAM (swap cache) within the call.
    after = await _swapped(pnode, sid)
    assert info.state == "running" and not pnode.cgroups.is_frozen(sid)
    assert after < swapped // 4, (swapped, after)
    assert pnode.cgroups.memory_usage(sid)[0] > resident + 48 * MIB

    ev = _last_resumed(await pnode.events(sid))
    d = ev.detail
    assert d["transparent"] is False and d["prefetch"] is True
    assert d["prefetch_anon_bytes"] >= 64 * MIB  # the holder's buffer was advised
    assert d["prefetch_processes"] >= 2  # corral-init and the holder at least
    assert d["swapped_before"] > 48 * MIB
    assert d["resident_after"] > d["resident_before"] + 48 * MIB
    assert d["prefetch_ms"] >= 0

    sums = await _checksums(pnode, sid)
    assert sums[0] == sums[-1]  # the memory read back is the memory that left
    await pnode.sandbox_destroy(sid)


async def test_plain_resume_leaves_memory_in_swap(pnode: Node):
    """The counter-case: without prefetch the pages stay in swap until touched (so the
    figure the prefetch test checks does not drop by itself)."""
    sid = await _holder_sandbox(pnode)
    swapped = await _paused(pnode, sid)
    await pnode.sandbox_resume(sid)
    await asyncio.sleep(0.5)
    assert await _swapped(pnode, sid) > swapped // 2
    d = _last_resumed(await pnode.events(sid)).detail
    assert "prefetch" not in d and d["transparent"] is False
    # a later explicit resume with prefetch of the running sandbox is a no-op, and the
    # memory still comes back intact on touch
    await pnode.sandbox_resume(sid, prefetch=True)
    assert await _swapped(pnode, sid) > swapped // 2
    sums = await _checksums(pnode, sid)
    assert sums[0] == sums[-1]
    assert await _swapped(pnode, sid) < swapped // 4  # touched: back in RAM
    await pnode.sandbox_destroy(sid)


async def test_job_resume_with_prefetch_through_the_sdk(pnode: Node):
    sids = [await _holder_sandbox(pnode, job="pf-1") for _ in range(2)]
    async with corral.AsyncClient(ops=pnode, own_ops=False) as client:
        paused = await client.sandboxes.pause(labels={"job": "pf-1"})
        assert sorted(s.id for s in paused) == sorted(sids)
        before = {sid: await _swapped(pnode, sid) for sid in sids}
        assert all(v > 48 * MIB for v in before.values()), before
        resumed = await client.sandboxes.resume(labels={"job": "pf-1"}, prefetch=True)
        assert sorted(s.id for s in resumed) == sorted(sids)
        for sid in sids:
            assert await _swapped(pnode, sid) < before[sid] // 4
            d = _last_resumed(await pnode.events(sid)).detail
            assert d["prefetch"] is True and d["prefetch_bytes"] >= 64 * MIB
        # the handle: paused again, resumed with prefetch by Sandbox.resume
        sb = await client.sandboxes.get(sids[0])
        await sb.pause()
        again = await _swapped(pnode, sids[0])
        assert again > 48 * MIB
        assert (await sb.resume(prefetch=True)).state == "running"
        assert await _swapped(pnode, sids[0]) < again // 4
        for sid in sids:
            sums = await _checksums(pnode, sid)
            assert sums[0] == sums[-1]
            await pnode.sandbox_destroy(sid)


async def test_request_to_paused_sandbox_does_not_prefetch(pnode: Node):
    sid = await _holder_sandbox(pnode)
    swapped = await _paused(pnode, sid)
    r = await pnode.exec(sid, ExecRequest(cmd=["true"]))  # transparent resume
    assert r.ok
    d = _last_resumed(await pnode.events(sid)).detail
    assert d["transparent"] is True and "prefetch" not in d
    assert await _swapped(pnode, sid) > swapped // 2
    await pnode.sandbox_destroy(sid)
