"""``corral bench share``: host memory of N sandboxes running the same program from one
shared layer, against the same N from N private copies of that layer.

Shared: N sandboxes of the image; the node mounts each layer once, so the program's files
(interpreter, libraries, modules) sit once in the page cache. Copied: N images, each with
its own copy of every layer of the image (the same bytes plus one padding block naming
the copy, so each copy has its own digest, its own mount and its own page cache) -- what a
platform that unpacks an image per sandbox gets. Memory is the kernel's: the sum of the
sandboxes' memory cgroup charges (anonymous memory and the page cache each one brought
in; a shared page is charged once, to the sandbox that read it first). Each phase starts
with the layer files evicted from the page cache (fadvise DONTNEED on those files only)
and with no layer mounted. ``ratio`` = shared / copied (smaller is better).

The layer files' own page cache is left out of the charges, in both phases: an EROFS mount
of a file reads it through the file's page cache, so what a sandbox reads is cached twice,
once as the EROFS file's pages (what the sandboxes map and keep using) and once as the
layer file's (a used-once duplicate the kernel reclaims first, plus its read-ahead). Whose
cgroup that duplicate is charged to is an accident: the sandbox that read a page first, or
the node when it read the file itself (a new layer's verification hashes all of it, a
hot-block prefetch the hot parts), so a phase's figure moved by up to the whole duplicate
(~46 MiB of a python image's first sandbox) with the store's history. Once the programs are
up, each phase records how much of the layer files is cached (``layer_file_cache_mib``) and
evicts it, then reads the charges. Hot-block prefetch is off for the bench's node, so it
neither moves charges nor records profiles of this bench's reads on the store.

The program is Python (``python3``, importing a broad set of the standard library) when the
image has it, else perl; the JSON says which. When the image's Python has numpy (a pip
toolkit layer, e.g. ``corral image build pip --req numpy==2.2.6 --on py/debian``), the main
program is a numpy one (imports numpy and runs a matrix product, an SVD and an FFT, so its
compiled extensions and OpenBLAS are mapped and used): a toolkit layer's shared objects are
what dominates a sandbox's file-backed memory. The stdlib-only program is then measured too,
as a second data point (``stdlib``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from corral.bench import hostmem
from corral.bench.scenarios import BenchOptions, header, prepared, say
from corral.errors import CorralError, SandboxError
from corral.host import pagecache
from corral.host.cgroups import Cgroups
from corral.images import hotblocks
from corral.images.store import LayerStore
from corral.node.config import NodeConfig
from corral.sdk import AsyncClient, Sandbox
from corral.spec import ImageInfo

__all__ = ["share"]

MIB = 1 << 20
_PY = (
    "import asyncio, json, email.parser, http.client, urllib.request, sqlite3, decimal, "
    "xml.etree.ElementTree, unittest, argparse, logging, subprocess, csv, zipfile, tarfile, "
    "difflib, pydoc, inspect, typing, dataclasses, concurrent.futures\n"
    "try:\n    import pip._internal.cli.main\nexcept Exception:\n    pass\n"
    "open('/tmp/ready', 'w').close()\nimport time\ntime.sleep(86400)\n"
)
_PERL = "open(F, '>/tmp/ready'); close F; sleep 86400;"
_NUMPY = (
    "import numpy as np\n"
    "rng = np.random.default_rng(0)\n"
    "a = rng.random((256, 256))\n"
    "b = a @ a.T\n"
    "u, s, vt = np.linalg.svd(a[:128, :128])\n"
    "f = np.fft.rfft(a[0])\n"
    "assert b.shape == (256, 256) and s.shape == (128,) and f.shape == (129,)\n"
    "try:\n"  # scipy too when the toolkit has it: its compiled modules are the bulk
    "    import scipy.linalg, scipy.optimize, scipy.sparse, scipy.signal, scipy.stats\n"
    "    scipy.linalg.lu(a[:64, :64])\n"
    "    scipy.optimize.minimize(lambda x: ((x - 1.0) ** 2).sum(), np.zeros(4))\n"
    "    scipy.signal.lfilter([1.0, -0.5], [1.0], a[0])\n"
    "    scipy.stats.norm.cdf(a[0])\n"
    "except ImportError:\n"
    "    pass\n" + _PY
)
_LABEL = "corral-bench-share"


def _evict(path: Path) -> None:
    """Drop this file's clean pages from the page cache (only this file's)."""
    with contextlib.suppress(OSError):
        pagecache.evict(path)


def _cached(path: Path) -> int:
    """Bytes of ``path`` in the page cache (0 if it cannot be read)."""
    try:
        return hotblocks.resident_bytes(path)
    except OSError:
        return 0


def _node_config(opts: BenchOptions) -> NodeConfig:
    """The bench's node, without hot-block prefetch (module docstring)."""
    return opts.node_config().model_copy(update={"layer_prefetch": False})


def _private_copies(store: LayerStore, image: ImageInfo, n: int) -> list[ImageInfo]:
    """N images, each with its own copy (own digest) of every layer of ``image``."""
    out = []
    tmp = store.root / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        layers = []
        for digest in image.layers:
            src = store.path_of(digest)
            dst = tmp / f"share-copy-{os.getpid()}-{i}.erofs"
            try:
                shutil.copyfile(src, dst)
                with open(dst, "ab") as f:
                    # Past the filesystem's last block: EROFS never reads it.
                    f.write(f"corral-bench-share copy {i} of {digest}".encode().ljust(4096, b"\0"))
                layer = store.add_file(dst, kind="dir", source=f"bench share copy {i}")
            finally:
                dst.unlink(missing_ok=True)
            _evict(store.path_of(layer.digest))
            layers.append(layer.digest)
        out.append(store.put_image(f"bench/share-copy-{i}", layers, env=image.env))
    return out


def _remove_copies(store: LayerStore, copies: list[ImageInfo], keep: set[str]) -> None:
    for img in copies:
        with contextlib.suppress(CorralError):
            store.remove_image(img.name)
    for img in copies:
        for d in img.layers:
            if d not in keep:
                with contextlib.suppress(CorralError):
                    store.remove_layer(d)


def _pss(pid: int) -> int:
    """Proportional set size of ``pid`` in bytes (a page mapped by k processes counts
    1/k to each; page cache nobody maps is not in it), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def _wait_ready(sb: Sandbox) -> None:
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(CorralError):
            await sb.files.stat("/tmp/ready")
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"{sb.id}: the program did not start within 120 s")
        await asyncio.sleep(0.1)


async def _phase(
    opts: BenchOptions, store: LayerStore, images: list[ImageInfo], argv: list[str]
) -> dict[str, Any]:
    files = sorted({store.path_of(d) for img in images for d in img.layers})
    for f in files:
        _evict(f)
    avail0 = hostmem.sample().available
    async with AsyncClient(config=_node_config(opts)) as client:
        sbs: list[Sandbox] = []
        try:
            for img in images:
                sb = await client.sandboxes.create(
                    image=img, labels={_LABEL: "1"}, limits={"memory": "512MiB", "disk": "64MiB"}
                )
                sbs.append(sb)
                await sb.spawn(argv)
                await _wait_ready(sb)
            await asyncio.sleep(1.0)
            file_cache = sum(_cached(f) for f in files)
            for f in files:
                _evict(f)  # the duplicate (module docstring); the EROFS pages stay
            charged = [(await sb.refresh()).memory_resident or 0 for sb in sbs]
            avail1 = hostmem.sample().available
            kinds = {"anon": 0, "file": 0, "kernel": 0}
            cg = Cgroups(opts.subtree)
            pss = 0
            for sb in sbs:
                with contextlib.suppress(CorralError):
                    for k, v in cg.memory_breakdown(sb.id).items():
                        if k in kinds:
                            kinds[k] += v
                    pss += sum(_pss(pid) for pid in cg.procs(sb.id))
        finally:
            await asyncio.gather(*(sb.destroy() for sb in sbs), return_exceptions=True)
    return {
        "mib": round(sum(charged) / MIB, 1),
        "per_sandbox_mib": [round(c / MIB, 1) for c in charged],
        "mem_available_drop_mib": round((avail0 - avail1) / MIB, 1),
        "pss_mib": round(pss / MIB, 1),
        "layer_file_cache_mib": round(file_cache / MIB, 1),
        **{f"{k}_mib": round(v / MIB, 1) for k, v in kinds.items()},
    }


async def share(opts: BenchOptions, count: int) -> dict[str, Any]:
    """The ``share`` scenario (see the module docstring)."""
    async with prepared(opts) as p:
        out = header("share", p, count=count)
        store = LayerStore(opts.store_dir)
        image = p.image.info
        async with AsyncClient(config=_node_config(opts)) as client:
            probe = await client.sandboxes.create(image=image, labels={_LABEL: "probe"})
            try:
                has_py = (await probe.exec(["python3", "-c", "pass"])).ok
                has_np = has_py and (await probe.exec(["python3", "-c", "import numpy"])).ok
                has_sp = has_np and (await probe.exec(["python3", "-c", "import scipy"])).ok
            finally:
                await probe.destroy()
        programs: dict[str, tuple[str, list[str]]] = {}
        if has_np:
            what = "numpy and scipy" if has_sp else "numpy"
            programs["main"] = (f"python3 ({what} from a toolkit layer)", ["python3", "-c", _NUMPY])
            programs["stdlib"] = ("python3 (stdlib imports)", ["python3", "-c", _PY])
        elif has_py:
            programs["main"] = ("python3 (stdlib imports)", ["python3", "-c", _PY])
        else:
            programs["main"] = ("perl", ["perl", "-e", _PERL])
        out["program"] = programs["main"][0]
        say(f"making {count} private copies of {len(image.layers)} layer(s)")
        copies = await asyncio.to_thread(_private_copies, store, image, count)
        results: dict[str, dict[str, Any]] = {}
        try:
            for key, (what, argv) in programs.items():
                say(f"{what}: shared: {count} sandboxes of {image.name}")
                shared = await _phase(opts, store, [image] * count, argv)
                say(f"{what}: copied: {count} sandboxes, each from its own copy")
                copied = await _phase(opts, store, copies, argv)
                results[key] = _result(what, shared, copied)
        finally:
            await asyncio.to_thread(_remove_copies, store, copies, set(image.layers))
        out.update(results.pop("main"))
        out.update(results)
        out["measure"] = "sum of the sandboxes' memory cgroup charges (anon + page cache)"
        return out


def _result(what: str, shared: dict[str, Any], copied: dict[str, Any]) -> dict[str, Any]:
    """One program's figures: by cgroup charges (``ratio``) and by the host's
    MemAvailable drop (``ratio_mem_available``, noisier: the whole host moves it)."""
    drop_s, drop_c = shared["mem_available_drop_mib"], copied["mem_available_drop_mib"]
    return {
        "program": what,
        "shared_mib": shared["mib"],
        "copied_mib": copied["mib"],
        "ratio": round(shared["mib"] / copied["mib"], 3) if copied["mib"] else None,
        "ratio_mem_available": round(drop_s / drop_c, 3) if drop_c > 0 else None,
        "ratio_pss": (
            round(shared["pss_mib"] / copied["pss_mib"], 3) if copied["pss_mib"] else None
        ),
        "shared": shared,
        "copied": copied,
    }
