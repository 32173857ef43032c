# ruff: noqa: F811  (pytest fixtures imported from test_init)
"""corral-init sessions (spawn with a stdin pipe + attach) and the shell protocol on top
of them, driven straight through InitClient (no node): see tests/integration/
test_shell_session.py for the same through a real node."""

from __future__ import annotations

import asyncio

import pytest

from corral.backends.initclient import InitClient
from corral.backends.shell import ShellSession, prologue, shell_argv
from corral.errors import ProcessNotFound, SandboxError
from tests.integration.test_init import (  # noqa: F401 (fixtures)
    ENV,
    eventually_gone,
    init,
    init_binary,
    ns,
    pytestmark,
)


async def test_attach_streams_and_detach_keeps_the_session(init: InitClient) -> None:
    pid_id, _ = await init.spawn(["cat"], env=ENV, stdin_pipe=True)
    try:
        async with init.attach(pid_id) as s:
            await s.write(b"one\n")
            it = aiter(s)
            assert await anext(it) == ("stdout", b"one\n")
        # detached: the output waits in the init, and comes first on the next attach
        async with init.attach(pid_id) as s:
            await s.write(b"two\n")
            it = aiter(s)
            assert await anext(it) == ("stdout", b"two\n")
            await s.close_stdin()
            assert [x async for x in it] == []
            assert (s.result.reason, s.result.code) == ("exited", 0)
        # ended: attach answers with the exit at once
        async with init.attach(pid_id) as s:
            assert [x async for x in s] == []
            assert s.result.code == 0
    finally:
        await init.forget(pid_id)


async def test_attach_errors(init: InitClient) -> None:
    with pytest.raises(ProcessNotFound):
        async with init.attach("p99999"):
            pass
    pid_id, _ = await init.spawn(["sleep", "30"], env=ENV)
    try:
        with pytest.raises(SandboxError, match="no stdin"):
            async with init.attach(pid_id):
                pass
    finally:
        await init.forget(pid_id)


async def test_second_attach_takes_over_and_output_waits(init: InitClient) -> None:
    pid_id, _ = await init.spawn(["cat"], env=ENV, stdin_pipe=True)
    try:
        async with init.attach(pid_id) as first:
            await first.write(b"a\n")
            async with init.attach(pid_id) as second:
                with pytest.raises(SandboxError, match="another client"):
                    async for _ in first:
                        pass
                await second.write(b"b\n")
                got = b""
                async for _, data in second:
                    got += data
                    if got.endswith(b"b\n"):
                        break
                assert got in (b"a\nb\n", b"b\n")  # a may have gone to the first client
    finally:
        await init.forget(pid_id)
    await eventually_gone(init, r"^cat$")


async def _session(init: InitClient) -> ShellSession:
    pid_id, pid = await init.spawn(
        shell_argv("sh-test", bash=True), env=ENV, cwd="/tmp", stdin_pipe=True
    )

    async def kill_children(p: int) -> None:
        await init.exec(
            ["sh", "-c", f"kill -9 $(cat /proc/{p}/task/*/children) 2>/dev/null"], env=ENV
        )

    s = ShellSession(pid_id, pid, lambda: init.attach(pid_id), kill_children)
    await s.open()
    await s.write(prologue(bash=True))
    return s


async def test_shell_protocol(init: InitClient) -> None:
    s = await _session(init)
    try:

        async def run(cmd: str, timeout: float | None = None) -> tuple[str, int | None, bytes]:
            r, gone = await s.run(cmd, timeout, 1 << 16, None)
            assert gone is None
            return r.reason, r.code, r.stdout + b"|" + r.stderr

        assert await run("x=1; printf abc") == ("exited", 0, b"abc|")
        assert await run("echo $x; echo e >&2; false") == ("exited", 1, b"1\n|e\n")
        assert await run("set -e; echo a; false; echo no") == ("exited", 1, b"a\n|")
        assert await run("set -e; f() { false; echo no; }; f; echo no2") == ("exited", 1, b"|")
        assert (await run("exit 7"))[:2] == ("exited", 7)
        assert (await run("set +e; echo alive"))[2] == b"alive\n|"
        assert (await run("cat; echo after"))[2] == b"after\n|"
        r = await run("sleep 30", timeout=0.5)
        assert r[0] == "timeout"
        assert (await run("echo $x"))[2] == b"1\n|"
        r2, _ = await s.run("head -c 100000 /dev/zero", None, 1000, None)
        assert (r2.reason, len(r2.stdout), r2.out_trunc) == ("output_limit", 1000, True)
        assert (await run("echo ok"))[2] == b"ok\n|"
    finally:
        await s.close()
        await init.forget(s.proc_id)
    await asyncio.sleep(0)
