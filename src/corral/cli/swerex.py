"""``corral swerex image``: build the SWE-ReX toolkit image (once; cached in the store)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from corral.cli._context import Globals, emit_json, err

__all__ = ["app"]

app = typer.Typer(help="SWE-ReX (SWE-agent's runtime) on corral.", no_args_is_help=True)


@app.command("image")
def image(
    ctx: typer.Context,
    base: Annotated[
        str, typer.Option(help="Base image: needs python3 (3.10+) and pip.")
    ] = "base/debian",
    name: Annotated[str, typer.Option(help="Image to write.")] = "swerex/debian",
    store_dir: Annotated[
        Path | None,
        typer.Option("--store", envvar="CORRAL_STORE", help="Layer store (default: the node's)."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Image NAME = BASE + swe-rex in /opt/swerex, for ``CorralDeployment(image=NAME)``.
    Built on this host from wheels its pip fetches; a no-op when NAME is there already
    over the same BASE."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from corral.images.store import LayerStore
    from corral.integrations.swerex._toolkit import ensure_image

    g: Globals = ctx.obj
    store = LayerStore(store_dir if store_dir is not None else g.config().store_dir)
    console = err()
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    ) as progress:
        info = ensure_image(store, base=base, name=name, progress=progress)
    if json_out or g.json:
        emit_json(info)
    else:
        typer.echo(f"{info.name} {info.digest}")
