"""Host figures for the metrics' scrape-time gauges: memory, swap, scratch, CPU, and how
much of the mounted layer files sits in the page cache.

Read only when Prometheus (or ``corral top``) asks, never on an operation's path. The
page cache figure uses ``cachestat(2)`` (Linux 6.5+): one syscall per layer file, no
mapping of the file; on an older kernel it is left out (None), not guessed.

Example:
    >>> sampler = HostSampler()
    >>> g = sampler.sample(live=[], capacity=4096, scratch_dir=None, layer_files=[])
    >>> g.mem_total > 0
    True
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from pathlib import Path

import psutil

from corral.node.metrics import NodeGauges
from corral.spec import SandboxInfo

__all__ = ["HostSampler", "page_cache_bytes"]

_SYS_CACHESTAT = 451  # x86_64 and the generic table alike


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def page_cache_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache (None: the kernel has no cachestat)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        rng = _CachestatRange(0, 0)  # len 0: to the end of the file
        out = _Cachestat()
        # Safe: cachestat only reads page cache counters of a file we opened read-only.
        rc = _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0)
        if rc != 0:
            return None
        return int(out.nr_cache) * _PAGE
    finally:
        os.close(fd)


class HostSampler:
    """Fills :class:`NodeGauges`; keeps the previous CPU times for a busy fraction."""

    def __init__(self) -> None:
        self._cpu_last: tuple[float, float] | None = None
        self._cachestat = True

    def sample(
        self,
        live: Iterable[SandboxInfo],
        *,
        capacity: int | None,
        scratch_dir: Path | None,
        layer_files: Iterable[Path],
        backend_of: str = "container",
    ) -> NodeGauges:
        g = NodeGauges(capacity=capacity)
        for info in live:
            key = (info.state, backend_of, info.spec.qos)
            g.sandboxes[key] = g.sandboxes.get(key, 0) + 1
        vm = psutil.virtual_memory()
        sw = psutil.swap_memory()
        g.mem_total, g.mem_available = vm.total, vm.available
        g.swap_total, g.swap_used = sw.total, sw.used
        if scratch_dir is not None:
            try:
                st = os.statvfs(scratch_dir)
                g.scratch_total = st.f_blocks * st.f_frsize
                g.scratch_used = (st.f_blocks - st.f_bfree) * st.f_frsize
            except OSError:
                pass
        g.cpu_count = os.cpu_count()
        g.load1 = os.getloadavg()[0]
        g.cpu_busy = self._busy()
        files = list(layer_files)
        g.layer_mounts = len(files)
        if self._cachestat:
            total = 0
            for f in files:
                n = page_cache_bytes(f)
                if n is None:
                    self._cachestat = False
                    break
                total += n
            else:
                g.layer_page_cache = total
        return g

    def _busy(self) -> float | None:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        total = sum(t)
        last, self._cpu_last = self._cpu_last, (idle, total)
        if last is None or total <= last[1]:
            return None
        return max(0.0, min(1.0, 1.0 - (idle - last[0]) / (total - last[1])))
