"""Prefetch of another process's memory: ``process_madvise(MADV_WILLNEED)`` over its mappings.

For each mapping listed in /proc/PID/maps the kernel starts a read of what is not in RAM:
anonymous pages (and shmem/memfd pages) that sit in swap are read into the swap cache
(swap-in readahead), file pages get page-cache readahead. Nothing is mapped into the
process: its next touch of a page is a minor fault instead of a swap-in from disk. The
reads are submitted, not waited for; the memory cgroup is charged for each page as it is
allocated, so the cgroup's swap figure drops while the call runs (cgroup v1 uncharges the
swap slot at once; on v2 ``memory.swap.current`` keeps the slot until it is freed).

Ranges are sent to the kernel in batches of at most :data:`IOV_MAX` iovecs and under the
kernel's per-call byte cap (it truncates a longer vector silently). A range the kernel
refuses (EINVAL, ENOMEM for a range unmapped meanwhile, EFAULT) is recorded and skipped;
a process that exits (ESRCH) ends only its own advice.

Needs CAP_SYS_NICE (and ptrace-read access to the target) for another process; advising
one's own process needs nothing.

Example::

    adv = willneed(pid)             # Advice(processes=1, ranges=31, bytes=..., errors=[])
    adv = willneed_all([p1, p2])    # the sum over several processes
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from corral.host._sys import errtext

__all__ = [
    "IOV_MAX",
    "MADV_WILLNEED",
    "Mapping",
    "RangeError",
    "Advice",
    "parse_maps",
    "batches",
    "advise",
    "willneed",
    "willneed_all",
]

IOV_MAX = 1024
"""Most iovecs one process_madvise call takes (UIO_MAXIOV)."""
MADV_WILLNEED = 3
MAX_CALL_BYTES = 1 << 30
"""Bytes per call: the kernel caps an iovec array at MAX_RW_COUNT (2 GiB - 1 page) and
cuts the rest off without an error, so larger ranges are split and batches kept under."""
# Generic syscall numbering (pidfd_open came in 5.3, process_madvise in 5.10), so the
# same on x86_64 and aarch64.
SYS_PROCESS_MADVISE = 440

_SPECIAL = frozenset({"[vvar]", "[vvar_vclock]", "[vsyscall]", "[vdso]", "[uprobes]"})
"""Kernel-provided mappings: nothing there to read (the vsyscall page is outside the user
address range and only fails)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall  # a private handle: argtypes set here must not leak into others
_syscall.restype = ctypes.c_long


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str
    path: str
    """The file, ``""`` for anonymous memory, or a name such as ``[heap]``/``[stack]``."""

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def anonymous(self) -> bool:
        return not self.path or self.path.startswith("[")


@dataclass(frozen=True)
class RangeError:
    """A range the kernel refused (or a process that was gone)."""

    pid: int
    start: int
    end: int
    errno: int

    def __str__(self) -> str:
        return f"pid {self.pid} {self.start:x}-{self.end:x}: {errtext(self.errno)}"


@dataclass
class Advice:
    """What was advised: processes reached, ranges and bytes the kernel accepted (split
    into anonymous and file-backed), and the ranges it refused."""

    processes: int = 0
    ranges: int = 0
    bytes: int = 0
    anon_bytes: int = 0
    file_bytes: int = 0
    errors: list[RangeError] = field(default_factory=list)

    def add(self, other: Advice) -> Advice:
        self.processes += other.processes
        self.ranges += other.ranges
        self.bytes += other.bytes
        self.anon_bytes += other.anon_bytes
        self.file_bytes += other.file_bytes
        self.errors.extend(other.errors)
        return self


def parse_maps(text: str) -> list[Mapping]:
    """The mappings worth advising from the text of /proc/PID/maps: all but the kernel's
    special ones and inaccessible (``---``) reservations and guard pages, which the process
    cannot touch without an mprotect first."""
    out: list[Mapping] = []
    for line in text.splitlines():
        parts = line.split(None, 5)  # the path may contain spaces ("... (deleted)")
        if len(parts) < 5 or "-" not in parts[0]:
            continue
        lo, hi = parts[0].split("-", 1)
        path = parts[5].strip() if len(parts) > 5 else ""
        perms = parts[1]
        if path in _SPECIAL or perms[:3] == "---":
            continue
        m = Mapping(int(lo, 16), int(hi, 16), perms, path)
        if m.size > 0:
            out.append(m)
    return out


def _split(mappings: Iterable[Mapping], most: int) -> Iterator[Mapping]:
    for m in mappings:
        start = m.start
        while m.end - start > most:
            yield Mapping(start, start + most, m.perms, m.path)
            start += most
        yield Mapping(start, m.end, m.perms, m.path) if start != m.start else m


def batches(
    mappings: Iterable[Mapping], most: int = IOV_MAX, most_bytes: int = MAX_CALL_BYTES
) -> list[list[Mapping]]:
    """Group ``mappings`` into calls of at most ``most`` ranges and ``most_bytes`` bytes
    (a range larger than ``most_bytes`` is split into pieces)."""
    out: list[list[Mapping]] = []
    cur: list[Mapping] = []
    size = 0
    for m in _split(mappings, most_bytes):
        if cur and (len(cur) >= most or size + m.size > most_bytes):
            out.append(cur)
            cur, size = [], 0
        cur.append(m)
        size += m.size
    if cur:
        out.append(cur)
    return out


def _process_madvise(pidfd: int, ranges: Sequence[Mapping]) -> int:
    """Bytes advised, or -errno when the first range failed."""
    iov = (_Iovec * len(ranges))(*[_Iovec(m.start, m.size) for m in ranges])
    while True:
        r = _syscall(
            ctypes.c_long(SYS_PROCESS_MADVISE),
            ctypes.c_int(pidfd),
            iov,
            ctypes.c_size_t(len(ranges)),
            ctypes.c_int(MADV_WILLNEED),
            ctypes.c_uint(0),
        )
        if r >= 0:
            return int(r)
        err = ctypes.get_errno()
        if err != errno.EINTR:
            return -err


def advise(
    pidfd: int,
    mappings: Sequence[Mapping],
    pid: int = 0,
    most: int = IOV_MAX,
    most_bytes: int = MAX_CALL_BYTES,
) -> Advice:
    """MADV_WILLNEED over ``mappings`` of the process behind ``pidfd`` (``pid`` only names
    it in errors). The kernel stops a call at the first range it refuses and returns the
    bytes done before it (or the error, if none): that range is recorded and skipped and the
    call goes on from the next one; ESRCH (the process is gone) ends the advice."""
    adv = Advice(processes=1)
    for batch in batches(mappings, most, most_bytes):
        todo = list(batch)
        while todo:
            n = _process_madvise(pidfd, todo)
            if n <= 0:
                err = -n if n < 0 else errno.EIO  # 0 bytes without an error: never loop
                first = todo.pop(0)
                adv.errors.append(RangeError(pid, first.start, first.end, err))
                if err == errno.ESRCH:
                    return adv
                continue
            while todo and n > 0:  # consume what the kernel says it did
                m = todo[0]
                done = min(n, m.size)
                n -= done
                adv.bytes += done
                if m.anonymous:
                    adv.anon_bytes += done
                else:
                    adv.file_bytes += done
                if done == m.size:
                    adv.ranges += 1
                    todo.pop(0)
                else:  # cut short (should not happen under the byte cap): go on from there
                    todo[0] = Mapping(m.start + done, m.end, m.perms, m.path)
    return adv


def willneed(pid: int) -> Advice:
    """Start the read-back of everything ``pid`` has mapped (see the module docstring)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return Advice(errors=[RangeError(pid, 0, 0, errno.ESRCH)])
    try:
        # The pidfd pins the process we mean; if the pid was reused after it exited, the
        # maps read here are another process's, and the advice (by pidfd) fails with ESRCH.
        try:
            with open(f"/proc/{pid}/maps") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):
            return Advice(errors=[RangeError(pid, 0, 0, errno.ESRCH)])
        return advise(pidfd, parse_maps(text), pid)
    finally:
        os.close(pidfd)


def willneed_all(pids: Iterable[int]) -> Advice:
    """:func:`willneed` for each of ``pids``, summed."""
    total = Advice()
    for pid in pids:
        total.add(willneed(pid))
    return total
