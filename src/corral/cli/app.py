"""The ``corral`` command: global options, error handling, and the command groups.

Exit codes: 0 success; ``sandbox exec`` and ``sandbox shell`` pass on the command's own
status (124 on timeout, 128+N when killed by signal N); 1 is left to a command's own
failure; 2 a CorralError, an OS error or a usage error (one red line on stderr, no
traceback unless ``-vv``); 130 interrupted.

Tests replace :data:`_client_factory` to run sandbox commands against a fake node::

    from corral.cli import app as cli_app
    monkeypatch.setattr(cli_app, "_client_factory", lambda g: AsyncClient(ops=FakeNode()))
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.markup import escape
from typer.core import TyperGroup

from corral.cli import cluster as cluster_cmd
from corral.cli import doctor as doctor_cmd
from corral.cli import events as events_cmd
from corral.cli import fncall as fncall_cmd
from corral.cli import images as images_cmd
from corral.cli import node as node_cmd
from corral.cli import observe as observe_cmd
from corral.cli import redteam as redteam_cmd
from corral.cli import sandbox as sandbox_cmd
from corral.cli import swerex as swerex_cmd
from corral.cli._context import ClientFactory, Globals, err, validation_text
from corral.errors import CorralError

__all__ = ["app", "main"]

_client_factory: ClientFactory | None = None
"""Hook for tests: when set, ``g.client()`` uses it instead of connecting to a node."""

EXIT_CORRAL_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def _fail(message: str, g: Globals | None) -> None:
    first, _, rest = message.strip().partition("\n")
    console = err()
    console.print(f"[bold red]error:[/] [red]{escape(first)}[/]")
    if rest:
        # Build tools' output tails and similar detail: useful, but not part of the one line.
        console.print(escape(rest), style="dim")
    if g is not None and g.verbose >= 2:
        console.print(escape(traceback.format_exc()), style="dim")


class _RootGroup(TyperGroup):
    """Turns corral's errors into one red line and exit code 2, and loads ``bench`` lazily
    (it may import heavy scenario code and is written separately)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CorralError as e:
            _fail(e.message, ctx.obj if isinstance(ctx.obj, Globals) else None)
        except ValidationError as e:
            _fail(validation_text(e), ctx.obj if isinstance(ctx.obj, Globals) else None)
        except BrokenPipeError:
            # `corral ... | head`: the reader left; stop quietly, as a shell pipeline would.
            with contextlib.suppress(Exception):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            raise typer.Exit(EXIT_BROKEN_PIPE) from None
        except OSError as e:
            # e.g. a --store on a read-only filesystem: the user's to fix, not a crash.
            _fail(str(e), ctx.obj if isinstance(ctx.obj, Globals) else None)
        except KeyboardInterrupt:
            err().print("[red]interrupted[/]")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        raise typer.Exit(EXIT_CORRAL_ERROR)

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        if "bench" not in names and _bench_available():
            names = [*names, "bench"]
        return names

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is None and cmd_name == "bench" and _bench_available():
            module = importlib.import_module("corral.bench.cli")
            cmd = typer.main.get_command(module.app)
            cmd.name = "bench"
        return cmd


def _bench_available() -> bool:
    try:
        return importlib.util.find_spec("corral.bench.cli") is not None
    except (ImportError, ValueError):
        return False


app = typer.Typer(
    name="corral",
    cls=_RootGroup,
    help="corral: elastic sandboxes for training and evaluating AI agents.",
    no_args_is_help=True,
    add_completion=False,
    # Locals may hold tokens; never print them with a traceback.
    pretty_exceptions_show_locals=False,
)
app.add_typer(images_cmd.app, name="image")
app.add_typer(sandbox_cmd.app, name="sandbox")
app.add_typer(node_cmd.app, name="node")
app.add_typer(events_cmd.app, name="events")
app.add_typer(cluster_cmd.app, name="cluster")
app.add_typer(fncall_cmd.app, name="fncall")
app.add_typer(swerex_cmd.app, name="swerex")
app.command("redteam")(redteam_cmd.redteam)
app.command("top")(observe_cmd.top)
app.command("ui")(observe_cmd.ui)
app.command("doctor")(doctor_cmd.doctor)


@app.callback()
def _root(
    ctx: typer.Context,
    node: Annotated[
        str | None,
        typer.Option(
            "--node",
            envvar="CORRAL_NODE",
            help="unix:///path/api.sock, http://host:port, ray://auto (a cluster), or 'embedded'. Default: the local "
            "API socket if a server listens on it, else an embedded node.",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="CORRAL_TOKEN", help="Bearer token for a TCP node."),
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option("--state-dir", help="State dir of the embedded node (implies embedded)."),
    ] = None,
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar="CORRAL_CONFIG",
            help="node.toml of the embedded node (implies embedded).",
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Machine-readable output where supported.")
    ] = False,
    verbose: Annotated[
        int, typer.Option("-v", "--verbose", count=True, help="-v: log, -vv: debug + tracebacks.")
    ] = 0,
) -> None:
    """corral: elastic sandboxes for training and evaluating AI agents."""
    ctx.obj = g = Globals(
        node=node,
        token=token,
        state_dir=state_dir,
        config_file=config_file,
        json=json_out,
        verbose=verbose,
        client_factory=_client_factory,
    )
    if node:
        g.target()  # a malformed --node fails here, before any command starts work
    if verbose:
        from rich.logging import RichHandler

        logging.basicConfig(
            level=logging.DEBUG if verbose >= 2 else logging.INFO,
            format="%(message)s",
            handlers=[RichHandler(console=err(), show_path=False)],
        )


@app.command("demo")
def _demo(
    ctx: typer.Context,
    count: Annotated[int, typer.Option(min=1, help="Number of concurrent agents.")] = 16,
) -> None:
    """Run the end-to-end demo on an embedded node: build images, run agents, grade them."""
    g: Globals = ctx.obj
    try:
        demo = importlib.import_module("corral.demo")
    except ImportError as e:
        raise CorralError(f"the demo is not available in this installation ({e})") from None
    rc = demo.run(count=count, config=g.config())
    if isinstance(rc, int) and rc:
        raise typer.Exit(rc)


def main() -> None:
    """Entry point of the ``corral`` console script."""
    app(prog_name="corral")


if __name__ == "__main__":  # python -m corral.cli.app (what the bench docs use)
    main()
