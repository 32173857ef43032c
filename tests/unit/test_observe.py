"""Metrics, stats, timelines and the observe routes (issue 14), on an ObservedFakeNode."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import corral
from corral.api.observe import LiveFeed, MetricsServer
from corral.api.ui_proxy import UIProxy
from corral.errors import InvalidRequest
from corral.node.metrics import MetricsConfig, NodeGauges, NodeMetrics, PhaseTimer
from corral.node.state import StateStore
from corral.node.stats import Observer, percentiles
from corral.sdk._http import HTTPOps
from corral.sdk._stats import fetch_stats, fetch_timeline
from corral.spec import ExecRequest, SandboxSpec
from tests.observe_fakes import ObservedFakeNode, observed_app, serve, tcp_socket, uds_socket

TOKEN = "obs-token"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="corral-obs-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def node(short_dir: Path) -> AsyncIterator[ObservedFakeNode]:
    n = ObservedFakeNode(short_dir)
    try:
        yield n
    finally:
        await n.close()


def families(text: str) -> dict[str, list]:  # type: ignore[type-arg]
    """name -> samples, parsed by prometheus_client's own text parser."""
    out: dict[str, list] = {}  # type: ignore[type-arg]
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, []).extend(fam.samples)
    return out


def sample(fams: dict[str, list], name: str, **labels: str) -> float:  # type: ignore[type-arg]
    for fam_samples in fams.values():
        for s in fam_samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


# ---------------------------------------------------------------- NodeMetrics alone
def test_phase_timer_adds_phases() -> None:
    t = PhaseTimer()
    with t.phase("rootfs"):
        pass
    with t.phase("rootfs"):
        pass
    t.add("process_run", 0.25)
    assert set(t.phases) == {"rootfs", "process_run"}
    assert t.phases["process_run"] == 0.25
    assert t.total() >= t.phases["rootfs"]


def test_render_parses_and_counters_move() -> None:
    g = NodeGauges(sandboxes={("running", "container", "latency"): 3}, capacity=10, mem_total=5)
    m = NodeMetrics(MetricsConfig(), gauges=lambda: g, security_kinds={"seccomp"})
    before = families(m.render().decode())
    assert sample(before, "corral_op_duration_seconds_count", op="create") == 0
    m.observe("create", 0.2, {"rootfs": 0.05, "bogus": 1.0}, {"job": "a"}, "container", "latency")
    m.event("seccomp", 3)
    m.event("net_denied")
    m.error("SandboxNotFound")
    m.fncall("python", "AC")
    f = families(m.render().decode())
    assert sample(f, "corral_op_duration_seconds_count", op="create", label_job="a") == 1
    assert sample(f, "corral_op_duration_seconds_sum", op="create") == pytest.approx(0.2)
    assert sample(f, "corral_op_phase_seconds_count", op="create", phase="rootfs") == 1
    # a phase outside the closed set never becomes a label
    assert sample(f, "corral_op_phase_seconds_count", phase="bogus") == 0
    assert sample(f, "corral_security_events_total", kind="seccomp") == 3
    assert sample(f, "corral_network_denials_total", kind="net_denied") == 1
    assert sample(f, "corral_errors_total", kind="SandboxNotFound") == 1
    assert sample(f, "corral_fncall_calls_total", language="python", verdict="AC") == 1
    assert sample(f, "corral_sandboxes", state="running", qos="latency") == 3
    assert sample(f, "corral_node_capacity") == 10
    assert m.op_counts() == {"create": 1}


def test_job_label_values_are_bounded() -> None:
    m = NodeMetrics(MetricsConfig(job_labels=["job"], max_label_values=3))
    for i in range(10):
        m.observe("exec", 0.001, None, {"job": f"j{i}", "sandbox": f"sb-{i}"})
    f = families(m.render().decode())
    jobs = {
        s.labels["label_job"] for s in f["corral_op_duration_seconds"] if s.name.endswith("_count")
    }
    assert jobs == {"j0", "j1", "j2", "other"}
    assert not any("sandbox" in s.labels for s in f["corral_op_duration_seconds"])


def test_disabled_metrics_do_nothing() -> None:
    m = NodeMetrics(MetricsConfig(enabled=False))
    m.observe("create", 1.0)
    m.event("seccomp")
    assert m.op_counts() == {}
    with pytest.raises(ValueError, match="unknown operation"):
        NodeMetrics().observe("teleport", 1.0)


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="job label"):
        MetricsConfig(job_labels=["job-name"])


def test_gauge_failure_does_not_break_a_scrape() -> None:
    def broken() -> NodeGauges:
        raise RuntimeError("boom")

    m = NodeMetrics(gauges=broken)
    assert b"corral_op_duration_seconds" in m.render()


# ---------------------------------------------------------------- stats
def test_percentiles_are_nearest_rank() -> None:
    p = percentiles([float(i) for i in range(1, 101)])
    assert (p.count, p.p50, p.p90, p.p99, p.max, p.mean) == (100, 50, 90, 99, 100, 50.5)
    with pytest.raises(ValueError):
        percentiles([])


async def test_stats_equal_what_was_measured(node: ObservedFakeNode) -> None:
    async with corral.AsyncClient(ops=node) as client:
        a = [
            await client.sandboxes.create(image="demo/python", labels={"job": "a"})
            for _ in range(3)
        ]
        await client.sandboxes.create(image="demo/python", labels={"job": "b"})
        for sb in a:
            await sb.exec(["echo", "x"])
        node.record_event(a[0].id, "seccomp", syscall="bpf")
        s = await fetch_stats(node, {"job": "a"})
    assert s.sandboxes == 3
    assert s.ops["create"].count == 3 and s.ops["exec"].count == 3
    rows = node.store.timings(ops=["create"])
    mine = sorted(r[3] for r in rows if r[5].get("job") == "a")
    assert s.ops["create"].p50 == mine[1] and s.ops["create"].max == mine[2]
    assert set(s.ops["create"].phases) == {"admission", "runtime_start"}
    assert s.events == {"seccomp": 1}
    assert (await fetch_stats(node, {"job": "nobody"})).ops == {}


async def test_timeline_merges_ops_and_events(node: ObservedFakeNode) -> None:
    info = await node.sandbox_create(SandboxSpec(image="demo/python"))
    await node.exec(info.id, ExecRequest(cmd=["true"]))
    node.record_event(info.id, "pids_limit", count=2)
    tl = await fetch_timeline(node, info.id)
    assert [(e.kind, e.name) for e in tl] == [
        ("op", "create"),
        ("op", "exec"),
        ("event", "pids_limit"),
    ]
    assert tl[0].phases and tl[2].detail == {"count": 2}


def test_stats_bad_input(short_dir: Path) -> None:
    obs = Observer(StateStore(short_dir / "s.db"), NodeMetrics(), max_rows=5)
    with pytest.raises(InvalidRequest, match="after until"):
        obs.stats(None, since=10, until=5)
    for _ in range(8):
        obs.record("exec", 0.001, {}, sandbox_id="sb-x")
    s = obs.stats()
    assert s.truncated and s.ops["exec"].count == 5


def test_events_are_counted_at_scrape_time(short_dir: Path) -> None:
    st = StateStore(short_dir / "s.db")
    st.add_event("sb-old", "seccomp", {})  # before the node started counting: not counted
    m = NodeMetrics(security_kinds={"seccomp"})
    obs = Observer(st, m)
    st.add_event("sb-1", "seccomp", {"count": 4})
    st.add_event("sb-1", "created", {})
    f = families(obs.render().decode())
    assert sample(f, "corral_security_events_total", kind="seccomp") == 4
    assert sample(f, "corral_events_total", kind="created") == 1
    f = families(obs.render().decode())  # a second scrape does not count them again
    assert sample(f, "corral_security_events_total", kind="seccomp") == 4


def test_timings_are_trimmed(short_dir: Path) -> None:
    st = StateStore(short_dir / "s.db")
    obs = Observer(st, NodeMetrics(), retention=3)
    for i in range(10):
        obs.record("exec", i / 1000, {}, sandbox_id="sb-1")
    obs.flush(trim=True)
    assert [r[3] for r in st.timings()] == [0.007, 0.008, 0.009]


# ---------------------------------------------------------------- REST
async def test_metrics_on_unix_socket_without_token(
    node: ObservedFakeNode, short_dir: Path
) -> None:
    sock = uds_socket(short_dir / "api.sock")
    async with serve(observed_app(node), sock):
        ops = HTTPOps(f"unix://{short_dir / 'api.sock'}")
        await ops.sandbox_create(SandboxSpec(image="demo/python", labels={"job": "rl"}))
        t = httpx.AsyncHTTPTransport(uds=str(short_dir / "api.sock"))
        async with httpx.AsyncClient(transport=t, base_url="http://x") as http:
            r = await http.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            f = families(r.text)
            assert sample(f, "corral_op_duration_seconds_count", op="create", label_job="rl") == 1
            stats = await fetch_stats(ops, {"job": "rl"})
            assert stats.ops["create"].count == 1
            r = await http.get("/v1/stats", params={"label": "not a label"})
            assert r.status_code == 400 and "key=value" in r.json()["error"]["message"]
            r = await http.get("/v1/stats", params={"since": 0, "until": 1e12})
            assert r.status_code == 400 and "narrow since/until" in r.json()["error"]["message"]
            r = await http.get("/v1/sandboxes/sb-nothere/timeline")
            assert r.status_code == 404
            r = await http.get("/ui")
            assert r.status_code == 200 and "<title>corral node</title>" in r.text
            assert "default-src 'self'" in r.headers["content-security-policy"]
            assert (await http.get("/ui/vendor/uPlot.iife.min.js")).status_code == 200
            assert (await http.get("/ui/../../etc/passwd")).status_code == 404
        await ops.close()


async def test_metrics_on_tcp_need_the_token(node: ObservedFakeNode) -> None:
    sock = tcp_socket()
    port = sock.getsockname()[1]
    async with serve(observed_app(node, token=TOKEN), sock):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for path in ("/metrics", "/v1/stats", "/ui", "/v1/live"):
                r = await http.get(path)
                assert r.status_code == 401, path
            r = await http.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200 and "corral_op_duration_seconds" in r.text


async def test_separate_metrics_listener_serves_only_metrics(node: ObservedFakeNode) -> None:
    with pytest.raises(InvalidRequest, match="host:port"):
        MetricsServer(node.observer, "nowhere")
    async with MetricsServer(node.observer, "127.0.0.1:0") as srv:
        async with httpx.AsyncClient(base_url=f"http://{srv.address}") as http:
            assert (await http.get("/metrics")).status_code == 200
            r = await http.get("/v1/sandboxes")
            assert r.status_code == 404 and "only GET /metrics" in r.json()["error"]["message"]
            assert (await http.post("/metrics")).status_code == 405


# ---------------------------------------------------------------- live feed
async def test_live_feed_drops_a_slow_client(node: ObservedFakeNode) -> None:
    feed = LiveFeed(node, node.observer, interval=3600)
    slow = feed.subscribe()
    fast = feed.subscribe()
    msg = await feed.snapshot()
    assert json.loads(msg[len(b"data: ") :])["states"] == {}
    for _ in range(40):  # more than a queue holds; the fast client drains as it goes
        feed.publish(msg)
        while not fast.queue.empty():
            fast.queue.get_nowait()
    assert slow.dropped and feed.dropped == 1
    assert slow.queue.qsize() == 1 and slow.queue.get_nowait() is None  # memory released
    assert not fast.dropped and feed.clients == 1
    feed.close()
    assert feed.clients == 0


async def test_live_stream_sends_events(node: ObservedFakeNode) -> None:
    info = await node.sandbox_create(SandboxSpec(image="demo/python"))
    node.record_event(info.id, "seccomp", syscall="bpf")
    feed = LiveFeed(node, node.observer, interval=0.05)
    it = feed.stream()
    assert await anext(it) == b"retry: 1000\n\n"
    body = json.loads((await anext(it))[len(b"data: ") :])
    assert any(e["kind"] == "seccomp" for e in body["events"])
    assert "seccomp" in body["security_kinds"] and body["ops"]["create"] == 1
    await it.aclose()  # type: ignore[attr-defined]
    assert feed.clients == 0


# ---------------------------------------------------------------- corral ui proxy
async def test_ui_proxy_one_time_token_and_read_only(
    node: ObservedFakeNode, short_dir: Path
) -> None:
    sock = uds_socket(short_dir / "api.sock")
    async with serve(observed_app(node), sock):
        async with UIProxy(f"unix://{short_dir / 'api.sock'}") as proxy:
            base = f"http://{proxy.address}"
            async with httpx.AsyncClient(base_url=base) as anon:
                r = await anon.get("/ui")
                assert r.status_code == 401 and "one-time token" in r.json()["error"]["message"]
                r = await anon.get("/ui", params={"token": "guess"})
                assert r.status_code == 401
            async with httpx.AsyncClient(base_url=base) as browser:
                r = await browser.get(proxy.login_url)
                assert r.status_code == 303 and "HttpOnly" in r.headers["set-cookie"]
                assert (await browser.get("/ui")).status_code == 200
                assert (await browser.get("/v1/stats")).status_code == 200
                assert (await browser.post("/v1/sandboxes", json={})).status_code == 400
                assert (await browser.get("/v1/images")).status_code == 404
                r = await browser.get("/ui", headers={"host": "evil.test"})
                assert r.status_code == 401
            async with httpx.AsyncClient(base_url=base) as late:
                r = await late.get(proxy.login_url)  # spent
                assert r.status_code == 401
    assert time.time() > 0


def test_lifecycle_is_one_json_line(short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    obs = Observer(StateStore(short_dir / "s.db"), NodeMetrics())
    with caplog.at_level("INFO", logger="corral.lifecycle"):
        obs.record("create", 0.5, {"rootfs": 0.1}, sandbox_id="sb-1", labels={"job": "j"})
        obs.record("exec", 0.001, {}, sandbox_id="sb-1")  # not a lifecycle action
        obs.record("destroy", 0.2, {}, sandbox_id="sb-1", failed=True)
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    assert [(x["op"], x["ok"]) for x in lines] == [("create", True), ("destroy", False)]
    assert lines[0]["phases"] == {"rootfs": 0.1} and lines[0]["labels"] == {"job": "j"}


# ---------------------------------------------------------------- bench
async def test_metrics_overhead_interleaves_on_and_off(node: ObservedFakeNode) -> None:
    from corral.bench.metrics_overhead import measure

    info = await node.sandbox_create(SandboxSpec(image="demo/python"))
    seen: list[bool] = []

    async def op(i: int) -> None:
        seen.append(node.observer.metrics.enabled)
        await node.exec(info.id, ExecRequest(cmd=["true"]))

    out = await measure(node, op, count=25)
    assert out["on"]["count"] == 25 and out["off"]["count"] == 25
    assert seen[:10] == [True] * 10 and seen[10:20] == [False] * 10  # interleaved blocks
    assert node.observer.metrics.enabled  # restored
    assert out["record_cost_us"] > 0
    assert (await measure(object(), op, 1))["skipped"]
