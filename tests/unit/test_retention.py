"""The state database's retention (corral.node.retention): what is dropped, what never is,
the bound on one step, the file that stops growing, and the cursor that fell behind."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from corral.errors import CursorExpired
from corral.node.retention import Pruner, Retention
from corral.node.state import StateStore
from corral.spec import SandboxInfo, SandboxSpec
from corral.testing import open_fake_node

SPEC = SandboxSpec(image="fake/base")


def _info(i: int, now: float) -> SandboxInfo:
    return SandboxInfo(
        id=f"sb-{i:08x}-n0000001",
        state="running",
        image="fake/base",
        image_digest="sha256:" + "0" * 64,
        spec=SPEC.model_copy(update={"labels": {"i": str(i)}}),
        node_id="n0000001",
        created_at=now,
        last_active_at=now,
    )


def _bounds(**kw: float) -> dict[str, float]:
    base = {"events_max": 10**9, "events_for": 1e9, "destroyed_max": 10**9, "destroyed_for": 1e9}
    return {**base, **kw}


def test_destroyed_records_go_by_age_and_count_live_ones_never(tmp_path: Path) -> None:
    st = StateStore(tmp_path / "state.db")
    try:
        now = 1_000_000.0
        for i in range(10):
            st.put_sandbox(_info(i, now))
        for i in range(6):  # 0..5 destroyed, 6..9 live
            st.mark_destroyed(f"sb-{i:08x}-n0000001")
        ids = [f"sb-{i:08x}-n0000001" for i in range(10)]
        # nothing is past its bounds yet
        assert st.prune(now, **_bounds(destroyed_for=3600)) == 0  # type: ignore[arg-type]
        # by count: the 4 oldest destroyed go, the live ones stay whatever the bound
        assert st.prune(now, **_bounds(destroyed_max=2)) == 4  # type: ignore[arg-type]
        kept = [i for i in ids if st.get_sandbox(i) is not None]
        assert len(kept) == 6 and all(st.get_sandbox(i).state == "running" for i in ids[6:])  # type: ignore[union-attr]
        # by age (the destroy time is the mark): the other destroyed go, live ones stay
        later = time.time() + 3600  # an hour after the destroys
        assert st.prune(later, **_bounds(destroyed_for=60)) == 2  # type: ignore[arg-type]
        assert [i for i in ids if st.get_sandbox(i) is not None] == ids[6:]
        assert len(st.live_sandboxes()) == 4
    finally:
        st.close()


def test_events_go_by_count_and_age_in_bounded_steps(tmp_path: Path) -> None:
    st = StateStore(tmp_path / "state.db")
    try:
        for i in range(1200):
            st.add_event("sb-x", "k", {"i": i})
        # one step removes at most `batch` of them
        assert st.prune(0.0, **_bounds(events_max=100), batch=500) == 500  # type: ignore[arg-type]
        assert st.events_trimmed_through() == 500
        assert st.prune(0.0, **_bounds(events_max=100), batch=500) == 500  # type: ignore[arg-type]
        assert st.prune(0.0, **_bounds(events_max=100), batch=500) == 100  # type: ignore[arg-type]
        assert [e.id for e in st.events()][0] == 1101 and st.events_trimmed_through() == 1100
        # by age: every event is older than a zero-second bound seen from far ahead
        assert st.prune(1e12, **_bounds(events_for=1), batch=500) == 100  # type: ignore[arg-type]
        assert st.events() == [] and st.events_trimmed_through() == 1200
        st.add_event(None, "new", {})
        assert st.events_trimmed_through() == 1200 and st.events()[0].id == 1201
    finally:
        st.close()


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def test_the_file_stops_growing_once_the_bounds_are_reached(tmp_path: Path) -> None:
    """Thousands of simulated sandbox lives with small bounds: the database file (main +
    WAL) at the end is within 10% of its size once the bounds were first reached."""
    path = tmp_path / "state.db"
    st = StateStore(path, checkpoint_interval=3600.0)  # checkpoints at the reaper's pass
    pruner = Pruner(
        st, Retention(events_max=300, destroyed_max=100, destroyed_for=1e9, events_for=1e9)
    )
    try:
        sizes = []
        for i in range(6000):
            now = 1_000_000.0 + i
            st.put_sandbox(_info(i, now))
            for kind in ("created", "exec", "destroyed"):
                st.add_event(f"sb-{i:08x}-n0000001", kind, {"pad": "x" * 40})
            st.add_timings([(f"sb-{i:08x}-n0000001", "create", now, 0.05, {"a": 0.01}, {})])
            st.mark_destroyed(f"sb-{i:08x}-n0000001")
            if i % 10 == 0:  # the reaper's pass
                asyncio.run(pruner.run())
                st.trim_timings(300)
                st.checkpoint()  # the checkpointer thread's pass, here at a fixed point
            if i % 1000 == 999:
                pages = st._db.execute("PRAGMA page_count").fetchone()[0]
                sizes.append((_size(path), pages))
        assert len(st.events()) <= 300 + 30
        assert st._db.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0] <= 100 + 10
        # the file with its WAL, and the pages of the database itself (a WAL of MiBs
        # would hide a slow growth): both flat; without pruning both grow every 1000 lives
        assert sizes[-1][0] <= sizes[1][0] * 1.10, sizes
        assert sizes[-1][1] <= sizes[1][1] * 1.10, sizes
    finally:
        st.close()


async def test_a_cursor_older_than_the_retention_is_refused_clearly(tmp_path: Path) -> None:
    async with open_fake_node(tmp_path) as node:
        for _ in range(4):
            await node.sandbox_create(SPEC)
        first = await node.events(limit=1)
        assert first
        node.state.trim_events(keep=2)  # what the retention does to an old log
        with pytest.raises(CursorExpired, match="no longer keeps .* Read again without a cursor"):
            await node.events(after=first[0].cursor)
        kept = await node.events()  # without a cursor: the oldest kept onwards
        assert len(kept) == 2 and kept[0].id == node.state.events_trimmed_through() + 1
        # the cursor of the last trimmed event itself misses nothing
        assert await node.events(after=kept[0].cursor) == kept[1:]


async def test_over_http_an_expired_cursor_is_a_documented_410(tmp_path: Path) -> None:
    import httpx

    from corral.api import create_app
    from corral.errors import error_from_wire

    async with open_fake_node(tmp_path) as node:
        for _ in range(3):
            await node.sandbox_create(SPEC)
        old = (await node.events(limit=1))[0].cursor
        node.state.trim_events(keep=1)
        app = create_app(node)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://corral.test"
        ) as c:
            r = await c.get("/v1/events", params={"after": old})
            spec = (await c.get("/openapi.json")).json()
        assert r.status_code == 410
        assert isinstance(error_from_wire(r.json(), 410), CursorExpired)
        assert "410" in spec["paths"]["/v1/events"]["get"]["responses"]
        assert "410" in spec["paths"]["/v1/sandboxes/{sandbox_id}/events"]["get"]["responses"]
