"""The Ray actors of a corral cluster: one node agent per host, one control plane.

Ray carries control messages only. Each **node agent** opens a real corral node on its host
and serves it over the node's own HTTP API (TCP, with a fresh bearer token); clients call
that API directly for every per-sandbox operation (exec, files, pty), so the data plane
never passes through Ray or the control plane. The agent is pinned to its host by a custom
resource ``corral-node-<host>`` that the operator (or ``ray.cluster_utils.Cluster`` in
tests) gives that Ray node, and is a named actor ``corral-node-<host>`` in the namespace
``corral``, which is how everyone finds it.

The **control plane** (named ``corral-control``) holds only soft state: the node list
(rediscovered from the named agents), a :class:`~corral.cluster.FleetClient` over their
HTTP APIs (placement, node loss) and the :class:`~corral.cluster.JobManager` (quotas,
groups, leases, which must outlive a killed trainer: that is why they live here). After a
restart it rebuilds all of it by asking the agents and the nodes.

The agent's token travels to clients in its actor info, over Ray's channel, and the node
API is plain HTTP: both are in clear on the wire. That is deliberate, not forgotten: who
can reach Ray can already run code on every host, so the Ray network must be trusted
anyway; on an untrusted one, turn on Ray's TLS and tunnel the node API (see the design
notes, "Agent tokens and the wire").

Nothing here is imported unless a cluster is used: ``ray`` is the optional extra
``corral[cluster]``. Methods take and return JSON strings of :mod:`corral.spec` models, and
errors travel as corral's wire errors (rebuilt by ``error_from_wire`` from its closed table)
rather than as pickled exceptions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from typing import Any

from corral.cluster.autoscale import CLOUD_AGENT_PREFIX, CloudPool, CloudScaler
from corral.cluster.events import ControlEvents
from corral.cluster.fleet import CLUSTER_ID, FleetClient
from corral.cluster.jobs import JobLimits, JobManager
from corral.errors import CorralError, InvalidRequest
from corral.spec import SandboxInfo, SandboxSpec

__all__ = [
    "NAMESPACE",
    "AGENT_PREFIX",
    "CONTROL_NAME",
    "node_resource",
    "NodeAgent",
    "ControlPlane",
    "agent_actor",
    "control_actor",
]

log = logging.getLogger("corral.cluster")

NAMESPACE = "corral"
REQUEST_LABEL = "corral.request"
"""A create's request key (set by the cluster client): a retried create finds what the
first try made instead of making it again."""
AGENT_PREFIX = "corral-node-"
CONTROL_NAME = "corral-control"
POOL_KEY = b"corral/cloud-pool"
"""Ray internal-KV key of the cloud pool's config: the cluster's state, so a restarted
control plane scales the same pool."""


def node_resource(host: str) -> str:
    """The Ray custom resource that pins a node agent to host ``host``."""
    return f"{AGENT_PREFIX}{host}"


def _wire(exc: CorralError) -> dict[str, Any]:
    return exc.to_wire()


def _agent_info_ok(info: object) -> bool:
    """Whether an agent's info is what :meth:`NodeAgent.info` returns (a garbage answer must
    not stop discovery of the other agents, nor add a node under a bad id)."""
    from corral.spec import NODE_ID_RE

    return (
        isinstance(info, dict)
        and all(isinstance(info.get(k), str) for k in ("node_id", "address", "token"))
        and bool(NODE_ID_RE.fullmatch(info["node_id"]))
        and info["node_id"] != CLUSTER_ID
        and info["address"].startswith(("http://", "https://"))
    )


def _limits(text: str) -> JobLimits:
    """A job's limits from a client's JSON; InvalidRequest naming what is wrong."""
    try:
        raw = json.loads(text)
    except ValueError:
        raise InvalidRequest("job limits: not JSON") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("job limits: expected an object of limits")
    known = set(JobLimits.__dataclass_fields__)
    if set(raw) - known:
        raise InvalidRequest(
            f"job limits: unknown {sorted(set(raw) - known)} (known: {sorted(known)})"
        )
    return JobLimits(**raw)


class NodeAgent:
    """Hosts one corral node on this host and serves its HTTP API (a Ray actor's body).

    ``config``: a :class:`corral.node.NodeConfig` as JSON. ``bind``: the address the API
    listens on (default: this host's address in the Ray cluster); the port is the kernel's
    choice."""

    def __init__(self, config: str, bind: str = "") -> None:
        self._config_json = config
        self._bind = bind
        self._token = secrets.token_urlsafe(24)
        self._node: Any = None
        self._server: Any = None

    async def start(self) -> dict[str, str]:
        """Open the node (it reconciles what an earlier agent left) and serve it."""
        # imported here: only a host that runs a node needs the node room
        from corral.api.server import NodeServer
        from corral.node import Node, NodeConfig

        if self._node is None:
            if not self._bind:
                import ray

                self._bind = ray.util.get_node_ip_address()
            cfg = NodeConfig.model_validate_json(self._config_json)
            self._node = await Node.open(cfg)
            self._server = NodeServer(self._node, host=self._bind, port=0, token=self._token)
            await self._server.start()
        return self.info()

    def info(self) -> dict[str, str]:
        """Where clients reach this node: ``{"node_id", "address", "token"}``."""
        if self._node is None:
            return {}
        return {
            "node_id": self._node.node_id,
            "address": self._server.address,
            "token": self._token,
        }

    async def release(self) -> bool:
        """Close this node if it holds no sandbox (a cloud node being given back); False,
        and nothing done, when it holds one."""
        if self._node is not None and await self._node.sandbox_list():
            return False
        await self.stop()
        return True

    async def stop(self, destroy: bool = False) -> int:
        """Stop serving and close the node; ``destroy`` first destroys every sandbox
        (returns how many). Without it sandboxes keep running for the next agent."""
        n = 0
        if self._server is not None:
            await self._server.stop()
            self._server = None
        if self._node is not None:
            if destroy:
                for info in await self._node.sandbox_list():
                    await self._node.sandbox_destroy(info.id)
                    n += 1
            await self._node.close()
            self._node = None
        return n


class ControlPlane:
    """Placement, jobs and node loss over the agents (a Ray actor's body); see module doc.

    ``interval``: seconds between status rounds (node loss is reported ``lost_after``
    seconds after a node's last answer, so within ``lost_after + interval``)."""

    def __init__(self, interval: float = 1.0, lost_after: float = 5.0) -> None:
        self._interval = interval
        self._log = ControlEvents()
        self._fleet = FleetClient(
            {}, lost_after=lost_after, status_timeout=min(2.0, lost_after), events=self._log
        )
        self._jobs = JobManager(
            self._fleet, free_slots=self._fleet.placer.free_slots, events=self._log
        )
        self._agents: dict[str, dict[str, str]] = {}
        self._loop: asyncio.Task[None] | None = None
        self._scaler: CloudScaler | None = None

    def configure_pool(self, pool: str) -> None:
        """Scale the cloud pool ``pool`` (a :class:`CloudPool` as JSON) through Ray's
        autoscaler from now on; kept in Ray's internal KV for a restarted control plane."""
        from ray.experimental import internal_kv

        cfg = CloudPool.from_json(pool)
        internal_kv._internal_kv_put(POOL_KEY, cfg.to_json().encode(), overwrite=True)
        self._use_pool(cfg)

    def _use_pool(self, cfg: CloudPool) -> None:
        if self._scaler is None:
            self._scaler = CloudScaler(self._fleet, cfg, _RayScale(cfg), self._log, self._poke)
            self._scaler.adopt([n for n in self._agents if n.startswith(CLOUD_AGENT_PREFIX)])
        else:  # reconfigured: new launches use the new config, running nodes stay
            self._scaler.reconfigure(cfg, _RayScale(cfg))

    async def _poke(self) -> None:
        await self.discover()
        await self._fleet.refresh()

    async def start(self) -> None:
        if self._loop is None:
            from ray.experimental import internal_kv

            raw = internal_kv._internal_kv_get(POOL_KEY)
            if raw:
                self._use_pool(CloudPool.from_json(raw.decode()))
            await self.discover()
            await self._fleet.refresh()
            await self._jobs.rebuild()  # after a restart: the jobs the nodes still hold
            self._loop = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(self._interval)
            try:
                if rounds % 5 == 0:
                    await self.discover()
                await self._fleet.refresh()
                await self._jobs.tick()
                if self._scaler is not None:
                    await self._scaler.tick()
            except Exception:  # the loop must outlive one bad round
                log.exception("control plane round failed")
            rounds += 1

    async def discover(self) -> list[dict[str, str]]:
        """Ask every named node agent where its node is; add new nodes and re-point those
        whose agent restarted (new address or token). Soft state: this is the rebuild."""
        import ray

        from corral.sdk._http import HTTPOps

        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry.get("name", "") if isinstance(entry, dict) else str(entry)
            if entry.get("namespace") != NAMESPACE or not name.startswith(AGENT_PREFIX):
                continue
            if self._scaler is not None and self._scaler.released(name):
                continue
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                info: dict[str, str] = await asyncio.wait_for(actor.info.remote(), timeout=2)
            except Exception:  # an agent starting or dying: next round
                continue
            if not info or self._agents.get(name) == info:
                continue
            if not _agent_info_ok(info):
                log.warning("agent %s answered garbage for its info: %.200r", name, info)
                continue
            self._agents[name] = info
            if self._scaler is not None and name.startswith(CLOUD_AGENT_PREFIX):
                self._scaler.adopt([name])  # no-op for its own launches
                self._scaler.seen(name, info["node_id"])
            old = self._fleet.add_node(
                info["node_id"], HTTPOps(info["address"], token=info["token"])
            )
            if old is not None:
                await old.close()
        if self._scaler is not None:
            for name in [n for n in self._agents if self._scaler.released(n)]:
                del self._agents[name]
        return list(self._agents.values())

    def nodes(self) -> list[dict[str, str]]:
        """Every known node: its agent's info plus ``lost``/``draining``."""
        lost = set(self._fleet.lost_nodes())
        return [{**a, "lost": str(a["node_id"] in lost)} for a in self._agents.values()]

    async def refresh(self) -> dict[str, str | None]:
        got = await self._fleet.refresh()
        return {k: None if v is None else v.model_dump_json() for k, v in got.items()}

    def drain(self, node_id: str, on: bool = True) -> None:
        self._fleet.drain(node_id, on)

    def draining(self) -> list[str]:
        """The nodes an operator is draining (clients that place creates themselves ask)."""
        return self._fleet.draining_nodes()

    # ----------------------------------------------------------------- creates
    async def sandbox_create(self, spec: str) -> str:
        try:
            s = SandboxSpec.model_validate_json(spec)
            done = await self._already(s, 1)
            info = done[0] if done else await self._fleet.sandbox_create(s)
        except CorralError as exc:
            return json.dumps(_wire(exc))
        return info.model_dump_json()

    async def _already(self, spec: SandboxSpec, n: int) -> list[SandboxInfo]:
        """What an earlier try of the same keyed request made (a client retrying after a
        restart of this actor): all n of them, or none (a partial group is undone)."""
        key = spec.labels.get(REQUEST_LABEL)
        if not key:
            return []
        made = await self._fleet.sandbox_list({REQUEST_LABEL: key})
        if len(made) >= n:
            return made[:n]
        for info in made:
            await self._fleet.sandbox_destroy(info.id)
        return []

    # ----------------------------------------------------------------- jobs
    async def job_open(self, name: str, limits: str) -> str:
        try:
            lim = _limits(limits)
        except CorralError as exc:
            return json.dumps(_wire(exc))
        return await self._call(self._job_open(name, lim))

    async def _job_open(self, name: str, limits: JobLimits) -> dict[str, Any]:
        job = await self._jobs.open(name, limits)
        return {"name": job.name, "live": len(job.live), "state": job.state}

    async def job_attach(self, name: str) -> str:
        async def go() -> dict[str, Any]:
            job = await self._jobs.attach(name)
            return {"name": job.name, "live": len(job.live), "state": job.state}

        return await self._call(go())

    async def job_renew(self, name: str) -> str:
        async def go() -> dict[str, Any]:
            return {"lease_until": self._jobs.renew(name)}

        return await self._call(go())

    async def job_create(self, name: str, n: int, spec: str) -> str:
        async def go() -> list[dict[str, Any]]:
            job = self._jobs.get(name)
            s = SandboxSpec.model_validate_json(spec)
            done = await self._already(s, n)
            if done:
                return [i.model_dump(mode="json") for i in done]
            made = (
                [await self._jobs.create(job, s)]
                if n == 1
                else await self._jobs.create_group(job, n, s)
            )
            return [i.model_dump(mode="json") for i in made]

        return await self._call(go())

    async def job_pause(self, name: str, resume: bool = False) -> str:
        async def go() -> list[dict[str, Any]]:
            job = self._jobs.get(name)
            got = await (self._jobs.resume(job) if resume else self._jobs.pause(job))
            return [i.model_dump(mode="json") for i in got]

        return await self._call(go())

    async def job_close(self, name: str) -> str:
        async def go() -> int:
            return await self._jobs.close(name)

        return await self._call(go())

    async def job_state(self, name: str) -> str:
        async def go() -> dict[str, Any]:
            job = self._jobs.get(name)
            return {
                "name": job.name,
                "state": job.state,
                "live": len(job.live),
                "orphans": job.orphans,
                "lease_ttl": job.limits.lease_ttl,
            }

        return await self._call(go())

    def events(
        self,
        after: int = 0,
        kinds: list[str] | None = None,
        labels: dict[str, str] | None = None,
        limit: int = 10_000,
    ) -> str:
        """Control-plane events after id ``after`` (see :mod:`corral.cluster.events`)."""
        got = self._log.after(after, kinds=kinds, labels=labels, limit=limit)
        return json.dumps([e.model_dump(mode="json") for e in got])

    def cloud_nodes(self) -> dict[str, str | None]:
        """Cloud agents the scaler launched: name -> node id (None while starting)."""
        return self._scaler.nodes() if self._scaler is not None else {}

    @staticmethod
    async def _call(coro: Any) -> str:
        try:
            return json.dumps({"ok": await coro})
        except CorralError as exc:
            return json.dumps(_wire(exc))

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
        await self._fleet.close()


class _RayScale:
    """:class:`~corral.cluster.autoscale.ScaleOps` on Ray (see there)."""

    def __init__(self, pool: CloudPool) -> None:
        self._pool = pool

    def request(self, nodes: int) -> None:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[{self._pool.resource: 1}] * nodes)

    def launch(self, name: str) -> None:
        # detached: a cloud agent outlives a restart of the control plane that started it
        # (the new one adopts it by name); one unit of the pool resource: one per node
        agent = (
            agent_actor()
            .options(
                name=name,
                namespace=NAMESPACE,
                resources={self._pool.resource: 1},
                lifetime="detached",
            )
            .remote(self._pool.node_config)
        )
        agent.start.remote()  # runs once Ray has placed the actor on the new node

    async def release(self, name: str, up: bool) -> bool:
        import ray

        try:
            agent = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True  # already gone
        ok = await agent.release.remote() if up else True
        if ok:
            ray.kill(agent, no_restart=True)
        return bool(ok)


def agent_actor() -> Any:
    """``NodeAgent`` as a Ray actor class (one concurrent call at a time is not enough:
    ``info`` must answer while ``start`` opens the node, so it is an async actor)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=0)(NodeAgent)


def control_actor() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1)(ControlPlane)
