"""``corral bench ondemand``, ``workspace`` and ``metasplit`` end to end at tiny sizes: each
starts its own MooseFS (bench/dfs.py), and the last stdout line has the keys issue 16 names."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from corral.bench import dfs
from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import run_bench

STATE = Path(f"/var/lib/corral-test{TAG}-sbench")
RUN = Path(f"/run/corral-test{TAG}-sbench")
MODE = ("all_ready_s", "done_s", "local_writes_mib", "store_reads_mib")

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def bench(images_ready):  # type: ignore[no-untyped-def]
    if why := dfs.available():
        pytest.skip(why)

    def run(*args: str) -> dict:  # type: ignore[type-arg]
        return run_bench(
            *args,
            state=STATE,
            run=RUN,
            subtree=f"corral-test{TAG}-sbench",
            store=TEST_STORE,
            image="test/debian",  # has python3
            timeout=900,
        )

    try:
        yield run
    finally:
        for p in (RUN, STATE):
            shutil.rmtree(p, ignore_errors=True)
        left = sorted(STATE.parent.glob(f"{STATE.name}-*"))  # -dfs, -gen, one per mode
        assert left == [], f"the bench left {left}"


def test_ondemand_json_shape(bench) -> None:  # type: ignore[no-untyped-def]
    out = bench("ondemand", "--sandboxes", "4", "--images", "2", "--image-mib", "8")
    assert out["scenario"] == "ondemand"
    assert set(out["modes"]) == {"ondemand", "eager", "cached"}
    for mode in out["modes"].values():
        assert set(MODE) <= set(mode)
        assert mode["done_s"] >= mode["all_ready_s"] > 0
    assert out["modes"]["eager"]["store_reads_mib"] > out["modes"]["ondemand"]["store_reads_mib"]
    for k in ("speedup_vs_eager", "writes_ratio_vs_eager", "vs_cached"):
        assert out[k] > 0, k
    # Where each burst's CPU went: the store's own processes share the machine's cores,
    # and eager's copy of every layer goes through the servers and the link.
    cpu = {mode: out["breakdown"][mode]["cpu_s"] for mode in out["modes"]}
    for split in cpu.values():
        assert set(split) == {"machine_busy", "store_servers", "store_link", "store_client"}
        assert split["machine_busy"] > 0 and min(split.values()) >= 0
    assert cpu["eager"]["store_servers"] + cpu["eager"]["store_link"] > 0
    # Each burst's CLOCK_MONOTONIC span (to cut a profile to it), in the order they ran.
    spans = [out["breakdown"][m]["mono_s"] for m in ("ondemand", "eager", "cached")]
    assert all(a < b for a, b in spans) and spans == sorted(spans)
    # Set-up recorded hot-block profiles (a task reads a small part of each layer).
    assert out["layer_prefetch"] is True and out["profiled_layers"] >= 1
    # No --store-cores: everything may run on every core.
    allowed = sorted(os.sched_getaffinity(0))
    assert out["store_cores"] == 0 and out["node_cpus"] is None
    assert all(out["breakdown"][m]["sandbox_cpus"] == allowed for m in out["modes"])


def test_ondemand_store_cores_keep_the_servers_off_the_nodes_cores(bench) -> None:  # type: ignore[no-untyped-def]
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 or more usable cores")
    out = bench("ondemand", "--sandboxes", "2", "--images", "1", "--image-mib", "4",
                "--store-cores", "1")  # fmt: skip
    node = allowed[:-1]
    assert out["store_cores"] == 1 and out["node_cpus"] == node
    # As the kernel had them after set-up: servers and the link's pump on the last core,
    # the FUSE client (the node's) on the node's.
    assert out["store_affinity"] == {"servers": allowed[-1:], "link": allowed[-1:], "client": node}
    for m in ("ondemand", "eager", "cached"):  # every mode's sandboxes on the node's cores
        assert out["breakdown"][m]["sandbox_cpus"] == node, m


def test_workspace_json_shape(bench) -> None:  # type: ignore[no-untyped-def]
    out = bench("workspace", "--sandboxes", "3", "--repo-mib", "2")
    assert out["scenario"] == "workspace"
    for side in ("layer", "tar"):
        assert out[side]["done_s"] > 0 and out[side]["writes_mib"] >= 0
    assert out["speedup"] > 0 and out["writes_ratio"] > 0


def test_metasplit_json_shape(bench) -> None:  # type: ignore[no-untyped-def]
    from corral.bench.metasplit import VARIANTS, WORKLOADS

    out = bench("metasplit", "--files", "300", "--trials", "2")
    assert out["scenario"] == "metasplit" and out["files"] == 300
    assert set(out["variants"]) == set(VARIANTS)
    for v in out["variants"].values():
        for w in WORKLOADS:
            assert v[f"{w}_ms_p50"] > 0 and len(v[f"{w}_ms"]) == 2 and v[f"{w}_link_mib"] >= 0
    # The split's metadata is on local disk: a stat walk reads nothing over the link,
    # while the whole layer's walk reads its inodes (and what shares their blocks) there.
    assert out["variants"]["split"]["stat_link_mib"] < 0.05
    assert out["variants"]["whole"]["stat_link_mib"] > 0
    sizes = out["sizes_mib"]
    assert 0 < sizes["split_meta_local"] < sizes["whole"] and sizes["split_blob"] > 0
    for k in ("stat_speedup_split", "read_speedup_split", "stat_speedup_noinline"):
        assert out[k] > 0, k
