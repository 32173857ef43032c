"""A tiny tmpfs holding only the sandbox init, so its bind mount names no host path.

A bind mount's root, as the guest reads it in /proc/self/mountinfo, is the path of the
source inside its filesystem: binding ``<state_dir>/bin/corral-init-<hash>`` from the
host's root filesystem would show the guest that path (the node's state dir). Bound from
this filesystem the root reads ``/corral-init`` and the source ``corral-init``.

Sandboxes keep the inode they were bound from, so the file can be replaced (a new init
build) and the tmpfs unmounted while they run; the node does both only between uses.

Example::

    init = install(Path("/run/corral/initfs"), built_init)   # .../initfs/corral-init
    ...                                                     # bind ``init`` into sandboxes
    remove(Path("/run/corral/initfs"))                       # node teardown
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from corral.errors import HostError
from corral.host import _sys, mounts

__all__ = ["NAME", "EMPTY", "install", "remove"]

NAME = "corral-init"
EMPTY = "empty"
"""An empty directory beside the init: bound read-only over masked directories
(corral.backends.oci.masks_as_binds), its root in the guest's mountinfo reads ``/empty``."""
_SLACK = 1 << 20


def install(mountpoint: Path, binary: Path) -> Path:
    """Mount the tmpfs at ``mountpoint`` (unless there) and put ``binary`` in it as
    :data:`NAME` (unless an identical copy is there); returns the copy's path."""
    target = mountpoint / NAME
    try:
        size = binary.stat().st_size
        mountpoint.mkdir(parents=True, exist_ok=True)
        if not mounts.is_mountpoint(mountpoint):
            # Traversable by every sandbox's mapped root (the runtime binds the file from
            # inside the user namespace); nothing on it is a device or setuid.
            data = f"size={size + _SLACK},mode=0755,nr_inodes=32"
            # Safe: a new, private tmpfs on corral's own (empty) directory.
            _sys.mount(NAME, mountpoint, "tmpfs", _sys.MS_NOSUID | _sys.MS_NODEV, data)
        empty = mountpoint / EMPTY
        empty.mkdir(mode=0o555, exist_ok=True)
        os.chmod(empty, 0o555)
        if target.is_file() and _same(target, binary):
            return target
        tmp = mountpoint / f".{NAME}.tmp"
        shutil.copyfile(binary, tmp)
        os.chmod(tmp, 0o555)
        os.replace(tmp, target)
    except OSError as e:
        raise HostError(f"init filesystem at {mountpoint}: {e}") from None
    return target


def _same(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    return a.read_bytes() == b.read_bytes()


def remove(mountpoint: Path) -> None:
    """Unmount the tmpfs and remove its directory (running sandboxes keep their init)."""
    with contextlib.suppress(OSError, HostError):
        if mounts.is_mountpoint(mountpoint):
            mounts.umount(mountpoint, detach=True)
    with contextlib.suppress(OSError):
        mountpoint.rmdir()
