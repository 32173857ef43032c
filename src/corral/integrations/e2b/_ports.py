"""Ports: an HTTP request to a server the guest runs on a port, relayed through exec.

Two forms reach it: the path ``/sandboxes/{id}/ports/{port}/...`` and E2B's host form
``Host: {port}-{sandboxID}.{domain}`` (what ``sandbox.get_host(port)`` names). Each request
must carry the node's token (``X-API-KEY`` or ``Authorization: Bearer``) or the sandbox's
own access token (``X-Access-Token`` or ``E2b-Traffic-Access-Token``).

The relay is one exec per request: bash's ``/dev/tcp`` connects to ``127.0.0.1:{port}``
inside the sandbox's network namespace, the request goes in on stdin and the response
comes back on stdout. So a guest without any network of its own is reachable, only on
its loopback, and through nothing but the operations interface (it works unchanged over
a cluster client). The price: the request and response are buffered whole (64 MiB at
most), ``Connection: close`` is forced, websockets are not relayed, and the guest needs
bash (``/dev/tcp``). A relay that lives across requests is future work.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.errors import CorralError, InvalidRequest, SandboxNotFound
from corral.integrations.e2b._common import e2b_error, envd_token, token_ok
from corral.ops import NodeOps
from corral.spec import ExecRequest

HOST_RE = re.compile(r"^(\d{1,5})-(sb-[0-9a-z]+-[0-9a-z]+)(?:\.|:|$)")
"""The E2B host form: ``8000-sb-abc-node.example.com``."""
PATH_RE = re.compile(r"^/sandboxes/([^/]+)/ports/(\d{1,5})(/.*)?$")
MAX_RESPONSE = 64 << 20

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
    """Relays one request into a sandbox's port (see the module docstring)."""

    def __init__(self, ops: NodeOps, token: str | None) -> None:
        self.ops = ops
        self.token = token

    def _allowed(self, request: Request, sid: str) -> bool:
        h = request.headers
        auth = h.get("authorization", "")
        node = h.get("x-api-key") or (auth[7:] if auth.lower().startswith("bearer ") else None)
        if self.token is None or (node is not None and token_ok(self.token, node)):
            return True
        own = h.get("x-access-token") or h.get("e2b-traffic-access-token")
        return own is not None and token_ok(envd_token(self.token, sid), own)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        m = HOST_RE.match(request.headers.get("host", ""))
        if m is not None:
            port, sid, path = int(m.group(1)), m.group(2), scope["path"]
        else:
            pm = PATH_RE.match(scope["path"])
            if pm is None:
                resp: Response = JSONResponse(e2b_error(404, "not a port route"), 404)
                await resp(scope, receive, send)
                return
            sid, port, path = pm.group(1), int(pm.group(2)), pm.group(3) or "/"
        if scope["type"] != "http":
            resp = JSONResponse(e2b_error(501, "websockets are not relayed to ports yet"), 501)
        elif not self._allowed(request, sid):
            resp = JSONResponse(e2b_error(401, f"no token for sandbox {sid!r}"), 401)
        elif not 1 <= port <= 65535:
            resp = JSONResponse(e2b_error(400, f"port {port}: not 1-65535"), 400)
        else:
            try:
                resp = await self._relay(request, sid, port, path)
            except SandboxNotFound:
                resp = JSONResponse(e2b_error(502, f"The sandbox {sid} was not found"), 502)
            except CorralError as exc:
                resp = JSONResponse(e2b_error(exc.status, str(exc)), exc.status)
        await resp(scope, receive, send)

    async def _relay(self, request: Request, sid: str, port: int, path: str) -> Response:
        body = await request.body()
        if len(body) > MAX_RESPONSE:
            raise InvalidRequest(f"request body over {MAX_RESPONSE} bytes")
        target = path + (("?" + request.url.query) if request.url.query else "")
        lines = [f"{request.method} {target} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
        for k, v in request.headers.items():
            if k.lower() not in _HOP:
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
