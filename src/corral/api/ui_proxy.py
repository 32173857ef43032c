"""``corral ui``: a node's dashboard in a local browser, through a read-only proxy.

A node on a unix socket cannot be opened by a browser, and a browser cannot attach the
bearer token a TCP node wants. ``UIProxy`` listens on 127.0.0.1 (a free port) and
forwards to the node, adding the node's token itself. Who may use it:

- **One-time token.** ``corral ui`` prints ``http://127.0.0.1:PORT/ui?token=T``. The
  first request carrying ``T`` gets a random session cookie (HttpOnly, SameSite=Strict)
  and a redirect to the plain URL; ``T`` is then spent. Every other request needs the
  cookie: another local user or a web page that learns the port gets 401.
- **Read-only.** Only ``GET`` of the dashboard's own routes is forwarded (the page, its
  files, the live feed, stats, sandbox lists, events, node status, timelines): the
  proxy cannot create, exec or destroy anything, whatever a page sends.
- **Host check.** Requests whose ``Host`` is not the proxy's own address are refused
  (DNS rebinding: a hostile site resolving its name to 127.0.0.1).

Example:
    >>> async with UIProxy("unix:///run/corral/api.sock") as proxy:    # doctest: +SKIP
    ...     print(proxy.login_url)
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
import socket
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie
from types import TracebackType
from urllib.parse import parse_qs

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send

from corral.api.server import _Server
from corral.errors import CorralError, HostError, InvalidRequest, NotFound, Unauthorized
from corral.sdk._http import parse_target

__all__ = ["UIProxy"]

log = logging.getLogger("corral.ui")

_COOKIE = "corral_ui"
_ALLOWED = re.compile(
    r"^/(ui(/.*)?|metrics|v1/(stats|live|node|events(/summary)?|sandboxes"
    r"(/[A-Za-z0-9_-]+(/(timeline|events))?)?))$"
)
_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"server", b"date"}


class UIProxy:
    """Local, token-guarded, read-only proxy of a node's dashboard (see module docstring)."""

    def __init__(
        self, target: str, *, token: str | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        kind, where = parse_target(target)
        if kind not in ("unix", "http"):
            raise InvalidRequest(f"corral ui needs a node's API address, not {target!r}")
        transport = httpx.AsyncHTTPTransport(uds=where if kind == "unix" else None)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._node = httpx.AsyncClient(
            base_url="http://corral" if kind == "unix" else where,
            transport=transport,
            headers=headers,
            timeout=httpx.Timeout(30.0, read=None),
        )
        self._host, self._port = host, port
        self._once: str | None = secrets.token_urlsafe(24)
        self._sessions: set[str] = set()
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.address = ""
        self.login_url = ""
        """The URL to open once (it carries the one-time token)."""

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        sock = socket.socket(
            socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
        )  # NODELAY: server.py
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise HostError(f"corral ui cannot listen on {self._host}:{self._port}: {exc}") from exc
        port = sock.getsockname()[1]
        self.address = f"{self._host}:{port}"
        self.login_url = f"http://{self.address}/ui?token={self._once}"
        config = uvicorn.Config(
            self, lifespan="off", log_config=None, access_log=False, server_header=False
        )
        self._server = _Server(config)  # leaves signals to the caller
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                await self._task
                raise HostError("corral ui: the local server stopped while starting")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True  # live streams would hold a graceful stop
        if self._task is not None:
            await self._task
        await self._node.aclose()

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def __aenter__(self) -> UIProxy:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # ----------------------------------------------------------------- the app
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            await self._serve(scope, receive, send)
        except CorralError as exc:
            await _answer(send, exc.status, json.dumps(exc.to_wire()).encode())

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if host not in (self.address, f"localhost:{self.address.rpartition(':')[2]}"):
            raise Unauthorized(f"corral ui answers only to http://{self.address}, not {host!r}")
        if scope["method"] != "GET":
            raise InvalidRequest(f"corral ui is read-only: {scope['method']} is not forwarded")
        path: str = scope["path"]
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        once = query.get("token", [""])[0]
        if path == "/ui" and once:
            await self._login(once, send)
            return
        if not self._session_ok(headers.get(b"cookie", b"")):
            raise Unauthorized(
                "no dashboard session: open the URL that `corral ui` printed (its one-time "
                "token works once; run `corral ui` again for a new one)"
            )
        if not _ALLOWED.match(path):
            raise NotFound(f"corral ui does not forward {path}")
        # the browser leaving must end the upstream stream too (the live feed never ends)
        forward = asyncio.ensure_future(self._forward(scope, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (forward, gone):
                task.cancel()
        if forward.done() and not forward.cancelled() and forward.exception() is not None:
            raise forward.exception()  # type: ignore[misc]

    async def _login(self, once: str, send: Send) -> None:
        expected, self._once = self._once, None
        if expected is None or not hmac.compare_digest(once.encode(), expected.encode()):
            self._once = expected  # a wrong guess does not spend the real token
            raise Unauthorized("this one-time token is wrong or was already used")
        session = secrets.token_urlsafe(32)
        self._sessions.add(session)
        cookie = f"{_COOKIE}={session}; HttpOnly; SameSite=Strict; Path=/"
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [(b"location", b"/ui"), (b"set-cookie", cookie.encode())],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    def _session_ok(self, raw: bytes) -> bool:
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(raw.decode("latin-1"))
        except Exception:
            return False
        got = jar.get(_COOKIE)
        return got is not None and any(
            hmac.compare_digest(got.value.encode(), s.encode()) for s in self._sessions
        )

    async def _forward(self, scope: Scope, send: Send) -> None:
        qs = scope.get("query_string", b"").decode("latin-1")
        url = scope["path"] + (f"?{qs}" if qs else "")
        req = self._node.build_request("GET", url, headers={"accept": "*/*"})
        try:
            resp = await self._node.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise HostError(
                f"corral ui cannot reach the node: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            fwd = [(k, v) for k, v in resp.headers.raw if k.lower() not in _HOP]
            await send({"type": "http.response.start", "status": resp.status_code, "headers": fwd})
            async for chunk in _chunks(resp):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await resp.aclose()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _chunks(resp: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in resp.aiter_raw():
        if chunk:
            yield chunk


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})
