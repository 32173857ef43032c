"""Bursting into a cloud pool that Ray's autoscaler really grows and shrinks.

One on-prem corral node (``c0``, on the Ray head, room for 5) and a cloud pool of Ray node
type ``corral.cloud`` that Ray's autoscaler (fake multi-node provider: a cloud node is a
set of local Ray processes) starts on request and removes when idle. Filling ``c0`` to 80%
makes the next create burst: the control plane asks the autoscaler for a cloud node, starts
a node agent pinned to it, and the create lands there once its node registers. After the
sandbox is destroyed the cloud node is released and Ray removes it.

Heavy (a second Ray cluster, a minute or two); this module runs before the shared
three-node cluster of test_cluster_ray.py starts (file order), since one process holds one
Ray connection at a time.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import corral
from tests.conftest import TAG, TEST_STORE

if TYPE_CHECKING:
    from corral.cluster.local_autoscale import LocalAutoscalingCluster

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.heavy,
]
ray = pytest.importorskip("ray", reason="the cluster tests need corral[cluster] (ray)")

IMAGE = "test/busybox"


def _dirs(name: str) -> tuple[Path, Path, str]:
    return (
        Path(f"/var/lib/corral-test{TAG}-{name}"),
        Path(f"/run/corral-test{TAG}-{name}"),
        f"corral-test{TAG}-{name}",
    )


def _config(name: str, pool: str, subnet: str, max_sandboxes: int) -> object:
    from corral.node import NodeConfig

    state, run, subtree = _dirs(name)
    return NodeConfig(
        state_dir=state,
        run_dir=run,
        store=TEST_STORE,
        cgroup_subtree=subtree,
        scratch_size="2GiB",
        reaper_interval=0.5,
        max_sandboxes=max_sandboxes,
        labels={"pool": pool, "host": name},
        network={"subnet": subnet},
    )


@pytest.fixture(scope="module")
def autoscaling() -> Iterator[LocalAutoscalingCluster]:
    from corral.cluster.autoscale import CloudPool
    from corral.cluster.local_autoscale import LocalAutoscalingCluster, _marked
    from tests.integration.conftest import _ensure_images, assert_no_leaks

    if ray.is_initialized():
        pytest.skip("another Ray cluster is connected in this process; run this file alone")
    _ensure_images()
    names = ("a0", "a1")
    for n in names:
        for d in _dirs(n)[:2]:
            shutil.rmtree(d, ignore_errors=True)
    onprem = _config("a0", "onprem", "10.246.0.0/16", 5)
    cloud = _config("a1", "cloud", "10.247.0.0/16", 16)
    pool = CloudPool(
        node_config=cloud.model_dump_json(),  # type: ignore[attr-defined]
        max_nodes=1,  # every cloud node of this machine would share one node config
        idle_after=2.0,
        wait=240.0,
        store=str(TEST_STORE),
    )
    lc = LocalAutoscalingCluster(onprem, pool, idle_minutes=0.1)  # type: ignore[arg-type]
    with lc:
        yield lc
    assert not Path(lc.tmp).exists()
    assert not _marked(str(lc.tmp).encode()), "Ray processes of the cluster left running"
    for n in names:
        state, run, subtree = _dirs(n)
        assert_no_leaks(state, run, subtree)
        for d in (state, run):
            shutil.rmtree(d, ignore_errors=True)


async def _until(what: str, check: object, deadline: float = 180.0) -> None:
    t0 = time.monotonic()
    while not await check():  # type: ignore[operator]
        if time.monotonic() - t0 > deadline:
            raise AssertionError(f"{what}: not within {deadline} s")
        await asyncio.sleep(0.5)


async def test_burst_grows_the_cloud_pool_and_idle_shrinks_it(
    autoscaling: LocalAutoscalingCluster,
) -> None:
    c0 = autoscaling.info["node_id"]
    async with corral.AsyncClient("ray://auto") as client:
        onprem = [await client.sandboxes.create(image=IMAGE, qos="latency") for _ in range(4)]
        assert {sb.info.node_id for sb in onprem} == {c0}
        assert autoscaling.cloud_ray_nodes() == []  # no cloud node before the burst

        # c0 is 80% full: this create may burst, the cloud pool is empty, so the control
        # plane has the autoscaler add a cloud node and places the create there
        t0 = time.monotonic()
        sb = await client.sandboxes.create(image=IMAGE, qos="latency")
        print(f"burst create on a new cloud node took {time.monotonic() - t0:.1f} s")
        assert sb.info.node_id != c0
        assert len(autoscaling.cloud_ray_nodes()) == 1
        r = await sb.exec(["sh", "-c", "echo from the cloud $((6*7))"])
        assert r.stdout == b"from the cloud 42\n"
        cloud_node = sb.info.node_id

        await sb.destroy()
        for x in onprem:
            await x.destroy()

        async def released() -> bool:
            return not autoscaling.cloud_ray_nodes()

        t0 = time.monotonic()
        await _until("the idle cloud node removed by the autoscaler", released)
        print(f"idle cloud node gone {time.monotonic() - t0:.1f} s after the last destroy")

        evs = await client.events(kinds=["autoscale", "burst"])
        acts = [(e.kind, e.detail.get("action") or e.detail.get("state")) for e in evs]
        assert ("burst", "on") in acts
        for act in ("request", "joined", "release"):
            assert ("autoscale", act) in acts, acts
        assert {e.node_id for e in evs} == {"cluster"}
        joined = [e for e in evs if e.detail.get("action") == "joined"]
        assert joined[0].detail["node"] == cloud_node
        # the released node left the fleet for good: not lost, not listed
        assert cloud_node not in client._ops.lost_nodes()  # type: ignore[union-attr]
