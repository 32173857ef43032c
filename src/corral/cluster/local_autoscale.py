"""A Ray cluster on this machine whose cloud pool Ray's autoscaler really grows and shrinks.

For tests (and for trying bursting on one machine): the head Ray node is the on-prem
host ``c0`` (custom resource ``corral-node-c0``, its agent started here); the autoscaler
(Ray's monitor on the head, ``FakeMultiNodeProvider``, which starts a Ray node as local
processes) adds Ray nodes of the type ``corral.cloud`` when asked, each carrying the pool's
resource, and removes them after ``idle_timeout_minutes`` without work. Cloud agents are
started by the control plane, never here.

Ray is kept to this cluster alone: its own GCS port (a free one), its own temp dir; no
``ray stop``. Closing destroys every agent's sandboxes, closes their nodes, shuts down
the head and then ends, by pid, any process of this cluster's temp dir still running (a
cloud node the autoscaler had not removed yet: the fake provider starts its processes
from the monitor, and they outlive it).

Ray ships no ``example.yaml`` for the fake provider in its wheel, so the autoscaling
config here is complete and names the provider as an ``external`` module.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from corral.cluster.autoscale import CloudPool
from corral.cluster.ray_actors import (
    AGENT_PREFIX,
    CONTROL_NAME,
    NAMESPACE,
    agent_actor,
    control_actor,
    node_resource,
)

if TYPE_CHECKING:
    from corral.node import NodeConfig

__all__ = ["LocalAutoscalingCluster", "autoscaling_config"]

_FAKE_HEAD_ID = "f" * 51 + "00000"  # the fake provider's id for the head node
_OBJECT_STORE = 100 << 20


def autoscaling_config(
    gcs_address: str, pool: CloudPool, head_resources: dict[str, float], idle_minutes: float
) -> dict[str, Any]:
    """Ray's autoscaling config: the head (no workers of its type) and the cloud node type
    (1 CPU, one unit of the pool resource, at most ``pool.max_nodes``)."""
    return {
        "cluster_name": "corral-local",
        "max_workers": pool.max_nodes,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_minutes,
        "provider": {
            "type": "external",
            "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {},
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0},
            pool.node_type: {
                "resources": {"CPU": 1, pool.resource: 1, "object_store_memory": _OBJECT_STORE},
                "node_config": {},
                "min_workers": 0,
                "max_workers": pool.max_nodes,
            },
        },
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def _marked(mark: bytes) -> set[int]:
    """Pids whose command line holds ``mark``, with all their descendants."""
    parent: dict[int, int] = {}
    hits: set[int] = set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
        if mark in cmd:
            hits.add(int(d))
    grew = True
    while grew:
        more = {p for p, pp in parent.items() if pp in hits and p not in hits}
        hits |= more
        grew = bool(more)
    return hits


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalAutoscalingCluster:
    """On-prem node ``c0`` on the head, a cloud pool the autoscaler scales (see module)."""

    def __init__(
        self,
        onprem: NodeConfig,
        pool: CloudPool,
        *,
        idle_minutes: float = 0.1,
        start_timeout: float = 300.0,
    ) -> None:
        self.onprem, self.pool = onprem, pool
        self.idle_minutes = idle_minutes
        self._timeout = start_timeout
        self.cluster: Any = None
        self.agent: Any = None
        self.info: dict[str, str] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="corral-ray-"))

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def start(self) -> LocalAutoscalingCluster:
        import ray
        from ray.cluster_utils import Cluster

        port = _free_port()
        ip = ray.util.get_node_ip_address()
        head: dict[str, float] = {"CPU": 1, node_resource("c0"): 1}
        cfg = autoscaling_config(f"{ip}:{port}", self.pool, head, self.idle_minutes)
        path = self.tmp / "autoscaling.json"
        path.write_text(json.dumps(cfg))
        # the monitor (a child of the head) reads these: the fake provider insists on
        # RAY_FAKE_CLUSTER, and one-second rounds keep the test short
        os.environ["RAY_FAKE_CLUSTER"] = "1"
        os.environ["AUTOSCALER_UPDATE_INTERVAL_S"] = "1"
        os.environ["RAY_OVERRIDE_NODE_ID_FOR_TESTING"] = _FAKE_HEAD_ID
        try:
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "gcs_server_port": port,
                    "num_cpus": 1,
                    "include_dashboard": False,
                    "resources": {node_resource("c0"): 1},
                    "autoscaling_config": str(path),
                    "object_store_memory": _OBJECT_STORE,
                    "temp_dir": str(self.tmp / "ray"),
                },
            )
        finally:
            os.environ.pop("RAY_OVERRIDE_NODE_ID_FOR_TESTING", None)
        try:
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
            self.agent = (
                agent_actor()
                .options(
                    name=f"{AGENT_PREFIX}c0",
                    namespace=NAMESPACE,
                    resources={node_resource("c0"): 1},
                )
                .remote(self.onprem.model_dump_json())
            )
            self.info = ray.get(self.agent.start.remote(), timeout=self._timeout)
            ctl = (
                control_actor()
                .options(
                    name=CONTROL_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
                )
                .remote()
            )
            ray.get(ctl.configure_pool.remote(self.pool.to_json()), timeout=60)
        except BaseException:
            self.close()
            raise
        return self

    def cloud_ray_nodes(self) -> list[str]:
        """Ray node ids of the live cloud nodes (those carrying the pool's resource)."""
        import ray

        return [
            n["NodeID"]
            for n in ray.nodes()
            if n.get("Alive") and self.pool.resource in n.get("Resources", {})
        ]

    def close(self) -> None:
        import ray

        try:
            if ray.is_initialized():
                for entry in ray.util.list_named_actors(all_namespaces=True):
                    name = entry.get("name", "")
                    if entry.get("namespace") == NAMESPACE and name.startswith(AGENT_PREFIX):
                        with contextlib.suppress(Exception):
                            agent = ray.get_actor(name, namespace=NAMESPACE)
                            ray.get(agent.stop.remote(destroy=True), timeout=self._timeout)
                            ray.kill(agent)
                with contextlib.suppress(ValueError):
                    ctl = ray.get_actor(CONTROL_NAME, namespace=NAMESPACE)
                    ray.get(ctl.stop.remote(), timeout=30)
                    ray.kill(ctl)
        finally:
            ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None
            self._end_leftovers()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _end_leftovers(self) -> None:
        """End, by pid, the processes still running from this cluster's temp dir (the
        cloud nodes' Ray processes, which the fake provider started outside the head)."""
        for _ in range(3):
            pids = _marked(str(self.tmp).encode())
            if not pids:
                return
            for pid in pids:
                # Safe: only processes whose command line names this cluster's own temp
                # dir, and their children (Ray workers rename themselves ray::...)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)

    def __enter__(self) -> LocalAutoscalingCluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
