"""Unpack an overlay upper dir that a guest sent as a tar (microVM snapshots), safely.

A microVM's writable layer lives on a disk image the host never mounts; to snapshot it,
the guest streams its overlay upper dir out as a pax tar (``/.corral/tar``, see
corral/init/corral-tar.c). The guest is untrusted, so its archive is too. This unpacker
writes into a fresh, empty directory and refuses (BuildError naming the member) anything
that could reach outside it or that a layer must not hold:

* names that are absolute, contain ``..``, are empty, or pass through a symlink or a
  non-directory the archive made earlier; a name given twice;
* hardlinks to anything but a regular file the archive made earlier;
* device nodes, except overlay whiteouts (char 0:0); sockets and unknown types;
* more than ``max_bytes`` of file data, or more than ``max_entries`` entries.

Kept: owners (the guest's ids, image-relative, as a layer stores them), modes (setuid
included: the destination's parent is the caller's root-only scratch dir), mtimes,
hardlinks, symlinks, fifos, whiteouts, and the xattrs a layer needs (``trusted.overlay.opaque``
marking a directory that hides the image's, ``security.capability``, ``user.*``); every
other xattr (overlay bookkeeping of the guest's own mount, SELinux labels) is dropped.

Nothing is extracted by tarfile's own extract (which follows a member's path through
earlier members): every entry is made here with ``O_NOFOLLOW`` / ``*at`` calls relative to
a directory fd opened without following symlinks.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from corral.errors import BuildError

__all__ = ["UpperSummary", "unpack_upper", "KEEP_XATTRS"]

KEEP_XATTRS = ("trusted.overlay.opaque", "security.capability")
"""xattrs a layer keeps (plus every ``user.*``)."""
_XATTR = "SCHILY.xattr."
_CHUNK = 1 << 20


@dataclass(frozen=True)
class UpperSummary:
    entries: int
    bytes: int
    """Bytes of regular file data written."""
    whiteouts: int


def _keep_xattr(name: str) -> bool:
    return name in KEEP_XATTRS or name.startswith("user.")


def _parts(name: str, what: str) -> list[str]:
    if name.startswith("/"):
        raise BuildError(f"{what}: absolute name {name!r}; refused")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in name.split("/"):
        raise BuildError(f"{what}: name {name!r} contains '..'; refused")
    if not parts:
        raise BuildError(f"{what}: empty name {name!r}; refused")
    if any("\0" in p for p in parts):
        raise BuildError(f"{what}: name {name!r} contains NUL; refused")
    return parts


def unpack_upper(
    src: IO[bytes],
    dest: Path,
    *,
    max_bytes: int,
    max_entries: int = 1_000_000,
    id_count: int = 65536,
    skip_top: tuple[str, ...] = (".corral",),
) -> UpperSummary:
    """Unpack the tar read from ``src`` (a stream; read once, front to back) into ``dest``
    (created here; must not exist). Top-level names in ``skip_top`` (corral's own mount
    points in the guest) are skipped with everything under them. BuildError on a refused
    member; ``dest`` is then left partly written for the caller to delete. Owners outside
    ``[0, id_count)`` (the ids a sandbox has) become root's, as a container snapshot's."""
    what = "guest upper tar"
    os.mkdir(dest, 0o700)
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    dirs: dict[str, int] = {}
    """Directories made so far (relative path -> fd), for *at calls and final modes."""
    kinds: dict[str, str] = {"": "dir"}
    regular: set[str] = set()
    late: list[tuple[str, tarfile.TarInfo]] = []  # directories: mode and mtime at the end
    total = entries = whiteouts = 0
    try:
        dirs[""] = root
        try:
            tf = tarfile.open(fileobj=src, mode="r|")
        except tarfile.TarError as e:
            raise BuildError(f"{what}: not a tar archive: {e}") from None
        with tf:
            for m in _members(tf, what):
                parts = _parts(m.name, what)
                if parts[0] in skip_top:
                    continue
                entries += 1
                if entries > max_entries:
                    raise BuildError(f"{what}: more than {max_entries} entries; refused")
                rel = "/".join(parts)
                if rel in kinds:
                    raise BuildError(f"{what}: member {m.name!r} given twice; refused")
                pfd = _parent_fd(dirs, kinds, parts, m.name, what)
                base = parts[-1]
                if m.isdir():
                    os.mkdir(base, 0o700, dir_fd=pfd)
                    fd = os.open(
                        base,
                        os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        dir_fd=pfd,
                    )
                    dirs[rel] = fd
                    kinds[rel] = "dir"
                    _owner_xattrs(fd, m, what, id_count)
                    late.append((rel, m))
                    continue
                if m.isreg():
                    if total + m.size > max_bytes:
                        raise BuildError(
                            f"{what}: file data past {max_bytes} bytes at {m.name!r}; refused"
                        )
                    total += m.size
                    fd = os.open(
                        base,
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600,
                        dir_fd=pfd,
                    )
                    try:
                        _copy(tf, m, fd, what)
                        _owner_xattrs(fd, m, what, id_count)
                        os.chmod(fd, m.mode & 0o7777)
                        os.utime(fd, ns=_ns(m))
                    finally:
                        os.close(fd)
                    kinds[rel] = "file"
                    regular.add(rel)
                    continue
                if m.islnk():
                    target = "/".join(_parts(m.linkname, f"{what}: hardlink {m.name!r}"))
                    if target not in regular:
                        raise BuildError(
                            f"{what}: hardlink {m.name!r} -> {m.linkname!r} is not to a "
                            "regular file earlier in the archive; refused"
                        )
                    tparts = target.split("/")
                    tfd = dirs["/".join(tparts[:-1])]
                    os.link(tparts[-1], base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
                    kinds[rel] = "file"
                    continue
                if m.issym():
                    # Never followed here: nothing is created through a symlink (see
                    # _parent_fd), and mkfs.erofs stores it as a link.
                    os.symlink(m.linkname, base, dir_fd=pfd)
                    uid, gid = _ids(m, id_count)
                    os.chown(base, uid, gid, dir_fd=pfd, follow_symlinks=False)
                    os.utime(base, ns=_ns(m), dir_fd=pfd, follow_symlinks=False)
                    kinds[rel] = "symlink"
                    continue
                if m.ischr() and m.devmajor == 0 and m.devminor == 0:
                    kind = stat.S_IFCHR
                    whiteouts += 1
                elif m.isfifo():
                    kind = stat.S_IFIFO
                elif m.isdev():
                    raise BuildError(
                        f"{what}: device node {m.name!r} ({m.devmajor}:{m.devminor}); "
                        "only whiteouts (char 0:0) are allowed; refused"
                    )
                else:
                    raise BuildError(f"{what}: member {m.name!r} of type {m.type!r}; refused")
                # Safe: a whiteout (char 0:0, which opens nothing) or a fifo, in the
                # caller's fresh root-only scratch dir.
                os.mknod(base, kind | 0o600, 0, dir_fd=pfd)
                _owner_xattrs(f"/proc/self/fd/{pfd}/{base}", m, what, id_count)
                os.chmod(base, m.mode & 0o7777, dir_fd=pfd)
                os.utime(base, ns=_ns(m), dir_fd=pfd, follow_symlinks=False)
                kinds[rel] = "node"
        for rel, m in reversed(late):  # children first: their mtimes are set
            fd = dirs[rel]
            os.chmod(fd, m.mode & 0o7777)
            os.utime(fd, ns=_ns(m))
    finally:
        for fd in dirs.values():
            with contextlib.suppress(OSError):
                os.close(fd)
    return UpperSummary(entries=entries, bytes=total, whiteouts=whiteouts)


def _members(tf: tarfile.TarFile, what: str) -> Iterator[tarfile.TarInfo]:
    try:
        yield from tf
    except tarfile.TarError as e:
        raise BuildError(f"{what}: corrupt archive: {e}") from None


def _parent_fd(
    dirs: dict[str, int], kinds: dict[str, str], parts: list[str], name: str, what: str
) -> int:
    """The fd of the member's parent dir, which the archive must have made (as a real
    directory) before it: nothing is written through a symlink or into a file."""
    parent = "/".join(parts[:-1])
    fd = dirs.get(parent)
    if fd is None:
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            kind = kinds.get(prefix)
            if kind is None:
                raise BuildError(
                    f"{what}: member {name!r} comes before its directory {prefix!r}; refused"
                )
            if kind != "dir":
                raise BuildError(
                    f"{what}: member {name!r} would be written through the {kind} "
                    f"{prefix!r}; refused"
                )
        raise BuildError(f"{what}: member {name!r}: no directory {parent!r}")
    return fd


def _copy(tf: tarfile.TarFile, m: tarfile.TarInfo, fd: int, what: str) -> None:
    f = tf.extractfile(m)
    if f is None:
        raise BuildError(f"{what}: member {m.name!r}: no data")
    left = m.size
    try:
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise BuildError(f"{what}: member {m.name!r} is cut short")
            os.write(fd, chunk)
            left -= len(chunk)
    except tarfile.TarError as e:
        raise BuildError(f"{what}: member {m.name!r}: {e}") from None


def _ids(m: tarfile.TarInfo, id_count: int) -> tuple[int, int]:
    uid = m.uid if 0 <= m.uid < id_count else 0
    gid = m.gid if 0 <= m.gid < id_count else 0
    return uid, gid


def _ns(m: tarfile.TarInfo) -> tuple[int, int]:
    t = int(min(max(m.mtime, 0), 1 << 40)) * 10**9
    return t, t


def _owner_xattrs(target: int | str, m: tarfile.TarInfo, what: str, id_count: int) -> None:
    """Owner first (chown clears setuid: modes are set after), then the kept xattrs.
    ``target``: an fd, or a path never followed at its last component."""
    uid, gid = _ids(m, id_count)
    if isinstance(target, int):
        os.chown(target, uid, gid)
    else:
        os.chown(target, uid, gid, follow_symlinks=False)
    for key, value in m.pax_headers.items():
        if not key.startswith(_XATTR):
            continue
        name = key[len(_XATTR) :]
        if not _keep_xattr(name):
            continue
        raw = value.encode("utf-8", "surrogateescape")
        try:
            if isinstance(target, int):
                os.setxattr(target, name, raw)
            else:
                os.setxattr(target, name, raw, follow_symlinks=False)
        except OSError as e:
            raise BuildError(f"{what}: member {m.name!r}: xattr {name}: {e.strerror}") from None
