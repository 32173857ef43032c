"""``corral bench NAME``: the benchmark commands (registered as a typer sub-app).

With ``--json`` the last line on stdout is one JSON object and the human-readable table
goes to stderr; without it, the table goes to stdout. Progress notes always go to stderr.

Example::

    corral bench create --count 50 --concurrency 8 --vs docker --json
    corral bench exec --count 200 --vs docker --json
    corral bench destroy --count 50 --vs docker --json
    corral bench density --count 200 --json
    corral bench fork --count 20 --json
    corral bench microvm --count 8 --json
    corral bench microvm --only dax --count 8 --json
    corral bench desktop --count 2 --json
    corral bench placement --nodes 160 --sandboxes 32768 --json
    corral bench cluster --nodes 3 --count 300 --json
    corral bench ondemand --sandboxes 64 --images 8 --json
    corral bench workspace --sandboxes 64 --json
    corral bench metasplit --files 20000 --json
    corral bench neighbours --seconds 6 --json
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from corral.bench import density_cmds, scenarios
from corral.bench._commands import Concurrency, Count, Scenario, _run, scenario
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


density_cmds.register(app)  # pause, qos, share, scale


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


@scenario(app, "microvm", image_help="An image in the store, or 'debian'/'busybox' (built).")
def microvm_cmd(
    opts: BenchOptions,
    count: Count = 8,
    kernel_dir: Annotated[
        Path | None,
        typer.Option("--kernel-dir", help="An extracted Debian kernel (default: fetched)."),
    ] = None,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help="Run one part: 'dax' (the shared/private memory figure and one idle VM's "
            "memory breakdown, with boot times; no pause, fork or container runs).",
        ),
    ] = None,
    tcg_tb_mib: Annotated[
        int | None,
        typer.Option("--tcg-tb-mib", min=1, help="TCG translation cache per VM (MiB)."),
    ] = None,
) -> Scenario:
    """MicroVMs: boot to first exec (p50/p99), exec p50, host memory per VM, accelerator,
    and the container boot to exec of the same run."""
    from corral.bench.microvm import microvm

    if only not in (None, "dax"):
        raise typer.BadParameter(f"{only!r}: the only part is 'dax'", param_hint="--only")
    return microvm(opts, count, kernel_dir, only=only, tcg_tb_mib=tcg_tb_mib)


@scenario(
    app,
    "desktop",
    image="desktop",
    image_help="An image in the store, or 'desktop' (Debian + DESKTOP_PACKAGES, built once).",
)
def desktop_cmd(
    opts: BenchOptions,
    count: Count = 2,
    width: Annotated[int, typer.Option("--width", min=320, max=3840)] = 1280,
    height: Annotated[int, typer.Option("--height", min=200, max=2160)] = 800,
    kernel_dir: Annotated[
        Path | None,
        typer.Option("--kernel-dir", help="An extracted Debian kernel (default: fetched)."),
    ] = None,
) -> Scenario:
    """Desktop VMs: boot to first screenshot (p50/p99), screenshot and input round trips,
    typed text to the file its command writes, host memory per VM, accelerator."""
    from corral.bench.desktop import desktop

    return desktop(opts, count, width, height, kernel_dir)


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


@scenario(app, "cluster", image="busybox")
def cluster_cmd(
    opts: BenchOptions,
    nodes: Annotated[int, typer.Option("--nodes", min=1, max=8, help="Local Ray nodes.")] = 3,
    count: Count = 300,
    concurrency: Concurrency = 8,
) -> Scenario:
    """The same creates and execs through the cluster client (Ray, placement) and straight
    at one node, in one run; node-loss detection time and orphans left after a lease lapses.
    Needs corral[cluster]."""
    from corral.bench.cluster import cluster

    return cluster(opts, nodes, count, concurrency)


@app.command("placement")
def placement_cmd(
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="Simulated nodes.")] = 160,
    sandboxes: Annotated[
        int, typer.Option("--sandboxes", min=1, help="Sandboxes in the burst.")
    ] = 32768,
    capacity: Annotated[
        int, typer.Option("--capacity", min=1, help="max_sandboxes of each simulated node.")
    ] = 256,
    placers: Annotated[
        int, typer.Option("--placers", min=1, help="Placers working at once, uncoordinated.")
    ] = 4,
    report_every: Annotated[
        int, typer.Option("--report-every", min=1, help="Decisions between node reports.")
    ] = 2048,
    k: Annotated[int, typer.Option("--k", min=1, help="Candidates sampled per decision.")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="Last stdout line: JSON.")] = False,
) -> None:
    """The placement core alone on one core against simulated nodes that admit like real
    ones: decisions/s, refusals, and whether any node went over its capacity."""
    from corral.bench.placement import placement

    _run(lambda: placement(nodes, sandboxes, capacity, placers, report_every, k), as_json)


_LinkMbit = Annotated[
    int, typer.Option("--link-mbit", min=10, help="Bandwidth of the store's link.")
]
_Readahead = Annotated[
    int,
    typer.Option(
        "--store-readahead-kib",
        min=0,
        help="Read-ahead of the store's client (MooseFS mfsreadaheadleng); 0: its default.",
    ),
]
_Delay = Annotated[
    float,
    typer.Option(
        "--link-delay-ms",
        min=0.0,
        help="Latency added to the store's link each way (a userspace delay line: this "
        "kernel has no netem); 0 for none.",
    ),
]


@scenario(
    app,
    "ondemand",
    image="python",
    image_help="Base image with python3 ('python': built once), in --store.",
)
def ondemand_cmd(
    opts: BenchOptions,
    sandboxes: Annotated[
        int, typer.Option("--sandboxes", min=1, help="Sandboxes in the burst, per mode.")
    ] = 64,
    images: Annotated[int, typer.Option("--images", min=1, help="Distinct images.")] = 8,
    image_mib: Annotated[
        int, typer.Option("--image-mib", min=4, help="Toolkit + workspace MiB per image.")
    ] = 300,
    link_mbit: _LinkMbit = 1000,
    concurrency: Concurrency = 8,
    readahead_kib: _Readahead = 0,
    delay_ms: _Delay = 0.5,
    prefetch: Annotated[
        bool,
        typer.Option(
            "--layer-prefetch/--no-layer-prefetch",
            help="Nodes prefetch layers' recorded hot blocks (the default); with it, set-up "
            "records the profiles by running one sandbox per image on a node of its own.",
        ),
    ] = True,
    content: Annotated[
        str,
        typer.Option(
            "--content",
            help="What the toolkit and workspace files hold: 'random' (incompressible, "
            "layers uncompressed) or 'source' (slices of real source text, layers lz4hc "
            "as `corral image build dir` makes them).",
        ),
    ] = "random",
    store_cores: Annotated[
        int,
        typer.Option(
            "--store-cores",
            min=0,
            help="Cores of this machine for the store's servers and link alone, as if they "
            "were other machines: the last N; the node, its FUSE client and its sandboxes "
            "run on the rest. 0 (the default): everything shares every core.",
        ),
    ] = 0,
) -> Scenario:
    """Burst on a cold node from a network store (MooseFS behind a shaped link): layers
    on demand vs an eager copy to local disk vs layers already local."""
    from corral.bench import cores
    from corral.bench.ondemand import CONTENTS, ondemand

    if content not in CONTENTS:  # before the set-up starts a store
        raise typer.BadParameter(
            f"{content!r} is not one of {', '.join(CONTENTS)}", param_hint="--content"
        )
    if store_cores:
        try:
            cores.split(store_cores)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--store-cores") from None

    return ondemand(
        opts,
        sandboxes,
        images,
        image_mib,
        link_mbit,
        concurrency,
        readahead_kib or None,
        delay_ms=delay_ms,
        prefetch=prefetch,
        content=content,
        store_cores=store_cores,
    )


@scenario(app, "metasplit", image="busybox", image_help="Not used (no sandboxes).")
def metasplit_cmd(
    opts: BenchOptions,
    files: Annotated[
        int, typer.Option("--files", min=100, help="Small files in the repository.")
    ] = 20000,
    trials: Annotated[int, typer.Option("--trials", min=1, help="Cold runs per variant.")] = 5,
    link_mbit: _LinkMbit = 1000,
    readahead_kib: _Readahead = 0,
    delay_ms: _Delay = 0.5,
) -> Scenario:
    """EROFS metadata on local disk, data on the network store (--blobdev) against the
    whole layer on the store, with and without inline data: a cold stat walk and a cold
    sample read of a repository of small files (issue 16, part 4)."""
    from corral.bench.metasplit import metasplit

    return metasplit(opts, files, trials, link_mbit, readahead_kib or None, delay_ms)


@scenario(
    app,
    "workspace",
    image="python",
    image_help="Base image with python3 ('python': built once), in --store.",
)
def workspace_cmd(
    opts: BenchOptions,
    sandboxes: Annotated[
        int, typer.Option("--sandboxes", min=1, help="Sandboxes, each with its own repository.")
    ] = 64,
    repo_mib: Annotated[int, typer.Option("--repo-mib", min=1, help="MiB per repository.")] = 50,
    link_mbit: _LinkMbit = 1000,
    concurrency: Concurrency = 8,
    readahead_kib: _Readahead = 0,
    layer_compress: Annotated[
        str,
        typer.Option(
            "--layer-compress",
            help="How the workspace layers are built: 'lz4hc' (64 KiB clusters, what "
            "`corral image build dir` writes), 'lz4' or 'none'.",
        ),
    ] = "lz4hc",
    delay_ms: _Delay = 0.5,
) -> Scenario:
    """Per-sandbox workspaces from a network store: an EROFS layer of the image vs a
    tar.gz extracted into the writable layer."""
    from corral.bench.workspace import workspace

    return workspace(
        opts,
        sandboxes,
        repo_mib,
        link_mbit,
        concurrency,
        readahead_kib or None,
        layer_compress=layer_compress,
        delay_ms=delay_ms,
    )


@scenario(app, "e2b")
def e2b_cmd(opts: BenchOptions, count: Count = 100) -> Scenario:
    """The e2b SDK's create and commands.run("true") against the same through corral's own
    SDK, both over HTTP to one node (needs the e2b extra and an image with bash)."""
    from corral.bench.e2b import e2b

    return e2b(opts, count)


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
    retention: Annotated[
        int,
        typer.Option(
            "--retention",
            min=100,
            help="Destroyed sandboxes' records, events and timings the node keeps.",
        ),
    ] = 1000,
) -> Scenario:
    """Create, exec, files, shell, pause/resume (every 10th), fork (every 50th), destroy,
    CYCLES times: errors, leaks after, node RSS and SQLite growth, create p99 drift."""
    from corral.bench.soak import soak

    return soak(opts, cycles, concurrency, retention)


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


@scenario(
    app,
    "neighbours",
    image="python",
    image_help="An image with python3 ('python': built once).",
    image_from=_python_image,
)
def neighbours_cmd(
    opts: BenchOptions,
    seconds: Annotated[
        float, typer.Option("--seconds", min=0.5, help="How long each attack is measured.")
    ] = 6.0,
    attack: Annotated[
        list[str] | None,
        typer.Option("--attack", help="Run only this attack (repeatable); default: all."),
    ] = None,
    probe_hz: Annotated[
        float,
        typer.Option(
            "--probe-hz", min=1, help="API calls and neighbour execs started a second, each."
        ),
    ] = 50.0,
    attacker_output_rate: Annotated[
        str | None,
        typer.Option(
            "--attacker-output-rate",
            help="The attackers' limits.output_rate (e.g. 1TiB: unpaced); default: the "
            "sandbox default.",
        ),
    ] = None,
) -> Scenario:
    """Fork bomb, memory bomb, disk fill, output flood, inotify and fd exhaustion and a CPU
    burn, each in its own sandbox: a latency-class neighbour's exec p99 and the API's p99
    against idle, and whether anyone outside the attacker was harmed."""
    from corral.bench.neighbours import neighbours

    return neighbours(opts, seconds, attack or None, probe_hz, attacker_output_rate)


if __name__ == "__main__":  # ``python -m corral.bench.cli``, before ``corral bench`` exists
    app()
