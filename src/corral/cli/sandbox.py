"""``corral sandbox``: create, exec, shell, ls, rm, cp, events, info, snapshot, fork, port."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from corral.cli import _cp, _desktop, _network, _pause, _ports, _pty, _snapshot
from corral.cli._context import (
    EMBEDDED,
    Globals,
    emit_json,
    err,
    out,
    parse_pairs,
    validation_text,
)
from corral.errors import CorralError, CursorExpired, InvalidRequest
from corral.spec import Limits, PtyRequest

if TYPE_CHECKING:
    from corral.ops import NodeOps
    from corral.spec import Event, ExecResult, SandboxInfo

__all__ = ["app", "exit_status"]

app = typer.Typer(help="Create and use sandboxes.", no_args_is_help=True)
_pause.register(app)  # pause, resume
_snapshot.register(app)  # snapshot, fork
_network.register(app)  # network
_ports.register(app)  # port
_desktop.register(app)  # screenshot, input

# Same conventions as timeout(1) and shells, so scripts can tell the cases apart.
EXIT_TIMEOUT = 124
_DESTROY_CONCURRENCY = 16
_EVENTS_PAGE = 1000
_FINAL_EVENTS = {"destroyed", "ttl_expired", "idle_timeout", "lost", "create_failed"}

LabelOpt = Annotated[
    list[str] | None, typer.Option("--label", "-l", metavar="K=V", help="Label (repeatable).")
]
EnvOpt = Annotated[
    list[str] | None, typer.Option("--env", "-e", metavar="K=V", help="Environment (repeatable).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _want_json(ctx: typer.Context, flag: bool) -> bool:
    return flag or bool(getattr(ctx.obj, "json", False))


# ---------------------------------------------------------------------------- create
@app.command("create")
def create(
    ctx: typer.Context,
    image: Annotated[str, typer.Argument(help="Image name or sha256: manifest digest.")],
    cpus: Annotated[float | None, typer.Option(help="CPU cores (cgroup quota).")] = None,
    memory: Annotated[str | None, typer.Option(help="Memory limit, e.g. 512MiB.")] = None,
    pids: Annotated[int | None, typer.Option(help="Max processes and threads.")] = None,
    disk: Annotated[str | None, typer.Option(help="Writable-layer quota, e.g. 2GiB.")] = None,
    output: Annotated[
        str | None, typer.Option(help="Default cap per exec output stream, e.g. 1MiB.")
    ] = None,
    output_rate: Annotated[
        str | None,
        typer.Option(help="Output the node relays a second, all execs together, e.g. 32MiB."),
    ] = None,
    ttl: Annotated[float | None, typer.Option(help="Destroy after this many seconds.")] = None,
    idle_timeout: Annotated[
        float | None, typer.Option(help="Destroy after this many idle seconds.")
    ] = None,
    idle_pause: Annotated[
        float | None, typer.Option(help="Pause after this many idle seconds (state kept).")
    ] = None,
    qos: Annotated[
        str | None, typer.Option(help="CPU class: best_effort (default) or latency.")
    ] = None,
    label: LabelOpt = None,
    env: EnvOpt = None,
    workdir: Annotated[str | None, typer.Option(help="Default cwd of execs.")] = None,
    hostname: Annotated[str | None, typer.Option(help="Hostname inside.")] = None,
    allow: _network.AllowOpt = None,
    deny: _network.DenyOpt = None,
    backend: Annotated[
        str | None, typer.Option(help="Isolation engine: container (default), microvm, vm.")
    ] = None,
    desktop: Annotated[
        str | None,
        typer.Option(metavar="WxH", help="vm: a display with an X session, e.g. 1280x800."),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Create a sandbox and print its id."""
    g: Globals = ctx.obj
    given = {
        "cpus": cpus,
        "memory": memory,
        "pids": pids,
        "disk": disk,
        "output": output,
        "output_rate": output_rate,
    }
    try:
        limits = Limits.model_validate({k: v for k, v in given.items() if v is not None})
    except ValidationError as e:
        raise InvalidRequest("--" + validation_text(e)) from None
    labels = parse_pairs(label, "--label")
    envs = parse_pairs(env, "--env")
    display = _desktop.parse_size(desktop)

    async def run() -> SandboxInfo:
        async with g.client() as client:
            sb = await client.sandboxes.create(
                image,
                limits=limits,
                ttl=ttl,
                idle_timeout=idle_timeout,
                labels=labels,
                env=envs,
                workdir=workdir,
                hostname=hostname,
                idle_pause=idle_pause,
                qos=qos,
                network={"allow": allow or [], "deny": deny or []},
                backend=backend,
                desktop=display,
            )
            return sb.info

    info = asyncio.run(run())
    if _want_json(ctx, json_out):
        emit_json(info)
    else:
        typer.echo(info.id)


# ------------------------------------------------------------------------------ exec
def exit_status(r: ExecResult) -> int:
    """The CLI's exit status for a command result: its own code, 124 on timeout, 128+N
    when killed by signal N."""
    if r.reason == "exited":
        return r.exit_code if r.exit_code is not None else 1
    if r.reason == "timeout":
        return EXIT_TIMEOUT
    if r.signal:
        return 128 + r.signal
    return 1


def _explain(r: ExecResult, limit: str | None) -> list[str]:
    notes = []
    if r.reason == "timeout":
        notes.append(f"command timed out after {r.duration:.1f} s and was killed")
    elif r.reason == "oom":
        notes.append("command was killed: the sandbox ran out of memory")
    elif r.reason == "output_limit":
        notes.append("command was killed: its output passed the output limit")
    elif r.reason == "signaled":
        notes.append(f"command was killed by signal {r.signal}")
    for stream, cut in (("stdout", r.stdout_truncated), ("stderr", r.stderr_truncated)):
        if cut:
            notes.append(
                f"{stream} was truncated at the output limit"
                + (f" ({limit})" if limit else "")
                + "; pass --output-limit to raise it"
            )
    return notes


@app.command(
    "exec",
    context_settings={"allow_interspersed_args": False},
)
def exec_(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
    cmd: Annotated[list[str], typer.Argument(metavar="CMD...", help="Command and arguments.")],
    timeout: Annotated[float | None, typer.Option(help="Kill after this many seconds.")] = None,
    cwd: Annotated[str | None, typer.Option(help="Working directory inside.")] = None,
    env: EnvOpt = None,
    user: Annotated[str | None, typer.Option(help="uid, uid:gid or a user name.")] = None,
    stdin: Annotated[
        bool, typer.Option("--stdin", "-i", help="Send this command's stdin to the command.")
    ] = False,
    output_limit: Annotated[
        str | None, typer.Option(help="Cap per output stream, e.g. 64MiB.")
    ] = None,
) -> None:
    """Run CMD in the sandbox, streaming its output; exit with its exit status.

    Options go before ID; everything after ID is the command (``--`` is optional).
    """
    g: Globals = ctx.obj
    if cmd and cmd[0] == "--":
        # Parsing stops at ID (so the command's own options stay its own), which leaves
        # the optional separator in the command.
        cmd = cmd[1:]
    if not cmd:
        raise InvalidRequest("exec: give the command after the sandbox id")
    data = typer.get_binary_stream("stdin").read() if stdin else None
    envs = parse_pairs(env, "--env")
    stdout = typer.get_binary_stream("stdout")
    stderr = typer.get_binary_stream("stderr")

    async def run() -> ExecResult:
        async with g.client() as client:
            sb = await client.sandboxes.get(sandbox_id)
            stream = sb.exec_stream(
                cmd,
                stdin=data,
                env=envs,
                cwd=cwd,
                user=user,
                timeout=timeout,
                output_limit=output_limit,
            )
            async with stream as s:
                async for chunk in s:
                    sink = stdout if chunk.stream == "stdout" else stderr
                    sink.write(chunk.data)
                    sink.flush()
            assert stream.result is not None
            return stream.result

    result = asyncio.run(run())
    for note in _explain(result, output_limit):
        err().print(f"[yellow]corral: {escape(note)}[/]")
    raise typer.Exit(exit_status(result))


# ----------------------------------------------------------------------------- shell
@app.command("shell")
def shell(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
    cmd: Annotated[
        list[str] | None,
        typer.Option("--cmd", help="Program to run (repeat for arguments); default bash or sh."),
    ] = None,
    env: EnvOpt = None,
) -> None:
    """Open an interactive terminal in the sandbox."""
    g: Globals = ctx.obj
    try:
        stdin_fd, stdout_fd = sys.stdin.fileno(), sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        raise InvalidRequest(
            "`corral sandbox shell` needs a terminal (stdin has no file)"
        ) from None
    envs = parse_pairs(env, "--env")
    sys.stdout.flush()
    result = asyncio.run(_shell(g, sandbox_id, cmd, envs, stdin_fd, stdout_fd))
    raise typer.Exit(_pty.exit_status(result))


async def _shell(
    g: Globals,
    sandbox_id: str,
    cmd: list[str] | None,
    env: dict[str, str],
    stdin_fd: int,
    stdout_fd: int,
) -> ExecResult | None:
    target = g.target()
    node: NodeOps
    if target == EMBEDDED:
        from corral.node import Node

        node = await Node.open(g.config())
    else:
        from corral.sdk._http import HTTPOps

        node = HTTPOps(target, token=g.token)  # the terminal over the API's websocket
    try:
        rows, cols = _pty.window_size(stdin_fd)
        try:
            req = PtyRequest(cmd=cmd or None, rows=rows, cols=cols, env=env)
        except ValidationError as exc:
            raise InvalidRequest(validation_text(exc)) from None
        stream = await node.pty(sandbox_id, req)  # no cmd: the node picks bash or sh
        return await _pty.attach(stream, stdin_fd=stdin_fd, stdout_fd=stdout_fd)
    finally:
        await node.close()


# -------------------------------------------------------------------------------- ls
def _ago(t: float, now: float) -> str:
    return _span(now - t) + " ago"


def _span(s: float) -> str:
    s = max(s, 0)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"


@app.command("ls")
def ls(
    ctx: typer.Context,
    label: LabelOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List sandboxes (those carrying every --label given)."""
    g: Globals = ctx.obj
    labels = parse_pairs(label, "--label")

    async def run() -> list[SandboxInfo]:
        async with g.client() as client:
            return [sb.info for sb in await client.sandboxes.list(labels=labels or None)]

    infos = sorted(asyncio.run(run()), key=lambda i: i.created_at)
    if _want_json(ctx, json_out):
        emit_json(infos)
        return
    now = time.time()
    table = Table(box=None, pad_edge=False)
    for col in ("ID", "STATE", "IMAGE", "CREATED", "EXPIRES", "LABELS"):
        table.add_column(col, no_wrap=col != "LABELS")
    for i in infos:
        table.add_row(
            i.id,
            i.state,
            i.image,
            _ago(i.created_at, now),
            "in " + _span(i.expires_at - now) if i.expires_at else "-",
            ",".join(f"{k}={v}" for k, v in sorted(i.spec.labels.items())),
        )
    out().print(table)


# -------------------------------------------------------------------------------- rm
@app.command("rm")
def rm(
    ctx: typer.Context,
    sandbox_ids: Annotated[
        list[str] | None, typer.Argument(metavar="[ID]...", help="Sandbox ids.")
    ] = None,
    all_: Annotated[
        bool, typer.Option("--all", "-a", help="Every sandbox (with --label: every match).")
    ] = False,
    label: LabelOpt = None,
) -> None:
    """Destroy sandboxes; prints each id destroyed."""
    g: Globals = ctx.obj
    ids = list(sandbox_ids or [])
    labels = parse_pairs(label, "--label")
    if ids and all_:
        raise InvalidRequest("give sandbox ids or --all, not both")
    if labels and not all_:
        raise InvalidRequest("--label selects sandboxes for --all; add --all")
    if not ids and not all_:
        raise InvalidRequest("name the sandboxes to remove, or pass --all [--label K=V]")

    async def run() -> list[tuple[str, CorralError | None]]:
        async with g.client() as client:
            targets = ids or [sb.id for sb in await client.sandboxes.list(labels=labels or None)]
            gate = asyncio.Semaphore(_DESTROY_CONCURRENCY)

            async def one(sid: str) -> tuple[str, CorralError | None]:
                async with gate:
                    try:
                        await (await client.sandboxes.get(sid)).destroy()
                    except CorralError as e:
                        return sid, e
                return sid, None

            return list(await asyncio.gather(*(one(s) for s in targets)))

    results = asyncio.run(run())
    failed = [(sid, e) for sid, e in results if e is not None]
    for sid, e in results:
        if e is None:
            typer.echo(sid)
    if len(results) == 1 and failed:
        raise failed[0][1]  # type: ignore[misc]
    for sid, e in failed:
        err().print(f"[bold red]error:[/] [red]{escape(sid)}: {escape(e.message)}[/]")
    if failed:
        raise typer.Exit(2)


# -------------------------------------------------------------------------------- cp
@app.command("cp")
def cp(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="LOCAL_PATH or ID:PATH")],
    dst: Annotated[str, typer.Argument(help="ID:PATH or LOCAL_PATH")],
) -> None:
    """Copy files or directories between this host and a sandbox (docker-cp style)."""
    g: Globals = ctx.obj
    s, d = _cp.parse_ref(src), _cp.parse_ref(dst)

    async def run() -> str:
        async with g.client() as client:
            return await _cp.copy(client, s, d)

    landed = asyncio.run(run())
    err().print(f"copied {escape(str(s))} to {escape(landed)}")


# ---------------------------------------------------------------------------- events
@app.command("events")
def events(
    ctx: typer.Context,
    sandbox_id: Annotated[
        str | None, typer.Argument(metavar="[ID]", help="Sandbox id (default: all).")
    ] = None,
    label: LabelOpt = None,
    after: Annotated[
        str | None,
        typer.Option(metavar="CURSOR", help="Only events after this cursor (an event's cursor)."),
    ] = None,
    kind: Annotated[
        list[str] | None, typer.Option("--kind", "-k", help="Only this kind (repeatable).")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON lines.")] = False,
) -> None:
    """Lifecycle and security events, oldest first."""
    g: Globals = ctx.obj
    labels = parse_pairs(label, "--label")
    as_json = _want_json(ctx, json_out)
    if sandbox_id and labels:
        raise InvalidRequest("give a sandbox id or --label, not both")

    def show(evs: list[Event]) -> None:
        if as_json:
            for e in evs:
                typer.echo(e.model_dump_json())
            return
        console = out()
        for e in evs:
            stamp = time.strftime("%H:%M:%S", time.localtime(e.time))
            detail = " ".join(f"{k}={v}" for k, v in e.detail.items())
            who = f"{e.sandbox_id} " if sandbox_id is None and e.sandbox_id else ""
            console.print(
                f"{e.id:>6} {stamp} {escape(who)}[bold]{escape(e.kind)}[/] {escape(detail)}"
            )

    async def run() -> None:
        cursor = after
        async with g.client() as client:
            while True:
                try:
                    evs = await client.events(
                        sandbox_id=sandbox_id,
                        after=cursor,
                        labels=labels or None,
                        kinds=kind,
                        limit=_EVENTS_PAGE,
                    )
                except CursorExpired as e:
                    if not follow or cursor is None:
                        raise
                    # fell behind the node's retention: say so, go on from the oldest kept
                    err().print(f"[yellow]events were missed:[/] {escape(e.message)}")
                    cursor = None
                    continue
                show(evs)
                if evs:
                    cursor = evs[-1].cursor
                if sandbox_id and any(e.kind in _FINAL_EVENTS for e in evs):
                    return
                if len(evs) == _EVENTS_PAGE:
                    continue  # a full page: more are waiting
                if not follow:
                    return
                await asyncio.sleep(1.0)

    asyncio.run(run())


# ------------------------------------------------------------------------------ info
@app.command("info")
def info(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
) -> None:
    """Print what the node knows about a sandbox, as JSON."""
    g: Globals = ctx.obj

    async def run() -> SandboxInfo:
        async with g.client() as client:
            return (await client.sandboxes.get(sandbox_id)).info

    emit_json(asyncio.run(run()))
