"""``corral fncall``: run a short program in a warm pool sandbox.

Example: ``corral fncall run --lang python solution.py --stdin input.txt``

Exit status: 0 when the call's status is ``ok``; 1 otherwise (the status is printed on
stderr); 2 a CorralError (bad request, no such image).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated

import typer

from corral.cli._context import Globals, emit_json, err
from corral.spec import CallLimits, CallResult

app = typer.Typer(help="Short calls in warm pool sandboxes (online-judge tasks, snippets).")


@app.command("run")
def run(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Source file ('-': read stdin).")],
    lang: Annotated[str, typer.Option("--lang", "-l", help="python, bash, c, cpp, ...")],
    stdin_file: Annotated[
        Path | None, typer.Option("--stdin", help="File given to the program as stdin.")
    ] = None,
    image: Annotated[
        str | None, typer.Option("--image", help="Pool image (default: the node's).")
    ] = None,
    cpu_time: Annotated[float, typer.Option("--cpu-time", help="CPU seconds.")] = 2.0,
    wall_time: Annotated[float, typer.Option("--wall-time", help="Wall-clock seconds.")] = 5.0,
    memory: Annotated[str, typer.Option("--memory", help="Memory limit, e.g. 256MiB.")] = "256MiB",
    output: Annotated[str, typer.Option("--output", help="Cap per output stream.")] = "64KiB",
    json_out: Annotated[bool, typer.Option("--json", help="Print the CallResult as JSON.")] = False,
) -> None:
    """Run FILE once; print its stdout (and stderr), exit 0 if its status is ok."""
    g: Globals = ctx.obj
    code = sys.stdin.read() if str(file) == "-" else file.read_text()
    stdin = stdin_file.read_text() if stdin_file is not None else ""
    limits = CallLimits(cpu_time=cpu_time, wall_time=wall_time, memory=memory, output=output)

    async def go() -> CallResult:
        async with g.client() as client:
            return await client.fncall.run(lang, code, stdin, limits=limits, image=image)

    r = asyncio.run(go())
    if json_out or g.json:
        emit_json(r)
    else:
        sys.stdout.write(r.stdout)
        sys.stdout.flush()
        sys.stderr.write(r.stderr)
        e = err()
        e.print(
            f"[dim]{r.status} · exit {r.exit_code if r.exit_code is not None else '-'} · "
            f"cpu {r.cpu_time * 1000:.1f} ms · wall {r.wall_time * 1000:.1f} ms · "
            f"peak {r.peak_memory >> 10} KiB[/]"
        )
    if r.status != "ok":
        raise typer.Exit(1)
