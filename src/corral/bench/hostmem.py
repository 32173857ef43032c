"""Host memory as the kernel counts it, for ``corral bench density``.

The headline figure is the growth of ``MemTotal - MemAvailable`` (from /proc/meminfo)
while N idle sandboxes exist, divided by N. ``MemAvailable`` already counts clean page
cache and reclaimable slab as available, so the shared, reclaimable page cache of the
image's layers is not charged to the sandboxes, while everything they pin is: process
memory, page tables, tmpfs/shmem, unreclaimable kernel objects (namespaces, mounts,
cgroups, sockets). We do not drop the page cache (``drop_caches`` is host-wide and would
disturb whatever else runs on this shared machine); MemAvailable makes it unnecessary.

Beside it we report the ``Slab``/``SUnreclaim`` growth (the kernel's share) and the
memory cgroup's own usage for the sandboxes' subtree (what a limit would see: v1
``memory.usage_in_bytes`` includes page cache and kernel memory charged to it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemSample", "sample", "cgroup_usage", "rss_sum", "slabs", "slab_growth", "MIB"]

MIB = 1 << 20
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemSample:
    """One reading of /proc/meminfo, in bytes."""

    total: int
    available: int
    slab: int
    sunreclaim: int
    shmem: int
    percpu: int = 0
    kernel_stack: int = 0
    page_tables: int = 0

    @property
    def used(self) -> int:
        return self.total - self.available

    @property
    def kernel(self) -> int:
        """Kernel memory no reclaim frees: unreclaimable slab, per-cpu areas (a v1 memory
        cgroup's statistics live there), kernel stacks, page tables."""
        return self.sunreclaim + self.percpu + self.kernel_stack + self.page_tables


def _meminfo(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def sample(text: str | None = None) -> MemSample:
    """Read /proc/meminfo (or parse ``text``)."""
    m = _meminfo(text if text is not None else Path("/proc/meminfo").read_text())
    return MemSample(
        total=m["MemTotal"],
        available=m["MemAvailable"],
        slab=m.get("Slab", 0),
        sunreclaim=m.get("SUnreclaim", 0),
        shmem=m.get("Shmem", 0),
        percpu=m.get("Percpu", 0),
        kernel_stack=m.get("KernelStack", 0),
        page_tables=m.get("PageTables", 0),
    )


def cgroup_usage(subtree: str) -> int | None:
    """Bytes charged to the memory cgroup ``subtree`` (v1 or v2), None if absent."""
    for path in (
        _CGROUP / "memory" / subtree / "memory.usage_in_bytes",
        _CGROUP / subtree / "memory.current",
        _CGROUP / "unified" / subtree / "memory.current",
    ):
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text())
    return None


def rss_sum(pids: list[int]) -> int:
    """Proportional set size (bytes) of ``pids`` together; vanished pids count 0."""
    total = 0
    for pid in set(pids):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
    return total


def slabs(text: str | None = None) -> dict[str, int]:
    """Bytes in each slab cache (all objects of its slabs, active or not: what it pins), from
    /proc/slabinfo (root only: {} otherwise)."""
    if text is None:
        try:
            text = Path("/proc/slabinfo").read_text()
        except OSError:
            return {}
    out: dict[str, int] = {}
    for line in text.splitlines()[2:]:
        f = line.split()
        # name active_objs num_objs objsize objperslab pagesperslab : tunables ... : slabdata
        # active_slabs num_slabs sharedavail
        try:
            pages_per_slab, num_slabs = int(f[5]), int(f[-2])
        except (IndexError, ValueError):
            continue
        out[f[0]] = out.get(f[0], 0) + num_slabs * pages_per_slab * 4096
    return out


def slab_growth(
    before: dict[str, int], after: dict[str, int], per: int, top: int = 15
) -> dict[str, float]:
    """KiB per ``per`` (sandbox) by which each cache grew, the ``top`` biggest growers."""
    n = max(per, 1)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    best = sorted((k for k, v in grew.items() if v > 0), key=lambda k: -grew[k])[:top]
    return {k: round(grew[k] / n / 1024, 2) for k in best}
