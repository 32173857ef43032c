"""Prometheus metrics of one node, with bounded label cardinality.

Invariants:

- **One registry per node, no module globals.** ``NodeMetrics`` owns its own
  ``CollectorRegistry``: two nodes in one process (tests, benches) never mix figures, and
  nothing registers on import.
- **Bounded cardinality.** Labels are the operation, its phase (a closed set per op), the
  backend, the QoS class, and the values of *allowlisted* sandbox label keys
  (``MetricsConfig.job_labels``, e.g. ``job``) as ``label_<key>``. Each allowlisted key
  keeps at most ``max_label_values`` distinct values; later ones are counted as
  ``other``. Sandbox ids are never labels (``stats`` and the timeline keep per-sandbox
  figures in the state store instead).
- **Cheap on the hot path.** ``observe`` is a few dict look-ups and one histogram
  ``observe`` per phase (~µs); everything that needs the host (memory, scratch, page
  cache of layers, sandboxes by state) is computed only when scraped, through the
  ``gauges`` callback the node hands over. ``enabled=False`` turns every call into a
  no-op, so a bench can measure what metrics cost.

Example:
    >>> m = NodeMetrics(MetricsConfig(job_labels=["job"]))
    >>> t = PhaseTimer()
    >>> with t.phase("admission"):
    ...     pass
    >>> m.observe("create", t.total(), t.phases, {"job": "rl-42"}, "container", "latency")
    >>> b"corral_op_duration_seconds_count" in m.render()
    True
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "CONTENT_TYPE",
    "MetricsConfig",
    "NodeGauges",
    "NodeMetrics",
    "OPS",
    "PHASES",
    "PhaseTimer",
]

log = logging.getLogger("corral.metrics")

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""Content type of :meth:`NodeMetrics.render` (Prometheus text format 0.0.4)."""

OPS = ("create", "exec", "destroy", "pause", "resume", "fork", "snapshot")
"""Operations with a duration histogram."""

PHASES: dict[str, tuple[str, ...]] = {
    "create": (
        "admission",
        "layer_mounts",
        "rootfs",
        "runtime_start",
        "network_attach",
        "init_ready",
    ),
    "exec": ("queue", "agent_round_trip", "process_run"),
}
"""The phases of an operation that become histogram labels (a closed set: a phase not
listed is kept in the state store's timings, never as a label)."""

# From a fast exec (~1 ms) to a slow create or snapshot (tens of seconds).
_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_OTHER = "other"
_LABEL_KEY_RE = r"^[a-zA-Z_][a-zA-Z0-9_]{0,40}$"


class MetricsConfig(BaseModel):
    """``[node.metrics]``: what the node measures and where Prometheus scrapes it."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    """False: no histograms or counters are updated (``/metrics`` still answers, with the
    scrape-time gauges only)."""
    job_labels: list[str] = Field(default_factory=lambda: ["job"])
    """Sandbox label keys whose values become metric labels (``label_<key>``). Keep this
    to keys with few values: every value multiplies the series."""
    max_label_values: int = Field(64, ge=1, le=10000)
    """Distinct values kept per allowlisted key; later values are counted as ``other``."""
    listen: str | None = Field(None, pattern=r"^(\[[0-9a-fA-F:]+\]|[0-9A-Za-z.-]+):[0-9]{1,5}$")
    """``host:port`` of a separate, token-free listener serving only ``GET /metrics``
    (None: metrics only on the API's own listeners)."""
    timing_retention: int = Field(200_000, ge=100)
    """How many of the newest per-sandbox timing rows the state store keeps (for
    ``stats`` and the timeline)."""

    @field_validator("job_labels")
    @classmethod
    def _job_labels(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if not re.match(_LABEL_KEY_RE, key):
                raise ValueError(
                    f"metrics job label {key!r} must be 1-41 of [a-zA-Z0-9_] starting with a "
                    "letter or _ (it becomes the Prometheus label label_<key>)"
                )
        if len(set(keys)) != len(keys):
            raise ValueError(f"metrics job labels {keys} name a key twice")
        return keys


class PhaseTimer:
    """Times the phases of one operation at the source.

    Example:
        >>> t = PhaseTimer()
        >>> with t.phase("layer_mounts"):
        ...     pass
        >>> sorted(t.phases)
        ['layer_mounts']

    A phase entered twice adds up; ``total()`` is the wall time since the timer was made
    (so time between phases counts too).
    """

    __slots__ = ("phases", "_start")

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """A phase measured elsewhere (e.g. the process run time the init reported)."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def total(self) -> float:
        return time.perf_counter() - self._start


@dataclass
class NodeGauges:
    """Figures computed when scraped (the node's callback fills what it knows)."""

    sandboxes: dict[tuple[str, str, str], int] = field(default_factory=dict)
    """(state, backend, qos class) -> how many."""
    capacity: int | None = None
    """Most sandboxes the node admits."""
    mem_total: int | None = None
    mem_available: int | None = None
    swap_total: int | None = None
    swap_used: int | None = None
    scratch_total: int | None = None
    scratch_used: int | None = None
    cpu_count: int | None = None
    load1: float | None = None
    cpu_busy: float | None = None
    """Fraction of all CPUs busy since the previous scrape (0..1)."""
    layer_mounts: int | None = None
    layer_page_cache: int | None = None
    """Bytes of the mounted layer files in the page cache (shared by every sandbox)."""


class _LabelValues:
    """Bounded map of allowlisted sandbox label values to metric label values."""

    def __init__(self, keys: Iterable[str], limit: int) -> None:
        self.keys = tuple(keys)
        self._limit = limit
        self._seen: dict[str, set[str]] = {k: set() for k in self.keys}
        self._lock = threading.Lock()

    def values(self, labels: Mapping[str, str] | None) -> tuple[str, ...]:
        if not self.keys:
            return ()
        out = []
        for key in self.keys:
            value = (labels or {}).get(key, "")
            seen = self._seen[key]
            if value not in seen:
                with self._lock:
                    if len(seen) >= self._limit:
                        value = _OTHER
                    else:
                        seen.add(value)
            out.append(value)
        return tuple(out)


class NodeMetrics:
    """The node's metrics. The node calls :meth:`observe`, :meth:`event`, :meth:`error`,
    :meth:`fncall`; the API calls :meth:`render`."""

    def __init__(
        self,
        config: MetricsConfig | None = None,
        gauges: Callable[[], NodeGauges] | None = None,
        security_kinds: Iterable[str] = (),
    ) -> None:
        self.config = config or MetricsConfig()
        self.enabled = self.config.enabled
        """Switch at run time (a bench compares on and off in one run)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = _LabelValues(self.config.job_labels, self.config.max_label_values)
        extra = [f"label_{k}" for k in self._labels.keys]
        common = ["backend", "qos", *extra]
        r = self.registry
        self._op = Histogram(
            "corral_op_duration_seconds",
            "Duration of node operations (create, exec, destroy, pause, resume, fork, "
            "snapshot), end to end inside the node.",
            ["op", *common],
            buckets=_BUCKETS,
            registry=r,
        )
        self._phase = Histogram(
            "corral_op_phase_seconds",
            "Duration of one phase of an operation (create: admission, layer_mounts, "
            "rootfs, runtime_start, network_attach, init_ready; exec: queue, "
            "agent_round_trip, process_run).",
            ["op", "phase", *common],
            buckets=_BUCKETS,
            registry=r,
        )
        self._ops_failed = Counter(
            "corral_op_failures",
            "Operations that failed, by operation.",
            ["op", *common],
            registry=r,
        )
        self._fncall = Counter(
            "corral_fncall_calls",
            "Function calls by language and verdict (status for plain runs).",
            ["language", "verdict"],
            registry=r,
        )
        self._events = Counter(
            "corral_events",
            "Lifecycle and security events by kind (a coalesced event counts its count).",
            ["kind"],
            registry=r,
        )
        self._security = Counter(
            "corral_security_events",
            "Security events (seccomp refusals, quota hits, file refusals...) by kind.",
            ["kind"],
            registry=r,
        )
        self._net_denied = Counter(
            "corral_network_denials",
            "Denied DNS lookups and connections of sandboxes.",
            ["kind"],
            registry=r,
        )
        self._errors = Counter(
            "corral_errors",
            "Errors the node answered, by error kind (corral.errors wire kinds).",
            ["kind"],
            registry=r,
        )
        self._kinds = _Bounded(256)
        self._children: dict[tuple[int, tuple[str, ...]], Histogram] = {}
        self._gauges = _GaugeCollector(gauges)
        r.register(self._gauges)
        self.security_kinds = frozenset(security_kinds)
        """Event kinds that also count as security events (the node passes
        ``corral.node.security.SECURITY_KINDS``)."""

    # ------------------------------------------------------------- the node's side
    def observe(
        self,
        op: str,
        seconds: float,
        phases: Mapping[str, float] | None = None,
        labels: Mapping[str, str] | None = None,
        backend: str = "container",
        qos: str = "best_effort",
        *,
        failed: bool = False,
    ) -> None:
        """One finished operation: its total and its phases (seconds)."""
        if not self.enabled:
            return
        if op not in OPS:
            raise ValueError(f"unknown operation {op!r}; metrics know {', '.join(OPS)}")
        common = (backend, qos, *self._labels.values(labels))
        if failed:
            self._ops_failed.labels(op, *common).inc()
            return
        self._child(self._op, (op, *common)).observe(seconds)
        known = PHASES.get(op, ())
        for name, secs in (phases or {}).items():
            if name in known:
                self._child(self._phase, (op, name, *common)).observe(secs)

    def _child(self, hist: Histogram, key: tuple[str, ...]) -> Histogram:
        """``hist.labels(*key)``, cached: ``labels()`` takes a lock and builds a tuple
        each call, a third of what an exec's metrics cost."""
        child = self._children.get((id(hist), key))
        if child is None:
            child = self._children[(id(hist), key)] = hist.labels(*key)
        return child

    def event(self, kind: str, n: int = 1) -> None:
        """An event was recorded (the state store's events feed this at scrape time)."""
        if not self.enabled:
            return
        kind = self._kinds.get(kind)
        self._events.labels(kind).inc(n)
        if kind in self.security_kinds:
            self._security.labels(kind).inc(n)
        if kind in ("net_denied", "dns_denied"):
            self._net_denied.labels(kind).inc(n)

    def error(self, kind: str) -> None:
        """The node answered an error of this wire kind (``corral.errors``)."""
        if self.enabled:
            self._errors.labels(self._kinds.get(kind)).inc()

    def fncall(self, language: str, verdict: str) -> None:
        if self.enabled:
            self._fncall.labels(self._kinds.get(language), self._kinds.get(verdict)).inc()

    # ---------------------------------------------------------------- the API's side
    def op_counts(self) -> dict[str, int]:
        """Operations finished so far, by operation (all labels summed): the live feed
        turns two of these into rates."""
        out: dict[str, int] = {}
        for fam in self._op.collect():
            for s in fam.samples:
                if s.name.endswith("_count"):
                    op = s.labels["op"]
                    out[op] = out.get(op, 0) + int(s.value)
        return out

    def render(self) -> bytes:
        """Everything in the Prometheus text format (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _Bounded:
    """At most ``limit`` distinct free-form label values; the rest are ``other``."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def get(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) >= self._limit:
            return _OTHER
        self._seen.add(value)
        return value


_GAUGES: tuple[tuple[str, str], ...] = (
    ("capacity", "Most sandboxes this node admits."),
    ("mem_total", "Host memory in bytes."),
    ("mem_available", "Host memory available in bytes (MemAvailable)."),
    ("swap_total", "Swap the host has, in bytes."),
    ("swap_used", "Swap in use, in bytes."),
    ("scratch_total", "Size of the scratch filesystem holding writable layers, in bytes."),
    ("scratch_used", "Bytes used on the scratch filesystem."),
    ("cpu_count", "CPUs of the host."),
    ("load1", "One-minute load average."),
    ("cpu_busy", "Fraction of all CPUs busy since the previous scrape."),
    ("layer_mounts", "EROFS layers mounted (each shared by every sandbox using it)."),
    ("layer_page_cache", "Bytes of mounted layer files in the page cache."),
)


class _GaugeCollector(Collector):
    """Asks the node for its figures at scrape time (nothing is kept between scrapes)."""

    def __init__(self, source: Callable[[], NodeGauges] | None) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []  # computed at scrape time; registering must not call the node

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        try:
            g = self.source()
        except Exception:
            # a scrape must never break the node, nor the scrape itself
            log.exception("node gauges failed; this scrape has none")
            return
        fam = GaugeMetricFamily(
            "corral_sandboxes",
            "Sandboxes on this node by state, backend and QoS class.",
            labels=["state", "backend", "qos"],
        )
        for (state, backend, qos), n in sorted(g.sandboxes.items()):
            fam.add_metric([state, backend, qos], n)
        yield fam
        for name, doc in _GAUGES:
            value = getattr(g, name)
            if value is not None:
                unit = "_bytes" if name.startswith(("mem_", "swap_", "scratch_", "layer_p")) else ""
                yield GaugeMetricFamily(f"corral_node_{name}{unit}", doc, value=float(value))
