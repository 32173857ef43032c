"""envd's ``process.Process`` Connect service, translated to corral exec and pty streams.

Each process is driven by a task of the node (not by the request that started it), which
fans its output out to every attached client: a client that disconnects only detaches,
``Connect`` attaches another one (from the moment it attaches), and every client sees a
start event first, then data and keepalives, then exactly one end event.

How a process runs:

- without stdin or a pty: ``exec_stream`` (stdout and stderr apart, exit code exact);
- with a pty, or with stdin (E2B's ``stdin=True``): a corral ``pty``, since that is the
  stream corral can write to after the start. For a stdin process the terminal is set to
  ``-echo -opost`` so the output reads as from a pipe, but stdout and stderr arrive
  merged, as stdout.

Pids are the numbers this service hands out (per sandbox, from 1000), not guest pids: an
exec stream does not report its guest pid. ``SendSignal`` ends an exec-stream process
with SIGKILL whatever the signal; a pty process gets the signal asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import Process

from corral.errors import CorralError
from corral.integrations.e2b._common import E2BConfig, guest_path, home_of
from corral.integrations.e2b._rpc import connect_error, oneof, request_user, sandbox_of
from corral.ops import NodeOps, PtyStream
from corral.spec import ExecChunk, ExecRequest, ExecResult, PtyRequest

log = logging.getLogger("corral.e2b")

Event = pb.ProcessEvent
KEEPALIVE_DEFAULT = 50.0
_MARKER = b"\x1ee2b-ready\x1e"
_PIPE_LIKE = "stty -echo -opost 2>/dev/null; printf '\\036e2b-ready\\036'; exec \"$@\""
"""Makes a terminal read like a pipe (no echo, no CR added), then says so (_MARKER)."""
MAX_BACKLOG = 4096
"""Events a client may fall behind by before it is detached (resource_exhausted)."""
_OVERFLOW = Event()


def _end_event(res: ExecResult | None, error: str | None = None) -> Event:
    if res is None:
        end = Event.EndEvent(exit_code=-1, exited=False, status="killed", error=error or "")
    elif res.exit_code is not None:
        end = Event.EndEvent(
            exit_code=res.exit_code, exited=True, status=f"exit status {res.exit_code}"
        )
    else:
        sig = res.signal or 9
        end = Event.EndEvent(exit_code=-1, exited=False, status=f"signal: {sig}")
    if res is not None and res.reason not in ("exited", "signaled"):
        end = Event.EndEvent(
            exit_code=end.exit_code, exited=end.exited, status=end.status, error=res.reason
        )
    return Event(event=oneof("end", end))


class _Proc:
    """One process and its attached clients."""

    def __init__(self, pid: int, tag: str, config: pb.ProcessConfig) -> None:
        self.pid = pid
        self.tag = tag
        self.config = config
        self.subs: set[asyncio.Queue[Event]] = set()
        self.end: Event | None = None
        self.task: asyncio.Task[None] | None = None
        self.pty: PtyStream | None = None
        self.pty_ready = asyncio.Event()
        self.writable = False
        """Started on a pty (with a pty or stdin), so input can reach it."""

    def publish(self, ev: Event) -> None:
        for q in list(self.subs):
            if q.qsize() >= MAX_BACKLOG:
                # a client that does not read must not make the node hold the output
                self.subs.discard(q)
                q.put_nowait(_OVERFLOW)
            else:
                q.put_nowait(ev)

    def finish(self, ev: Event) -> None:
        if self.end is None:
            self.end = ev
            self.publish(ev)
            self.pty_ready.set()

    async def events(
        self,
        q: asyncio.Queue[Event],
        keepalive: float,
        wrap: Callable[..., Any],
        deadline: float | None = None,
    ) -> AsyncIterator[Any]:
        """Start first, data and keepalives, exactly one end. Detaches when the client
        goes away; the process runs on. Past ``deadline`` (``time.monotonic()``, from
        the client's ``Connect-Timeout-Ms``: the SDK's command ``timeout``) the stream
        ends with ``deadline_exceeded``, which the SDK raises as its TimeoutException;
        the process runs on, as envd's does (a ``kill`` ends it)."""
        try:
            yield wrap(event=Event(event=oneof("start", Event.StartEvent(pid=self.pid))))
            if self.end is not None and q.empty():
                yield wrap(event=self.end)
                return
            while True:
                wait = keepalive
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ConnectError(
                            Code.DEADLINE_EXCEEDED,
                            f"process {self.pid}: the request's timeout passed before it "
                            "ended (it runs on: connect again to follow it, or kill it)",
                        )
                    wait = min(wait, left)
                try:
                    ev = await asyncio.wait_for(q.get(), wait)
                except TimeoutError:
                    if deadline is None or time.monotonic() < deadline:
                        yield wrap(event=Event(event=oneof("keepalive", Event.KeepAlive())))
                    continue
                if ev is _OVERFLOW:
                    raise ConnectError(
                        Code.RESOURCE_EXHAUSTED,
                        f"the client fell {MAX_BACKLOG} events behind process {self.pid}; "
                        "it runs on: connect again to follow it",
                    )
                yield wrap(event=ev)
                if ev.event is not None and ev.event.field == "end":
                    return
        finally:
            self.subs.discard(q)

    def attach(self) -> asyncio.Queue[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        self.subs.add(q)
        return q


class ProcessService(Process):
    """``process.Process`` over ``ops`` (see the module docstring)."""

    def __init__(self, ops: NodeOps, config: E2BConfig) -> None:
        self.ops = ops
        self.config = config
        self._procs: dict[str, dict[int, _Proc]] = {}
        self._pids = itertools.count(1000)

    # ------------------------------------------------------------------ helpers
    def _find(self, sid: str, selector: pb.ProcessSelector | None) -> _Proc:
        procs = self._procs.get(sid, {})
        sel = selector.selector if selector is not None else None
        if sel is not None and sel.field == "pid" and sel.value in procs:
            return procs[sel.value]
        if sel is not None and sel.field == "tag":
            for p in procs.values():
                if p.tag == sel.value:
                    return p
        raise ConnectError(Code.NOT_FOUND, f"process {sel.value if sel else '?'} not found")

    @staticmethod
    def _deadline(ctx: RequestContext[Any, Any]) -> float | None:
        """The client's ``Connect-Timeout-Ms`` as a ``time.monotonic()`` deadline."""
        ms = ctx.timeout_ms
        return None if ms is None else time.monotonic() + ms / 1000.0

    @staticmethod
    def _keepalive(ctx: RequestContext[Any, Any]) -> float:
        raw = ctx.request_headers.get("keepalive-ping-interval")
        try:
            return max(1.0, float(raw)) if raw else KEEPALIVE_DEFAULT
        except ValueError:
            return KEEPALIVE_DEFAULT

    # -------------------------------------------------------------------- start
    async def start(
        self, request: pb.StartRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.StartResponse]:
        sid = sandbox_of(ctx)
        user = request_user(ctx, self.config)
        cfg = request.process or pb.ProcessConfig(cmd="/bin/sh")
        if not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd: empty")
        cmd = [cfg.cmd, *cfg.args]
        env = {"HOME": home_of(user), "USER": user, **dict(cfg.envs)}
        try:
            cwd = guest_path(cfg.cwd, user) if cfg.cwd else home_of(user)
            # a sandbox that is gone is the stream's error (the SDK: "not running"), not
            # a process that ends at once
            info = await self.ops.sandbox_get(sid)
        except CorralError as exc:
            raise connect_error(exc) from None
        if info.state in ("destroying", "destroyed", "failed"):
            raise ConnectError(Code.UNAVAILABLE, f"The sandbox {sid} was not found")
        proc = _Proc(next(self._pids), request.tag or "", cfg)
        self._procs.setdefault(sid, {})[proc.pid] = proc
        q = proc.attach()
        if request.pty is not None or request.stdin:
            size = request.pty.size if request.pty is not None else None
            if request.pty is None:  # stdin only: a terminal that reads like a pipe
                cmd = ["/bin/sh", "-c", _PIPE_LIKE, "sh", *cmd]
            preq = PtyRequest(
                cmd=cmd,
                env=env,
                cwd=cwd,
                user=user,
                rows=size.rows if size and size.rows else 24,
                cols=size.cols if size and size.cols else 80,
            )
            as_pty = request.pty is not None
            proc.writable = True
            proc.task = asyncio.get_running_loop().create_task(
                self._drive_pty(sid, proc, preq, as_pty)
            )
        else:
            # streamed, not kept: the sandbox's output limit (for buffered execs) does not
            # apply; E2B commands print as much as they like
            ereq = ExecRequest(cmd=cmd, env=env, cwd=cwd, user=user, output_limit=1 << 30)
            proc.task = asyncio.get_running_loop().create_task(self._drive_exec(sid, proc, ereq))
        deadline = self._deadline(ctx)
        async for ev in proc.events(q, self._keepalive(ctx), pb.StartResponse, deadline):
            yield ev

    async def _drive_exec(self, sid: str, proc: _Proc, req: ExecRequest) -> None:
        result: ExecResult | None = None
        error: str | None = None
        try:
            async for item in self.ops.exec_stream(sid, req):
                if isinstance(item, ExecChunk):
                    data = Event.DataEvent(output=oneof(item.stream, item.data))
                    proc.publish(Event(event=oneof("data", data)))
                else:
                    result = item
        except asyncio.CancelledError:
            error = "killed"
        except CorralError as exc:
            error = str(exc)
        finally:
            proc.finish(_end_event(result, error))
            self._forget_later(sid, proc)

    async def _drive_pty(self, sid: str, proc: _Proc, req: PtyRequest, as_pty: bool) -> None:
        field = "pty" if as_pty else "stdout"
        error: str | None = None
        stream: PtyStream | None = None
        try:
            stream = await self.ops.pty(sid, req)
            async with stream:
                proc.pty = stream
                # a stdin process takes input only once its terminal stopped echoing (the
                # marker says so); what came before the marker is the wrapper's, dropped
                head = b"" if not as_pty else None
                if as_pty:
                    proc.pty_ready.set()
                async for data in stream:
                    if head is not None:
                        head += data
                        if _MARKER not in head:
                            continue
                        data = head.split(_MARKER, 1)[1]
                        head = None
                        proc.pty_ready.set()
                        if not data:
                            continue
                    ev = Event.DataEvent(output=oneof(field, data))
                    proc.publish(Event(event=oneof("data", ev)))
        except asyncio.CancelledError:
            error = "killed"
        except CorralError as exc:
            error = str(exc)
        finally:
            proc.finish(_end_event(stream.result if stream else None, error))
            self._forget_later(sid, proc)

    def _forget_later(self, sid: str, proc: _Proc) -> None:
        procs = self._procs.get(sid)
        if procs is not None:
            procs.pop(proc.pid, None)
            if not procs:
                self._procs.pop(sid, None)

    # ---------------------------------------------------------- other methods
    def connect(
        self, request: pb.ConnectRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.ConnectResponse]:
        proc = self._find(sandbox_of(ctx), request.process)
        keepalive, deadline = self._keepalive(ctx), self._deadline(ctx)
        return proc.events(proc.attach(), keepalive, pb.ConnectResponse, deadline)

    async def list(self, request: pb.ListRequest, ctx: RequestContext[Any, Any]) -> pb.ListResponse:
        procs = self._procs.get(sandbox_of(ctx), {})
        return pb.ListResponse(
            processes=[
                pb.ProcessInfo(config=p.config, pid=p.pid, tag=p.tag or None)
                for p in procs.values()
                if p.end is None
            ]
        )

    async def _pty_of(self, proc: _Proc) -> PtyStream:
        await proc.pty_ready.wait()
        if proc.pty is None or proc.end is not None:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {proc.pid} has ended")
        return proc.pty

    async def send_input(
        self, request: pb.SendInputRequest, ctx: RequestContext[Any, Any]
    ) -> pb.SendInputResponse:
        proc = self._find(sandbox_of(ctx), request.process)
        inp = request.input.input if request.input is not None else None
        if not proc.writable:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"process {proc.pid} was started without stdin (start it with stdin=True)",
            )
        stream = await self._pty_of(proc)
        if inp is not None:
            with contextlib.suppress(CorralError):
                await stream.write(inp.value)
        return pb.SendInputResponse()

    async def close_stdin(
        self, request: pb.CloseStdinRequest, ctx: RequestContext[Any, Any]
    ) -> pb.CloseStdinResponse:
        proc = self._find(sandbox_of(ctx), request.process)
        stream = await self._pty_of(proc)
        await stream.close_stdin()
        return pb.CloseStdinResponse()

    async def send_signal(
        self, request: pb.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> pb.SendSignalResponse:
        proc = self._find(sandbox_of(ctx), request.process)
        sig = int(request.signal.value) if request.signal is not None else 9
        if proc.pty is not None:
            try:
                await proc.pty.signal(sig or 9)
            except CorralError as exc:
                raise connect_error(exc) from None
        elif proc.task is not None:
            proc.task.cancel()
        return pb.SendSignalResponse()

    async def update(
        self, request: pb.UpdateRequest, ctx: RequestContext[Any, Any]
    ) -> pb.UpdateResponse:
        proc = self._find(sandbox_of(ctx), request.process)
        if request.pty is not None and request.pty.size is not None:
            stream = await self._pty_of(proc)
            await stream.resize(request.pty.size.rows, request.pty.size.cols)
        return pb.UpdateResponse()

    async def stream_input(
        self, request: AsyncIterator[pb.StreamInputRequest], ctx: RequestContext[Any, Any]
    ) -> pb.StreamInputResponse:
        proc: _Proc | None = None
        async for msg in request:
            ev = msg.event
            if ev is None:
                continue
            if ev.field == "start":
                proc = self._find(sandbox_of(ctx), ev.value.process)
            elif ev.field == "data" and proc is not None:
                stream = await self._pty_of(proc)
                inp = ev.value.input.input if ev.value.input is not None else None
                if inp is not None:
                    await stream.write(inp.value)
        return pb.StreamInputResponse()
