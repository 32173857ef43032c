"""Host uids that own sandbox user namespaces: one per live sandbox, never shared.

The kernel charges what a guest creates (inotify instances and watches, pending signals,
POSIX message queue bytes, processes) to its own uid inside the sandbox *and* to the owner
of each user namespace above it (kernel/ucount.c: the chain walks ``ns->ucounts``, the
owner's counters in the parent namespace, checked against the parent's per-user sysctl or
the creator's rlimit). With host root as the owner of every sandbox's namespace, one guest
could exhaust host root's allowance and with it every neighbour's. Each sandbox's
namespace is therefore created by a uid of its own from a range the node reserves
(:class:`OwnerUids`), outside the ids sandboxes map to.

A uid that owns a namespace has every capability inside it, so nothing else on the host
may run as one of these uids. Nodes on one host share the uid space: a uid is claimed
host-wide with an open-file-description lock on one byte (offset = uid) of one of
:data:`SHARDS` lock files (``LOCK_FILE.<uid % SHARDS>``), released by :meth:`OwnerUids.release` or when the node process exits,
so two nodes never hand out the same owner at the same time. After a restart the node
re-claims the owners of the sandboxes it adopts (:func:`namespace_owner` reads them
back from the kernel), so no database column is needed.

Example::

    owners = OwnerUids(first=165536, count=65536)
    uid = owners.allocate()          # e.g. 171234, locked host-wide
    ...                              # the sandbox's namespace is created as that uid
    owners.release(uid)              # at destroy
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import struct
import threading
from pathlib import Path

from corral.errors import CapacityError, HostError

__all__ = ["LOCK_FILE", "OwnerUids", "namespace_owner"]

LOCK_FILE = Path("/run/corral-userns-owners.lock")
"""Host-wide: one locked byte per owner uid in use by any corral node on this host, in the
shard ``LOCK_FILE.<uid % SHARDS>``."""
SHARDS = 64
"""Lock files the uids are spread over (a node opens all of them at start). The kernel
keeps a file's POSIX locks in one list that every lock and unlock walks, and random uids'
bytes do not coalesce: with one file, a create's lock cost grew with the live count (``posix_lock_inode``, 0.14 -> 0.36 ms of
CPU per create from 200 to 800 live sandboxes; perf, tools/profile_scale.py)."""

_F_OFD_SETLK = 37
_NS_GET_OWNER_UID = 0xB704


def _flock(kind: int, start: int) -> bytes:
    # struct flock: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0)


class OwnerUids:
    """Allocator of owner uids ``first .. first+count-1``, claimed host-wide (thread-safe)."""

    def __init__(self, first: int, count: int, lock_file: Path = LOCK_FILE) -> None:
        if first <= 0 or count <= 0 or first + count > 2**32 - 2:
            raise HostError(f"owner uids: bad range first={first} count={count}")
        self.first = first
        self.count = count
        self._held: set[int] = set()
        self._lock = threading.Lock()
        self._lock_file = lock_file
        self._fds: dict[int, int] = {}  # shard -> fd
        try:
            for shard in range(SHARDS):  # all at start: a node's fd count stays flat after
                self._shard_fd(shard)
        except HostError:
            self.close()
            raise

    def _shard_fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is None:  # only at start, or after close
            path = f"{self._lock_file}.{shard}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise HostError(f"owner uids: cannot open {path}: {e.strerror}") from None
            self._fds[shard] = fd
        return fd

    def _set(self, kind: int, uid: int) -> None:
        fcntl.fcntl(self._shard_fd(uid % SHARDS), _F_OFD_SETLK, _flock(kind, uid))

    def _try(self, uid: int) -> bool:
        try:
            self._set(fcntl.F_WRLCK, uid)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False  # another node holds it
            raise HostError(f"owner uids: locking uid {uid}: {e.strerror}") from None
        return True

    def allocate(self) -> int:
        """A uid no sandbox on this host owns now. Starts at a random point of the range, so
        a just-released uid (whose namespace the kernel may still be freeing) is rarely
        handed out again soon. CapacityError when the whole range is in use."""
        with self._lock:
            start = secrets.randbelow(self.count)
            for i in range(self.count):
                uid = self.first + (start + i) % self.count
                if uid not in self._held and self._try(uid):
                    self._held.add(uid)
                    return uid
        raise CapacityError(
            f"all {self.count} user namespace owner uids ({self.first}..."
            f"{self.first + self.count - 1}) are in use on this host"
        )

    def claim(self, uid: int) -> bool:
        """Re-claim the owner of an adopted sandbox; False if another node holds it now
        (then the two sandboxes share that owner's budget until one is destroyed)."""
        if not self.first <= uid < self.first + self.count:
            return False
        with self._lock:
            if uid in self._held:
                return True
            if not self._try(uid):
                return False
            self._held.add(uid)
            return True

    def release(self, uid: int) -> None:
        """Give ``uid`` back (a uid not held is ignored)."""
        with self._lock:
            if uid not in self._held:
                return
            self._held.discard(uid)
            self._set(fcntl.F_UNLCK, uid)

    def held(self) -> set[int]:
        with self._lock:
            return set(self._held)

    def close(self) -> None:
        """Release every claim (closing the file descriptions drops their locks)."""
        with self._lock:
            self._held.clear()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def namespace_owner(pid: int) -> int | None:
    """Host uid owning the user namespace of process ``pid``, or None if it is gone."""
    try:
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = fcntl.ioctl(fd, _NS_GET_OWNER_UID, b"\0" * 4)
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(struct.unpack("I", raw)[0])
