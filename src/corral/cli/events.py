"""``corral events``: the node's event log across sandboxes, summarised per job/label."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from corral.cli._context import Globals, emit_json, out, parse_pairs
from corral.spec import EventSummary

app = typer.Typer(help="The event log: security denials and lifecycle, per job or label.")

LabelOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--label", "-l", metavar="K=V", help="Only sandboxes with this label (repeatable)."
    ),
]
KindOpt = Annotated[
    list[str] | None, typer.Option("--kind", "-k", help="Only this event kind (repeatable).")
]


@app.command("summary")
def summary(
    ctx: typer.Context,
    label: LabelOpt = None,
    kind: KindOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """How often each kind of event happened, per sandbox and in total.

    Example: ``corral events summary --label job=rl-42 --kind seccomp --kind pids_limit``
    """
    g: Globals = ctx.obj
    labels = parse_pairs(label, "--label")

    async def run() -> EventSummary:
        async with g.client() as client:
            return await client.events_summary(labels=labels or None, kinds=kind or None)

    s = asyncio.run(run())
    if json_out or g.json:
        emit_json(s)
        return
    out().print(summary_table(s))


def summary_table(s: EventSummary) -> Table:
    """A sandbox-by-kind table of counts, with a totals row."""
    kinds = sorted(s.totals)
    where = " ".join(f"{k}={v}" for k, v in s.labels.items()) or "all sandboxes"
    t = Table(title=f"events: {escape(where)}", caption=f"{len(s.sandboxes)} sandboxes")
    t.add_column("sandbox")
    for k in kinds:
        t.add_column(escape(k), justify="right")
    for sid in sorted(s.sandboxes):
        per = s.sandboxes[sid]
        t.add_row(escape(sid), *(str(per.get(k, "")) for k in kinds))
    t.add_section()
    t.add_row("[bold]total[/]", *(f"[bold]{s.totals[k]}[/]" for k in kinds))
    return t
