"""The benchmark scenarios: the same work on corral and, with ``--vs docker``, on Docker.

Each scenario returns one JSON-ready dict. corral is driven through the SDK with an
embedded node (the default transport), configured with a bench-only state dir, run dir
and cgroup subtree so a benchmark never touches a user's node. Every corral figure has
its Docker twin measured in the same run, and ``ratio`` divides one by the other, because
absolute numbers on a shared, noisy machine mean little. Each side gets one untimed
warm-up (first layer mount, first container of the daemon) before measuring.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.bench import hostmem, metrics_overhead
from corral.bench.docker import DockerBaseline
from corral.bench.image import BenchImage, ensure_image, mounted_rootfs
from corral.bench.stats import CpuMeter, rate, summary_ms
from corral.errors import CorralError, SandboxError
from corral.host import leaks
from corral.images.store import LayerStore
from corral.node.config import NodeConfig
from corral.sdk import AsyncClient, Sandbox
from corral.spec import ImageInfo

__all__ = ["BenchOptions", "create", "exec_", "destroy", "density", "DOCKER_METHODS"]

SLEEP = ["sleep", "86400"]
"""What keeps a Docker container alive (busybox sleep has no ``infinity``)."""
DOCKER_METHODS = {
    "run-rm": "docker run --rm --network none IMG true (client start to exit; includes the "
    "container's removal, which --rm waits for)",
    "run-exec": "docker run -d --network none IMG sleep, then docker exec C true "
    "(removal untimed, like corral's)",
}


@dataclass
class BenchOptions:
    """What every scenario shares (the CLI's common options)."""

    state_dir: Path = Path("/var/lib/corral-bench")
    run_dir: Path = Path("/run/corral-bench")
    subtree: str = "corral-bench"
    store: Path | None = None
    image: str = "debian"
    vs: str | None = None
    runtime: str = "auto"
    docker_method: str = "run-rm"

    def node_config(self, count: int = 0) -> NodeConfig:
        return NodeConfig.model_validate(
            {
                "state_dir": self.state_dir,
                "run_dir": self.run_dir,
                "store": self.store,
                "cgroup_subtree": self.subtree,
                "backends": [{"kind": "container", "runtime": self.runtime}],
                "max_sandboxes": max(4096, count + 16),
            }
        )

    @property
    def store_dir(self) -> Path:
        return self.store or self.state_dir / "store"


@dataclass
class Prepared:
    image: BenchImage
    docker: DockerBaseline | None = None
    docker_image: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def prepared(opts: BenchOptions) -> AsyncIterator[Prepared]:
    """The bench image in the store and, with ``--vs docker``, a daemon holding its twin."""
    store = LayerStore(opts.store_dir)
    image = await asyncio.to_thread(ensure_image, store, opts.image)
    if opts.vs is None:
        yield Prepared(image)
        return
    if opts.vs != "docker":
        raise CorralError(f"--vs {opts.vs!r}: the only baseline is 'docker'")
    async with DockerBaseline(opts.state_dir, opts.run_dir) as d:
        tag = f"corral-bench:{image.info.digest.split(':', 1)[1][:16]}"
        say(f"importing {image.info.name} into Docker as {tag}")
        work = opts.run_dir.with_name(opts.run_dir.name + "-export")

        def _import() -> str:
            try:
                with mounted_rootfs(store, image.info, work) as root:
                    return d.import_rootfs(root, tag)
            finally:
                with contextlib.suppress(OSError):
                    work.rmdir()

        await asyncio.to_thread(_import)
        yield Prepared(image, d, tag)


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        "mem_total_mib": hostmem.sample().total // hostmem.MIB,
        "cpu_loop_ms": cpu_loop_ms(),
    }


def cpu_loop_ms(n: int = 1_000_000) -> float:
    """The best of 3 times of a fixed pure-Python loop, in ms: how fast this machine's
    CPU was when the run's figures were gathered (``machine()`` takes it once, before the
    run; ``bench create`` again after its timed creates, ``bench scale`` after each
    window). A VM's CPU can run at half speed one day (its host's load, which the guest
    does not see as steal), and the CPU-bound figures of two runs compare only as far as
    this does."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        acc = 0
        for i in range(n):
            acc += i
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000, 1)


def header(scenario: str, p: Prepared, **fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": scenario, **fields}
    out["image"] = p.image.info.name
    out["image_detail"] = p.image.describe()
    out["machine"] = machine()
    if p.docker is not None:
        out["docker_version"] = p.docker.version
    return out


# ---------------------------------------------------------------------- measuring helpers
@dataclass
class Timing:
    latencies: list[float]
    wall: float
    errors: list[str]

    def figures(self, per_s: bool = True) -> dict[str, Any]:
        if not self.latencies:
            raise CorralError(f"every operation failed; first error: {self.errors[:1]}")
        out: dict[str, Any] = summary_ms(self.latencies)
        if per_s:
            out["per_s"] = rate(len(self.latencies), self.wall)
        out["wall_s"] = round(self.wall, 3)
        out["errors"] = len(self.errors)
        if self.errors:
            out["first_error"] = self.errors[0][:500]
        return out


async def many(
    n: int, concurrency: int, op: Callable[[int], Awaitable[object]], what: str = ""
) -> Timing:
    """Run ``op(0..n-1)`` with at most ``concurrency`` in flight; time each one from the
    moment it may start (its slot is free) to its end, and the whole from first to last.
    ``what``: on long runs (1,000 or more), say "<what>: k/n" every tenth, on stderr."""
    sem = asyncio.Semaphore(max(1, concurrency))
    lat: list[float] = []
    errors: list[str] = []
    step = n // 10 if what and n >= 1000 else 0

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            try:
                await op(i)
            except Exception as e:  # a failed operation is counted, not fatal to the run
                errors.append(f"{type(e).__name__}: {e}")
            else:
                lat.append(time.perf_counter() - t0)
            finished = len(lat) + len(errors)
            if step and finished % step == 0:
                failed = f" ({len(errors)} failed)" if errors else ""
                say(f"{what}: {finished}/{n}{failed}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return Timing(lat, time.perf_counter() - t0, errors)


def ratio(corral: dict[str, Any], docker: dict[str, Any] | None) -> dict[str, float] | None:
    """How many times better corral is: docker/corral for times, corral/docker for rates."""
    if docker is None:
        return None
    out = {}
    for key in ("p50_ms", "p99_ms"):
        if corral.get(key) and docker.get(key):
            out[key] = round(docker[key] / corral[key], 2)
    for key in ("per_s", "create_per_s"):
        if corral.get(key) and docker.get(key):
            out[key] = round(corral[key] / docker[key], 2)
    if corral.get("host_mem_per_sandbox_mib") and docker.get("host_mem_per_sandbox_mib"):
        out["host_mem_per_sandbox"] = round(
            docker["host_mem_per_sandbox_mib"] / corral["host_mem_per_sandbox_mib"], 2
        )
    return out


async def _true(sb: Sandbox) -> None:
    r = await sb.exec(["true"], timeout=60)
    if not r.ok:
        raise SandboxError(
            f"`true` in {sb.id} ended {r.reason} (exit {r.exit_code}): "
            f"{r.stderr.decode(errors='replace')[:300]}"
        )


async def _destroy_all(sbs: list[Sandbox], concurrency: int) -> Timing:
    async def op(i: int) -> None:
        await sbs[i].destroy()

    return await many(len(sbs), concurrency, op, "corral: destroyed")


async def _warm_up(client: AsyncClient, img: ImageInfo) -> None:
    sb = await client.sandboxes.create(image=img, labels={"corral-bench": "warmup"})
    try:
        await _true(sb)
    finally:
        await sb.destroy()
    await _settled(client)


async def _cgroup_pool(client: AsyncClient) -> dict[str, int] | None:
    """The container engine's pre-made cgroups (host/cgroups.py, CgroupPool), as its node
    status reports them: the pool size per limits, the creates that got one and the
    destroyed sandboxes' cgroups it kept; None without a pool (an OCI runtime, or cgroup
    v2)."""
    for b in (await client.node_status()).backends:
        if b.kind == "container" and "cgroup_pool_taken" in b.detail:
            return {
                "size": int(b.detail["cgroup_pool_size"]),
                "taken": int(b.detail["cgroup_pool_taken"]),
                "returned": int(b.detail.get("cgroup_pool_returned", 0)),
            }
    return None


async def _settled(client: AsyncClient) -> None:
    """Wait until the node's pre-made cgroups of the warm-up's limits are made and the
    btrfs cleaner has dropped what earlier runs deleted, as on a node that has been up for
    a while (an embedded node's; another's settles by itself)."""
    from corral.node import Node  # the embedded node: it is imported when the client opens

    node = await client._get_ops()
    if isinstance(node, Node):
        queued = await asyncio.to_thread(node.scratch.pending_cleanup)
        if queued:
            say(f"waiting for btrfs to drop {queued} subvolumes deleted by earlier runs")
        await node.wait_settled(60.0)


async def _create_n(
    client: AsyncClient,
    img: ImageInfo,
    n: int,
    concurrency: int,
    sbs: list[Sandbox],
    run_true: bool,
    label: str,
) -> Timing:
    async def op(i: int) -> None:
        sb = await client.sandboxes.create(image=img, labels={"corral-bench": label})
        sbs.append(sb)
        if run_true:
            await _true(sb)

    return await many(n, concurrency, op, "corral: created")


async def _create_phases(
    client: AsyncClient, label: str, since: float
) -> dict[str, dict[str, float]]:
    """The node's own timing of the creates labelled ``label`` since ``since`` (a reused
    state dir keeps earlier runs' timings), per phase (p50, p99, mean in ms): where a
    create's time goes (runtime_start, init_ready, rootfs, layer_mounts)."""
    st = await client.stats(labels={"corral-bench": label}, since=since)
    op = st.ops.get("create")
    if op is None:
        return {}
    rows = {"total": op, **op.phases}
    return {
        name: {k: round(getattr(p, k) * 1000, 2) for k in ("p50", "p99", "mean")}
        for name, p in rows.items()
    }


# ---------------------------------------------------------------------- docker helpers
async def _docker_run_detached(d: DockerBaseline, image: str) -> str:
    out = await d.docker("run", "-d", "--network", "none", *d.label_args(), image, *SLEEP)
    return out.strip()


async def _docker_rm(d: DockerBaseline, cids: list[str], concurrency: int) -> Timing:
    async def op(i: int) -> None:
        await d.docker("rm", "-f", cids[i])

    return await many(len(cids), concurrency, op, "docker: removed")


async def _docker_start_n(
    d: DockerBaseline, image: str, n: int, concurrency: int, cids: list[str]
) -> Timing:
    async def op(i: int) -> None:
        cids.append(await _docker_run_detached(d, image))

    return await many(n, concurrency, op, "docker: started")


# ---------------------------------------------------------------------- scenarios
async def create(opts: BenchOptions, count: int, concurrency: int) -> dict[str, Any]:
    """Request to first command: create + exec(``true``), ``count`` times, ``concurrency``
    in flight. Sandboxes are destroyed afterwards, untimed."""
    async with prepared(opts) as p:
        out = header("create", p, count=count, concurrency=concurrency)
        async with AsyncClient(config=opts.node_config(count)) as client:
            img = await client.images.get(p.image.info.name)
            await _warm_up(client, img)
            sbs: list[Sandbox] = []
            try:
                say(f"corral: {count} creates at concurrency {concurrency}")
                since = time.time()
                cpu = CpuMeter().start()
                t = await _create_n(client, img, count, concurrency, sbs, True, "create")
                # Per create + exec(true): where the node's 2 cores go, whatever the load.
                out["cpu_ms_per_create"] = per = cpu.per_op(count - len(t.errors))
                # The most creates a second this machine's cores could give at that CPU
                # per create, were they all busy with nothing else: 150/s on 2 cores
                # needs machine <= 13.3 ms, however the work is spread.
                out["cpu_ceiling_per_s"] = round(
                    len(os.sched_getaffinity(0)) * 1000 / max(per["machine"], 0.01), 1
                )
                # The CPU's speed again, right after the timed creates: a run whose
                # machine slowed down (or sped up) meanwhile shows it against the header's.
                out["cpu_loop_ms_after"] = cpu_loop_ms()
                pool = await _cgroup_pool(client)
                if pool is not None:  # creates that got a pre-made cgroup
                    out["cgroup_pool"] = pool
                out["phases_ms"] = await _create_phases(client, "create", since)
                # Serial creates vary by several ms here: 100 of each (interleaved in
                # blocks) resolve a 2% difference where 20 did not.
                say(f"corral: metrics on/off, {min(count, 100)} serial creates each")
                out["metrics_overhead"] = await metrics_overhead.measure(
                    await client._get_ops(),
                    lambda i: _create_n(client, img, 1, 1, sbs, True, "metrics"),
                    min(count, 100),
                )
            finally:
                await _destroy_all(sbs, concurrency)
            out["corral"] = t.figures()
        out["docker"] = await _docker_create(p, count, concurrency, opts.docker_method)
        out["ratio"] = ratio(out["corral"], out["docker"])
        return out


async def _docker_create(
    p: Prepared, count: int, concurrency: int, method: str
) -> dict[str, Any] | None:
    d = p.docker
    if d is None:
        return None
    say(f"docker: {count} creates at concurrency {concurrency} ({method})")
    cids: list[str] = []
    base = ("run", "--network", "none", *d.label_args())

    async def run_rm(i: int) -> None:
        await d.docker(*base, "--rm", p.docker_image, "true")

    async def run_exec(i: int) -> None:
        cid = await _docker_run_detached(d, p.docker_image)
        cids.append(cid)
        await d.docker("exec", cid, "true")

    op = run_rm if method == "run-rm" else run_exec
    try:
        await op(-1)  # warm-up
        t = await many(count, concurrency, op)
    finally:
        await _docker_rm(d, cids, concurrency)
    return {**t.figures(), "method": DOCKER_METHODS[method]}


async def exec_(opts: BenchOptions, count: int) -> dict[str, Any]:
    """Round trip of ``true`` in one running sandbox, ``count`` times in a row."""
    async with prepared(opts) as p:
        out = header("exec", p, count=count)
        async with AsyncClient(config=opts.node_config()) as client:
            img = await client.images.get(p.image.info.name)
            sb = await client.sandboxes.create(image=img, labels={"corral-bench": "exec"})
            try:
                for _ in range(3):
                    await _true(sb)
                say(f"corral: {count} execs of true")
                t = await many(count, 1, lambda i: _true(sb))
                say(f"corral: metrics on/off, {count} execs each")
                out["metrics_overhead"] = await metrics_overhead.measure(
                    await client._get_ops(), lambda i: _true(sb), count
                )
            finally:
                await sb.destroy()
            out["corral"] = t.figures(per_s=False)
        out["docker"] = None
        if p.docker is not None:
            d = p.docker
            cid = await _docker_run_detached(d, p.docker_image)
            try:
                for _ in range(3):
                    await d.docker("exec", cid, "true")
                say(f"docker: {count} docker exec of true")
                t = await many(count, 1, lambda i: d.docker("exec", cid, "true"))
            finally:
                await d.docker("rm", "-f", cid)
            out["docker"] = {**t.figures(per_s=False), "method": "docker exec C true"}
        out["ratio"] = ratio(out["corral"], out["docker"])
        return out


async def destroy(opts: BenchOptions, count: int, concurrency: int) -> dict[str, Any]:
    """Destroy ``count`` running sandboxes with ``concurrency`` in flight (creation untimed)."""
    async with prepared(opts) as p:
        out = header("destroy", p, count=count, concurrency=concurrency)
        async with AsyncClient(config=opts.node_config(count)) as client:
            img = await client.images.get(p.image.info.name)
            await _warm_up(client, img)
            sbs: list[Sandbox] = []
            try:
                say(f"corral: creating {count} sandboxes (untimed)")
                made = await _create_n(client, img, count, concurrency, sbs, False, "destroy")
                say(f"corral: destroying {len(sbs)} at concurrency {concurrency}")
                todo, sbs = sbs, []
                t = await _destroy_all(todo, concurrency)
            finally:
                await _destroy_all(sbs, concurrency)
            out["corral"] = {**t.figures(), "create_errors": len(made.errors)}
        out["docker"] = None
        if p.docker is not None:
            d = p.docker
            cids: list[str] = []
            try:
                say(f"docker: starting {count} containers (untimed)")
                made = await _docker_start_n(d, p.docker_image, count, concurrency, cids)
                say(f"docker: docker rm -f of {len(cids)} at concurrency {concurrency}")
                doomed, cids = cids, []
                t = await _docker_rm(d, doomed, concurrency)
            finally:
                await _docker_rm(d, cids, concurrency)
            out["docker"] = {
                **t.figures(),
                "create_errors": len(made.errors),
                "method": "docker rm -f C (running sleep)",
            }
        out["ratio"] = ratio(out["corral"], out["docker"])
        return out


def _mem_figures(
    before: hostmem.MemSample,
    after: hostmem.MemSample,
    alive: int,
    cg_before: int | None,
    cg_after: int | None,
) -> dict[str, Any]:
    n = max(alive, 1)
    used = after.used - before.used
    out: dict[str, Any] = {
        "host_mem_per_sandbox_mib": round(used / n / hostmem.MIB, 3),
        "host_used_delta_mib": round(used / hostmem.MIB, 1),
        "slab_delta_mib": round((after.slab - before.slab) / hostmem.MIB, 1),
        "sunreclaim_delta_mib": round((after.sunreclaim - before.sunreclaim) / hostmem.MIB, 1),
        "shmem_delta_mib": round((after.shmem - before.shmem) / hostmem.MIB, 1),
    }
    if cg_after is not None:
        cg = cg_after - (cg_before or 0)
        out["cgroup_mem_mib"] = round(cg / hostmem.MIB, 1)
        out["cgroup_mem_per_sandbox_mib"] = round(cg / n / hostmem.MIB, 3)
    return out


async def _settle() -> None:
    # Let freshly started inits finish faulting in and the kernel's per-cpu counters
    # (which MemAvailable folds in lazily) catch up before reading /proc/meminfo.
    await asyncio.sleep(2.0)


async def _mem_reading(samples: int = 5, gap: float = 0.3) -> tuple[hostmem.MemSample, float]:
    """The median of a few /proc/meminfo readings, and their spread in MiB: the machine is
    shared, so the spread says how much of a small delta is other people's noise."""
    got = []
    for i in range(samples):
        if i:
            await asyncio.sleep(gap)
        got.append(hostmem.sample())
    got.sort(key=lambda m: m.used)
    return got[len(got) // 2], (got[-1].used - got[0].used) / hostmem.MIB


async def density(opts: BenchOptions, count: int, concurrency: int = 8) -> dict[str, Any]:
    """``count`` idle sandboxes at once: are they alive and answering, what do they cost
    in host memory, and is anything left on the host after destroying them all?"""
    async with prepared(opts) as p:
        out = header("density", p, count=count, concurrency=concurrency)
        before_scan = leaks.scan(opts.state_dir, opts.run_dir, subtree=opts.subtree)
        corral = await _corral_density(opts, p, count, concurrency)
        after_scan = leaks.scan(opts.state_dir, opts.run_dir, subtree=opts.subtree)
        left = {k: sorted(set(v) - set(before_scan.get(k, []))) for k, v in after_scan.items()}
        left = {k: v for k, v in left.items() if v}
        out.update(corral)
        out["leftovers"] = leaks.total(left)
        if left:
            out["leftover_detail"] = {k: v[:20] for k, v in left.items()}
        pre = leaks.total(before_scan)
        if pre:
            out["preexisting_before_run"] = pre
        out["memory_method"] = (
            "host: (MemTotal-MemAvailable) after all sandboxes are up minus before, / alive; "
            "MemAvailable discounts reclaimable page cache and slab, so shared layer cache is "
            "not charged; no drop_caches (host-wide); each reading is the median of 5, "
            "host_noise_mib their spread. cgroup: memory usage of the sandboxes' "
            "cgroup subtree (includes their page cache and kernel memory)."
        )
        out["docker"] = await _docker_density(p, count, concurrency)
        out["ratio"] = ratio(out, out["docker"])
        return out


async def _corral_density(
    opts: BenchOptions, p: Prepared, count: int, concurrency: int
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    async with AsyncClient(config=opts.node_config(count)) as client:
        img = await client.images.get(p.image.info.name)
        await _warm_up(client, img)
        await _settle()
        before, noise_before = await _mem_reading()
        cg_before = hostmem.cgroup_usage(opts.subtree)
        rss_before = hostmem.rss_sum([os.getpid()])
        slabs_before = hostmem.slabs()
        sbs: list[Sandbox] = []
        try:
            say(f"corral: creating {count} idle sandboxes at concurrency {concurrency}")
            made = await _create_n(client, img, count, concurrency, sbs, False, "density")
            res["create_per_s"] = rate(len(sbs), made.wall) if sbs else 0.0
            res["create_errors"] = len(made.errors)
            if made.errors:
                res["first_error"] = made.errors[0][:500]
            await _settle()
            after, noise_after = await _mem_reading()
            cg_after = hostmem.cgroup_usage(opts.subtree)
            infos = [await sb.refresh() for sb in sbs]
            res["alive"] = sum(1 for i in infos if i.state == "running" and _pid_alive(i.pid))
            res.update(_mem_figures(before, after, res["alive"], cg_before, cg_after))
            # The kernel's part on its own: unreclaimable slab per sandbox, and the caches
            # that grew most (which objects a sandbox costs: namespaces, cgroups, mounts).
            alive = max(res["alive"], 1)
            res["kernel_sunreclaim_per_sandbox_kib"] = round(
                (after.sunreclaim - before.sunreclaim) / alive / 1024, 1
            )
            res["kernel_per_sandbox_kib"] = round((after.kernel - before.kernel) / alive / 1024, 1)
            res["kernel_parts_per_sandbox_kib"] = {
                k: round((getattr(after, k) - getattr(before, k)) / alive / 1024, 1)
                for k in ("sunreclaim", "percpu", "kernel_stack", "page_tables")
            }
            res["slab_kib_per_sandbox_by_cache"] = hostmem.slab_growth(
                slabs_before, hostmem.slabs(), res["alive"]
            )
            res["host_noise_mib"] = round(max(noise_before, noise_after), 1)
            res["node_process_pss_delta_mib"] = round(
                (hostmem.rss_sum([os.getpid()]) - rss_before) / hostmem.MIB, 1
            )
            say(f"corral: exec true in each of {len(sbs)}")
            answered = await many(
                len(sbs), concurrency, lambda i: _true(sbs[i]), "corral: answered"
            )
            res["responsive"] = len(answered.latencies)
            res["exec_p50_ms"] = summary_ms(answered.latencies)["p50_ms"] if sbs else None
            say(f"corral: destroying {len(sbs)}")
            todo, sbs = sbs, []
            gone = await _destroy_all(todo, concurrency)
            res["destroy_per_s"] = rate(len(gone.latencies), gone.wall) if todo else 0.0
            res["destroy_errors"] = len(gone.errors)
        finally:
            await _destroy_all(sbs, concurrency)
    return res


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _docker_density(p: Prepared, count: int, concurrency: int) -> dict[str, Any] | None:
    d = p.docker
    if d is None:
        return None
    res: dict[str, Any] = {"method": "docker run -d --network none IMG sleep; docker exec C true"}
    cids: list[str] = []
    try:
        cid = await _docker_run_detached(d, p.docker_image)  # warm-up
        await d.docker("rm", "-f", cid)
        await _settle()
        before, noise_before = await _mem_reading()
        pss_before = hostmem.rss_sum(d.daemon_pids())
        say(f"docker: starting {count} idle containers at concurrency {concurrency}")
        made = await _docker_start_n(d, p.docker_image, count, concurrency, cids)
        res["create_per_s"] = rate(len(cids), made.wall) if cids else 0.0
        res["create_errors"] = len(made.errors)
        await _settle()
        after, noise_after = await _mem_reading()
        out = await d.docker(
            "ps", "-q", "--filter", f"label={d.run_label}", "--filter", "status=running"
        )
        res["alive"] = len(out.split())
        res.update(_mem_figures(before, after, res["alive"], None, None))
        res["host_noise_mib"] = round(max(noise_before, noise_after), 1)
        if d.owned:
            res["daemon_and_shims_pss_delta_mib"] = round(
                (hostmem.rss_sum(d.daemon_pids()) - pss_before) / hostmem.MIB, 1
            )
        answered = await many(
            len(cids), concurrency, lambda i: d.docker("exec", cids[i], "true"), "docker: answered"
        )
        res["responsive"] = len(answered.latencies)
        say(f"docker: removing {len(cids)}")
        todo, cids = cids, []
        gone = await _docker_rm(d, todo, concurrency)
        res["destroy_per_s"] = rate(len(gone.latencies), gone.wall) if todo else 0.0
    finally:
        await _docker_rm(d, cids, concurrency)
    return res


def remove_state(opts: BenchOptions) -> None:
    """Delete the bench node's state dir (used by tests; the CLI keeps it for the image)."""
    shutil.rmtree(opts.state_dir, ignore_errors=True)
