"""``corral node``: serve the API, show status, collect garbage."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from corral.cli._context import EMBEDDED, Globals, emit_json, err, human_bytes, out
from corral.errors import Conflict, InvalidRequest

if TYPE_CHECKING:
    from corral.node import NodeConfig
    from corral.ops import NodeOps
    from corral.spec import BackendStatus, NodeStatus

__all__ = ["app"]

app = typer.Typer(help="Run and inspect the node agent.", no_args_is_help=True)


def _parse_hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidRequest(f"--tcp {value!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


def _read_token(token: str | None, token_file: Path | None) -> str | None:
    if token and token_file:
        raise InvalidRequest("give --token or --token-file, not both")
    if token_file is None:
        return token
    try:
        value = token_file.read_text().strip()
    except OSError as e:
        raise InvalidRequest(f"--token-file {token_file}: {e.strerror}") from None
    if not value:
        raise InvalidRequest(f"--token-file {token_file} is empty")
    return value


@app.command("serve")
def serve(
    ctx: typer.Context,
    socket_path: Annotated[
        Path | None,
        typer.Option("--socket", help="Unix socket to serve on (default: the node's api_socket)."),
    ] = None,
    tcp: Annotated[
        str | None, typer.Option("--tcp", metavar="HOST:PORT", help="Also serve on TCP.")
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token", help="Bearer token required over TCP (default: the global --token)."
        ),
    ] = None,
    token_file: Annotated[
        Path | None, typer.Option("--token-file", help="File holding the bearer token.")
    ] = None,
    config_file: Annotated[
        Path | None, typer.Option("--config", help="node.toml ([node] table of NodeConfig).")
    ] = None,
    e2b_template: Annotated[
        list[str] | None,
        typer.Option(
            "--e2b-template",
            metavar="TEMPLATE=IMAGE",
            help="E2B template id/alias served as this corral image (repeatable; over "
            "node.toml's e2b_templates).",
        ),
    ] = None,
    e2b: Annotated[
        bool,
        typer.Option(
            "--e2b/--no-e2b",
            help="Also speak the E2B API (E2B_API_URL/E2B_SANDBOX_URL point here, E2B_API_KEY "
            "is the token); on by default, --no-e2b serves corral's API only.",
        ),
    ] = True,
) -> None:
    """Open the node and serve the REST API until SIGTERM or SIGINT, then close the node."""
    g: Globals = ctx.obj
    if config_file is not None:
        g.config_file = config_file
    cfg = g.config()
    if e2b_template:
        templates = {**cfg.e2b_templates, **_parse_templates(e2b_template)}
        cfg = cfg.model_copy(update={"e2b_templates": templates})
    secret = _read_token(token or None, token_file)
    host = port = None
    if tcp:
        host, port = _parse_hostport(tcp)
        secret = secret or g.token  # the global --token / CORRAL_TOKEN
        if not secret:
            raise InvalidRequest(
                "--tcp needs --token or --token-file: the API runs commands in sandboxes and "
                "must not be open to anyone who can reach the port"
            )
    elif secret:
        raise InvalidRequest(
            "--token/--token-file guard the --tcp listener; the unix socket is protected by "
            "its mode (0600, the node's user only)"
        )
    uds = socket_path or cfg.socket_path
    asyncio.run(_serve(cfg, uds=uds, host=host, port=port, token=secret, e2b=e2b))


def _parse_templates(items: list[str]) -> dict[str, str]:
    """``TEMPLATE=IMAGE`` options as a table; a malformed one is a user error naming it."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, image = item.partition("=")
        if not sep or not name.strip() or not image.strip():
            raise InvalidRequest(f"--e2b-template {item!r}: expected TEMPLATE=IMAGE")
        out[name.strip()] = image.strip()
    return out


async def _open_node(cfg: NodeConfig) -> NodeOps:
    from corral.node import Node

    return await Node.open(cfg)


async def _serve(
    cfg: NodeConfig,
    *,
    uds: Path,
    host: str | None,
    port: int | None,
    token: str | None,
    open_node: Callable[[NodeConfig], Awaitable[NodeOps]] = _open_node,
    e2b: bool = True,
) -> None:
    """Open the node, serve it on ``uds`` (and TCP), close it on SIGINT/SIGTERM."""
    from corral.api.server import NodeServer

    loop = asyncio.get_running_loop()
    servers: list[NodeServer] = []
    stopping = False

    def stop() -> None:
        # First signal: graceful (in-flight requests finish); a second one cuts them short.
        nonlocal stopping
        stopping = True
        for s in servers:
            s.request_stop()

    # Installed before the node opens, so a signal during start-up still closes it cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    started: list[NodeServer] = []
    metrics = None
    try:
        node = await open_node(cfg)
        try:
            servers.append(NodeServer(node, uds=uds, e2b=e2b))
            if host is not None:
                servers.append(NodeServer(node, host=host, port=port, token=token, e2b=e2b))
            for s in servers:
                await s.start()
                started.append(s)
            metrics = await _metrics_listener(cfg, node)
            err().print(
                f"corral node {getattr(node, 'node_id', '')} serving on "
                + " and ".join(s.address for s in servers)
                + f" (state {cfg.state_dir}); stop with Ctrl-C or SIGTERM"
            )
            if stopping:
                stop()
            waits = [asyncio.ensure_future(s.wait()) for s in servers]
            # One listener failing stops the others: half a node is worse than none.
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not stopping:
                stop()
            await asyncio.gather(*waits, return_exceptions=True)
        finally:
            if metrics is not None:
                with contextlib.suppress(Exception):
                    await metrics.__aexit__(None, None, None)
            for s in started:
                with contextlib.suppress(Exception):
                    await s.stop()
            # Shielded: a late signal must not leave the node half closed.
            await asyncio.shield(node.close())
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    err().print("corral node stopped")


async def _metrics_listener(cfg: NodeConfig, node: NodeOps):  # type: ignore[no-untyped-def]
    """The token-free ``/metrics`` listener of ``[node.metrics] listen``, if configured."""
    observer = getattr(node, "observer", None)
    if cfg.metrics.listen is None or observer is None:
        return None
    from corral.api.observe import MetricsServer

    server = MetricsServer(observer, cfg.metrics.listen)
    await server.__aenter__()
    err().print(f"metrics on http://{cfg.metrics.listen}/metrics (no token)")
    return server


@app.command("status")
def status(
    ctx: typer.Context,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the node's identity, backends, capacity and what it runs."""
    g: Globals = ctx.obj
    st = asyncio.run(_status(g))
    if json_out or g.json:
        emit_json(st)
        return
    out().print(status_table(st))


def _capacity(st: NodeStatus) -> str:
    if not st.idle_capacity:
        return "unknown"
    return f"about {st.idle_capacity} idle sandboxes (bounded by {st.idle_capacity_bound})"


def status_table(st: NodeStatus) -> Table:
    """The node's status as a two-column table (key, value)."""
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    cap = f" of {st.max_sandboxes}" if st.max_sandboxes else ""
    for key, value in (
        ("node", st.node_id),
        ("version", st.version),
        ("labels", " ".join(f"{k}={v}" for k, v in sorted(st.labels.items())) or "none"),
        *(_backend_row(b, st.default_backend) for b in st.backends),
        ("cgroups", st.cgroup_mode),
        ("sandboxes", f"{st.sandboxes}{cap} ({st.running} running, {st.paused} paused)"),
        ("idle capacity", _capacity(st)),
        ("cpus", f"{st.cpus} (load {st.load1:.2f})"),
        ("memory", f"{human_bytes(st.mem_available)} free of {human_bytes(st.mem_total)}"),
        ("scratch", f"{human_bytes(st.scratch_free)} free of {human_bytes(st.scratch_total)}"),
        ("swap", ", ".join(st.swap) or "none added"),
        ("core scheduling", "yes" if st.core_scheduling else f"no: {st.qos_detail}"),
        ("mounted layers", str(st.mounted_layers)),
        ("state dir", st.state_dir),
        ("store", st.store),
    ):
        table.add_row(escape(key), escape(value))
    return table


def _backend_row(b: BackendStatus, default: str) -> tuple[str, str]:
    facts = [f"{k}={v}" for k, v in sorted(b.detail.items())]
    if b.accel:
        facts.insert(0, f"accel={b.accel}")
    state = "ok" if b.ok else "NOT OK"
    mark = ", default" if b.kind == default else ""
    return f"backend {b.kind}", f"{state}{mark}" + (f" ({', '.join(facts)})" if facts else "")


async def _status(g: Globals) -> NodeStatus:
    async with g.client() as client:
        return await client.node_status()


@app.command("gc")
def gc(
    ctx: typer.Context,
    everything: Annotated[
        bool, typer.Option("--all", help="Also destroy every sandbox and unmount all layers.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Remove what a crash left behind (containers, mounts, cgroups, writable layers)."""
    g: Globals = ctx.obj
    if g.node and g.target() != EMBEDDED:
        raise InvalidRequest(
            "`corral node gc` works on this host's state dir, not over the API; run it on the "
            "node's host after stopping `corral node serve`"
        )
    removed = asyncio.run(_gc(g.config(), everything))
    if json_out or g.json:
        emit_json(removed)
        return
    if not any(removed.values()):
        out().print("nothing to remove")
        return
    out().print("removed: " + ", ".join(f"{n} {what}" for what, n in removed.items() if n))


async def _gc(cfg: NodeConfig, everything: bool) -> dict[str, int]:
    from corral.node import Node

    try:
        node = await Node.open(cfg)
    except Conflict as e:
        raise Conflict(
            f"{e.message}. `corral node gc` needs the state dir to itself: stop "
            "`corral node serve` first"
        ) from None
    try:
        return await node.gc(everything=everything)
    finally:
        await node.close()
