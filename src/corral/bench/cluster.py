"""``corral bench cluster``: the same work through the cluster client and straight at one node.

A local Ray cluster of ``nodes`` Ray nodes on this machine hosts one real corral node each
(:class:`corral.cluster.local.LocalRayCluster`). In the same run:

- **cluster**: ``count`` creates at ``concurrency`` through ``RayOps`` (placed over all
  nodes), then destroyed;
- **single_node**: the same against the first node's HTTP API directly;
- then ``exec true`` one after another in a few sandboxes of each, the two taking turns,
  so that both see the same moments of the machine;
- **lost_detect_s**: one agent is killed; seconds until the cluster client reports its node
  lost (then the agent is restarted and its node reconciles);
- **orphans_left**: a job whose lease is never renewed: its sandboxes must be paused, then
  destroyed after the grace; what is left of them afterwards.

On one machine every node shares the same CPUs, so the cluster cannot be faster than one
node here; the ratio says what the control plane and routing cost (target: create
throughput ≥ 0.9x, exec p50 ≤ 1.1x).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from corral.bench.image import ensure_image
from corral.bench.scenarios import BenchOptions, say
from corral.bench.stats import p50, p99
from corral.errors import CorralError
from corral.images.store import LayerStore
from corral.ops import NodeOps
from corral.spec import ExecRequest, SandboxInfo, SandboxSpec

__all__ = ["cluster"]

_EXECS = 100
_EXEC_SANDBOXES = 12  # per side, execs cycle over them (the cluster's spread over the nodes)


async def _creates(
    ops: NodeOps, image: str, count: int, concurrency: int, made: list[SandboxInfo]
) -> dict[str, Any]:
    """``count`` creates at ``concurrency`` (kept in ``made``): throughput and latency."""
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def one() -> None:
        async with sem:
            t = time.perf_counter()
            made.append(await ops.sandbox_create(SandboxSpec(image=image, labels={"b": "c"})))
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    wall = time.perf_counter() - t0
    return {
        "count": count,
        "create_per_s": round(count / wall, 2),
        "create_p50_ms": round(p50(lat) * 1000, 2),
        "create_p99_ms": round(p99(lat) * 1000, 2),
        "nodes_used": len({i.node_id for i in made}),
    }


async def _execs_taking_turns(
    sides: list[tuple[NodeOps, list[SandboxInfo], dict[str, Any]]],
) -> None:
    """``exec true`` one after another, the sides taking turns (each side's i-th sandbox),
    so that both see the same moments of the machine; p50/p99 into each side's figures."""
    ex: list[list[float]] = [[] for _ in sides]
    for i in range(_EXECS):
        for k, (ops, made, _) in enumerate(sides):
            t = time.perf_counter()
            await ops.exec(made[i % len(made)].id, ExecRequest(cmd=["true"]))
            ex[k].append(time.perf_counter() - t)
    for (_, _, out), lat in zip(sides, ex, strict=True):
        out["exec_p50_ms"] = round(p50(lat) * 1000, 2)
        out["exec_p99_ms"] = round(p99(lat) * 1000, 2)


async def _destroy(ops: NodeOps, made: list[SandboxInfo], concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def gone(sid: str) -> None:
        async with sem:
            await ops.sandbox_destroy(sid)

    await asyncio.gather(*(gone(i.id) for i in made), return_exceptions=True)


async def _until(check: Any, deadline: float) -> float:
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > deadline:
            raise CorralError(f"bench cluster: condition not reached within {deadline} s")
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def cluster(opts: BenchOptions, nodes: int, count: int, concurrency: int) -> dict[str, Any]:
    from corral.cluster.local import LocalRayCluster
    from corral.cluster.ray_client import RayOps
    from corral.node import NodeConfig
    from corral.sdk._http import HTTPOps

    store = LayerStore(opts.store_dir)
    image = (await asyncio.to_thread(ensure_image, store, opts.image)).info
    configs = [
        NodeConfig.model_validate(
            {
                "state_dir": opts.state_dir.with_name(f"{opts.state_dir.name}-c{i}"),
                "run_dir": opts.run_dir.with_name(f"{opts.run_dir.name}-c{i}"),
                "store": opts.store_dir,
                "cgroup_subtree": f"{opts.subtree}-c{i}",
                "backends": [{"kind": "container", "runtime": opts.runtime}],
                "max_sandboxes": count + 16,
                "scratch_size": "8GiB",
                "network": {"subnet": f"10.{250 + i}.0.0/16"},
                "labels": {"host": f"c{i}"},
            }
        )
        for i in range(nodes)
    ]
    say(f"starting a local Ray cluster of {nodes} nodes")
    lc = LocalRayCluster(configs)
    lc.start()  # in the main thread: Ray sets signal handlers (blocks this loop; nothing else runs)
    out: dict[str, Any] = {"scenario": "cluster", "nodes": nodes, "image": image.name}
    try:
        ops = await RayOps(lost_after=5.0).connect()
        first = lc.infos["c0"]
        single = HTTPOps(first["address"], token=first["token"])
        try:
            for side, side_ops in (("cluster", ops), ("single_node", single)):
                say(f"{side}: {count} creates at concurrency {concurrency}")
                made: list[SandboxInfo] = []
                try:
                    out[side] = await _creates(side_ops, image.digest, count, concurrency, made)
                finally:
                    await _destroy(side_ops, made, concurrency)
            made_c: list[SandboxInfo] = []
            made_s: list[SandboxInfo] = []
            try:
                say(f"exec: {_EXECS} each, cluster and single node taking turns")
                await _creates(ops, image.digest, _EXEC_SANDBOXES, concurrency, made_c)
                await _creates(single, image.digest, _EXEC_SANDBOXES, concurrency, made_s)
                await _execs_taking_turns(
                    [(ops, made_c, out["cluster"]), (single, made_s, out["single_node"])]
                )
            finally:
                await _destroy(ops, made_c, concurrency)
                await _destroy(single, made_s, concurrency)
            c, s = out["cluster"], out["single_node"]
            out["ratio"] = {
                "create_per_s": round(c["create_per_s"] / s["create_per_s"], 3),
                "exec_p50_ms": round(c["exec_p50_ms"] / s["exec_p50_ms"], 3),
            }
            out["orphans_left"] = await _orphans(ops, image.digest)
            out["lost_detect_s"] = await _lost(ops, lc, f"c{nodes - 1}")
        finally:
            await single.close()
            await ops.close()
    finally:
        lc.close()
    return out


async def _orphans(ops: Any, image: str) -> int:
    """A job whose client stops renewing: paused at expiry, reaped after the grace."""
    say("lease: a job that stops renewing (ttl 2 s, grace 2 s)")
    c = ops.control
    lim = {"max_sandboxes": 8, "max_creates_per_s": 100, "lease_ttl": 2, "grace": 2}
    json.loads(await c.job_open.remote("bench-lease", json.dumps(lim)))
    spec = SandboxSpec(image=image).model_dump_json()
    json.loads(await c.job_create.remote("bench-lease", 4, spec))

    async def reaped() -> bool:
        st = json.loads(await c.job_state.remote("bench-lease"))
        return bool(st.get("ok", {}).get("state") == "reaped")

    await _until(reaped, 60)
    return len(await ops.sandbox_list({"corral.job": "bench-lease"}))


async def _lost(ops: Any, lc: Any, host: str) -> float:
    say(f"node loss: killing the agent of {host}")
    nid = lc.infos[host]["node_id"]
    lc.kill_agent(host)
    t0 = time.monotonic()

    async def lost() -> bool:
        return nid in ops.lost_nodes()

    await _until(lost, 60)
    took = time.monotonic() - t0
    await asyncio.to_thread(lc.start_agent, host)  # back, so close() can clean its node
    return round(took, 2)
