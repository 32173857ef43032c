"""The ``dax`` figure of ``corral bench microvm``: host memory of N microVMs that read the
same image files, with the layers shared by DAX against private copies (virtio-blk).

Both sets boot the same DAX-ready copy of the bench image (EROFS maps only uncompressed,
block-aligned files with DAX: a compressed file or a tail packed inline is copied into the
guest's page cache whatever the device; the copy is made once and kept in the store as
``<image>-plain``). Each VM reads the same files (``READ``, ~60 MiB of a Debian minbase),
then the node's cgroups say what the N VMs hold together: their memory.current summed
(guest RAM in use, QEMU, and the host page cache of the layer files, charged to the
first VM that read them; the files are dropped from the page cache before each set so
no earlier reader holds them). ``ratio`` = shared / private, all of the VMs' memory;
``read_added_ratio`` the same for what reading added to the VMs booted and idle (under
TCG each VM's idle memory includes QEMU's translation cache, tcg_tb_mib, which KVM has
not).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.bench import microvm_mem
from corral.bench.scenarios import say
from corral.bench.stats import p50
from corral.images.erofs import DAX
from corral.images.store import LayerStore
from corral.spec import ImageInfo

if TYPE_CHECKING:
    from corral.backends.microvm.backend import MicroVMBackend
    from corral.node import Node
    from corral.spec import SandboxSpec

__all__ = ["dax_figure", "plain_image"]

READ = (
    "B=/.corral/busybox; $B find /usr/bin /usr/sbin /usr/lib -type f"
    " -exec $B cat {} + 2>/dev/null | $B wc -c"
)
"""What each VM reads (prints the bytes read)."""


def plain_image(store: LayerStore, image: ImageInfo, scratch: Path) -> ImageInfo:
    """``image`` with every layer rebuilt for DAX (uncompressed, no inline tails: see
    :data:`corral.images.erofs.DAX`), cached in the store by name."""
    from corral.errors import ImageNotFound
    from corral.host import mounts

    name = f"{image.name.split(':')[0]}-plain"
    with contextlib.suppress(ImageNotFound):
        have = store.image(name)
        if all(store.layer(d).meta.get("compression") == DAX for d in have.layers):
            return have
    layers = []
    for digest in image.layers:
        info = store.layer(digest)
        if info.meta.get("compression") == DAX:
            layers.append(digest)
            continue
        scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=scratch) as tmp:
            mnt = Path(tmp) / "m"
            mnt.mkdir()
            # Safe: a read-only mount of one of the store's own layers, for mkfs to read.
            mounts.mount_erofs(store.path_of(digest), mnt)
            try:
                plain = store.add_dir(mnt, kind="image", source=f"{digest} for dax", compress=DAX)
            finally:
                mounts.umount(mnt)
        layers.append(plain.digest)
    return store.put_image(name, layers, env=dict(image.env), workdir=image.workdir)


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def dax_figure(
    node: Node, vm: MicroVMBackend, spec: SandboxSpec, count: int, state_dir: Path
) -> dict[str, Any]:
    """``{"shared_mib", "private_mib", "ratio", ...}`` for ``count`` VMs of ``spec``'s
    image (see the module docstring). Leaves the backend's ``dax`` setting as it was."""
    from corral.spec import ExecRequest

    store = node.store
    image = await asyncio.to_thread(
        plain_image, store, store.image(spec.image), state_dir / "dax-plain"
    )
    files = [store.path_of(d) for d in image.layers]
    vspec = spec.model_copy(update={"image": image.name})
    saved = vm.config
    out: dict[str, Any] = {"image": image.name, "layers_mib": 0.0}
    out["layers_mib"] = round(sum(p.stat().st_size for p in files) / (1 << 20), 1)
    held: dict[str, int] = {}
    idle: dict[str, int] = {}
    boot_ms: dict[str, float] = {}
    read_ms: dict[str, float] = {}
    breakdown: dict[str, Any] = {}
    try:
        for mode, on in (("shared", True), ("private", False)):
            vm.config = saved.model_copy(update={"dax": on})
            await asyncio.to_thread(_drop_cache, files)
            ids: list[str] = []
            say(f"microvm dax: {count} VMs reading the image's files, layers {mode}")
            try:
                boots = []
                for _ in range(count):
                    t0 = time.perf_counter()
                    info = await node.sandbox_create(vspec)
                    boots.append(time.perf_counter() - t0)
                    ids.append(info.id)
                    want = "dax" if on else "virtio-blk"
                    if info.layer_access != want:
                        raise RuntimeError(f"{info.id}: layers by {info.layer_access}, not {want}")
                boot_ms[mode] = round(p50(boots) * 1000, 1)
                idle[mode] = sum(node.cgroups.memory_current(i) for i in ids)
                breakdown[mode] = await idle_breakdown(node, vm, ids[0])
                reads = []
                for i in ids:
                    t0 = time.perf_counter()
                    r = await node.exec(i, ExecRequest(cmd=["sh", "-c", READ], timeout=600))
                    reads.append(time.perf_counter() - t0)
                    if r.exit_code != 0:
                        raise RuntimeError(f"read in {i}: {r.reason} {r.stderr[:200]!r}")
                    out["read_mib"] = round(int(r.stdout.split()[0]) / (1 << 20), 1)
                read_ms[mode] = round(p50(reads) * 1000, 1)
                held[mode] = sum(node.cgroups.memory_current(i) for i in ids)
            finally:
                for i in ids:
                    await node.sandbox_destroy(i)
    finally:
        vm.config = saved
    out["shared_mib"] = round(held["shared"] / (1 << 20), 1)
    out["private_mib"] = round(held["private"] / (1 << 20), 1)
    out["ratio"] = round(held["shared"] / held["private"], 3) if held["private"] else None
    # what reading the files added (the VMs' own idle memory left out)
    grew = {m: held[m] - idle[m] for m in held}
    out["idle_mib"] = {m: round(v / (1 << 20), 1) for m, v in idle.items()}
    out["idle_per_vm_mib"] = {m: round(v / count / (1 << 20), 1) for m, v in idle.items()}
    out["boot_ms_p50"] = boot_ms
    out["read_ms_p50"] = read_ms
    out["idle_breakdown"] = breakdown
    out["read_added_mib"] = {m: round(v / (1 << 20), 1) for m, v in grew.items()}
    out["read_added_ratio"] = (
        round(grew["shared"] / grew["private"], 3) if grew["private"] > 0 else None
    )
    return out


async def idle_breakdown(node: Node, vm: MicroVMBackend, sandbox_id: str) -> dict[str, Any]:
    """Where one idle VM's host memory goes (:mod:`corral.bench.microvm_mem`): QEMU's
    mappings by kind, the cgroup's charge by kind, the guest's own /proc/meminfo; MiB."""
    from corral.spec import ExecRequest

    pid = vm.vmm_pid(sandbox_id)
    if pid is None:
        return {}
    argv = json.loads((vm.dir(sandbox_id) / "vm.json").read_text())["argv"]
    r = await node.exec(sandbox_id, ExecRequest(cmd=["/.corral/busybox", "cat", "/proc/meminfo"]))
    charged = node.cgroups.memory_breakdown(sandbox_id)
    return {
        "qemu_rss": microvm_mem.smaps_breakdown(pid, microvm_mem.ram_sizes(argv)),
        "cgroup": {k: round(v / (1 << 20), 1) for k, v in charged.items()},
        "guest": microvm_mem.guest_meminfo(r.text() if r.ok else ""),
    }
