"""``corral bench cluster``: the same work through the cluster client and straight at one node.

A local Ray cluster of ``nodes`` Ray nodes on this machine hosts one real corral node each
(:class:`corral.cluster.local.LocalRayCluster`). In the same run:

- **cluster**: ``count`` creates at ``concurrency`` through ``RayOps`` (placed by the
  control plane over all nodes), then exec ``true`` one after another, then destroys;
- **single_node**: the same against the first node's HTTP API directly;
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


async def _work(ops: NodeOps, image: str, count: int, concurrency: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    made: list[SandboxInfo] = []

    async def one() -> None:
        async with sem:
            t = time.perf_counter()
            made.append(await ops.sandbox_create(SandboxSpec(image=image, labels={"b": "c"})))
            lat.append(time.perf_counter() - t)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(count)))
        wall = time.perf_counter() - t0
        ex: list[float] = []
        for i in range(min(_EXECS, len(made))):
            t = time.perf_counter()
            await ops.exec(made[i].id, ExecRequest(cmd=["true"]))
            ex.append(time.perf_counter() - t)
    finally:

        async def gone(sid: str) -> None:
            async with sem:
                await ops.sandbox_destroy(sid)

        await asyncio.gather(*(gone(i.id) for i in made), return_exceptions=True)
    return {
        "count": count,
        "create_per_s": round(count / wall, 2),
        "create_p50_ms": round(p50(lat) * 1000, 2),
        "create_p99_ms": round(p99(lat) * 1000, 2),
        "exec_p50_ms": round(p50(ex) * 1000, 2),
        "exec_p99_ms": round(p99(ex) * 1000, 2),
        "nodes_used": len({i.node_id for i in made}),
    }


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
            say(f"cluster: {count} creates at concurrency {concurrency}")
            out["cluster"] = await _work(ops, image.digest, count, concurrency)
            say(f"single node: {count} creates at concurrency {concurrency}")
            out["single_node"] = await _work(single, image.digest, count, concurrency)
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
