"""``corral sandbox pause`` / ``resume``: by id, or every sandbox of a job (``--label``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

from corral.cli._context import Globals, emit_json, parse_pairs
from corral.errors import InvalidRequest

if TYPE_CHECKING:
    from corral.spec import SandboxInfo

__all__ = ["register"]

_Ids = Annotated[list[str] | None, typer.Argument(metavar="[ID]...", help="Sandbox ids.")]
_Labels = Annotated[
    list[str] | None,
    typer.Option("--label", "-l", metavar="K=V", help="Every sandbox with these labels."),
]
_MemSnap = Annotated[
    bool,
    typer.Option(
        "--memory-snapshot",
        help="microVMs: save each machine to a file and end its VMM (all memory released).",
    ),
]
_Json = Annotated[bool, typer.Option("--json", help="Print JSON.")]
_Prefetch = Annotated[
    bool,
    typer.Option("--prefetch", help="Also read all their memory back from swap now."),
]


def _run(
    ctx: typer.Context,
    ids: list[str] | None,
    label: list[str] | None,
    pause: bool,
    prefetch: bool = False,
    memory_snapshot: bool = False,
) -> None:
    g: Globals = ctx.obj
    labels = parse_pairs(label, "--label")
    if bool(ids) == bool(labels):
        raise InvalidRequest("name sandbox ids or give --label K=V (not both)")
    if memory_snapshot and labels:
        raise InvalidRequest("--memory-snapshot: name sandbox ids (not --label)")

    async def run() -> list[SandboxInfo]:
        async with g.client() as client:
            if labels:
                if pause:
                    return [sb.info for sb in await client.sandboxes.pause(labels=labels)]
                got = await client.sandboxes.resume(labels=labels, prefetch=prefetch)
                return [sb.info for sb in got]
            handles = [await client.sandboxes.get(sid) for sid in ids or []]
            return list(
                await asyncio.gather(
                    *(
                        sb.pause(memory_snapshot) if pause else sb.resume(prefetch=prefetch)
                        for sb in handles
                    )
                )
            )

    infos = asyncio.run(run())
    if getattr(ctx.obj, "json", False):
        emit_json(infos)
        return
    for i in infos:
        mem = ""
        if i.memory_resident is not None:
            mem = f"  resident {i.memory_resident >> 20} MiB  swapped {(i.memory_swapped or 0) >> 20} MiB"
        typer.echo(f"{i.id}  {i.state}{mem}")


def register(app: typer.Typer) -> None:
    """Add the pause and resume commands to ``corral sandbox``."""

    @app.command("pause")
    def pause(
        ctx: typer.Context,
        sandbox_ids: _Ids = None,
        label: _Labels = None,
        memory_snapshot: _MemSnap = False,
    ) -> None:
        """Freeze sandboxes and move their memory to swap; state stays (any request, or
        ``resume``, thaws them). Prints each id with its memory resident and swapped."""
        _run(ctx, sandbox_ids, label, pause=True, memory_snapshot=memory_snapshot)

    @app.command("resume")
    def resume(
        ctx: typer.Context,
        sandbox_ids: _Ids = None,
        label: _Labels = None,
        prefetch: _Prefetch = False,
    ) -> None:
        """Thaw paused sandboxes (``--prefetch``: and start reading their memory back)."""
        _run(ctx, sandbox_ids, label, pause=False, prefetch=prefetch)
