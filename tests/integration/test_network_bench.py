"""``corral bench network`` end to end at tiny counts: the last stdout line is one JSON
object with the documented figures, and nothing of the bench is left behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import TAG, TEST_STORE

STATE = Path(f"/var/lib/corral-test{TAG}-nbench")
RUN = Path(f"/run/corral-test{TAG}-nbench")
SUBTREE = f"corral-test{TAG}-nbench"


def test_bench_network_json(images_ready) -> None:  # type: ignore[no-untyped-def]
    argv = [
        sys.executable, "-m", "corral.bench.cli", "network", "--json",
        "--count", "2", "--updates", "2", "--rounds", "1", "--size", "8MiB",
        "--state-dir", str(STATE), "--run-dir", str(RUN), "--cgroup-subtree", SUBTREE,
        "--store", str(TEST_STORE), "--image", "test/debian",
    ]  # fmt: skip
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["scenario"] == "network"
        for key in ("attach_ms_p50", "attach_ms_p99", "policy_update_ms_p50", "throughput_ratio"):
            assert isinstance(out[key], float) and out[key] > 0, (key, out)
        assert out["attach_ms_p50"] <= out["attach_ms_p99"]
        for key in ("create_extra_ms_p50", "create_extra_ms_paired_p50"):  # may be < 0
            assert isinstance(out[key], float), (key, out)
        assert out["throughput_mbps_host"] > 0 and out["throughput_mbps_path"] > 0
    finally:
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert SUBTREE not in tables
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert SUBTREE not in netns
