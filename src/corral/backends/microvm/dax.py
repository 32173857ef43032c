"""Image layers mapped into a microVM as persistent memory, read by the guest with DAX.

Why: with virtio-blk every guest keeps its own copy of the layer blocks it reads in its
page cache (N VMs, N copies, besides the host's page cache of the file). Mapped as guest
memory straight from the store's layer file (``memory-backend-file``, ``share=on``,
``readonly=on``), the guest reads the host's page cache of that file in place (EROFS
``-o dax``): one copy on the node, shared with every VM and with the containers that
mount the same file.

How, on QEMU 7.2's ``-M microvm`` (whose memory-device slot gives virtio-pmem no address,
see docs/design-notes.md): the guest's RAM is built from NUMA nodes laid out back to back,
and each layer file is one of them; the kernel is told, by ``memmap=SIZE!START``, that
those ranges are persistent memory (e820 type 12), which ``nd_e820`` turns into
``/dev/pmem<i>`` (the microvm's PCIe host, ``pcie=on``, is needed: the kernel inserts
those ranges into its resource tree in its PCI resource survey). The address layout::

    [ RAM: the guest's memory ][ layer 0 | pad 0 ][ gap ][ layer 1 | pad 1 ][ gap ] ... [ tail ]

* a pmem range must start and end 2 MiB aligned (``memremap_pages``), layer files are
  any multiple of 4 KiB: each is followed by a small RAM node (its pad) up to the next
  2 MiB boundary. The pad is in the pmem range but never read (EROFS stays in its size);
  the store's file stays as it is (same digest, same page cache as the containers').
* a 2 MiB RAM gap after each range, or the kernel merges adjacent type-12 ranges into one
  device;
* QEMU loads the initramfs at the top of RAM: a RAM tail big enough for it comes last.

Pads, gaps and the tail are part of the guest's memory limit, not on top of it; the guest
pays 64 bytes of ``struct page`` per 4 KiB of layer (1.6%) for DAX. A layer whose size is
not a 4 KiB multiple, or a layout past what the machine keeps below 4 GiB, gets no plan:
the VM then has its layers by virtio-blk (the fallback, reported per sandbox).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DaxPlan", "plan", "ALIGN"]

ALIGN = 2 << 20
"""A pmem range's alignment (x86 ``memremap_pages`` subsection)."""
_GAP = 2 << 20
_PAGE = 4096
_MAX_LOW = 3 << 30
"""Guest RAM the microvm machine keeps below 4 GiB (the layout assumes one piece)."""
_MIN_RAM = 64 << 20


@dataclass(frozen=True)
class DaxPlan:
    """QEMU arguments and kernel parameters that map ``layers`` as pmem0..N-1."""

    argv: list[str]
    """``-m``, the memory backends and the NUMA nodes (replaces a plain ``-m``)."""
    kernel_args: list[str]
    """``memmap=SIZE!START`` per layer."""
    total_mib: int
    """The machine's RAM size in MiB (the guest's memory plus the layer ranges)."""


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


def plan(layers: list[tuple[Path, int]], memory_mib: int, initrd_size: int) -> DaxPlan | None:
    """The layout for ``layers`` ((path, size), base first) in a guest of ``memory_mib``,
    or None when they cannot be mapped (then: virtio-blk)."""
    if not layers or any(size <= 0 or size % _PAGE for _, size in layers):
        return None
    mem = memory_mib << 20
    tail = _up(initrd_size + (8 << 20), ALIGN)
    main = mem - tail - _GAP * len(layers)
    if main < _MIN_RAM or main % ALIGN:
        return None
    regions = [_up(size, ALIGN) for _, size in layers]
    total = mem + sum(regions)
    if total > _MAX_LOW:
        return None
    argv = ["-object", f"memory-backend-ram,id=ram,size={main}", "-numa", "node,memdev=ram"]
    kargs: list[str] = []
    at = main
    for i, ((path, size), region) in enumerate(zip(layers, regions)):
        if "," in str(path):
            return None  # QEMU's option syntax: a comma would need escaping
        # Shared with every reader of the store's file, read-only: the guest cannot write
        # it (its writes are dropped), and a migration skips it (x-ignore-shared).
        argv += [
            "-object",
            f"memory-backend-file,id=l{i},mem-path={path},size={size},share=on,readonly=on",
            "-numa",
            f"node,memdev=l{i}",
            "-object",
            f"memory-backend-ram,id=p{i},size={region - size + _GAP}",
            "-numa",
            f"node,memdev=p{i}",
        ]
        kargs.append(f"memmap={region}!{at:#x}")
        at += region + _GAP
    argv += ["-object", f"memory-backend-ram,id=tail,size={tail}", "-numa", "node,memdev=tail"]
    return DaxPlan(argv=["-m", f"{total >> 20}M", *argv], kernel_args=kargs, total_mib=total >> 20)
