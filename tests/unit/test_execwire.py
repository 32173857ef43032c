"""The binary exec answer (corral.execwire): the node sends it only when asked, the SDK
asks and reads it back to the same result (small and streamed, with random bytes and both
streams), a plain client still gets JSON, and a damaged framing is a clear error."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import corral
from corral import execwire
from corral.api.bigbody import BIG, RAW_SLICE, exec_raw_response
from corral.api.server import NodeServer
from corral.errors import TransportError
from corral.spec import ExecResult
from corral.testing import FakeNode


def test_wants_reads_the_accept_header() -> None:
    assert execwire.wants(execwire.MEDIA_TYPE)
    assert execwire.wants(f"application/json;q=0.5, {execwire.MEDIA_TYPE.upper()}; q=1")
    for no in (None, "", "*/*", "application/json", execwire.MEDIA_TYPE + "x"):
        assert not execwire.wants(no), no


async def _body(resp: object) -> bytes:
    it = getattr(resp, "body_iterator", None)
    if it is None:
        return resp.body  # type: ignore[attr-defined,no-any-return]
    return b"".join([bytes(p) async for p in it])


async def test_the_binary_answer_is_the_same_result() -> None:
    cases = [
        ExecResult(exit_code=0, reason="exited"),
        ExecResult(exit_code=1, stdout=b"out", stderr=b"err\x00\xff", reason="exited"),
        ExecResult(
            exit_code=None,
            signal=9,
            stdout=os.urandom(2 * RAW_SLICE + 3),
            stderr=os.urandom(BIG + 1),
            reason="output_limit",
            stdout_truncated=True,
            duration=1.5,
        ),
    ]
    for res in cases:
        resp = exec_raw_response(res)
        body = await _body(resp)
        assert resp.media_type == execwire.MEDIA_TYPE
        if len(res.stdout) + len(res.stderr) > BIG:
            assert resp.headers["content-length"] == str(len(body))
        assert execwire.parse(resp.headers[execwire.HEADER], body) == res


@pytest.mark.parametrize(
    "header, body, why",
    [
        (None, b"{}", "without its"),
        ("head=2, stdout=1", b"{}x", "expected head=N"),
        ("head=2, stdout=1, stderr=0, head=2", b"{}x", "expected head=N"),
        ("head=2, stdout=-1, stderr=0", b"{}x", "expected head=N"),
        ("head=2, stdout=5, stderr=0", b"{}x", "the body has 3"),
    ],
)
def test_a_damaged_framing_is_named(header: str | None, body: bytes, why: str) -> None:
    with pytest.raises(execwire.FramingError, match=why):
        execwire.parse(header, body)


def test_a_head_with_output_of_its_own_is_refused() -> None:
    head = ExecResult(exit_code=0, stdout=b"sneaky", reason="exited").model_dump_json().encode()
    with pytest.raises(execwire.FramingError, match="output of its own"):
        execwire.parse(f"head={len(head)}, stdout=0, stderr=0", head)


@pytest.fixture
async def served() -> AsyncIterator[tuple[NodeServer, Path]]:
    d = Path(tempfile.mkdtemp(prefix="corral-wire-", dir="/tmp"))  # a short socket path
    try:
        async with NodeServer(FakeNode(), uds=d / "api.sock") as srv:
            yield srv, d / "api.sock"
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_the_sdk_asks_for_it_and_plain_clients_get_json(
    served: tuple[NodeServer, Path],
) -> None:
    srv, sock = served
    word = "x" * (3 * RAW_SLICE)  # past BIG: sent in pieces
    async with corral.AsyncClient(srv.address) as client:
        sb = await client.sandboxes.create(image="demo/python")
        small = await sb.exec(["echo", "hi"])
        assert (small.stdout, small.exit_code) == (b"hi\n", 0)
        big = await sb.exec(["echo", word], output_limit="8MiB")
        assert big.stdout == word.encode() + b"\n"
    transport = httpx.AsyncHTTPTransport(uds=str(sock))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as raw:
        url, req = f"/v1/sandboxes/{sb.id}/exec", {"cmd": ["echo", "hi"]}
        plain = await raw.post(url, json=req)
        assert plain.headers["content-type"] == "application/json"
        assert ExecResult.model_validate_json(plain.content).stdout == b"hi\n"
        binary = await raw.post(url, json=req, headers={"accept": execwire.MEDIA_TYPE})
        assert binary.headers["content-type"].startswith(execwire.MEDIA_TYPE)
        assert binary.content.endswith(b"hi\n")
        got = execwire.parse(binary.headers[execwire.HEADER], binary.content)
        assert got.stdout == b"hi\n"


async def test_the_sdk_names_a_damaged_answer(
    served: tuple[NodeServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, _ = served
    monkeypatch.setattr(execwire, "framing_header", lambda h, o, e: "head=1, stdout=0, stderr=0")
    async with corral.AsyncClient(srv.address) as client:
        sb = await client.sandboxes.create(image="demo/python")
        with pytest.raises(TransportError, match="a damaged answer"):
            await sb.exec(["echo", "hi"])
