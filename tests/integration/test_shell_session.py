"""Persistent shell sessions through a real node: one real shell per session in the
sandbox (corral.backends.shell), all shell state kept between commands, robust ends of
commands, interrupts, and sessions that outlive a restart of the node agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import corral
from corral.node import Node
from corral.spec import ExecRequest, Limits, SandboxSpec
from tests.conftest import TAG
from tests.integration.conftest import assert_no_leaks, node_config

SMALL = {"memory": "256MiB", "disk": "128MiB"}
_PROCS = 'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < "$f"; echo; done'


async def _procs(sb: corral.Sandbox) -> bytes:
    """The command lines of every process of the sandbox, one a line."""
    return (await sb.exec(["sh", "-c", _PROCS])).stdout


async def _settled(sb: corral.Sandbox, gone: bytes, shells: int) -> bytes:
    """The process list once nothing matching ``gone`` and only ``shells`` session shells
    are left (a SIGKILLed process takes a moment to go)."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        procs = await _procs(sb)
        done = gone not in procs and procs.count(b"corral-shell") == shells
        if done or asyncio.get_running_loop().time() > deadline:
            return procs
        await asyncio.sleep(0.05)


async def test_state_survives_between_commands(client: corral.AsyncClient) -> None:
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        sh = await sb.shell()
        await sh.run("x=1; declare -a arr=(a b c); cd /tmp; alias ll='echo aliased'")
        await sh.run("f() { echo fn $1; }; trap 'echo bye' USR1; shopt -s nullglob; set -u")
        await sh.run("sleep 300 & sleep 301 &")
        r = await sh.run('echo "$x ${arr[1]}"; pwd; ll; f 2; trap -p USR1; shopt nullglob')
        assert r.stdout == (
            b"1 b\n/tmp\naliased\nfn 2\ntrap -- 'echo bye' SIGUSR1\nnullglob       \ton\n"
        ), r
        r = await sh.run("echo $unset_var")  # set -u kept
        assert r.exit_code == 1 and b"unbound variable" in r.stderr
        r = await sh.run("set +u; jobs")
        assert r.stdout.count(b"Running") == 2 and b"sleep 301" in r.stdout, r
        r = await sh.run("kill %1 %2; wait; jobs; echo done")
        assert r.stdout.endswith(b"done\n")


async def test_set_e_stops_the_command_not_the_session(client: corral.AsyncClient) -> None:
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        sh = await sb.shell()
        r = await sh.run("set -e; echo a; false; echo not-reached")
        assert (r.exit_code, r.stdout, r.stderr) == (1, b"a\n", b"")
        r = await sh.run("echo $-; (exit 3); echo not-reached")  # set -e is still on
        assert r.exit_code == 3 and b"e" in r.stdout.split(b"\n")[0]
        r = await sh.run("f() { false; echo no; }; f; echo no")
        assert (r.exit_code, r.stdout) == (1, b"")
        r = await sh.run("false || echo handled; if false; then :; fi; echo fine")
        assert (r.exit_code, r.stdout) == (0, b"handled\nfine\n")
        r = await sh.run("trap 'echo user-err >&2' ERR; set +e; false; echo on")
        assert (r.exit_code, r.stdout, r.stderr) == (0, b"on\n", b"user-err\n")
        r = await sh.run("exit 5")
        assert r.exit_code == 5
        assert (await sh.run("echo still")).stdout == b"still\n"
        r = await sh.run("(exit 6)")
        assert r.exit_code == 6


async def test_markers_stdin_and_output(client: corral.AsyncClient) -> None:
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        sh = await sb.shell()
        r = await sh.run("printf 'no newline'; printf 'err too' >&2")
        assert (r.stdout, r.stderr) == (b"no newline", b"err too")
        # markers of earlier commands (or made up ones) in the output are just output
        r = await sh.run("printf '\\036E0123:0\\036'; printf '\\036S0\\036'")
        assert r.stdout == b"\x1eE0123:0\x1e\x1eS0\x1e"
        # a command reading stdin cannot eat the next command
        r = await sh.run("cat; read -r line; echo got=$line")
        assert (r.stdout, r.exit_code) == (b"got=\n", 0)
        assert (await sh.run("echo next")).stdout == b"next\n"
        r = await sh.run("cat; echo; wc -c", stdin=b"\x00bin\xffary\n")
        assert r.stdout == b"\x00bin\xffary\n\n0\n"
        limit = sb.info.spec.limits.output
        r = await sh.run(f"head -c {limit + 100000} /dev/zero")
        assert (r.reason, r.stdout_truncated, len(r.stdout)) == ("output_limit", True, limit)
        assert (await sh.run("echo after-limit")).stdout == b"after-limit\n"


async def test_timeout_and_interrupt_keep_the_session(client: corral.AsyncClient) -> None:
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        sh = await sb.shell()
        await sh.run("kept=yes")
        r = await sh.run("sleep 300", timeout=1)
        assert (r.reason, r.exit_code, r.signal) == ("timeout", None, 2)
        assert (await sh.run("echo $kept")).stdout == b"yes\n"
        # a command that ignores SIGINT: its process is SIGKILLed, the shell stays
        r = await sh.run("trap '' INT; sh -c 'trap \"\" INT; sleep 300'", timeout=1)
        assert (r.reason, r.signal) == ("timeout", 9)
        assert b"new shell" not in r.stderr
        assert (await sh.run("trap - INT; echo $kept")).stdout == b"yes\n"
        # an interrupt from another caller while a command runs
        task = asyncio.create_task(sh.run("echo started; sleep 300; echo not-reached"))
        while b"sleep 300" not in await _procs(sb):
            await asyncio.sleep(0.05)
        await sh.interrupt()
        r = await task
        assert (r.exit_code, r.stdout) == (130, b"started\n")
        assert (await sh.run("echo $kept")).stdout == b"yes\n"


async def test_sessions_are_independent_and_close_leaves_nothing(
    client: corral.AsyncClient,
) -> None:
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        a, b = await sb.shell(), await sb.shell(cwd="/tmp")
        await a.run("v=A; cd /work 2>/dev/null || cd /; sleep 600 &")
        r = await b.run('echo "[$v]"; pwd; jobs')
        assert r.stdout == b"[]\n/tmp\n"
        before = await _procs(sb)
        assert b"sleep 600" in before and before.count(b"corral-shell") == 2
        assert [p for p in await sb.processes() if "corral-shell" in p.info.cmd] == []
        await a.close()
        after = await _settled(sb, b"sleep 600", 1)
        assert b"sleep 600" not in after and after.count(b"corral-shell") == 1
        with pytest.raises(corral.ProcessNotFound):
            await a.run("true")
        await b.close()
        assert b"corral-shell" not in await _settled(sb, b"corral-shell", 0)


STATE = Path(f"/var/lib/corral-test{TAG}-shellrs")
RUN = Path(f"/run/corral-test{TAG}-shellrs")
SUBTREE = f"corral-test{TAG}-shellrs"


async def test_session_survives_agent_restart(images_ready: None) -> None:
    cfg = node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE)
    node = await Node.open(cfg)
    info = None
    try:
        for left in await node.sandbox_list():  # of an earlier run that crashed
            await node.sandbox_destroy(left.id)
        spec = SandboxSpec(image="test/debian", limits=Limits(memory="256MiB", disk="128MiB"))
        info = await node.sandbox_create(spec)
        sh = await node.shell_open(info.id)
        await node.shell_run(info.id, sh.id, "plain=kept; cd /tmp; sleep 300 &")
        # output written while no node is attached waits, and is not taken for the next
        # command's
        job = "until [ -e /tmp/go ]; do sleep 0.05; done; echo late; echo late >&2; : > /tmp/done"
        await node.shell_run(info.id, sh.id, f"({job}) &")
    except BaseException:
        if info is not None:
            await node.sandbox_destroy(info.id)
        raise
    finally:
        await node.close()
    node = await Node.open(cfg)
    try:
        wait = "touch /tmp/go; until [ -e /tmp/done ]; do sleep 0.05; done"
        await node.exec(info.id, ExecRequest(cmd=["sh", "-c", wait], timeout=60))
        r = await node.shell_run(info.id, sh.id, "echo $plain; pwd; jobs -r | grep -c 'sleep 300'")
        assert (r.stdout, r.stderr, r.exit_code) == (b"kept\n/tmp\n1\n", b"", 0), r
        await node.shell_close(info.id, sh.id)
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            ps = await node.exec(info.id, ExecRequest(cmd=["sh", "-c", _PROCS]))
            left = b"corral-shell" in ps.stdout or b"sleep 300" in ps.stdout
            if not left or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        assert not left, ps.stdout
    finally:
        await node.sandbox_destroy(info.id)
        await node.close()
    assert_no_leaks(STATE, RUN, SUBTREE)


async def test_sh_session_where_the_image_has_no_bash(client: corral.AsyncClient) -> None:
    async with await client.sandboxes.create(image="test/busybox", limits=SMALL) as sb:
        sh = await sb.shell(cwd="/tmp")
        await sh.run("x=1; f() { echo fn; }; cd /")
        r = await sh.run("echo $x; f; pwd; printf tail")
        assert (r.stdout, r.exit_code) == (b"1\nfn\n/\ntail", 0)
        r = await sh.run("sleep 300", timeout=1)
        assert (r.reason, r.signal) == ("timeout", 2)
        assert (await sh.run("echo $x; cat", stdin=b"in")).stdout == b"1\nin"


async def test_a_shell_gone_before_its_session_attaches_is_reported_as_not_started(
    client: corral.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race behind a cwd that does not exist: the shell may end before the session
    attaches, and the init then answers the attach with its end and closes, so the
    prologue's write finds the connection gone. The caller hears either way that the shell
    could not start in that directory, and the sandbox carries on."""
    from corral.backends import shell as shellmod

    async def gone(self: shellmod.ShellSession, data: bytes) -> None:
        raise corral.SandboxError("init dropped the connection (attach): [Errno 32] Broken pipe")

    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        with monkeypatch.context() as m:
            m.setattr(shellmod.ShellSession, "write", gone)
            with pytest.raises(corral.CorralError, match="could not start a shell session in /tmp"):
                await sb.shell(cwd="/tmp")
        sh = await sb.shell(cwd="/tmp")
        assert (await sh.run("pwd")).stdout == b"/tmp\n"


async def test_a_shell_that_ends_is_replaced_and_says_so(client: corral.AsyncClient) -> None:
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        sh = await sb.shell(cwd="/tmp")
        await sh.run("x=1; cd /")
        r = await sh.run("echo bye; exec true")
        assert r.stdout == b"bye\n" and b"continues in a new shell started in /tmp" in r.stderr
        assert (await sh.run('echo "[$x]"; pwd')).stdout == b"[]\n/tmp\n"
        # a shell that ignores SIGINT in a loop of builtins cannot be got back: replaced
        r = await sh.run("y=1; trap '' INT; echo spin; while :; do :; done", timeout=1)
        assert (r.reason, r.stdout) == ("timeout", b"spin\n")
        assert b"continues in a new shell" in r.stderr
        assert (await sh.run('echo "[$y]"')).stdout == b"[]\n"
        with pytest.raises(corral.CorralError, match="/nonexistent"):
            await sb.shell(cwd="/nonexistent")
