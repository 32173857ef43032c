"""Ports: HTTP and WebSocket to a server the guest runs on a port, through the node.

Two forms reach it: the path ``/sandboxes/{id}/ports/{port}/...`` and E2B's host form
``Host: {port}-{sandboxID}.{domain}`` (what ``sandbox.get_host(port)`` and corral's
``sb.ports.expose(port)`` name). Each request must carry the node's token (``X-API-KEY``
or ``Authorization: Bearer``) or the sandbox's own access token (``X-Access-Token`` or
``E2b-Traffic-Access-Token``); one sandbox's token opens no other sandbox's ports. The
credentials are not passed on to the guest.

For a browser, which cannot add headers: a link with ``?corral_token=<the sandbox's
token>`` answers a redirect to the same URL without it and sets an HttpOnly, SameSite=Strict
cookie scoped to that port's path (or host), which authenticates what the page loads
next, WebSockets included (``corral sandbox port ID PORT --open``). The node's token is
never accepted in a URL.

On the embedded node (:class:`corral.ops.PortOps`) the node connects to
``127.0.0.1:{port}`` inside the sandbox's network namespace and relays HTTP streamed, with
keep-alive, and WebSockets (:mod:`._portlink`): a guest without any network of its own is
reachable, only on that port. Over anything else (a cluster client, a backend whose
network the node cannot enter) the fallback is one exec per request: bash's ``/dev/tcp``
connects inside the sandbox, the request goes in on stdin and the response comes back on
stdout, buffered whole (64 MiB at most), ``Connection: close``, no websockets, and the
guest needs bash.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode

import httpcore
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.websockets import WebSocket

from corral.errors import CorralError, InvalidRequest, SandboxNotFound
from corral.integrations.e2b._common import e2b_error, envd_token, token_ok
from corral.integrations.e2b._portlink import COOKIE, PortLink, passed_on
from corral.ops import NodeOps, PortOps
from corral.spec import SANDBOX_ID_RE, ExecRequest

HOST_RE = re.compile(r"^(\d{1,5})-(sb-[0-9a-z]+-[0-9a-z]+)(?:\.|:|$)")
"""The E2B host form: ``8000-sb-abc-node.example.com``."""
PATH_RE = re.compile(r"^/sandboxes/([^/]+)/ports/(\d{1,5})(/.*)?$")
MAX_RESPONSE = 64 << 20
LINK_PARAM = "corral_token"

# the reader goes to the background: a background command's stdin would be /dev/null
_RELAY = r"""exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 111
cat <&3 &
cat >&3
wait
"""
_HOP = {
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te",
    "trailer", "host", "content-length", "authorization", "x-api-key", "x-access-token",
    "e2b-traffic-access-token", "e2b-sandbox-id", "e2b-sandbox-port",
}  # fmt: skip


def _dechunk(body: bytes) -> bytes:
    out, i = bytearray(), 0
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            raise ValueError("chunked body ends inside a chunk size")
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[j + 2 : j + 2 + size]
        i = j + 2 + size + 2


def parse_response(raw: bytes) -> Response:
    """An HTTP/1.x response read until the server closed, as a starlette Response."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("no complete response head")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP response: {lines[0][:80]!r}")
    status = int(parts[1])
    headers: list[tuple[str, str]] = []
    chunked = False
    for line in lines[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        k, v = k.strip(), v.strip()
        if k.lower() == "transfer-encoding" and "chunked" in v.lower():
            chunked = True
        if k.lower() in _HOP:
            continue
        headers.append((k, v))
    if chunked:
        body = _dechunk(body)
    resp = Response(body, status_code=status)
    for k, v in headers:
        resp.headers.append(k, v)
    return resp


class PortProxy:
    """Routes, authenticates and relays one request into a sandbox's port (module doc)."""

    def __init__(self, ops: NodeOps, token: str | None) -> None:
        self.ops = ops
        self.token = token
        self.link = PortLink(ops, token) if isinstance(ops, PortOps) else None

    def _allowed(self, request: Request | WebSocket, sid: str) -> bool:
        h = request.headers
        auth = h.get("authorization", "")
        node = h.get("x-api-key") or (auth[7:] if auth.lower().startswith("bearer ") else None)
        if self.token is None or (node is not None and token_ok(self.token, node)):
            return True
        # the sandbox's own token, in any of the headers; X-API-Key is what SWE-ReX sends
        own = envd_token(self.token, sid)
        cookie = request.cookies.get(COOKIE)
        given = (h.get("x-access-token"), h.get("e2b-traffic-access-token"), node, cookie)
        return any(g is not None and token_ok(own, g) for g in given)

    def _link_login(self, scope: Any, sid: str, prefix: str) -> Response | None:
        """A ``?corral_token=`` link: the cookie and a redirect without the token (None: no
        such parameter)."""
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), True)
        given = [v for k, v in query if k == LINK_PARAM]
        if not given:
            return None
        own = envd_token(self.token, sid)
        if own is not None and not token_ok(own, given[0]):
            return JSONResponse(e2b_error(401, f"not the token of sandbox {sid!r}"), 401)
        rest = urlencode([(k, v) for k, v in query if k != LINK_PARAM])
        resp = RedirectResponse(scope["path"] + ("?" + rest if rest else ""), status_code=303)
        if own is not None:
            resp.set_cookie(COOKIE, own, path=prefix or "/", httponly=True, samesite="strict")
        return resp

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
        m = HOST_RE.match(host)
        prefix = ""
        if m is not None:
            port, sid, path = int(m.group(1)), m.group(2), scope["path"]
        else:
            pm = PATH_RE.match(scope["path"])
            if pm is None:
                await self._refuse(scope, receive, send, 404, "not a port route")
                return
            sid, port, path = pm.group(1), int(pm.group(2)), pm.group(3) or "/"
            prefix = f"/sandboxes/{sid}/ports/{port}"
        request: Request | WebSocket = (
            WebSocket(scope, receive, send) if scope["type"] == "websocket" else Request(scope)
        )
        login = self._link_login(scope, sid, prefix) if scope["type"] == "http" else None
        if login is not None:
            await login(scope, receive, send)
        elif not self._allowed(request, sid):
            await self._refuse(scope, receive, send, 401, f"no token for sandbox {sid!r}")
        elif not 1 <= port <= 65535:
            await self._refuse(scope, receive, send, 400, f"port {port}: not 1-65535")
        elif SANDBOX_ID_RE.fullmatch(sid) is None:
            await self._refuse(scope, receive, send, 404, f"{sid[:80]!r} is not a sandbox id")
        elif isinstance(request, WebSocket):
            if self.link is None:
                why = "websockets reach ports only on the node itself (not over this client)"
                await self._refuse(scope, receive, send, 501, why)
            else:
                await self.link.websocket(request, sid, port, path, prefix)
        else:
            request = Request(scope, receive)
            try:
                if self.link is not None:
                    resp = await self._direct(request, sid, port, path, prefix)
                else:
                    resp = await self._relay(request, sid, port, path)
            except SandboxNotFound:
                resp = JSONResponse(e2b_error(502, f"The sandbox {sid} was not found"), 502)
            except CorralError as exc:
                resp = JSONResponse(e2b_error(exc.status, str(exc)), exc.status)
            await resp(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Any, receive: Any, send: Any, status: int, message: str) -> None:
        """An E2B error body for HTTP; for a WebSocket, a close before accepting, which the
        server turns into HTTP 403 (ASGI has no other way to refuse a handshake)."""
        if scope["type"] == "websocket":
            await WebSocket(scope, receive, send).close(code=1008, reason=message[:120])
        else:
            await JSONResponse(e2b_error(status, message), status)(scope, receive, send)

    async def _direct(
        self, request: Request, sid: str, port: int, path: str, prefix: str
    ) -> Response:
        assert self.link is not None
        try:
            return await self.link.http(request, sid, port, path, prefix)
        except InvalidRequest:
            # a backend whose network the node cannot enter: one exec per request
            return await self._relay(request, sid, port, path)
        except httpcore.TimeoutException as exc:
            return JSONResponse(e2b_error(504, f"port {port} timed out: {exc}"), 504)
        except httpcore.NetworkError as exc:
            return JSONResponse(e2b_error(502, f"port {port} dropped the request: {exc}"), 502)
        except httpcore.ProtocolError as exc:
            return JSONResponse(e2b_error(502, f"port {port} answered badly: {exc}"), 502)

    async def _relay(self, request: Request, sid: str, port: int, path: str) -> Response:
        body = await request.body()
        if len(body) > MAX_RESPONSE:
            raise InvalidRequest(f"request body over {MAX_RESPONSE} bytes")
        target = path + (("?" + request.url.query) if request.url.query else "")
        lines = [f"{request.method} {target} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
        for k, v in passed_on(request.headers, self.token):
            lines.append(f"{k}: {v}")
        lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
        raw = "\r\n".join(lines).encode("latin-1") + body
        res = await self.ops.exec(
            sid,
            ExecRequest(
                cmd=["bash", "-c", _RELAY, "relay", str(port)],
                stdin=raw,
                user="65534",
                timeout=120,
                output_limit=MAX_RESPONSE,
            ),
        )
        if res.exit_code == 127 and not res.stdout:
            return JSONResponse(e2b_error(501, "the port relay needs bash in the sandbox"), 501)
        if not res.stdout:
            return JSONResponse(
                e2b_error(502, f"nothing answered on port {port} in sandbox {sid}"), 502
            )
        if res.stdout_truncated:
            return JSONResponse(e2b_error(502, f"response over {MAX_RESPONSE} bytes"), 502)
        try:
            return parse_response(res.stdout)
        except ValueError as exc:
            return JSONResponse(e2b_error(502, f"port {port} answered badly: {exc}"), 502)
