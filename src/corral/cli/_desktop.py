"""``corral sandbox screenshot ID OUT.png`` and ``corral sandbox input ID ACTION ...``: the
display of a ``vm`` sandbox created with ``--desktop WxH``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from corral.cli._context import Globals, err, validation_text
from corral.errors import InvalidRequest
from corral.spec import Desktop, DesktopInput

__all__ = ["register", "parse_size"]


def parse_size(text: str | None) -> Desktop | None:
    """``1280x800`` -> Desktop(width=1280, height=800); None stays None."""
    if text is None:
        return None
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise InvalidRequest(f"--desktop {text!r}: WIDTHxHEIGHT, e.g. 1280x800")
    try:
        return Desktop(width=int(w), height=int(h))
    except ValidationError as e:
        raise InvalidRequest("--desktop " + validation_text(e)) from None


def register(app: typer.Typer) -> None:
    @app.command("screenshot")
    def screenshot(
        ctx: typer.Context,
        sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
        out: Annotated[Path, typer.Argument(metavar="OUT.png", help="Where to write the PNG.")],
    ) -> None:
        """Write the screen of a desktop VM as a PNG file."""
        g: Globals = ctx.obj

        async def run() -> bytes:
            async with g.client() as client:
                return await (await client.sandboxes.get(sandbox_id)).desktop.screenshot()

        data = asyncio.run(run())
        out.write_bytes(data)
        err().print(f"{out}: {len(data)} bytes")

    @app.command("input")
    def input_(
        ctx: typer.Context,
        sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
        action: Annotated[str, typer.Argument(help="move, click, drag, scroll, type or key.")],
        x: Annotated[int | None, typer.Option(help="Pointer x (pixels from the left).")] = None,
        y: Annotated[int | None, typer.Option(help="Pointer y (pixels from the top).")] = None,
        to_x: Annotated[int | None, typer.Option(help="drag: end x.")] = None,
        to_y: Annotated[int | None, typer.Option(help="drag: end y.")] = None,
        button: Annotated[str, typer.Option(help="left, right or middle.")] = "left",
        count: Annotated[int, typer.Option(help="click: how many clicks.")] = 1,
        dx: Annotated[int, typer.Option(help="scroll: wheel clicks right (<0 left).")] = 0,
        dy: Annotated[int, typer.Option(help="scroll: wheel clicks down (<0 up).")] = 0,
        text: Annotated[str, typer.Option(help="type: the text (\\n for Enter).")] = "",
        keys: Annotated[str, typer.Option(help="key: a combo like ctrl+l.")] = "",
    ) -> None:
        """Send one pointer or keyboard action to a desktop VM, e.g.
        ``corral sandbox input ID click --x 200 --y 120`` or
        ``corral sandbox input ID type --text 'echo hi\\n'``."""
        g: Globals = ctx.obj
        fields = {
            "action": action,
            "x": x,
            "y": y,
            "to_x": to_x,
            "to_y": to_y,
            "button": button,
            "count": count,
            "dx": dx,
            "dy": dy,
            "text": text.replace("\\n", "\n").replace("\\t", "\t"),
            "keys": keys,
        }
        try:
            req = DesktopInput.model_validate(fields)
        except ValidationError as e:
            raise InvalidRequest(validation_text(e)) from None

        async def run() -> None:
            async with g.client() as client:
                ops = await client._get_ops()
                await ops.desktop_input(sandbox_id, req)

        asyncio.run(run())
