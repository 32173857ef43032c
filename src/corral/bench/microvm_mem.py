"""Where one microVM's host memory goes: QEMU's mappings, its cgroup's counters, and the
guest's own view, for the ``idle_breakdown`` of ``corral bench microvm``.

QEMU's ``/proc/PID/smaps`` is summed by what each mapping is:

* ``guest_ram``: anonymous mappings the size of one of the machine's RAM backends (``-m``
  or a ``memory-backend-ram,size=``); what the guest has touched and not handed back;
* ``tcg_code_buffer``: the anonymous rwx mapping, TCG's translation cache (``tb-size``);
* ``layer_files``: the DAX-mapped layer files (the store's, shared page cache);
* ``qemu_heap``: every other anonymous mapping (malloc arenas, thread stacks);
* ``qemu_files``: QEMU's binary and libraries (shared with every other QEMU).

Rss is what the process maps now; the cgroup's charge (``Cgroups.memory_breakdown``)
adds what no mapping shows (page cache of the writable disk and of the kernel/initramfs
files, kernel memory: page tables, slab). The guest's ``/proc/meminfo`` says what the guest itself holds.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["GUEST_MEMINFO", "guest_meminfo", "ram_sizes", "smaps_breakdown"]

_HEAD = re.compile(r"^[0-9a-f]+-[0-9a-f]+ (\S{4}) \S+ \S+ \d+\s*(.*)$")
_MIB = 1 << 20

GUEST_MEMINFO = ("MemTotal", "MemFree", "Buffers", "Cached", "Shmem", "Slab", "PageTables")
"""The guest's /proc/meminfo lines kept (kB in the guest, reported in MiB)."""


def ram_sizes(argv: list[str]) -> set[int]:
    """The byte sizes of the machine's RAM backends in QEMU's ``argv``."""
    sizes: set[int] = set()
    for i, a in enumerate(argv):
        if a == "-m" and i + 1 < len(argv):
            v = argv[i + 1].split(",")[0]
            sizes.add(int(v.rstrip("M")) * _MIB)
        for m in re.finditer(r"memory-backend-ram,[^ ]*?size=(\d+)", a):
            sizes.add(int(m.group(1)))
    return sizes


def smaps_breakdown(pid: int, ram: set[int], path: Path | None = None) -> dict[str, Any]:
    """Rss (and, for guest RAM, the part in transparent huge pages) of QEMU ``pid`` by
    kind of mapping, in MiB (``path``: another smaps file to read, for tests)."""
    rss: dict[str, int] = {}
    huge = 0
    kind = "qemu_heap"
    size = 0
    with open(path or f"/proc/{pid}/smaps") as f:
        for line in f:
            m = _HEAD.match(line)
            if m:
                perms, name = m.group(1), m.group(2).strip()
                kind = _kind(perms, name)
                continue
            key, _, rest = line.partition(":")
            if key == "Size":
                size = int(rest.split()[0]) << 10
                if kind == "qemu_heap" and size in ram:
                    kind = "guest_ram"
            elif key == "Rss":
                rss[kind] = rss.get(kind, 0) + (int(rest.split()[0]) << 10)
            elif key == "AnonHugePages" and kind == "guest_ram":
                huge += int(rest.split()[0]) << 10
    out: dict[str, Any] = {k: round(v / _MIB, 1) for k, v in sorted(rss.items())}
    out["guest_ram_thp"] = round(huge / _MIB, 1)
    out["rss_total"] = round(sum(rss.values()) / _MIB, 1)
    return out


def _kind(perms: str, path: str) -> str:
    if path.endswith(".erofs"):
        return "layer_files"
    if path.startswith("/"):
        return "qemu_files"
    if perms.startswith("rwx"):
        return "tcg_code_buffer"
    return "qemu_heap"  # anonymous or [heap]/[stack]; guest RAM is told apart by size


def guest_meminfo(text: str) -> dict[str, float]:
    """:data:`GUEST_MEMINFO` from the guest's /proc/meminfo, in MiB."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in GUEST_MEMINFO:
            out[k] = round(int(v.split()[0]) / 1024, 1)
    return out
