"""The cluster on a real local Ray cluster with three real corral nodes."""

from __future__ import annotations

import asyncio
import time

import pytest

import corral
from corral.cluster.local import LocalRayCluster
from corral.cluster.ray_client import RayOps
from corral.errors import Conflict, InvalidRequest, JobQuotaExceeded
from corral.spec import ExecRequest, SandboxSpec

IMAGE = "test/busybox"


async def _until(what: str, check: object, deadline: float = 30.0) -> float:
    """Poll ``check()`` (async, truthy when done) until it holds; the seconds it took."""
    t0 = time.monotonic()
    while not await check():  # type: ignore[operator]
        if time.monotonic() - t0 > deadline:
            raise AssertionError(f"{what}: not within {deadline} s")
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


async def test_placement_routing_groups_and_job_pause(raycorral: LocalRayCluster) -> None:
    async with corral.AsyncClient("ray://auto") as client:
        ops = client._ops
        assert isinstance(ops, RayOps) and len(ops.node_ids()) == 3
        async with client.jobs.open("rl-t1", max_sandboxes=6, max_creates_per_s=50) as job:
            group = await job.create_group(6, IMAGE, qos="latency")
            assert len({sb.info.node_id for sb in group}) >= 2  # spread over nodes
            for sb in group:
                r = await sb.exec(["sh", "-c", "echo $((6*7))"])
                assert r.stdout == b"42\n"
            with pytest.raises(JobQuotaExceeded, match="over by 1"):
                await job.create(IMAGE, qos="latency")
            paused = await job.pause()
            assert len(paused) == 6 and {i.state for i in paused} == {"paused"}
            assert len(await job.resume()) == 6
        # a clean exit closed the job: its sandboxes are gone on every node
        assert await client.sandboxes.list(labels={"corral.job": "rl-t1"}) == []


async def test_rate_back_pressure_queues_creates(raycorral: LocalRayCluster) -> None:
    """Above its rate a job's creates wait their turn (none refused): 5 at 4/s with a burst
    of 1 cannot all be made in under a second. A lower bound only, which slowness cannot
    break."""
    async with corral.AsyncClient("ray://auto") as client:
        async with client.jobs.open(
            "rl-rate", max_sandboxes=8, max_creates_per_s=4, burst=1
        ) as job:
            t0 = time.monotonic()
            group = await job.create_group(5, IMAGE, qos="latency")
            took = time.monotonic() - t0
            assert len(group) == 5
            assert took >= 0.95, took  # 4 refills at 4/s after the first token


async def test_group_all_or_nothing_with_a_failing_node(raycorral: LocalRayCluster) -> None:
    async with corral.AsyncClient("ray://auto") as client:
        # node c2 does not know the permission "pkgs": creates placed there fail
        async with client.jobs.open("rl-t2", max_sandboxes=30, max_creates_per_s=100) as job:
            # 24 spread by load over 3 nodes: some land on c2 (and fail), some elsewhere
            with pytest.raises(InvalidRequest, match=r"[1-9][0-9]* made and destroyed again"):
                await job.create_group(24, IMAGE, qos="latency", network={"allow": ["pkgs"]})
            assert await job.sandboxes() == []
            group = await job.create_group(9, IMAGE, qos="latency")
            assert len(group) == 9


@pytest.mark.heavy
async def test_node_loss_reported_and_recovered(raycorral: LocalRayCluster) -> None:
    async with corral.AsyncClient("ray://auto") as client:
        ops = client._ops
        assert isinstance(ops, RayOps)
        on_c2 = SandboxSpec(image=IMAGE, qos="latency", labels={"corral.node/host": "c2"})
        made = [await ops.sandbox_create(on_c2) for _ in range(3)]
        made += [
            await ops.sandbox_create(SandboxSpec(image=IMAGE, qos="latency")) for _ in range(3)
        ]
        by_node = {i.node_id for i in made}
        victim = raycorral.agents["c2"]
        info = await victim.info.remote()
        mine = [i for i in made if i.node_id == info["node_id"]]
        assert mine, by_node
        t0 = time.monotonic()
        raycorral.kill_agent("c2")

        async def lost() -> bool:
            return info["node_id"] in ops.lost_nodes()

        await _until("node reported lost", lost)
        took = time.monotonic() - t0
        print(f"node loss reported after {took:.1f} s")
        got = await ops.sandbox_get(mine[0].id)
        assert got.state == "lost"
        for _ in range(4):
            assert (
                await ops.sandbox_create(SandboxSpec(image=IMAGE, qos="latency"))
            ).node_id != info["node_id"]
        # the agent comes back on its host: the node reconciles, its sandboxes survive
        again = await asyncio.to_thread(raycorral.start_agent, "c2")
        assert again["node_id"] == info["node_id"]

        async def back() -> bool:
            return info["node_id"] not in ops.lost_nodes()

        await _until("node back", back)
        got = await ops.sandbox_get(mine[0].id)
        assert got.state == "running"
        r = await ops.exec(mine[0].id, ExecRequest(cmd=["echo", "alive"]))
        assert r.stdout == b"alive\n"

        # the control plane's node_lost/node_back come through the fleet-wide event stream
        # (the control plane sees the agent back on its own rounds, a little after us)
        async def both() -> bool:
            evs = await client.events(kinds=["node_lost", "node_back"])
            assert {e.node_id for e in evs} <= {"cluster"}
            kinds = [e.kind for e in evs if e.detail.get("node") == info["node_id"]]
            return kinds[-2:] == ["node_lost", "node_back"]

        await _until("node_lost and node_back in client.events()", both)
        for i in await ops.sandbox_list():
            await ops.sandbox_destroy(i.id)


_TRAINER = r"""
import asyncio, json, sys
import ray
import corral

async def main():
    ray.init(address=sys.argv[1], namespace="corral", log_to_driver=False)
    async with corral.AsyncClient("ray://auto") as client:
        name, grace = sys.argv[2], float(sys.argv[3])
        job = client.jobs.open(name, max_sandboxes=8, lease_ttl=3, grace=grace)
        await job.__aenter__()
        group = await job.create_group(3, "test/busybox", qos="latency")
        await group[0].exec(["sh", "-c", "echo kept > /tmp/state"])  # state to find again
        print(json.dumps([sb.id for sb in group]), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main())
"""


@pytest.mark.heavy
async def test_lease_expiry_after_client_sigkill(raycorral: LocalRayCluster) -> None:
    ids = await _trainer_killed(raycorral, "rl-kill", grace=4)  # dies without a word
    assert len(ids) == 3
    async with corral.AsyncClient("ray://auto") as client:
        ops = client._ops
        assert isinstance(ops, RayOps)

        async def states() -> set[str]:
            return {(await ops.sandbox_get(i)).state for i in ids}

        async def paused() -> bool:
            return await states() == {"paused"}

        async def gone() -> bool:
            return await client.sandboxes.list(labels={"corral.job": "rl-kill"}) == []

        await _until("job paused after the lease lapsed", paused)
        await _until("orphans destroyed after the grace", gone)
        events = [e for e in await client.jobs.events() if e.detail.get("job") == "rl-kill"]
        assert [(e.kind, e.detail.get("count")) for e in events] == [
            ("lease_expired", 3),
            ("orphans", 3),
        ]
        state = await client.jobs.state("rl-kill")
        assert state["state"] == "reaped" and state["orphans"] == 3
        with pytest.raises(Conflict, match="destroyed"):
            async with client.jobs.attach("rl-kill"):
                pass


async def _trainer_killed(raycorral: LocalRayCluster, job: str, grace: float) -> list[str]:
    """Run a trainer process that opens ``job`` (lease 3 s) with 3 sandboxes, then SIGKILL
    it; the ids it made."""
    import json
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, raycorral.address, job, str(grace)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        assert proc.stdout is not None
        ids: list[str] = json.loads(await asyncio.to_thread(proc.stdout.readline))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
    return ids


@pytest.mark.heavy
async def test_restarted_client_attaches_and_gets_its_sandboxes_back(
    raycorral: LocalRayCluster,
) -> None:
    """A trainer killed -9 and started again within the grace takes its job back: the
    sandboxes its lease lapse paused run again, with their state, and the job is its own."""
    ids = await _trainer_killed(raycorral, "rl-back", grace=300)
    assert len(ids) == 3
    async with corral.AsyncClient("ray://auto") as client:
        ops = client._ops
        assert isinstance(ops, RayOps)

        async def paused() -> bool:
            return {(await ops.sandbox_get(i)).state for i in ids} == {"paused"}

        await _until("job paused after the lease lapsed", paused)
        async with client.jobs.attach("rl-back") as job:
            assert {(await ops.sandbox_get(i)).state for i in ids} == {"running"}
            r = await ops.exec(ids[0], ExecRequest(cmd=["cat", "/tmp/state"]))
            assert r.stdout == b"kept\n"
            assert sorted(sb.id for sb in await job.sandboxes()) == sorted(ids)
            job.close_on_exit = True  # this client now owns the job: a clean exit ends it
        kinds = [e.kind for e in await client.jobs.events() if e.detail.get("job") == "rl-back"]
        assert kinds[:2] == ["lease_expired", "job_attached"]
        assert await client.sandboxes.list(labels={"corral.job": "rl-back"}) == []


@pytest.mark.heavy
async def test_control_plane_restart_rebuilds_nodes_and_jobs(raycorral: LocalRayCluster) -> None:
    import ray

    from corral.cluster.ray_actors import CONTROL_NAME, NAMESPACE

    async with corral.AsyncClient("ray://auto") as client:
        async with client.jobs.open("rl-cp", max_sandboxes=3, lease_ttl=30) as job:
            await job.create_group(2, IMAGE, qos="latency")
            ray.kill(ray.get_actor(CONTROL_NAME, namespace=NAMESPACE), no_restart=False)

            async def rebuilt() -> bool:
                # ray.kill returns before the old actor is gone, and the old one still
                # knows the job: only the new one says job_rebuilt (its own events)
                try:
                    evs = await client.jobs.events()
                    if not any(
                        e.kind == "job_rebuilt" and e.detail.get("job") == "rl-cp" for e in evs
                    ):
                        return False
                    st = await client.jobs.state("rl-cp")
                except Exception:
                    return False
                return bool(st["live"] == 2)

            await _until("job rebuilt by the restarted control plane", rebuilt)
            with pytest.raises(JobQuotaExceeded, match="max_sandboxes 3"):
                await job.create_group(2, IMAGE, qos="latency")
            assert len(await job.sandboxes()) == 2
