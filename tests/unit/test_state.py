"""The node's SQLite state store: events paging, marks and retention."""

from __future__ import annotations

from pathlib import Path

from corral.node.state import StateStore


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
