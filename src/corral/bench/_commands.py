"""How a benchmark scenario becomes a ``corral bench NAME`` command.

Every scenario takes the same node options (--json, --state-dir, --run-dir,
--cgroup-subtree, --store, --image, --runtime; --vs and --docker-method where there is
a Docker baseline). :func:`scenario` adds them to a command after its own options, turns
them into one :class:`BenchOptions` and prints the result, so a scenario's command only
names its own options::

    @scenario(app, "exec", vs=True)
    def exec_cmd(opts: BenchOptions, count: Count = 200) -> Scenario:
        return scenarios.exec_(opts, count)

The function's docstring is the command's help.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from corral.bench import scenarios
from corral.bench.scenarios import BenchOptions
from corral.errors import CorralError

__all__ = ["scenario", "Scenario", "Count", "Concurrency", "DEFAULT_STATE", "DEFAULT_RUN"]

Count = Annotated[int, typer.Option("--count", "-n", min=1, help="How many operations.")]
Concurrency = Annotated[
    int, typer.Option("--concurrency", "-c", min=1, help="Operations in flight.")
]

DEFAULT_STATE = Path("/var/lib/corral-bench")
DEFAULT_RUN = Path("/run/corral-bench")
IMAGE_HELP = "'debian' (minbase, built once), 'busybox', or an image in the store."

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
_Runtime = Annotated[
    str, typer.Option("--runtime", help="How sandboxes start: auto, launch, runc or crun.")
]
_DockerMethod = Annotated[
    str,
    typer.Option(
        "--docker-method",
        help="run-rm: docker run --rm IMG true; run-exec: docker run -d + docker exec true.",
    ),
]

Scenario = Coroutine[Any, Any, dict[str, Any]]
"""What a scenario's function returns: the run, which its command awaits."""
F = TypeVar("F", bound=Callable[..., Scenario])


def scenario(
    app: typer.Typer,
    name: str,
    *,
    vs: bool = False,
    docker_method: bool = False,
    image: str = "debian",
    image_help: str = IMAGE_HELP,
    image_from: Callable[[BenchOptions], str] | None = None,
) -> Callable[[F], F]:
    """Register ``fn(opts, **own)`` on ``app`` as the command ``NAME``.

    The command's options are fn's own (its parameters after ``opts``), then --vs (with
    ``vs``), the node options every scenario shares (``image``/``image_help``: the
    --image default and help), then --docker-method (with ``docker_method``). It checks
    them, builds ``opts`` (``image_from(opts)``, if given, picks the image first) and
    prints the result of awaiting ``fn(opts, **own)``.
    """

    def register(fn: F) -> F:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]
        shared = [
            *([("vs", _Vs, None)] if vs else []),
            ("as_json", _Json, False),
            ("state_dir", _State, DEFAULT_STATE),
            ("run_dir", _Run, DEFAULT_RUN),
            ("subtree", _Subtree, "corral-bench"),
            ("store", _Store, None),
            ("image", Annotated[str, typer.Option("--image", help=image_help)], image),
            ("runtime", _Runtime, "auto"),
            *([("docker_method", _DockerMethod, "run-rm")] if docker_method else []),
        ]
        kw_only = inspect.Parameter.KEYWORD_ONLY

        def command(**kw: Any) -> None:
            as_json = kw.pop("as_json")
            opts = _options(
                kw.pop("vs", None),
                kw.pop("state_dir"),
                kw.pop("run_dir"),
                kw.pop("subtree"),
                kw.pop("store"),
                kw.pop("image"),
                kw.pop("runtime"),
                kw.pop("docker_method", "run-rm"),
            )
            if image_from is not None:
                opts.image = image_from(opts)
            _run(lambda: fn(opts, **kw), as_json)

        command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [p.replace(kind=kw_only) for p in own]
            + [inspect.Parameter(n, kw_only, annotation=a, default=d) for n, a, d in shared]
        )
        command.__name__ = fn.__name__
        command.__doc__ = fn.__doc__
        app.command(name)(command)
        return fn

    return register


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
    if runtime not in ("auto", "launch", "runc", "crun"):
        raise typer.BadParameter(
            f"{runtime!r}: use auto, launch, runc or crun", param_hint="--runtime"
        )
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


def _run(coro_fn: Callable[[], Scenario], as_json: bool) -> None:
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
