"""A terminal into a real sandbox over the node's HTTP API (the pty websocket): output,
exit status, window size, signals, auth, hang-up, and ``corral sandbox shell`` over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral.api.server import NodeServer
from corral.errors import SandboxNotFound, Unauthorized
from corral.host import leaks
from corral.node import Node
from corral.sdk._http import HTTPOps
from corral.spec import ExecRequest, Limits, PtyRequest, SandboxSpec
from tests.conftest import TAG
from tests.integration.conftest import open_node
from tests.unit.test_pty_ws import run_cli_in_pty

STATE = Path(f"/var/lib/corral-test{TAG}-pty")
RUN = Path(f"/run/corral-test{TAG}-pty")
SUBTREE = f"corral-test{TAG}-pty"


@pytest.fixture
async def served(images_ready: None, tmp_path: Path) -> AsyncIterator[tuple[Node, HTTPOps, str]]:
    async with open_node(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, gc=False) as node:
        spec = SandboxSpec(image="test/debian", limits=Limits(memory="256MiB", disk="128MiB"))
        sid = (await node.sandbox_create(spec)).id
        async with NodeServer(node, uds=tmp_path / "api.sock") as srv:
            ops = HTTPOps(srv.address)
            try:
                yield node, ops, sid
            finally:
                await ops.close()
    found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    assert leaks.total(found) == 0, found


SH = PtyRequest(cmd=["/bin/sh"])


async def _until(it: AsyncIterator[bytes], got: bytearray, want: bytes) -> None:
    """Read terminal output into ``got`` until ``want`` shows (10 s at most)."""
    async with asyncio.timeout(10):
        while want not in got:
            got += await anext(it)


async def _rest(s: Any) -> bytes:
    out = bytearray()
    async with asyncio.timeout(30):
        async for data in s:
            out += data
    return bytes(out)


async def test_tty_output_and_exit_code(served: tuple[Node, HTTPOps, str]) -> None:
    _, ops, sid = served
    async with await ops.pty(sid, PtyRequest()) as s:
        assert s.cmd[0].endswith("/bash") and s.pid > 0  # the node's default: bash -l
        await s.write(b"tty; echo $((6*7)); exit 3\n")
        out = await _rest(s)
    assert b"/dev/pts/" in out and b"\r\n42\r\n" in out, out
    assert s.result is not None and (s.result.reason, s.result.exit_code) == ("exited", 3)


async def test_resize_is_seen_by_stty(served: tuple[Node, HTTPOps, str]) -> None:
    _, ops, sid = served
    async with await ops.pty(sid, SH) as s:
        it, got = aiter(s), bytearray()
        await s.write(b"stty size\n")
        await _until(it, got, b"24 80\r\n")
        await s.resize(50, 132)
        await s.write(b"stty size\n")
        await _until(it, got, b"50 132\r\n")
        await s.close_stdin()  # EOF on an empty line: sh ends with the last status
        async with asyncio.timeout(10):
            async for _ in it:
                pass
    assert s.result is not None and (s.result.reason, s.result.exit_code) == ("exited", 0)


async def test_signal_and_unknown_sandbox(served: tuple[Node, HTTPOps, str]) -> None:
    _, ops, sid = served
    sleeper = PtyRequest(cmd=["/bin/sh", "-c", "echo ready; exec sleep 100"])
    async with await ops.pty(sid, sleeper) as s:
        it, got = aiter(s), bytearray()
        await _until(it, got, b"ready")
        await s.signal(9)
        async with asyncio.timeout(10):
            async for _ in it:
                pass
    assert s.result is not None and (s.result.reason, s.result.signal) == ("signaled", 9)

    with pytest.raises(SandboxNotFound, match="sb-nosuchsandbox"):
        async with await ops.pty("sb-nosuchsandbox", SH):
            pass


async def test_hang_up_ends_the_command(served: tuple[Node, HTTPOps, str]) -> None:
    node, ops, sid = served
    async with await ops.pty(sid, SH) as s:
        it, got = aiter(s), bytearray()
        await s.write(b"echo started; exec sleep 4242\n")
        await _until(it, got, b"started\r\n")
    # the client left: the node must not keep the sleep running
    listing = ["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"]
    for _ in range(100):
        r = await node.exec(sid, ExecRequest(cmd=listing))
        if b"sleep 4242" not in r.stdout:
            break
        await asyncio.sleep(0.05)
    assert b"sleep 4242" not in r.stdout


async def test_wrong_token_is_refused_over_tcp(served: tuple[Node, HTTPOps, str]) -> None:
    node, _, sid = served
    async with NodeServer(node, host="127.0.0.1", port=0, token="right") as srv:
        bad, good = HTTPOps(srv.address, token="wrong"), HTTPOps(srv.address, token="right")
        try:
            with pytest.raises(Unauthorized):
                async with await bad.pty(sid, SH):
                    pass
            async with await good.pty(sid, SH) as s:
                await s.write(b"exit 5\n")
                await _rest(s)
            assert s.result is not None and s.result.exit_code == 5
        finally:
            await bad.close()
            await good.close()


async def test_cli_shell_over_http(served: tuple[Node, HTTPOps, str]) -> None:
    _, ops, sid = served
    code, out = await run_cli_in_pty(
        ["--node", f"unix://{ops._where}", "sandbox", "shell", sid],
        [b"echo $((6*7)); exit 6\r"],
    )
    assert b"\r42\r\n" in out, out  # after bash's bracketed-paste-off sequence
    assert code == 6, out
