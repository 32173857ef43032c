"""A real local multi-node Ray cluster with three real corral nodes on this machine.

Ray runs a head and two more Ray nodes (``ray.cluster_utils.Cluster``, 1 CPU each, no
dashboard); each Ray node carries the custom resource ``corral-node-cN`` that pins the
node agent ``corral-node-cN`` to it. Every corral node has its own state dir, run dir,
cgroup subtree (``corral-test<TAG>-cN``), network subnet and scratch filesystem.
At the end the agents destroy their sandboxes and close their nodes, Ray is shut down
(only the processes it started), and nothing of the nodes may be left.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import TAG, TEST_STORE

if TYPE_CHECKING:
    from corral.cluster.local import LocalRayCluster
    from corral.node import NodeConfig

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
ray = pytest.importorskip("ray", reason="the cluster tests need corral[cluster] (ray)")

NODES = 3


def node_dirs(i: int) -> tuple[Path, Path, str]:
    return (
        Path(f"/var/lib/corral-test{TAG}-c{i}"),
        Path(f"/run/corral-test{TAG}-c{i}"),
        f"corral-test{TAG}-c{i}",
    )


def node_config(i: int) -> NodeConfig:
    from corral.node import NodeConfig

    state, run, subtree = node_dirs(i)
    return NodeConfig(
        state_dir=state,
        run_dir=run,
        store=TEST_STORE,
        cgroup_subtree=subtree,
        scratch_size="2GiB",
        reaper_interval=0.5,
        max_sandboxes=64,
        labels={"pool": "onprem", "host": f"c{i}"},
        # c2 lacks the permission "pkgs": a create asking for it fails there (the failure a
        # group test injects on one node)
        network={
            "subnet": f"10.24{i}.0.0/16",
            "permissions": {} if i == 2 else {"pkgs": {"hosts": ["pkgs.test"]}},
        },
    )


@pytest.fixture(scope="session")
def raycorral() -> Iterator[LocalRayCluster]:
    from corral.cluster.local import LocalRayCluster
    from tests.integration.conftest import _ensure_images, assert_no_leaks

    _ensure_images()
    for i in range(NODES):
        for d in node_dirs(i)[:2]:
            shutil.rmtree(d, ignore_errors=True)
    with LocalRayCluster([node_config(i) for i in range(NODES)]) as lc:
        yield lc
    for i in range(NODES):
        state, run, subtree = node_dirs(i)
        assert_no_leaks(state, run, subtree)  # retried: loop devices go asynchronously
        for d in (state, run):
            shutil.rmtree(d, ignore_errors=True)
