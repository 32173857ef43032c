"""Mounts: EROFS layers, idmapped clones, overlayfs, binds, tmpfs — by direct syscalls.

Sandbox creation sits on this path, so nothing here spawns a process: each helper is one
to four system calls (a few tens of microseconds each). All of them run as host root in
the node agent's mount namespace; each call's comment says why it is safe.

Example::

    mount_erofs(Path("/store/ab12.erofs"), Path("/run/corral/layers/raw/ab12"))
    mount_overlay([top, base], upper, work, Path("/run/corral/sb/x/rootfs"))
    umount(Path("/run/corral/sb/x/rootfs"))
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Sequence
from pathlib import Path

from corral.errors import HostError
from corral.host import _sys
from corral.host._sys import errtext

__all__ = [
    "mount_erofs",
    "mount_idmapped",
    "mount_overlay",
    "overlay_fd",
    "mount_bind",
    "mount_tmpfs",
    "make_private",
    "umount",
    "is_mountpoint",
    "mounts_under",
]


def _fail(what: str, e: OSError, *paths: Path | str, detail: str = "") -> HostError:
    where = " ".join(str(p) for p in paths)
    extra = f": {detail}" if detail else ""
    return HostError(f"{what} {where} failed: {errtext(e.errno or 0)}{extra}")


def mount_erofs(
    image: Path, target: Path, *, direct: bool = False, devices: Sequence[Path] = ()
) -> None:
    """Mount an EROFS image file read-only at ``target``.

    The kernel (6.12+) mounts a regular file directly, with no loop device; where it
    refuses (ENOTBLK: built without file-backed EROFS) a loop device with autoclear is
    attached, which the unmount frees.

    ``direct``: the mount reads the file with direct I/O (``-o directio``), past the
    file's own page cache, so what sandboxes read is cached once (as the EROFS files'
    pages) instead of twice. A kernel whose EROFS has no such option gets a buffered mount;
    so does the loop fallback.

    ``devices``: the image's extra blob files (``mkfs.erofs --blobdev``: the image holds
    the metadata, a blob the data), in order (``-o device=``); file-backed mounts only.
    """
    for d in devices:
        if "," in str(d):
            raise HostError(
                f"mount erofs {image}: blob path {d} has a comma (a mount option separator)"
            )
    # Safe: read-only, nodev, nosuid; the image is a content-verified layer file and the
    # target a directory under corral's own mount root. Sandboxes never see this mount
    # directly, only overlays or idmapped clones of it.
    flags = _sys.MS_RDONLY | _sys.MS_NODEV | _sys.MS_NOSUID
    try:
        opts = (["directio"] if direct else []) + [f"device={d}" for d in devices]
        _sys.mount(image, target, "erofs", flags, ",".join(opts) or None)
        return
    except OSError as e:
        if direct and e.errno == errno.EINVAL:  # no such option here (or a bad image)
            mount_erofs(image, target, devices=devices)
            return
        if e.errno != errno.ENOTBLK or devices:
            hint = "not an EROFS image, or a corrupt one" if e.errno == errno.EINVAL else ""
            raise _fail("mount erofs", e, image, *devices, target, detail=hint) from None
        first = e
    from corral.host import loop  # only hosts without file-backed EROFS get here

    try:
        dev = loop.attach(image, read_only=True)
    except HostError as e:
        raise HostError(
            f"mount erofs {image} {target} failed: {errtext(first.errno or 0)}; "
            f"loop fallback failed too: {e.message}"
        ) from None
    try:
        _sys.mount(dev.path, target, "erofs", flags)
    except OSError as e:
        raise _fail("mount erofs (loop)", e, image, dev.path, target) from None
    finally:
        # The mount now holds the loop device; closing our fd lets autoclear free it
        # when the filesystem is unmounted.
        dev.close()


def _clone_to(
    source: Path, target: Path, recursive: bool, attr: int, userns_fd: int = 0, what: str = ""
) -> None:
    """open_tree(CLONE) + mount_setattr + move_mount: the clone is complete (read-only,
    idmapped) before anyone can see it, and only the attributes in ``attr`` change."""
    flags = _sys.OPEN_TREE_CLONE | _sys.OPEN_TREE_CLOEXEC | (_sys.AT_RECURSIVE if recursive else 0)
    try:
        # Safe: a detached clone of a mount we own; nothing sees it until move_mount.
        fd = _sys.open_tree(_sys.AT_FDCWD, source, flags)
    except OSError as e:
        raise _fail(f"{what} open_tree", e, source) from None
    try:
        if attr:
            try:
                # Safe: changes only the detached clone. For MOUNT_ATTR_IDMAP the userns
                # is corral's own, mapping onto the unprivileged sandbox uid range.
                _sys.mount_setattr(
                    fd,
                    "",
                    _sys.AT_EMPTY_PATH | (_sys.AT_RECURSIVE if recursive else 0),
                    attr,
                    userns_fd=userns_fd,
                )
            except OSError as e:
                raise _fail(f"{what} mount_setattr", e, source) from None
        try:
            # Safe: attaches the clone at a directory under corral's roots.
            _sys.move_mount(fd, "", _sys.AT_FDCWD, target, _sys.MOVE_MOUNT_F_EMPTY_PATH)
        except OSError as e:
            raise _fail(f"{what} move_mount", e, source, target) from None
    finally:
        os.close(fd)


def mount_idmapped(
    source: Path, target: Path, userns_fd: int, recursive: bool = False, readonly: bool = True
) -> None:
    """Clone the mount at ``source`` to ``target`` with the id mapping of ``userns_fd``.

    Files owned by host uid 0 appear as the namespace's mapped root (e.g. 100000), so a
    sandbox whose root is that uid owns them. Read-only (and nodev, nosuid) by default.
    """
    attr = _sys.MOUNT_ATTR_IDMAP | _sys.MOUNT_ATTR_NODEV | _sys.MOUNT_ATTR_NOSUID
    if readonly:
        attr |= _sys.MOUNT_ATTR_RDONLY
    _clone_to(source, target, recursive, attr, userns_fd, what="idmapped mount:")


def _split_option(opt: str) -> tuple[str, str | None]:
    key, sep, value = opt.partition("=")
    return key, (value if sep else None)


def mount_overlay(
    lowers: Sequence[Path],
    upper: Path | None,
    work: Path | None,
    target: Path,
    options: Sequence[str] = (),
) -> None:
    """Mount overlayfs at ``target``: ``lowers`` top-first, ``upper`` None for read-only.

    Uses fsopen/fsconfig with one ``lowerdir+`` per layer (kernel 6.8+), so the number of
    layers never meets mount(2)'s one-page option limit; paths over fsconfig's 256-byte
    string limit go by file descriptor (FSCONFIG_SET_FD, 6.15+) or /proc/self/fd. Older
    kernels get mount(2) with ``/proc/self/fd/N`` lower paths (~17 bytes per layer, so
    ~200 layers fit). A read-only stack of one layer is a read-only bind mount, because
    overlayfs wants two lowers when there is no upper. ``options``: extra overlay options
    such as ``"index=off"`` or ``"xino=off"``.
    """
    if not lowers:
        raise HostError(f"mount overlay {target}: no lower layers given")
    if (upper is None) != (work is None):
        raise HostError(f"mount overlay {target}: upper and work must be given together")
    if upper is None and len(lowers) == 1 and not options:
        mount_bind(lowers[0], target, readonly=True)
        return
    try:
        mfd = overlay_fd(lowers, upper, work, options, what=str(target))
    except _NoFsopen:
        _mount_overlay_legacy(lowers, upper, work, target, options)
        return
    try:
        # Safe: attaches the new overlay at the sandbox's rootfs directory.
        _sys.move_mount(mfd, "", _sys.AT_FDCWD, target, _sys.MOVE_MOUNT_F_EMPTY_PATH)
    except OSError as e:
        raise _fail("move_mount overlay", e, target) from None
    finally:
        os.close(mfd)


class _NoFsopen(Exception):
    """The kernel has no fsopen (before 5.2)."""


def overlay_fd(
    lowers: Sequence[Path],
    upper: Path | None,
    work: Path | None,
    options: Sequence[str] = (),
    *,
    what: str = "(detached)",
) -> int:
    """An overlayfs as a detached mount (fsopen/fsconfig/fsmount): an fd of a mount in
    no mount namespace's table, which the caller attaches (move_mount) or hands to the
    sandbox's launcher, whose own mount namespace is the only one it ever appears in.
    Closing the fd before that frees it. Arguments as :func:`mount_overlay` (two or more
    layers, or an upper); ``what`` names it in errors. HostError, or _NoFsopen (old kernel)."""
    if not lowers:
        raise HostError(f"mount overlay {what}: no lower layers given")
    if (upper is None) != (work is None):
        raise HostError(f"mount overlay {what}: upper and work must be given together")
    try:
        fsfd = _sys.fsopen("overlay")
    except OSError as e:
        if e.errno != errno.ENOSYS:
            raise _fail("fsopen overlay", e, what) from None
        raise _NoFsopen from None
    fds: list[int] = []
    step = ""  # what fsconfig was given last, for the error message
    try:
        try:
            for lower in lowers:
                step = f"lowerdir+ {lower}"
                _set_path(fsfd, "lowerdir+", lower, fds)
            if upper is not None and work is not None:
                step = f"upperdir {upper}"
                _set_path(fsfd, "upperdir", upper, fds)
                step = f"workdir {work}"
                _set_path(fsfd, "workdir", work, fds)
            for opt in options:
                step = f"option {opt}"
                key, value = _split_option(opt)
                if value is None:
                    _sys.fsconfig(fsfd, _sys.FSCONFIG_SET_FLAG, key)
                else:
                    _sys.fsconfig(fsfd, _sys.FSCONFIG_SET_STRING, key, value)
            step = f"create ({len(lowers)} lowers, upper={upper})"
            # Safe: builds a superblock from directories corral prepared; the mount is
            # detached until move_mount.
            _sys.fsconfig(fsfd, _sys.FSCONFIG_CMD_CREATE)
        except OSError as e:
            log = _sys.fs_log(fsfd)
            raise _fail(
                "mount overlay", e, what, detail=f"at {step}" + (f" ({log})" if log else "")
            ) from None
        attr = (
            _sys.MOUNT_ATTR_NODEV
            if upper is not None
            else (_sys.MOUNT_ATTR_NODEV | _sys.MOUNT_ATTR_RDONLY)
        )
        try:
            return _sys.fsmount(fsfd, attr)
        except OSError as e:
            raise _fail("fsmount overlay", e, what) from None
    finally:
        for fd in fds:
            os.close(fd)
        os.close(fsfd)


def _set_path(fsfd: int, key: str, path: Path, fds: list[int]) -> None:
    """Give overlayfs a layer as the string ``/proc/self/fd/N`` of an O_PATH fd.

    overlayfs shows its options in /proc/<pid>/mountinfo exactly as given (a layer given
    by fd, FSCONFIG_SET_FD, as its full path): a host path there would tell the guest
    where the node keeps its state. The magic link resolves to the same directory while
    the fd is open, is short (no 256-byte fsconfig string limit) and works on every
    kernel with fsconfig.
    """
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    fds.append(fd)
    _sys.fsconfig(fsfd, _sys.FSCONFIG_SET_STRING, key, f"/proc/self/fd/{fd}")


def _mount_overlay_legacy(
    lowers: Sequence[Path],
    upper: Path | None,
    work: Path | None,
    target: Path,
    options: Sequence[str],
) -> None:
    # /proc/self/fd/N is short and thread-safe (unlike a chdir trick); overlayfs resolves
    # the paths while mounting, after which the fds may close.
    fds = [os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for p in lowers]
    try:
        opts = ["lowerdir=" + ":".join(f"/proc/self/fd/{fd}" for fd in fds)]
        if upper is not None and work is not None:
            # By fd too: mountinfo shows the options as given (see _set_path).
            fds += [os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for p in (upper, work)]
            opts += [f"upperdir=/proc/self/fd/{fds[-2]}", f"workdir=/proc/self/fd/{fds[-1]}"]
        opts += list(options)
        data = ",".join(opts)
        if len(data) >= 4096:
            raise HostError(
                f"mount overlay {target}: options are {len(data)} bytes, over one page; "
                f"{len(lowers)} layers are too many for this kernel"
            )
        flags = _sys.MS_NODEV | (_sys.MS_RDONLY if upper is None else 0)
        try:
            _sys.mount("overlay", target, "overlay", flags, data)
        except OSError as e:
            raise _fail("mount overlay", e, target) from None
    finally:
        for fd in fds:
            os.close(fd)


def mount_bind(source: Path, target: Path, readonly: bool = True, recursive: bool = False) -> None:
    """Bind ``source`` at ``target``, read-only by default (with ``recursive``, every
    submount too). The other flags of the source (nosuid, nodev...) are kept."""
    attr = _sys.MOUNT_ATTR_RDONLY if readonly else 0
    _clone_to(source, target, recursive, attr, what="bind mount:")


def mount_tmpfs(target: Path, size: int, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
    """Mount a tmpfs of at most ``size`` bytes (nosuid, nodev) at ``target``."""
    data = f"size={size},mode={mode:o},uid={uid},gid={gid}"
    try:
        # Safe: a size-capped memory filesystem; nosuid/nodev so a sandbox cannot plant
        # device nodes or setuid binaries in it.
        _sys.mount("tmpfs", target, "tmpfs", _sys.MS_NOSUID | _sys.MS_NODEV, data)
    except OSError as e:
        raise _fail("mount tmpfs", e, target, detail=data) from None


def make_private(target: Path) -> None:
    """Make the mount at ``target`` private, so mounts below it never propagate."""
    try:
        # Safe: changes only propagation of a corral-owned mount point.
        _sys.mount(None, target, None, _sys.MS_PRIVATE)
    except OSError as e:
        raise _fail("make private", e, target) from None


def umount(target: Path, detach: bool = False, busy_wait: float = 0.0) -> None:
    """Unmount ``target``; not mounted or missing is not an error. ``detach``: MNT_DETACH.

    ``busy_wait``: for up to this many seconds retry while the mount is busy (processes of a
    just-killed sandbox may still be exiting); after that a lazy detach if ``detach``."""
    deadline = time.monotonic() + busy_wait
    while True:
        try:
            # Safe: callers pass only paths under corral's roots; NOFOLLOW keeps a symlink
            # planted there from redirecting the unmount.
            _sys.umount2(
                target, _sys.UMOUNT_NOFOLLOW | (_sys.MNT_DETACH if detach and busy_wait <= 0 else 0)
            )
            return
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOENT):
                return
            if e.errno == errno.EBUSY and time.monotonic() < deadline:
                time.sleep(0.005)
                continue
            if e.errno == errno.EBUSY and detach and busy_wait > 0:
                busy_wait = 0
                continue
            raise _fail("umount", e, target) from None


# statx(2), for STATX_ATTR_MOUNT_ROOT: one syscall, and it tells a bind mount of a
# directory on the same filesystem apart (st_dev comparison does not).
_STATX_ATTR_MOUNT_ROOT = 0x2000
_SYS_STATX = 332 if os.uname().machine == "x86_64" else 291


def is_mountpoint(path: Path) -> bool:
    """True if ``path`` is the root of a mount (symlinks are not followed)."""
    buf = ctypes.create_string_buffer(256)
    ret = _sys.libc.syscall(
        _SYS_STATX,
        ctypes.c_int(_sys.AT_FDCWD),
        os.fsencode(path),
        ctypes.c_int(_sys.AT_SYMLINK_NOFOLLOW | _sys.AT_NO_AUTOMOUNT),
        ctypes.c_uint(0),
        buf,
    )
    if ret < 0:
        return False
    attributes = int.from_bytes(buf.raw[8:16], "little")
    mask = int.from_bytes(buf.raw[56:64], "little")
    if mask & _STATX_ATTR_MOUNT_ROOT:
        return bool(attributes & _STATX_ATTR_MOUNT_ROOT)
    return os.path.ismount(path)  # pragma: no cover - kernels before 5.8


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    if "\\" not in field:
        return field
    out = bytearray()
    raw = field.encode()
    i = 0
    while i < len(raw):
        if raw[i] == 0x5C and i + 4 <= len(raw) and raw[i + 1 : i + 4].isdigit():
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return os.fsdecode(bytes(out))


def mounts_under(prefix: Path) -> list[Path]:
    """Mount points at or below ``prefix``, deepest (and most recent) first.

    A path mounted twice appears twice, so unmounting the list in order removes all.
    """
    base = os.path.normpath(str(prefix))
    found: list[tuple[int, int, Path]] = []
    with open("/proc/self/mountinfo", "rb") as f:
        for order, line in enumerate(f):
            point = _unescape(os.fsdecode(line.split(b" ", 5)[4]))
            if point == base or point.startswith(base.rstrip("/") + "/"):
                found.append((point.count("/"), order, Path(point)))
    found.sort(key=lambda t: (t[0], t[1]), reverse=True)
    return [p for _, _, p in found]
