"""The density benchmarks' commands: ``corral bench pause``, ``qos``, ``share``, ``scale``.

Registered on the bench app by :func:`register` (bench/cli.py calls it), with the same
common options and JSON conventions as the other scenarios (corral.bench._commands).
"""

from __future__ import annotations

from typing import Annotated

import typer

from corral.bench._commands import Concurrency, Count, Scenario, scenario
from corral.bench.scenarios import BenchOptions
from corral.spec import parse_bytes

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""

    @scenario(app, "pause")
    def pause_cmd(
        opts: BenchOptions,
        count: Count = 8,
        mem: Annotated[str, typer.Option("--mem", help="Touched memory per sandbox.")] = "256MiB",
        swap: Annotated[
            str, typer.Option("--swap", help="Swap the bench node adds: file or zram.")
        ] = "file",
        prefetch: Annotated[
            bool, typer.Option("--prefetch", help="resume(prefetch=True) before the first exec.")
        ] = False,
    ) -> Scenario:
        """Pause N sandboxes holding random memory: released fraction, pause ms, first exec
        after resume (vs a running sandbox's exec), time to touch all memory after resume,
        state intact."""
        from corral.bench import pause

        if swap not in ("file", "zram"):
            raise typer.BadParameter(f"{swap!r}: use file or zram", param_hint="--swap")
        return pause.pause(opts, count, parse_bytes(mem), swap, prefetch=prefetch)

    @scenario(app, "qos")
    def qos_cmd(
        opts: BenchOptions,
        count: Count = 1000,
        burners: Annotated[
            int, typer.Option("--burners", help="Busy sandboxes (default: 2 per CPU).")
        ] = 0,
    ) -> Scenario:
        """Exec round trip of a latency-class sandbox: idle, under best-effort load, and
        under the same load without QoS (p50, p99). COUNT execs per phase: the default
        1000 puts each p99 on its 10 worst samples (at 200, on 2, it swung 0.9-1.9x)."""
        from corral.bench import qos

        return qos.qos(opts, count, burners)

    @scenario(app, "share")
    def share_cmd(opts: BenchOptions, count: Count = 8) -> Scenario:
        """Host memory of N sandboxes running one program from one shared layer vs from N
        private copies of it (ratio = shared / copied)."""
        from corral.bench import share

        return share.share(opts, count)

    @scenario(app, "scale")
    def scale_cmd(
        opts: BenchOptions,
        count: Count = 3200,
        window: Annotated[
            int, typer.Option("--window", min=1, help="Creates per window (one figure each).")
        ] = 400,
        concurrency: Concurrency = 8,
    ) -> Scenario:
        """Create COUNT sandboxes in windows of WINDOW, keeping them alive: create/s and
        exec p50 per window (flat = O(1) per operation), then destroy/s of all and the
        leftovers on the host."""
        from corral.bench import scale

        return scale.scale(opts, count, window, concurrency)
