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

The program is Python (``python3``, importing a broad set of the standard library) when the
image has it, else perl; the JSON says which.
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
from corral.host.cgroups import Cgroups
from corral.images.store import LayerStore
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
_LABEL = "corral-bench-share"


def _evict(path: Path) -> None:
    """Drop this file's clean pages from the page cache (only this file's)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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
    for img in images:
        for d in img.layers:
            _evict(store.path_of(d))
    avail0 = hostmem.sample().available
    async with AsyncClient(config=opts.node_config()) as client:
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
            charged = [(await sb.refresh()).memory_resident or 0 for sb in sbs]
            avail1 = hostmem.sample().available
            kinds = {"anon": 0, "file": 0, "kernel": 0}
            cg = Cgroups(opts.subtree)
            for sb in sbs:
                with contextlib.suppress(CorralError):
                    for k, v in cg.memory_breakdown(sb.id).items():
                        if k in kinds:
                            kinds[k] += v
        finally:
            await asyncio.gather(*(sb.destroy() for sb in sbs), return_exceptions=True)
    return {
        "mib": round(sum(charged) / MIB, 1),
        "per_sandbox_mib": [round(c / MIB, 1) for c in charged],
        "mem_available_drop_mib": round((avail0 - avail1) / MIB, 1),
        **{f"{k}_mib": round(v / MIB, 1) for k, v in kinds.items()},
    }


async def share(opts: BenchOptions, count: int) -> dict[str, Any]:
    """The ``share`` scenario (see the module docstring)."""
    async with prepared(opts) as p:
        out = header("share", p, count=count)
        store = LayerStore(opts.store_dir)
        image = p.image.info
        async with AsyncClient(config=opts.node_config()) as client:
            probe = await client.sandboxes.create(image=image, labels={_LABEL: "probe"})
            try:
                has_py = (await probe.exec(["python3", "-c", "pass"])).ok
            finally:
                await probe.destroy()
        argv = ["python3", "-c", _PY] if has_py else ["perl", "-e", _PERL]
        out["program"] = "python3 (stdlib imports)" if has_py else "perl"
        say(f"making {count} private copies of {len(image.layers)} layer(s)")
        copies = await asyncio.to_thread(_private_copies, store, image, count)
        try:
            say(f"shared: {count} sandboxes of {image.name}")
            shared = await _phase(opts, store, [image] * count, argv)
            say(f"copied: {count} sandboxes, each from its own copy")
            copied = await _phase(opts, store, copies, argv)
        finally:
            await asyncio.to_thread(_remove_copies, store, copies, set(image.layers))
        out.update(
            {
                "shared_mib": shared["mib"],
                "copied_mib": copied["mib"],
                "ratio": round(shared["mib"] / copied["mib"], 3) if copied["mib"] else None,
                "shared": shared,
                "copied": copied,
                "measure": "sum of the sandboxes' memory cgroup charges (anon + page cache)",
            }
        )
        return out
