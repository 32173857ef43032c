"""``corral bench create`` and ``exec`` end to end at tiny counts (no Docker): the last
stdout line is one JSON object of the documented shape."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import run_bench

STATE = Path(f"/var/lib/corral-test{TAG}-bench")
RUN = Path(f"/run/corral-test{TAG}-bench")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(images_ready):  # type: ignore[no-untyped-def]
    def run(*args: str) -> dict:  # type: ignore[type-arg]
        return run_bench(
            *args,
            state=STATE,
            run=RUN,
            subtree=f"corral-test{TAG}-bench",
            store=TEST_STORE,
            image="test/busybox",
            timeout=120,
        )

    try:
        yield run
    finally:
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)


def _figures(d: dict, keys: tuple[str, ...]) -> None:  # type: ignore[type-arg]
    for k in keys:
        assert isinstance(d[k], int | float) and d[k] > 0, (k, d)


def test_create_json_shape(bench) -> None:  # type: ignore[no-untyped-def]
    out = bench("create", "--count", "3", "--concurrency", "2")
    assert out["scenario"] == "create"
    assert out["count"] == 3 and out["concurrency"] == 2
    assert out["image"] == "test/busybox"
    _figures(out["corral"], ("p50_ms", "p99_ms", "per_s"))
    assert out["corral"]["n"] == 3 and out["corral"]["errors"] == 0
    assert out["corral"]["p50_ms"] <= out["corral"]["p99_ms"]
    assert out["docker"] is None
    # The CPU's speed before (the header's) and after the timed creates.
    assert out["machine"]["cpu_loop_ms"] > 0 and out["cpu_loop_ms_after"] > 0
    # CPU per create: the node's, its reaped children's, and the whole machine's, which
    # also holds the sandboxes' still-running processes; the ceiling follows from it.
    cpu = out["cpu_ms_per_create"]
    assert set(cpu) == {"node", "children", "machine", "host_init"}, cpu
    assert cpu["machine"] > 0 and cpu["node"] > 0, cpu
    assert cpu["host_init"] >= 0, cpu  # the host init's share of machine
    assert out["cpu_ceiling_per_s"] > 0
    # With corral's launcher on cgroup v1 or hybrid: its pre-made cgroups, from the node's
    # status; after the warm-up settled the pool, the creates take from it.
    if "cgroup_pool" in out:
        pool = out["cgroup_pool"]
        assert set(pool) == {"size", "taken", "returned"} and pool["size"] > 0, pool
        assert isinstance(pool["taken"], int) and 0 < pool["taken"] <= 3, pool


def test_exec_json_shape(bench) -> None:  # type: ignore[no-untyped-def]
    out = bench("exec", "--count", "5")
    assert out["scenario"] == "exec" and out["count"] == 5
    _figures(out["corral"], ("p50_ms", "p99_ms"))
    assert out["corral"]["n"] == 5
    assert out["docker"] is None


def test_scale_json_shape(bench) -> None:  # type: ignore[no-untyped-def]
    out = bench("scale", "--count", "4", "--window", "2")
    assert out["scenario"] == "scale" and out["count"] == 4
    assert [w["live"] for w in out["windows"]] == [2, 4]
    _figures(out, ("exec_p50_ms_empty", "exec_p50_ms_full", "destroy_per_s"))
    _figures(out, ("exec_again_p50_ms_full",))
    assert all(w["exec_again_p50_ms"] > 0 for w in out["windows"])
    assert all(w["cpu_loop_ms"] > 0 for w in out["windows"])
    assert out["create_errors"] == 0 and out["destroy_errors"] == 0
    assert out["leftovers"] == 0, out.get("leftover_detail")
    # What the destroys handed on: the pool settling (removing cgroups beyond its size).
    after = out["after_destroy"]
    assert after["settle_s"] >= 0 and after["machine_busy_ms_per_destroy"] > 0, after
    assert after["machine_busy_ms_per_destroy_settling"] >= 0, after
    pool = after["cgroup_pool"]
    assert pool is None or set(pool) == {"size", "taken", "returned"}, pool
    # The spans tools/profile_scale.py cuts its samples by, in order.
    spans = [out["exec_empty_mono_s"]]
    for w in out["windows"]:
        spans += [w["mono_s"], w["exec_mono_s"]]
    spans.append(out["destroy_mono_s"])
    flat = [t for span in spans for t in span]
    assert flat == sorted(flat), spans


def _sleepers() -> int:
    """Processes left of tools/host_load.py's (``sleep 86400``)."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                n += Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x0086400\x00"
            except OSError:
                continue  # ended while we looked
    return n


def test_host_load_tool(bench) -> None:  # type: ignore[no-untyped-def]
    """tools/host_load.py: each condition's processes really are in the namespaces it
    names, the bench ran against an empty node for each, and none of them is left."""
    assert _sleepers() == 0
    opts = f"--state-dir {STATE} --run-dir {RUN} --cgroup-subtree corral-test{TAG}-bench"
    opts += f" --store {TEST_STORE} --image test/busybox"
    argv = [sys.executable, str(REPO / "tools" / "host_load.py"), "none", "netns", "pidmnt"]
    argv += ["--count", "12", "--creates", "6", "--concurrency", "2", "--settle", "0"]
    # 12 namespaces need no teardown wait; a core kept busy by anything else must not
    # hold the test up.
    argv += ["--idle-window", "0.2", "--teardown-timeout", "4", "--bench-args", opts, "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    runs = {run["condition"]: run for run in out["runs"]}
    assert [run["condition"] for run in out["runs"]] == ["none", "netns", "pidmnt"]
    assert (runs["none"]["processes"], runs["none"]["network_namespaces"]) == (0, 0)
    assert (runs["netns"]["processes"], runs["netns"]["network_namespaces"]) == (12, 12)
    assert (runs["pidmnt"]["processes"], runs["pidmnt"]["network_namespaces"]) == (12, 1)
    for run in out["runs"]:
        assert run["per_s"] > 0 and run["p99_ms"] >= run["p50_ms"] > 0, run
        assert "host_init" in run["cpu_ms_per_create"], run
    assert _sleepers() == 0
