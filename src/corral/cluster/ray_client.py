"""``RayOps``: the SDK's transport for ``corral.AsyncClient("ray://auto")``.

It is a :class:`~corral.cluster.FleetClient` whose nodes are the HTTP APIs of the node
agents found through Ray, so every per-sandbox call goes straight to the sandbox's node.
A plain create is placed by the client itself, one more placer without coordination (as
DSec runs several): it knows the nodes and their reports, and creates straight on the node
it picks, which admits or refuses (a refusal is placed elsewhere). The control-plane actor
places what needs it: a job's creates (the jobs' quotas and leases live there, surviving a
killed trainer), and a create while the on-prem pool is full enough to burst, which may
grow the cloud pool through Ray's autoscaler. The client keeps its own status loop (node loss shows in its ``sandbox_get``/``sandbox_list`` without asking the
control plane) and picks up nodes that join.

``ray://auto`` joins the Ray cluster this host belongs to; ``ray://HOST:PORT`` joins the
one whose GCS listens there. A process that already called ``ray.init`` is used as is.

Example:
    >>> async with corral.AsyncClient("ray://auto") as client:                  # doctest: +SKIP
    ...     async with client.jobs.open("rl-42", max_sandboxes=64) as job:
    ...         group = await job.create_group(8, image="demo/base")
    ...         await group[0].exec(["true"])
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from corral.cluster.fleet import FleetClient
from corral.cluster.jobs import JobLimits
from corral.cluster.ray_actors import CONTROL_NAME, NAMESPACE, REQUEST_LABEL, control_actor
from corral.errors import CapacityError, InvalidRequest, TransportError, error_from_wire
from corral.sdk._sandbox import Sandbox
from corral.spec import Event, SandboxInfo, SandboxSpec

__all__ = ["RayOps", "RemoteJobs", "RemoteJob", "ray_address", "REQUEST_LABEL"]

_CALL_TRIES = 40


def ray_address(target: str) -> str:
    """``ray://auto`` -> ``auto``; ``ray://host:port`` -> ``host:port``."""
    parts = urlsplit(target)
    if parts.scheme != "ray" or not parts.netloc or parts.path not in ("", "/"):
        raise InvalidRequest(
            f"{target!r} is not a cluster target: use ray://auto or ray://HOST:PORT"
        )
    return parts.netloc


def _unwire(raw: str) -> Any:
    body = json.loads(raw)
    if isinstance(body, dict) and "error" in body:
        raise error_from_wire(body)
    return body["ok"] if isinstance(body, dict) and "ok" in body else body


class RayOps(FleetClient):
    """NodeOps over a Ray-hosted corral cluster (see the module docstring)."""

    def __init__(
        self, target: str = "ray://auto", *, interval: float = 1.0, lost_after: float = 5.0
    ) -> None:
        super().__init__({}, lost_after=lost_after, status_timeout=min(2.0, lost_after))
        self._address = ray_address(target)
        self._interval = interval
        self._control: Any = None
        self._loop: asyncio.Task[None] | None = None
        self._owns_ray = False
        self._addresses: dict[str, str] = {}
        self.jobs = RemoteJobs(self)
        """Jobs of the cluster: ``open``, ``attach``."""

    async def connect(self) -> RayOps:
        """Join Ray, find or start the control plane, learn the nodes."""
        try:
            import ray
        except ImportError:
            raise InvalidRequest("ray:// targets need Ray: pip install 'corral[cluster]'") from None
        if not ray.is_initialized():
            ray.init(address=self._address, namespace=NAMESPACE, log_to_driver=False)
            self._owns_ray = True
        self._control = (
            control_actor()
            .options(
                name=CONTROL_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
            )
            .remote()
        )
        await self._control.start.remote()
        await self.sync_nodes()
        await self.refresh()
        self._loop = asyncio.get_running_loop().create_task(self._run())
        return self

    async def sync_nodes(self) -> None:
        """Add the nodes the control plane knows, re-pointing those whose agent moved.

        Also (re)starts the control plane's loop: after Ray restarted the actor it runs
        again from the first client that comes by, rebuilding its nodes and jobs."""
        from corral.sdk._http import HTTPOps

        await self.call("start")
        infos = await self.call("discover")
        for info in infos:
            if self._addresses.get(info["node_id"]) != info["address"]:
                self._addresses[info["node_id"]] = info["address"]
                old = self.add_node(info["node_id"], HTTPOps(info["address"], token=info["token"]))
                if old is not None:
                    await old.close()
        await self._sync_draining()
        # a node the control plane no longer lists was released (an idle cloud node): it
        # left for good, so it must not be reported lost (a dead agent stays listed)
        listed = {i["node_id"] for i in infos}
        for nid in [n for n in self._addresses if n not in listed]:
            del self._addresses[nid]
            gone = self.remove_node(nid)
            if gone is not None:
                await gone.close()

    async def _sync_draining(self) -> None:
        """Take the operator's drains from the control plane (this client places creates
        too, so it must skip a draining node: within one round of the drain)."""
        draining = set(await self.call("draining"))
        for nid in self.node_ids():
            if (nid in draining) != (nid in self.draining_nodes()):
                self.drain(nid, nid in draining)

    async def _run(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(self._interval)
            with contextlib.suppress(Exception):  # next round retries; loss is by silence
                if rounds % 5 == 4:
                    await self.sync_nodes()
                else:
                    await self._sync_draining()
                await self.refresh()
            rounds += 1

    async def call(self, method: str, *args: Any) -> Any:
        """``method`` of the control plane, retried while Ray restarts the actor.

        Creates carry a request key (the label ``corral.request``) that a retry finds
        instead of creating again, even on a restarted control plane; the other calls are
        harmless to repeat (a repeated close answers JobNotFound)."""
        import ray

        for attempt in range(_CALL_TRIES):
            try:
                return await getattr(self.control, method).remote(*args)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError) as exc:
                if attempt == _CALL_TRIES - 1:
                    raise TransportError(
                        f"the corral control plane did not answer {method} "
                        f"({type(exc).__name__}) after {_CALL_TRIES} tries"
                    ) from exc
                await asyncio.sleep(0.25)
        raise AssertionError("unreachable")

    @property
    def control(self) -> Any:
        """The control-plane actor handle."""
        if self._control is None:
            raise TransportError("this cluster client is not connected")
        return self._control

    async def sandbox_create(self, spec: SandboxSpec) -> SandboxInfo:
        """Placed here while the on-prem pool has room (see the module doc); through the
        control plane when bursting, or when no node here would take it."""
        if self.node_ids():
            if not self.placer.bursting():
                try:
                    return await super().sandbox_create(spec)
                except CapacityError:
                    pass  # full as far as this client knows: the control plane may burst
            # the control plane has not seen this client's placements: it asks the nodes
            # first, so that it bursts from the fill this client saw
            await self.call("refresh")
        info = SandboxInfo.model_validate_json(
            _checked(await self.call("sandbox_create", _keyed(spec).model_dump_json()))
        )
        return (await self.learn([info]))[0]

    async def learn(self, infos: list[SandboxInfo]) -> list[SandboxInfo]:
        """Remember sandboxes the control plane made; one on a node this client does not
        know yet (a cloud node the autoscaler just added) makes it look for nodes now."""
        known = set(self.node_ids())
        if any(i.node_id not in known for i in infos):
            await self.sync_nodes()
        return self._remember(infos)

    async def _control_events(
        self, position: int, kinds: list[str] | None, labels: dict[str, str] | None, limit: int
    ) -> list[Event]:
        raw = await self.call("events", position, kinds, labels, limit)
        return [Event.model_validate(e) for e in json.loads(raw)]

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
            self._loop = None
        await super().close()
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False


def _keyed(spec: SandboxSpec) -> SandboxSpec:
    """``spec`` with a fresh request key (see :data:`REQUEST_LABEL`)."""
    labels = {**spec.labels, REQUEST_LABEL: secrets.token_hex(8)}
    return spec.model_copy(update={"labels": labels})


def _checked(raw: str) -> str:
    body = json.loads(raw)
    if isinstance(body, dict) and "error" in body:
        raise error_from_wire(body)
    return raw


class RemoteJobs:
    """``client.jobs``: jobs held by the control plane."""

    def __init__(self, ops: RayOps) -> None:
        self._ops = ops

    def open(
        self,
        name: str,
        *,
        max_sandboxes: int = 1024,
        max_creates_per_s: float = 100.0,
        burst: int = 0,
        lease_ttl: float = 30.0,
        grace: float = 300.0,
    ) -> RemoteJob:
        """A job, used as ``async with``: opened on entry, its lease renewed while inside,
        and on a clean exit closed (its sandboxes destroyed). If this process dies inside,
        the lease lapses: the job's sandboxes are paused, then destroyed after ``grace``
        unless :meth:`attach` takes the job back."""
        lim = JobLimits(max_sandboxes, max_creates_per_s, burst, lease_ttl, grace)
        return RemoteJob(self._ops, name, lim, attach=False)

    def attach(self, name: str) -> RemoteJob:
        """Take back a job whose client died (resumes its sandboxes if paused)."""
        return RemoteJob(self._ops, name, None, attach=True)

    async def events(self, after: int = 0) -> list[Event]:
        """Control-plane events after id ``after`` only (``lease_expired``, ``orphans``,
        ``job_attached``, node and autoscale events); ``client.events()`` merges them
        with every node's events under one cursor."""
        raw = await self._ops.call("events", after)
        return [Event.model_validate(e) for e in json.loads(raw)]

    async def state(self, name: str) -> dict[str, Any]:
        return dict(_unwire(await self._ops.call("job_state", name)))


class RemoteJob:
    """One job of the control plane; see :meth:`RemoteJobs.open`."""

    def __init__(self, ops: RayOps, name: str, limits: JobLimits | None, *, attach: bool) -> None:
        self._ops, self._limits, self._attach = ops, limits, attach
        self.name: str = name
        """The job's name."""
        self._renew: asyncio.Task[None] | None = None
        self.close_on_exit: bool = not attach
        """Destroy the job's sandboxes when the ``async with`` block ends cleanly."""

    async def __aenter__(self) -> RemoteJob:
        if self._attach:
            _unwire(await self._ops.call("job_attach", self.name))
        else:
            assert self._limits is not None
            lim = self._limits
            raw = json.dumps(
                {
                    "max_sandboxes": lim.max_sandboxes,
                    "max_creates_per_s": lim.max_creates_per_s,
                    "burst": lim.burst,
                    "lease_ttl": lim.lease_ttl,
                    "grace": lim.grace,
                }
            )
            _unwire(await self._ops.call("job_open", self.name, raw))
        ttl = (
            self._limits.lease_ttl
            if self._limits
            else float((await self._ops.jobs.state(self.name))["lease_ttl"])
        )
        self._renew = asyncio.get_running_loop().create_task(self._renewing(ttl / 3))
        return self

    async def _renewing(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(Exception):  # a missed renewal is retried; ttl covers 3
                _unwire(await self._ops.call("job_renew", self.name))

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._renew is not None:
            self._renew.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renew
        if et is None and self.close_on_exit:
            _unwire(await self._ops.call("job_close", self.name))

    async def create(self, image: str, **fields: Any) -> Sandbox:
        return (await self.create_group(1, image, **fields))[0]

    async def create_group(self, n: int, image: str, **fields: Any) -> list[Sandbox]:
        """n sandboxes of ``SandboxSpec(image=image, **fields)``, all or none."""
        spec = SandboxSpec.model_validate({"image": image, **fields})
        got = _unwire(
            await self._ops.call("job_create", self.name, n, _keyed(spec).model_dump_json())
        )
        infos = await self._ops.learn([SandboxInfo.model_validate(i) for i in got])
        return [Sandbox._wrap(self._ops, i) for i in infos]

    async def pause(self) -> list[SandboxInfo]:
        got = _unwire(await self._ops.call("job_pause", self.name, False))
        return [SandboxInfo.model_validate(i) for i in got]

    async def resume(self) -> list[SandboxInfo]:
        got = _unwire(await self._ops.call("job_pause", self.name, True))
        return [SandboxInfo.model_validate(i) for i in got]

    async def sandboxes(self) -> list[SandboxInfo]:
        return await self._ops.sandbox_list({"corral.job": self.name})
