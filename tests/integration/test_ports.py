"""Ports through the node: HTTP and WebSocket servers in a sandbox with no network of its
own, reached with corral's SDK (``sb.ports.expose``) over a real node's HTTP server; a
missing token, another sandbox's token, and a port nothing listens on are refused."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

import corral
from corral.api.server import NodeServer
from corral.host import leaks
from corral.node import Node
from corral.sdk._sandbox import Sandbox
from tests.conftest import TAG
from tests.integration.conftest import open_node

STATE = Path(f"/var/lib/corral-test{TAG}-ports")
RUN = Path(f"/run/corral-test{TAG}-ports")
SUBTREE = f"corral-test{TAG}-ports"
TOKEN = "ports-test-token"

# The guest's server: plain HTTP (GET echoes the path, POST echoes the body with its
# length) and a WebSocket echo on /ws, stdlib only (the test image has no websockets
# package). It writes /tmp/ready once it listens: the test's readiness signal.
SERVER = r"""
import base64, hashlib, http.server, socketserver, struct, sys

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

def recv_exact(f, n):
    b = f.read(n)
    if len(b) < n:
        raise EOFError
    return b

def ws_echo(h):
    key = h.headers["Sec-WebSocket-Key"].encode()
    acc = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
    h.send_response(101)
    h.send_header("Upgrade", "websocket")
    h.send_header("Connection", "Upgrade")
    h.send_header("Sec-WebSocket-Accept", acc)
    if h.headers.get("Sec-WebSocket-Protocol"):
        h.send_header("Sec-WebSocket-Protocol", h.headers["Sec-WebSocket-Protocol"].split(",")[0])
    h.end_headers()
    h.wfile.flush()
    f = h.rfile
    while True:
        b0, b1 = recv_exact(f, 2)
        op, n = b0 & 0x0F, b1 & 0x7F
        if n == 126:
            n = struct.unpack(">H", recv_exact(f, 2))[0]
        elif n == 127:
            n = struct.unpack(">Q", recv_exact(f, 8))[0]
        mask = recv_exact(f, 4)
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(recv_exact(f, n)))
        if op == 8:
            h.wfile.write(b"\x88\x02\x03\xe8"); h.wfile.flush()
            return
        if op == 1 and data == b"bye":
            h.wfile.write(b"\x88\x02\x0f\xa0"); h.wfile.flush()  # close 4000
            return
        out = data if op == 2 else b"echo:" + data
        hdr = bytes([0x80 | op])
        if len(out) < 126:
            hdr += bytes([len(out)])
        elif len(out) < 65536:
            hdr += bytes([126]) + struct.pack(">H", len(out))
        else:
            hdr += bytes([127]) + struct.pack(">Q", len(out))
        h.wfile.write(hdr + out); h.wfile.flush()

class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def _send(self, body, ctype="text/plain"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return ws_echo(self)
        seen = {k.lower(): v for k, v in self.headers.items()}
        import json
        self._send(json.dumps({"path": self.path, "headers": seen}).encode(), "application/json")
    def do_POST(self):
        n = int(self.headers["Content-Length"])
        body = self.rfile.read(n)
        self._send(hashlib.sha256(body).hexdigest().encode() + b" %d" % len(body))

class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

srv = S(("127.0.0.1", int(sys.argv[1])), H)
open("/tmp/ready", "w").close()
srv.serve_forever()
"""


@pytest.fixture(scope="module")
async def served(images_ready: None) -> AsyncIterator[tuple[Node, str]]:
    async with open_node(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, gc=True) as node:
        async with NodeServer(node, host="127.0.0.1", port=0, token=TOKEN) as srv:
            yield node, srv.address
    found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    assert leaks.total(found) == 0, found


@pytest.fixture(scope="module")
async def client(served: tuple[Node, str]) -> AsyncIterator[corral.AsyncClient]:
    async with corral.AsyncClient(served[1], token=TOKEN) as c:
        yield c


async def _serving(client: corral.AsyncClient, port: int = 8000) -> Sandbox:
    sb = await client.sandboxes.create(image="test/debian", ttl=600)
    await sb.files.write("/tmp/srv.py", SERVER.encode())
    await sb.spawn(["python3", "/tmp/srv.py", str(port)])
    r = await sb.exec(["bash", "-c", "until [ -e /tmp/ready ]; do sleep 0.05; done"], timeout=60)
    assert r.exit_code == 0
    return sb


@pytest.fixture(scope="module")
async def sb(client: corral.AsyncClient) -> AsyncIterator[Sandbox]:
    s = await _serving(client)
    yield s
    await s.destroy()


async def test_http_by_path_and_host(sb: Sandbox, served: tuple[Node, str]) -> None:
    ep = await sb.ports.expose(8000)
    assert ep.url == f"{served[1]}/sandboxes/{sb.id}/ports/8000/"
    assert ep.host_url is not None and ep.host_url.startswith(f"http://8000-{sb.id}.localhost:")
    assert list(ep.headers) == ["X-Access-Token"]
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.get(ep.url + "a/b?x=1", headers=ep.headers)
        assert r.status_code == 200, r.text
        seen = r.json()
        assert seen["path"] == "/a/b?x=1"
        # the proxy's credentials stay on the node; the guest learns where it is mounted
        assert "x-access-token" not in seen["headers"]
        assert seen["headers"]["x-forwarded-prefix"] == f"/sandboxes/{sb.id}/ports/8000"
        # the guest application's own credentials pass; the node's token never does
        r = await c.get(ep.url, headers={**ep.headers, "Authorization": "Bearer app-secret"})
        assert r.json()["headers"]["authorization"] == "Bearer app-secret"
        r = await c.get(ep.url, headers={"X-API-KEY": TOKEN})
        assert "x-api-key" not in r.json()["headers"]
        r = await c.get(ep.url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and "authorization" not in r.json()["headers"]
        # SWE-ReX sends the sandbox's own token as X-API-Key: accepted, and passed on
        r = await c.get(ep.url, headers={"X-API-Key": ep.headers["X-Access-Token"]})
        assert r.status_code == 200 and "x-api-key" in r.json()["headers"]
        # the host form, by Host header (what a wildcard DNS name for the node gives)
        host = {"Host": f"8000-{sb.id}.localhost", **ep.headers}
        r = await c.get(served[1] + "/c", headers=host)
        assert r.status_code == 200 and r.json()["path"] == "/c"
        # a streamed body both ways, bigger than any buffer on the way
        body = os.urandom(9 << 20)
        r = await c.post(ep.url + "up", headers=ep.headers, content=body)
        assert r.status_code == 200
        assert r.text == f"{hashlib.sha256(body).hexdigest()} {len(body)}"
        # several requests over one client connection
        for i in range(5):
            assert (await c.get(ep.url + f"k{i}", headers=ep.headers)).json()["path"] == f"/k{i}"


async def test_websocket_echo(sb: Sandbox) -> None:
    ep = await sb.ports.expose(8000)
    async with connect(
        ep.ws_url + "ws",
        additional_headers=ep.headers,
        subprotocols=["chat"],  # type: ignore[list-item]
    ) as ws:
        assert ws.subprotocol == "chat"
        await ws.send("hello")
        assert await ws.recv() == "echo:hello"
        blob = os.urandom(200_000)
        await ws.send(blob)
        assert await ws.recv() == blob
        await ws.send("bye")  # the guest closes with 4000: the client sees that code
        with pytest.raises(Exception):
            await ws.recv()
        assert ws.close_code == 4000


async def test_refusals(sb: Sandbox, client: corral.AsyncClient, served: tuple[Node, str]) -> None:
    ep = await sb.ports.expose(8000)
    other = await client.sandboxes.create(image="test/debian", ttl=600)
    try:
        theirs = (await other.ports.expose(8000)).headers
        async with httpx.AsyncClient(timeout=60) as c:
            assert (await c.get(ep.url)).status_code == 401
            assert (await c.get(ep.url, headers={"X-Access-Token": "nope"})).status_code == 401
            assert (await c.get(ep.url, headers=theirs)).status_code == 401
            # the node's token opens every sandbox's ports
            assert (await c.get(ep.url, headers={"X-API-KEY": TOKEN})).status_code == 200
            # nothing listens on this port of the other sandbox
            r = await c.get(f"{served[1]}/sandboxes/{other.id}/ports/8000/", headers=theirs)
            assert r.status_code == 502 and "nothing listens" in r.json()["message"]
            r = await c.get(f"{served[1]}/sandboxes/nope/ports/8000/", headers={"X-API-KEY": TOKEN})
            assert r.status_code == 404
        for headers in ({}, theirs):
            with pytest.raises(InvalidStatus) as ei:
                async with connect(ep.ws_url + "ws", additional_headers=headers):
                    pass
            assert ei.value.response.status_code == 403
    finally:
        await other.destroy()


async def test_guest_has_no_network(sb: Sandbox) -> None:
    """The server is reached although the guest cannot reach out: no route but loopback."""
    code = "import socket; socket.create_connection(('10.0.0.1', 80), timeout=3)"
    r = await sb.exec(["python3", "-c", code], timeout=30)
    assert r.exit_code != 0


async def test_cli_port(sb: Sandbox, served: tuple[Node, str]) -> None:
    """In a thread: the CLI runs its own event loop, the node serves on the test's."""
    from typer.testing import CliRunner

    from corral.cli.app import app

    args = ["--node", served[1], "--token", TOKEN, "sandbox", "port", sb.id, "8000"]
    res = await asyncio.to_thread(CliRunner().invoke, app, args)
    assert res.exit_code == 0, res.output
    assert res.output.strip() == f"{served[1]}/sandboxes/{sb.id}/ports/8000/"
    res = await asyncio.to_thread(CliRunner().invoke, app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["headers"]["X-Access-Token"]


async def test_a_paused_sandbox_wakes_for_its_port(sb: Sandbox) -> None:
    ep = await sb.ports.expose(8000)
    await sb.pause()
    assert (await sb.refresh()).state == "paused"
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.get(ep.url + "after-pause", headers=ep.headers)
    assert r.status_code == 200 and r.json()["path"] == "/after-pause"
    assert (await sb.refresh()).state == "running"


async def test_browser_link_sets_a_cookie(sb: Sandbox) -> None:
    """``?corral_token=`` answers a redirect and an HttpOnly cookie for this port's path;
    the cookie then authenticates HTTP and WebSocket, and never reaches the guest."""
    ep = await sb.ports.expose(8000)
    token = ep.headers["X-Access-Token"]
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.get(ep.url + "page?a=1&corral_token=" + token)
        assert r.status_code == 303
        assert r.headers["location"] == f"/sandboxes/{sb.id}/ports/8000/page?a=1"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert f"Path=/sandboxes/{sb.id}/ports/8000" in cookie
        r = await c.get(ep.url + "page?a=1", headers={"Cookie": f"corral_port={token}; app=1"})
        assert r.status_code == 200
        assert r.json()["headers"]["cookie"] == "app=1"
        # another sandbox's token, or the node's, in a link: refused
        assert (await c.get(ep.url + "?corral_token=nope")).status_code == 401
        assert (await c.get(ep.url + f"?corral_token={TOKEN}")).status_code == 401
    async with connect(
        ep.ws_url + "ws", additional_headers={"Cookie": f"corral_port={token}"}
    ) as ws:
        await ws.send("c")
        assert await ws.recv() == "echo:c"
