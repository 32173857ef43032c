"""HTTP and WebSocket into a sandbox's port over a socket the node opened in its namespace.

Used by :mod:`._ports` when the operations object is a :class:`corral.ops.PortOps` (the
embedded node). HTTP goes through ``httpcore`` (the engine under httpx) with a network
backend whose "TCP connect" is :meth:`~corral.ops.PortOps.port_connect` (one guest
connection per request; the client's own connection to the node is kept alive), request
and response bodies streamed both ways (no size cap, server-sent
events and long polls work). A WebSocket is bridged message by message: the node accepts
the client's, opens one to the guest with ``websockets`` over such a socket, and pumps
both ways until either side closes; the close code is passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpcore
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from corral.errors import CorralError
from corral.ops import PortOps

__all__ = ["PortLink"]

_READ = 64 << 10
# Not passed on: hop-by-hop headers and the proxy's own credentials (see ``passed_on``).
HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te",
    "trailer", "host", "content-length", "x-access-token", "e2b-traffic-access-token",
    "e2b-sandbox-id", "e2b-sandbox-port", "expect", "sec-websocket-key", "sec-websocket-version",
    "sec-websocket-extensions", "sec-websocket-protocol",
})  # fmt: skip
_NODE_CARRIERS = ("authorization", "x-api-key")
COOKIE = "corral_port"
"""The cookie a browser gets from a ``?corral_token=`` link (see :mod:`._ports`)."""


def _without_our_cookie(value: str) -> str:
    kept = [c for c in value.split(";") if c.strip().partition("=")[0] != COOKIE]
    return ";".join(kept).strip()


def passed_on(headers: Any, node_token: str | None) -> list[tuple[str, str]]:
    """The client's end-to-end headers the guest may see.

    ``Authorization`` and ``X-API-Key`` are the guest application's own business (a
    server with its own auth, SWE-ReX's key), so they pass, unless they carry the
    node's token: that one never reaches a guest.
    """
    out = []
    for k, v in headers.items():
        low = k.lower()
        if low in HOP:
            continue
        if low in _NODE_CARRIERS and node_token and node_token in v:
            continue
        if low == "cookie":
            v = _without_our_cookie(v)
            if not v:
                continue
        out.append((k, v))
    return out


class _SockStream(httpcore.AsyncNetworkStream):
    """One connected socket as httpcore wants it (asyncio's sock_* calls)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return await asyncio.wait_for(self._loop.sock_recv(self._sock, max_bytes), timeout)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            await asyncio.wait_for(self._loop.sock_sendall(self._sock, buffer), timeout)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self._sock.close()

    def get_extra_info(self, info: str) -> Any:
        return self._sock if info == "socket" else None


class _Backend(httpcore.AsyncNetworkBackend):
    """ "Connect to host:port" means port ``port`` of sandbox ``host``."""

    def __init__(self, ops: PortOps) -> None:
        self._ops = ops

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        return _SockStream(await self._ops.port_connect(host, port))

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _forwarded(
    request: Request | WebSocket, node_token: str | None, prefix: str
) -> list[tuple[str, str]]:
    """What passes on, plus what a server behind a proxy wants to know."""
    out = passed_on(request.headers, node_token)
    out.append(("X-Forwarded-Host", request.headers.get("host", "")))
    if prefix:
        out.append(("X-Forwarded-Prefix", prefix))
    return out


class PortLink:
    """HTTP and WebSocket to ``127.0.0.1:port`` inside a sandbox (see the module doc)."""

    def __init__(self, ops: PortOps, node_token: str | None) -> None:
        self._ops = ops
        self._token = node_token
        self._pool = httpcore.AsyncConnectionPool(
            network_backend=_Backend(ops),
            max_connections=4096,
            # none kept idle: an idle socket would hold a destroyed sandbox's network
            # namespace alive (httpcore expires idle connections only on its next use)
            max_keepalive_connections=0,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def http(self, request: Request, sid: str, port: int, path: str, prefix: str) -> Response:
        """Relay one request; the response streams back as the guest sends it."""
        target = path + (("?" + request.url.query) if request.url.query else "")
        headers = [("Host", f"127.0.0.1:{port}"), *_forwarded(request, self._token, prefix)]
        body: AsyncIterator[bytes] | None = None
        length = request.headers.get("content-length")
        if length is not None:
            headers.append(("Content-Length", length))
            body = request.stream()
        elif "chunked" in request.headers.get("transfer-encoding", "").lower():
            headers.append(("Transfer-Encoding", "chunked"))
            body = request.stream()
        req = httpcore.Request(
            request.method,
            httpcore.URL(scheme=b"http", host=sid.encode(), port=port, target=target.encode()),
            headers=headers,
            content=body,
            extensions={"timeout": {"connect": 15.0, "read": None, "write": 120.0, "pool": None}},
        )
        resp = await self._pool.handle_async_request(req)
        out = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in resp.headers
            if k.decode("latin-1").lower() not in HOP or k.lower() == b"content-length"
        ]

        async def relay() -> AsyncIterator[bytes]:
            try:
                with self._ops.port_hold(sid):
                    async for chunk in resp.aiter_stream():  # type: ignore[attr-defined]
                        yield chunk
            finally:
                await resp.aclose()  # type: ignore[attr-defined]

        streamed = StreamingResponse(relay(), status_code=resp.status)
        del streamed.headers["content-type"]  # starlette's default; the guest's is in ``out``
        for k, v in out:
            streamed.headers.append(k, v)
        return streamed

    async def websocket(self, ws: WebSocket, sid: str, port: int, path: str, prefix: str) -> None:
        """Bridge the client's WebSocket to the guest's until either side closes."""
        target = path + (("?" + ws.url.query) if ws.url.query else "")
        offered = list(ws.scope.get("subprotocols") or [])
        try:
            sock = await self._ops.port_connect(sid, port)
        except CorralError as exc:
            await ws.close(code=1011, reason=str(exc)[:120])
            return
        try:
            guest = await connect(
                f"ws://127.0.0.1:{port}{target}",
                sock=sock,
                subprotocols=offered or None,  # type: ignore[arg-type]
                additional_headers=_forwarded(ws, self._token, prefix),
                compression=None,
                max_size=None,
                open_timeout=30,
                user_agent_header=None,
            )
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            sock.close()
            why = f"HTTP {exc.response.status_code}" if isinstance(exc, InvalidStatus) else exc
            await ws.close(code=1011, reason=f"port {port} refused the websocket: {why}"[:120])
            return
        async with guest:
            await ws.accept(subprotocol=guest.subprotocol)
            with self._ops.port_hold(sid):
                await _pump(ws, guest)


async def _pump(ws: WebSocket, guest: ClientConnection) -> None:
    async def to_guest() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                code = msg.get("code") or 1000
                await guest.close(code=1000 if code in (1005, 1006, 1015) else code)
                return
            if msg.get("text") is not None:
                await guest.send(msg["text"])
            elif msg.get("bytes") is not None:
                await guest.send(msg["bytes"])

    async def to_client() -> None:
        try:
            async for data in guest:
                if isinstance(data, str):
                    await ws.send_text(data)
                else:
                    await ws.send_bytes(data)
        except ConnectionClosed:
            pass
        rcvd = guest.close_code if guest.close_code is not None else 1000
        code = 1000 if rcvd in (1005, 1006) else rcvd
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            await ws.close(code=code, reason=guest.close_reason or "")

    tasks = [asyncio.create_task(to_guest()), asyncio.create_task(to_client())]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        for t in done:
            exc = t.exception()
            if exc is not None and not isinstance(exc, (ConnectionClosed, WebSocketDisconnect)):
                raise exc
    finally:
        for t in tasks:
            t.cancel()
