"""Jobs: quotas, back-pressure, groups and leases on top of any :class:`~corral.ops.NodeOps`.

A job (an RL run, an eval) names a set of sandboxes, labelled ``corral.job=<name>``, and
carries its limits:

- **Live cap** (``max_sandboxes``): a create that would take the job past it fails at once
  with :class:`~corral.errors.JobQuotaExceeded` saying by how much (HTTP 429). Failing fast,
  not queueing, is deliberate: a cap is reached only by a job that forgot to destroy, and a
  queue would hide that until it timed out.
- **Create rate** (``max_creates_per_s``, a token bucket with ``burst``): creates above the
  rate wait in arrival order, so a 32K burst is accepted and drained at the fleet's pace,
  never dropped.
- **Groups** (:meth:`JobManager.create_group`): n sandboxes, all or none. The cap and the
  fleet's known free room are checked for all n before any is made (a group larger than
  either fails at once, naming the shortfall); if one create fails, those made are
  destroyed before the error is raised.
- **Lease** (``lease_ttl``): the client renews it while it lives. When it lapses (trainer
  killed, network cut) :meth:`JobManager.tick` pauses all of the job's sandboxes at once;
  after ``grace`` more seconds without :meth:`JobManager.attach` it destroys them. Both
  steps are counted and reported as control-plane events (``lease_expired``, ``orphans``).

The manager holds only soft state: a job's live set is rebuilt from ``sandbox_list`` by
label (:meth:`JobManager.refresh`), so a restarted control plane loses no sandbox. Time
comes from an injected clock and sleep, so tests drive it without waiting.

Example:
    >>> jobs = JobManager(FakeNode())                                 # doctest: +SKIP
    >>> job = await jobs.open("rl-42", JobLimits(max_sandboxes=8))    # doctest: +SKIP
    >>> group = await jobs.create_group(job, 8, SandboxSpec(image="demo/base"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from corral.cluster.events import ControlEvents
from corral.errors import (
    CapacityError,
    Conflict,
    CorralError,
    InvalidRequest,
    JobNotFound,
    JobQuotaExceeded,
    SandboxNotFound,
)
from corral.ops import NodeOps
from corral.spec import Event, SandboxInfo, SandboxSpec

__all__ = [
    "JOB_LABEL",
    "LIMITS_LABEL",
    "JobLimits",
    "Job",
    "JobManager",
    "TokenBucket",
    "JobNotFound",
]

JOB_LABEL = "corral.job"
"""The label that ties a sandbox to its job."""
LIMITS_LABEL = "corral.job.limits"
"""The job's limits, carried by each of its sandboxes (``max=..,rate=..,burst=..,ttl=..,
grace=..``), so a restarted control plane rebuilds the job from the nodes alone."""
_JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class JobLimits:
    """A job's quotas and lease. Zero is refused: a job that may hold nothing is a mistake."""

    max_sandboxes: int = 1024
    """Hard cap on live sandboxes of the job."""
    max_creates_per_s: float = 100.0
    """Sustained create rate; creates above it wait in order."""
    burst: int = 0
    """Creates allowed at once before the rate applies (0: one second's worth)."""
    lease_ttl: float = 30.0
    """Seconds a lease lasts without renewal."""
    grace: float = 300.0
    """Seconds the job's sandboxes stay paused after the lease lapses, before destruction."""

    def to_label(self) -> str:
        return (
            f"max={self.max_sandboxes},rate={self.max_creates_per_s:g},burst={self.burst},"
            f"ttl={self.lease_ttl:g},grace={self.grace:g}"
        )

    @classmethod
    def from_label(cls, text: str) -> JobLimits:
        """Limits from :meth:`to_label`'s text; defaults for a label that is not one."""
        try:
            kv = dict(part.split("=", 1) for part in text.split(","))
            return cls(
                max_sandboxes=int(kv["max"]),
                max_creates_per_s=float(kv["rate"]),
                burst=int(kv["burst"]),
                lease_ttl=float(kv["ttl"]),
                grace=float(kv["grace"]),
            )
        except (KeyError, ValueError, InvalidRequest):
            return cls()

    def __post_init__(self) -> None:
        for name in ("max_sandboxes", "max_creates_per_s", "lease_ttl"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise InvalidRequest(
                    f"{name}: {v!r} must be a positive number (a quota of zero "
                    "would refuse every create; destroy the job instead)"
                )
        if self.grace < 0 or self.burst < 0:
            raise InvalidRequest("grace and burst cannot be negative")


class TokenBucket:
    """A create-rate limit whose waiters are served strictly in arrival order.

    Each ``acquire`` reserves the next free slot (``burst`` tokens refill at ``rate`` per
    second) and sleeps until it; a reservation is taken before sleeping, so order is kept
    without a queue object and a cancelled waiter gives its slot back."""

    def __init__(self, rate: float, burst: int, clock: Clock, sleep: Sleep) -> None:
        self.rate = rate
        self.burst = max(1, burst or math.ceil(rate))
        self._clock, self._sleep = clock, sleep
        self._tokens = float(self.burst)
        self._stamp = clock()
        self._waiting = 0

    def _refill(self, now: float) -> None:
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def wait_time(self) -> float:
        """Seconds until a create asked now would start."""
        self._refill(self._clock())
        return max(0.0, (1.0 - self._tokens) / self.rate)

    @property
    def waiting(self) -> int:
        return self._waiting

    async def acquire(self) -> None:
        self._refill(self._clock())
        self._tokens -= 1.0  # reserve: later callers queue behind this one
        if self._tokens >= 0:
            return
        delay = -self._tokens / self.rate
        self._waiting += 1
        try:
            await self._sleep(delay)
        except BaseException:
            self._tokens += 1.0
            raise
        finally:
            self._waiting -= 1


@dataclass(eq=False)
class Job:
    """One job's soft state in the control plane."""

    name: str
    limits: JobLimits
    bucket: TokenBucket
    lease_until: float
    live: set[str] = field(default_factory=set)
    reserved: int = 0
    """Creates admitted under the cap and not finished yet."""
    state: Literal["active", "expired", "reaped"] = "active"
    """``expired``: lease lapsed, sandboxes paused; ``reaped``: they were destroyed."""
    expired_at: float | None = None
    orphans: int = 0
    """Sandboxes destroyed because the lease lapsed."""

    @property
    def labels(self) -> dict[str, str]:
        return {JOB_LABEL: self.name}


class JobManager:
    """Jobs over a fleet (``ops``: a cluster client, or one node).

    ``free_slots(spec)``, when given, says how many more sandboxes the fleet can take; a
    group larger than that fails at once instead of half-creating."""

    def __init__(
        self,
        ops: NodeOps,
        *,
        free_slots: Callable[[SandboxSpec], int] | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        events: ControlEvents | None = None,
    ) -> None:
        self._ops = ops
        self._free_slots = free_slots
        self._clock, self._sleep = clock, sleep
        self._jobs: dict[str, Job] = {}
        self.log = events or ControlEvents()
        """Where job events go (the control plane shares it with the fleet's events)."""

    # ------------------------------------------------------------------ jobs
    async def open(self, name: str, limits: JobLimits | None = None) -> Job:
        """Start a job (its lease from now), or re-attach to one of that name."""
        if not isinstance(name, str) or not _JOB_NAME_RE.fullmatch(name):
            raise InvalidRequest(
                f"job name {str(name)[:70]!r} must be 1-63 of [A-Za-z0-9._-], starting with a "
                "letter or digit"
            )
        if name in self._jobs:
            return await self.attach(name)
        lim = limits or JobLimits()
        job = Job(
            name=name,
            limits=lim,
            bucket=TokenBucket(lim.max_creates_per_s, lim.burst, self._clock, self._sleep),
            lease_until=self._clock() + lim.lease_ttl,
        )
        self._jobs[name] = job
        await self._recount(job)
        return job

    def get(self, name: str) -> Job:
        try:
            return self._jobs[name]
        except KeyError:
            known = ", ".join(sorted(self._jobs)[:10]) or "none"
            raise JobNotFound(f"no job {name!r} (jobs: {known})") from None

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def renew(self, name: str) -> float:
        """Extend the lease of an active job; returns its new end (clock seconds)."""
        job = self.get(name)
        if job.state != "active":
            raise Conflict(
                f"the lease of job {name!r} has expired ({job.state}); attach to it again "
                "(jobs.attach) to resume its sandboxes"
            )
        job.lease_until = self._clock() + job.limits.lease_ttl
        return job.lease_until

    async def attach(self, name: str) -> Job:
        """Take a job back: renew its lease, and resume its sandboxes if the lease had lapsed.

        Conflict if they were already destroyed (the grace period passed)."""
        job = self.get(name)
        if job.state == "reaped":
            raise Conflict(
                f"job {name!r} lost its lease and its {job.orphans} sandboxes were destroyed "
                f"after the {job.limits.grace:g} s grace; open a new job"
            )
        if job.state == "expired":
            await self._ops.sandboxes_resume(job.labels)
            job.state, job.expired_at = "active", None
            self._event(job, "job_attached")
        job.lease_until = self._clock() + job.limits.lease_ttl
        return job

    async def refresh(self, name: str) -> Job:
        """Rebuild the job's live set from the fleet (after a restart, or TTL reaping)."""
        job = self.get(name)
        await self._recount(job)
        return job

    async def _recount(self, job: Job) -> None:
        job.live = {i.id for i in await self._ops.sandbox_list(job.labels)}

    # ------------------------------------------------------------------ creates
    async def create(self, job: Job, spec: SandboxSpec) -> SandboxInfo:
        """One sandbox for the job: fail fast above the cap, wait in order above the rate."""
        self._admit(job, 1)
        job.reserved += 1
        try:
            await job.bucket.acquire()
            self._need_active(job)
            info = await self._ops.sandbox_create(self._labelled(job, spec))
        finally:
            job.reserved -= 1
        job.live.add(info.id)
        return info

    async def create_group(self, job: Job, n: int, spec: SandboxSpec) -> list[SandboxInfo]:
        """n sandboxes, all or none (a GRPO group): on any failure those made are destroyed
        and the first error is raised."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidRequest(f"group size {n!r} must be a whole number of at least 1")
        self._admit(job, n)
        if self._free_slots is not None:
            free = self._free_slots(spec)
            if free < n:
                raise CapacityError(
                    f"a group of {n} does not fit: the fleet has room for {free} more "
                    f"sandboxes of this kind (short by {n - free})"
                )
        job.reserved += n
        try:
            results = await asyncio.gather(
                *(self._one(job, spec) for _ in range(n)), return_exceptions=True
            )
        finally:
            job.reserved -= n
        made = [r for r in results if isinstance(r, SandboxInfo)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self._undo([i.id for i in made])
            err = errors[0]
            if isinstance(err, CorralError):
                raise type(err)(
                    f"group of {n} failed ({len(errors)} creates failed, {len(made)} made "
                    f"and destroyed again): {err.message}"
                ) from err
            raise err
        job.live.update(i.id for i in made)
        return made

    async def _one(self, job: Job, spec: SandboxSpec) -> SandboxInfo:
        await job.bucket.acquire()
        self._need_active(job)
        return await self._ops.sandbox_create(self._labelled(job, spec))

    async def _undo(self, ids: list[str]) -> None:
        async def gone(sid: str) -> None:
            try:
                await self._ops.sandbox_destroy(sid)
            except SandboxNotFound:
                pass

        await asyncio.gather(*(gone(i) for i in ids), return_exceptions=True)

    async def destroy(self, job: Job, sandbox_id: str) -> None:
        await self._ops.sandbox_destroy(sandbox_id)
        job.live.discard(sandbox_id)

    def _admit(self, job: Job, n: int) -> None:
        self._need_active(job)
        have = len(job.live) + job.reserved
        cap = job.limits.max_sandboxes
        if have + n > cap:
            raise JobQuotaExceeded(
                f"job {job.name!r} is at its live cap: max_sandboxes {cap}, {len(job.live)} "
                f"live + {job.reserved} being created + {n} asked is over by "
                f"{have + n - cap}; destroy sandboxes of the job or raise its cap",
                retry_after=None,
            )

    def _need_active(self, job: Job) -> None:
        if job.state != "active":
            raise Conflict(
                f"the lease of job {job.name!r} has expired ({job.state}): attach to it "
                "before creating"
            )

    @staticmethod
    def _labelled(job: Job, spec: SandboxSpec) -> SandboxSpec:
        labels = {**spec.labels, JOB_LABEL: job.name, LIMITS_LABEL: job.limits.to_label()}
        return spec.model_copy(update={"labels": labels})

    async def rebuild(self) -> list[str]:
        """Take up the jobs whose sandboxes the fleet holds and this manager does not know
        (a restarted control plane): limits from their label, a fresh lease. A job whose
        client is gone then lapses and is reaped like any other. Returns the names."""
        found: dict[str, str] = {}
        for info in await self._ops.sandbox_list():
            name = info.spec.labels.get(JOB_LABEL)
            if name and name not in self._jobs and _JOB_NAME_RE.fullmatch(name):
                found.setdefault(name, info.spec.labels.get(LIMITS_LABEL, ""))
        for name, text in found.items():
            lim = JobLimits.from_label(text)
            job = Job(
                name=name,
                limits=lim,
                bucket=TokenBucket(lim.max_creates_per_s, lim.burst, self._clock, self._sleep),
                lease_until=self._clock() + lim.lease_ttl,
            )
            self._jobs[name] = job
            await self._recount(job)
            self._event(job, "job_rebuilt", count=len(job.live))
        return sorted(found)

    # ------------------------------------------------------------------ job-wide
    async def pause(self, job: Job) -> list[SandboxInfo]:
        return await self._ops.sandboxes_pause(job.labels)

    async def resume(self, job: Job) -> list[SandboxInfo]:
        return await self._ops.sandboxes_resume(job.labels)

    async def close(self, name: str) -> int:
        """End a job: destroy its sandboxes and forget it; returns how many were destroyed."""
        job = self.get(name)
        await self._recount(job)
        ids = list(job.live)
        await self._undo(ids)
        del self._jobs[name]
        return len(ids)

    # ------------------------------------------------------------------ leases
    async def tick(self) -> None:
        """Act on lapsed leases: pause at expiry, destroy after the grace. Call it often
        (the cluster's control loop does, about once a second)."""
        now = self._clock()
        for job in list(self._jobs.values()):
            if job.state == "active" and now >= job.lease_until:
                job.state, job.expired_at = "expired", now
                paused = await self._ops.sandboxes_pause(job.labels)
                self._event(job, "lease_expired", count=len(paused))
            elif (
                job.state == "expired"
                and job.expired_at is not None
                and now >= job.expired_at + job.limits.grace
            ):
                await self._recount(job)
                ids = list(job.live)
                await self._undo(ids)
                job.orphans += len(ids)
                job.live.clear()
                job.state = "reaped"
                self._event(job, "orphans", count=len(ids))

    # ------------------------------------------------------------------ events
    def events(self, after: int = 0) -> list[Event]:
        """Control-plane events after id ``after``: the job ones (``lease_expired``,
        ``orphans``, ``job_attached``, ``job_rebuilt``) name their job in
        ``detail["job"]``; the log may also hold node and autoscale events."""
        return self.log.after(after)

    def _event(self, job: Job, kind: str, **detail: int) -> None:
        self.log.add(kind, job=job.name, **detail)
