"""The control plane's own event log: what no single node can report.

Nodes log their sandboxes' events; the control plane sees things above them: a job's lease
lapsing (``lease_expired``), its sandboxes reaped (``orphans``), a job taken back
(``job_attached``) or rebuilt after a restart (``job_rebuilt``), a node going silent
(``node_lost``) and answering again (``node_back``), on-prem fill crossing the burst
threshold (``burst``), and the cloud pool growing and shrinking (``autoscale``).

The fleet-wide ``events()`` merges this log with the nodes' logs under one opaque cursor, in
which the control plane is one more position, keyed :data:`~corral.cluster.CLUSTER_ID`.
The log is soft state like the rest of the control plane: a restarted control plane starts
an empty one. So that a cursor taken before the restart neither skips nor repeats the new
log's events, ids are milliseconds since the epoch (bumped by one when two events share a
millisecond), not a counter starting again at 1.

Example:
    >>> log = ControlEvents(clock=lambda: 1.0)
    >>> log.add("burst", state="on").id
    1000
    >>> [e.kind for e in log.after(0)]
    ['burst']
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from corral.spec import Event

__all__ = ["ControlEvents", "CONTROL_NODE"]

CONTROL_NODE = "cluster"
"""``node_id`` of control-plane events (and their key in a fleet cursor); the same name as
the fleet-wide status's ``node_id``."""

Detail = str | int | float | bool | None


class ControlEvents:
    """A bounded in-memory log of control-plane events (the newest ``keep`` of them)."""

    def __init__(self, keep: int = 10_000, clock: Callable[[], float] = time.time) -> None:
        self._log: deque[Event] = deque(maxlen=keep)
        self._clock = clock
        self._last = 0

    def add(self, kind: str, **detail: Detail) -> Event:
        """Record an event now; returns it."""
        now = self._clock()
        self._last = max(self._last + 1, int(now * 1000))
        ev = Event(
            id=self._last,
            sandbox_id=None,
            time=now,
            kind=kind,
            detail=dict(detail),
            node_id=CONTROL_NODE,
        )
        self._log.append(ev)
        return ev

    def after(
        self,
        position: int = 0,
        *,
        kinds: list[str] | None = None,
        labels: dict[str, str] | None = None,
        limit: int = 10_000,
    ) -> list[Event]:
        """Events with id above ``position``, oldest first, at most ``limit``.

        ``kinds`` keeps those kinds. ``labels`` filters as a node does for its sandboxes:
        control-plane events have no sandbox, so only a job filter can match them (the
        label ``corral.job`` against the event's ``detail["job"]``); any other label
        leaves them out."""
        out: list[Event] = []
        for e in self._log:
            if e.id <= position or (kinds and e.kind not in kinds):
                continue
            if labels and not _matches(e, labels):
                continue
            out.append(e)
            if len(out) >= limit:
                break
        return out


def _matches(e: Event, labels: dict[str, str]) -> bool:
    from corral.cluster.jobs import JOB_LABEL

    return set(labels) == {JOB_LABEL} and e.detail.get("job") == labels[JOB_LABEL]
