"""The security event log: denials the node observes, coalesced into bounded events.

Sources: refused system calls (seccomp user notifications, :mod:`corral.host.seccomp_notify`),
quota hits the node can read from the kernel (the pids limit's ``pids.events``, the disk
quota), plus the kinds the node records itself elsewhere (``oom``, ``output_limit``,
``file_refused``). Every event is ``Event(sandbox_id, time, kind, detail)`` in the node's
event table.

Bounded: repeats of one (sandbox, kind, key) are counted, not logged one by one. The first
occurrence is written at once; further ones within ``window`` seconds become a single
event with ``count`` (and ``first``/``last`` times) when the window ends. A sandbox has at
most ``max_keys`` distinct keys in memory; the rest are counted under ``key=other``. So a
guest that calls ``bpf()`` in a loop for an hour leaves ~hour/window rows, not millions.

Example::

    log = SecurityLog(store.add_event)
    log.record("sb-1", "seccomp", "bpf", {"syscall": "bpf"})   # any thread
    log.flush()                                                  # the event loop
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from corral.backends.base import Meters
from corral.errors import HostError
from corral.host.fdstore import FdStore, end_stale
from corral.host.seccomp_notify import NotifyListener, SeccompCall
from corral.node.state import StateStore
from corral.policy import seccomp as policy
from corral.spec import EventSummary

__all__ = ["NodeSecurity", "SecurityLog", "SECURITY_KINDS", "describe_call"]

_log = logging.getLogger("corral.security")

SECURITY_KINDS: dict[str, str] = {
    "seccomp": "a refused system call (syscall, arg)",
    "seccomp_unwatched": "refused calls of this sandbox are no longer recorded (agent restart "
    "without the fd holder)",
    "pids_limit": "a fork/clone failed at the sandbox's pids limit",
    "disk_quota": "the writable layer reached its disk quota",
    "oom": "an exec ended because the OOM killer killed it (memory limit)",
    "oom_kill": "the OOM killer killed processes of the sandbox (any, counted)",
    "output_limit": "an exec was stopped because its output reached the cap",
    "output_truncated": "an exec's output was cut at the cap (the command ran on)",
    "file_refused": "the files API refused a path (escape, device, bad name...)",
    "net_denied": "a connection the network policy dropped (corral.node.network)",
    "dns_denied": "a name lookup the network policy refused (corral.node.network)",
}
"""Event kinds that record a denial, with what each means."""

Detail = dict[str, str | int | float | bool | None]

_IOCTL_NAMES = {cmd: name for name, cmd in policy.DENIED_IOCTLS.items()}
_IOCTL_TYPES = {t: name for name, t in policy.DENIED_IOCTL_TYPES.items()}
_FAMILIES = {
    3: "AF_AX25", 4: "AF_IPX", 5: "AF_APPLETALK", 8: "AF_ATMPVC", 9: "AF_X25",
    15: "AF_KEY", 17: "AF_PACKET", 21: "AF_RDS", 24: "AF_PPPOX", 29: "AF_CAN",
    30: "AF_TIPC", 31: "AF_BLUETOOTH", 38: "AF_ALG", 40: "AF_VSOCK", 41: "AF_KCM",
    44: "AF_XDP",
}  # fmt: skip


def describe_call(call: SeccompCall) -> tuple[str, Detail]:
    """(coalescing key, event detail) of a refused call: the syscall and, where it decides
    the refusal, the argument that did (ioctl command, socket family, namespace flags)."""
    name = call.name
    detail: Detail = {"syscall": name, "comm": call.comm or None}
    key = name
    if name == "ioctl":
        cmd = call.args[1] & 0xFFFFFFFF
        what = _IOCTL_NAMES.get(cmd) or _IOCTL_TYPES.get((cmd >> 8) & 0xFF, "")
        detail.update(arg=f"{cmd:#x}", what=what.split(" ")[0] if what else None)
        key = f"ioctl:{cmd:#x}"
    elif name == "socket":
        fam = call.args[0] & 0xFFFFFFFF
        family: str | None = _FAMILIES.get(fam)
        key = f"socket:{fam}"
        if fam in policy.IP_FAMILIES and call.args[1] & policy.SOCK_TYPE_MASK == policy.SOCK_RAW:
            family = policy.IP_FAMILIES[fam] + " SOCK_RAW"
            key += ":raw"
        detail.update(arg=fam, what=family)
    elif name in ("mknod", "mknodat"):
        mode = call.args[policy.MKNOD_MODE_ARG[name]] & policy.S_IFMT
        detail.update(arg=f"{mode:#o}", what="S_IFBLK" if mode == 0o060000 else "S_IFCHR")
        key = f"{name}:{mode:#o}"
    elif name in ("clone", "unshare", "setns"):
        flags = call.args[0] & 0xFFFFFFFF if name != "setns" else call.args[1] & 0xFFFFFFFF
        detail.update(arg=f"{flags:#x}")
        key = f"{name}:{flags:#x}"
    return key, detail


@dataclass
class _Entry:
    detail: Detail
    count: int = 0
    first: float = 0.0
    last: float = 0.0
    written_at: float | None = None


@dataclass
class _Sandbox:
    entries: dict[tuple[str, str], _Entry] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)


class SecurityLog:
    """Coalesces denials per (sandbox, kind, key) and writes them through ``add_event``.

    ``record`` may be called from any thread; ``flush`` only from the thread that owns the
    store (the node's event loop). ``wake`` (optional) is called, from the recording thread,
    when a new key appears, so the owner can flush soon.
    """

    def __init__(
        self,
        add_event: Callable[[str | None, str, Detail], int],
        *,
        window: float = 10.0,
        max_keys: int = 64,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self._add = add_event
        self.window = window
        self.max_keys = max_keys
        self.wake = wake
        self._lock = threading.Lock()
        self._sb: dict[str, _Sandbox] = {}
        # Sandboxes with entries: a flush visits these, not every sandbox seen (each live
        # one has counters), so the reaper's pass does not grow with the live count. A dict
        # as an ordered set: events are written in the order the sandboxes first denied.
        self._noisy: dict[str, None] = {}

    def record(self, sandbox_id: str, kind: str, key: str, detail: Detail, n: int = 1) -> None:
        now = time.time()
        new = False
        with self._lock:
            sb = self._sb.setdefault(sandbox_id, _Sandbox())
            k = (kind, key)
            e = sb.entries.get(k)
            if e is None:
                if len(sb.entries) >= self.max_keys:
                    k = (kind, "other")
                    e = sb.entries.get(k)
                    detail = {"note": "more distinct denials than the node tracks"}
                if e is None:
                    e = sb.entries[k] = _Entry(detail=dict(detail), first=now)
                    self._noisy[sandbox_id] = None
                    new = True
            if e.count == 0:
                e.first = now
            e.count += n
            e.last = now
        if new and self.wake is not None:
            self.wake()

    def record_call(self, sandbox_id: str, call: SeccompCall) -> None:
        """A refused system call (the seccomp listener's callback)."""
        key, detail = describe_call(call)
        self.record(sandbox_id, "seccomp", key, detail)

    def flush(self, sandbox_id: str | None = None, *, final: bool = False) -> int:
        """Write what is due (``final``: everything pending, then forget the sandbox)."""
        now = time.time()
        rows: list[tuple[str, str, Detail]] = []
        with self._lock:
            sids = [sandbox_id] if sandbox_id is not None else list(self._noisy)
            for sid in sids:
                sb = self._sb.get(sid)
                if sb is None:
                    continue
                for k, e in list(sb.entries.items()):
                    due = e.written_at is None or now - e.written_at >= self.window
                    if e.count and (due or final):
                        d: Detail = {**e.detail, "count": e.count}
                        if e.count > 1:
                            d.update(first=round(e.first, 3), last=round(e.last, 3))
                        rows.append((sid, k[0], d))
                        e.count = 0
                        e.written_at = now
                    elif not e.count and due:
                        del sb.entries[k]  # quiet for a window: the next one is news again
                if not sb.entries:
                    self._noisy.pop(sid, None)
                if final:
                    del self._sb[sid]
                    self._noisy.pop(sid, None)
        for sid, kind, d in rows:
            self._add(sid, kind, d)
        return len(rows)

    def pending(self) -> list[tuple[str, str, int]]:
        """(sandbox, kind, occurrences) counted but not written yet (inside a window)."""
        with self._lock:
            return [
                (sid, k[0], e.count)
                for sid, sb in self._sb.items()
                for k, e in sb.entries.items()
                if e.count and e.written_at is not None
            ]

    # -- quota hits the kernel counts -------------------------------------------------

    def check_counter(self, sandbox_id: str, kind: str, value: int | None) -> None:
        """A kernel counter of refusals (``pids.events`` max, OOM kills): its growth since
        the last look is recorded as ``kind`` with that many occurrences."""
        if value is None:
            return
        with self._lock:
            sb = self._sb.setdefault(sandbox_id, _Sandbox())
            before = sb.counters.get(kind)
            sb.counters[kind] = value
        if before is not None and value > before:
            self.record(sandbox_id, kind, "", {"total": value}, value - before)

    def seen(self, sandbox_id: str, counters: dict[str, int | None]) -> None:
        """Start counting from the kernel's current figures (create, adoption)."""
        with self._lock:
            sb = self._sb.setdefault(sandbox_id, _Sandbox())
            sb.counters.update({k: v for k, v in counters.items() if v is not None})


def _close_all(fds_by_sandbox: dict[str, list[int]]) -> None:
    """Close the fds the holder handed back (our copies) and forget them."""
    for fds in fds_by_sandbox.values():
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    fds_by_sandbox.clear()


class NodeSecurity:
    """The node's side of the security event log: the seccomp listener, the coalescing log,
    and the quota checks the node runs at the end of each exec and before a destroy.

    The node calls: :meth:`created`/:meth:`adopted` once per sandbox, :meth:`recovered`
    after the adoptions, :meth:`after_exec`, :meth:`before_destroy`, :meth:`flush` (reaper
    pass, before answering a query), :meth:`gc` and :meth:`close`.

    With ``helper_dir`` (where the node builds its C helpers) every notification fd is also
    kept by the node's fd holder (:mod:`corral.host.fdstore`), so a restarted agent takes
    the fds of the sandboxes it adopts back and goes on recording their refused calls.
    """

    def __init__(
        self,
        add_event: Callable[[str | None, str, Detail], int],
        meters: Callable[[str], Meters],
        *,
        listener_path: Path | None,
        helper_dir: Path | None = None,
    ) -> None:
        self._add = add_event
        self._meters = meters
        """The sandbox's kernel counters (its backend's ``meters``)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        self.log = SecurityLog(add_event, wake=self._wake)
        self.listener: NotifyListener | None = None
        self.fdstore: FdStore | None = None
        self._helper_dir = helper_dir
        self._handed: dict[str, list[int]] = {}  # the holder's fds, until adopted()
        self._known: set[str] = set()  # sandboxes created or adopted, not destroyed
        if listener_path is not None:
            if helper_dir is not None:
                try:
                    self.fdstore, self._handed = FdStore.open(listener_path.parent, helper_dir)
                except (OSError, HostError) as e:
                    _log.warning("no seccomp fd holder (fds will not survive a restart): %s", e)
            self.listener = NotifyListener(listener_path, self.log.record_call, on_fd=self._keep)
            self.listener.start()
        self._disk_full: set[str] = set()
        self._checked: dict[str, float] = {}
        self.check_interval = 1.0

    @property
    def notify_path(self) -> str | None:
        """``listenerPath`` for the seccomp profile (None: no notifications)."""
        return str(self.listener.path) if self.listener is not None else None

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.flush)

    def _counters(self, sandbox_id: str, m: Meters | None = None) -> dict[str, int | None]:
        m = self._meters(sandbox_id) if m is None else m
        return {"pids_limit": m.pids_refused, "oom_kill": m.oom_kills}

    def _keep(self, sandbox_id: str, fd: int) -> None:
        """A new notification fd (listener thread): the holder gets a dup."""
        if self.fdstore is not None:
            self.fdstore.put(sandbox_id, fd)

    def created(self, sandbox_id: str, fresh: bool = True) -> None:
        """A new sandbox (``fresh``): its cgroup was made by this create, so its refusal
        counters start at zero, and anything counted during its start is reported (no
        read of them on the create path). An adopted one starts from the kernel's figures."""
        self._known.add(sandbox_id)
        if fresh:
            self.log.seen(sandbox_id, {"pids_limit": 0, "oom_kill": 0})
        else:
            self.log.seen(sandbox_id, self._counters(sandbox_id))

    def adopted(self, sandbox_id: str) -> None:
        """A sandbox from before an agent restart: its notification fds come back from the
        fd holder; without them (no holder) it is marked ``seccomp_unwatched``."""
        self.created(sandbox_id, fresh=False)
        if self.listener is None:
            return
        fds = self._handed.pop(sandbox_id, [])
        for fd in fds:
            self.listener.watch(sandbox_id, fd)
        if not fds:
            self._add(
                sandbox_id,
                "seccomp_unwatched",
                {"reason": "agent restarted; refused calls now fail with ENOSYS, unrecorded"},
            )

    def recovered(self) -> None:
        """After the adoptions: the holder forgets sandboxes that did not survive."""
        if self.fdstore is not None:
            for sid in self._handed:
                self.fdstore.drop(sid)
        _close_all(self._handed)

    def gc(self, live: set[str]) -> None:
        """The holder keeps only fds of ``live`` sandboxes; one that does not answer (or was
        lost) is ended by its recorded pid and replaced, with every fd the listener serves."""
        if self.listener is None or self._helper_dir is None:
            return
        store = self.fdstore
        if store is not None:
            for sid in store.held() - live:
                store.drop(sid)
            if store.ping():
                return
            store.abandon()
        self.fdstore = None
        run_dir = self.listener.path.parent
        end_stale(run_dir)
        try:
            fresh, handed = FdStore.open(run_dir, self._helper_dir)
        except (OSError, HostError) as e:
            _log.warning("gc: cannot start a seccomp fd holder: %s", e)
            return
        for sid in handed:  # a holder we could reach after all: start clean
            fresh.drop(sid)
        _close_all(handed)
        self.fdstore = fresh  # first: a create meanwhile is kept (at worst twice)
        self.listener.for_each(lambda sid, fd: fresh.put(sid, fd) if sid in live else None)

    def after_exec(self, sandbox_id: str, disk_limit: int, truncated: bool = False) -> None:
        """Quota hits of the exec that just ended (pids limit, OOM kills, disk quota), and
        its output truncation (``truncated``: cut at the cap while the command ran on).

        At most once per ``check_interval`` per sandbox (the reads cost ~0.2 ms, a fast
        exec ~4 ms): the pids and OOM figures are kernel counters, so nothing is lost, only
        reported up to a second later; :meth:`before_destroy` always looks. The disk figure
        is a level, not a counter: a fill freed again before the next look goes unreported.
        So a new sandbox's first exec is looked at, not deferred by an interval: filling the
        disk is often the first thing a guest does (the red-team disk test)."""
        if truncated:
            self.log.record(sandbox_id, "output_truncated", "", {})
        now = time.monotonic()
        if now - self._checked.get(sandbox_id, -1e9) < self.check_interval:
            return
        self._checked[sandbox_id] = now
        self._check(sandbox_id, disk_limit)

    def _check(self, sandbox_id: str, disk_limit: int) -> None:
        m = self._meters(sandbox_id)
        for kind, value in self._counters(sandbox_id, m).items():
            self.log.check_counter(sandbox_id, kind, value)
        used = m.disk_used
        if used is None:
            return
        # Reported once per filling: again only after the guest freed space.
        if used >= disk_limit * 0.95:
            if sandbox_id not in self._disk_full:
                self._disk_full.add(sandbox_id)
                self.log.record(
                    sandbox_id, "disk_quota", "", {"used_bytes": used, "limit_bytes": disk_limit}
                )
        else:
            self._disk_full.discard(sandbox_id)

    def before_destroy(self, sandbox_id: str, disk_limit: int) -> None:
        self._known.discard(sandbox_id)
        if self.fdstore is not None:
            self.fdstore.drop(sandbox_id)
        self._check(sandbox_id, disk_limit)
        self.log.flush(sandbox_id, final=True)
        self._disk_full.discard(sandbox_id)
        self._checked.pop(sandbox_id, None)

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self.log.flush()

    def close(self) -> None:
        """Stop listening. The holder keeps the fds of sandboxes still running (a failed
        create's are dropped) and exits by itself if that is none."""
        self.flush()
        undecided = set(self._handed)  # an open that failed before its adoptions: keep them
        _close_all(self._handed)
        if self.fdstore is not None:
            for sid in self.fdstore.held() - self._known - undecided:
                self.fdstore.drop(sid)
            self.fdstore.close()
        if self.listener is not None:
            self.listener.close()

    def summary(
        self,
        state: StateStore,
        labels: dict[str, str] | None,
        kinds: list[str] | None,
        sandbox_id: str | None = None,
    ) -> EventSummary:
        """Occurrences per sandbox and kind, written or still being counted."""
        self.flush()
        ids = set(state.sandbox_ids_with_labels(labels)) if labels else None
        rows = state.event_counts(sandbox_id, kinds)
        rows += [r for r in self.log.pending() if sandbox_id in (None, r[0])]
        out = EventSummary(labels=dict(labels or {}))
        for sid, kind, n in rows:
            if sid is None or (ids is not None and sid not in ids):
                continue
            if kinds and kind not in kinds:
                continue
            per = out.sandboxes.setdefault(sid, {})
            per[kind] = per.get(kind, 0) + n
            out.totals[kind] = out.totals.get(kind, 0) + n
        return out
