"""The few details of the operations API the suite depends on, in one place: sandbox ids
``sb-<12>-<node>`` (``spec.parse_sandbox_id``), events paged with an opaque cursor
(``events(after=cursor)``), ``SandboxInfo.backend``.
"""

from __future__ import annotations

from corral.ops import NodeOps
from corral.spec import SANDBOX_ID_RE, Event, SandboxInfo

__all__ = ["UNKNOWN_ID", "is_sandbox_id", "backend_of", "events_after", "cursor_of", "cursor_now"]

UNKNOWN_ID = "sb-000000000000-000000000000"
"""A well-formed sandbox id that no node ever hands out (ids are random)."""


def is_sandbox_id(sandbox_id: str) -> bool:
    """Whether ``sandbox_id`` has the shape of an id the node hands out."""
    return SANDBOX_ID_RE.fullmatch(sandbox_id) is not None


def backend_of(info: SandboxInfo) -> str:
    """The isolation engine that runs the sandbox."""
    return info.backend


Cursor = str | None


def cursor_of(events: list[Event], start: Cursor = None) -> Cursor:
    """A cursor past the last of ``events`` (``start`` when there are none)."""
    return events[-1].cursor if events else start


async def cursor_now(ops: NodeOps) -> Cursor:
    """A cursor past every event so far. One answer is a page (a node caps it), so this
    pages to the end; a state dir kept between runs may hold many."""
    cursor: Cursor = None
    while page := await events_after(ops, cursor):
        cursor = cursor_of(page, cursor)
    return cursor


async def events_after(
    ops: NodeOps,
    cursor: Cursor = None,
    *,
    sandbox_id: str | None = None,
    labels: dict[str, str] | None = None,
    kinds: list[str] | None = None,
) -> list[Event]:
    """Events after ``cursor`` (all from the start with the default), oldest first."""
    return await ops.events(
        sandbox_id=sandbox_id, after=cursor, labels=labels, kinds=kinds, limit=10000
    )
