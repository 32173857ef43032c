"""How long the node's state database remembers what is gone.

Every sandbox life leaves rows behind: its record (kept after the destroy, so that a late
call hears "sandbox X is destroyed" and its labels still filter events), its events and its
phase timings. Without a bound the database grows by ~2.6 KiB a life, forever. The bounds
(node config):

- ``destroyed_retention`` seconds after its destroy, and at most the newest
  ``destroyed_max``, for destroyed sandboxes' records (live ones are never dropped);
- the newest ``event_retention`` events, none older than ``event_max_age`` seconds;
- the newest ``metrics.timing_retention`` timings (trimmed by corral.node.stats).

The reaper's pass calls :meth:`Pruner.run`: a few bounded steps (``StateStore.prune``,
``batch`` rows per table each), yielding to the event loop between them, so a backlog (a
lowered bound, a node that was off) drains over several passes instead of one long write
lock that creates would wait behind. SQLite reuses the freed pages, so once the bounds
are reached the file stays the size it is (``corral bench soak`` measures it).

An ``events`` cursor older than the oldest kept event gets ``CursorExpired`` (see
corral.node.events): a follower learns that it missed events instead of skipping them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from corral.node.config import NodeConfig
from corral.node.state import StateStore

__all__ = ["Retention", "Pruner"]


@dataclass(frozen=True)
class Retention:
    """The bounds of :mod:`corral.node.retention` (see NodeConfig for each)."""

    events_max: int = 1_000_000
    events_for: float = 30 * 86400.0
    destroyed_max: int = 20_000
    destroyed_for: float = 86400.0

    @classmethod
    def of(cls, config: NodeConfig) -> Retention:
        return cls(
            events_max=config.event_retention,
            events_for=config.event_max_age,
            destroyed_max=config.destroyed_max,
            destroyed_for=config.destroyed_retention,
        )


class Pruner:
    """Applies a :class:`Retention` to a state store in bounded steps."""

    def __init__(self, state: StateStore, retention: Retention, batch: int = 500, steps: int = 8):
        self.state = state
        self.retention = retention
        self.batch = batch
        self.steps = steps
        """Steps per pass at most: 8 x 500 rows a second outpaces any create rate."""

    def step(self, now: float | None = None) -> int:
        """One bounded step; the rows it deleted."""
        r = self.retention
        return self.state.prune(
            time.time() if now is None else now,
            events_max=r.events_max,
            events_for=r.events_for,
            destroyed_max=r.destroyed_max,
            destroyed_for=r.destroyed_for,
            batch=self.batch,
        )

    async def run(self) -> int:
        """Up to ``steps`` steps while each finds a full batch; the rows deleted."""
        total = 0
        for _ in range(self.steps):
            gone = self.step()
            total += gone
            if gone < self.batch:
                break
            await asyncio.sleep(0)  # let requests waiting for the database in between
        return total
