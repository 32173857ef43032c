"""``corral fncall``: run a short program in a warm pool sandbox.

Example: ``corral fncall run --lang python solution.py --stdin input.txt``; ``corral fncall
setup`` builds the image calls use when they name none (once, cached in the store).

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


@app.command("setup")
def setup(
    ctx: typer.Context,
    suite: Annotated[str, typer.Option(help="Debian release to build on.")] = "bookworm",
    mirror: Annotated[str | None, typer.Option(help="Debian mirror URL.")] = None,
    store_dir: Annotated[
        Path | None,
        typer.Option("--store", help="Layer store directory (default: the node's store_dir)."),
    ] = None,
    rebuild: Annotated[bool, typer.Option(help="Build again even if it exists.")] = False,
) -> None:
    """Build the image calls without an image use (fncall/default), once.

    A Debian release with python3, gcc and g++ (the built-in languages python, bash, c,
    cpp), written to the node's layer store; a node without fncall.default_image uses it.
    Takes a minute or more (mmdebstrap downloads the packages: 40 s here); later runs
    find it in the store and return at once.
    """
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from corral.backends.fncall.config import SETUP_IMAGE, SETUP_PACKAGES
    from corral.errors import ImageNotFound
    from corral.images import build
    from corral.images.store import LayerStore

    g: Globals = ctx.obj
    store = LayerStore(store_dir if store_dir is not None else g.config().store_dir)
    if not rebuild:
        try:
            img = store.image(SETUP_IMAGE)
        except ImageNotFound:
            pass
        else:
            err().print(f"{SETUP_IMAGE} is already in {store.root} ({img.digest[:19]})")
            return
    err().print(
        f"building {SETUP_IMAGE}: Debian {suite} with {', '.join(SETUP_PACKAGES)} "
        "(once; cached in the layer store)"
    )
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=err(),
    ) as progress:
        layer = build.build_debian(
            store, suite, include=list(SETUP_PACKAGES), mirror=mirror, progress=progress
        )
    img = store.put_image(SETUP_IMAGE, [layer.digest], workdir="/")
    err().print(f"image {SETUP_IMAGE} {img.digest[:19]}: fncall.run(language=...) works now")
