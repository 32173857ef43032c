"""The contract of exec, exec_stream, background processes and shell sessions."""

from __future__ import annotations

from corral.errors import InvalidRequest, ProcessNotFound
from corral.ops import NodeOps
from corral.spec import ExecChunk, ExecRequest, ExecResult, SandboxInfo
from tests.contract.base import ContractBase, raises_exactly, run


class RunContract(ContractBase):
    async def test_exit_codes_and_output(self, ops: NodeOps, sb: SandboxInfo) -> None:
        r = await run(ops, sb.id, "echo out; echo err >&2; exit 3")
        assert (r.exit_code, r.signal, r.reason, r.ok) == (3, None, "exited", False)
        assert (r.stdout, r.stderr, r.truncated) == (b"out\n", b"err\n", False)
        assert (await run(ops, sb.id, "true")).ok
        assert (await run(ops, sb.id, "false")).exit_code == 1
        missing = await run(ops, sb.id, "no-such-command-here")
        assert (missing.exit_code, missing.reason) == (127, "exited")
        assert b"no-such-command-here" in missing.stderr

    async def test_signaled(self, ops: NodeOps, sb: SandboxInfo) -> None:
        r = await run(ops, sb.id, "echo going; kill -TERM $$; echo not-reached")
        assert (r.reason, r.signal, r.exit_code, r.ok) == ("signaled", 15, None, False)
        assert r.stdout == b"going\n"

    async def test_stdin_env_cwd(self, ops: NodeOps, sb: SandboxInfo) -> None:
        r = await run(ops, sb.id, "cat", stdin=b"fed through stdin\n")
        assert r.stdout == b"fed through stdin\n"
        r = await run(ops, sb.id, "printenv", "SPEC_VAR", "OVERRIDDEN", env={"OVERRIDDEN": "req"})
        assert r.stdout == b"from-spec\nreq\n"
        r = await run(ops, sb.id, "printenv", "HOSTNAME", "HOME")
        assert r.stdout == f"{sb.spec.hostname}\n/root\n".encode()
        r = await run(ops, sb.id, "printenv", "HOME", user="nobody")
        assert r.stdout == b"/\n"  # not root's home
        assert (await run(ops, sb.id, "printenv", "PATH")).stdout.count(b"/bin") >= 2
        assert (await run(ops, sb.id, "pwd")).stdout == f"{sb.spec.workdir}\n".encode()
        assert (await run(ops, sb.id, "pwd", cwd="/tmp")).stdout == b"/tmp\n"
        r = await run(ops, sb.id, "pwd", cwd="/no/such/dir")
        assert (r.exit_code, r.stdout) == (126, b"")
        assert b"/no/such/dir" in r.stderr

    async def test_user(self, ops: NodeOps, sb: SandboxInfo) -> None:
        assert (await run(ops, sb.id, "id", "-u")).stdout == b"0\n"
        assert (await run(ops, sb.id, "id", "-u", user="1234")).stdout == b"1234\n"
        assert (await run(ops, sb.id, "id", "-g", user="1234:55")).stdout == b"55\n"
        assert (await run(ops, sb.id, "id", "-u", user="nobody")).stdout == b"65534\n"
        with raises_exactly(InvalidRequest, match="no-such-user"):
            await run(ops, sb.id, "true", user="no-such-user")

    async def test_timeout(self, ops: NodeOps, sb: SandboxInfo) -> None:
        r = await run(ops, sb.id, "echo before; sleep 30; echo after", timeout=2)
        assert (r.reason, r.exit_code, r.signal, r.ok) == ("timeout", None, 9, False)
        assert r.stdout == b"before\n"

    async def test_output_limit(self, ops: NodeOps, sb: SandboxInfo) -> None:
        r = await run(ops, sb.id, "echo", "x" * 5000, output_limit=1024)
        assert (r.reason, r.exit_code, r.ok) == ("output_limit", None, False)
        assert (r.stdout, r.stdout_truncated, r.stderr_truncated) == (b"x" * 1024, True, False)
        r = await run(ops, sb.id, "echo", "x" * 1023, output_limit=1024)  # 1024 with \n
        assert (r.reason, r.stdout_truncated, len(r.stdout)) == ("exited", False, 1024)
        r = await run(ops, sb.id, "echo", "y" * 2000)  # the sandbox's default: 64 KiB
        assert (r.reason, len(r.stdout)) == ("exited", 2001)

    async def test_exec_stream(self, ops: NodeOps, sb: SandboxInfo) -> None:
        req = ExecRequest(cmd=["sh", "-c", "echo a; echo b >&2; cat; exit 4"], stdin=b"in\n")
        items = [x async for x in ops.exec_stream(sb.id, req)]
        assert all(isinstance(x, ExecChunk) for x in items[:-1])
        result = items[-1]
        assert isinstance(result, ExecResult)
        assert (result.exit_code, result.reason, result.stdout, result.stderr) == (
            4,
            "exited",
            b"",
            b"",
        )
        out = b"".join(
            x.data for x in items[:-1] if isinstance(x, ExecChunk) and x.stream == "stdout"
        )
        err = b"".join(
            x.data for x in items[:-1] if isinstance(x, ExecChunk) and x.stream == "stderr"
        )
        assert (out, err) == (b"a\nin\n", b"b\n")

        req = ExecRequest(cmd=["echo", "z" * 5000], output_limit=1000)
        items = [x async for x in ops.exec_stream(sb.id, req)]
        result = items[-1]
        assert isinstance(result, ExecResult) and result.reason == "output_limit"
        assert result.stdout_truncated and not result.stderr_truncated
        assert b"".join(x.data for x in items[:-1] if isinstance(x, ExecChunk)) == b"z" * 1000

    async def test_processes(self, ops: NodeOps, sb: SandboxInfo) -> None:
        done = await ops.spawn(sb.id, ExecRequest(cmd=["sh", "-c", "echo done; exit 5"]))
        assert done.running and done.cmd == ["sh", "-c", "echo done; exit 5"] and done.pid > 0
        ended = await ops.process_get(sb.id, done.id, wait=60)
        assert not ended.running and ended.result is not None
        assert (ended.result.exit_code, ended.result.reason) == (5, "exited")
        assert ended.stdout == b"done\n"

        long = await ops.spawn(sb.id, ExecRequest(cmd=["sh", "-c", "echo started; sleep 600"]))
        assert long.id != done.id
        assert long.id in {p.id for p in await ops.process_list(sb.id) if p.running}
        # Its output so far is there while it runs (wait for it: it may not have started).
        while (cur := await ops.process_get(sb.id, long.id, wait=0.05)).stdout == b"":
            assert cur.running
        assert cur.running and cur.stdout == b"started\n" and cur.result is None
        await ops.process_kill(sb.id, long.id, signal=15)
        killed = await ops.process_get(sb.id, long.id, wait=60)
        assert not killed.running and killed.result is not None
        assert (killed.result.reason, killed.result.signal) == ("signaled", 15)
        assert killed.result.exit_code is None and killed.stdout == b"started\n"
        listed = {p.id: p.running for p in await ops.process_list(sb.id)}
        assert (listed[done.id], listed[long.id]) == (False, False)  # ended ones stay listed

        with raises_exactly(InvalidRequest, match="signal"):
            await ops.process_kill(sb.id, done.id, signal=0)
        with raises_exactly(InvalidRequest, match="stdin"):
            await ops.spawn(sb.id, ExecRequest(cmd=["cat"], stdin=b"x"))

    async def test_shells(self, ops: NodeOps, sb: SandboxInfo) -> None:
        sh = await ops.shell_open(sb.id, cwd="/tmp", env={"OPENED_WITH": "1"})
        assert sh.cwd == "/tmp"
        assert (await ops.shell_run(sb.id, sh.id, "pwd")).stdout == b"/tmp\n"
        r = await ops.shell_run(sb.id, sh.id, "cd / && export KEPT=yes")
        assert r.ok
        r = await ops.shell_run(sb.id, sh.id, "pwd; echo $KEPT $OPENED_WITH $SPEC_VAR")
        assert r.stdout == b"/\nyes 1 from-spec\n"
        r = await ops.shell_run(sb.id, sh.id, "echo no >&2; false")
        assert (r.exit_code, r.stderr) == (1, b"no\n")
        assert (await ops.shell_run(sb.id, sh.id, "cat", stdin=b"piped")).stdout == b"piped"
        r = await ops.shell_run(sb.id, sh.id, "sleep 30", timeout=0.5)
        assert r.reason == "timeout"
        r = await ops.shell_run(sb.id, sh.id, "echo " + "x" * (70 << 10))  # over 64 KiB
        assert (r.reason, r.stdout_truncated, len(r.stdout)) == ("output_limit", True, 64 << 10)
        other = await ops.shell_open(sb.id)
        assert (
            await ops.shell_run(sb.id, other.id, "pwd")
        ).stdout == f"{sb.spec.workdir}\n".encode()
        assert (await ops.shell_run(sb.id, other.id, "echo x$KEPT")).stdout == b"x\n"
        with raises_exactly(InvalidRequest, match="NUL"):
            await ops.shell_run(sb.id, sh.id, "echo a\0b")
        await ops.shell_close(sb.id, sh.id)
        with raises_exactly(ProcessNotFound, match=sh.id):
            await ops.shell_run(sb.id, sh.id, "true")
        with raises_exactly(ProcessNotFound, match=sh.id):
            await ops.shell_close(sb.id, sh.id)
        await ops.shell_close(sb.id, other.id)
