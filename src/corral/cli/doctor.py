"""``corral doctor``: check this host before it serves sandboxes (see corral.node.doctor).

Exit status 0 when no fatal check fails (warnings are printed), 1 when one does: a node
would refuse to start. ``--json`` prints ``{"ok": bool, "checks": [...]}`` as one line,
the last of stdout, for automation.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from corral.cli._context import Globals, err, out

__all__ = ["doctor"]


def doctor(
    ctx: typer.Context,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON (one line).")] = False,
) -> None:
    """Check kernel features, limits, disk, leftovers and helpers of this host for a node.

    Uses the node configuration of --config/--state-dir (default: /var/lib/corral). Reads
    only: nothing on the host is changed. Exit status 1 when a check the node cannot
    start without fails.
    """
    from corral.node.doctor import fatal_failures, run_checks

    g: Globals = ctx.obj
    checks = run_checks(g.config())
    fatal = fatal_failures(checks)
    if json_out or g.json:
        typer.echo(
            json.dumps({"ok": not fatal, "checks": [c.model_dump(mode="json") for c in checks]})
        )
    else:
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_column(no_wrap=True)
        table.add_column(style="bold", no_wrap=True)
        table.add_column(ratio=1)
        for c in checks:
            mark = (
                "[green]ok[/]" if c.ok else ("[bold red]FATAL[/]" if c.fatal else "[yellow]warn[/]")
            )
            text = escape(c.detail) + (f"\n[cyan]→ {escape(c.fix)}[/]" if c.fix else "")
            table.add_row(mark, escape(c.name), text)
        out().print(table)
        warns = sum(1 for c in checks if not c.ok and not c.fatal)
        if fatal:
            err().print(
                f"[bold red]{len(fatal)} fatal:[/] a node will not start here until "
                + ", ".join(escape(c.name) for c in fatal)
                + " is fixed"
            )
        else:
            err().print(
                "[green]this host can serve sandboxes[/]"
                + (f" ({warns} warning{'s' if warns != 1 else ''})" if warns else "")
            )
    if fatal:
        raise typer.Exit(1)
