"""``corral bench workspace``: every sandbox with its own repository, as an EROFS
workspace layer of its image vs a tar.gz extracted into its writable layer.

Set-up (untimed): the MooseFS store of bench/dfs.py; per sandbox a distinct repository
of ``--repo-mib`` (source-like text files, every file of repository k carrying k in its
first line so no two repositories share a layer), published twice on the store: as a
layer (image = base + that layer) and as ``repos/<k>.tar.gz`` (gzip level 1, to keep
the set-up short; extraction cost hardly depends on the level).

* ``layer``: create the sandbox from its image; the repository is there, read on demand.
* ``tar``: create the sandbox from the base image, read its tarball from the store,
  write it into the sandbox and extract it there (``tar xzf``), as a harness that ships
  workspaces as archives does.

Then, in both, the same task: walk the repository (every file stat'ed) and read one file
in ten. Figures: ``done_s`` (start to the last task done, ``--concurrency`` sandboxes in
flight), ``writes_mib`` (sectors written to the state dir's disk per /proc/diskstats,
after a sync; includes whatever else the machine writes meanwhile), ``store_reads_mib``
(bytes that came over the store's link).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any

from corral.bench.dfs import MooseStore
from corral.bench.ondemand import (
    MIB,
    _all,
    _mode_opts,
    disk_writes,
    drop_cache,
    open_dfs,
    stamp_all,
)
from corral.bench.scenarios import BenchOptions, machine, say
from corral.errors import CorralError, SandboxError
from corral.images.store import LayerStore
from corral.sdk import AsyncClient, Sandbox

__all__ = ["workspace"]

TASK = r"""
import os, zlib
n = acc = 0
for root, dirs, files in os.walk("/work/repo"):
    dirs.sort()
    for i, name in enumerate(sorted(files)):
        p = os.path.join(root, name)
        os.stat(p)
        n += 1
        if i % 10 == 0:
            with open(p, "rb") as f:
                acc = zlib.crc32(f.read(), acc)
print(n, acc)
"""
_WORDS = (
    "def class return import self value data index result node tree item list dict "
    "for while if else elif try except raise with as yield lambda None True False"
).split()


def _corpus(size: int, seed: int = 7) -> list[bytes]:
    """Source-like text files (~16 KiB each) adding up to ``size``; compresses ~3-4x."""
    rnd = random.Random(seed)
    files = []
    total = 0
    while total < size:
        lines = []
        for _ in range(400):
            ind = "    " * rnd.randrange(3)
            words = " ".join(rnd.choice(_WORDS) for _ in range(rnd.randrange(3, 9)))
            lines.append(f"{ind}{words} = {rnd.randrange(1 << 30):x}")
        body = ("\n".join(lines) + "\n").encode()
        files.append(body)
        total += len(body)
    return files


def _write_repo(dst: Path, k: int, corpus: list[bytes]) -> None:
    for j, body in enumerate(corpus):
        p = dst / "work" / "repo" / f"pkg{j // 50:02d}" / f"mod{j:04d}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"# repository {k}\n".encode() + body)


def publish(
    store: LayerStore,
    base_layers: list[str],
    count: int,
    repo_mib: int,
    gen: Path,
    compress: str | None = "lz4hc",
) -> tuple[list[str], list[Path]]:
    """Per repository: an image base + its layer (built with ``compress``, as
    ``corral image build dir`` does), and its tar.gz; all evicted from cache."""
    corpus = _corpus(repo_mib * MIB)
    names, tars = [], []
    (store.root / "repos").mkdir(exist_ok=True)
    for k in range(count):
        src = gen / f"repo{k}"
        shutil.rmtree(src, ignore_errors=True)
        _write_repo(src, k, corpus)
        li = store.add_dir(src, kind="workspace", source=f"bench-repo{k}", compress=compress)
        name = f"bench/workspace-{k}"
        store.put_image(name, [*base_layers, li.digest], workdir="/work/repo")
        tar_path = store.root / "repos" / f"{k}.tar.gz"
        with tarfile.open(tar_path, "w:gz", compresslevel=1) as tar:
            tar.add(src / "work" / "repo", arcname="repo")
        shutil.rmtree(src)
        names.append(name)
        tars.append(tar_path)
        if k % 8 == 7 or k == count - 1:
            say(f"published {k + 1}/{count} repositories")
    stamp_all(store)
    for t in tars:
        drop_cache(t)
    return names, tars


async def _burst(
    opts: BenchOptions,
    sandboxes: int,
    concurrency: int,
    start: Any,
    drop: list[Path],
    fs: MooseStore,
) -> dict[str, float]:
    for p in drop:
        drop_cache(p)
    fs.drop_server_cache()
    sbs: list[Sandbox] = []
    try:
        async with AsyncClient(config=opts.node_config(sandboxes)) as client:
            sem = asyncio.Semaphore(concurrency)
            done: list[float] = []
            os.sync()
            w0 = disk_writes(opts.state_dir.parent)
            r0 = fs.link_bytes()[1]
            t0 = time.monotonic()

            async def one(k: int) -> None:
                async with sem:
                    sb = await start(client, k)
                    sbs.append(sb)
                    r = await sb.exec(["python3", "-c", TASK], timeout=600)
                    if r.exit_code != 0:
                        raise SandboxError(f"task failed in {sb.id}: {r.stderr[-500:]!r}")
                done.append(time.monotonic() - t0)

            try:
                await _all(one(k) for k in range(sandboxes))
                os.sync()
                writes = disk_writes(opts.state_dir.parent) - w0
                reads = fs.link_bytes()[1] - r0
            finally:
                # Also on failure: a node keeps its sandboxes when it closes.
                await asyncio.gather(*(sb.destroy() for sb in sbs), return_exceptions=True)
    finally:
        shutil.rmtree(opts.state_dir, ignore_errors=True)
        shutil.rmtree(opts.run_dir, ignore_errors=True)
    return {
        "done_s": round(max(done), 3),
        "writes_mib": round(writes / MIB, 1),
        "store_reads_mib": round(reads / MIB, 1),
    }


async def workspace(
    opts: BenchOptions,
    sandboxes: int,
    repo_mib: int,
    link_mbit: int,
    concurrency: int,
    readahead_kib: int | None = None,
    *,
    layer_compress: str = "lz4hc",
    delay_ms: float = 0.0,
) -> dict[str, Any]:
    from corral.bench.fncall import _ensure_python_image

    if layer_compress not in ("lz4", "lz4hc", "none"):
        raise CorralError(f"--layer-compress {layer_compress!r}: use lz4, lz4hc or none")
    compress = None if layer_compress == "none" else layer_compress

    base_name = await asyncio.to_thread(_ensure_python_image, opts)
    base = LayerStore(opts.store_dir).image(base_name)
    fs = await asyncio.to_thread(open_dfs, opts, link_mbit, readahead_kib, delay_ms)
    gen = opts.state_dir.with_name(opts.state_dir.name + "-gen")
    try:
        store = LayerStore(fs.mountpoint / "store", timeout=120)
        local = LayerStore(opts.store_dir)
        for d in base.layers:
            await asyncio.to_thread(store.add_file, local.path_of(d), kind="base", source=base_name)
        store.put_image("bench/workspace-base", base.layers, workdir="/work")
        say(f"publishing {sandboxes} repositories of ~{repo_mib} MiB as layers and tar.gz")
        names, tars = await asyncio.to_thread(
            publish, store, base.layers, sandboxes, repo_mib, gen, compress
        )
        layer_files = [store.path_of(li.digest) for li in store.layers()]

        async def from_layer(client: AsyncClient, k: int) -> Sandbox:
            return await client.sandboxes.create(image=names[k])

        async def from_tar(client: AsyncClient, k: int) -> Sandbox:
            sb = await client.sandboxes.create(image="bench/workspace-base")
            data = await asyncio.to_thread(tars[k].read_bytes)
            await sb.files.write("/work/repo.tar.gz", data)
            r = await sb.exec("cd /work && tar xzf repo.tar.gz && rm repo.tar.gz", timeout=600)
            if r.exit_code != 0:
                raise SandboxError(f"tar xzf failed in {sb.id}: {r.stderr[-500:]!r}")
            return sb

        out: dict[str, Any] = {
            "scenario": "workspace",
            "sandboxes": sandboxes,
            "repo_mib": repo_mib,
            "tar_gz_mib": round(sum(t.stat().st_size for t in tars) / len(tars) / MIB, 1),
            "link_mbit": link_mbit,
            "link_delay_ms": delay_ms,
            "store_readahead_kib": readahead_kib,
            "layer_compress": layer_compress,
            "layer_mib": round(
                sum(store.path_of(store.image(n).layers[-1]).stat().st_size for n in names)
                / len(names)
                / MIB,
                1,
            ),
            "concurrency": concurrency,
            "machine": machine(),
        }
        for mode, start, drop in (
            ("layer", from_layer, layer_files),
            ("tar", from_tar, [*layer_files, *tars]),
        ):
            say(f"{mode}: {sandboxes} sandboxes, each with its own repository")
            out[mode] = await _burst(
                _mode_opts(opts, f"ws{mode}", store.root), sandboxes, concurrency, start, drop, fs
            )
        out["speedup"] = round(out["tar"]["done_s"] / out["layer"]["done_s"], 2)
        out["writes_ratio"] = round(
            out["tar"]["writes_mib"] / max(out["layer"]["writes_mib"], 0.1), 2
        )
        return out
    finally:
        await asyncio.to_thread(shutil.rmtree, gen, True)
        await asyncio.to_thread(fs.stop)
