"""The node's periodic pass: TTLs, idle timeouts and idle pauses, dead sandboxes.

Once per ``reaper_interval`` it writes the activity stamps gathered since the last pass,
trims the event log, flushes coalesced security events, then looks at every live
sandbox: past its TTL -> destroyed (a paused one too); idle past ``idle_pause`` -> paused
in the background; idle past ``idle_timeout`` -> destroyed (a paused one is spared: pausing
is how an idle sandbox is kept); an agent that died -> ``died`` event and destroyed. A
sandbox with a request in flight is never taken.
"""

from __future__ import annotations

import asyncio
import logging
import time

from corral.node.lifecycle import Lifecycle
from corral.node.pause import Pauser
from corral.node.security import NodeSecurity
from corral.node.state import StateStore
from corral.node.stats import Observer
from corral.node.table import SandboxTable

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
        event_retention: int,
        observer: Observer,
    ) -> None:
        self.observer = observer
        self.life = life
        self.table = table
        self.state = state
        self.security = security
        self.pauser = pauser
        self.interval = interval
        self.event_retention = event_retention
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._forever(), name="corral-reaper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.once()
            except Exception:
                log.exception("reaper pass failed")

    async def once(self) -> None:
        self.table.flush_touches()
        self.state.trim_events(self.event_retention)
        self.observer.flush(trim=True)
        self.security.flush()
        now = time.time()
        for sid in self.table.ids():
            info = self.table.get(sid)  # as it is now: an earlier destroy here awaited
            if info is not None and info.state == "paused":
                if info.expires_at and now >= info.expires_at:
                    await self.life.destroy(info, "ttl_expired")
                continue  # idle_timeout spares a paused sandbox: pausing is how it is kept
            if info is None or info.state != "running" or self.table.busy(sid):
                continue
            if info.expires_at and now >= info.expires_at:
                await self.life.destroy(info, "ttl_expired")
            elif info.spec.idle_pause and now - info.last_active_at >= info.spec.idle_pause:
                self.life.background(self.pauser.pause(sid), f"idle-pause-{sid}")
            elif info.spec.idle_timeout and now - info.last_active_at >= info.spec.idle_timeout:
                await self.life.destroy(info, "idle_timeout")
            elif not self.life.backend_of(info).alive(info.id):
                self.state.add_event(info.id, "died", {})
                await self.life.destroy(info, "destroyed")
