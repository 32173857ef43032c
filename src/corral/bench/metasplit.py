"""``corral bench metasplit``: does EROFS's metadata/data split pay on a network store?

Set-up (untimed): the MooseFS store of bench/dfs.py behind its shaped link, and one
repository of ``--files`` small files (1-7 KiB of random bytes each, 100 to a directory)
built three ways:

* ``whole``: ``mkfs.erofs`` as corral builds an uncompressed layer, the file on the store.
  Small files' tails are inlined with their inodes, so metadata and data share blocks.
* ``noinline``: the same with ``-E noinline_data``: inodes and directories in blocks of
  their own, every file's data in whole blocks of its own; the file on the store.
* ``split``: ``--blobdev`` with ``--chunksize 4096``: the metadata image (inodes,
  directories, chunk indexes) on the node's local disk, the data in a blob on the store,
  mounted with ``-o device=<blob>`` (what DSec does with 3FS).

Each variant then runs two workloads, each on a cold mount (the files evicted from this
machine's page cache, the chunkserver's too): ``stat``, a walk that lstat()s every file
(``git status``, ``find``), and ``read``, the same walk reading every 20th file whole (a
task's sample). Trials alternate the variants' order. Figures per variant and workload:
median and each trial's milliseconds, and the MiB that came over the link (median).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.bench.dfs import MooseStore
from corral.bench.ondemand import MIB, drop_cache, open_dfs
from corral.bench.scenarios import BenchOptions, machine, say
from corral.host import mounts

__all__ = ["metasplit", "VARIANTS", "WORKLOADS"]

VARIANTS = ("whole", "noinline", "split")
WORKLOADS = ("stat", "read")
_PER_DIR = 100
_SAMPLE = 20  # the read workload reads every 20th file


def _repo(root: Path, files: int) -> None:
    for k in range(files):
        p = root / "repo" / f"d{k // _PER_DIR:04d}" / f"f{k:06d}.py"
        if k % _PER_DIR == 0:
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(1024 + (k * 7919) % 6144))


def _mkfs(*args: str) -> None:
    r = subprocess.run(["mkfs.erofs", "--quiet", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"mkfs.erofs {' '.join(args)} failed: {r.stderr.strip()[-500:]}")


def _walk(root: Path, read: bool) -> int:
    """lstat every file under ``root`` in a sorted walk; with ``read``, read every
    ``_SAMPLE``-th file whole. Returns the files seen."""
    n = 0
    for top, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(top, name)
            os.lstat(p)
            if read and n % _SAMPLE == 0:
                with open(p, "rb") as f:
                    while f.read(1 << 16):
                        pass
            n += 1
    return n


async def metasplit(
    opts: BenchOptions,
    files: int,
    trials: int,
    link_mbit: int,
    readahead_kib: int | None,
    delay_ms: float,
) -> dict[str, Any]:
    """The scenario (see the module docstring). Blocking work on the event loop: nothing
    else runs on it here (no node, no sandboxes)."""
    work = opts.state_dir.with_name(opts.state_dir.name + "-metasplit")
    shutil.rmtree(work, ignore_errors=True)
    (work / "mnt").mkdir(parents=True)
    out: dict[str, Any] = {
        "scenario": "metasplit",
        "files": files,
        "trials": trials,
        "link_mbit": link_mbit,
        "link_delay_ms": delay_ms,
        "store_readahead_kib": readahead_kib,
        "machine": machine(),
    }
    fs = open_dfs(opts, link_mbit, readahead_kib, delay_ms)
    try:
        say(f"writing a repository of {files} files")
        _repo(work / "src", files)
        local = work / "local"
        local.mkdir()
        store = fs.mountpoint / "metasplit"
        store.mkdir(exist_ok=True)
        say("building the three layers")
        _mkfs(str(local / "whole.erofs"), str(work / "src"))
        _mkfs("-Enoinline_data", str(local / "noinline.erofs"), str(work / "src"))
        _mkfs(
            f"--blobdev={local / 'data.blob'}",
            "--chunksize=4096",
            str(local / "meta.erofs"),
            str(work / "src"),
        )
        shutil.rmtree(work / "src")
        for name in ("whole.erofs", "noinline.erofs", "data.blob"):
            shutil.copyfile(local / name, store / name)
            (local / name).unlink()
        os.sync()
        layers: dict[str, tuple[Path, list[Path]]] = {
            "whole": (store / "whole.erofs", []),
            "noinline": (store / "noinline.erofs", []),
            "split": (local / "meta.erofs", [store / "data.blob"]),
        }
        out["sizes_mib"] = {
            "whole": _mib((store / "whole.erofs").stat().st_size),
            "noinline": _mib((store / "noinline.erofs").stat().st_size),
            "split_meta_local": _mib((local / "meta.erofs").stat().st_size),
            "split_blob": _mib((store / "data.blob").stat().st_size),
        }
        every = [p for image, blobs in layers.values() for p in (image, *blobs)]
        runs: dict[tuple[str, str], list[tuple[float, int]]] = {
            (v, w): [] for v in VARIANTS for w in WORKLOADS
        }
        for t in range(trials):
            order = VARIANTS if t % 2 == 0 else tuple(reversed(VARIANTS))
            for v in order:
                for w in WORKLOADS:
                    image, blobs = layers[v]
                    runs[(v, w)].append(
                        _cold(
                            fs, every, image, blobs, work / "mnt", lambda m: _walk(m, w == "read")
                        )
                    )
            say(
                f"trial {t + 1}/{trials}: "
                + ", ".join(
                    f"{v} {runs[(v, 'stat')][-1][0]:.0f}/{runs[(v, 'read')][-1][0]:.0f} ms"
                    for v in VARIANTS
                )
            )
        out["variants"] = {
            v: {
                f"{w}_ms_p50": round(statistics.median(ms for ms, _ in runs[(v, w)]), 1)
                for w in WORKLOADS
            }
            | {f"{w}_ms": [round(ms, 1) for ms, _ in runs[(v, w)]] for w in WORKLOADS}
            | {
                f"{w}_link_mib": _mib(int(statistics.median(b for _, b in runs[(v, w)])))
                for w in WORKLOADS
            }
            for v in VARIANTS
        }
        whole = out["variants"]["whole"]
        for v in ("noinline", "split"):
            for w in WORKLOADS:
                mine = out["variants"][v][f"{w}_ms_p50"]
                out[f"{w}_speedup_{v}"] = round(whole[f"{w}_ms_p50"] / mine, 2) if mine else None
        return out
    finally:
        for m in mounts.mounts_under(work / "mnt"):
            mounts.umount(m, detach=True)
        fs.stop()
        shutil.rmtree(work, ignore_errors=True)


def _cold(
    fs: MooseStore,
    every: list[Path],
    image: Path,
    blobs: list[Path],
    mnt: Path,
    task: Callable[[Path], int],
) -> tuple[float, int]:
    """Evict every layer file and the chunkserver's cache, mount ``image`` (with
    ``blobs``), time ``task`` on the mount; (milliseconds, bytes over the link)."""
    for p in every:
        drop_cache(p)
    fs.drop_server_cache()
    rx0 = fs.link_bytes()[1]
    mounts.mount_erofs(image, mnt, devices=blobs)
    try:
        t0 = time.perf_counter()
        task(mnt)
        ms = (time.perf_counter() - t0) * 1000
    finally:
        mounts.umount(mnt)
    return ms, fs.link_bytes()[1] - rx0


def _mib(n: int) -> float:
    return round(n / MIB, 2)
