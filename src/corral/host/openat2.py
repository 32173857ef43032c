"""openat2(2) through ctypes: path resolution that the kernel confines to a directory.

Python's ``os`` module has no openat2, and it is the only race-free way to resolve a path
chosen by an adversary (the guest) inside a directory tree the adversary can modify: the
kernel resolves every component, symlinks included, under one of the ``RESOLVE_*``
policies, so no symlink swapped in between check and use can lead elsewhere.

Example:
    >>> import os
    >>> root = os.open("/", os.O_PATH | os.O_DIRECTORY)
    >>> fd = openat2(root, "/etc/passwd", os.O_PATH, resolve=RESOLVE_IN_ROOT)
    >>> os.close(fd); os.close(root)
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = [
    "RESOLVE_NO_XDEV",
    "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_SYMLINKS",
    "RESOLVE_BENEATH",
    "RESOLVE_IN_ROOT",
    "RESOLVE_CACHED",
    "SYS_OPENAT2",
    "openat2",
]

RESOLVE_NO_XDEV = 0x01
"""Fail with EXDEV on crossing a mount point (including bind mounts and via symlinks)."""
RESOLVE_NO_MAGICLINKS = 0x02
"""Fail with ELOOP on procfs "magic links" such as /proc/<pid>/fd/<n> or /proc/<pid>/root."""
RESOLVE_NO_SYMLINKS = 0x04
"""Fail with ELOOP on any symlink, in any component (stronger than O_NOFOLLOW)."""
RESOLVE_BENEATH = 0x08
"""Fail with EXDEV if resolution would leave dirfd (absolute paths, symlinks, ``..``)."""
RESOLVE_IN_ROOT = 0x10
"""Treat dirfd as ``/``: absolute paths and symlinks and ``..`` are clamped inside it."""
RESOLVE_CACHED = 0x20
"""Only resolve from the dentry cache; EAGAIN otherwise."""

# openat2 came after the syscall-table unification (5.6), so every architecture that uses
# the generic numbering (x86_64, aarch64, riscv64, i386, arm...) has it at 437.
SYS_OPENAT2 = 437

# The kernel answers EAGAIN when a rename or mount raced with a ".." lookup under
# RESOLVE_IN_ROOT/RESOLVE_BENEATH and asks the caller to retry; a guest can provoke this
# on purpose, so we retry a bounded number of times and then report EAGAIN.
_EAGAIN_RETRIES = 64


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [
    ctypes.c_long,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.POINTER(_OpenHow),
    ctypes.c_size_t,
]


def openat2(dirfd: int, path: str | bytes, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """Open ``path`` relative to ``dirfd`` under the ``resolve`` policy; return a new fd.

    Like :func:`os.open`, the fd is always close-on-exec (O_CLOEXEC is added) and failures
    raise :class:`OSError` (or its errno subclass, e.g. FileNotFoundError) carrying
    ``errno`` and ``path``. ``mode`` must be 0 unless ``flags`` has O_CREAT or O_TMPFILE
    (the kernel rejects it with EINVAL otherwise). EINTR is retried; EAGAIN is retried a
    bounded number of times. ENOSYS means the kernel is older than 5.6.
    """
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ValueError("embedded null byte")
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    attempts = 0
    while True:
        fd = _syscall(SYS_OPENAT2, dirfd, raw, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err == errno.EAGAIN and attempts < _EAGAIN_RETRIES:
            attempts += 1
            continue
        raise OSError(err, os.strerror(err), os.fsdecode(raw))
