"""Jobs over fake nodes: live cap, create rate in order, groups all-or-nothing, leases."""

from __future__ import annotations

import asyncio

import pytest

from corral.cluster import JOB_LABEL, FleetClient, JobLimits, JobManager, JobNotFound, TokenBucket
from corral.errors import (
    CapacityError,
    Conflict,
    ImageNotFound,
    InvalidRequest,
    JobQuotaExceeded,
)
from corral.spec import SandboxSpec
from corral.testing import FakeNode

SPEC = SandboxSpec(image="demo/base")


class Clock:
    """A clock the test moves; ``sleep`` records each wait and moves nothing."""

    def __init__(self) -> None:
        self.t = 100.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, d: float) -> None:
        self.waits.append(round(d, 6))
        await asyncio.sleep(0)


async def _fleet(n: int = 3, max_sandboxes: int = 0) -> tuple[FleetClient, list[FakeNode]]:
    nodes = [FakeNode(f"n{i}", max_sandboxes=max_sandboxes) for i in range(n)]
    fleet = FleetClient({x.node_id: x for x in nodes}, seed=3)
    await fleet.refresh()
    return fleet, nodes


async def _jobs(
    clock: Clock, n: int = 3, max_sandboxes: int = 0
) -> tuple[JobManager, FleetClient, list[FakeNode]]:
    fleet, nodes = await _fleet(n, max_sandboxes)
    jobs = JobManager(fleet, free_slots=fleet.placer.free_slots, clock=clock, sleep=clock.sleep)
    return jobs, fleet, nodes


async def test_cap_fails_fast_naming_the_limit_and_overshoot() -> None:
    clock = Clock()
    jobs, fleet, _ = await _jobs(clock)
    job = await jobs.open("rl-42", JobLimits(max_sandboxes=3, max_creates_per_s=1000))
    for _ in range(3):
        info = await jobs.create(job, SPEC)
        assert info.spec.labels[JOB_LABEL] == "rl-42"
    with pytest.raises(JobQuotaExceeded, match=r"max_sandboxes 3.*over by 1") as ei:
        await jobs.create(job, SPEC)
    assert ei.value.status == 429
    with pytest.raises(JobQuotaExceeded, match="over by 4"):
        await jobs.create_group(job, 4, SPEC)
    assert len(await fleet.sandbox_list({JOB_LABEL: "rl-42"})) == 3


async def test_zero_quota_and_bad_names_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="max_sandboxes"):
        JobLimits(max_sandboxes=0)
    with pytest.raises(InvalidRequest, match="max_creates_per_s"):
        JobLimits(max_creates_per_s=0)
    jobs, _, _ = await _jobs(Clock())
    with pytest.raises(InvalidRequest, match="job name"):
        await jobs.open("bad name!")
    with pytest.raises(JobNotFound, match="no job 'nope'"):
        await jobs.attach("nope")


async def test_rate_queues_in_order_never_drops() -> None:
    clock = Clock()
    b = TokenBucket(rate=10, burst=2, clock=clock, sleep=clock.sleep)
    await asyncio.gather(*(b.acquire() for _ in range(6)))
    # two go at once (burst), the next four wait 0.1 s apart, in arrival order
    assert clock.waits == [0.1, 0.2, 0.3, 0.4]
    clock.t += 10  # refilled up to the burst, no more
    clock.waits.clear()
    await asyncio.gather(*(b.acquire() for _ in range(3)))
    assert clock.waits == [0.1]


async def test_burst_above_rate_is_all_created() -> None:
    clock = Clock()
    jobs, fleet, nodes = await _jobs(clock)
    job = await jobs.open("burst", JobLimits(max_sandboxes=100, max_creates_per_s=5, burst=5))
    got = await asyncio.gather(*(jobs.create(job, SPEC) for _ in range(30)))
    assert len({i.id for i in got}) == 30 and len(job.live) == 30
    assert len(clock.waits) == 25 and clock.waits == sorted(clock.waits)
    assert await _count(nodes) == 30
    assert {i.node_id for i in got} == {"n0", "n1", "n2"}  # spread over the fleet


async def test_group_all_or_nothing_when_one_create_fails() -> None:
    clock = Clock()
    jobs, fleet, nodes = await _jobs(clock)
    # one node misses the image: creates placed there fail, the rest must be undone
    await nodes[1].image_remove("demo/python")
    job = await jobs.open("grpo", JobLimits(max_sandboxes=64, max_creates_per_s=1000))
    with pytest.raises(ImageNotFound, match=r"group of 12 failed .* made and destroyed again"):
        await jobs.create_group(job, 12, SandboxSpec(image="demo/python"))
    assert [len(await n.sandbox_list()) for n in nodes] == [0, 0, 0]
    assert job.live == set() and job.reserved == 0
    group = await jobs.create_group(job, 12, SPEC)
    assert len(group) == 12 and len(job.live) == 12


async def test_group_larger_than_fleet_fails_at_once_naming_shortfall() -> None:
    clock = Clock()
    jobs, _, nodes = await _jobs(clock, n=2, max_sandboxes=4)
    job = await jobs.open("big", JobLimits(max_sandboxes=1000, max_creates_per_s=1000))
    with pytest.raises(CapacityError, match=r"room for 8 .*short by 2"):
        await jobs.create_group(job, 10, SPEC)
    assert await _count(nodes) == 0


async def test_lease_expiry_pauses_then_reaps_orphans_with_events() -> None:
    clock = Clock()
    jobs, fleet, _ = await _jobs(clock)
    lim = JobLimits(max_sandboxes=10, max_creates_per_s=1000, lease_ttl=30, grace=60)
    job = await jobs.open("rl-1", lim)
    await jobs.create_group(job, 4, SPEC)
    clock.t += 20
    jobs.renew("rl-1")
    clock.t += 20
    await jobs.tick()  # renewed 20 s ago: still alive
    assert {i.state for i in await fleet.sandbox_list({JOB_LABEL: "rl-1"})} == {"running"}
    clock.t += 15
    await jobs.tick()
    assert {i.state for i in await fleet.sandbox_list({JOB_LABEL: "rl-1"})} == {"paused"}
    with pytest.raises(Conflict, match="expired"):
        jobs.renew("rl-1")
    with pytest.raises(Conflict, match="attach"):
        await jobs.create(job, SPEC)
    clock.t += 61
    await jobs.tick()
    assert await fleet.sandbox_list({JOB_LABEL: "rl-1"}) == []
    assert job.orphans == 4
    kinds = [(e.kind, e.detail.get("count")) for e in jobs.events()]
    assert kinds == [("lease_expired", 4), ("orphans", 4)]
    with pytest.raises(Conflict, match="4 sandboxes were destroyed"):
        await jobs.attach("rl-1")


async def test_attach_within_grace_resumes() -> None:
    clock = Clock()
    jobs, fleet, _ = await _jobs(clock)
    job = await jobs.open("rl-2", JobLimits(max_sandboxes=10, lease_ttl=5, grace=60))
    await jobs.create_group(job, 3, SPEC)
    clock.t += 6
    await jobs.tick()
    clock.t += 30
    again = await jobs.open("rl-2")  # a restarted trainer re-opens by name
    assert again is job and job.state == "active"
    assert {i.state for i in await fleet.sandbox_list({JOB_LABEL: "rl-2"})} == {"running"}
    clock.t += 100
    await jobs.tick()  # renewed at attach: paused again only after its ttl, never reaped yet
    assert job.orphans == 0


async def test_refresh_rebuilds_live_set_and_job_pause_spans_nodes() -> None:
    clock = Clock()
    jobs, fleet, nodes = await _jobs(clock)
    job = await jobs.open("rl-3", JobLimits(max_sandboxes=20, max_creates_per_s=1000))
    made = await jobs.create_group(job, 9, SPEC)
    paused = await jobs.pause(job)
    assert len(paused) == 9 and {i.node_id for i in paused} == {"n0", "n1", "n2"}
    assert len(await jobs.resume(job)) == 9
    # a fresh control plane (soft state lost) finds the job's sandboxes again
    jobs2 = JobManager(fleet, clock=clock, sleep=clock.sleep)
    job2 = await jobs2.open("rl-3", JobLimits(max_sandboxes=9))
    assert job2.live == {i.id for i in made}
    with pytest.raises(JobQuotaExceeded):
        await jobs2.create(job2, SPEC)
    assert await jobs2.close("rl-3") == 9
    assert await _count(nodes) == 0


async def _count(nodes: list[FakeNode]) -> int:
    return sum([len(await n.sandbox_list()) for n in nodes])


async def test_restarted_control_plane_rebuilds_jobs_and_still_reaps() -> None:
    clock = Clock()
    jobs, fleet, nodes = await _jobs(clock)
    lim = JobLimits(max_sandboxes=5, max_creates_per_s=50, lease_ttl=10, grace=20)
    job = await jobs.open("rl-9", lim)
    await jobs.create_group(job, 4, SPEC)
    # the control plane dies with its soft state; a new one asks the nodes
    jobs2 = JobManager(fleet, clock=clock, sleep=clock.sleep)
    assert await jobs2.rebuild() == ["rl-9"]
    again = jobs2.get("rl-9")
    assert again.limits == lim and len(again.live) == 4
    with pytest.raises(JobQuotaExceeded, match="over by 1"):
        await jobs2.create_group(again, 2, SPEC)
    clock.t += 11
    await jobs2.tick()
    clock.t += 21
    await jobs2.tick()
    assert await _count(nodes) == 0 and again.orphans == 4
    kinds = [e.kind for e in jobs2.events()]
    assert kinds == ["job_rebuilt", "lease_expired", "orphans"]
