"""``corral bench ondemand``: a burst of sandboxes on a cold node, layers read on demand
from a network store, against an eager copy (what ``docker pull`` does) and a node whose
layers are already on local disk.

Set-up (untimed): a MooseFS store behind a shaped link (bench/dfs.py); ``--images``
images of ``--image-mib`` each in it, every one base (a Debian image with python3,
shared) + toolkit (a package of modules and data files nobody reads) + workspace (a tree
of files of which the task reads one in ten); each layer verified once, as a publisher
would (store.py stamps), and then dropped from the page cache. ``--content`` picks what
the files hold: random bytes in uncompressed layers (the default; the most bytes a task's
reads can cost) or real source text in lz4hc layers (:data:`CONTENTS`).

Hot-block profiles (images/hotblocks.py; on by default, ``--no-layer-prefetch`` for the
A/B): also in set-up, one sandbox per image runs the task on a node of its own, and that
node leaves on the store what of each layer its sandboxes read, as the first node to run
an image does in a cluster; the cached store gets the same profiles (the same software on
local disk). Every mode's node is still cold: fresh state dir, page cache evicted.

Each mode opens a fresh node (its own state dir), and ``--sandboxes`` sandboxes,
spread round-robin over the images, are created ``--concurrency`` at a time; each runs
the task as soon as it is up: imports five modules of its toolkit, reads its sample of
the workspace, and prints a checksum.

* ``ondemand``: the node mounts the layers straight from the network store.
* ``eager``: ``eager_layers``: each layer is copied whole to local disk before its first
  mount (docker pull's cost; no extraction, so a lower bound for it).
* ``cached``: the layers sit in a store on local disk (copied untimed), page cache cold.

Before each mode the layer files are evicted from the page cache on both sides of the
link (the node's FUSE pages and the chunkserver's chunk files, which share this
machine's page cache), so every mode starts cold.

Figures per mode: ``all_ready_s`` (start to the last create answered), ``done_s`` (start
to the last task finished), ``local_writes_mib`` (sectors written to the state dir's disk
per /proc/diskstats, after a sync: includes whatever else the machine writes meanwhile),
``store_reads_mib`` (bytes that came over the store's link).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.bench import cores, dfs
from corral.bench.scenarios import BenchOptions, machine, say
from corral.bench.stats import machine_busy_s
from corral.errors import SandboxError
from corral.host import pagecache
from corral.images.store import LayerStore
from corral.sdk import AsyncClient, Sandbox
from corral.spec import Stats

__all__ = ["ondemand", "disk_writes", "drop_cache", "open_dfs", "stamp_all", "Figures"]

MIB = 1 << 20
_FILE = 128 << 10
_MODULES = 40

TASK = r"""
import importlib, os, sys, zlib
sys.path.insert(0, "/opt/tk")
for j in range(5):
    importlib.import_module(f"tk.mod{j}")
acc = 0
for root, dirs, files in os.walk("/work/repo"):
    dirs.sort()
    for name in sorted(files)[::10]:
        with open(os.path.join(root, name), "rb") as f:
            acc = zlib.crc32(f.read(), acc)
print(acc)
"""


# ---------------------------------------------------------------------- measuring

_AFFINITY = "import os; print(*sorted(os.sched_getaffinity(0)))"


def _device(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return os.major(st.st_dev), os.minor(st.st_dev)


def disk_writes(path: Path) -> int:
    """Bytes written so far to the block device holding ``path`` (0 if it has none)."""
    major, minor = _device(path)
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if int(p[0]) == major and int(p[1]) == minor:
                return int(p[9]) * 512
    return 0


def cpu_split(
    busy: tuple[float, float], store: tuple[dict[str, float], dict[str, float]] | None
) -> dict[str, float]:
    """A burst's CPU seconds: the machine's, and of them the network store's processes'
    (``store_servers``, ``store_link``: another machine's and the network's in a cluster,
    here on the same cores as the node; ``store_client``: the node's mfsmount)."""
    out = {"machine_busy": round(busy[1] - busy[0], 2)}
    if store is not None:
        for k, v in store[1].items():
            out[f"store_{k}"] = round(v - store[0].get(k, 0.0), 2)
    return out


drop_cache = pagecache.evict
"""Evict one file from the page cache (cold reads without dropping the machine's)."""


@dataclass
class Figures:
    """One mode's result; ``breakdown``: where the time went (:func:`breakdown`)."""

    all_ready_s: float
    done_s: float
    local_writes_mib: float
    store_reads_mib: float
    breakdown: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        return {k: round(getattr(self, k), 3) for k in _FIGURES}


_FIGURES = ("all_ready_s", "done_s", "local_writes_mib", "store_reads_mib")


def _pct(values: list[float]) -> dict[str, float]:
    """p50 and max of ``values`` (nearest rank), rounded to the millisecond."""
    v = sorted(values)
    return {"p50": round(v[(len(v) - 1) // 2], 3), "max": round(v[-1], 3)} if v else {}


def breakdown(
    waits: list[float],
    creates: list[float],
    tasks: list[float],
    stats: Stats | None,
    cpu: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Where a burst's time went, per sandbox (p50 and max, seconds): ``queued`` (waiting
    for a --concurrency slot), ``create`` (the create call as the client saw it), ``task``
    (the exec of the task, from the create's answer to its end) and the node's own
    phases of the creates (``corral stats``: layer_mounts, rootfs, runtime_start, ...) and
    of the execs; ``cpu_s``: :func:`cpu_split`; ``mono_s`` (added by the caller): the
    burst's CLOCK_MONOTONIC span, to cut a system-wide profile to it. Figures for
    reading, not for the targets: they do not change what ``all_ready_s`` and ``done_s``
    measure."""
    out: dict[str, Any] = {
        "queued": _pct(waits),
        "create": _pct(creates),
        "task": _pct(tasks),
    }
    if cpu is not None:
        out["cpu_s"] = cpu
    if stats is not None:
        for op in ("create", "exec"):
            st = stats.ops.get(op)
            if st is not None:
                out[f"node_{op}"] = {
                    name: {"p50": round(p.p50, 3), "max": round(p.max, 3)}
                    for name, p in sorted(st.phases.items())
                }
    return out


# ---------------------------------------------------------------------- set-up


def open_dfs(
    opts: BenchOptions,
    link_mbit: int,
    readahead_kib: int | None,
    delay_ms: float = 0.0,
    server_cpus: frozenset[int] | None = None,
) -> dfs.MooseStore:
    why = dfs.available()
    if why:
        raise SandboxError(f"bench needs a distributed filesystem: {why}")
    work = opts.state_dir.with_name(opts.state_dir.name + "-dfs")
    # Named after the state dir, so benches of different state dirs do not collide.
    h = int(hashlib.sha256(str(work).encode()).hexdigest()[:8], 16)
    fs = dfs.MooseStore(
        work,
        name=f"b{h % 16**6:06x}",
        subnet=64 + h % 128,
        rate_mbit=link_mbit,
        readahead_kib=readahead_kib,
        delay_ms=delay_ms,
        server_cpus=server_cpus,
    )
    ra = "client default" if readahead_kib is None else f"{readahead_kib} KiB"
    on = "" if server_cpus is None else f", servers on core(s) {cores.cpu_list(server_cpus)}"
    say(
        f"starting MooseFS (link {link_mbit} Mbit/s, +{delay_ms} ms each way, read-ahead {ra}"
        f"{on}) at {fs.mountpoint}"
    )
    fs.start()
    return fs


CONTENTS = ("random", "source")
"""What the toolkit and workspace files hold: ``random`` bytes (nothing compresses; the
layers are stored uncompressed) or ``source``: slices of real source text (this host's
Python standard library), the layers compressed with lz4hc as ``corral image build dir``
compresses a workspace, so the store holds and the link carries what a repository of code
costs, about a third of its size."""


class _Content:
    """Bytes for the bench's files: random, or slices of a corpus of source text, each
    file starting elsewhere in it (files differ; nothing is deduplicated)."""

    def __init__(self, kind: str) -> None:
        if kind not in CONTENTS:
            raise SandboxError(f"content: {kind!r} is not one of {', '.join(CONTENTS)}")
        self.kind = kind
        self.corpus = b""
        self.at = 0
        if kind == "source":
            parts, total = [], 0
            for f in sorted(Path(os.__file__).parent.rglob("*.py")):
                try:
                    parts.append(f.read_bytes())
                except OSError:
                    continue
                total += len(parts[-1])
                if total >= 32 * MIB:
                    break
            self.corpus = b"".join(parts)
            if len(self.corpus) < 4 * MIB:
                raise SandboxError(f"content source: only {len(self.corpus)} bytes of source here")

    @property
    def compress(self) -> str | None:
        return "lz4hc" if self.kind == "source" else None

    def text(self, size: int) -> str:
        """``size`` characters for a module's string constant: random hex (what the bench
        always wrote), or source text."""
        if self.kind == "random":
            return os.urandom(size // 2).hex()
        return self.take(size).decode("latin-1")

    def take(self, size: int) -> bytes:
        if self.kind == "random":
            return os.urandom(size)
        self.at = (self.at + 1_000_003) % len(self.corpus)  # a prime stride: a new offset
        out = bytearray()
        at = self.at
        while len(out) < size:
            out += self.corpus[at : at + size - len(out)]
            at = 0
        return bytes(out)


def _fill(path: Path, size: int, content: _Content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.take(size))


def _toolkit(root: Path, size: int, content: _Content) -> None:
    pkg = root / "opt" / "tk" / "tk"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for j in range(_MODULES):
        blob = content.text(8192)
        (pkg / f"mod{j}.py").write_text(f"DATA = {blob!r}\n\ndef f(x):\n    return x + {j}\n")
    left, k = size - _MODULES * 8300, 0
    while left > 0:
        _fill(root / "opt" / "tk" / "data" / f"blob{k}.bin", min(left, 4 * MIB), content)
        left -= 4 * MIB
        k += 1


def _workspace(root: Path, size: int, content: _Content) -> None:
    for k in range(max(1, size // _FILE)):
        _fill(root / "work" / "repo" / f"d{k // 64:03d}" / f"f{k:05d}.dat", _FILE, content)


def publish_images(
    store: LayerStore,
    base_layers: list[str],
    count: int,
    image_mib: int,
    gen: Path,
    content: str = "random",
) -> list[str]:
    """``count`` images base + toolkit + workspace in ``store``; every layer verified once
    (stamped) and then evicted from the page cache. ``content``: see :data:`CONTENTS`."""
    names = []
    fill = _Content(content)
    for i in range(count):
        tk, ws = gen / f"tk{i}", gen / f"ws{i}"
        for d in (tk, ws):
            shutil.rmtree(d, ignore_errors=True)
        _toolkit(tk, image_mib * MIB * 2 // 3, fill)
        _workspace(ws, image_mib * MIB // 3, fill)
        layers = [
            store.add_dir(d, kind="dir", source=f"bench-{d.name}", compress=fill.compress)
            for d in (tk, ws)
        ]
        shutil.rmtree(tk)
        shutil.rmtree(ws)
        name = f"bench/ondemand-{i}"
        store.put_image(name, [*base_layers, *(li.digest for li in layers)], workdir="/work")
        names.append(name)
        say(f"image {i + 1}/{count}: {name}")
    stamp_all(store)
    return names


def stamp_all(store: LayerStore) -> None:
    """Verify every layer once, as a publisher would, leaving settled stamps (store.py:
    written 2 s after the file's last change), then evict the files from the page cache.
    A fresh LayerStore: the builder's instance trusts what it just hashed itself."""
    time.sleep(2.5)  # set-up only: let the last layer's mtime settle
    fresh = LayerStore(store.root, timeout=None)
    for li in fresh.layers():
        fresh.verify(li.digest)
        drop_cache(fresh.path_of(li.digest))


def copy_store(src: LayerStore, dst: Path) -> LayerStore:
    """A local copy of every layer and image of ``src`` (the cached baseline's store)."""
    shutil.rmtree(dst, ignore_errors=True)
    local = LayerStore(dst)
    for li in src.layers():
        local.add_file(src.path_of(li.digest), kind=li.kind, source=li.source)
    for img in src.images():
        local.put_image(img.name, img.layers, env=img.env, workdir=img.workdir)
    for li in src.layers():  # the same software on both: the hot-block profiles too
        profile = src.hot_profile(li.digest)
        if profile is not None:
            local.save_hot_profile(li.digest, profile)
    os.sync()
    stamp_all(local)
    return local


# ---------------------------------------------------------------------- one mode


async def _all(coros: Iterable[Awaitable[None]]) -> None:
    """Await every one, even when some fail (none is left running against a closing
    node), then raise the first failure."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def _mode_opts(opts: BenchOptions, mode: str, store: Path) -> BenchOptions:
    return BenchOptions(
        state_dir=opts.state_dir.with_name(f"{opts.state_dir.name}-{mode}"),
        run_dir=opts.run_dir.with_name(f"{opts.run_dir.name}-{mode}"),
        subtree=f"{opts.subtree}-{mode}",
        store=store,
        runtime=opts.runtime,
    )


async def run_burst(
    opts: BenchOptions,
    *,
    eager: bool,
    images: list[str],
    sandboxes: int,
    concurrency: int,
    task: list[str],
    link: dfs.MooseStore | None,
    drop: list[Path],
    prefetch: bool = True,
) -> Figures:
    """Open a fresh node, create ``sandboxes`` sandboxes of ``images`` (round-robin) and
    run ``task`` in each as soon as it is up; the figures, then everything removed."""
    for p in drop:
        drop_cache(p)
    if link is not None:
        link.drop_server_cache()
    cfg = opts.node_config(sandboxes).model_copy(
        update={"eager_layers": eager, "layer_prefetch": prefetch}
    )
    sbs: list[Sandbox] = []
    try:
        async with AsyncClient(config=cfg) as client:
            sem = asyncio.Semaphore(concurrency)
            ready: list[float] = []
            done: list[float] = []
            waits: list[float] = []
            creates: list[float] = []
            tasks: list[float] = []
            os.sync()
            w0 = disk_writes(opts.state_dir.parent)
            r0 = link.link_bytes()[1] if link else 0
            c0 = machine_busy_s(), link.cpu_seconds() if link else None
            t0 = time.monotonic()

            async def one(i: int) -> None:
                async with sem:
                    t1 = time.monotonic()
                    sb = await client.sandboxes.create(image=images[i % len(images)])
                    t2 = time.monotonic()
                    sbs.append(sb)
                    ready.append(t2 - t0)
                r = await sb.exec(task, timeout=600)
                if r.exit_code != 0:
                    raise SandboxError(f"task failed in {sb.id}: {r.stderr[-500:]!r}")
                t3 = time.monotonic()
                done.append(t3 - t0)
                waits.append(t1 - t0)
                creates.append(t2 - t1)
                tasks.append(t3 - t2)

            try:
                await _all(one(i) for i in range(sandboxes))
                os.sync()
                writes = disk_writes(opts.state_dir.parent) - w0
                reads = (link.link_bytes()[1] - r0) if link else 0
                c1 = machine_busy_s(), link.cpu_seconds() if link else None
                t_end = time.monotonic()
                stats = await client.stats()
                seen = await sbs[0].exec(["python3", "-c", _AFFINITY], timeout=60)
            finally:
                # Also on failure: a node keeps its sandboxes when it closes.
                await asyncio.gather(*(sb.destroy() for sb in sbs), return_exceptions=True)
    finally:
        shutil.rmtree(opts.state_dir, ignore_errors=True)
        shutil.rmtree(opts.run_dir, ignore_errors=True)
    parts = breakdown(
        waits,
        creates,
        tasks,
        stats,
        cpu_split((c0[0], c1[0]), (c0[1], c1[1]) if c0[1] and c1[1] else None),
    )
    # CLOCK_MONOTONIC of the burst (as cpu_s counts it): a system-wide profiler's samples
    # (`perf record -k CLOCK_MONOTONIC`) are cut to one mode by it.
    parts["mono_s"] = [round(t0, 3), round(t_end, 3)]
    # The cores a sandbox could run on (with --store-cores: the node's only).
    parts["sandbox_cpus"] = [int(c) for c in seen.stdout.split()]
    return Figures(max(ready), max(done), writes / MIB, reads / MIB, parts)


# ---------------------------------------------------------------------- the scenario


async def ondemand(
    opts: BenchOptions,
    sandboxes: int,
    images: int,
    image_mib: int,
    link_mbit: int,
    concurrency: int,
    readahead_kib: int | None = None,
    *,
    delay_ms: float = 0.0,
    prefetch: bool = True,
    content: str = "random",
    store_cores: int = 0,
) -> dict[str, Any]:
    """The scenario. ``store_cores``: 0, the store's servers and link share every core
    with the node (a one-machine test bed); N, they get the last N cores and the node
    (this process, its FUSE client, its sandboxes) the rest, as if the store were other
    machines (bench/cores.py). Every mode runs under the same split."""
    split = cores.split(store_cores) if store_cores else None
    with cores.pinned(split[0]) if split else contextlib.nullcontext():
        from corral.bench.fncall import _ensure_python_image

        base_name = await asyncio.to_thread(_ensure_python_image, opts)
        base = LayerStore(opts.store_dir).image(base_name)
        fs = await asyncio.to_thread(
            open_dfs, opts, link_mbit, readahead_kib, delay_ms, split[1] if split else None
        )
        gen = opts.state_dir.with_name(opts.state_dir.name + "-gen")
        try:
            store = LayerStore(fs.mountpoint / "store", timeout=120)
            local = LayerStore(opts.store_dir)
            for d in base.layers:
                await asyncio.to_thread(
                    store.add_file, local.path_of(d), kind="base", source=base_name
                )
            say(f"publishing {images} images of ~{image_mib} MiB each into the network store")
            names = await asyncio.to_thread(
                publish_images, store, base.layers, images, image_mib, gen, content
            )
            task = ["python3", "-c", TASK]
            layer_files = [store.path_of(li.digest) for li in store.layers()]
            profiled = 0
            if prefetch:
                say("recording hot-block profiles: one sandbox per image on a node of its own")
                await run_burst(
                    _mode_opts(opts, "profile", store.root),
                    eager=False,
                    images=names,
                    sandboxes=len(names),
                    concurrency=concurrency,
                    task=task,
                    link=fs,
                    drop=layer_files,
                )
                digests = [li.digest for li in store.layers()]
                profiled = sum(store.hot_profile(d) is not None for d in digests)
                say(f"hot-block profiles: {profiled} of {len(digests)} layers")
            cached_dir = gen / "cached-store"
            cached = await asyncio.to_thread(copy_store, store, cached_dir)
            cached_files = [cached.path_of(li.digest) for li in cached.layers()]
            out: dict[str, Any] = {
                "scenario": "ondemand",
                "sandboxes": sandboxes,
                "images": images,
                "image_mib": image_mib,
                "content": content,
                "image_bytes_mib": round(
                    sum(store.layer(d).size for d in store.image(names[0]).layers) / MIB, 1
                ),
                "link_mbit": link_mbit,
                "link_delay_ms": delay_ms,
                "store_readahead_kib": readahead_kib,
                "layer_prefetch": prefetch,
                "profiled_layers": profiled if prefetch else 0,
                "concurrency": concurrency,
                "store_cores": len(split[1]) if split else 0,
                # Where each side may run: the node's cores (None: all) and the store's
                # processes' as read from the kernel after set-up.
                "node_cpus": sorted(split[0]) if split else None,
                "store_affinity": fs.affinity(),
                "machine": machine(),
                "modes": {},
            }
            runs = (
                ("ondemand", False, store.root, layer_files),
                ("eager", True, store.root, layer_files),
                ("cached", False, cached.root, cached_files),
            )
            for mode, eager, root, drop in runs:
                say(f"{mode}: {sandboxes} sandboxes over {images} images on a cold node")
                fig = await run_burst(
                    _mode_opts(opts, mode, root),
                    eager=eager,
                    images=[n for n in names],
                    sandboxes=sandboxes,
                    concurrency=concurrency,
                    task=task,
                    link=fs,
                    drop=drop,
                    prefetch=prefetch,
                )
                out["modes"][mode] = fig.as_dict()
                out.setdefault("breakdown", {})[mode] = fig.breakdown
            m = out["modes"]
            out["speedup_vs_eager"] = round(m["eager"]["done_s"] / m["ondemand"]["done_s"], 2)
            out["writes_ratio_vs_eager"] = round(
                m["ondemand"]["local_writes_mib"] / max(m["eager"]["local_writes_mib"], 0.001), 3
            )
            out["vs_cached"] = round(m["ondemand"]["done_s"] / m["cached"]["done_s"], 2)
            return out
        finally:
            await asyncio.to_thread(shutil.rmtree, gen, True)
            await asyncio.to_thread(fs.stop)
