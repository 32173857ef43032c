"""A Ray cluster of several Ray nodes on this one machine, each hosting a corral node agent.

For tests and benchmarks (``corral bench cluster``): ``ray.cluster_utils.Cluster`` starts a
head and ``len(configs) - 1`` more Ray nodes (1 CPU each, no dashboard), each carrying the
custom resource ``corral-node-cN`` that pins agent ``corral-node-cN`` to it. Closing it
has every agent destroy its sandboxes and close its node, then shuts down only the Ray
processes it started.

Example:
    >>> with LocalRayCluster([cfg0, cfg1, cfg2]) as lc:           # doctest: +SKIP
    ...     ops = await RayOps().connect()
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

from corral.cluster.ray_actors import (
    AGENT_PREFIX,
    CONTROL_NAME,
    NAMESPACE,
    agent_actor,
    node_resource,
)

if TYPE_CHECKING:
    from corral.node import NodeConfig

__all__ = ["LocalRayCluster"]


class LocalRayCluster:
    """Ray nodes ``c0..cN-1`` on this host with one corral node agent each (see module)."""

    def __init__(self, configs: list[NodeConfig], start_timeout: float = 300.0) -> None:
        self.configs = configs
        self._timeout = start_timeout
        self.cluster: Any = None
        self.agents: dict[str, Any] = {}
        self.infos: dict[str, dict[str, str]] = {}

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def start(self) -> LocalRayCluster:
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "include_dashboard": False,
                "resources": {node_resource("c0"): 1},
            },
        )
        try:
            for i in range(1, len(self.configs)):
                self.cluster.add_node(num_cpus=1, resources={node_resource(f"c{i}"): 1})
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
            for i in range(len(self.configs)):
                self.start_agent(f"c{i}")
        except BaseException:
            self.close()
            raise
        return self

    def start_agent(self, host: str) -> dict[str, str]:
        """Start (or restart) the agent of ``host`` (``cN``); its node reconciles."""
        import ray

        cfg = self.configs[int(host[1:])]
        agent = (
            agent_actor()
            .options(
                name=f"{AGENT_PREFIX}{host}",
                namespace=NAMESPACE,
                resources={node_resource(host): 1},
            )
            .remote(cfg.model_dump_json())
        )
        self.agents[host] = agent
        info: dict[str, str] = ray.get(agent.start.remote(), timeout=self._timeout)
        self.infos[host] = info
        return info

    def kill_agent(self, host: str) -> None:
        """Kill the agent's worker process (a node loss); its node's sandboxes stay."""
        import ray

        ray.kill(self.agents.pop(host), no_restart=True)

    def close(self) -> None:
        import ray

        try:
            if ray.is_initialized():
                # an agent killed (a node-loss test) and not restarted left its node's
                # sandboxes running: a new agent adopts them so that they can be destroyed
                for i in range(len(self.configs)):
                    if f"c{i}" not in self.agents and self.infos.get(f"c{i}"):
                        self.start_agent(f"c{i}")
                for agent in self.agents.values():
                    ray.get(agent.stop.remote(destroy=True), timeout=self._timeout)
                self.agents.clear()
                try:
                    ctl = ray.get_actor(CONTROL_NAME, namespace=NAMESPACE)
                    ray.get(ctl.stop.remote(), timeout=30)
                    ray.kill(ctl)
                except ValueError:
                    pass
        finally:
            ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
