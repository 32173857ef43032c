"""inotify through ctypes: one instance, watches added by path, events parsed.

The kernel makes every event from a real change of a watched directory: a guest can
cause events only by changing its own files, never forge one, and never one for a
directory of another sandbox (each watch is on an inode of that sandbox's root).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterator
from typing import NamedTuple

from corral.errors import CapacityError

__all__ = [
    "IN_ATTRIB", "IN_CREATE", "IN_DELETE", "IN_DELETE_SELF", "IN_IGNORED", "IN_ISDIR",
    "IN_MODIFY", "IN_MOVED_FROM", "IN_MOVED_TO", "IN_MOVE_SELF", "IN_ONLYDIR",
    "IN_Q_OVERFLOW", "Event", "add_watch", "init", "parse", "rm_watch",
]  # fmt: skip

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_HEAD = struct.Struct("iIII")

_libc = ctypes.CDLL(None, use_errno=True)


class Event(NamedTuple):
    wd: int
    mask: int
    cookie: int
    name: str


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, errno.EMFILE):
            raise CapacityError(f"{what}: the node's inotify limit is reached ({os.strerror(err)})")
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def init() -> int:
    """A non-blocking, close-on-exec inotify fd."""
    return _check(_libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC), "inotify_init1")


def add_watch(fd: int, path: str, mask: int) -> int:
    """Watch ``path`` (follows it: pass ``/proc/self/fd/N`` of an O_PATH fd)."""
    return _check(_libc.inotify_add_watch(fd, os.fsencode(path), mask), "inotify_add_watch")


def rm_watch(fd: int, wd: int) -> None:
    """Remove a watch; one the kernel dropped already (IN_IGNORED) is no error."""
    if _libc.inotify_rm_watch(fd, wd) < 0 and ctypes.get_errno() != errno.EINVAL:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def parse(buf: bytes) -> Iterator[Event]:
    """The events in one ``read`` of an inotify fd."""
    i = 0
    while i + _HEAD.size <= len(buf):
        wd, mask, cookie, n = _HEAD.unpack_from(buf, i)
        raw = buf[i + _HEAD.size : i + _HEAD.size + n]
        yield Event(wd, mask, cookie, os.fsdecode(raw.split(b"\0", 1)[0]))
        i += _HEAD.size + n
