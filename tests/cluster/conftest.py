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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TAG, TEST_STORE

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
ray = pytest.importorskip("ray", reason="the cluster tests need corral[cluster] (ray)")

NODES = 3


def node_dirs(i: int) -> tuple[Path, Path, str]:
    return (
        Path(f"/var/lib/corral-test{TAG}-c{i}"),
        Path(f"/run/corral-test{TAG}-c{i}"),
        f"corral-test{TAG}-c{i}",
    )


def node_config_json(i: int) -> str:
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
    ).model_dump_json()


@dataclass
class RayCorral:
    """The running test cluster: the Ray cluster and the agents by host name."""

    cluster: Any
    agents: dict[str, Any] = field(default_factory=dict)

    def start_agent(self, host: str) -> dict[str, str]:
        from corral.cluster.ray_actors import AGENT_PREFIX, NAMESPACE, agent_actor, node_resource

        i = int(host[1:])
        agent = (
            agent_actor()
            .options(
                name=f"{AGENT_PREFIX}{host}",
                namespace=NAMESPACE,
                resources={node_resource(host): 1},
            )
            .remote(node_config_json(i))
        )
        self.agents[host] = agent
        info: dict[str, str] = ray.get(agent.start.remote(), timeout=180)
        return info

    def kill_agent(self, host: str) -> None:
        ray.kill(self.agents.pop(host), no_restart=True)


@pytest.fixture(scope="session")
def raycorral() -> Iterator[RayCorral]:
    from ray.cluster_utils import Cluster

    from corral.cluster.ray_actors import CONTROL_NAME, NAMESPACE, node_resource
    from corral.host import leaks
    from tests.integration.conftest import _ensure_images

    _ensure_images()
    for i in range(NODES):
        for d in node_dirs(i)[:2]:
            shutil.rmtree(d, ignore_errors=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "resources": {node_resource("c0"): 1},
        },
    )
    rc = RayCorral(cluster)
    try:
        for i in range(1, NODES):
            cluster.add_node(num_cpus=1, resources={node_resource(f"c{i}"): 1})
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        for i in range(NODES):
            rc.start_agent(f"c{i}")
        yield rc
    finally:
        try:
            if ray.is_initialized():
                for agent in rc.agents.values():
                    ray.get(agent.stop.remote(destroy=True), timeout=120)
                try:
                    ctl = ray.get_actor(CONTROL_NAME, namespace=NAMESPACE)
                    ray.get(ctl.stop.remote(), timeout=30)
                    ray.kill(ctl)
                except ValueError:
                    pass
        finally:
            ray.shutdown()
            cluster.shutdown()
    for i in range(NODES):
        state, run, subtree = node_dirs(i)
        found = leaks.scan(state, run, subtree, netns_prefix=subtree)
        assert leaks.total(found) == 0, {k: v for k, v in found.items() if v}
        for d in (state, run):
            shutil.rmtree(d, ignore_errors=True)
