"""Running commands in sandboxes: exec, streams, terminals, background processes, shells.

Every command starts inside the sandbox from its agent (corral-init), so every restriction
of the sandbox is inherited. The node prepares the environment (image env, sandbox env,
request env), resolves a user name against the sandbox's own /etc/passwd, caps output at
the sandbox's default unless the request says otherwise, and turns the agent's report into
an :class:`ExecResult` whose ``reason`` always says how the command ended (an OOM kill is
told apart from any other SIGKILL by the cgroup's OOM counter).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator

from pydantic import ValidationError

from corral.backends import shell as shellmod
from corral.backends.base import Agent
from corral.backends.initclient import InitExit
from corral.errors import CorralError, InvalidRequest, NotFound, ProcessNotFound, SandboxError
from corral.node.lifecycle import Lifecycle
from corral.node.metrics import PhaseTimer
from corral.node.pty import NodePty
from corral.node.security import NodeSecurity
from corral.node.state import StateStore
from corral.node.table import SandboxTable
from corral.ops import DEFAULT_SHELLS
from corral.spec import (
    ExecChunk,
    ExecRequest,
    ExecResult,
    ProcessInfo,
    PtyRequest,
    SandboxInfo,
    ShellInfo,
    validation_message,
)

__all__ = ["Execs", "DEFAULT_PATH"]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_ENDS = ("exited", "signaled", "timeout", "oom", "output_limit")


class Execs:
    """Commands in the sandboxes of one node."""

    def __init__(
        self,
        life: Lifecycle,
        table: SandboxTable,
        state: StateStore,
        security: NodeSecurity,
        id_count: int,
    ) -> None:
        self.life = life
        self.table = table
        self.state = state
        self.security = security
        self.id_count = id_count
        self._shells: dict[str, shellmod.ShellSession] = {}
        """Attached shell sessions by shell id (rebuilt on demand after a restart)."""

    # ------------------------------------------------------------------ helpers
    def _agent(self, info: SandboxInfo) -> Agent:
        return self.life.backend_of(info).agent(info.id)

    def _prepare(self, info: SandboxInfo, req: ExecRequest) -> dict[str, object]:
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": info.spec.hostname}
        env.update(info.image_env)
        env.update(info.spec.env)
        env.update(req.env)
        uid, gid = self._resolve_user(info, req.user)
        if req.user and uid != 0 and "HOME" not in req.env:
            env["HOME"] = "/"
        limit = req.output_limit if req.output_limit is not None else info.spec.limits.output
        return {
            "env": env,
            "cwd": req.cwd or info.spec.workdir,
            "uid": uid,
            "gid": gid,
            "timeout": req.timeout,
            "output_limit": limit,
            "output_rate": int(info.spec.limits.output_rate),
        }

    def _resolve_user(self, info: SandboxInfo, user: str | None) -> tuple[int, int]:
        if not user:
            return 0, 0
        name, _, group = user.partition(":")
        uid = gid = None
        if name.isdigit():
            uid = int(name)
        else:
            for line in self._etc(info, "/etc/passwd"):
                f = line.split(":")
                if len(f) >= 4 and f[0] == name:
                    uid, gid = int(f[2]), int(f[3])
                    break
            if uid is None:
                raise InvalidRequest(f"user: no user {name!r} in the sandbox's /etc/passwd")
        if group:
            if group.isdigit():
                gid = int(group)
            else:
                for line in self._etc(info, "/etc/group"):
                    f = line.split(":")
                    if len(f) >= 3 and f[0] == group:
                        gid = int(f[2])
                        break
                else:
                    raise InvalidRequest(f"user: no group {group!r} in the sandbox's /etc/group")
        if gid is None:
            gid = uid
        if not (0 <= uid < self.id_count and 0 <= gid < self.id_count):
            raise InvalidRequest(f"user: ids must be below {self.id_count}")
        return uid, gid

    def _etc(self, info: SandboxInfo, path: str) -> list[str]:
        try:
            files = self.life.backend_of(info).files(info.id)
            return files.read(path, length=1 << 20).decode(errors="replace").splitlines()
        except CorralError:
            return []

    def _oom_kills(self, info: SandboxInfo) -> int:
        return self.life.backend_of(info).meters(info.id).oom_kills or 0

    def _to_result(self, info: SandboxInfo, r: InitExit, oom_before: int) -> ExecResult:
        sid = info.id
        reason = r.reason
        if (live := self.table.get(sid)) is not None:
            # Truncated without being stopped for it (output_limit has its own event).
            cut = reason != "output_limit" and (r.out_trunc or r.err_trunc)
            self.security.after_exec(sid, live.spec.limits.disk, truncated=cut)
        if reason == "signaled" and r.signal == 9 and self._oom_kills(info) > oom_before:
            reason = "oom"
        if reason not in _ENDS:
            raise SandboxError(f"sandbox {sid}: init reported unknown end {reason!r}")
        if reason in ("oom", "output_limit", "timeout"):
            detail: dict[str, object] = {"duration": round(r.duration, 3)}
            if reason == "output_limit":
                detail.update(stdout_bytes=r.out_len, stderr_bytes=r.err_len)
            self.state.add_event(sid, reason, detail)
        return ExecResult(
            exit_code=r.code if reason == "exited" else None,
            signal=r.signal if reason != "exited" else None,
            stdout=r.stdout,
            stderr=r.stderr,
            stdout_truncated=r.out_trunc,
            stderr_truncated=r.err_trunc,
            duration=r.duration,
            reason=reason,  # type: ignore[arg-type]
        )

    # ------------------------------------------------------------------ exec
    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        t = PhaseTimer()
        with t.phase("queue"):
            info = self.life.active(sandbox_id)
            p = self._prepare(info, req)
            before = self._oom_kills(info)
        with self.table.working(sandbox_id):
            async with self.life.agent_errors(sandbox_id, "the exec"):
                t0 = time.perf_counter()
                r = await self._agent(info).exec(req.cmd, stdin=req.stdin, **p)  # type: ignore[arg-type]
                call = time.perf_counter() - t0
        t.add("process_run", r.duration)
        t.add("agent_round_trip", max(0.0, call - r.duration))
        result = self._to_result(info, r, before)
        self.life.record("exec", t, info)
        return result

    async def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[ExecChunk | ExecResult]:
        info = self.life.active(sandbox_id)
        p = self._prepare(info, req)
        before = self._oom_kills(info)
        with self.table.working(sandbox_id):
            stream = self._agent(info).stream(
                req.cmd,
                stdin_pipe=req.stdin is not None,
                tty=req.tty,
                keep_output=False,
                **p,  # type: ignore[arg-type]
            )
            async with self.life.agent_errors(sandbox_id, "the exec"), stream as s:
                if req.stdin is not None:
                    await s.write(req.stdin)
                    await s.close_stdin()
                async for name, data in s:
                    yield ExecChunk(stream=name, data=data)  # type: ignore[arg-type]
                result = s.result
        yield self._to_result(info, result, before)

    async def pty(self, sandbox_id: str, req: PtyRequest) -> NodePty[InitExit]:
        """An interactive terminal (``corral sandbox shell``). The sandbox counts as busy
        while it is open, so the idle reaper never takes it from under a user."""
        info = self.life.active(sandbox_id)
        cmd = req.cmd or await self._default_shell(info)
        ereq = ExecRequest(
            cmd=cmd,
            env={"TERM": "xterm-256color", **req.env},
            cwd=req.cwd,
            user=req.user,
        )
        p = self._prepare(info, ereq)
        p["output_limit"] = 1 << 40
        before = self._oom_kills(info)
        stream = self._agent(info).stream(
            cmd,
            stdin_pipe=True,
            tty=True,
            rows=req.rows,
            cols=req.cols,
            keep_output=False,
            **p,  # type: ignore[arg-type]
        )
        return NodePty(
            stream,
            self.table.working(sandbox_id),
            lambda r: self._to_result(info, r, before),
            cmd=cmd,
        )

    async def _default_shell(self, info: SandboxInfo) -> list[str]:
        """The first of DEFAULT_SHELLS whose program the sandbox has (as ops.default_shell
        decides it, through the sandbox's files)."""
        files = self.life.backend_of(info).files(info.id)
        for candidate in DEFAULT_SHELLS[:-1]:
            try:
                await asyncio.to_thread(files.stat, candidate[0])
            except NotFound:
                continue
            return list(candidate)
        return list(DEFAULT_SHELLS[-1])

    async def spawn(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        info = self.life.active(sandbox_id)
        if req.stdin is not None or req.tty:
            raise InvalidRequest("stdin/tty: background processes get no stdin; use exec_stream")
        p = self._prepare(info, req)
        del p["timeout"], p["output_rate"]  # its output waits in the init: nothing to pace
        async with self.life.agent_errors(sandbox_id, "spawn"):
            pid_id, pid = await self._agent(info).spawn(req.cmd, **p)  # type: ignore[arg-type]
        return ProcessInfo(id=pid_id, pid=pid, cmd=req.cmd, running=True)

    async def process_get(
        self, sandbox_id: str, process_id: str, wait: float | None = None
    ) -> ProcessInfo:
        info = self.life.active(sandbox_id)
        before = self._oom_kills(info)
        with self.table.working(sandbox_id):
            async with self.life.agent_errors(sandbox_id, "the process wait"):
                p = await self._agent(info).wait(process_id, timeout=wait or 0)
        result = self._to_result(info, p.exit, before) if p.exit else None
        return ProcessInfo(
            id=p.id,
            pid=p.pid,
            cmd=p.argv,
            running=p.running,
            stdout=p.stdout,
            stderr=p.stderr,
            result=result,
        )

    async def process_kill(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        info = self.life.active(sandbox_id)
        if not 1 <= signal <= 64:
            raise InvalidRequest(f"signal: {signal} is not a signal number (1-64)")
        async with self.life.agent_errors(sandbox_id, "process kill"):
            await self._agent(info).kill(process_id, signal)

    async def process_list(self, sandbox_id: str) -> list[ProcessInfo]:
        info = self.life.active(sandbox_id)
        async with self.life.agent_errors(sandbox_id, "process list"):
            procs = await self._agent(info).list()
        return [
            ProcessInfo(id=p.id, pid=p.pid, cmd=p.argv, running=p.running)
            for p in procs
            if p.argv[-2:-1] != [shellmod.MARK]  # shell sessions have their own API
        ]

    # ------------------------------------------------------------------ shells
    async def shell_open(
        self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ShellInfo:
        """Start the session's shell in the sandbox (see corral.backends.shell) and check
        that it answers."""
        info = self.life.active(sandbox_id)
        try:
            req = ExecRequest(cmd=["true"], cwd=cwd, env=env or {})  # validates cwd and env
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
        shell_id = "sh-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))
        start = req.cwd or info.spec.workdir
        for k, old in list(self._shells.items()):  # of sandboxes that went away
            if old.over:
                del self._shells[k]
        sess = await self._start_shell(info, shell_id, start, req.env)
        self._shells[shell_id] = sess
        created = self.state.put_shell(shell_id, sandbox_id, start, req.env)
        return ShellInfo(id=shell_id, cwd=start, created_at=created)

    async def _start_shell(
        self, info: SandboxInfo, shell_id: str, cwd: str, env: dict[str, str]
    ) -> shellmod.ShellSession:
        bash = "bash" in (await self._default_shell(info))[0]
        p = self._prepare(info, ExecRequest(cmd=["sh"], env=env, cwd=cwd))
        del p["timeout"], p["output_rate"]  # its output waits in the init: nothing to pace
        agent = self._agent(info)
        async with self.life.agent_errors(info.id, "the shell session"):
            proc_id, pid = await agent.spawn(
                shellmod.shell_argv(shell_id, bash),
                stdin_pipe=True,
                **p,  # type: ignore[arg-type]
            )
            sess = self._session(info, proc_id, pid)
            try:
                await sess.open()
                await sess.write(shellmod.prologue(bash))
                r, gone = await sess.run("true", 30, 4096, None)
            except SandboxError as e:
                # A shell that could not start (a cwd that does not exist) may have ended
                # before the session attached: the init then answers the attach with its
                # end and closes, and the prologue's write finds the connection gone.
                await self._drop_shell(info, sess)
                raise self._shell_failed(info, cwd, str(e)) from None
            except BaseException:
                await self._drop_shell(info, sess)
                raise
        if gone is not None or r.code != 0:
            await self._drop_shell(info, sess)
            raise self._shell_failed(info, cwd, r.stderr.decode(errors="replace")[:500] or gone)
        return sess

    @staticmethod
    def _shell_failed(info: SandboxInfo, cwd: str, why: object) -> SandboxError:
        return SandboxError(
            f"sandbox {info.id}: could not start a shell session in {cwd} (is it an "
            f"existing directory?): {why}"
        )

    def _session(self, info: SandboxInfo, proc_id: str, pid: int) -> shellmod.ShellSession:
        agent = self._agent(info)

        async def kill_children(shell_pid: int) -> None:
            # the command ignored SIGINT: SIGKILL whatever the shell runs (its jobs
            # included), depth first, never the shell itself
            script = (
                "k() { for c in $(cat /proc/$1/task/*/children 2>/dev/null); do "
                'k "$c"; kill -9 "$c" 2>/dev/null; done; }; k "$0"'
            )
            with contextlib.suppress(CorralError):
                await agent.exec(
                    ["sh", "-c", script, str(shell_pid)],
                    env={"PATH": DEFAULT_PATH},
                    timeout=30,
                )

        rate = int(info.spec.limits.output_rate)  # a session's commands print through it
        return shellmod.ShellSession(
            proc_id, pid, lambda: agent.attach(proc_id, output_rate=rate), kill_children
        )

    async def _drop_shell(self, info: SandboxInfo, sess: shellmod.ShellSession) -> None:
        """Detach and end a session's shell (its whole process group)."""
        await sess.close()
        with contextlib.suppress(CorralError):
            await self._agent(info).forget(sess.proc_id)

    async def _live_shell(self, info: SandboxInfo, shell_id: str) -> shellmod.ShellSession:
        """The attached session; after a node restart, attach again to the shell that
        kept running in the sandbox (found by its argv)."""
        sess = self._shells.get(shell_id)
        if sess is not None and sess.alive:
            return sess
        if sess is not None:
            await sess.close()
            del self._shells[shell_id]
        async with self.life.agent_errors(info.id, "the shell session"):
            for p in await self._agent(info).list():
                if p.running and p.argv[-2:] == [shellmod.MARK, shell_id]:
                    sess = self._session(info, p.id, p.pid)
                    await sess.open()
                    self._shells[shell_id] = sess
                    return sess
        self.state.delete_shell(shell_id)
        raise ProcessNotFound(
            f"shell session {shell_id!r} in sandbox {info.id}: its shell is gone (the "
            "sandbox restarted or the shell was killed); open a new session"
        )

    async def shell_run(
        self,
        sandbox_id: str,
        shell_id: str,
        command: str,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        row = self.state.get_shell(shell_id)
        if row is None or row[0] != sandbox_id:
            raise ProcessNotFound(f"no shell session {shell_id!r} in sandbox {sandbox_id}")
        if "\0" in command:
            raise InvalidRequest("command: cannot contain NUL bytes")
        if timeout is not None:
            try:
                ExecRequest(cmd=["true"], timeout=timeout)
            except ValidationError as e:
                raise InvalidRequest(validation_message(e)) from None
        info = self.life.active(sandbox_id)
        sess = await self._live_shell(info, shell_id)
        files = self.life.backend_of(info).files(info.id)
        stdin_path = None
        if stdin is not None:
            stdin_path = f"{shellmod.STATE_DIR}/{shell_id}.stdin"
            await asyncio.to_thread(files.mkdir, shellmod.STATE_DIR)
            await asyncio.to_thread(files.write, stdin_path, stdin, 0o600)
        before = self._oom_kills(info)
        try:
            with self.table.working(sandbox_id):
                async with self.life.agent_errors(sandbox_id, "the shell command"):
                    r, gone = await sess.run(command, timeout, info.spec.limits.output, stdin_path)
        finally:
            if stdin_path is not None:
                with contextlib.suppress(CorralError):
                    await asyncio.to_thread(files.remove, stdin_path)
        if gone is not None:
            # the session goes on in a new shell, and the result says so
            await self._drop_shell(info, sess)
            self._shells.pop(shell_id, None)
            self._shells[shell_id] = await self._start_shell(info, shell_id, row[1], row[2])
            note = (
                f"\ncorral: {gone}; the session continues in a new shell started in "
                f"{row[1]} (variables, functions, jobs and the working directory are lost)\n"
            )
            r.stderr += note.encode()
        return self._to_result(info, r, before)

    async def shell_interrupt(self, sandbox_id: str, shell_id: str) -> None:
        """SIGINT to the running command of a session (the shell stays)."""
        row = self.state.get_shell(shell_id)
        if row is None or row[0] != sandbox_id:
            raise ProcessNotFound(f"no shell session {shell_id!r} in sandbox {sandbox_id}")
        info = self.life.active(sandbox_id)
        sess = await self._live_shell(info, shell_id)
        async with self.life.agent_errors(sandbox_id, "the shell interrupt"):
            await sess.interrupt()

    async def detach_shells(self) -> None:
        """On node close: let go of every session; the shells keep running in their
        sandboxes and the next node attaches again on their next command."""
        sessions, self._shells = list(self._shells.values()), {}
        for sess in sessions:
            await sess.close()

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        """End the session: its shell and everything it started (one process group)."""
        row = self.state.get_shell(shell_id)
        if row is None or row[0] != sandbox_id:
            raise ProcessNotFound(f"no shell session {shell_id!r} in sandbox {sandbox_id}")
        self.state.delete_shell(shell_id)
        sess = self._shells.pop(shell_id, None)
        info = self.table.get(sandbox_id)
        if info is None or info.state != "running":  # its shells end with the sandbox
            if sess is not None:
                await sess.close()
            return
        if sess is None:
            with contextlib.suppress(CorralError):
                for p in await self._agent(info).list():
                    if p.argv[-2:] == [shellmod.MARK, shell_id]:
                        sess = self._session(info, p.id, p.pid)
        if sess is not None:
            await self._drop_shell(info, sess)
