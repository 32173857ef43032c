"""``corral sandbox network ID --allow NAME [--deny NAME]``: change egress of a live sandbox."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from corral.cli._context import Globals, emit_json
from corral.errors import InvalidRequest
from corral.spec import NetworkPolicy

__all__ = ["register", "AllowOpt", "DenyOpt"]

AllowOpt = Annotated[
    list[str] | None,
    typer.Option("--allow", metavar="NAME", help="Grant a named network permission (repeatable)."),
]
DenyOpt = Annotated[
    list[str] | None,
    typer.Option("--deny", metavar="NAME", help="Refuse a named permission (repeatable)."),
]


def register(app: typer.Typer) -> None:
    @app.command("network")
    def network(
        ctx: typer.Context,
        sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
        allow: AllowOpt = None,
        deny: DenyOpt = None,
        none: Annotated[
            bool, typer.Option("--none", help="Revoke every allowance (no egress).")
        ] = False,
        json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """Show or change a sandbox's network policy (in effect when this returns)."""
        g: Globals = ctx.obj
        if none and allow:
            raise InvalidRequest("give --allow or --none, not both")

        async def run() -> NetworkPolicy:
            async with g.client() as client:
                sb = await client.sandboxes.get(sandbox_id)
                if allow is None and deny is None and not none:
                    return await sb.network.policy()
                return await sb.network.update(allow=[] if none else allow, deny=deny)

        policy = asyncio.run(run())
        if json_out or getattr(ctx.obj, "json", False):
            emit_json(policy)
        else:
            typer.echo(
                f"allow: {' '.join(policy.allow) or '-'}  deny: {' '.join(policy.deny) or '-'}"
            )
