"""``AsyncClient``: the entry point of the SDK.

The client only chooses a transport (a ``NodeOps``) and builds handles; every sandbox
operation is a method of a handle (see ``_sandbox.py``) and one call on the ``NodeOps``.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from corral.errors import CorralError, InvalidRequest
from corral.ops import NodeOps
from corral.sdk._fncall import FnCall
from corral.sdk._sandbox import Sandbox, invalid_request
from corral.sdk._stats import fetch_stats
from corral.spec import (
    Desktop,
    Event,
    EventSummary,
    ImageInfo,
    LayerInfo,
    Limits,
    NetworkPolicy,
    NodeStatus,
    SandboxSpec,
    Stats,
)

if TYPE_CHECKING:
    from corral.cluster.ray_client import RemoteJobs
    from corral.node import NodeConfig

__all__ = ["AsyncClient", "Images", "Sandboxes"]


class AsyncClient:
    """Asynchronous client of one corral node.

    ``target``: None runs an embedded node in this process (opened on first use);
    ``"unix:///run/corral/api.sock"`` or ``"http://host:8700"`` talks to a node's API;
    ``"ray://auto"`` to a corral cluster on Ray (``corral[cluster]``), where
    ``client.jobs`` also exists.
    ``ops`` injects any ``NodeOps`` (tests pass ``corral.testing.FakeNode()``).

    Example:
        >>> async with corral.AsyncClient() as client:                       # doctest: +SKIP
        ...     sb = await client.sandboxes.create(image="demo/python", ttl=600)
        ...     print((await sb.exec(["python", "-c", "print(1+1)"])).stdout)

    ``close()`` closes what the client opened (the embedded node, HTTP connections), and an
    injected ``ops`` only if ``own_ops=True``.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        config: NodeConfig | None = None,
        ops: NodeOps | None = None,
        own_ops: bool = False,
    ) -> None:
        if ops is not None and (target is not None or config is not None):
            raise InvalidRequest("pass either ops= or target/config=, not both")
        if target is not None and config is not None:
            raise InvalidRequest("config= configures the embedded node; a target has its own")
        if target is None and token is not None:
            raise InvalidRequest("token= is for a node's API; the embedded node needs none")
        if target is not None and not target.startswith("ray://"):
            from corral.sdk._http import parse_target

            parse_target(target)  # fail here, not at first use, on a malformed target
        self._target, self._token, self._config = target, token, config
        self._ops: NodeOps | None = ops
        self._owns_ops = ops is None or own_ops
        self._where = target or ("embedded" if ops is None else repr(ops))
        self._lock = asyncio.Lock()
        self._closed = False
        self.images = Images(self)
        """Images of the node's store."""
        self.sandboxes = Sandboxes(self)
        """Create, find and list sandboxes."""
        self.fncall = FnCall(self)
        """Short calls in warm pools: ``run``, ``judge``, ``map``."""

    def __repr__(self) -> str:
        return f"AsyncClient({self._where!r})"

    @property
    def jobs(self) -> RemoteJobs:
        """Jobs (quotas, groups, leases) of a cluster target (``ray://``), once entered
        (``open``, ``attach``, ``events``, ``state``)."""
        jobs: RemoteJobs | None = getattr(self._ops, "jobs", None)
        if jobs is None:
            raise InvalidRequest(
                f"jobs need a cluster: open the client on ray://auto (this one is {self._where})"
                " and enter it (async with) first"
            )
        return jobs

    async def _get_ops(self) -> NodeOps:
        if self._closed:
            raise CorralError("this corral client is closed")
        if self._ops is None:
            async with self._lock:
                if self._ops is None:
                    self._ops = await self._open()
        return self._ops

    async def _open(self) -> NodeOps:
        if self._target is None:
            # imported here: the embedded node pulls in the whole node room, which an HTTP
            # user never needs
            from corral.node import Node

            return await Node.open(self._config)
        if self._target.startswith("ray://"):
            # imported here: Ray is the optional extra corral[cluster]
            from corral.cluster.ray_client import RayOps

            return await RayOps(self._target).connect()
        from corral.sdk._http import HTTPOps

        return HTTPOps(self._target, token=self._token)

    async def events(
        self,
        sandbox_id: str | None = None,
        after: str | None = None,
        labels: Mapping[str, str] | None = None,
        kinds: Sequence[str] | None = None,
        limit: int = 1000,
    ) -> builtins.list[Event]:
        """Lifecycle and security events after the cursor ``after`` (None: from the
        start), oldest first, at most ``limit`` (1 to 10000); ``kinds`` keeps only those
        kinds (e.g. ``["seccomp", "pids_limit"]``). Page on with the last event's cursor.

        Example:
            >>> evs = await client.events(labels={"job": "rl-42"})        # doctest: +SKIP
            >>> more = await client.events(after=evs[-1].cursor)          # doctest: +SKIP
        """
        ops = await self._get_ops()
        return await ops.events(
            sandbox_id=sandbox_id,
            after=after,
            labels=dict(labels) if labels else None,
            kinds=_kinds(kinds),
            limit=limit,
        )

    async def events_summary(
        self,
        labels: Mapping[str, str] | None = None,
        kinds: Sequence[str] | None = None,
        sandbox_id: str | None = None,
    ) -> EventSummary:
        """How often each kind of event happened per sandbox and in total, e.g. for a job:
        ``(await client.events_summary(labels={"job": "rl-42"})).totals`` is like
        ``{"created": 8, "seccomp": 12}``; ``.sandboxes`` has the same per sandbox id.
        """
        ops = await self._get_ops()
        return await ops.events_summary(
            labels=dict(labels) if labels else None, kinds=_kinds(kinds), sandbox_id=sandbox_id
        )

    async def node_status(self) -> NodeStatus:
        return await (await self._get_ops()).node_status()

    async def stats(
        self,
        labels: Mapping[str, str] | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> Stats:
        """p50/p90/p99 per operation (create, exec, destroy, pause, resume, fork, snapshot)
        and per phase for the sandboxes with these labels, and event counts by kind, e.g.
        ``(await client.stats(labels={"job": "rl-42"})).ops["create"].phases``."""
        return await fetch_stats(await self._get_ops(), labels, since, until)

    async def close(self) -> None:
        """Close the embedded node or the HTTP connections. Sandboxes keep running."""
        if self._closed:
            return
        self._closed = True
        ops, self._ops = self._ops, None
        if ops is not None and self._owns_ops:
            await ops.close()

    async def __aenter__(self) -> AsyncClient:
        await self._get_ops()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Images:
    """``client.images``: the node's image store (building happens in ``corral image``)."""

    __slots__ = ("_client",)

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def get(self, name: str) -> ImageInfo:
        """Image by name (``demo/python``) or manifest digest."""
        return await (await self._client._get_ops()).image_get(name)

    async def list(self) -> builtins.list[ImageInfo]:
        return await (await self._client._get_ops()).image_list()

    async def compose(
        self,
        name: str,
        layers: Sequence[str | ImageInfo | LayerInfo],
        env: Mapping[str, str] | None = None,
        workdir: str = "/",
    ) -> ImageInfo:
        """Stack layers (bottom first) into a new image; an ImageInfo contributes all of
        its layers. Writes a manifest, copies nothing.

        Example:
            >>> base = await client.images.get("demo/python")              # doctest: +SKIP
            >>> await client.images.compose("task/42", [base, "sha256:..."])  # doctest: +SKIP
        """
        digests: builtins.list[str] = []
        for layer in layers:
            if isinstance(layer, ImageInfo):
                digests.extend(layer.layers)
            elif isinstance(layer, LayerInfo):
                digests.append(layer.digest)
            else:
                digests.append(layer)
        ops = await self._client._get_ops()
        return await ops.image_compose(
            name, digests, env=dict(env) if env else None, workdir=workdir
        )

    async def remove(self, name: str) -> None:
        await (await self._client._get_ops()).image_remove(name)

    async def layers(self) -> builtins.list[LayerInfo]:
        return await (await self._client._get_ops()).layer_list()


class Sandboxes:
    """``client.sandboxes``: create, find and list sandboxes."""

    __slots__ = ("_client",)

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self,
        image: str | ImageInfo,
        *,
        limits: Limits | Mapping[str, Any] | None = None,
        ttl: float | None = None,
        idle_timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        hostname: str | None = None,
        idle_pause: float | None = None,
        qos: str | None = None,
        network: NetworkPolicy | Mapping[str, Any] | None = None,
        backend: str | None = None,
        desktop: Desktop | Mapping[str, Any] | None = None,
        ttl_action: str | None = None,
    ) -> Sandbox:
        """Create a sandbox and wait until it runs.

        ``ttl_action="pause"``: the TTL pauses the sandbox instead of destroying it
        (``sb.set_ttl`` gives it a new TTL later).

        ``desktop`` (``backend="vm"`` only) gives the VM a display with an X session of
        that size; ``sb.desktop`` then takes screenshots and sends input.

        An ``ImageInfo`` is pinned by digest, so every sandbox of a run gets the same
        layers even if the name is recomposed meanwhile. None means the spec's default
        (for ``backend``: the node's default isolation engine, ``container``).
        """
        fields: dict[str, Any] = {
            "image": image.digest if isinstance(image, ImageInfo) else image,
            "limits": limits,
            "ttl": ttl,
            "idle_timeout": idle_timeout,
            "labels": dict(labels) if labels is not None else None,
            "env": dict(env) if env is not None else None,
            "workdir": workdir,
            "hostname": hostname,
            "idle_pause": idle_pause,
            "qos": qos,
            "network": network,
            "backend": backend,
            "desktop": desktop,
            "ttl_action": ttl_action,
        }
        try:
            spec = SandboxSpec.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise invalid_request(exc) from None
        ops = await self._client._get_ops()
        return Sandbox._wrap(ops, await ops.sandbox_create(spec))

    async def get(self, sandbox_id: str) -> Sandbox:
        """Handle on an existing sandbox; raises SandboxNotFound."""
        return await Sandbox._from_id(await self._client._get_ops(), sandbox_id)

    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[Sandbox]:
        """Sandboxes whose labels include every ``labels`` pair."""
        ops = await self._client._get_ops()
        infos = await ops.sandbox_list(labels=dict(labels) if labels else None)
        return [Sandbox._wrap(ops, info) for info in infos]

    async def pause(self, labels: Mapping[str, str]) -> builtins.list[Sandbox]:
        """Pause every sandbox with all of ``labels`` in one call (a job, when its trainer
        is preempted); returns the sandboxes now paused.

        Example:
            >>> await client.sandboxes.pause(labels={"job": "rl-42"})     # doctest: +SKIP
        """
        ops = await self._client._get_ops()
        return [Sandbox._wrap(ops, i) for i in await ops.sandboxes_pause(dict(labels))]

    async def resume(
        self, labels: Mapping[str, str], prefetch: bool = False
    ) -> builtins.list[Sandbox]:
        """Resume every paused sandbox with all of ``labels`` (``prefetch``: read their
        memory back at once, see :meth:`Sandbox.resume`); returns those resumed."""
        ops = await self._client._get_ops()
        got = await ops.sandboxes_resume(dict(labels), prefetch)
        return [Sandbox._wrap(ops, i) for i in got]


def _kinds(kinds: Sequence[str] | None) -> list[str] | None:
    if isinstance(kinds, str):
        raise InvalidRequest("kinds: give a list of event kinds, not one string")
    return list(kinds) if kinds else None
