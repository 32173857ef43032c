"""Pause and resume of sandboxes, and the swap a node adds for them.

Pause = freeze every process of the sandbox (cgroup freezer) and push its memory out to
swap (:meth:`Cgroups.reclaim`); the limits are restored right away, and frozen tasks do not
fault their pages back in. Resume = thaw; pages come back on first touch. ``resume(prefetch=
True)`` also starts reading the whole working set back once thawed (:mod:`corral.host.prefetch`:
MADV_WILLNEED through process_madvise over every mapping of every process, so swapped pages
go to the swap cache and touching them is a minor fault, not a disk read); the call returns
when the advice calls have, the reads may still be finishing. Without it nothing is read
ahead: a resumed agent often touches a small part of what it had, and reading it all back
costs the full swap-in. Any request to a paused sandbox resumes it first (:meth:`Pauser.wake`,
called from the node's request choke point), so a paused sandbox is only slower on its
first request, never broken.

States: ``running`` -> ``pausing`` (frozen, reclaim running) -> ``paused``; ``paused`` ->
``resuming`` -> ``running``. A pause first lets requests already in flight finish (up to
:data:`PAUSE_GRACE`); a request that arrives during ``pausing`` stops the pause, which
thaws the sandbox as soon as its memory limit is restored (the request waits until then).

For other parts of the node that need a sandbox still for a moment (snapshots, forks)::

    async with node.pauser.frozen(sandbox_id):
        ...   # every process of the sandbox is frozen here (already paused: stays so)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.errors import Conflict, CorralError, HostError, InvalidRequest
from corral.host import prefetch as prefetchmod
from corral.host import swap as swapmod
from corral.host.cgroups import Cgroups
from corral.node.table import SandboxTable
from corral.spec import SandboxInfo, SandboxState

if TYPE_CHECKING:
    from corral.node.config import SwapConfig

__all__ = ["Pauser", "NodeSwap"]

log = logging.getLogger("corral.node.pause")

_PAUSABLE = ("running",)
PAUSE_GRACE = 10.0
"""Seconds a pause waits for requests already in flight before it freezes anyway."""
_ASLEEP = ("pausing", "paused")


class NodeSwap:
    """The swap area a node adds (per its config) and removes; recorded in the state dir so
    that a node that crashed removes it on its next teardown or gc."""

    def __init__(self, config: SwapConfig, state_dir: Path) -> None:
        self.config = config
        self.record = swapmod.SwapRecord(state_dir / "swap.json")
        self.file = config.path or state_dir / "swap" / "corral.swap"
        self.devices: list[swapmod.SwapDevice] = []

    def setup(self) -> None:
        """Add the configured swap, unless what an earlier run added is still on."""
        on = swapmod.active()
        kept = [d for d in self.record.load() if d.path in on]
        stale = [d for d in self.record.load() if d.path not in on]
        for d in stale:  # half-removed by a crash (zram device or file without swapon)
            swapmod.remove(d)
        if kept or self.config.kind == "none":
            self.devices = kept
            if kept:
                self.record.save(kept)
            else:
                self.record.clear()
            return
        if self.config.kind == "zram":
            dev = swapmod.add_zram(self.config.size)
        else:
            dev = swapmod.add_file(self.file, self.config.size)
        self.devices = [dev]
        self.record.save(self.devices)

    def teardown(self) -> None:
        """swapoff and remove what this node added (pages in it come back to RAM first)."""
        for d in self.record.load() or self.devices:
            swapmod.remove(d)
        self.devices = []
        self.record.clear()
        if self.config.path is None:
            with contextlib.suppress(OSError):
                self.file.parent.rmdir()

    def paths(self) -> list[str]:
        return [d.path for d in self.devices]

    def zram_compressed(self) -> int:
        """RAM taken by this node's zram devices (their compressed pages), in bytes."""
        return sum(swapmod.zram_stats(d).get("mem_used", 0) for d in self.devices)


class Pauser:
    """Pauses and resumes the sandboxes of one node; the :class:`SandboxTable` keeps the
    states (and refuses a change a destroy has overtaken), ``event`` records events; so this
    class owns no state but the running reclaims.
    """

    def __init__(
        self,
        cgroups: Cgroups,
        table: SandboxTable,
        event: Callable[[str, str, dict[str, Any]], object],
        save_memory: Callable[[str], Awaitable[dict[str, Any]]] | None = None,
        restore_memory: Callable[[str], Awaitable[object]] | None = None,
    ) -> None:
        self.cgroups = cgroups
        # pause(memory_snapshot=True): the backend saves the whole machine and ends it
        # (microVMs); resume restores it, or the first request does (through the backend).
        self._save_memory = save_memory
        self._restore_memory = restore_memory
        self._mem_paused: set[str] = set()
        self.table = table
        self._event = event
        self._stops: dict[str, threading.Event] = {}
        self._tasks: dict[str, asyncio.Future[SandboxInfo]] = {}
        self._held: dict[str, int] = {}
        self._wake_pending: set[str] = set()
        self._fz: dict[str, threading.Lock] = {}
        # Sandboxes an explicit resume(prefetch=True) is waking: their "resumed" event waits
        # here (None until the thaw) for the prefetch figures.
        self._deferred: dict[str, dict[str, Any] | None] = {}
        # Reclaim blocks in the kernel for up to a second per sandbox: its own threads, so a
        # job-wide pause of thousands never starves the node's other thread work (files).
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="corral-reclaim")

    async def close(self) -> None:
        """Cut reclaims in progress short (their sandboxes end up paused, just less
        reclaimed) and wait for them."""
        for ev in list(self._stops.values()):
            ev.set()
        if self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)
        self._pool.shutdown(wait=False)

    def _lock(self, sid: str) -> threading.Lock:
        lock = self._fz.get(sid)
        if lock is None:
            lock = self._fz[sid] = threading.Lock()
        return lock

    def _freeze(self, sid: str, stop: threading.Event | None = None) -> None:
        """Freeze, unless (or until) ``stop`` is set. Freezer writes of one sandbox are
        serialized: a thaw racing a freeze's wait would otherwise leave either waiting for
        a state that never comes, or the sandbox frozen after its thaw."""
        with self._lock(sid):
            if stop is None or not stop.is_set():
                self.cgroups.freeze(sid, abort=None if stop is None else stop.is_set)

    def _thaw(self, sid: str) -> None:
        with self._lock(sid):  # a freeze in progress gives way within ~1 ms (its stop)
            self.cgroups.thaw(sid)

    def _set(self, info: SandboxInfo, state: SandboxState) -> SandboxInfo:
        return self.table.set_state(info.id, state)

    def _get(self, sid: str) -> SandboxInfo | None:
        return self.table.get(sid)

    # ------------------------------------------------------------------ pause
    async def pause(self, sandbox_id: str, memory_snapshot: bool = False) -> SandboxInfo:
        """Freeze and reclaim; returns the sandbox as ``paused`` (or as a concurrent
        request left it: ``running`` when one resumed it meanwhile). ``memory_snapshot``:
        the backend saves the machine to a file and ends it instead (all its memory freed)."""
        running = self._tasks.get(sandbox_id)
        if running is not None:
            return await asyncio.shield(running)
        info = self._get(sandbox_id)
        assert info is not None
        if info.state == "paused":
            return info
        if info.state not in _PAUSABLE:
            raise Conflict(f"sandbox {sandbox_id} is {info.state}; only a running one pauses")
        if memory_snapshot:
            if self._save_memory is None:
                raise InvalidRequest("pause(memory_snapshot=True): not on this node")
            task = asyncio.ensure_future(self._pause_memory(info, self._save_memory))
        else:
            task = asyncio.ensure_future(self._pause(info))
        self._tasks[sandbox_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(sandbox_id, None))
        # Once started, a pause runs to its end (or until a request stops it): a caller
        # that goes away must not leave a sandbox frozen with its state saying running.
        return await asyncio.shield(task)

    async def _pause(self, info: SandboxInfo) -> SandboxInfo:
        sid = info.id
        loop = asyncio.get_running_loop()
        stop = self._stops[sid] = threading.Event()
        t0 = time.monotonic()
        before = self._usage(sid)
        info = self._set(info, "pausing")
        frozen_ms = 0.0
        # Requests already in flight (an exec sent a moment before the pause) finish first,
        # up to PAUSE_GRACE; new ones stop the pause (wake). Past the grace the sandbox is
        # frozen anyway: a long exec then waits for the resume.
        deadline = time.monotonic() + PAUSE_GRACE
        while self.table.busy(sid) and not stop.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        try:
            await loop.run_in_executor(self._pool, self._freeze, sid, stop)
            frozen_ms = (time.monotonic() - t0) * 1000
            if not stop.is_set():
                await loop.run_in_executor(self._pool, self._reclaim, sid, stop)
        except BaseException:
            cur = self._get(sid)
            if cur is not None and cur.state in ("pausing", "resuming"):
                with contextlib.suppress(CorralError):
                    self._thaw(sid)
                self._set(cur, "running")
            raise
        finally:
            if self._stops.get(sid) is stop:
                del self._stops[sid]
        cur = self._get(sid)
        if cur is not None and cur.state == "resuming":
            # A request came meanwhile (wake() stopped us): thaw only now that the reclaim
            # has given the memory limit back, or the sandbox would thrash against it.
            return self._finish_wake(cur, t0, transparent=True)
        if cur is None or cur.state != "pausing":
            return cur or info  # destroyed meanwhile
        resident, swapped = self._usage(sid)
        cur = self._set(cur, "paused")
        self._event(
            sid,
            "paused",
            {
                "ms": round((time.monotonic() - t0) * 1000, 1),
                "freeze_ms": round(frozen_ms, 1),
                "resident_before": before[0],
                "resident": resident,
                "swapped": swapped,
            },
        )
        return cur

    async def _pause_memory(
        self, info: SandboxInfo, save: Callable[[str], Awaitable[dict[str, Any]]]
    ) -> SandboxInfo:
        """Requests in flight finish (up to PAUSE_GRACE), then the backend saves and ends
        the machine. A request arriving during the save waits for it and then restores."""
        sid = info.id
        t0 = time.monotonic()
        before = self._usage(sid)
        info = self._set(info, "pausing")
        deadline = time.monotonic() + PAUSE_GRACE
        while self.table.busy(sid) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        try:
            detail = await save(sid)
        except BaseException:
            cur = self._get(sid)
            if cur is not None and cur.state in ("pausing", "resuming"):
                self._set(cur, "running")
            raise
        cur = self._get(sid)
        if cur is None or cur.state not in ("pausing", "resuming"):
            return cur or info  # destroyed meanwhile
        self._mem_paused.add(sid)
        if cur.state == "resuming":  # a request came meanwhile: it restores the machine
            return self._finish_wake(cur, t0, transparent=True, thaw=False)
        resident, swapped = self._usage(sid)
        cur = self._set(cur, "paused")
        self._event(
            sid,
            "paused",
            {
                "ms": round((time.monotonic() - t0) * 1000, 1),
                "resident_before": before[0],
                "resident": resident,
                "swapped": swapped,
                **detail,
            },
        )
        return cur

    def _reclaim(self, sid: str, stop: threading.Event) -> None:
        try:
            self.cgroups.reclaim(sid, stop.is_set)
        except HostError as e:
            # Frozen but not reclaimed is still paused; a destroyed cgroup ends up here too.
            log.warning("reclaim of %s stopped: %s", sid, e.message)

    def _usage(self, sid: str) -> tuple[int, int]:
        try:
            return self.cgroups.memory_usage(sid)
        except CorralError:
            return 0, 0

    # ------------------------------------------------------------------ resume
    async def resume(self, sandbox_id: str, prefetch: bool = False) -> SandboxInfo:
        """Thaw a paused sandbox (a running one is returned as it is); one being paused is
        stopped and thawed, and returned once it runs.

        ``prefetch``: once thawed, advise every process of the sandbox to read its memory
        back (:meth:`_prefetch`); returns when the advice calls have returned, and the
        ``resumed`` event carries the figures (bytes advised, swapped before/after, ms). A
        sandbox still held frozen by a :meth:`frozen` block is not prefetched (it stays
        frozen until the block ends)."""
        info = self._get(sandbox_id)
        assert info is not None
        if info.state == "running":
            return info
        if info.state not in (*_ASLEEP, "resuming"):
            raise Conflict(f"sandbox {sandbox_id} is {info.state}; only a paused one resumes")
        mem = sandbox_id in self._mem_paused
        own = prefetch and sandbox_id not in self._deferred  # a second caller just waits
        if own:
            self._deferred[sandbox_id] = None
        try:
            if mem and info.state == "paused" and self._restore_memory is not None:
                info = await self._restore(sandbox_id, info)
            else:
                info = self.wake(sandbox_id, transparent=False)
                task = self._tasks.get(sandbox_id)
                if task is not None:
                    info = await asyncio.shield(task)
                if mem and info.state == "running" and self._restore_memory is not None:
                    await self._restore_memory(sandbox_id)  # else the first request would
        finally:
            detail = self._deferred.pop(sandbox_id, None) if own else None
        if detail is None:  # not woken by this call (held frozen, destroyed meanwhile)
            return info
        detail["transparent"] = False  # also when it stopped a pause half-way
        try:
            if info.state == "running":
                detail.update(await self._prefetch(sandbox_id))
        finally:
            self._event(sandbox_id, "resumed", detail)
        return info

    async def _restore(self, sid: str, info: SandboxInfo) -> SandboxInfo:
        """Resume a machine saved by a memory-snapshot pause: ``resuming`` while the backend
        restores it, ``running`` once it runs. A restore that fails (a corrupt or missing
        file) leaves it ``paused`` and still saved: the error is the caller's, the reaper
        does not take a saved machine for a dead one, and destroy still works."""
        assert self._restore_memory is not None
        t0 = time.monotonic()
        info = self._set(info, "resuming")
        try:
            await self._restore_memory(sid)
        except BaseException:
            cur = self._get(sid)
            if cur is not None and cur.state == "resuming":
                self._set(cur, "paused")
            raise
        self._mem_paused.discard(sid)
        cur = self._get(sid)
        if cur is None or cur.state != "resuming":
            return cur or info  # destroyed meanwhile
        return self._finish_wake(cur, t0, transparent=False, thaw=False)

    async def _prefetch(self, sid: str) -> dict[str, Any]:
        """MADV_WILLNEED over all mappings of the sandbox's processes, in a thread (the
        calls submit the reads of all swapped pages, which takes a while for a big sandbox);
        returns the figures for the ``resumed`` event."""
        t0 = time.monotonic()
        before = self._usage(sid)
        try:
            pids = self.cgroups.procs(sid)
        except CorralError:
            pids = []
        adv = await asyncio.to_thread(prefetchmod.willneed_all, pids)
        after = self._usage(sid)
        if adv.errors:
            log.debug("prefetch of %s: %d ranges refused (%s)", sid, len(adv.errors), adv.errors[0])
        return {
            "prefetch": True,
            "prefetch_ms": round((time.monotonic() - t0) * 1000, 2),
            "prefetch_bytes": adv.bytes,
            "prefetch_anon_bytes": adv.anon_bytes,
            "prefetch_file_bytes": adv.file_bytes,
            "prefetch_processes": adv.processes,
            "prefetch_ranges": adv.ranges,
            "prefetch_errors": len(adv.errors),
            # v1 moves a page's charge from swap to memory as it enters the swap cache; v2
            # keeps the swap slot charged until it is freed: there "resident" is the figure
            "swapped_before": before[1],
            "swapped_after": after[1],
            "resident_before": before[0],
            "resident_after": after[0],
        }

    def wake(self, sandbox_id: str, transparent: bool = True) -> SandboxInfo:
        """For a request that arrived at a paused or pausing sandbox. Paused: thaw now
        (synchronously: a freezer write, ~1 ms). Pausing: stop the freeze or reclaim and
        leave the state ``resuming``; the pause task thaws as soon as the memory limit is
        back (the request meanwhile waits on the frozen processes, like in a frozen()
        block).

        Never prefetches: this runs synchronously in the request's path, and a request
        usually touches a small part of the sandbox's memory; reading all of it back would
        compete with the request's own faults for the disk, and a sandbox that idle-pause
        parks and a poll wakes would take its whole memory back every time. Callers that
        know the sandbox is about to work call ``resume(prefetch=True)``."""
        info = self._get(sandbox_id)
        assert info is not None
        if info.state not in _ASLEEP:
            return info
        if self._held.get(sandbox_id):
            self._wake_pending.add(sandbox_id)  # woken when the frozen() block ends
            return info
        stop = self._stops.get(sandbox_id)
        if info.state == "pausing" and stop is not None:
            stop.set()
            return self._set(info, "resuming")
        if info.state == "pausing":  # a memory save in progress: it ends in "running"
            return self._set(info, "resuming")
        t0 = time.monotonic()
        self._mem_paused.discard(sandbox_id)  # nothing frozen then: the thaw is a no-op
        info = self._set(info, "resuming")
        try:
            self._thaw(sandbox_id)
        except BaseException:
            self._set(info, "paused")
            raise
        return self._finish_wake(info, t0, transparent, thaw=False)

    def _finish_wake(
        self, info: SandboxInfo, t0: float, transparent: bool, thaw: bool = True
    ) -> SandboxInfo:
        if thaw:  # also a freeze stopped half-way (FREEZING) must be thawed
            self._thaw(info.id)
        info = self._set(info, "running")
        detail = {"ms": round((time.monotonic() - t0) * 1000, 2), "transparent": transparent}
        if info.id in self._deferred:  # resume(prefetch=True) adds its figures, then records
            self._deferred[info.id] = detail
        else:
            self._event(info.id, "resumed", detail)
        return info

    # ------------------------------------------------------------------ jobs
    async def pause_many(self, infos: list[SandboxInfo]) -> list[SandboxInfo]:
        """Pause all of ``infos`` concurrently; returns those now paused."""
        got = await asyncio.gather(
            *(self.pause(i.id) for i in infos if i.state in ("running", "pausing", "paused")),
            return_exceptions=True,
        )
        return [g for g in got if isinstance(g, SandboxInfo) and g.state == "paused"]

    async def resume_many(
        self, infos: list[SandboxInfo], prefetch: bool = False
    ) -> list[SandboxInfo]:
        """Resume all of ``infos`` that are paused (or being paused); returns those resumed."""
        got = await asyncio.gather(
            *(self.resume(i.id, prefetch) for i in infos if i.state in (*_ASLEEP, "resuming")),
            return_exceptions=True,
        )
        return [g for g in got if isinstance(g, SandboxInfo) and g.state == "running"]

    # ------------------------------------------------------------------ for other parts
    @contextlib.asynccontextmanager
    async def frozen(self, sandbox_id: str) -> AsyncIterator[None]:
        """Hold the sandbox's processes frozen for the block (e.g. to copy its writable
        layer consistently). A paused sandbox stays paused; requests arriving meanwhile do
        not thaw it early (they wait on the frozen processes until the block ends)."""
        info = self._get(sandbox_id)
        if info is None:
            raise InvalidRequest(f"no sandbox {sandbox_id}")
        self._held[sandbox_id] = self._held.get(sandbox_id, 0) + 1
        thaw = info.state not in _ASLEEP
        try:
            if thaw:
                await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._freeze, sandbox_id
                )
            yield
        finally:
            n = self._held.pop(sandbox_id, 1) - 1
            if n:
                self._held[sandbox_id] = n
            else:
                wanted = sandbox_id in self._wake_pending
                self._wake_pending.discard(sandbox_id)
                cur = self._get(sandbox_id)
                with contextlib.suppress(CorralError):
                    if cur is not None and cur.state in _ASLEEP:
                        if wanted:  # a request came for the paused sandbox meanwhile
                            self.wake(sandbox_id)
                    elif cur is not None and thaw:
                        self._thaw(sandbox_id)

    def recovered(self, info: SandboxInfo, saved: bool = False) -> SandboxInfo:
        """After an agent restart: a sandbox caught mid-pause or mid-resume gets its memory
        limit back (a reclaim cut short may have left it squeezed) and runs; a paused one
        stays paused if its cgroup is still frozen, or if ``saved``: its backend holds it
        in a memory snapshot (a microVM), which its first request or a resume restores
        (its cgroup's limits are the backend's own, never squeezed: left alone)."""
        if info.state == "paused" and self._is_frozen(info.id):
            return info
        if saved and info.state in ("pausing", "resuming", "paused"):
            self._mem_paused.add(info.id)
            return info if info.state == "paused" else self._set(info, "paused")
        if info.state == "running" and self._is_frozen(info.id):
            # Held frozen by a snapshot or fork (Pauser.frozen) when the agent died.
            with contextlib.suppress(CorralError):
                self.cgroups.thaw(info.id)
            return info
        if info.state in ("pausing", "resuming", "paused"):
            with contextlib.suppress(CorralError):
                self.cgroups.set_memory(info.id, info.spec.limits.memory, 0)
                self.cgroups.thaw(info.id)
            return self._set(info, "running")
        return info

    def _is_frozen(self, sid: str) -> bool:
        try:
            return self.cgroups.is_frozen(sid)
        except CorralError:
            return False

    def held(self, sandbox_id: str) -> bool:
        """True while a :meth:`frozen` block holds the sandbox."""
        return bool(self._held.get(sandbox_id))

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is being destroyed: stop its freeze or reclaim."""
        self._mem_paused.discard(sandbox_id)
        stop = self._stops.get(sandbox_id)
        if stop is not None:
            stop.set()
        self._fz.pop(sandbox_id, None)
