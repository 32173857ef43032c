"""A FakeNode wired to an Observer the way the real node is to be wired (issue 14).

``ObservedFakeNode`` times its operations with a PhaseTimer and hands them to an
``Observer`` over a real ``StateStore``; its events also go to that store (so metrics
and stats count them), and it answers ``stats``/``timeline`` as the node will. The
helpers serve it over a unix socket or TCP with the observe router included exactly as
``create_app`` is to include it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from corral.api import create_app
from corral.api.observe import observe_router
from corral.api.server import _Server
from corral.node.metrics import MetricsConfig, NodeMetrics, PhaseTimer
from corral.node.security import SECURITY_KINDS
from corral.node.state import StateStore
from corral.node.stats import Observer
from corral.spec import ExecRequest, ExecResult, SandboxInfo, SandboxSpec, Stats, TimelineEntry
from corral.testing import FakeNode


class ObservedFakeNode(FakeNode):
    def __init__(self, state_dir: Path, config: MetricsConfig | None = None) -> None:
        super().__init__()
        self.store = StateStore(state_dir / "state.db")
        metrics = NodeMetrics(config or MetricsConfig(), security_kinds=SECURITY_KINDS)
        self.observer = Observer(self.store, metrics)

    async def sandbox_create(self, spec: SandboxSpec) -> SandboxInfo:
        t = PhaseTimer()
        with t.phase("admission"):
            await asyncio.sleep(0)
        with t.phase("runtime_start"):
            info = await super().sandbox_create(spec)
        self.store.put_sandbox(info)
        self.observer.record(
            "create", t.total(), t.phases, sandbox_id=info.id, labels=spec.labels, qos=spec.qos
        )
        return info

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        t = PhaseTimer()
        with t.phase("agent_round_trip"):
            r = await super().exec(sandbox_id, req)
        info = await self.sandbox_get(sandbox_id)
        self.observer.record(
            "exec", t.total(), t.phases, sandbox_id=sandbox_id, labels=info.spec.labels
        )
        return r

    def record_event(self, sandbox_id: str | None, kind: str, **detail: str | int) -> None:
        super().record_event(sandbox_id, kind, **detail)
        self.store.add_event(sandbox_id, kind, dict(detail))

    async def stats(
        self,
        labels: dict[str, str] | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> Stats:
        return self.observer.stats(labels, since, until)

    async def timeline(self, sandbox_id: str, limit: int = 2000) -> list[TimelineEntry]:
        return self.observer.timeline(sandbox_id, limit)

    async def close(self) -> None:
        await super().close()
        self.observer.flush()
        self.store.close()


def observed_app(node: ObservedFakeNode, token: str | None = None) -> FastAPI:
    """The node's app with the observe routes, as ``create_app`` is to build it."""
    app = create_app(node, token=token)
    app.include_router(observe_router(node, node.observer))
    return app


@contextlib.asynccontextmanager
async def serve(app: FastAPI, sock: socket.socket) -> AsyncIterator[uvicorn.Server]:
    server = _Server(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
        await asyncio.sleep(0.005)
    try:
        yield server
    finally:
        server.should_exit = True
        server.force_exit = True
        await task


def uds_socket(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(64)
    return s


def tcp_socket(host: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    s.listen(64)
    return s
