"""``CorralDeployment``: swe-rex 1.4.0's deployment interface over a corral sandbox.

``start`` creates a sandbox from the toolkit image (see :mod:`._toolkit`), starts
``swerex-remote`` in it on the sandbox's loopback (the guest needs no network), and
connects swe-rex's own ``RemoteRuntime`` through the node's port proxy; ``stop`` closes
the runtime and destroys the sandbox. The runtime's ``X-API-Key`` is the sandbox's own
access token: the port proxy accepts it for this sandbox only and passes it on, and the
server checks it too. So nothing but this deployment (or the node's token holder)
drives the session, and the token opens no other sandbox.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import DeploymentNotStartedError
from swerex.runtime.abstract import IsAliveResponse
from swerex.runtime.remote import RemoteRuntime

import corral
from corral.errors import InvalidRequest, NotFound, SandboxError
from corral.integrations.swerex._toolkit import server_command
from corral.sdk._sandbox import Sandbox

__all__ = ["CorralDeployment", "CorralDeploymentConfig"]


class CorralDeploymentConfig(BaseModel):
    """What :class:`CorralDeployment` takes (the shape of swe-rex's deployment configs)."""

    node: str = "http://127.0.0.1:8700"
    """The node's HTTP address (the port proxy lives on its HTTP server)."""
    token: str | None = None
    """The node's token (None: the node has none)."""
    image: str = "swerex/debian"
    """A corral image with the toolkit (``corral swerex image``)."""
    port: int = Field(8000, ge=1, le=65535)
    """Port of ``swerex-remote`` inside the sandbox (its loopback)."""
    startup_timeout: float = 120.0
    """Seconds to wait for the runtime to answer after the sandbox is up."""
    runtime_timeout: float = 60.0
    """Timeout of one request of the runtime (swe-rex's ``RemoteRuntime.timeout``)."""
    ttl: float | None = 4 * 3600
    """Backstop: the node destroys the sandbox after this many seconds, stopped or not."""
    memory: str | None = None
    """Memory limit of the sandbox (corral's ``Limits.memory``, e.g. ``"2g"``)."""
    cpus: float | None = None
    labels: dict[str, str] = Field(default_factory=dict)

    type: Literal["corral"] = "corral"
    """Discriminator, as swe-rex's own configs have."""

    model_config = ConfigDict(extra="forbid")

    def get_deployment(self) -> CorralDeployment:
        return CorralDeployment.from_config(self)


class CorralDeployment(AbstractDeployment):
    """A SWE-ReX runtime in a corral sandbox (see the module doc).

    Example:
        >>> d = CorralDeployment(node="http://127.0.0.1:8700", token=tok)  # doctest: +SKIP
        >>> await d.start()                                                # doctest: +SKIP
        >>> await d.runtime.create_session(CreateBashSessionRequest())     # doctest: +SKIP
        >>> await d.stop()                                                 # doctest: +SKIP
    """

    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = CorralDeploymentConfig(**kwargs)
        self.logger = logger or logging.getLogger("corral.swerex")
        self._hooks = CombinedDeploymentHook()
        self._client: corral.AsyncClient | None = None
        self._sandbox: Sandbox | None = None
        self._runtime: RemoteRuntime | None = None

    @classmethod
    def from_config(cls, config: CorralDeploymentConfig) -> CorralDeployment:
        return cls(**config.model_dump())

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self) -> Sandbox | None:
        """The corral sandbox while started (for corral's own SDK: snapshots, files...)."""
        return self._sandbox

    @property
    def runtime(self) -> RemoteRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Create the sandbox, start the server in it, wait until the runtime answers."""
        if self._sandbox is not None:
            raise InvalidRequest("this deployment is started already")
        cfg = self._config
        if not cfg.node.startswith(("http://", "https://")):
            raise InvalidRequest(
                f"node {cfg.node!r}: the runtime is reached through the node's HTTP "
                "server; give its http:// address"
            )
        t0 = time.monotonic()
        self._hooks.on_custom_step("Creating corral sandbox")
        self._client = corral.AsyncClient(cfg.node, token=cfg.token)
        limits: dict[str, Any] = {}
        if cfg.memory is not None:
            limits["memory"] = cfg.memory
        if cfg.cpus is not None:
            limits["cpus"] = cfg.cpus
        try:
            self._sandbox = await self._client.sandboxes.create(
                image=cfg.image,
                ttl=cfg.ttl,
                labels={"swerex": "1", **cfg.labels},
                limits=corral.Limits(**limits) if limits else None,
            )
            ep = await self._sandbox.ports.expose(cfg.port)
            # the sandbox's access token, or (a node without a token) one of our own
            token = ep.headers.get("X-Access-Token") or secrets.token_hex(16)
            self._hooks.on_custom_step("Starting runtime")
            self.logger.info("Starting swerex-remote in sandbox %s", self._sandbox.id)
            proc = await self._sandbox.spawn(server_command(token, cfg.port))
            self._runtime = RemoteRuntime(
                auth_token=token,
                host=ep.url.rstrip("/"),
                timeout=cfg.runtime_timeout,
                logger=self.logger,
            )
            await self._wait_alive(proc.id, cfg.startup_timeout)
        except BaseException:
            await self.stop()
            raise
        self.logger.info("Runtime started in %.2fs", time.monotonic() - t0)

    async def _wait_alive(self, process_id: str, timeout: float) -> None:
        """Poll ``is_alive`` (asyncio sleeps: swe-rex's helper blocks the event loop) until
        the server answers; a server that exited fails at once with its output."""
        assert self._sandbox is not None and self._runtime is not None
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            alive = await self._runtime.is_alive(timeout=5)
            if alive:
                return
            last = alive.message
            procs = {p.id: p for p in await self._sandbox.processes()}
            proc = procs.get(process_id)
            if proc is None or not proc.info.running:
                out, err = await proc.output() if proc is not None else (b"", b"")
                raise SandboxError(
                    f"swerex-remote exited in sandbox {self._sandbox.id} (does image "
                    f"{self._config.image!r} have the toolkit? `corral swerex image`): "
                    f"{(out + err).decode(errors='replace')[-2000:]}"
                )
            await asyncio.sleep(0.2)
        raise TimeoutError(f"swerex-remote did not answer within {timeout}s: {last}")

    async def stop(self) -> None:
        """Close the runtime and destroy the sandbox (safe to call twice)."""
        if self._runtime is not None:
            try:
                await self._runtime.close()
            except Exception as exc:  # the sandbox goes anyway
                self.logger.debug("runtime close: %s", exc)
            self._runtime = None
        if self._sandbox is not None:
            sb, self._sandbox = self._sandbox, None
            try:
                await sb.destroy()
            except NotFound:
                pass
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
