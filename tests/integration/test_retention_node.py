"""A real node with a small retention: hundreds of sandbox lives leave the state database
no bigger once its bounds are reached (corral.node.retention), and a late call about a
pruned sandbox is still a clear SandboxNotFound."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from corral.errors import SandboxNotFound
from corral.spec import ExecRequest, SandboxSpec
from tests.conftest import TAG
from tests.integration.conftest import assert_no_leaks, node_config, open_node

STATE = Path(f"/var/lib/corral-test{TAG}-ret")
RUN = Path(f"/run/corral-test{TAG}-ret")
SUBTREE = f"corral-test{TAG}-ret"


def _db(node) -> tuple[int, int, int, int]:  # type: ignore[no-untyped-def]
    """(pages of the database, pages in use, destroyed records, events) as the node's
    store sees them."""
    db = node.state._db
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    gone = db.execute("SELECT COUNT(*) FROM sandboxes WHERE state='destroyed'").fetchone()[0]
    events = db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    free = db.execute("PRAGMA freelist_count").fetchone()[0]
    return int(pages), int(pages - free), int(gone), int(events)


async def test_the_state_database_stays_bounded_over_many_lives(images_ready) -> None:  # type: ignore[no-untyped-def]
    cfg = node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE)
    cfg.event_retention = cfg.metrics.timing_retention = 100
    cfg.destroyed_max = 50
    spec = SandboxSpec(image="test/debian")
    first_id = ""
    try:
        async with open_node(cfg) as node:
            sem = asyncio.Semaphore(8)

            async def life(i: int) -> str:
                async with sem:
                    info = await node.sandbox_create(spec)
                    try:
                        r = await node.exec(info.id, ExecRequest(cmd=["echo", str(i)]))
                        assert r.stdout == f"{i}\n".encode()
                    finally:
                        await node.sandbox_destroy(info.id)
                    return info.id

            sizes = []
            for rnd in range(6):  # 4 x 100 lives; a reaper pass (its pruning) after each
                ids = await asyncio.gather(*(life(rnd * 100 + i) for i in range(100)))
                first_id = first_id or ids[0]
                for _ in range(20):  # bounded steps: a backlog takes a few passes
                    await node.reaper.once()
                node.observer.flush(trim=True)
                sizes.append(_db(node))
            # the bounds hold: 50 destroyed records, 100 events (pruned after each round)
            assert all(s[2] <= 50 and s[3] <= 100 for s in sizes), sizes
            # once they were reached (after the first round) the pages in use stay flat,
            # and the file only finds its high-water mark (the freelist absorbs the
            # churn of 8 lives in flight): far less than the ~65 pages that 100 lives
            # add to a database that keeps everything
            assert sizes[-1][1] <= sizes[1][1] * 1.10 + 2, sizes
            assert sizes[-1][0] - sizes[1][0] <= 16, sizes
            # a pruned sandbox: still a clear answer, only no longer "destroyed"
            with pytest.raises(SandboxNotFound, match="no sandbox"):
                await node.exec(first_id, ExecRequest(cmd=["true"]))
        assert_no_leaks(STATE, RUN, SUBTREE)
    finally:
        shutil.rmtree(STATE, ignore_errors=True)
        shutil.rmtree(RUN, ignore_errors=True)
