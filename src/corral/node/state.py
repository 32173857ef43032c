"""The node's durable state: SQLite in WAL mode in the state dir.

The node is the source of truth for its sandboxes; this store is how that truth survives
an agent restart. Only the Node object writes here.

Two faults from outside the node are turned into clear refusals instead of silent damage:

- **Another process holds the database** (an ``sqlite3`` shell or a backup in a write
  transaction): a statement waits up to :data:`BUSY_TIMEOUT` seconds, then fails with a
  :class:`~corral.errors.HostError` naming the file and how to find the holder. Nothing
  half-done stays in memory (see ``SandboxTable.add``); once released, it works again.
- **The write-ahead log lost while the node was down** (``state.db-wal`` removed or
  truncated after a crash): commits since the last checkpoint live only in the WAL, and
  SQLite would silently open the older main file, so the node would forget sandboxes
  that are still running. :func:`check_wal` compares the WAL with the frame count the
  crashed agent's shared-memory index (``state.db-shm``) recorded and refuses to open,
  naming both files, until the WAL is restored or the loss is accepted (remove the -shm).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

from corral.errors import HostError
from corral.spec import Event, SandboxInfo, SandboxState

__all__ = ["StateStore", "Timing", "BUSY_TIMEOUT", "CHECKPOINT_INTERVAL", "check_wal"]

_log = logging.getLogger(__name__)

BUSY_TIMEOUT = 5.0
"""Seconds a statement waits for another process's lock on the database before failing."""

CHECKPOINT_INTERVAL = 1.0
"""Seconds between the checkpointer thread's passes (see :class:`StateStore`)."""
_WAL_KEEP = 16 << 20
"""Bytes of write-ahead log kept on disk once it is reset (SQLite's journal_size_limit)."""

Timing = tuple[str | None, str, float, float, dict[str, float], dict[str, str]]
"""One finished operation: (sandbox_id, op, unix time, seconds, phases, labels)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    info TEXT NOT NULL,
    labels TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    idle_timeout REAL,
    last_active_at REAL NOT NULL
);
-- (state, last_active_at): live lookups by state, and retention's oldest destroyed first;
-- it replaces the earlier index on state alone (one index to update per write, not two)
CREATE INDEX IF NOT EXISTS sandboxes_gone ON sandboxes(state, last_active_at);
DROP INDEX IF EXISTS sandboxes_state;
CREATE TABLE IF NOT EXISTS shells (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    cwd TEXT NOT NULL,
    env TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS shells_sandbox ON shells(sandbox_id);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_sandbox ON events(sandbox_id, id);
CREATE TABLE IF NOT EXISTS timings (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT,
    op TEXT NOT NULL,
    time REAL NOT NULL,
    seconds REAL NOT NULL,
    phases TEXT NOT NULL,
    labels TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS timings_sandbox ON timings(sandbox_id, id);
CREATE INDEX IF NOT EXISTS timings_time ON timings(time);
"""

_LIVE = tuple(st for st in get_args(SandboxState) if st != "destroyed")

_WAL_HEADER = 32
_FRAME_HEADER = 24


def check_wal(path: Path) -> None:
    """Refuse (HostError) when ``path``'s WAL is shorter than the last agent committed.

    A clean close checkpoints and removes the WAL; after a crash the -shm file's index
    header (native byte order; ``mxFrame`` at byte 16, the page size at byte 14) still
    says how many frames were valid. A WAL shorter than that lost commits."""
    shm, wal = path.with_name(path.name + "-shm"), path.with_name(path.name + "-wal")
    try:
        head = shm.read_bytes()[:48]
    except FileNotFoundError:
        return
    if len(head) < 48 or head[12] != 1:  # isInit: the index was never built
        return
    page = struct.unpack_from("=H", head, 14)[0]
    page = 65536 if page == 1 else page
    frames = struct.unpack_from("=I", head, 16)[0]
    if frames == 0 or page < 512:
        return
    need = _WAL_HEADER + frames * (page + _FRAME_HEADER)
    have = wal.stat().st_size if wal.exists() else None
    if have is not None and have >= need:
        return
    what = "is missing" if have is None else f"has {have} bytes of the {need} committed"
    raise HostError(
        f"the node's state database {path}: its write-ahead log {wal} {what} ({frames} "
        f"frames recorded in {shm} by the agent that last wrote it): the sandboxes created "
        "or changed since the last checkpoint would be forgotten while still running. "
        f"Restore {wal.name} from where it went and start again; to accept the loss "
        f"instead, remove {shm} (then `corral node gc` removes what the database forgot)"
    )


def _translated(e: sqlite3.OperationalError, path: Path) -> Exception:
    text = str(e)
    if "locked" in text or "busy" in text:
        return HostError(
            f"the node's state database {path} is locked by another process (waited "
            f"{BUSY_TIMEOUT:g} s): an sqlite3 shell or a backup holding a write transaction? "
            f"`fuser {path}` names it; nothing was changed, retry once it lets go"
        )
    return HostError(f"the node's state database {path}: {text}")


class _Connection(sqlite3.Connection):
    """A connection whose lock and I/O errors say which file and what to do."""

    db_path = Path()

    def execute(self, *args: Any) -> sqlite3.Cursor:
        try:
            return super().execute(*args)
        except sqlite3.OperationalError as e:
            raise _translated(e, self.db_path) from e

    def executemany(self, *args: Any) -> sqlite3.Cursor:
        try:
            return super().executemany(*args)
        except sqlite3.OperationalError as e:
            raise _translated(e, self.db_path) from e


class StateStore:
    """The node's database. Its writes run on the node's event loop; on the node's store
    (``checkpoint_interval`` given) the checkpoints that copy the write-ahead log into the
    main file (and fsync both) run in a thread of their own (``corral-state-ckpt``, a
    second connection, every :data:`CHECKPOINT_INTERVAL` seconds), not in whichever commit
    crosses SQLite's 1000-page mark. Measured here (3000 batches of two events, one with
    2.5 KB of detail, the state dir's disk; two runs each): 0.28-0.29 ms per commit on
    average and up to 32-40 ms (a checkpoint's fsyncs) with SQLite's automatic checkpoint,
    0.15-0.16 ms and at most 0.5-0.6 ms with the thread. A passive checkpoint takes no
    writer's lock, so the loop's commits go on while it runs."""

    def __init__(self, path: Path, checkpoint_interval: float | None = None) -> None:
        """``checkpoint_interval``: seconds between the checkpointer thread's passes (the
        node passes :data:`CHECKPOINT_INTERVAL`); None, for short-lived users (tools,
        tests): no thread, SQLite checkpoints in its commits as by default."""
        path.parent.mkdir(parents=True, exist_ok=True)
        check_wal(path)
        self._db = self._connect(path)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a power cut may lose the last commits, never corrupt the file.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._closed = False
        self._batch_lock = threading.RLock()
        self.checkpoints = 0
        """Checkpointer passes so far (tests wait on it: :meth:`wait_checkpoints`)."""
        self._passes = threading.Condition()
        self._stop = threading.Event()
        self._ckpt: threading.Thread | None = None
        if checkpoint_interval is None:
            return
        self._db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread's work
        # A burst's WAL is not left that big on disk once the checkpointer has caught up.
        self._db.execute(f"PRAGMA journal_size_limit={_WAL_KEEP}")
        self._ckpt_db = self._connect(path)
        self._ckpt_lock = threading.Lock()
        self._ckpt = threading.Thread(
            target=self._checkpointer, args=(checkpoint_interval,), name="corral-state-ckpt"
        )
        self._ckpt.daemon = True  # a store nobody closed must not hold the process open
        self._ckpt.start()

    @staticmethod
    def _connect(path: Path) -> _Connection:
        db = sqlite3.connect(
            path,
            isolation_level=None,
            check_same_thread=False,
            timeout=BUSY_TIMEOUT,
            factory=_Connection,
        )
        db.db_path = path
        return db

    def _checkpointer(self, interval: float) -> None:
        failing = False
        while not self._stop.wait(interval):
            try:
                self.checkpoint()
                failing = False
            except (sqlite3.Error, HostError) as e:
                # The next pass tries again (the WAL only grows meanwhile); said once.
                if not failing:
                    _log.warning("state database checkpoint (retried every pass): %s", e)
                failing = True
            with self._passes:
                self.checkpoints += 1
                self._passes.notify_all()

    def checkpoint(self) -> None:
        """Copy the write-ahead log into the main file (passive: what no reader needs),
        on the checkpointer's connection. The thread calls it; not for the event loop."""
        if self._ckpt is None:  # no checkpointer: SQLite's own, or this one by hand
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            return
        with self._ckpt_lock:
            self._ckpt_db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def wait_checkpoints(self, n: int, timeout: float) -> bool:
        """Until the checkpointer has made ``n`` passes in all; False after ``timeout``."""
        with self._passes:
            return self._passes.wait_for(lambda: self.checkpoints >= n, timeout)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The statements run inside commit together: one write-ahead-log append instead
        of one per statement (a create's "running" record and its event, a destroy's
        record and event). Committed also when the body raises: what ran is kept, as it
        was statement by statement. Nested batches join the outer one. The body must not
        await: another batch on the event loop would nest into this one's commit."""
        with self._batch_lock:
            if self._db.in_transaction:
                yield
                return
            self._db.execute("BEGIN")
            try:
                yield
            finally:
                if self._db.in_transaction:
                    self._db.execute("COMMIT")

    def close(self) -> None:
        self._closed = True
        if self._ckpt is not None:
            self._stop.set()
            self._ckpt.join()
            self._ckpt_db.close()
        self._db.close()  # the last connection: checkpoints and removes the WAL

    # sandboxes
    def put_sandbox(self, info: SandboxInfo) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO sandboxes VALUES (?,?,?,?,?,?,?,?)",
            (
                info.id,
                info.state,
                info.model_dump_json(),
                json.dumps(info.spec.labels),
                info.created_at,
                info.expires_at,
                info.spec.idle_timeout,
                info.last_active_at,
            ),
        )

    def get_sandbox(self, sandbox_id: str) -> SandboxInfo | None:
        row = self._db.execute(
            "SELECT info, state FROM sandboxes WHERE id=?", (sandbox_id,)
        ).fetchone()
        if row is None:
            return None
        return _record(row[0], row[1])

    def live_sandboxes(self) -> list[SandboxInfo]:
        q = "SELECT info, state FROM sandboxes WHERE state IN (%s) ORDER BY created_at" % (
            ",".join("?" * len(_LIVE))
        )
        return [_record(raw, state) for raw, state in self._db.execute(q, _LIVE)]

    def set_state(self, sandbox_id: str, state: str) -> None:
        """A state change and nothing else: the state column only, which every read takes
        over the record's JSON (a destroy's "destroying" is then no serialisation of the
        whole record on the event loop)."""
        self._db.execute("UPDATE sandboxes SET state=? WHERE id=?", (state, sandbox_id))

    def mark_destroyed(self, sandbox_id: str) -> None:
        """Keep the row (labels stay queryable for events), drop what only a live one needs.
        Its ``last_active_at`` becomes the destroy time, which :meth:`prune` ages it by."""
        self._db.execute(
            "UPDATE sandboxes SET state='destroyed', last_active_at=? WHERE id=?",
            (time.time(), sandbox_id),
        )
        self._db.execute("DELETE FROM shells WHERE sandbox_id=?", (sandbox_id,))

    def touch_many(self, stamps: dict[str, float]) -> None:
        self._db.executemany(
            "UPDATE sandboxes SET last_active_at=? WHERE id=?",
            [(t, sid) for sid, t in stamps.items()],
        )

    # shells
    def put_shell(self, shell_id: str, sandbox_id: str, cwd: str, env: dict[str, str]) -> float:
        now = time.time()
        self._db.execute(
            "INSERT OR REPLACE INTO shells VALUES (?,?,?,?,?)",
            (shell_id, sandbox_id, cwd, json.dumps(env), now),
        )
        return now

    def get_shell(self, shell_id: str) -> tuple[str, str, dict[str, str], float] | None:
        row = self._db.execute(
            "SELECT sandbox_id, cwd, env, created_at FROM shells WHERE id=?", (shell_id,)
        ).fetchone()
        return (row[0], row[1], json.loads(row[2]), row[3]) if row else None

    def delete_shell(self, shell_id: str) -> None:
        self._db.execute("DELETE FROM shells WHERE id=?", (shell_id,))

    # events
    def add_event(self, sandbox_id: str | None, kind: str, detail: dict) -> int:
        if self._closed:
            # An exec that outlived Node.close() reports its end (timeout, oom...): the
            # caller still gets its result; only the event is not recorded.
            return 0
        cur = self._db.execute(
            "INSERT INTO events (sandbox_id, time, kind, detail) VALUES (?,?,?,?)",
            (sandbox_id, time.time(), kind, json.dumps(detail)),
        )
        return int(cur.lastrowid or 0)

    def trim_events(self, keep: int) -> int:
        """Drop all but the newest ``keep`` events; returns how many were dropped."""
        cur = self._db.execute("DELETE FROM events WHERE id <= ?", (self.last_event_id() - keep,))
        return cur.rowcount

    def events_trimmed_through(self) -> int:
        """Id of the newest event no longer kept (0 if none was trimmed): a cursor before
        it has missed events. Ids only grow (AUTOINCREMENT) and only trimming removes rows,
        so it is the oldest kept id minus one, or the last id given when none is kept."""
        row = self._db.execute("SELECT MIN(id) FROM events").fetchone()
        if row[0] is not None:
            return int(row[0]) - 1
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name='events'").fetchone()
        return int(row[0]) if row else 0

    def prune(
        self,
        now: float,
        *,
        events_max: int,
        events_for: float,
        destroyed_max: int,
        destroyed_for: float,
        batch: int = 500,
    ) -> int:
        """One bounded step of the retention: delete at most ``batch`` events beyond the
        newest ``events_max`` or older than ``events_for`` seconds, and at most ``batch``
        records of sandboxes destroyed over ``destroyed_for`` seconds ago or beyond the
        newest ``destroyed_max`` destroyed ones; returns how many rows went.

        Why bounded: each statement holds the database's write lock, and creates wait on
        it; the caller repeats while a step returns ``batch`` or more, with other work in
        between. Why no VACUUM: the freed pages go on SQLite's freelist and later rows
        reuse them, so the file stops growing once the bounds are reached. Live sandboxes'
        records are never touched; their events and timings are bounded like any other.
        """
        if self._closed:
            return 0
        gone = 0
        # two queries: SQLite answers a lone MIN or MAX from the key, both at once by a scan
        lo = self._db.execute("SELECT MIN(id) FROM events").fetchone()[0]
        hi = self._db.execute("SELECT MAX(id) FROM events").fetchone()[0]
        if lo is not None:
            # ids grow with time: both bounds cut a prefix; look at the oldest batch only
            cur = self._db.execute(
                "DELETE FROM events WHERE id < ? AND (id <= ? OR time < ?)",
                (lo + batch, hi - events_max, now - events_for),
            )
            gone += cur.rowcount
        # both counts from the index sandboxes_gone (state, last_active_at)
        total = self._db.execute(
            "SELECT COUNT(*) FROM sandboxes WHERE state='destroyed'"
        ).fetchone()[0]
        old = self._db.execute(
            "SELECT COUNT(*) FROM sandboxes WHERE state='destroyed' AND last_active_at < ?",
            (now - destroyed_for,),
        ).fetchone()[0]
        doomed = min(batch, max(int(total) - destroyed_max, int(old)))
        if doomed > 0:  # the oldest destroyed first (index sandboxes_gone)
            cur = self._db.execute(
                "DELETE FROM sandboxes WHERE rowid IN (SELECT rowid FROM sandboxes "
                "WHERE state='destroyed' ORDER BY last_active_at LIMIT ?)",
                (doomed,),
            )
            gone += cur.rowcount
        return gone

    def last_event_id(self) -> int:
        """Id of the newest event (0 if none): a mark for "events from now on"."""
        row = self._db.execute("SELECT MAX(id) FROM events").fetchone()
        return int(row[0] or 0)

    def events(
        self,
        sandbox_id: str | None = None,
        since_id: int = 0,
        limit: int = 10000,
        kinds: list[str] | None = None,
    ) -> list[Event]:
        where, args = _event_filter(sandbox_id, kinds)
        rows = self._db.execute(
            "SELECT id, sandbox_id, time, kind, detail FROM events "
            f"WHERE id>? {where} ORDER BY id LIMIT ?",
            (since_id, *args, limit),
        )
        return [
            Event(id=r[0], sandbox_id=r[1], time=r[2], kind=r[3], detail=json.loads(r[4]))
            for r in rows
        ]

    def event_counts(
        self, sandbox_id: str | None = None, kinds: list[str] | None = None, since_id: int = 0
    ) -> list[tuple[str | None, str, int]]:
        """(sandbox_id, kind, occurrences) over the kept events; a coalesced event (see
        corral.node.security) counts ``detail.count`` times."""
        where, args = _event_filter(sandbox_id, kinds)
        rows = self._db.execute(
            "SELECT sandbox_id, kind, SUM(COALESCE(json_extract(detail, '$.count'), 1)) "
            f"FROM events WHERE id>? {where} GROUP BY sandbox_id, kind",
            (since_id, *args),
        )
        return [(r[0], r[1], int(r[2])) for r in rows]

    def sandbox_ids_with_labels(self, labels: dict[str, str]) -> list[str]:
        """Every sandbox, live or destroyed, whose labels include all of ``labels``."""
        out = []
        for sid, raw in self._db.execute("SELECT id, labels FROM sandboxes"):
            have = json.loads(raw)
            if all(have.get(k) == v for k, v in labels.items()):
                out.append(sid)
        return out

    # timings (phase timings per operation, for stats and the timeline)
    def add_timings(self, rows: list[Timing]) -> None:
        """Write a batch of finished operations (the node buffers them: one transaction
        per batch keeps SQLite off the exec path)."""
        if self._closed or not rows:
            return
        values = [(s, op, t, sec, json.dumps(ph), json.dumps(lb)) for s, op, t, sec, ph, lb in rows]
        # One transaction: outside one, executemany commits each row on its own (a WAL
        # append and the write lock per row: ~1.3 ms of the event loop a second for a
        # node doing 100 operations a second, 7 ms at worst; bench neighbours' API probe)
        with self.batch():
            self._db.executemany(
                "INSERT INTO timings (sandbox_id, op, time, seconds, phases, labels) "
                "VALUES (?,?,?,?,?,?)",
                values,
            )

    def timings(
        self,
        sandbox_id: str | None = None,
        ops: list[str] | None = None,
        since: float = 0.0,
        until: float | None = None,
        limit: int = 100_000,
    ) -> list[Timing]:
        """Kept timings, oldest first, at most ``limit`` (the newest of them)."""
        where, args = "time>=?", [since]  # type: tuple[str, list[object]]
        if until is not None:
            where += " AND time<=?"
            args.append(until)
        if sandbox_id is not None:
            where += " AND sandbox_id=?"
            args.append(sandbox_id)
        if ops:
            where += f" AND op IN ({','.join('?' * len(ops))})"
            args.extend(ops)
        rows = self._db.execute(
            "SELECT sandbox_id, op, time, seconds, phases, labels FROM timings "
            f"WHERE {where} ORDER BY id DESC LIMIT ?",
            (*args, limit),
        ).fetchall()
        return [(r[0], r[1], r[2], r[3], json.loads(r[4]), json.loads(r[5])) for r in rows[::-1]]

    def trim_timings(self, keep: int) -> int:
        """Drop all but the newest ``keep`` timings; returns how many were dropped."""
        row = self._db.execute("SELECT MAX(id) FROM timings").fetchone()
        cur = self._db.execute("DELETE FROM timings WHERE id <= ?", (int(row[0] or 0) - keep,))
        return cur.rowcount

    def event_counts_between(
        self, since: float, until: float, sandbox_id: str | None = None
    ) -> list[tuple[str | None, str, int]]:
        """(sandbox_id, kind, occurrences) of the kept events recorded in [since, until]."""
        where, args = "", []  # type: tuple[str, list[object]]
        if sandbox_id is not None:
            where, args = " AND sandbox_id=?", [sandbox_id]
        rows = self._db.execute(
            "SELECT sandbox_id, kind, SUM(COALESCE(json_extract(detail, '$.count'), 1)) "
            f"FROM events WHERE time>=? AND time<=? {where} GROUP BY sandbox_id, kind",
            (since, until, *args),
        )
        return [(r[0], r[1], int(r[2])) for r in rows]

    def event_kinds_since(self, since_id: int) -> tuple[int, dict[str, int]]:
        """(newest event id, kind -> occurrences) of the events after ``since_id``: lets
        metrics count events at scrape time without a hook on every writer."""
        rows = self._db.execute(
            "SELECT MAX(id), kind, SUM(COALESCE(json_extract(detail, '$.count'), 1)) "
            "FROM events WHERE id>? GROUP BY kind",
            (since_id,),
        ).fetchall()
        top = max((int(r[0]) for r in rows), default=since_id)
        return top, {r[1]: int(r[2]) for r in rows}


def _record(raw: str, state: str) -> SandboxInfo:
    """A sandbox row's record. The state column is the truth: set_state and mark_destroyed
    update only it, not the JSON."""
    info = SandboxInfo.model_validate_json(raw)
    return info if info.state == state else info.model_copy(update={"state": state})


def _event_filter(sandbox_id: str | None, kinds: list[str] | None) -> tuple[str, list[object]]:
    """SQL conditions (after ``id>?``) for one sandbox and/or some kinds."""
    where, args = "", []  # type: tuple[str, list[object]]
    if sandbox_id is not None:
        where += " AND sandbox_id=?"
        args.append(sandbox_id)
    if kinds:
        where += f" AND kind IN ({','.join('?' * len(kinds))})"
        args.extend(kinds)
    return where, args
