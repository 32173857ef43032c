"""``corral sandbox snapshot`` / ``fork``: a sandbox's files as an image, or as new sandboxes."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError

from corral.cli._context import Globals, emit_json, parse_pairs, validation_text
from corral.errors import InvalidRequest
from corral.spec import Limits

if TYPE_CHECKING:
    from corral.spec import ImageInfo, SandboxInfo

__all__ = ["register"]

_Id = Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")]
_Json = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _json(ctx: typer.Context, flag: bool) -> bool:
    return flag or bool(getattr(ctx.obj, "json", False))


def register(app: typer.Typer) -> None:
    """Add the snapshot and fork commands to ``corral sandbox``."""

    @app.command("snapshot")
    def snapshot(
        ctx: typer.Context,
        sandbox_id: _Id,
        name: Annotated[
            str | None,
            typer.Option("--name", help="Image name (default snapshot/ID:<UTC time>)."),
        ] = None,
        json_out: _Json = False,
    ) -> None:
        """Pack the sandbox's filesystem changes into a new layer and image (processes are
        not included); prints the image name. `corral sandbox create NAME` restores it."""
        g: Globals = ctx.obj

        async def run() -> ImageInfo:
            async with g.client() as client:
                return await (await client.sandboxes.get(sandbox_id)).snapshot(name)

        img = asyncio.run(run())
        if _json(ctx, json_out):
            emit_json(img)
        else:
            typer.echo(img.name)

    @app.command("fork")
    def fork(
        ctx: typer.Context,
        sandbox_id: _Id,
        count: Annotated[int, typer.Option("--count", "-n", min=1, help="How many.")] = 1,
        memory: Annotated[str | None, typer.Option(help="Memory limit of each child.")] = None,
        disk: Annotated[str | None, typer.Option(help="Writable-layer quota of each.")] = None,
        label: Annotated[
            list[str] | None,
            typer.Option(
                "--label",
                "-l",
                metavar="K=V",
                help="Labels of the children (replace the parent's).",
            ),
        ] = None,
        ttl: Annotated[float | None, typer.Option(help="Destroy each after SECONDS.")] = None,
        json_out: _Json = False,
    ) -> None:
        """Start N sandboxes from the sandbox's current files (copy-on-write; processes are
        not cloned). Children inherit its spec except what is given; prints their ids."""
        g: Globals = ctx.obj
        limits = None
        given = {k: v for k, v in {"memory": memory, "disk": disk}.items() if v is not None}
        labels = parse_pairs(label, "--label") if label else None

        async def run() -> list[SandboxInfo]:
            nonlocal limits
            async with g.client() as client:
                parent = await client.sandboxes.get(sandbox_id)
                if given:
                    try:
                        base = parent.info.spec.limits.model_dump()
                        limits = Limits.model_validate({**base, **given})
                    except ValidationError as e:
                        raise InvalidRequest("--" + validation_text(e)) from None
                kids = await parent.fork(count, limits=limits, labels=labels, ttl=ttl)
                return [k.info for k in kids]

        infos = asyncio.run(run())
        if _json(ctx, json_out):
            emit_json(infos)
        else:
            for i in infos:
                typer.echo(i.id)
