"""The node's periodic pass: TTLs, idle timeouts and idle pauses, dead sandboxes.

Once per ``reaper_interval`` it writes the activity stamps gathered since the last pass,
prunes the state database to its retention (events, destroyed sandboxes: see
corral.node.retention), flushes coalesced security events, then looks at the sandboxes
that need it: past its TTL -> destroyed (a paused one too), or paused for a ``ttl_action``
of ``pause`` (then its TTL is cleared); idle past ``idle_pause`` -> paused
in the background; idle past ``idle_timeout`` -> destroyed (a paused one is spared: pausing
is how an idle sandbox is kept); an agent that died -> ``died`` event and destroyed. A
sandbox with a request in flight is never taken.

A pass costs O(due + died + SAMPLE), not O(live): deadlines come off a heap and deaths
from pidfds in the event loop (corral.node.watch), both kept current by the table's
change listener; a bounded round-robin sample of ``alive()`` checks covers deaths a pid
does not show.
"""

from __future__ import annotations

import asyncio
import logging
import time

from corral.node.deadlines import SAMPLE, Deadlines, DeathWatch, next_deadline
from corral.node.lifecycle import Lifecycle
from corral.node.pause import Pauser
from corral.node.retention import Pruner
from corral.node.security import NodeSecurity
from corral.node.state import StateStore
from corral.node.stats import Observer
from corral.node.table import SandboxTable
from corral.spec import SandboxInfo

__all__ = ["Reaper"]

log = logging.getLogger("corral.node")


class Reaper:
    def __init__(
        self,
        life: Lifecycle,
        table: SandboxTable,
        state: StateStore,
        security: NodeSecurity,
        pauser: Pauser,
        interval: float,
        pruner: Pruner,
        observer: Observer,
    ) -> None:
        self.observer = observer
        self.life = life
        self.table = table
        self.state = state
        self.security = security
        self.pauser = pauser
        self.interval = interval
        self.pruner = pruner
        self._task: asyncio.Task[None] | None = None
        self.deadlines = Deadlines()
        self.deaths = DeathWatch()
        table.listeners.append(self._changed)

    def _changed(self, sandbox_id: str, info: SandboxInfo | None) -> None:
        if info is None:
            self.deadlines.forget(sandbox_id)
            self.deaths.forget(sandbox_id)
            return
        self.deadlines.arm(sandbox_id, next_deadline(info))
        self.deaths.watch(sandbox_id, info.pid if info.state == "running" else None)

    def start(self) -> None:
        for info in self.table.values():  # any added before the listener: once, at start
            self._changed(info.id, info)
        self._task = asyncio.create_task(self._forever(), name="corral-reaper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self.deaths.close()

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.once()
            except Exception:
                log.exception("reaper pass failed")

    async def once(self) -> None:
        self.table.flush_touches()
        await self.pruner.run()  # bounded steps (corral.node.retention)
        self.observer.flush(trim=True)
        self.security.flush()
        now = time.time()
        for sid in self.deadlines.due(now):
            await self._deadline(sid, now)
        for sid in {*self.deaths.reported(), *self.deaths.sample(SAMPLE)}:
            await self._maybe_dead(sid)

    async def _deadline(self, sid: str, now: float) -> None:
        """``sid``'s deadline came: act, or arm the next one (activity moved it)."""
        info = self.table.get(sid)  # as it is now: an earlier destroy here awaited
        if info is None:
            return
        expired = info.expires_at is not None and now >= info.expires_at
        if info.state == "paused":
            if expired and info.spec.ttl_action == "pause":
                self.table.update(sid, expires_at=None)  # its TTL did its work: kept
            elif expired:
                await self.life.destroy(info, "ttl_expired")
            else:  # idle_timeout spares a paused sandbox: pausing is how it is kept
                self.deadlines.arm(sid, next_deadline(info))
            return
        if info.state != "running" or self.table.busy(sid):
            when = next_deadline(info)
            if when is not None:
                self.deadlines.arm(sid, max(when, now + self.interval))
            return
        if expired and info.spec.ttl_action == "pause":
            # Paused, the next look clears the TTL; a pause that fails leaves it running
            # and expired, so the state change re-arms it and the pause is tried again.
            self.life.background(self.pauser.pause(sid), f"ttl-pause-{sid}")
        elif expired:
            await self.life.destroy(info, "ttl_expired")
        elif info.spec.idle_pause and now - info.last_active_at >= info.spec.idle_pause:
            # Its state change (pausing, or back to running if the pause fails) re-arms it.
            self.life.background(self.pauser.pause(sid), f"idle-pause-{sid}")
        elif info.spec.idle_timeout and now - info.last_active_at >= info.spec.idle_timeout:
            await self.life.destroy(info, "idle_timeout")
        else:
            self.deadlines.arm(sid, next_deadline(info))

    async def _maybe_dead(self, sid: str) -> None:
        """A pidfd said ``sid``'s process exited, or the sample picked it: ask its backend."""
        info = self.table.get(sid)
        if info is None:
            self.deaths.settled(sid)
            return
        if info.state != "running" or self.table.busy(sid):
            return  # a reported death stays reported: looked at again on a later pass
        self.deaths.settled(sid)
        if not self.life.backend_of(info).alive(info.id):
            self.state.add_event(info.id, "died", {})
            await self.life.destroy(info, "destroyed")
