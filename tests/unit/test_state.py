"""The node's SQLite state store: events paging, marks and retention."""

from __future__ import annotations

import struct
import time
from pathlib import Path

from corral.node.state import StateStore
from corral.spec import SandboxInfo, SandboxSpec


def test_events_marks_and_retention(tmp_path: Path) -> None:
    st = StateStore(tmp_path / "state.db")
    try:
        assert st.last_event_id() == 0
        for i in range(25):
            st.add_event("sb-x", "k", {"i": i})
        mark = st.last_event_id()
        assert mark == 25
        st.add_event(None, "after", {})
        assert [e.kind for e in st.events(since_id=mark)] == ["after"]
        assert len(st.events(limit=10)) == 10  # a page, not everything
        assert st.trim_events(keep=5) == 21
        left = st.events()
        assert len(left) == 5 and left[-1].kind == "after" and left[0].id == 22
        assert st.trim_events(keep=5) == 0
    finally:
        st.close()


def test_batch_commits_once_keeps_work_on_error_and_nests(tmp_path: Path) -> None:
    st = StateStore(tmp_path / "state.db")
    other = StateStore(tmp_path / "state.db")  # another connection: sees commits only
    try:
        with st.batch():
            st.add_event("sb-a", "one", {})
            with st.batch():  # joins the outer one
                st.add_event("sb-a", "two", {})
            assert other.events() == []  # not committed yet
        assert [e.kind for e in other.events()] == ["one", "two"]
        try:
            with st.batch():
                st.add_event("sb-b", "kept", {})
                raise RuntimeError("a step after the write failed")
        except RuntimeError:
            pass
        # Committed all the same, as statement-by-statement writes were.
        assert [e.kind for e in other.events()][-1] == "kept"
        st.add_event("sb-c", "after", {})  # autocommit again
        assert [e.kind for e in other.events()][-1] == "after"
    finally:
        other.close()
        st.close()


def _wal_frames(db: Path) -> tuple[int, int]:
    """(frames in the WAL, frames already copied into the main file), from the -shm index:
    mxFrame in its header, nBackfill in the checkpoint info after the header's two copies
    (read without a checkpoint; the wal_checkpoint pragma would run one)."""
    head = (db.parent / (db.name + "-shm")).read_bytes()[:100]
    return struct.unpack_from("=I", head, 16)[0], struct.unpack_from("=I", head, 96)[0]


def test_checkpoints_run_in_their_own_thread(tmp_path: Path) -> None:
    """The writing connection never checkpoints (no fsync in a commit on the event loop);
    the checkpointer thread copies the WAL into the main file, and close removes the WAL."""
    db = tmp_path / "state.db"
    wal = tmp_path / "state.db-wal"
    st = StateStore(db, checkpoint_interval=3600.0)  # no pass in this part
    try:
        assert st._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        for i in range(3000):  # ~1,500 pages of WAL: past SQLite's automatic 1,000
            st.add_event("sb-x", "k", {"pad": "x" * 1000, "i": i})
        frames, copied = _wal_frames(db)
        assert frames > 1000 and copied == 0, (frames, copied)  # no commit checkpointed
        assert st.checkpoints == 0
    finally:
        st.close()
    assert not wal.exists()
    st = StateStore(db, checkpoint_interval=0.01)
    try:
        for i in range(3000):
            st.add_event("sb-y", "k", {"pad": "x" * 1000, "i": i})
        n = st.checkpoints
        assert st.wait_checkpoints(n + 2, 60.0)  # a whole pass that started after the writes
        frames, copied = _wal_frames(db)
        assert frames > 1000 and copied == frames, (frames, copied)  # the thread copied all
        assert len(st.events(limit=10_000)) == 6000
    finally:
        st.close()
    assert not wal.exists()


def test_a_store_without_checkpointer_starts_no_thread(tmp_path: Path) -> None:
    """Short-lived users (tools, tests) get SQLite's own checkpoints and no thread: a store
    left open by a test does not go on checkpointing (and warning) after its dir is gone."""
    st = StateStore(tmp_path / "state.db")
    try:
        assert st._ckpt is None
        assert st._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
        st.add_event("sb-x", "k", {})
        st.checkpoint()  # by hand, on its own connection
    finally:
        st.close()


def test_a_state_change_alone_writes_the_state_column_and_every_read_takes_it(
    tmp_path: Path,
) -> None:
    now = time.time()
    info = SandboxInfo(
        id="sb-00000001-n0000001",
        state="running",
        image="fake/base",
        image_digest="sha256:" + "0" * 64,
        spec=SandboxSpec(image="fake/base"),
        node_id="n0000001",
        created_at=now,
        last_active_at=now,
    )
    st = StateStore(tmp_path / "state.db")
    try:
        st.put_sandbox(info)
        st.set_state(info.id, "paused")
        (raw,) = st._db.execute("SELECT info FROM sandboxes").fetchone()
        assert '"state":"running"' in raw  # the JSON was not rewritten
        got = st.get_sandbox(info.id)
        assert got is not None and got.state == "paused"
        assert [s.state for s in st.live_sandboxes()] == ["paused"]  # what a restart adopts
        st.set_state(info.id, "destroying")
        assert [s.state for s in st.live_sandboxes()] == ["destroying"]
        st.mark_destroyed(info.id)
        assert st.live_sandboxes() == []
    finally:
        st.close()
