"""Observability routes: ``/metrics``, ``/v1/stats``, a sandbox's timeline, the live feed
(server-sent events) and the dashboard at ``/ui``.

Included into the node's app (``app.include_router(observe_router(ops, observer))``), so
it sits behind the same listeners and the same bearer token: on the unix socket no
token, on TCP the token. :func:`metrics_app` is the token-free app of the separate
metrics listener (``[node.metrics] listen``): it serves ``GET /metrics`` and nothing
else, so exposing it runs nothing in any sandbox.

The live feed is one poller per app, however many browsers watch: once a second it reads
new events, sandbox counts by state and operation counters, and hands the same message
to every client's queue. A queue holds at most ``_QUEUE`` messages; a client that falls
that far behind is dropped (its stream ends; EventSource reconnects and starts from the
present), so a slow client costs bounded memory and never blocks the poller or the node.

Example:
    >>> app = create_app(FakeNode())                                   # doctest: +SKIP
    >>> app.include_router(observe_router(ops, observer))              # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import Response, StreamingResponse

from corral.api.server import _Server
from corral.errors import CursorExpired, HostError, InvalidRequest, NotFound
from corral.node.metrics import CONTENT_TYPE
from corral.node.security import SECURITY_KINDS
from corral.node.stats import Observer, parse_label_filter
from corral.ops import EVENTS_LIMIT_MAX, NodeOps
from corral.spec import Stats, TimelineEntry, encode_cursor

__all__ = ["LiveFeed", "MetricsServer", "metrics_app", "observe_router"]

log = logging.getLogger("corral.api")

_QUEUE = 32
"""Messages a live-feed client may lag behind before it is dropped."""
_EVENTS_PER_TICK = 500
_STREAM_SECONDS = 300.0
"""A live stream ends after this long (the browser reconnects at once): no connection
outlives a node's graceful stop by more than that, and none lives forever."""
_SECURITY_KINDS = sorted(SECURITY_KINDS)
_MAX_RANGE = 366 * 86400.0
_UI_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
}


class _Client:
    __slots__ = ("queue", "dropped")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(_QUEUE)
        self.dropped = False


class LiveFeed:
    """One poller, many bounded client queues (see the module docstring)."""

    def __init__(self, ops: NodeOps, observer: Observer | None, interval: float = 1.0) -> None:
        self._ops = ops
        self._observer = observer
        self.interval = interval
        self._clients: set[_Client] = set()
        self._task: asyncio.Task[None] | None = None
        self._last_event: str | None = None
        self.dropped = 0
        """Clients dropped for being too slow (for tests and logs)."""

    @property
    def clients(self) -> int:
        return len(self._clients)

    def subscribe(self) -> _Client:
        client = _Client()
        self._clients.add(client)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll(), name="corral-live-feed")
        return client

    def unsubscribe(self, client: _Client) -> None:
        self._clients.discard(client)
        if not self._clients and self._task is not None:
            self._task.cancel()
            self._task = None

    def close(self) -> None:
        """End every stream (the server is stopping)."""
        for client in list(self._clients):
            self._drop(client, slow=False)
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _drop(self, client: _Client, slow: bool) -> None:
        client.dropped = True
        while not client.queue.empty():
            client.queue.get_nowait()
        client.queue.put_nowait(None)  # room: just emptied
        self._clients.discard(client)
        if slow:
            self.dropped += 1
            log.info("live feed: dropped a client %d messages behind", _QUEUE)

    def publish(self, message: bytes) -> None:
        for client in list(self._clients):
            try:
                client.queue.put_nowait(message)
            except asyncio.QueueFull:
                self._drop(client, slow=True)

    async def _poll(self) -> None:
        while self._clients:
            try:
                self.publish(await self.snapshot())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("live feed: a snapshot failed; trying again")
            await asyncio.sleep(self.interval)

    async def snapshot(self) -> bytes:
        """One SSE message: node figures, sandboxes by state, op counters, new events."""
        status = await self._ops.node_status()
        sandboxes = await self._ops.sandbox_list()
        states: dict[str, int] = {}
        for info in sandboxes:
            states[info.state] = states.get(info.state, 0) + 1
        if self._last_event is not None:
            try:
                events = await self._ops.events(after=self._last_event, limit=_EVENTS_PER_TICK)
            except CursorExpired:  # fell behind the retention: start over at the newest
                self._last_event = None
        if self._last_event is None:
            # a new feed starts with the last 50 events, not the whole log
            start = 0
            if self._observer:
                state = self._observer.state
                start = max(state.last_event_id() - 50, state.events_trimmed_through())
            cursor = encode_cursor({status.node_id: max(0, start)})
            events = (await self._ops.events(after=cursor, limit=EVENTS_LIMIT_MAX))[-50:]
        if events:
            self._last_event = events[-1].cursor
        elif self._last_event is None:
            self._last_event = encode_cursor({status.node_id: max(0, start)})
        body: dict[str, Any] = {
            "t": time.time(),
            "node": json.loads(status.model_dump_json()),
            "states": states,
            "ops": self._observer.metrics.op_counts() if self._observer else {},
            "events": [json.loads(e.model_dump_json()) for e in events],
            "security_kinds": _SECURITY_KINDS,
        }
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    async def stream(self) -> AsyncIterator[bytes]:
        client = self.subscribe()
        deadline = time.monotonic() + _STREAM_SECONDS
        try:
            yield b"retry: 1000\n\n"
            while time.monotonic() < deadline:
                try:
                    msg = await asyncio.wait_for(client.queue.get(), timeout=15)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if msg is None:
                    yield b"event: dropped\ndata: {}\n\n"
                    return
                yield msg
        finally:
            self.unsubscribe(client)


def _range(since: float | None, until: float | None) -> tuple[float | None, float | None]:
    now = time.time()
    if since is not None and since < 0:  # relative: the last N seconds
        since = now + since
    if since is not None and until is not None and since > until:
        raise InvalidRequest(f"since ({since}) is after until ({until})")
    if since is not None and (until or now) - since > _MAX_RANGE:
        raise InvalidRequest(
            f"time range of {((until or now) - since) / 86400:.0f} days is longer than the "
            f"{_MAX_RANGE / 86400:.0f} days a stats request may cover; narrow since/until"
        )
    return since, until


def observe_router(
    ops: NodeOps, observer: Observer | None, feed: LiveFeed | None = None
) -> APIRouter:
    """The routes of this module over ``ops`` and the node's ``observer`` (None: the node
    keeps no metrics; ``/metrics`` and ``/v1/stats`` answer 404 saying so). ``feed``: the
    live feed to serve (default: a new one; pass your own to ``close()`` it at stop)."""
    r = APIRouter()
    feed = feed or LiveFeed(ops, observer)

    def need() -> Observer:
        if observer is None:
            raise NotFound("this node keeps no metrics or timings ([node.metrics] is off)")
        return observer

    @r.get("/metrics", tags=["observe"], response_class=Response)
    async def metrics() -> Response:
        body = await asyncio.to_thread(need().render)
        return Response(body, media_type=CONTENT_TYPE)

    @r.get("/v1/stats", response_model=Stats, tags=["observe"])
    async def stats(
        label: list[str] = Query([], description="key=value; repeat to require several"),
        since: float | None = Query(None, description="unix time, or -N for the last N s"),
        until: float | None = Query(None, description="unix time; default now"),
    ) -> Response:
        labels = parse_label_filter(label)
        lo, hi = _range(since, until)
        found = await asyncio.to_thread(need().stats, labels, lo, hi)
        return Response(found.model_dump_json(), media_type="application/json")

    @r.get(
        "/v1/sandboxes/{sandbox_id}/timeline", response_model=list[TimelineEntry], tags=["observe"]
    )
    async def timeline(sandbox_id: str, limit: int = Query(2000, ge=1, le=20000)) -> Response:
        obs = need()
        try:
            await ops.sandbox_get(sandbox_id)
        except NotFound:
            # a destroyed sandbox still has its timeline as long as its rows are kept
            if obs.state.get_sandbox(sandbox_id) is None:
                raise
        entries = await asyncio.to_thread(obs.timeline, sandbox_id, limit)
        body = b"[" + b",".join(e.model_dump_json().encode() for e in entries) + b"]"
        return Response(body, media_type="application/json")

    @r.get("/v1/live", tags=["observe"], response_class=StreamingResponse)
    async def live() -> StreamingResponse:
        """Server-sent events: one JSON message a second (see LiveFeed.snapshot)."""
        return StreamingResponse(
            feed.stream(),
            media_type="text/event-stream",
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )

    @r.get("/ui", tags=["observe"], response_class=Response, include_in_schema=False)
    async def ui_index() -> Response:
        return _ui_file("index.html")

    @r.get("/ui/{name:path}", tags=["observe"], response_class=Response, include_in_schema=False)
    async def ui_file(name: str) -> Response:
        return _ui_file(name or "index.html")

    return r


def _ui_file(name: str) -> Response:
    media = _UI_FILES.get(name)
    if media is None:  # a closed list: no path from the URL ever reaches the filesystem
        raise NotFound(f"no dashboard file {name!r}")
    data = resources.files("corral.ui").joinpath(name).read_bytes()
    return Response(
        data,
        media_type=media,
        headers={
            "cache-control": "no-cache",
            # the page only talks to this origin and runs only its own files
            "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; frame-ancestors 'none'",
            "x-content-type-options": "nosniff",
        },
    )


def metrics_app(observer: Observer) -> FastAPI:
    """The app of the separate, token-free metrics listener: ``GET /metrics`` only."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(observer.render)
        return Response(body, media_type=CONTENT_TYPE)

    async def not_here(_: Any, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        err = NotFound("only GET /metrics is served here")
        body = json.dumps(err.to_wire())
        return Response(body, status_code=status, media_type="application/json")

    app.add_exception_handler(404, not_here)
    app.add_exception_handler(405, not_here)
    return app


class MetricsServer:
    """The separate, token-free metrics listener (``[node.metrics] listen``): serves
    :func:`metrics_app` on ``host:port`` until stopped.

    Example:
        >>> async with MetricsServer(node.observer, "0.0.0.0:9470") as m:   # doctest: +SKIP
        ...     print(m.address)
    """

    def __init__(self, observer: Observer, listen: str) -> None:
        host, sep, port = listen.rpartition(":")
        if not sep or not port.isdigit():
            raise InvalidRequest(f"metrics listen address {listen!r} must be host:port")
        self._host, self._port = host.strip("[]"), int(port)
        self._app = metrics_app(observer)
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self.address = ""

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY: server.py
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise HostError(
                f"cannot listen for metrics on {self._host}:{self._port}: {exc}"
            ) from exc
        self.address = f"{self._host}:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            self._app, lifespan="off", log_config=None, access_log=False, server_header=False
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                await self._task
                raise HostError(f"the metrics listener on {self.address} stopped while starting")
            await asyncio.sleep(0.005)
        log.info("corral metrics on http://%s/metrics", self.address)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            await self._task
            self._task = None

    async def __aenter__(self) -> MetricsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
