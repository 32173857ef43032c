"""``corral cluster``: start a node agent on this host, and look at or steer the cluster.

The cluster runs on Ray (``pip install 'corral[cluster]'``). A host joins with
``corral cluster up``, which needs the host's Ray node to carry the custom resource
``corral-node-<host>`` (that is what pins the agent to this host)::

    ray start --address=HEAD:6379 --resources='{"corral-node-h1": 1}'
    corral cluster up --host h1 --config /etc/corral/node.toml

Everything else talks to the control plane through the cluster client, like the SDK's
``AsyncClient("ray://auto")``; ``corral --node ray://auto sandbox ls`` works too.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from corral.cli._context import emit_json, human_bytes, out
from corral.errors import InvalidRequest

if TYPE_CHECKING:
    from corral.cluster.ray_client import RayOps

__all__ = ["app"]

app = typer.Typer(help="A corral cluster on Ray: join a host, status, drain.", no_args_is_help=True)

_Address = Annotated[
    str, typer.Option("--address", help="Ray cluster to join: 'auto' or HOST:PORT of its GCS.")
]
_Json = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InvalidRequest("the cluster needs Ray: pip install 'corral[cluster]'") from None
    return ray


async def _connect(address: str) -> RayOps:
    from corral.cluster.ray_client import RayOps

    _ray()
    return await RayOps(f"ray://{address}").connect()


@app.command("up")
def up(
    host: Annotated[str, typer.Option("--host", help="This host's name in the cluster.")],
    config: Annotated[
        Path | None, typer.Option("--config", help="The node's config file (TOML).")
    ] = None,
    address: _Address = "auto",
) -> None:
    """Start this host's node agent (a detached Ray actor pinned to this host): it opens the
    node, reconciles what an earlier agent left, and serves the node's API to the cluster."""
    from corral.cluster.ray_actors import AGENT_PREFIX, NAMESPACE, agent_actor, node_resource
    from corral.node import NodeConfig

    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", host):
        raise InvalidRequest(f"--host {host!r}: 1-32 of [a-z0-9-]")
    cfg = NodeConfig.from_toml(config) if config is not None else NodeConfig()
    ray = _ray()
    joined = not ray.is_initialized()
    if joined:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    try:
        res = node_resource(host)
        if not any(n.get("Alive") and res in n.get("Resources", {}) for n in ray.nodes()):
            raise InvalidRequest(
                f"no Ray node carries the resource {res!r}: start Ray on this host with "
                f"--resources='{{\"{res}\": 1}}' (that pins the agent here)"
            )
        agent = (
            agent_actor()
            .options(
                name=f"{AGENT_PREFIX}{host}",
                namespace=NAMESPACE,
                resources={res: 1},
                lifetime="detached",
                get_if_exists=True,
            )
            .remote(cfg.model_dump_json())
        )
        info = ray.get(agent.start.remote(), timeout=600)
        out().print(f"node {info['node_id']} of host {host} serves {info['address']}")
    finally:
        if joined:
            ray.shutdown()


@app.command("status")
def status(address: _Address = "auto", as_json: _Json = False) -> None:
    """The fleet in one line per figure: nodes, lost, sandboxes, capacity."""

    async def go() -> Any:
        ops = await _connect(address)
        try:
            return await ops.node_status()
        finally:
            await ops.close()

    st = asyncio.run(go())
    if as_json:
        emit_json(st.model_dump(mode="json"))
        return
    t = Table(title="corral cluster")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for k in ("nodes", "lost", "draining"):
        t.add_row(k, st.labels.get(k, "0"))
    t.add_row("sandboxes", f"{st.sandboxes} / {st.max_sandboxes or '-'}")
    t.add_row("running / paused", f"{st.running} / {st.paused}")
    t.add_row("memory free", human_bytes(st.mem_available))
    t.add_row("cpus (load1)", f"{st.cpus} ({st.load1:.1f})")
    out().print(t)


@app.command("nodes")
def nodes(address: _Address = "auto", as_json: _Json = False) -> None:
    """Every node: state, sandboxes, capacity, load, labels."""

    async def go() -> list[dict[str, Any]]:
        ops = await _connect(address)
        try:
            lost = set(ops.lost_nodes())
            rows = []
            for nid, st in ops.statuses().items():
                rows.append(
                    {
                        "node_id": nid,
                        "state": "lost" if nid in lost else "up",
                        "sandboxes": st.sandboxes if st else None,
                        "max_sandboxes": st.max_sandboxes if st else None,
                        "load1": st.load1 if st else None,
                        "labels": st.labels if st else {},
                    }
                )
            return rows
        finally:
            await ops.close()

    rows = asyncio.run(go())
    if as_json:
        emit_json(rows)
        return
    t = Table(title="corral cluster nodes")
    for c in ("node", "state", "sandboxes", "max", "load1", "labels"):
        t.add_column(c)
    for r in rows:
        labels = ",".join(f"{k}={v}" for k, v in sorted(r["labels"].items()))
        t.add_row(
            r["node_id"],
            r["state"],
            str(r["sandboxes"]),
            str(r["max_sandboxes"]),
            str(r["load1"]),
            labels,
        )
    out().print(t)


@app.command("drain")
def drain(
    node: Annotated[str, typer.Argument(help="Node id (as in `corral cluster nodes`).")],
    undo: Annotated[bool, typer.Option("--undo", help="Place on the node again.")] = False,
    address: _Address = "auto",
) -> None:
    """Place no more sandboxes on NODE (its sandboxes keep running); --undo reverses it."""

    async def go() -> None:
        ops = await _connect(address)
        try:
            if node not in ops.node_ids():
                raise InvalidRequest(
                    f"no node {node!r} in the cluster (nodes: {', '.join(ops.node_ids())})"
                )
            await ops.control.drain.remote(node, not undo)
        finally:
            await ops.close()

    asyncio.run(go())
    out().print(f"node {node} {'accepts sandboxes again' if undo else 'is draining'}")


@app.command("cloud-pool")
def cloud_pool(
    config: Annotated[
        Path,
        typer.Option("--config", help='Node config (TOML) of every cloud node; pool = "cloud".'),
    ],
    resource: Annotated[
        str, typer.Option("--resource", help="Custom resource of the cloud Ray node type.")
    ] = "corral-pool-cloud",
    node_type: Annotated[
        str, typer.Option("--node-type", help="The cloud Ray node type (for the record).")
    ] = "corral.cloud",
    max_nodes: Annotated[int, typer.Option("--max-nodes", help="At most this many.")] = 4,
    idle_after: Annotated[
        float, typer.Option("--idle-after", help="Seconds empty before a node is released.")
    ] = 60.0,
    wait: Annotated[
        float, typer.Option("--wait", help="Seconds a burst create waits for a new node.")
    ] = 180.0,
    store: Annotated[
        str | None, typer.Option("--store", help="Store dir the cloud pool reads.")
    ] = None,
    address: _Address = "auto",
) -> None:
    """Let the control plane grow the cloud pool through Ray's autoscaler when on-prem is
    over its burst threshold, and give idle cloud nodes back (kept in the cluster's state:
    a restarted control plane keeps doing it). The Ray cluster config must have a node type
    carrying RESOURCE (1 per node) with min_workers 0."""
    from corral.cluster.autoscale import CloudPool
    from corral.node import NodeConfig

    cfg = NodeConfig.from_toml(config)
    pool = CloudPool(
        node_config=cfg.model_dump_json(),
        node_type=node_type,
        resource=resource,
        max_nodes=max_nodes,
        idle_after=idle_after,
        wait=wait,
        store=store or str(cfg.store_dir),
    )

    async def go() -> None:
        ops = await _connect(address)
        try:
            await ops.control.configure_pool.remote(pool.to_json())
        finally:
            await ops.close()

    asyncio.run(go())
    out().print(
        f"cloud pool: up to {max_nodes} nodes of type {node_type} ({resource}), "
        f"released after {idle_after:g} s idle"
    )
