"""`corral demo`: an embedded single-node corral running an agent-style workload.

1. Builds (once, then cached in the store) a Debian base layer, a Python toolkit layer
   (pytest) and a workspace layer holding a small repository with a failing test; the
   hidden tests are a layer of their own that only the grading image has.
2. Creates N sandboxes concurrently; in each a scripted agent inspects the repository,
   runs the tests in a persistent shell, edits the code and runs the tests again.
3. Grades every attempt in a fresh sandbox from pristine layers plus the agent's patch.
4. Prints the outcomes and a latency breakdown, and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import corral
from corral.node import NodeConfig

__all__ = ["run", "ensure_images"]

PYTEST = "pytest==8.3.4"

_CALC = '''"""A tiny calculator with a bug the agent has to find."""


def add(a, b):
    return a + b


def mean(xs):
    return sum(xs) / (len(xs) + 1)   # bug: off by one
'''

_VISIBLE_TEST = """from calc import add, mean


def test_add():
    assert add(2, 3) == 5


def test_mean():
    assert mean([2, 4]) == 3
"""

_HIDDEN_TEST = """from calc import add, mean


def test_hidden_mean_many():
    assert mean([1, 2, 3, 4]) == 2.5


def test_hidden_add_negative():
    assert add(-2, 2) == 0
"""

# What each scripted agent writes as its fix: most are right, some overfit the visible test.
_FIXES = {
    "correct": "return sum(xs) / len(xs)",
    "overfit": "return 3 if xs == [2, 4] else sum(xs) / (len(xs) + 1)",
}


@dataclass
class Timings:
    create: list[float] = field(default_factory=list)
    exec: list[float] = field(default_factory=list)
    destroy: list[float] = field(default_factory=list)


def _p(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))] * 1000


def ensure_images(config: NodeConfig, console: Console) -> None:
    """Build the demo images unless the store has them already."""
    from corral.images import build
    from corral.images.store import LayerStore

    store = LayerStore(config.store_dir)
    have = {i.name for i in store.images()}
    if {"demo/python", "demo/task", "demo/grade"} <= have:
        return
    console.print("[bold]building demo images (once; cached in the layer store)[/]")
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        if "demo/base" not in have:
            base = build.build_debian(
                store, "bookworm", include=["python3", "python3-pip"], progress=progress
            )
            store.put_image("demo/base", [base.digest])
        base_img = store.image("demo/base")
        if "demo/python" not in have:
            tk = build.build_pip(store, base_img, [PYTEST], progress=progress)
            store.put_image("demo/python", [*base_img.layers, tk.digest])
    py = store.image("demo/python")
    tmp = Path(tempfile.mkdtemp(prefix="corral-demo-"))
    try:
        ws = tmp / "ws" / "work"
        (ws / "tests").mkdir(parents=True)
        (ws / "calc.py").write_text(_CALC)
        (ws / "tests" / "test_calc.py").write_text(_VISIBLE_TEST)
        (ws / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
        ws_layer = build.build_dir(store, tmp / "ws")
        hidden = tmp / "hidden" / "grader"
        hidden.mkdir(parents=True)
        (hidden / "test_hidden.py").write_text(_HIDDEN_TEST)
        hidden_layer = build.build_dir(store, tmp / "hidden")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    store.put_image("demo/task", [*py.layers, ws_layer.digest], workdir="/work")
    store.put_image(
        "demo/grade", [*py.layers, ws_layer.digest, hidden_layer.digest], workdir="/work"
    )


async def _timed(bucket: list[float], coro):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    try:
        return await coro
    finally:
        bucket.append(time.perf_counter() - t)


async def _agent(client: corral.AsyncClient, n: int, t: Timings, limits: corral.Limits) -> dict:
    strategy = "overfit" if n % 5 == 4 else "correct"
    sb = await _timed(
        t.create,
        client.sandboxes.create(
            image="demo/task", limits=limits, ttl=600, labels={"job": "demo", "agent": str(n)}
        ),
    )
    steps = 0
    try:
        sh = await sb.shell()
        for cmd in ("ls -la", "cat calc.py", "python3 -m pytest -q 2>&1 | tail -3"):
            r = await _timed(t.exec, sh.run(cmd, timeout=120))
            steps += 1
        before = r.stdout.decode(errors="replace")
        src = (await sb.files.read("/work/calc.py")).decode()
        src = src.replace("return sum(xs) / (len(xs) + 1)   # bug: off by one", _FIXES[strategy])
        await sb.files.write("/work/calc.py", src.encode())
        r = await _timed(t.exec, sh.run("python3 -m pytest -q 2>&1 | tail -1", timeout=120))
        steps += 2
        patch = await sb.files.read("/work/calc.py")
    finally:
        await _timed(t.destroy, sb.destroy())
    # grading: a fresh sandbox from pristine layers + the hidden tests, plus only the patch
    grader = await _timed(
        t.create,
        client.sandboxes.create(
            image="demo/grade", limits=limits, ttl=600, labels={"job": "demo", "grader": str(n)}
        ),
    )
    try:
        await grader.files.write("/work/calc.py", patch)
        g = await _timed(
            t.exec,
            grader.exec(
                [
                    "python3",
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "/work/tests",
                    "/grader",
                ],
                cwd="/work",
                timeout=120,
            ),
        )
    finally:
        await _timed(t.destroy, grader.destroy())
    return {
        "agent": n,
        "strategy": strategy,
        "steps": steps,
        "before": "fail" if "failed" in before else "pass",
        "after_visible": r.stdout.decode(errors="replace").strip().splitlines()[-1:],
        "graded": "PASS" if g.ok else "FAIL",
    }


async def run_async(count: int = 16, config: NodeConfig | None = None) -> int:
    console = Console()
    cfg = config or NodeConfig()
    await asyncio.to_thread(ensure_images, cfg, console)
    t = Timings()
    limits = corral.Limits(cpus=1, memory="512MiB", pids=256, disk="1GiB")
    started = time.perf_counter()
    async with corral.AsyncClient(config=cfg) as client:
        with console.status(f"running {count} agents ..."):
            results = await asyncio.gather(
                *(_agent(client, n, t, limits) for n in range(count)), return_exceptions=True
            )
        left = await client.sandboxes.list(labels={"job": "demo"})
    wall = time.perf_counter() - started
    table = Table(title=f"corral demo: {count} agents, {wall:.1f} s")
    for col in ("agent", "strategy", "tests before", "visible after", "hidden grade"):
        table.add_column(col)
    errors = 0
    for res in results:
        if isinstance(res, BaseException):
            errors += 1
            table.add_row("?", "error", "", "", f"[red]{type(res).__name__}: {res}[/]")
            continue
        table.add_row(
            str(res["agent"]),
            res["strategy"],
            res["before"],
            " ".join(res["after_visible"]),
            "[green]PASS[/]" if res["graded"] == "PASS" else "[red]FAIL[/]",
        )
    console.print(table)
    lat = Table(title="latency (ms)")
    for col in ("operation", "count", "median", "p99"):
        lat.add_column(col, justify="right")
    for name, xs in (
        ("create", t.create),
        ("exec (agent commands, pytest included)", t.exec),
        ("destroy", t.destroy),
    ):
        med = statistics.median(xs) * 1000 if xs else float("nan")
        lat.add_row(name, str(len(xs)), f"{med:.1f}", f"{_p(xs, 0.99):.1f}")
    console.print(lat)
    if left:
        console.print(f"[red]{len(left)} sandboxes left behind[/]")
    return 1 if errors or left else 0


def run(count: int = 16, config: NodeConfig | None = None) -> int:
    return asyncio.run(run_async(count, config))
