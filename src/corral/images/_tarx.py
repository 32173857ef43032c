"""Safe extraction of (untrusted) tar archives into a fresh directory, as root, keeping
owners, modes (setuid included), mtimes, hardlinks, device nodes and xattrs; and the
translation of OCI whiteouts into overlayfs ones.

Python's tarfile checks every member first (no absolute names, no ``..``, nothing written
through a symlink or hard-linked to one); GNU tar then extracts, because tarfile drops
xattrs such as ``security.capability``. The destination starts empty, so the only
symlinks in it are those the archive made, which the check tracks member by member.
"""

from __future__ import annotations

import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

from corral.errors import BuildError
from corral.images._proc import ToolFailed, run_tool
from corral.images._progress import Step

__all__ = ["check_tar", "extract_tar", "apply_oci_whiteouts", "TarSummary", "OPAQUE_XATTR"]

OPAQUE_XATTR = "trusted.overlay.opaque"
_WH = ".wh."
_WH_OPQ = ".wh..wh..opq"
_WH_META = ".wh..wh."


@dataclass(frozen=True)
class TarSummary:
    members: int
    has_root: bool
    """The archive has a ``.`` entry, which sets the owner, mode and mtime of the root."""
    dirs: frozenset[str] = frozenset()
    """Directories the archive lists (others tar makes implicitly, as parents)."""


def _norm(name: str, archive: Path, what: str = "member") -> str:
    if name.startswith("/"):
        raise BuildError(f"{archive}: {what} {name!r} has an absolute path; refused")
    parts = name.split("/")
    if ".." in parts:
        raise BuildError(f"{archive}: {what} {name!r} contains '..'; refused")
    clean = [p for p in parts if p not in ("", ".")]
    return "/".join(clean) if clean else "."


def check_tar(archive: Path) -> TarSummary:
    """Check every member of ``archive`` (plain or compressed); BuildError on the first bad."""
    symlinks: set[str] = set()
    kinds: dict[str, str] = {}
    count = 0
    has_root = False

    def through_symlink(path: str) -> str | None:
        parts = path.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in symlinks:
                return prefix
        return None

    try:
        with tarfile.open(archive, "r:*") as tf:
            for m in tf:
                count += 1
                name = _norm(m.name, archive)
                if name == ".":
                    has_root = True
                    if not m.isdir():
                        raise BuildError(f"{archive}: root entry {m.name!r} is not a directory")
                    continue
                via = through_symlink(name)
                if via is not None:
                    raise BuildError(
                        f"{archive}: member {m.name!r} would be written through the symlink "
                        f"{via!r}; refused"
                    )
                if m.islnk():
                    target = _norm(m.linkname, archive, "hard link target")
                    if through_symlink(target) is not None or target in symlinks:
                        raise BuildError(
                            f"{archive}: hard link {m.name!r} -> {m.linkname!r} goes through "
                            "a symlink; refused"
                        )
                    if kinds.get(target) != "file":
                        raise BuildError(
                            f"{archive}: hard link {m.name!r} points to {m.linkname!r}, which "
                            "is not a file earlier in the archive"
                        )
                if not (
                    m.isfile()
                    or m.isdir()
                    or m.issym()
                    or m.islnk()
                    or m.ischr()
                    or m.isblk()
                    or m.isfifo()
                ):
                    raise BuildError(
                        f"{archive}: member {m.name!r} has unsupported type {m.type!r}"
                    )
                if m.issym():
                    # Never forgotten, even if a later entry of the same name replaces
                    # it: whether tar replaces or keeps a symlink to a directory depends
                    # on its version and options (--keep-directory-symlink), and no sane
                    # archive needs to write below a name that once was a symlink.
                    symlinks.add(name)
                kinds[name] = (
                    "dir" if m.isdir() else ("file" if m.isfile() or m.islnk() else "other")
                )
    except tarfile.TarError as e:
        raise BuildError(f"{archive} is not a readable tar archive: {e}") from None
    except OSError as e:
        raise BuildError(f"cannot read {archive}: {e.strerror or e}") from None
    dirs = frozenset(n for n, k in kinds.items() if k == "dir")
    return TarSummary(count, has_root, dirs)


def extract_tar(archive: Path, dest: Path, *, step: Step | None = None) -> TarSummary:
    """Check ``archive`` and extract it into the empty directory ``dest`` as root.

    Without a ``.`` entry the root of ``dest`` becomes ``0755 root:root`` with mtime 0, so
    that the layer built from it does not depend on when it was extracted.
    """
    summary = check_tar(archive)
    os.chmod(dest, 0o755)
    os.chown(dest, 0, 0)
    argv = [
        "tar",
        "-x",
        "-v",
        "-f",
        str(archive),
        "-C",
        str(dest),
        "--numeric-owner",
        "--same-owner",
        "--same-permissions",
        "--xattrs",
        "--xattrs-include=*",
    ]

    def count(_line: str) -> None:
        if step is not None:
            step.advance(1)

    try:
        run_tool(argv, what=f"extracting {archive}", on_line=count)
    except ToolFailed as e:
        raise BuildError(f"tar could not extract {archive}:\n{e.output}") from None
    # Directories tar created on its own (no entry of their own) and a root without a
    # "." entry get mtime 0, so the layer does not depend on when it was extracted.
    if not summary.has_root:
        os.utime(dest, ns=(0, 0))
    for dirpath, dirnames, _files in os.walk(dest):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if os.path.relpath(p, dest) not in summary.dirs and not os.path.islink(p):
                os.utime(p, ns=(0, 0), follow_symlinks=False)
    return summary


def apply_oci_whiteouts(root: Path) -> int:
    """Turn OCI whiteouts under ``root`` into overlayfs ones; return how many.

    ``.wh.NAME`` becomes a char 0/0 device ``NAME`` (or, if this layer re-creates NAME as
    a directory, that directory becomes opaque); ``.wh..wh..opq`` marks its directory
    opaque (xattr ``trusted.overlay.opaque=y``). Parent mtimes are kept as in the archive.
    """
    done = 0
    for dirpath, dirnames, filenames in os.walk(root):
        names = [n for n in dirnames + filenames if n.startswith(_WH)]
        if not names:
            continue
        parent = Path(dirpath)
        pst = os.lstat(parent)
        for n in names:
            path = parent / n
            wst = os.lstat(path)
            if stat.S_ISDIR(wst.st_mode):
                raise BuildError(f"whiteout {path} is a directory; a whiteout must be a file")
            path.unlink()
            if n == _WH_OPQ:
                os.setxattr(parent, OPAQUE_XATTR, b"y", follow_symlinks=False)
            elif n.startswith(_WH_META):
                continue  # aufs bookkeeping (.wh..wh.plnk, .wh..wh.aufs): no meaning here
            else:
                target = parent / n[len(_WH) :]
                if os.path.lexists(target):
                    # Same layer re-creates the name: a file already hides the lower one;
                    # a directory must hide the lower directory's contents.
                    if target.is_dir() and not target.is_symlink():
                        os.setxattr(target, OPAQUE_XATTR, b"y", follow_symlinks=False)
                else:
                    os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
                    os.chown(target, wst.st_uid, wst.st_gid, follow_symlinks=False)
                    os.utime(target, ns=(wst.st_atime_ns, wst.st_mtime_ns), follow_symlinks=False)
            done += 1
        dirnames[:] = [d for d in dirnames if not d.startswith(_WH)]
        os.utime(parent, ns=(pst.st_atime_ns, pst.st_mtime_ns), follow_symlinks=False)
    return done
