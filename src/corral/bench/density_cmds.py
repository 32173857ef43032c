"""The density benchmarks' commands: ``corral bench pause``, ``qos`` and ``share``.

Registered on the bench app by :func:`register` (bench/cli.py calls it), with the same
common options and JSON conventions as the other scenarios.
"""

# No ``from __future__ import annotations``: typer reads the option types below at run
# time, and they are attributes of bench/cli.py, bound inside register().
from collections.abc import Callable
from typing import Annotated, Any

import typer

from corral.spec import parse_bytes

__all__ = ["register"]


def register(app: typer.Typer, options: Callable[..., Any], run: Callable[..., None]) -> None:
    """Add the commands to ``app``; ``options``/``run`` are bench/cli.py's helpers."""
    from corral.bench import cli as c

    @app.command("pause")
    def pause_cmd(
        count: c._Count = 8,
        mem: Annotated[str, typer.Option("--mem", help="Touched memory per sandbox.")] = "256MiB",
        swap: Annotated[
            str, typer.Option("--swap", help="Swap the bench node adds: file or zram.")
        ] = "file",
        as_json: c._Json = False,
        state_dir: c._State = c.DEFAULT_STATE,
        run_dir: c._Run = c.DEFAULT_RUN,
        subtree: c._Subtree = "corral-bench",
        store: c._Store = None,
        image: c._Image = "debian",
        runtime: c._Runtime = "auto",
    ) -> None:
        """Pause N sandboxes holding random memory: released fraction, pause ms, first exec
        after resume (vs a running sandbox's exec), state intact."""
        from corral.bench import pause

        if swap not in ("file", "zram"):
            raise typer.BadParameter(f"{swap!r}: use file or zram", param_hint="--swap")
        opts = options(None, state_dir, run_dir, subtree, store, image, runtime)
        run(lambda: pause.pause(opts, count, parse_bytes(mem), swap), as_json)

    @app.command("qos")
    def qos_cmd(
        count: c._Count = 200,
        burners: Annotated[
            int, typer.Option("--burners", help="Busy sandboxes (default: 2 per CPU).")
        ] = 0,
        as_json: c._Json = False,
        state_dir: c._State = c.DEFAULT_STATE,
        run_dir: c._Run = c.DEFAULT_RUN,
        subtree: c._Subtree = "corral-bench",
        store: c._Store = None,
        image: c._Image = "debian",
        runtime: c._Runtime = "auto",
    ) -> None:
        """Exec round trip of a latency-class sandbox: idle, under best-effort load, and
        under the same load without QoS (p50, p99)."""
        from corral.bench import qos

        opts = options(None, state_dir, run_dir, subtree, store, image, runtime)
        run(lambda: qos.qos(opts, count, burners), as_json)

    @app.command("share")
    def share_cmd(
        count: c._Count = 8,
        as_json: c._Json = False,
        state_dir: c._State = c.DEFAULT_STATE,
        run_dir: c._Run = c.DEFAULT_RUN,
        subtree: c._Subtree = "corral-bench",
        store: c._Store = None,
        image: c._Image = "debian",
        runtime: c._Runtime = "auto",
    ) -> None:
        """Host memory of N sandboxes running one program from one shared layer vs from N
        private copies of it (ratio = shared / copied)."""
        from corral.bench import share

        opts = options(None, state_dir, run_dir, subtree, store, image, runtime)
        run(lambda: share.share(opts, count), as_json)
