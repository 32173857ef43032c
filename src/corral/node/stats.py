"""Phase timings kept per sandbox, and the figures computed from them.

The node hands every finished operation to one :class:`Observer`: the operation's total
and phase durations (timed at the source by a :class:`~corral.node.metrics.PhaseTimer`)
go to the Prometheus histograms at once and, buffered, to the ``timings`` table of the
state store, where ``stats`` (percentiles for a label filter) and a sandbox's timeline
read them.

Trade-offs:

- **Buffered writes.** A row per exec written at once would put an SQLite transaction
  on the exec path; rows wait in memory (at most ``_FLUSH_AT``) and go in one
  ``executemany`` when the buffer fills, when the reaper calls :meth:`Observer.flush`, or
  before any read. A crash loses at most the buffer: figures, not state.
- **Bounded reads.** ``stats`` reads at most ``max_rows`` timings (the newest in the
  range; ``Stats.truncated`` says so), whatever range was asked: a huge range costs the
  same as a large one.
- **Structured logs.** Every lifecycle operation (not exec: too many, and its figures
  are in the histograms) is also one JSON line on the ``corral.lifecycle`` logger:
  sandbox id, op, seconds, phases, the sandbox's labels; never guest output. Nothing
  is formatted unless a handler wants INFO.
- **Events counted at scrape time.** Metrics count events from the state store's events
  table (new rows since the last scrape), so no event writer needs a metrics hook.

Example:
    >>> obs = Observer(StateStore(tmp / "state.db"), NodeMetrics())        # doctest: +SKIP
    >>> t = PhaseTimer()
    >>> with t.phase("rootfs"): ...                                         # doctest: +SKIP
    >>> obs.record("create", t.total(), t.phases, sandbox_id=sid, labels={"job": "a"})
    >>> obs.stats({"job": "a"}).ops["create"].p50                           # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from corral.errors import InvalidRequest
from corral.node.gauges import HostSampler
from corral.node.metrics import MetricsConfig, NodeGauges, NodeMetrics
from corral.node.security import SECURITY_KINDS
from corral.node.state import StateStore, Timing
from corral.spec import OpStats, Percentiles, SandboxInfo, Stats, TimelineEntry

__all__ = ["Observer", "percentiles", "parse_label_filter"]

_FLUSH_AT = 512
_LIFECYCLE = frozenset({"create", "destroy", "pause", "resume", "fork", "snapshot"})
lifecycle_log = logging.getLogger("corral.lifecycle")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9_.\-/]{1,63}$")


def percentiles(values: Sequence[float]) -> Percentiles:
    """Nearest-rank p50/p90/p99 (the value at rank ceil(p*n)), mean and max."""
    if not values:
        raise ValueError("percentiles of no values")
    s = sorted(values)
    n = len(s)

    def rank(p: float) -> float:
        return s[max(0, math.ceil(p * n) - 1)]

    return Percentiles(
        count=n, p50=rank(0.50), p90=rank(0.90), p99=rank(0.99), mean=sum(s) / n, max=s[-1]
    )


def parse_label_filter(items: Sequence[str]) -> dict[str, str]:
    """``["job=rl-42", ...]`` -> ``{"job": "rl-42"}``; a malformed item is an error."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _LABEL_KEY.match(key) or len(value) > 256:
            raise InvalidRequest(
                f"label filter {item!r} must be key=value with a key of 1-63 of "
                "[A-Za-z0-9_.-/] and a value of at most 256 characters"
            )
        out[key] = value
    return out


class Observer:
    """The node's single object for metrics and phase timings.

    The node calls :meth:`record` after each operation (failed ones with
    ``failed=True``), :meth:`flush` from its reaper (which also trims), and answers
    ``stats``/timeline/``/metrics`` through :meth:`stats`, :meth:`timeline`,
    :meth:`render`.
    """

    def __init__(
        self,
        state: StateStore,
        metrics: NodeMetrics,
        *,
        retention: int | None = None,
        max_rows: int = 200_000,
    ) -> None:
        self.state = state
        self.metrics = metrics
        self._retention = retention or metrics.config.timing_retention
        self._max_rows = max_rows
        self._buffer: list[Timing] = []
        self._lock = threading.Lock()
        # count only events recorded from now on: counters restart with the process,
        # which Prometheus' rate() understands as a reset
        self._events_seen = state.last_event_id()
        self._events_lock = threading.Lock()

    @classmethod
    def for_node(
        cls,
        state: StateStore,
        config: MetricsConfig,
        *,
        live: Callable[[], Iterable[SandboxInfo]],
        capacity: int,
        scratch_dir: Path | None,
        layer_files: Callable[[], Iterable[Path]],
    ) -> Observer:
        """The node's observer: metrics with the host gauges and the security kinds.

        ``live`` and ``layer_files`` are called at scrape time, in a worker thread: give
        snapshots (``lambda: list(node._live.values())``), not live iterators.
        """
        sampler = HostSampler()

        def gauges() -> NodeGauges:
            return sampler.sample(
                live(), capacity=capacity, scratch_dir=scratch_dir, layer_files=layer_files()
            )

        return cls(state, NodeMetrics(config, gauges, SECURITY_KINDS))

    # ------------------------------------------------------------- the node's side
    def record(
        self,
        op: str,
        seconds: float,
        phases: Mapping[str, float] | None = None,
        *,
        sandbox_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        backend: str = "container",
        qos: str = "best_effort",
        failed: bool = False,
    ) -> None:
        """One finished operation. Cheap: a histogram update and an append."""
        if not self.metrics.enabled:
            return
        self.metrics.observe(op, seconds, phases, labels, backend, qos, failed=failed)
        if op in _LIFECYCLE and lifecycle_log.isEnabledFor(logging.INFO):
            lifecycle_log.info(
                json.dumps(
                    {
                        "time": round(time.time(), 6),
                        "op": op,
                        "sandbox_id": sandbox_id,
                        "ok": not failed,
                        "seconds": round(seconds, 6),
                        "phases": {k: round(v, 6) for k, v in (phases or {}).items()},
                        "labels": dict(labels or {}),
                        "backend": backend,
                        "qos": qos,
                    },
                    separators=(",", ":"),
                )
            )
        if failed:
            return
        row: Timing = (sandbox_id, op, time.time(), seconds, dict(phases or {}), dict(labels or {}))
        with self._lock:
            self._buffer.append(row)
            full = len(self._buffer) >= _FLUSH_AT
        if full:
            self.flush()

    def flush(self, trim: bool = False) -> None:
        """Write buffered timings; ``trim``: also drop all but the newest ``retention``."""
        with self._lock:
            rows, self._buffer = self._buffer, []
        with self.state.batch():  # one commit for both
            self.state.add_timings(rows)
            if trim:
                self.state.trim_timings(self._retention)

    def sync_events(self) -> None:
        """Count the events recorded since the last call into the metrics."""
        with self._events_lock:  # two scrapes at once must not count a row twice
            top, counts = self.state.event_kinds_since(self._events_seen)
            self._events_seen = top
            for kind, n in counts.items():
                self.metrics.event(kind, n)

    # ---------------------------------------------------------------- the API's side
    def render(self) -> bytes:
        """``GET /metrics``: the Prometheus text, events counted up to now."""
        if self.metrics.enabled:
            self.sync_events()
        return self.metrics.render()

    def stats(
        self,
        labels: Mapping[str, str] | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> Stats:
        """Percentiles per operation and phase, and event counts, for the sandboxes whose
        labels include all of ``labels`` (none: every operation on the node)."""
        now = time.time()
        since = 0.0 if since is None else since
        until = now if until is None else until
        if since > until:
            raise InvalidRequest(f"stats: since ({since}) is after until ({until})")
        self.flush()
        want = dict(labels or {})
        rows = self.state.timings(since=since, until=until, limit=self._max_rows + 1)
        truncated = len(rows) > self._max_rows
        rows = rows[-self._max_rows :]
        ids: set[str] | None = None
        if want:
            ids = set(self.state.sandbox_ids_with_labels(want))
            rows = [r for r in rows if _matches(r, want, ids)]
        totals: dict[str, list[float]] = {}
        phases: dict[str, dict[str, list[float]]] = {}
        for _sid, op, _t, seconds, ph, _lb in rows:
            totals.setdefault(op, []).append(seconds)
            for name, secs in ph.items():
                phases.setdefault(op, {}).setdefault(name, []).append(secs)
        ops = {
            op: OpStats(
                **percentiles(vals).model_dump(),
                phases={p: percentiles(v) for p, v in sorted(phases.get(op, {}).items())},
            )
            for op, vals in sorted(totals.items())
        }
        events: dict[str, int] = {}
        for sid, kind, n in self.state.event_counts_between(since, until):
            if ids is None or sid in ids:
                events[kind] = events.get(kind, 0) + n
        count = len(ids) if ids is not None else len(self.state.sandbox_ids_with_labels({}))
        return Stats(
            labels=want,
            since=since,
            until=until,
            sandboxes=count,
            ops=ops,
            events=dict(sorted(events.items())),
            truncated=truncated,
        )

    def timeline(self, sandbox_id: str, limit: int = 2000) -> list[TimelineEntry]:
        """The sandbox's operations and events, oldest first (at most ``limit``, the newest)."""
        self.flush()
        out = [
            TimelineEntry(time=t, kind="op", name=op, seconds=sec, phases=ph)
            for _s, op, t, sec, ph, _l in self.state.timings(sandbox_id=sandbox_id, limit=limit)
        ]
        out += [
            TimelineEntry(time=e.time, kind="event", name=e.kind, detail=e.detail)
            for e in self.state.events(sandbox_id, limit=100_000)[-limit:]
        ]
        out.sort(key=lambda e: e.time)
        return out[-limit:]


def _matches(row: Timing, want: dict[str, str], ids: set[str]) -> bool:
    sid, labels = row[0], row[5]
    if sid is not None:
        return sid in ids
    return all(labels.get(k) == v for k, v in want.items())
