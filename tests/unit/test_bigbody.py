"""A big exec result's streamed JSON body (corral.api.bigbody) is byte for byte what
pydantic writes, reads back to the same result, and has the Content-Length it is sent
with; the node's end of the connection has a send buffer with room for a slice."""

from __future__ import annotations

import os

from corral.api.bigbody import BIG, SLICE, exec_result_chunks, exec_result_response
from corral.spec import ExecResult


async def _body(res: ExecResult) -> bytes:
    return b"".join([piece async for piece in exec_result_chunks(res)])


async def test_the_sliced_body_is_pydantics_json() -> None:
    cases = [
        ExecResult(exit_code=0, reason="exited"),
        ExecResult(
            exit_code=None,
            signal=9,
            stdout=b"y\n" * (BIG // 2 + 7),
            reason="output_limit",
            stdout_truncated=True,
            duration=1.25,
        ),
        # random bytes over several slices, lengths that are not multiples of 3
        ExecResult(
            exit_code=3,
            stdout=os.urandom(2 * SLICE + 1),
            stderr=os.urandom(SLICE + 2),
            reason="exited",
            stderr_truncated=True,
        ),
    ]
    for res in cases:
        body = await _body(res)
        assert body == res.model_dump_json().encode()
        resp = exec_result_response(res)
        if len(res.stdout) + len(res.stderr) > BIG:  # streamed, its length told up front
            assert resp.headers["content-length"] == str(len(body))
        assert ExecResult.model_validate_json(body) == res


async def test_a_big_answer_goes_over_http_with_its_length() -> None:
    import shutil
    import socket
    import tempfile
    from pathlib import Path

    import httpx

    import corral
    from corral.api.server import _SNDBUF, NodeServer
    from corral.testing import FakeNode

    d = Path(tempfile.mkdtemp(prefix="corral-big-", dir="/tmp"))  # a short socket path
    try:
        async with NodeServer(FakeNode(), uds=d / "api.sock") as srv:
            async with corral.AsyncClient(srv.address) as client:
                sb = await client.sandboxes.create(image="demo/python")
                word = "x" * (SLICE + 5)  # past BIG: streamed, in more than one slice
                r = await sb.exec(["echo", word], output_limit="8MiB")
                assert r.stdout == word.encode() + b"\n"
            transport = httpx.AsyncHTTPTransport(uds=str(d / "api.sock"))
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as raw:
                resp = await raw.post(
                    f"/v1/sandboxes/{sb.id}/exec",
                    json={"cmd": ["echo", word], "output_limit": 8 << 20},
                )
                assert resp.status_code == 200, resp.text[:300]
                assert "chunked" not in resp.headers.get("transfer-encoding", "")
                assert int(resp.headers["content-length"]) == len(resp.content)
                # the node's end of the connection has room for a slice (api/server.py)
                assert srv._server is not None
                conns = srv._server.server_state.connections
                wmem_max = int(Path("/proc/sys/net/core/wmem_max").read_text())
                sizes = {
                    c.transport.get_extra_info("socket").getsockopt(  # type: ignore[attr-defined]
                        socket.SOL_SOCKET, socket.SO_SNDBUF
                    )
                    for c in conns
                }
                assert sizes == {2 * min(_SNDBUF, wmem_max)}, sizes
    finally:
        shutil.rmtree(d, ignore_errors=True)
