"""The REST API as a client without the SDK sees it, and its server."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

import corral
from corral.api import NodeServer, create_app
from corral.ops import NodeOps
from corral.sdk._http import HTTPOps
from corral.spec import ExecChunk, ExecRequest, ExecResult, NodeStatus
from corral.testing import FakeNode

TOKEN = "s3cret-token"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="corral-t-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _asgi(ops: NodeOps | None = None, **kw: object) -> httpx.AsyncClient:
    app = create_app(ops or FakeNode(), **kw)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://corral.test")


@pytest.fixture
async def api() -> AsyncIterator[httpx.AsyncClient]:
    async with _asgi() as c:
        yield c


@pytest.fixture
async def uds(short_dir: Path) -> AsyncIterator[tuple[httpx.AsyncClient, FakeNode]]:
    """A real uvicorn on a unix socket, and a raw httpx client on it."""
    node = _Flaky()
    async with NodeServer(node, uds=short_dir / "api.sock") as srv:
        assert srv.address == f"unix://{short_dir}/api.sock"
        transport = httpx.AsyncHTTPTransport(uds=str(short_dir / "api.sock"))
        async with httpx.AsyncClient(transport=transport, base_url="http://corral") as c:
            yield c, node


class _Flaky(FakeNode):
    """A node with bugs on demand."""

    async def node_status(self) -> NodeStatus:
        raise RuntimeError("boom: a bug in the node")

    async def exec_stream(self, sandbox_id, req):  # type: ignore[no-untyped-def]
        if req.cmd[0] != "break-mid-stream":
            async for item in super().exec_stream(sandbox_id, req):
                yield item
            return
        yield ExecChunk(stream="stdout", data=b"partial")
        raise corral.SandboxError("the sandbox's init stopped answering")


def _err(resp: httpx.Response) -> tuple[str, str]:
    body = resp.json()["error"]
    return body["kind"], body["message"]


# ----------------------------------------------------------------------- auth
async def test_auth_required_on_every_route() -> None:
    async with _asgi(token=TOKEN) as c:
        for path in ("/v1/healthz", "/v1/node", "/v1/sandboxes", "/openapi.json", "/v1/nope"):
            resp = await c.get(path)
            assert resp.status_code == 401, path
            assert _err(resp)[0] == "Unauthorized"
            assert resp.headers["www-authenticate"] == "Bearer"
            resp = await c.get(path, headers={"authorization": "Bearer wrong"})
            assert resp.status_code == 401, path
            resp = await c.get(path, headers={"authorization": TOKEN})  # scheme missing
            assert resp.status_code == 401, path
        ok = await c.get("/v1/healthz", headers={"authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json() == {"ok": True}


async def test_sdk_with_and_without_token() -> None:
    app = create_app(FakeNode(), token=TOKEN)
    for token, works in ((TOKEN, True), ("nope", False), (None, False)):
        ops = HTTPOps("http://corral.test", token=token, transport=httpx.ASGITransport(app))
        async with corral.AsyncClient(ops=ops) as client:
            if works:
                assert (await client.images.get("demo/python")).name == "demo/python"
            else:
                with pytest.raises(corral.Unauthorized, match="bearer token"):
                    await client.images.get("demo/python")
        await ops.close()


async def test_tcp_needs_a_token_even_on_loopback() -> None:
    for host in ("127.0.0.1", "0.0.0.0", "::1"):
        with pytest.raises(corral.InvalidRequest, match="without a token"):
            NodeServer(FakeNode(), host=host, port=0)
    with pytest.raises(corral.InvalidRequest, match="exactly one"):
        NodeServer(FakeNode(), token=TOKEN)


async def test_tcp_with_token_through_the_sdk() -> None:
    async with NodeServer(FakeNode(), host="127.0.0.1", port=0, token=TOKEN) as srv:
        assert srv.address.startswith("http://127.0.0.1:") and not srv.address.endswith(":0")
        async with corral.AsyncClient(srv.address, token=TOKEN) as client:
            sb = await client.sandboxes.create(image="demo/python")
            assert (await sb.exec(["echo", "tcp"])).stdout == b"tcp\n"
        async with corral.AsyncClient(srv.address, token="wrong") as client:
            with pytest.raises(corral.Unauthorized):
                await client.node_status()


# ------------------------------------------------------------- validation
async def test_bad_spec_names_the_field(api: httpx.AsyncClient) -> None:
    resp = await api.post(
        "/v1/sandboxes", json={"image": "demo/python", "limits": {"memory": "lots"}}
    )
    assert resp.status_code == 422
    kind, msg = _err(resp)
    assert kind == "InvalidRequest" and msg.startswith("limits.memory: ") and "'lots'" in msg
    resp = await api.post("/v1/sandboxes", json={"image": "demo/python", "limits": {"bogus": 1}})
    assert _err(resp) == ("InvalidRequest", "limits.bogus: Extra inputs are not permitted")
    resp = await api.post("/v1/sandboxes", json={"limits": {}})
    assert _err(resp) == ("InvalidRequest", "image: Field required")
    resp = await api.post("/v1/sandboxes", content=b"")
    assert resp.status_code == 422 and "Field required" in _err(resp)[1]
    # the SDK maps the same answer to the same exception
    ops = HTTPOps("http://corral.test", transport=api._transport)  # type: ignore[arg-type]
    with pytest.raises(corral.InvalidRequest, match=r"limits\.memory"):
        # the body the SDK would send if it skipped its own validation
        await ops._call("POST", "/sandboxes", json={"image": "x", "limits": {"memory": "lots"}})


async def test_bad_query_and_labels(api: httpx.AsyncClient) -> None:
    sb = (await api.post("/v1/sandboxes", json={"image": "demo/python"})).json()["id"]
    resp = await api.get(f"/v1/sandboxes/{sb}/files", params={"path": "/x", "offset": -1})
    assert resp.status_code == 422 and _err(resp)[1].startswith("offset: ")
    resp = await api.get(f"/v1/sandboxes/{sb}/files")
    assert _err(resp) == ("InvalidRequest", "path: Field required")
    resp = await api.get("/v1/sandboxes", params={"label": "nokey"})
    assert resp.status_code == 400 and "label" in _err(resp)[1]
    resp = await api.get("/v1/sandboxes", params=[("label", "a=1"), ("label", "b=2")])
    assert resp.status_code == 200 and resp.json() == []


async def test_unknown_routes_and_methods(api: httpx.AsyncClient) -> None:
    resp = await api.get("/v1/nope")
    assert resp.status_code == 404 and _err(resp)[0] == "NotFound"
    resp = await api.patch("/v1/sandboxes")
    assert resp.status_code == 405 and _err(resp)[0] == "InvalidRequest"
    resp = await api.get("/v1/sandboxes/sb-000000000000")
    assert resp.status_code == 404 and _err(resp)[0] == "SandboxNotFound"


async def test_body_limit() -> None:
    async with _asgi(max_body=1024) as c:
        sb = (await c.post("/v1/sandboxes", json={"image": "demo/python"})).json()["id"]
        url = f"/v1/sandboxes/{sb}/files"
        resp = await c.put(url, params={"path": "/work/big"}, content=b"x" * 2048)
        assert resp.status_code == 413 and _err(resp)[0] == "InvalidRequest"
        assert "1024" in _err(resp)[1]

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
            for _ in range(4):
                yield b"y" * 512

        resp = await c.put(url, params={"path": "/work/big"}, content=chunked())
        assert resp.status_code == 413 and _err(resp)[0] == "InvalidRequest"
        resp = await c.post(
            "/v1/sandboxes",
            content=b'{"image": "' + b"z" * 2000 + b'"}',
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 413
        resp = await c.put(url, params={"path": "/work/small"}, content=b"x" * 1024)
        assert resp.status_code == 204


# ------------------------------------------------------- robustness on uvicorn
async def test_malformed_json_then_still_alive(uds: tuple[httpx.AsyncClient, FakeNode]) -> None:
    c, _ = uds
    for body in (b"{not json", b"[1, 2", b"\xff\xfe"):
        resp = await c.post(
            "/v1/sandboxes", content=body, headers={"content-type": "application/json"}
        )
        assert resp.status_code == 422
        kind, msg = _err(resp)
        assert kind == "InvalidRequest" and "not valid JSON" in msg
    resp = await c.post("/v1/sandboxes", json=["a", "list"])
    assert resp.status_code == 422 and _err(resp)[0] == "InvalidRequest"
    assert (await c.get("/v1/healthz")).json() == {"ok": True}


async def test_internal_error_is_500_and_logged(
    uds: tuple[httpx.AsyncClient, FakeNode], caplog: pytest.LogCaptureFixture
) -> None:
    c, _ = uds
    with caplog.at_level(logging.ERROR, logger="corral.api"):
        resp = await c.get("/v1/node")
    assert resp.status_code == 500
    kind, msg = _err(resp)
    assert kind == "CorralError" and "internal error" in msg and "boom" not in msg
    assert any(
        "boom" in r.getMessage() or (r.exc_info and "boom" in str(r.exc_info[1]))
        for r in caplog.records
    )
    assert (await c.get("/v1/healthz")).status_code == 200


async def test_exec_stream_wire_format(uds: tuple[httpx.AsyncClient, FakeNode]) -> None:
    c, _ = uds
    sb = (await c.post("/v1/sandboxes", json={"image": "demo/python"})).json()["id"]
    req = ExecRequest(cmd=["sh", "-c", "echo out; echo err >&2"]).model_dump_json()
    async with c.stream(
        "POST",
        f"/v1/sandboxes/{sb}/exec/stream",
        content=req,
        headers={"content-type": "application/json"},
    ) as resp:
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) async for line in resp.aiter_lines() if line]
    assert lines[:2] == [
        {"stream": "stdout", "data": base64.b64encode(b"out\n").decode()},
        {"stream": "stderr", "data": base64.b64encode(b"err\n").decode()},
    ]
    assert ExecResult.model_validate(lines[2]["result"]).exit_code == 0
    resp = await c.post(
        "/v1/sandboxes/sb-000000000000/exec/stream",
        content=req,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 404 and _err(resp)[0] == "SandboxNotFound"


async def test_error_mid_stream_reaches_the_sdk(short_dir: Path) -> None:
    async with NodeServer(_Flaky(), uds=short_dir / "api.sock") as srv:
        async with corral.AsyncClient(srv.address) as client:
            sb = await client.sandboxes.create(image="demo/python")
            got = []
            with pytest.raises(corral.SandboxError, match="stopped answering"):
                async with sb.exec_stream(["break-mid-stream"]) as stream:
                    async for chunk in stream:
                        got.append(chunk.data)
            assert got == [b"partial"]
            assert (await sb.exec(["echo", "after"])).stdout == b"after\n"


async def test_openapi(api: httpx.AsyncClient) -> None:
    spec = (await api.get("/openapi.json")).json()
    paths = spec["paths"]
    for p in (
        "/v1/sandboxes",
        "/v1/sandboxes/{sandbox_id}/exec",
        "/v1/images/{name}",
        "/v1/sandboxes/{sandbox_id}/files/tar",
        "/v1/events",
        "/v1/node",
        "/v1/healthz",
    ):
        assert p in paths, p
    assert "SandboxSpec" in spec["components"]["schemas"]
    body = paths["/v1/sandboxes"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/SandboxSpec")


# --------------------------------------------------------------- the socket
async def test_socket_mode_and_stale_socket(short_dir: Path) -> None:
    path = short_dir / "api.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # bound, never listening: what a crashed server leaves behind
    stale.close()
    async with NodeServer(FakeNode(), uds=path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(corral.Conflict, match="already listens"):
            await NodeServer(FakeNode(), uds=path).start()
    assert not path.exists()
    path.write_text("not a socket")
    with pytest.raises(corral.InvalidRequest, match="not a socket"):
        await NodeServer(FakeNode(), uds=path).start()
    assert path.read_text() == "not a socket"


async def test_serve_stops_gracefully_on_sigterm(short_dir: Path) -> None:
    path = short_dir / "api.sock"
    code = textwrap.dedent(f"""
        import asyncio
        from pathlib import Path
        from corral.api import serve
        from corral.testing import FakeNode
        asyncio.run(serve(FakeNode(), uds=Path({str(path)!r})))
        print("clean exit")
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        for _ in range(500):
            if path.exists():
                break
            await asyncio.sleep(0.01)
        async with corral.AsyncClient(f"unix://{path}") as client:
            sb = await client.sandboxes.create(image="demo/python")
            in_flight = asyncio.ensure_future(sb.exec("sleep 0.5; echo finished"))
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            r = await in_flight  # the request already running is allowed to finish
            assert r.stdout == b"finished\n"
        out, err = await asyncio.to_thread(proc.communicate, timeout=20)
        assert proc.returncode == 0, err.decode()
        assert out.decode().strip() == "clean exit"
        assert not path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_leaving_a_stream_early_ends_it_on_the_node(short_dir: Path) -> None:
    ended = asyncio.Event()

    class Tracking(FakeNode):
        async def exec_stream(self, sandbox_id, req):  # type: ignore[no-untyped-def]
            try:
                async for item in super().exec_stream(sandbox_id, req):
                    yield item
            finally:
                ended.set()

    async with NodeServer(Tracking(), uds=short_dir / "api.sock") as srv:
        async with corral.AsyncClient(srv.address) as client:
            sb = await client.sandboxes.create(image="demo/python")
            async with sb.exec_stream("echo first; sleep 30; echo never") as stream:
                async for chunk in stream:
                    assert chunk.data == b"first\n"
                    break
            await asyncio.wait_for(ended.wait(), 5)  # the node saw the client go
            assert (await sb.exec(["echo", "next"])).stdout == b"next\n"


class _FullDisk(FakeNode):
    """A node whose sandbox disks are full, and whose scratch filesystem is, for one path."""

    async def file_write(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, append: bool = False
    ) -> None:
        self._sb(sandbox_id)
        if path == "/scratch-full":
            raise corral.ScratchFull(f"{path}: no space left on the node's scratch filesystem")
        raise corral.QuotaExceeded(f"{path}: disk quota exceeded: the sandbox's disk is full")


async def test_full_disk_kinds_cross_the_wire(short_dir: Path) -> None:
    async with NodeServer(_FullDisk(), uds=short_dir / "api.sock") as srv:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=srv.address[7:])) as c:
            sb = (await c.post("http://corral/v1/sandboxes", json={"image": "demo/python"})).json()
            resp = await c.put(
                f"http://corral/v1/sandboxes/{sb['id']}/files?path=/big", content=b"x"
            )
            assert resp.status_code == 507 and _err(resp)[0] == "QuotaExceeded"
        async with corral.AsyncClient(srv.address) as client:
            box = await client.sandboxes.get(sb["id"])
            with pytest.raises(corral.QuotaExceeded, match="disk quota exceeded"):
                await box.files.write("/big", b"x")
            with pytest.raises(corral.ScratchFull, match="scratch") as ei:
                await box.files.write("/scratch-full", b"x")
            assert isinstance(ei.value, corral.CapacityError) and ei.value.status == 503
