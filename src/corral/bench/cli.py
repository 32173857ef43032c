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

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from corral.bench import density_cmds, scenarios
from corral.bench.scenarios import BenchOptions
from corral.errors import CorralError

__all__ = ["app"]

app = typer.Typer(
    name="bench",
    help="Benchmarks: corral measured against a baseline in the same run (--vs docker).",
    no_args_is_help=True,
    add_completion=False,
)

_Vs = Annotated[
    str | None,
    typer.Option(
        "--vs", help="Also measure the same work with this baseline in the same run: docker."
    ),
]
_Json = Annotated[
    bool,
    typer.Option(
        "--json", help="Print the result as one JSON object (last stdout line); table to stderr."
    ),
]
_State = Annotated[
    Path, typer.Option("--state-dir", help="Bench-only node state dir (never a user's node).")
]
_Run = Annotated[Path, typer.Option("--run-dir", help="Bench-only node run dir.")]
_Subtree = Annotated[
    str, typer.Option("--cgroup-subtree", help="cgroup subtree of the bench node's sandboxes.")
]
_Store = Annotated[
    Path | None, typer.Option("--store", help="Layer store to read (default: STATE_DIR/store).")
]
_Image = Annotated[
    str,
    typer.Option(
        "--image", help="'debian' (minbase, built once), 'busybox', or an image in the store."
    ),
]
_Runtime = Annotated[str, typer.Option("--runtime", help="OCI runtime: auto, runc or crun.")]
_Count = Annotated[int, typer.Option("--count", "-n", min=1, help="How many operations.")]
_Conc = Annotated[int, typer.Option("--concurrency", "-c", min=1, help="Operations in flight.")]

DEFAULT_STATE = Path("/var/lib/corral-bench")
DEFAULT_RUN = Path("/run/corral-bench")


def _options(
    vs: str | None,
    state_dir: Path,
    run_dir: Path,
    subtree: str,
    store: Path | None,
    image: str,
    runtime: str,
    docker_method: str = "run-rm",
) -> BenchOptions:
    if vs not in (None, "docker"):
        raise typer.BadParameter(f"{vs!r}: the only baseline is 'docker'", param_hint="--vs")
    if runtime not in ("auto", "runc", "crun"):
        raise typer.BadParameter(f"{runtime!r}: use auto, runc or crun", param_hint="--runtime")
    if not subtree.startswith("corral"):
        raise typer.BadParameter("must start with 'corral'", param_hint="--cgroup-subtree")
    if docker_method not in scenarios.DOCKER_METHODS:
        raise typer.BadParameter(
            f"{docker_method!r}: use one of {', '.join(scenarios.DOCKER_METHODS)}",
            param_hint="--docker-method",
        )
    return BenchOptions(
        state_dir=state_dir,
        run_dir=run_dir,
        subtree=subtree,
        store=store,
        image=image,
        vs=vs,
        runtime=runtime,
        docker_method=docker_method,
    )


def _table(result: dict[str, Any]) -> Table:
    t = Table(title=f"corral bench {result['scenario']}", caption=f"image {result.get('image')}")
    t.add_column("figure")
    sides = [s for s in ("corral", "docker") if isinstance(result.get(s), dict)]
    flat = "corral" not in result  # density keeps corral's figures at the top level
    if flat:
        sides = ["corral", *[s for s in sides if s == "docker"]]
    for s in sides:
        t.add_column(s, justify="right")
    # a dict of corral-vs-baseline ratios (share reports a plain number instead)
    has_ratios = isinstance(result.get("ratio"), dict)
    if has_ratios:
        t.add_column("ratio", justify="right")

    def side(name: str) -> dict[str, Any]:
        return result if (flat and name == "corral") else result.get(name) or {}

    keys: list[str] = []
    for s in sides:
        for k, v in side(s).items():
            if (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and k not in keys
                and k not in ("count", "concurrency")
            ):
                keys.append(k)
    ratios: dict[str, Any] = result["ratio"] if has_ratios else {}
    for k in keys:
        row = [k, *[_fmt(side(s).get(k)) for s in sides]]
        if has_ratios:
            r = ratios.get(k) or ratios.get(k.removesuffix("_mib"))
            row.append(f"{r}x" if r else "")
        t.add_row(*row)
    return t


def _fmt(v: Any) -> str:
    return "" if v is None else str(v)


def _emit(result: dict[str, Any], as_json: bool) -> None:
    Console(stderr=as_json).print(_table(result))
    if as_json:
        sys.stdout.write(json.dumps(result, separators=(",", ":")) + "\n")
        sys.stdout.flush()


def _run(coro_fn: Callable[[], Coroutine[Any, Any, dict[str, Any]]], as_json: bool) -> None:
    try:
        result = asyncio.run(coro_fn())
    except CorralError as e:
        Console(stderr=True).print(f"[red]bench failed:[/red] {e.message}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        Console(stderr=True).print(
            "[yellow]interrupted; the bench node and Docker were cleaned up[/yellow]"
        )
        raise typer.Exit(130) from None
    _emit(result, as_json)


@app.command("create")
def create_cmd(
    count: _Count = 50,
    concurrency: _Conc = 8,
    vs: _Vs = None,
    as_json: _Json = False,
    state_dir: _State = DEFAULT_STATE,
    run_dir: _Run = DEFAULT_RUN,
    subtree: _Subtree = "corral-bench",
    store: _Store = None,
    image: _Image = "debian",
    runtime: _Runtime = "auto",
    docker_method: Annotated[
        str,
        typer.Option(
            "--docker-method",
            help="run-rm: docker run --rm IMG true; run-exec: docker run -d + docker exec true.",
        ),
    ] = "run-rm",
) -> None:
    """Request to first command: create a sandbox and run `true` in it (p50, p99, per_s)."""
    opts = _options(vs, state_dir, run_dir, subtree, store, image, runtime, docker_method)
    _run(lambda: scenarios.create(opts, count, concurrency), as_json)


@app.command("exec")
def exec_cmd(
    count: _Count = 200,
    vs: _Vs = None,
    as_json: _Json = False,
    state_dir: _State = DEFAULT_STATE,
    run_dir: _Run = DEFAULT_RUN,
    subtree: _Subtree = "corral-bench",
    store: _Store = None,
    image: _Image = "debian",
    runtime: _Runtime = "auto",
) -> None:
    """Round trip of `true` in one running sandbox, one after another (p50, p99)."""
    opts = _options(vs, state_dir, run_dir, subtree, store, image, runtime)
    _run(lambda: scenarios.exec_(opts, count), as_json)


@app.command("destroy")
def destroy_cmd(
    count: _Count = 50,
    concurrency: _Conc = 8,
    vs: _Vs = None,
    as_json: _Json = False,
    state_dir: _State = DEFAULT_STATE,
    run_dir: _Run = DEFAULT_RUN,
    subtree: _Subtree = "corral-bench",
    store: _Store = None,
    image: _Image = "debian",
    runtime: _Runtime = "auto",
) -> None:
    """Destroy running sandboxes at a concurrency (per_s, p50); creation is untimed."""
    opts = _options(vs, state_dir, run_dir, subtree, store, image, runtime)
    _run(lambda: scenarios.destroy(opts, count, concurrency), as_json)


@app.command("density")
def density_cmd(
    count: _Count = 200,
    concurrency: _Conc = 8,
    vs: _Vs = None,
    as_json: _Json = False,
    state_dir: _State = DEFAULT_STATE,
    run_dir: _Run = DEFAULT_RUN,
    subtree: _Subtree = "corral-bench",
    store: _Store = None,
    image: _Image = "debian",
    runtime: _Runtime = "auto",
) -> None:
    """N idle sandboxes at once: alive, responsive, host memory each, leftovers after."""
    opts = _options(vs, state_dir, run_dir, subtree, store, image, runtime)
    _run(lambda: scenarios.density(opts, count, concurrency), as_json)


density_cmds.register(app, _options, _run)  # pause, qos, share


@app.command("fork")
def fork_cmd(
    count: _Count = 20,
    size: Annotated[
        str, typer.Option("--size", help="Files the parent writes (1 MiB each).")
    ] = "500MiB",
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="fork(count) repeats.")] = 3,
    as_json: _Json = False,
    state_dir: _State = DEFAULT_STATE,
    run_dir: _Run = DEFAULT_RUN,
    subtree: _Subtree = "corral-bench",
    store: _Store = None,
    image: _Image = "debian",
    runtime: _Runtime = "auto",
) -> None:
    """Fork a sandbox holding SIZE of written files: forks/s and snapshot ms, against a
    plain create and the naive copy (download + upload into a fresh sandbox)."""
    from corral.bench import fork
    from corral.spec import parse_bytes

    opts = _options(None, state_dir, run_dir, subtree, store, image, runtime)
    _run(lambda: fork.fork(opts, count, parse_bytes(size), rounds), as_json)


@app.command("fncall")
def fncall_cmd(
    count: _Count = 1000,
    concurrency: _Conc = 8,
    as_json: _Json = False,
    state_dir: _State = DEFAULT_STATE,
    run_dir: _Run = DEFAULT_RUN,
    subtree: _Subtree = "corral-bench",
    store: _Store = None,
    image: Annotated[
        str,
        typer.Option(
            "--image",
            help="'python' (Debian minbase + python3, built once) "
            "or an image with python3 in the store.",
        ),
    ] = "python",
    runtime: _Runtime = "auto",
) -> None:
    """Isolated Python calls/s from a warm pool vs a fresh container and a bare process per call."""
    from corral.bench.fncall import fncall

    opts = _options(None, state_dir, run_dir, subtree, store, image, runtime)
    _run(lambda: fncall(opts, count, concurrency), as_json)


@app.command("network")
def network_cmd(
    count: Annotated[
        int,
        typer.Option("--count", "-n", min=1, help="Sandboxes created with and without a policy."),
    ] = 20,
    updates: Annotated[int, typer.Option("--updates", min=1, help="Policy updates timed.")] = 20,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Downloads on each path.")] = 3,
    size: Annotated[str, typer.Option("--size", help="Bytes per download.")] = "256MiB",
    as_json: _Json = False,
    state_dir: _State = DEFAULT_STATE,
    run_dir: _Run = DEFAULT_RUN,
    subtree: _Subtree = "corral-bench",
    store: _Store = None,
    image: Annotated[
        str, typer.Option("--image", help="An image with python3 ('python': built once).")
    ] = "python",
    runtime: _Runtime = "auto",
) -> None:
    """Egress policy: extra create cost (attach), time until an update takes effect, and
    allowed-path HTTP throughput against the same download from the host."""
    from corral.bench.fncall import _ensure_python_image
    from corral.bench.network import network
    from corral.spec import parse_bytes

    opts = _options(None, state_dir, run_dir, subtree, store, image, runtime)
    opts.image = _ensure_python_image(opts)
    _run(lambda: network(opts, count, updates, rounds, parse_bytes(size)), as_json)


if __name__ == "__main__":  # ``python -m corral.bench.cli``, before ``corral bench`` exists
    app()
