"""Paging through a node's event log with opaque cursors (see corral.ops).

The label filter applies before the limit (a page is never emptied by filtering while
later events match), and each event carries its node and the cursor just after it. A
cursor older than the node's retention (corral.node.retention) is refused with
CursorExpired rather than answered with the kept events, which would skip the trimmed
ones without a word.
"""

from __future__ import annotations

from corral.errors import CursorExpired
from corral.node.state import StateStore
from corral.ops import check_events_limit, cursor_positions, stamp_events
from corral.spec import Event

__all__ = ["page_events"]


def page_events(
    state: StateStore,
    node_id: str,
    sandbox_id: str | None,
    after: str | None,
    labels: dict[str, str] | None,
    kinds: list[str] | None,
    limit: int,
) -> list[Event]:
    positions = cursor_positions(after)
    check_events_limit(limit)
    since = positions.get(node_id, 0)
    trimmed = state.events_trimmed_through() if since else 0
    if since < trimmed:
        raise CursorExpired(
            f"after: node {node_id} no longer keeps the events after this cursor's "
            f"position {since}: those up to {trimmed} were trimmed by its retention "
            "(node config event_retention, event_max_age), so some were never read "
            "(with a kind or label filter, maybe none that matched). Read again without "
            f"a cursor: that starts at the oldest kept event, {trimmed + 1}"
        )
    ids = set(state.sandbox_ids_with_labels(labels)) if labels else None
    out: list[Event] = []
    while len(out) < limit:
        page = state.events(sandbox_id, since, limit=limit, kinds=kinds)
        if not page:
            break
        since = page[-1].id
        out += [e for e in page if ids is None or e.sandbox_id in ids]
    return stamp_events(out[:limit], node_id, positions)
