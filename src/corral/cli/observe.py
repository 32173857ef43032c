"""``corral top`` (a live terminal view of a node) and ``corral ui`` (its dashboard in a
local browser).

``top`` asks the node once per refresh for its status, its sandboxes, stats over the
last minute (for rates) and the last ten minutes (for percentiles), and the security
events since the previous refresh; it keeps nothing but the last 12 events. ``--label``
narrows everything but the node figures to one job.

``ui`` serves the dashboard of a node on 127.0.0.1 behind a one-time token (see
:mod:`corral.api.ui_proxy`); an embedded node has no API to show, so it needs a running
``corral node serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from corral.cli._context import EMBEDDED, Globals, human_bytes, out, parse_pairs
from corral.errors import CursorExpired, InvalidRequest, NotFound
from corral.sdk._stats import fetch_stats
from corral.spec import Event, NodeStatus, SandboxInfo, Stats

__all__ = ["top", "ui"]

_SECURITY = (
    "seccomp",
    "pids_limit",
    "disk_quota",
    "oom",
    "oom_kill",
    "output_limit",
    "file_refused",
    "net_denied",
    "dns_denied",
)
_RATE_WINDOW = 60.0
_PCT_WINDOW = 600.0

LabelOpt = Annotated[
    list[str] | None,
    typer.Option("--label", "-l", metavar="K=V", help="Only sandboxes with this label."),
]


@dataclass
class _Frame:
    status: NodeStatus
    sandboxes: list[SandboxInfo]
    recent: Stats
    window: Stats
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=12))
    at: float = field(default_factory=time.time)


def _ms(s: float) -> str:
    if s < 0.001:
        return f"{s * 1e6:.0f} µs"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def render(frame: _Frame, labels: dict[str, str]) -> Group:
    """One screen of ``corral top``."""
    st = frame.status
    where = " ".join(f"{k}={v}" for k, v in labels.items()) or "all sandboxes"
    head = Table.grid(padding=(0, 3))
    for _ in range(5):
        head.add_column()
    used = st.mem_total - st.mem_available
    head.add_row(
        f"[b]node[/] {escape(st.node_id)}",
        f"[b]sandboxes[/] {st.sandboxes} (running {st.running}, paused {st.paused})",
        f"[b]memory[/] {human_bytes(used)} / {human_bytes(st.mem_total)}",
        f"[b]layers[/] {st.mounted_layers}",
        f"[b]backends[/] {escape(', '.join(b.kind for b in st.backends))} · "
        f"{escape(st.cgroup_mode)}",
    )
    rates = Table.grid(padding=(0, 3))
    rates.add_column()
    cells = []
    for op in ("create", "exec", "pause", "resume", "destroy"):
        n = frame.recent.ops[op].count if op in frame.recent.ops else 0
        cells.append(f"[b]{op}s/s[/] {n / _RATE_WINDOW:.2f}")
    rates.add_row("   ".join(cells))

    by = Table(title=f"sandboxes: {escape(where)}", expand=False)
    by.add_column("state")
    by.add_column("backend")
    by.add_column("class")
    by.add_column("count", justify="right")
    counts: dict[tuple[str, str, str], int] = {}
    for info in frame.sandboxes:
        key = (info.state, getattr(info, "backend", None) or "container", info.spec.qos)
        counts[key] = counts.get(key, 0) + 1
    for (state, backend, qos), n in sorted(counts.items()):
        by.add_row(state, backend, qos, str(n))
    if not counts:
        by.add_row("-", "-", "-", "0")

    lat = Table(title=f"latency, last {_PCT_WINDOW / 60:.0f} min", expand=False)
    for col in ("operation / phase", "count", "p50", "p90", "p99"):
        lat.add_column(col, justify="left" if col.startswith("op") else "right")
    for op, s in frame.window.ops.items():
        lat.add_row(f"[b]{op}[/]", str(s.count), _ms(s.p50), _ms(s.p90), _ms(s.p99))
        for ph, p in s.phases.items():
            lat.add_row(f"  {ph}", str(p.count), _ms(p.p50), _ms(p.p90), _ms(p.p99))
    if not frame.window.ops:
        lat.add_row("(no operations yet)", "", "", "", "")

    ev = Table(title="recent security events", expand=False)
    ev.add_column("time")
    ev.add_column("kind")
    ev.add_column("sandbox")
    ev.add_column("detail")
    for e in reversed(frame.events):
        detail = " ".join(f"{k}={v}" for k, v in e.detail.items())
        ev.add_row(
            time.strftime("%H:%M:%S", time.localtime(e.time)),
            f"[red]{escape(e.kind)}[/]",
            escape(e.sandbox_id or "node"),
            escape(detail[:60]),
        )
    if not frame.events:
        ev.add_row("-", "none", "", "")
    stamp = time.strftime("%H:%M:%S", time.localtime(frame.at))
    side = Table.grid(padding=(0, 4))
    side.add_row(by, ev)
    return Group(Panel(Group(head, rates), title=f"corral top · {stamp}"), side, lat)


async def _stats(ops: Any, labels: dict[str, str], since: float) -> Stats:
    """The node's stats, or empty ones from a node that keeps none (older, or metrics
    off): top still shows everything else."""
    try:
        return await fetch_stats(ops, labels or None, since=since)
    except (NotFound, InvalidRequest):
        return Stats(labels=labels, since=since)


async def _security_events(ops: Any, labels: dict[str, str], after: str | None) -> list[Event]:
    """Security events after ``after``; a cursor the node's retention passed (no such
    event for that long) starts again at the oldest kept."""
    try:
        return await ops.events(after=after, labels=labels or None, kinds=list(_SECURITY))
    except CursorExpired:
        return await ops.events(after=None, labels=labels or None, kinds=list(_SECURITY))


async def _frame(
    ops: Any, labels: dict[str, str], events: deque[Event], since: list[str | None]
) -> _Frame:
    now = time.time()
    status, sandboxes, recent, window, new = await asyncio.gather(
        ops.node_status(),
        ops.sandbox_list(labels=labels or None),
        _stats(ops, labels, now - _RATE_WINDOW),
        _stats(ops, labels, now - _PCT_WINDOW),
        _security_events(ops, labels, since[0]),
    )
    if new:
        since[0] = new[-1].cursor
        events.extend(new)
    return _Frame(status, sandboxes, recent, window, events)


def top(
    ctx: typer.Context,
    label: LabelOpt = None,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between refreshes.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one screen and exit.")] = False,
) -> None:
    """A live view of the node: capacity, sandboxes by state/backend/class, operations
    per second, latency percentiles per phase, recent security events.

    Example: ``corral top --label job=rl-42``
    """
    g: Globals = ctx.obj
    labels = parse_pairs(label, "--label")

    async def run() -> None:
        async with g.client() as client:
            # the operations object itself: stats is not on the client yet (sdk/_stats.py)
            ops = await client._get_ops()
            events: deque[Event] = deque(maxlen=12)
            since: list[str | None] = [None]
            frame = await _frame(ops, labels, events, since)
            if once:
                out().print(render(frame, labels))
                return
            with Live(render(frame, labels), console=out(), screen=False) as live:
                while True:
                    await asyncio.sleep(interval)
                    frame = await _frame(ops, labels, events, since)
                    live.update(render(frame, labels))

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


def ui(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(min=0, max=65535, help="Local port (0: any free).")] = 0,
) -> None:
    """Serve the node's dashboard on 127.0.0.1 behind a one-time token; open the printed
    URL in a browser. Read-only: the page cannot change anything on the node.
    """
    from corral.api.ui_proxy import UIProxy

    g: Globals = ctx.obj
    target = g.target()
    if target == EMBEDDED:
        raise InvalidRequest(
            "corral ui shows a running node: start one with `corral node serve`, or pass "
            "--node unix:///path/api.sock (or http://host:port with --token)"
        )

    async def run() -> None:
        async with UIProxy(target, token=g.token, port=port) as proxy:
            typer.echo(f"corral dashboard of {target}:")
            typer.echo(f"  {proxy.login_url}")
            typer.echo("(the token works once; Ctrl-C stops)", err=True)
            await proxy.wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
