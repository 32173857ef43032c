"""Metrics and stats of a real node, and a real Prometheus scraping them (issue 14).

The node times its own operations (its Observer); the test times the same calls from
outside and checks that the node's figures lie within them.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral.api.observe import metrics_app
from corral.node.metrics import PhaseTimer
from corral.node.stats import Observer
from corral.spec import ExecRequest, SandboxSpec
from tests.observe_fakes import serve, tcp_socket

PROMETHEUS = Path("/usr/bin/prometheus")
RULES = Path(__file__).parents[2] / "docs" / "prometheus" / "corral.rules.yml"


EPS = 1e-6
"""perf_counter's resolution is far below this; the slack covers the float round trip."""


@pytest.fixture
def observer(node) -> Iterator[Observer]:  # type: ignore[no-untyped-def]
    """The node's own observer (job labels are on the allowlist by default)."""
    yield node.observer


async def _timed(obs: Observer, op: str, coro, sandbox_id=None, labels=None):  # type: ignore[no-untyped-def]
    """The call's result and the seconds measured around it (the node records it itself)."""
    t = PhaseTimer()
    result = await coro
    return result, t.total()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_real_node_metrics_and_stats(node, observer: Observer) -> None:  # type: ignore[no-untyped-def]
    # unique per run: the test node's state dir (and its timings) outlives a run
    job = f"obs-real-{uuid.uuid4().hex[:8]}"
    labels = {"job": job}
    spec = SandboxSpec(image="test/busybox", labels=labels)
    creates, execs = [], []
    infos = []
    for _ in range(2):
        info, secs = await _timed(observer, "create", node.sandbox_create(spec), labels=labels)
        infos.append(info)
        creates.append(secs)
    for info in infos:
        _, secs = await _timed(
            observer, "exec", node.exec(info.id, ExecRequest(cmd=["true"])), info.id, labels
        )
        execs.append(secs)
    text = (await asyncio.to_thread(observer.render)).decode()
    s = _samples(text)
    key = ("corral_op_duration_seconds_count", (("backend", "container"), ("label_job", job), ("op", "create"), ("qos", "best_effort")))  # fmt: skip
    assert s[key] == 2
    running = sum(
        v for (n, lb), v in s.items() if n == "corral_sandboxes" and ("state", "running") in lb
    )
    assert running >= 2
    assert s[("corral_node_layer_mounts", ())] >= 1
    assert s[("corral_node_layer_page_cache_bytes", ())] > 0  # the busybox layer was read
    assert s[("corral_node_scratch_total_bytes", ())] > 0
    # the node's own lifecycle events were counted from its state store
    assert s[("corral_events_total", (("kind", "created"),))] >= 2

    observer.flush()
    st = await asyncio.to_thread(observer.stats, labels)
    assert st.sandboxes == 2
    assert st.ops["create"].count == 2 and st.ops["exec"].count == 2
    # the node's own figures lie within what was measured around the calls
    assert 0 < st.ops["create"].max <= max(creates) + EPS
    assert 0 < st.ops["create"].p50 <= min(creates) + EPS
    assert 0 < st.ops["exec"].max <= max(execs) + EPS
    assert st.events.get("created") == 2
    tl = await asyncio.to_thread(observer.timeline, infos[0].id)
    assert [e.name for e in tl if e.kind == "op"] == ["create", "exec"]
    assert any(e.kind == "event" and e.name == "created" for e in tl)
    for info in infos:
        await _timed(observer, "destroy", node.sandbox_destroy(info.id), info.id, labels)
    observer.flush()
    assert (await asyncio.to_thread(observer.stats, labels)).ops["destroy"].count == 2


# ---------------------------------------------------------------- a real Prometheus
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prometheus_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="corral-prom-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def prometheus(prometheus_dir: Path) -> AsyncIterator[tuple[str, Path]]:
    """(base URL, config path): the config is written by the test before the first reload."""
    if not PROMETHEUS.exists():
        pytest.skip("needs Debian's prometheus package (make test installs it)")
    port = _free_port()
    cfg = prometheus_dir / "prometheus.yml"
    cfg.write_text("global: {scrape_interval: 1s}\n")
    shutil.copy(RULES, prometheus_dir / "corral.rules.yml")
    proc = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={cfg}",
            f"--storage.tsdb.path={prometheus_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(prometheus_dir / "log", "wb"),  # noqa: SIM115
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base) as http:
            for _ in range(600):
                try:
                    if (await http.get("/-/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None, (prometheus_dir / "log").read_text()[-2000:]
                await asyncio.sleep(0.05)
        yield base, cfg
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _query(http: httpx.AsyncClient, promql: str) -> list[dict]:  # type: ignore[type-arg]
    r = await http.get("/api/v1/query", params={"query": promql})
    assert r.status_code == 200, r.text
    return r.json()["data"]["result"]  # type: ignore[no-any-return]


async def _until(http: httpx.AsyncClient, promql: str, ok, what: str) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    """Poll Prometheus until ``ok(result)``: a readiness condition, not a timing bound."""
    for _ in range(1200):
        res = await _query(http, promql)
        if ok(res):
            return res
        await asyncio.sleep(0.05)
    raise AssertionError(f"Prometheus never showed {what}: last answer {res}")


async def test_prometheus_scrapes_the_node(node, observer: Observer, prometheus) -> None:  # type: ignore[no-untyped-def]
    base, cfg = prometheus
    sock = tcp_socket()
    port = sock.getsockname()[1]
    async with serve(metrics_app(observer), sock):
        cfg.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "rule_files: [corral.rules.yml]\n"
            "scrape_configs:\n"
            f"  - job_name: corral\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
        )
        async with httpx.AsyncClient(base_url=base) as http:
            assert (await http.post("/-/reload")).status_code == 200
            await _until(http, 'up{job="corral"}', lambda r: r and r[0]["value"][1] == "1", "up")
            # one create, seen by Prometheus, then two more: the series exists before
            # them, so rate() in the recording rule sees an increase
            job = f"obs-prom-{uuid.uuid4().hex[:8]}"
            labels = {"job": job}
            spec = SandboxSpec(image="test/busybox", labels=labels)
            count_q = f'sum(corral_op_duration_seconds_count{{op="create",label_job="{job}"}})'
            made, measured = [], []
            for n in (1, 3):
                while len(made) < n:
                    info, secs = await _timed(
                        observer, "create", node.sandbox_create(spec), labels=labels
                    )
                    made.append(info)
                    measured.append(secs)
                await _until(
                    http, count_q, lambda r, n=n: r and float(r[0]["value"][1]) == n, f"{n} creates"
                )
            p99 = await _query(
                http,
                "histogram_quantile(0.99, sum by (le) "
                f'(corral_op_duration_seconds_bucket{{op="create",label_job="{job}"}}))',
            )
            value = float(p99[0]["value"][1])
            # histogram_quantile interpolates inside the bucket holding the slowest create
            buckets = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
            # measured around the call, so a little above what the node recorded: the
            # slowest create may sit in the bucket below when it is near a boundary
            upper = next(b for b in buckets if b >= max(measured))
            lower = max([b for b in buckets if b < max(measured) - 0.005], default=0.0)
            assert lower <= value <= upper, (value, measured)
            # the documented recording rule answers too
            rule = await _until(
                http,
                'corral:op_duration_seconds:p99_5m{op="create"}',
                lambda r: r and r[0]["value"][1] not in ("NaN",),
                "the recording rule",
            )
            assert 0 < float(rule[0]["value"][1]) <= 60
            r = await http.get("/api/v1/rules")
            names = {g["name"] for g in r.json()["data"]["groups"]}
            assert names == {"corral-recording", "corral-alerts"}
            for info in made:
                await node.sandbox_destroy(info.id)
