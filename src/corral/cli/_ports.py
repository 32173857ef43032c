"""``corral sandbox port ID PORT``: where a server the guest runs is reached."""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
from typing import TYPE_CHECKING, Annotated

import typer

from corral.cli._context import Globals, emit_json

if TYPE_CHECKING:
    from corral.sdk._ports import PortEndpoint

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command("port")
    def port(
        ctx: typer.Context,
        sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
        number: Annotated[int, typer.Argument(metavar="PORT", help="Port the guest serves.")],
        host_form: Annotated[
            bool, typer.Option("--host", help="Print the host form ({port}-{id}.node) instead.")
        ] = False,
        curl: Annotated[
            bool, typer.Option("--curl", help="Print a curl command that reaches the port.")
        ] = False,
        open_it: Annotated[
            bool,
            typer.Option("--open", help="Open it in a browser (a link holding the token)."),
        ] = False,
        json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """Print the URL of a sandbox's port on the node (HTTP and WebSocket; the guest needs
        no network). Requests must send the header printed with --curl or --json: the
        sandbox's own access token, which opens this sandbox's ports and nothing else."""
        g: Globals = ctx.obj

        async def run() -> PortEndpoint:
            async with g.client() as client:
                sb = await client.sandboxes.get(sandbox_id)
                return await sb.ports.expose(number)

        ep = asyncio.run(run())
        if json_out or getattr(ctx.obj, "json", False):
            emit_json(
                {**dataclasses.asdict(ep), "ws_url": ep.ws_url, "browser_url": ep.browser_url}
            )
            return
        if open_it:
            import webbrowser

            if ep.unix_socket:
                raise typer.BadParameter("a browser cannot reach a node over a unix socket")
            typer.echo(ep.url)
            webbrowser.open(ep.browser_url)
            return
        url = ep.url
        if host_form:
            if ep.host_url is None:
                raise typer.BadParameter("the node's address is an IP or socket: no host form")
            url = ep.host_url
        if curl:
            words = ["curl"]
            if ep.unix_socket:
                words += ["--unix-socket", ep.unix_socket]
            for k, v in ep.headers.items():
                words += ["-H", f"{k}: {v}"]
            typer.echo(shlex.join([*words, url]))
        else:
            typer.echo(url)
