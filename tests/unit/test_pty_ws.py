"""The terminal websocket (``/v1/sandboxes/{id}/pty``) against FakeNode's toy terminal:
the protocol, its errors, auth, and ``corral sandbox shell`` over HTTP on a real pty."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from corral.api.server import NodeServer
from corral.errors import SandboxNotFound, Unauthorized
from corral.sdk._http import HTTPOps
from corral.spec import PtyRequest, SandboxSpec
from corral.testing import FakeNode


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[FakeNode, HTTPOps, str]]:
    node = FakeNode()
    sid = (await node.sandbox_create(SandboxSpec(image="demo/base"))).id
    async with NodeServer(node, uds=tmp_path / "api.sock") as srv:
        ops = HTTPOps(srv.address)
        try:
            yield node, ops, sid
        finally:
            await ops.close()


SH = PtyRequest(cmd=["/bin/sh"])


async def _drain(ws: Any) -> list[bytes | str]:
    """Every message until the close, whatever its code."""
    msgs: list[bytes | str] = []
    with contextlib.suppress(ConnectionClosed):
        while True:
            msgs.append(await ws.recv())
    return msgs


async def _session(s: Any, *lines: bytes) -> bytes:
    out = bytearray()
    for line in lines:
        await s.write(line)
    async for data in s:
        assert isinstance(data, bytes)
        out += data
    return bytes(out)


async def test_run_and_exit_code(served: tuple[FakeNode, HTTPOps, str]) -> None:
    _, ops, sid = served
    async with await ops.pty(sid, PtyRequest(env={"WHO": "corral"})) as s:
        assert s.cmd == ["/bin/sh"]  # the fake has no bash: the node's default falls back
        assert s.pid > 0
        out = await _session(s, b"tty\r", b"echo hi $WHO\r", b"exit 3\r")
    assert b"/dev/pts/" in out and b"hi corral\r\n" in out
    assert s.result is not None and (s.result.reason, s.result.exit_code) == ("exited", 3)


async def test_cwd_reaches_the_terminal(served: tuple[FakeNode, HTTPOps, str]) -> None:
    _, ops, sid = served
    async with await ops.pty(sid, PtyRequest(cmd=["/bin/sh"], cwd="/tmp")) as s:
        out = await _session(s, b"pwd\r", b"exit 0\r")
    assert b"/tmp\r\n" in out


async def test_resize_signal_eof(served: tuple[FakeNode, HTTPOps, str]) -> None:
    _, ops, sid = served
    async with await ops.pty(sid, SH) as s:
        await s.resize(50, 132)
        await s.write(b"stty size\r")
        await s.write(b"false\r")
        await s.close_stdin()  # EOF on an empty line: the shell ends with the last status
        out = await _session(s)
    assert b"50 132" in out
    assert s.result is not None and (s.result.reason, s.result.exit_code) == ("exited", 1)

    async with await ops.pty(sid, SH) as s:
        await s.signal(2)
        await _session(s)
    assert s.result is not None and (s.result.reason, s.result.signal) == ("signaled", 2)


async def test_eof_ends_the_shell(served: tuple[FakeNode, HTTPOps, str]) -> None:
    _, ops, sid = served
    async with await ops.pty(sid, SH) as s:
        await s.write(b"false\r")
        await s.close_stdin()
        await _session(s)
    assert s.result is not None and s.result.exit_code == 1


async def test_unknown_sandbox_names_it(served: tuple[FakeNode, HTTPOps, str]) -> None:
    _, ops, _ = served
    with pytest.raises(SandboxNotFound, match="sb-nosuchthing"):
        async with await ops.pty("sb-nosuchthing", SH):
            pass
    with pytest.raises(SandboxNotFound, match="sb-nosuchthing"):  # default shell lookup too
        async with await ops.pty("sb-nosuchthing", PtyRequest()):
            pass


async def test_raw_protocol_close_codes(served: tuple[FakeNode, HTTPOps, str]) -> None:
    node, ops, sid = served
    path = ops._where
    uri = f"ws://corral/v1/sandboxes/{sid}/pty?cmd=/bin/sh&rows=30&cols=90"
    async with unix_connect(path, uri=uri) as ws:
        started = json.loads(await ws.recv())
        assert started["started"]["cmd"] == ["/bin/sh"]
        await ws.send(b"stty size\r")
        await ws.send(json.dumps({"eof": True}))
        frames = [m async for m in ws]
        assert ws.close_code == 1000
    assert b"30 90" in b"".join(m for m in frames if isinstance(m, bytes))
    exit_ = json.loads(frames[-1])["exit"]
    assert (exit_["reason"], exit_["exit_code"], exit_["signal"]) == ("exited", 0, None)

    async with unix_connect(path, uri="ws://corral/v1/sandboxes/sb-gone/pty") as ws:
        err = json.loads(await ws.recv())
        assert err["error"]["kind"] == "SandboxNotFound"
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert ws.close_code == 4404 and "sb-gone" in (ws.close_reason or "")

    for bad, words in (
        ("not json", "control message"),
        ('{"resize": [0, 80]}', "resize rows"),
        ('{"signal": 99}', "signal"),
        ('{"bell": 1}', "bell"),
    ):
        async with unix_connect(path, uri=f"ws://corral/v1/sandboxes/{sid}/pty?cmd=sh") as ws:
            await ws.recv()  # started
            await ws.send(bad)
            msgs = await _drain(ws)
            err = json.loads(msgs[-1])["error"]
            assert err["kind"] == "InvalidRequest" and words in err["message"], (bad, err)
            assert ws.close_code == 4400

    async with unix_connect(path, uri=f"ws://corral/v1/sandboxes/{sid}/pty?rows=x") as ws:
        msgs = await _drain(ws)
        assert "rows" in json.loads(msgs[-1])["error"]["message"] and ws.close_code == 4400


async def test_client_leaving_early_keeps_the_server(
    served: tuple[FakeNode, HTTPOps, str],
) -> None:
    _, ops, sid = served
    async with await ops.pty(sid, SH) as s:
        await s.write(b"echo bye\r")
    async with await ops.pty(sid, SH) as s:
        out = await _session(s, b"exit 0\r")
    assert s.result is not None and s.result.exit_code == 0 and b"$ " in out


async def test_wrong_token_is_refused_before_the_handshake() -> None:
    node = FakeNode()
    sid = (await node.sandbox_create(SandboxSpec(image="demo/base"))).id
    async with NodeServer(node, host="127.0.0.1", port=0, token="right") as srv:
        bad = HTTPOps(srv.address, token="wrong")
        good = HTTPOps(srv.address, token="right")
        try:
            with pytest.raises(Unauthorized, match="bearer token"):
                async with await bad.pty(sid, SH):
                    pass
            uri = srv.address.replace("http", "ws", 1) + f"/v1/sandboxes/{sid}/pty"
            with pytest.raises(InvalidStatus) as info:
                async with connect(uri):
                    pass
            assert info.value.response.status_code == 401
            async with await good.pty(sid, SH) as s:
                await _session(s, b"exit 4\r")
            assert s.result is not None and s.result.exit_code == 4
        finally:
            await bad.close()
            await good.close()


# ------------------------------------------------------------ the CLI on a real pty
async def run_cli_in_pty(
    args: list[str], keys: list[bytes], timeout: float = 30.0
) -> tuple[int, bytes]:
    """Run ``corral ARGS`` with a real terminal as stdin/stdout; type ``keys`` once the
    remote prompt shows (any output), return (exit status, everything the terminal got)."""
    master, slave = os.openpty()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from corral.cli import main; main()", *args,
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    loop = asyncio.get_running_loop()
    got = bytearray()
    chunk: asyncio.Queue[bytes] = asyncio.Queue()

    def readable() -> None:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every holder of the slave has closed it
            data = b""
        if not data:
            loop.remove_reader(master)
        chunk.put_nowait(data)

    loop.add_reader(master, readable)
    try:
        async with asyncio.timeout(timeout):
            pending = list(keys)
            while True:
                data = await chunk.get()
                if not data:
                    break
                got += data
                if pending:
                    os.write(master, pending.pop(0))
            return await proc.wait(), bytes(got)
    finally:
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(master)
        os.close(master)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_cli_shell_over_http(served: tuple[FakeNode, HTTPOps, str]) -> None:
    _, ops, sid = served
    code, out = await run_cli_in_pty(
        ["--node", f"unix://{ops._where}", "sandbox", "shell", sid],
        [b"echo over http\r", b"exit 7\r"],
    )
    assert b"over http" in out, out
    assert code == 7, out
