"""The node's live sandboxes: one object owning them, their marks and their states.

Every part of the node that reads or changes a live sandbox (lifecycle, exec, files, the
pauser, snapshots and forks, fncall pools, the reaper) does it here, so that

* there is one table of allowed state transitions (:data:`TRANSITIONS`), checked on every
  change; a change a destroy has overtaken is dropped, never written back;
* every state change is written to the state database as it happens (SQLite is the
  source of truth across an agent restart);
* "busy" (a request in flight: the idle reaper and the pauser's grace wait for it) and
  "touched" (last activity, written to the database in batches by the reaper) are kept in
  one place.

States: ``creating`` -> ``running`` <-> (``pausing`` -> ``paused`` -> ``resuming``) ->
``destroying`` -> gone (``destroyed`` in the database). A create that fails goes from
``creating`` straight to gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

from corral.errors import Conflict, SandboxNotFound
from corral.node.state import StateStore
from corral.spec import SANDBOX_ID_RE, SandboxInfo, SandboxState

__all__ = ["SandboxTable", "TRANSITIONS", "shown_id", "Listener"]

Listener = Callable[[str, SandboxInfo | None], None]
"""Told of each change of a live sandbox: (id, its new record, or None once removed).
How the reaper keeps its deadlines and death watches without scanning the table."""

TRANSITIONS: dict[str, frozenset[str]] = {
    "creating": frozenset({"running", "destroying"}),
    "running": frozenset({"pausing", "destroying"}),
    # a pause that failed or was stopped by a request (wake)
    "pausing": frozenset({"paused", "resuming", "running", "destroying"}),
    # recovered after a restart with its cgroup thawed: straight to running
    "paused": frozenset({"resuming", "running", "destroying"}),
    # a thaw that failed goes back to paused
    "resuming": frozenset({"running", "paused", "destroying"}),
    "destroying": frozenset(),
}
"""state -> the states it may change to (``destroying`` ends in removal, not a state)."""

ASLEEP = ("pausing", "paused", "resuming")


def shown_id(sandbox_id: str) -> str:
    """An id as quoted in an error: a caller's 20,000-character id is not echoed whole."""
    return repr(sandbox_id) if len(sandbox_id) <= 80 else repr(sandbox_id[:80]) + "..."


class SandboxTable:
    """Live sandboxes of one node (not thread-safe: the node's event loop only)."""

    def __init__(self, state: StateStore, node_id: str) -> None:
        self._state = state
        self.node_id = node_id
        self._live: dict[str, SandboxInfo] = {}
        self._busy: dict[str, int] = {}
        self._touched: dict[str, float] = {}
        self.listeners: list[Listener] = []

    def _tell(self, sandbox_id: str, info: SandboxInfo | None) -> None:
        for listener in self.listeners:
            listener(sandbox_id, info)

    # ------------------------------------------------------------------ reading
    def get(self, sandbox_id: str) -> SandboxInfo | None:
        return self._live.get(sandbox_id)

    def need(self, sandbox_id: str) -> SandboxInfo:
        """The live sandbox, or SandboxNotFound saying what became of it."""
        info = self._live.get(sandbox_id)
        if info is None:
            old = self.recorded(sandbox_id)
            if old is not None:
                raise SandboxNotFound(f"sandbox {sandbox_id} is {old.state}")
            raise SandboxNotFound(f"no sandbox {shown_id(sandbox_id)} on node {self.node_id}")
        return info

    def recorded(self, sandbox_id: str) -> SandboxInfo | None:
        """The database's record (also of a destroyed sandbox); None for ids it cannot hold."""
        if not _plausible(sandbox_id):
            return None
        return self._state.get_sandbox(sandbox_id)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def ids(self) -> list[str]:
        return list(self._live)

    def values(self) -> list[SandboxInfo]:
        return list(self._live.values())

    def count(self, state: SandboxState) -> int:
        return sum(1 for i in self._live.values() if i.state == state)

    def with_labels(self, labels: dict[str, str] | None) -> list[SandboxInfo]:
        out = list(self._live.values())
        if labels:
            out = [i for i in out if all(i.spec.labels.get(k) == v for k, v in labels.items())]
        return out

    def in_flight(self) -> bool:
        """A create or destroy is running."""
        return any(i.state in ("creating", "destroying") for i in self._live.values())

    # ------------------------------------------------------------------ changing
    def add(self, info: SandboxInfo) -> None:
        """A sandbox being created (``creating``), or adopted after a restart."""
        if info.id in self._live:
            raise Conflict(f"sandbox {info.id} is already on this node")
        # Recorded first: a database that refuses (locked by another process) must not
        # leave a ghost "creating" entry in memory that nothing would ever remove.
        self._state.put_sandbox(info)
        self._live[info.id] = info
        self._tell(info.id, info)

    def set_state(self, sandbox_id: str, state: SandboxState, **update: object) -> SandboxInfo:
        """Move a live sandbox to ``state`` (with field ``update``s) and record it.

        A change a destroy has overtaken (the sandbox is ``destroying`` or gone) is
        dropped and the current record returned, so a late pause or resume never writes a
        destroyed sandbox back. Any other transition outside :data:`TRANSITIONS` is a bug
        of the caller: Conflict."""
        cur = self._live.get(sandbox_id)
        if cur is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} is gone")
        if cur.state == "destroying" and state != "destroying":
            return cur
        if state != cur.state and state not in TRANSITIONS[cur.state]:
            raise Conflict(f"sandbox {sandbox_id} is {cur.state}, cannot become {state}")
        info = cur.model_copy(update={"state": state, **update})
        self._live[sandbox_id] = info
        # Also "destroying": an agent killed mid-destroy leaves a record that the next
        # open does not adopt but finishes destroying (reported "lost").
        if update:
            self._state.put_sandbox(info)
        else:
            self._state.set_state(sandbox_id, state)
        self._tell(sandbox_id, info)
        return info

    def update(self, sandbox_id: str, **fields: object) -> SandboxInfo:
        """Change fields other than the state (network policy, address) and record them."""
        cur = self._live.get(sandbox_id)
        if cur is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} is gone")
        info = cur.model_copy(update=fields)
        self._live[sandbox_id] = info
        if info.state != "destroying":
            self._state.put_sandbox(info)
        self._tell(sandbox_id, info)
        return info

    def remove(self, sandbox_id: str) -> None:
        """Gone: recorded as destroyed."""
        self._live.pop(sandbox_id, None)
        self._touched.pop(sandbox_id, None)
        self._state.mark_destroyed(sandbox_id)
        self._tell(sandbox_id, None)

    # ------------------------------------------------------------------ marks
    @contextlib.contextmanager
    def working(self, sandbox_id: str) -> Iterator[None]:
        """Marks a request in flight, so the idle reaper and a pause's grace wait for it."""
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        try:
            yield
        finally:
            self._touched[sandbox_id] = time.time()
            n = self._busy.get(sandbox_id, 1) - 1
            if n:
                self._busy[sandbox_id] = n
            else:
                self._busy.pop(sandbox_id, None)

    def busy(self, sandbox_id: str) -> bool:
        return sandbox_id in self._busy

    def touch(self, sandbox_id: str, when: float | None = None) -> None:
        self._touched[sandbox_id] = time.time() if when is None else when

    def last_active(self, sandbox_id: str, default: float) -> float:
        return self._touched.get(sandbox_id, default)

    def flush_touches(self) -> None:
        """Write the activity stamps gathered since the last flush (one transaction)."""
        if self._touched:
            self._state.touch_many(self._touched)
            for sid, t in self._touched.items():
                if sid in self._live:
                    self._live[sid] = self._live[sid].model_copy(update={"last_active_at": t})
            self._touched.clear()

    async def created(self, sandbox_id: str) -> None:
        """Wait until the sandbox is no longer being created (made, or failed and gone)."""
        while (i := self._live.get(sandbox_id)) is not None and i.state == "creating":
            await asyncio.sleep(0.005)


def _plausible(sandbox_id: str) -> bool:
    return len(sandbox_id) <= 64 and SANDBOX_ID_RE.fullmatch(sandbox_id) is not None
