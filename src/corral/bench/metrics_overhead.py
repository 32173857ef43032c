"""``"metrics_overhead"`` of ``corral bench create|exec``: the same work with the node's
metrics on and off, in one run.

Noise on these shared machines is larger than what metrics cost, so the two settings are
interleaved in short blocks (on, off, on, off...) rather than run one after the other:
a load spike then hits both alike. Reported: each setting's figures, the p50 ratio
(on/off) and the p50 difference in milliseconds, and the cost of one
``Observer.record`` measured alone (a floor that noise cannot hide).

It needs the embedded node's ``observer`` (issue 14 wiring); a node without one answers
``{"skipped": "..."}`` instead of figures.

Example:
    >>> figures = await measure(ops, lambda i: sb.exec(["true"]), count=200)   # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from corral.node.metrics import MetricsConfig, NodeMetrics
from corral.node.stats import Observer

__all__ = ["measure", "record_cost"]

_BLOCK = 10


def _figures(samples: list[float]) -> dict[str, Any]:
    s = sorted(samples)
    return {
        "count": len(s),
        "p50_ms": statistics.median(s) * 1000,
        "p99_ms": s[max(0, int(len(s) * 0.99 + 0.5) - 1)] * 1000,
    }


async def measure(ops: Any, op: Callable[[int], Awaitable[object]], count: int) -> dict[str, Any]:
    """Run ``op`` ``count`` times with metrics on and ``count`` times off, interleaved."""
    observer: Observer | None = getattr(ops, "observer", None)
    if observer is None:
        return {"skipped": f"{type(ops).__name__} has no observer (metrics not wired)"}
    metrics = observer.metrics
    was = metrics.enabled
    times: dict[bool, list[float]] = {True: [], False: []}
    i = 0
    try:
        while len(times[False]) < count:
            for setting in (True, False):
                metrics.enabled = setting
                for _ in range(min(_BLOCK, count - len(times[setting]))):
                    t0 = time.perf_counter()
                    await op(i)
                    times[setting].append(time.perf_counter() - t0)
                    i += 1
    finally:
        metrics.enabled = was
    on, off = _figures(times[True]), _figures(times[False])
    return {
        "on": on,
        "off": off,
        "p50_ratio": on["p50_ms"] / off["p50_ms"] if off["p50_ms"] else None,
        "p50_delta_ms": on["p50_ms"] - off["p50_ms"],
        "record_cost_us": record_cost(),
        "interleaved_blocks_of": _BLOCK,
    }


def record_cost(n: int = 5000) -> float:
    """Median microseconds of one ``Observer.record`` of an exec with three phases, on a
    private in-memory state store (what the node pays per operation, SQLite batch included)."""
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from corral.node.state import StateStore

    with TemporaryDirectory(prefix="corral-mcost-") as d:
        store = StateStore(Path(d) / "s.db")
        obs = Observer(store, NodeMetrics(MetricsConfig(job_labels=["job"])))
        phases = {"queue": 1e-5, "agent_round_trip": 1e-3, "process_run": 5e-4}
        labels = {"job": "bench"}
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            obs.record("exec", 0.0015, phases, sandbox_id="sb-bench", labels=labels)
            samples.append(time.perf_counter() - t0)
        obs.flush()
        store.close()
    return statistics.median(samples) * 1e6
