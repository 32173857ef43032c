"""``corral bench NAME``: the benchmark commands (registered as a typer sub-app).

With ``--json`` the last line on stdout is one JSON object and the human-readable table
goes to stderr; without it, the table goes to stdout. Progress notes always go to stderr.

Example::

    corral bench create --count 50 --concurrency 8 --vs docker --json
    corral bench exec --count 200 --vs docker --json
    corral bench destroy --count 50 --vs docker --json
    corral bench density --count 200 --json
    corral bench fork --count 20 --json
"""

from __future__ import annotations

from typing import Annotated

import typer

from corral.bench import density_cmds, scenarios
from corral.bench._commands import Concurrency, Count, Scenario, scenario
from corral.bench.scenarios import BenchOptions

__all__ = ["app"]

app = typer.Typer(
    name="bench",
    help="Benchmarks: corral measured against a baseline in the same run (--vs docker).",
    no_args_is_help=True,
    add_completion=False,
)


@scenario(app, "create", vs=True, docker_method=True)
def create_cmd(opts: BenchOptions, count: Count = 50, concurrency: Concurrency = 8) -> Scenario:
    """Request to first command: create a sandbox and run `true` in it (p50, p99, per_s)."""
    return scenarios.create(opts, count, concurrency)


@scenario(app, "exec", vs=True)
def exec_cmd(opts: BenchOptions, count: Count = 200) -> Scenario:
    """Round trip of `true` in one running sandbox, one after another (p50, p99)."""
    return scenarios.exec_(opts, count)


@scenario(app, "destroy", vs=True)
def destroy_cmd(opts: BenchOptions, count: Count = 50, concurrency: Concurrency = 8) -> Scenario:
    """Destroy running sandboxes at a concurrency (per_s, p50); creation is untimed."""
    return scenarios.destroy(opts, count, concurrency)


@scenario(app, "density", vs=True)
def density_cmd(opts: BenchOptions, count: Count = 200, concurrency: Concurrency = 8) -> Scenario:
    """N idle sandboxes at once: alive, responsive, host memory each, leftovers after."""
    return scenarios.density(opts, count, concurrency)


density_cmds.register(app)  # pause, qos, share


@scenario(app, "fork")
def fork_cmd(
    opts: BenchOptions,
    count: Count = 20,
    size: Annotated[
        str, typer.Option("--size", help="Files the parent writes (1 MiB each).")
    ] = "500MiB",
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="fork(count) repeats.")] = 3,
) -> Scenario:
    """Fork a sandbox holding SIZE of written files: forks/s and snapshot ms, against a
    plain create and the naive copy (download + upload into a fresh sandbox)."""
    from corral.bench import fork
    from corral.spec import parse_bytes

    return fork.fork(opts, count, parse_bytes(size), rounds)


@scenario(
    app,
    "fncall",
    image="python",
    image_help="'python' (Debian minbase + python3, built once) "
    "or an image with python3 in the store.",
)
def fncall_cmd(opts: BenchOptions, count: Count = 1000, concurrency: Concurrency = 8) -> Scenario:
    """Isolated Python calls/s from a warm pool vs a fresh container and a bare process per call."""
    from corral.bench.fncall import fncall

    return fncall(opts, count, concurrency)


def _python_image(opts: BenchOptions) -> str:
    from corral.bench.fncall import _ensure_python_image

    return _ensure_python_image(opts)


@scenario(
    app,
    "network",
    image="python",
    image_help="An image with python3 ('python': built once).",
    image_from=_python_image,
)
def network_cmd(
    opts: BenchOptions,
    count: Annotated[
        int,
        typer.Option("--count", "-n", min=1, help="Sandboxes created with and without a policy."),
    ] = 20,
    updates: Annotated[int, typer.Option("--updates", min=1, help="Policy updates timed.")] = 20,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Downloads on each path.")] = 3,
    size: Annotated[str, typer.Option("--size", help="Bytes per download.")] = "256MiB",
) -> Scenario:
    """Egress policy: extra create cost (attach), time until an update takes effect, and
    allowed-path HTTP throughput against the same download from the host."""
    from corral.bench.network import network
    from corral.spec import parse_bytes

    return network(opts, count, updates, rounds, parse_bytes(size))


@scenario(app, "fuzz")
def fuzz_cmd(
    opts: BenchOptions,
    cases: Annotated[int, typer.Option("--cases", min=1, help="Requests generated.")] = 2000,
    seed: Annotated[
        int, typer.Option("--seed", help="Hypothesis seed (same seed, same cases).")
    ] = 0,
) -> Scenario:
    """schemathesis against the node's OpenAPI spec over HTTP, real sandboxes behind it:
    answers >= 500, undocumented statuses, schema violations; the node checked after."""
    from corral.bench.fuzz import fuzz

    return fuzz(opts, cases, seed)


@scenario(app, "soak")
def soak_cmd(
    opts: BenchOptions,
    cycles: Annotated[int, typer.Option("--cycles", min=1, help="Sandbox lives run.")] = 10000,
    concurrency: Concurrency = 8,
) -> Scenario:
    """Create, exec, files, shell, pause/resume (every 10th), fork (every 50th), destroy,
    CYCLES times: errors, leaks after, node RSS and SQLite growth, create p99 drift."""
    from corral.bench.soak import soak

    return soak(opts, cycles, concurrency)


@scenario(app, "crash")
def crash_cmd(
    opts: BenchOptions,
    count: Count = 500,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Kill and restart repeats.")] = 5,
) -> Scenario:
    """SIGKILL the node agent with COUNT live, paused and busy sandboxes and operations in
    flight, start it again: sandboxes lost, leftovers, seconds until all answer again."""
    from corral.bench.crash import crash

    return crash(opts, count, rounds)


if __name__ == "__main__":  # ``python -m corral.bench.cli``, before ``corral bench`` exists
    app()
