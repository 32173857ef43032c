"""A loop-backed btrfs scratch filesystem: one subvolume with a qgroup limit per sandbox.

Writable layers (overlay upper + work dirs) live in subvolumes, so a sandbox's disk use is
capped by a qgroup limit (XFS/ext4 project quotas are not in the kernels we run on), a
sandbox's writes are deleted in one call, and forking a sandbox is a snapshot (~10 ms).
Everything on the hot path is an ioctl; ``mkfs.btrfs`` runs once per node.

Metadata reservations and EDQUOT (measured 2026-12-02, kernel 6.18, simple quotas):
every transaction handle reserves ``items x nodesize`` against its subvolume's qgroup
(a ``renameat2(RENAME_EXCHANGE)`` 15 x 16 KiB = 240 KiB) and keeps it until the next
transaction commit, while the guest stores nothing. When the reservations reach the
limit the kernel commits and retries once; that retry loses a race when another writer
in the same subvolume commits meanwhile, and the guest gets EDQUOT at a few KiB used.
With a 16 MiB limit, an exchange loop alone ran 617k renames in 20 s (~470 commits/s,
no error), but beside a second writer of small files it got EDQUOT within 0.2-2 s; so
did the node's own writes into that sandbox. A shorter commit interval does not help
(``commit=1``/``commit=5``: EDQUOT within 0.05/0.7 s): the reservations outrun any
interval, and the flush commits far more often anyway. What helps is fewer exhaustions:

* 4 KiB metadata nodes (:data:`_NODESIZE`): reservations are 4x smaller; the same host
  loop beside a writer then ran ~10 s at 16 MiB before an EDQUOT, and 20 s at 64 MiB
  without one.
* A metadata allowance on top of the quota (:func:`qgroup_limit`): with 4 KiB nodes,
  a sandbox of 16 MiB disk, its exchange loop beside two threads of node file writes
  for 20 s, hit EDQUOT in 2 of 2 runs at +0, 1 of 2 at +64 MiB, none at +128 MiB (1 run) and +256 MiB
  (2 runs; ~1 commit/s). The allowance is also what stored bytes may exceed
  ``Limits.disk`` by, so it is a quarter of the quota, at least 64 MiB, at most 1 GiB:
  the guaranteed room stays ``Limits.disk`` and the overshoot stays small next to a
  scratch filesystem of tens of GiB.

The race itself is the kernel's and stays: a guest churning metadata at its limit, beside
another writer, can still see a spurious EDQUOT, only far less often. The node reports
EDQUOT from its own file operations as ``QuotaExceeded`` (HTTP 507), never as a refused
path.

Example::

    scratch = Scratch(Path("/var/lib/corral/scratch.img"), Path("/run/corral/scratch"), 64 << 30)
    scratch.setup()
    sub = scratch.create_subvol("sb-1234", quota=10 << 20)   # ~1 ms
    (sub / "upper").mkdir(); (sub / "work").mkdir()
    ...
    scratch.delete_subvol("sb-1234")
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import subprocess
import time
import uuid
from pathlib import Path

from corral.errors import HostError
from corral.host import _sys, loop
from corral.host._sys import errtext
from corral.host.mounts import is_mountpoint, umount

__all__ = ["Scratch", "qgroup_limit", "METADATA_ALLOWANCE_MIN", "METADATA_ALLOWANCE_MAX"]

METADATA_ALLOWANCE_MIN = 64 << 20
METADATA_ALLOWANCE_MAX = 1 << 30


def qgroup_limit(quota: int) -> int:
    """The qgroup limit behind a disk quota of ``quota`` bytes: the quota plus a metadata
    allowance of a quarter of it, at least 64 MiB and at most 1 GiB.

    The allowance is room for the metadata reservations that btrfs holds against the
    qgroup until the next transaction commit (see the module docstring): without it a
    guest that renames or creates files quickly exhausts its quota's room again and again
    while storing almost nothing, and each exhaustion is a chance to get a spurious
    EDQUOT. The price: stored bytes may exceed ``quota`` by up to the allowance.
    """
    allowance = min(max(quota // 4, METADATA_ALLOWANCE_MIN), METADATA_ALLOWANCE_MAX)
    return quota + allowance


def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (0x94 << 8) | nr


def _ior(nr: int, size: int) -> int:
    return (2 << 30) | (size << 16) | (0x94 << 8) | nr


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (0x94 << 8) | nr


_VOL_ARGS = 4096
_IOC_SYNC = (0x94 << 8) | 8
_IOC_SNAP_DESTROY = _iow(15, _VOL_ARGS)
_IOC_SUBVOL_CREATE = _iow(14, _VOL_ARGS)
_IOC_SNAP_CREATE_V2 = _iow(23, _VOL_ARGS)
_IOC_INO_LOOKUP = _iowr(18, 4096)
_IOC_FS_INFO = _ior(31, 1024)
_IOC_QUOTA_CTL = _iowr(40, 16)
_IOC_QGROUP_CREATE = _iow(42, 16)
_IOC_QGROUP_LIMIT = _ior(43, 48)
_IOC_SUBVOL_SYNC_WAIT = _iow(65, 16)  # struct btrfs_ioctl_subvol_wait (Linux 6.13+)
_SUBVOL_SYNC_COUNT = 2
_QUOTA_CTL_ENABLE = 1
_QUOTA_CTL_ENABLE_SIMPLE = 4
_QGROUP_LIMIT_MAX_RFER = 1
_QGROUP_LIMIT_MAX_EXCL = 2
_NODESIZE = 4096
"""Metadata block size of a new scratch filesystem (mkfs.btrfs -n; its default is 16 KiB).
Every transaction handle reserves ``items x nodesize`` of qgroup space until the next
commit, so 4 KiB nodes make a metadata-heavy guest exhaust its quota's room 4x less often
(see the module docstring)."""
_FIRST_FREE_OBJECTID = 256  # inode number of every subvolume's root directory
_BTRFS_MAGIC = 0x9123683E


class _VolArgs(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int64), ("name", ctypes.c_char * 4088)]


class _VolArgsV2(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_int64),
        ("transid", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 4),
        ("name", ctypes.c_char * 4040),
    ]


class _QgroupLimit(ctypes.Structure):
    _fields_ = [
        ("qgroupid", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("max_rfer", ctypes.c_uint64),
        ("max_excl", ctypes.c_uint64),
        ("rsv_rfer", ctypes.c_uint64),
        ("rsv_excl", ctypes.c_uint64),
    ]


def _check_name(name: str) -> bytes:
    raw = os.fsencode(name)
    if not raw or raw in (b".", b"..") or b"/" in raw or b"\0" in raw or len(raw) > 255:
        raise HostError(f"btrfs: bad subvolume name {name!r}")
    return raw


class Scratch:
    """A btrfs filesystem in a sparse image file, mounted through an autoclear loop device.

    ``quota_mode`` after :meth:`setup` is ``"simple"`` (squota, kernel 6.7+: cheap,
    accounts each extent to the subvolume that wrote it) or ``"full"`` (classic qgroups).
    """

    def __init__(self, image: Path, mountpoint: Path, size: int) -> None:
        self.image = Path(image)
        self.mountpoint = Path(mountpoint)
        self.size = size
        self.quota_mode: str | None = None
        self._dirfd = -1
        self._fsid: str | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def setup(self) -> None:
        """Create the image (sparse) and filesystem if new, mount it, enable quotas.

        Idempotent: a mountpoint that already holds this btrfs is adopted.
        """
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        if not is_mountpoint(self.mountpoint):
            self._format_if_new()
            self._mount()
        elif not self._is_btrfs():
            raise HostError(f"btrfs scratch: {self.mountpoint} is mounted but not btrfs")
        if self._dirfd >= 0:
            os.close(self._dirfd)
        self._dirfd = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._enable_quota()
        self._fsid = self._read_fsid()

    def _is_btrfs(self) -> bool:
        try:
            return _sys.fs_type(self.mountpoint) == _BTRFS_MAGIC
        except OSError:
            return False

    def _format_if_new(self) -> None:
        if self.image.exists():
            return
        self.image.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.image.with_name(self.image.name + ".new")
        with open(tmp, "wb") as f:
            f.truncate(self.size)  # sparse: costs no disk until written
        proc = subprocess.run(
            [
                "mkfs.btrfs",
                "-q",
                "-f",
                "-m",
                "single",
                "-d",
                "single",
                "-n",
                str(_NODESIZE),
                str(tmp),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise HostError(f"mkfs.btrfs {tmp} failed: {proc.stderr.strip()}")
        tmp.rename(self.image)

    def _mount(self) -> None:
        img = Path(os.path.realpath(self.image))
        live = [d for d, f in loop.backed_by(img.parent).items() if f == img]
        if live:
            # This filesystem is still alive on a loop device: an earlier mount was detached
            # while something (a sandbox's overlay) still holds it. A second loop device on
            # the same file would be a second, independent btrfs (kernel 6.7+ mounts such a
            # clone under a temporary fsid) writing the same blocks: seen here corrupting
            # the scratch filesystem. Mounting that device again gives the live one back.
            self._mount_dev(live[0])
            return
        dev = loop.attach(self.image)
        try:
            self._mount_dev(dev.path)
        finally:
            dev.close()  # autoclear: the unmount now frees the loop device

    def _mount_dev(self, dev_path: Path) -> None:
        try:
            # Safe: a filesystem corral formatted, in a file corral owns, mounted at
            # corral's scratch dir; nosuid/nodev because sandboxes write into it.
            _sys.mount(
                dev_path,
                self.mountpoint,
                "btrfs",
                _sys.MS_NOSUID | _sys.MS_NODEV | _sys.MS_NOATIME,
            )
        except OSError as e:
            raise HostError(
                f"mount btrfs {self.image} ({dev_path}) at {self.mountpoint}: "
                f"{errtext(e.errno or 0)}"
            ) from None

    def _enable_quota(self) -> None:
        for cmd, mode in ((_QUOTA_CTL_ENABLE_SIMPLE, "simple"), (_QUOTA_CTL_ENABLE, "full")):
            args = (ctypes.c_uint64 * 2)(cmd, 0)
            try:
                # Safe: turns on accounting in corral's own scratch filesystem.
                fcntl.ioctl(self._dirfd, _IOC_QUOTA_CTL, args)
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                    continue  # kernel without squota: fall back to full qgroups
                raise HostError(
                    f"btrfs quota enable on {self.mountpoint}: {errtext(e.errno or 0)}"
                ) from None
            self.quota_mode = mode
            return
        raise HostError(f"btrfs quota enable on {self.mountpoint}: not supported")

    def _read_fsid(self) -> str:
        buf = bytearray(1024)
        fcntl.ioctl(self._dirfd, _IOC_FS_INFO, buf)
        return str(uuid.UUID(bytes=bytes(buf[16:32])))

    def close(self) -> None:
        """Let go of the filesystem without unmounting it (sandboxes still use it)."""
        if self._dirfd >= 0:
            os.close(self._dirfd)
            self._dirfd = -1

    def teardown(self, delete_image: bool = False) -> None:
        """Unmount (the autoclear loop device goes with it); optionally delete the image."""
        self.close()
        umount(self.mountpoint, busy_wait=5.0)
        # The kernel frees an autoclear loop device asynchronously after the last unmount;
        # wait for it so that callers (and leak checks) see a clean host when we return.
        deadline = time.monotonic() + 5
        while loop.backed_by(self.image) and time.monotonic() < deadline:
            time.sleep(0.01)
        if delete_image:
            self.image.unlink(missing_ok=True)

    # -- subvolumes --------------------------------------------------------------------

    def _fd(self) -> int:
        if self._dirfd < 0:
            raise HostError(f"btrfs scratch {self.mountpoint}: setup() was not called")
        return self._dirfd

    def create_subvol(self, name: str, quota: int | None) -> Path:
        """Create subvolume ``name`` with a referenced-bytes limit of ``quota`` (None: none)."""
        args = _VolArgs(0, _check_name(name))
        try:
            # Safe: creates an empty subvolume inside corral's scratch filesystem.
            fcntl.ioctl(self._fd(), _IOC_SUBVOL_CREATE, args)
        except OSError as e:
            raise HostError(
                f"btrfs subvolume create {self.mountpoint / name}: {errtext(e.errno or 0)}"
            ) from None
        path = self.mountpoint / name
        if quota is not None:
            try:
                self.set_quota(name, quota)
            except HostError:
                self.delete_subvol(name)
                raise
        return path

    def set_quota(self, name: str, quota: int | None, exclusive_only: bool = False) -> None:
        """Set (or with None clear) the limit on subvolume ``name``'s qgroup 0/<id>.

        The kernel limit is :func:`qgroup_limit` (``quota`` plus a metadata allowance).
        ``exclusive_only``: limit only exclusive bytes (for a snapshot under full qgroups,
        whose referenced bytes include everything it shares with its source).
        """
        lim = _QgroupLimit()
        lim.qgroupid = 0  # 0 = the qgroup of the subvolume the fd is in
        if quota is not None:
            lim.flags = _QGROUP_LIMIT_MAX_EXCL | (0 if exclusive_only else _QGROUP_LIMIT_MAX_RFER)
            lim.max_rfer = lim.max_excl = qgroup_limit(quota)
        else:
            lim.flags = _QGROUP_LIMIT_MAX_RFER | _QGROUP_LIMIT_MAX_EXCL
            lim.max_rfer = lim.max_excl = 2**64 - 1  # the kernel's "no limit"
        fd = self._open(name)
        try:
            # Safe: limits only the qgroup of a subvolume corral created.
            fcntl.ioctl(fd, _IOC_QGROUP_LIMIT, lim)
        except OSError as e:
            raise HostError(
                f"btrfs qgroup limit {quota} on {self.mountpoint / name}: {errtext(e.errno or 0)}"
            ) from None
        finally:
            os.close(fd)

    def _open(self, name: str) -> int:
        try:
            return os.open(
                _check_name(name),
                os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW,
                dir_fd=self._fd(),
            )
        except FileNotFoundError:
            raise HostError(f"btrfs: no subvolume {self.mountpoint / name}") from None

    def subvol_id(self, name: str) -> int:
        """The subvolume's tree id (its qgroup is 0/<id>)."""
        fd = self._open(name)
        try:
            buf = bytearray(4096)
            buf[8:16] = _FIRST_FREE_OBJECTID.to_bytes(8, "little")
            fcntl.ioctl(fd, _IOC_INO_LOOKUP, buf)
            return int.from_bytes(buf[0:8], "little")
        except OSError as e:
            raise HostError(f"btrfs: {self.mountpoint / name} is not a subvolume: {e}") from None
        finally:
            os.close(fd)

    def delete_subvol(self, name: str) -> None:
        """Delete subvolume ``name`` with everything in it; missing is not an error."""
        try:
            sub_id = self.subvol_id(name)
        except HostError:
            if not (self.mountpoint / name).exists():
                return
            raise
        args = _VolArgs(0, _check_name(name))
        try:
            # Safe: removes a subvolume of corral's scratch filesystem by name, relative
            # to its root fd (no path walk a sandbox could redirect).
            fcntl.ioctl(self._fd(), _IOC_SNAP_DESTROY, args)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return
            raise HostError(
                f"btrfs subvolume delete {self.mountpoint / name}: {errtext(e.errno or 0)}"
            ) from None
        self._remove_qgroup(sub_id)

    def _remove_qgroup(self, sub_id: int) -> bool:
        args = (ctypes.c_uint64 * 2)(0, sub_id)  # create=0: remove qgroup 0/<id>
        try:
            # Safe: drops the accounting record of a subvolume that no longer exists.
            fcntl.ioctl(self._fd(), _IOC_QGROUP_CREATE, args)
        except OSError as e:
            # ENOENT: the kernel already removed it; EBUSY: the cleaner has not dropped
            # the subvolume yet, after which the kernel removes the qgroup itself.
            if e.errno in (errno.ENOENT, errno.EBUSY, errno.EINVAL):
                return False
            raise HostError(f"btrfs qgroup remove 0/{sub_id}: {errtext(e.errno or 0)}") from None
        return True

    def remove_stale_qgroups(self) -> int:
        """Remove qgroups 0/<id> whose subvolume is gone (for gc); returns how many.

        The kernel removes a deleted subvolume's qgroup itself once the cleaner has
        dropped it (see :meth:`sync`); this catches any left by older kernels.
        """
        self.sync()
        live = {5} | {self.subvol_id(n) for n in self.subvols()}
        removed = 0
        for qid in self._qgroup_ids():
            if qid not in live and self._remove_qgroup(qid):
                removed += 1
        return removed

    def _qgroup_ids(self) -> list[int]:
        base = Path("/sys/fs/btrfs") / str(self._fsid) / "qgroups"
        ids = []
        for entry in base.glob("0_*"):
            ids.append(int(entry.name[2:]))
        return ids

    def snapshot(self, src: str, dst: str, quota: int | None) -> Path:
        """Writable snapshot of subvolume ``src`` as ``dst`` (for forking a sandbox), ~2 ms.

        ``quota`` limits what ``dst`` writes from now on. Under simple quotas a snapshot
        starts at 0 bytes (each extent stays charged to the subvolume that wrote it);
        under full qgroups it is charged at once for everything it shares with ``src``
        as referenced bytes, so there only its exclusive bytes are limited.
        """
        src_fd = self._open(src)
        try:
            args = _VolArgsV2()
            args.fd = src_fd
            args.name = _check_name(dst)
            try:
                # Safe: a copy-on-write snapshot inside corral's scratch filesystem.
                fcntl.ioctl(self._fd(), _IOC_SNAP_CREATE_V2, args)
            except OSError as e:
                raise HostError(
                    f"btrfs snapshot {self.mountpoint / src} -> {dst}: {errtext(e.errno or 0)}"
                ) from None
        finally:
            os.close(src_fd)
        if quota is not None:
            try:
                self.set_quota(dst, quota, exclusive_only=self.quota_mode == "full")
            except HostError:
                self.delete_subvol(dst)
                raise
        return self.mountpoint / dst

    def usage(self, name: str) -> int:
        """Bytes charged to subvolume ``name``'s qgroup (as of the last transaction commit)."""
        sub_id = self.subvol_id(name)
        path = f"/sys/fs/btrfs/{self._fsid}/qgroups/0_{sub_id}/referenced"  # one string: per exec
        try:
            return int(_sys.read_small(path))
        except OSError as e:
            raise HostError(f"btrfs usage of {name}: cannot read {path}: {e}") from None

    def sync(self) -> None:
        """Commit the current transaction, so :meth:`usage` is up to date.

        BTRFS_IOC_SYNC (unlike syncfs) also wakes the cleaner, which drops deleted
        subvolumes (freeing their space, and their qgroups) within milliseconds instead
        of at the next 30 s commit.
        """
        try:
            fcntl.ioctl(self._fd(), _IOC_SYNC)
        except OSError as e:
            raise HostError(f"btrfs sync {self.mountpoint}: {errtext(e.errno or 0)}") from None

    def pending_cleanup(self) -> int | None:
        """Deleted subvolumes the cleaner has not dropped yet (None: the kernel cannot say).

        A deleted subvolume goes from the tree at once, but the cleaner frees its blocks
        later, at a commit, and what is still queued when the filesystem is unmounted is
        dropped after the next mount: a node's destroys cost CPU after they return, and a
        node that starts after a busy one pays for what that one deleted.
        """
        buf = bytearray(struct.pack("=QII", 0, _SUBVOL_SYNC_COUNT, 0))
        try:
            # Safe: a read-only query of the scratch filesystem's cleaner queue.
            fcntl.ioctl(self._fd(), _IOC_SUBVOL_SYNC_WAIT, buf)
        except OSError as e:
            if e.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                return None
            raise HostError(
                f"btrfs cleaner queue of {self.mountpoint}: {errtext(e.errno or 0)}"
            ) from None
        return int(struct.unpack("=QII", buf)[2])

    def wait_cleaned(self, timeout: float) -> bool:
        """Wake the cleaner and wait until it has dropped every deleted subvolume (see
        :meth:`pending_cleanup`); False if some are left after ``timeout`` seconds. For
        benches that time creates: the cleaner's work for an earlier run's destroys would
        otherwise land in their figures (here 236 queued took 0.41 s to drop)."""
        deadline = time.monotonic() + timeout
        self.sync()
        while (left := self.pending_cleanup()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the ioctl's own wait modes block with no timeout
        return not left

    def subvols(self) -> list[str]:
        """Names of the subvolumes directly under the mountpoint."""
        names = []
        with os.scandir(self.mountpoint) as it:
            for entry in it:
                # readdir reports a subvolume's id as d_ino; its root inode is 256.
                if (
                    entry.is_dir(follow_symlinks=False)
                    and entry.stat(follow_symlinks=False).st_ino == _FIRST_FREE_OBJECTID
                ):
                    names.append(entry.name)
        return sorted(names)
