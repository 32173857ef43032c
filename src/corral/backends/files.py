"""File operations inside a sandbox's root filesystem, done by the node on the host side.

The root (an overlayfs mount on the host) is full of guest-controlled names: symlinks to
``/``, ``..`` chains, device nodes copied up from image layers, and entries that the guest
swaps between our check and our use. The rules every method here follows:

* Every guest path is resolved by the kernel with openat2(RESOLVE_IN_ROOT |
  RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV) relative to an fd of the root, so absolute
  symlinks, relative symlinks and ``..`` are clamped inside the sandbox exactly as the
  guest itself would see them. No host path string is ever handed to a path-based call.
* Mutations resolve the *parent* directory to an fd, then act on the last component
  relative to it without following it (O_NOFOLLOW, AT_SYMLINK_NOFOLLOW, renameat, unlinkat).
* Files are opened for reading only after an O_PATH open and fstat proved the inode is a
  regular file; the real open goes through /proc/self/fd of that O_PATH fd, so a device
  node or fifo swapped in meanwhile is never opened (opening a host device could read a
  host disk, opening a fifo would block the node).
* Trees (recursive remove, download) are walked with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS
  opens from a directory fd, so a directory replaced by a symlink mid-walk fails the open.
* Error messages name the path as seen inside the sandbox, never a host path.

Semantics worth knowing:

* ``write`` (not append) writes a temporary file in the target directory and renames it
  over the name: a symlink at the final component is *replaced* by the new file; its
  target is never touched. ``append`` refuses a final-component symlink (PathRefused),
  because appending "to a link" has no replace meaning and following it is what an
  attacker would want.
* ``read`` and ``list`` follow a final-component symlink, confined to the sandbox root;
  ``stat``, ``remove`` and ``download_tar`` act on the link itself.
* ``..`` is resolved by the kernel and clamped at the sandbox root (``/../etc`` is the
  sandbox's ``/etc``). Creating parents through a symlink that dangles inside the
  sandbox fails with NotFound, as ``mkdir -p`` does; nothing is created at its target.
* Mount points below the root (host-side bind mounts) are refused (PathRefused) unless
  the SandboxFS was made with ``no_xdev=False``; downloads skip their content.
* Created entries are owned by the guest's root (host ``uid``/``gid``), or by the inside
  user given as ``owner_uid``/``owner_gid``. Uploaded archives do not keep their owners
  (like ``docker cp``).

Example:
    >>> fs = SandboxFS(Path("/var/lib/corral/sandboxes/sb-x/rootfs"))  # doctest: +SKIP
    >>> fs.write("/work/a.py", b"print(1)\\n")                          # doctest: +SKIP
    >>> fs.read("/work/a.py")                                          # doctest: +SKIP
    b'print(1)\\n'
"""

from __future__ import annotations

import bz2
import errno
import gzip
import io
import itertools
import lzma
import os
import secrets
import stat as st_
import tarfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, cast

from corral.errors import (
    Conflict,
    CorralError,
    HostError,
    InvalidRequest,
    NotFound,
    PathRefused,
    QuotaExceeded,
    ScratchFull,
)
from corral.host.openat2 import (
    RESOLVE_BENEATH,
    RESOLVE_IN_ROOT,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    openat2,
)
from corral.spec import FileStat

__all__ = ["SandboxFS", "ID_RANGE", "OVERFLOW_ID", "MAX_NAME", "MAX_PATH", "MAX_MEMBERS"]

ID_RANGE = 65536
"""Number of ids mapped into a sandbox's user namespace, starting at the base uid/gid."""
OVERFLOW_ID = 65534
"""What the guest sees for a host owner outside its mapping (the kernel's overflow id)."""
MAX_NAME = 255
MAX_PATH = 4096
MAX_MEMBERS = 1_000_000
"""Most members one uploaded archive may have."""

_DIR = os.O_RDONLY | os.O_DIRECTORY
_CHUNK = 1 << 20
_HEADER_ALLOWANCE = 64 << 20
"""Tar stream bytes allowed beyond the content cap, for headers and padding."""
_TMP_PREFIX = ".corral-tmp-"
# How often an entry met by a recursive remove may change under it (a guest refilling a
# directory or swapping it with a link) before we give up instead of racing it forever.
_RMDIR_RETRIES = 100


@dataclass(frozen=True)
class _Path:
    """A validated guest path: ``parts`` are its components without ``""`` and ``.``."""

    text: str
    parts: tuple[str, ...]

    @property
    def rel(self) -> str:
        """The path relative to the root, for openat2 ("." for the root itself)."""
        return "/".join(self.parts) or "."

    @property
    def parent(self) -> _Path:
        return _Path(_join((), self.parts[:-1]), self.parts[:-1])

    @property
    def name(self) -> str:
        return self.parts[-1] if self.parts else "/"

    def child(self, *names: str) -> _Path:
        return _Path(_join(self.parts, names), self.parts + names)


def _join(a: tuple[str, ...], b: tuple[str, ...]) -> str:
    return "/" + "/".join(a + b)


def _check_parts(parts: list[str], what: str) -> None:
    for part in parts:
        if len(os.fsencode(part)) > MAX_NAME:
            raise PathRefused(f"{what}: a name is longer than {MAX_NAME} bytes")


def _parse(path: object) -> _Path:
    """Validate a guest path; keep ``..`` (the kernel clamps it at the sandbox root)."""
    if not isinstance(path, str):
        raise InvalidRequest(f"a path must be a string, not {type(path).__name__}")
    if "\0" in path:
        raise PathRefused(f"path {path[:200]!r} contains a NUL byte")
    if len(os.fsencode(path)) > MAX_PATH:
        raise PathRefused(f"path {path[:100]!r}... is longer than {MAX_PATH} bytes")
    if not path.startswith("/"):
        raise InvalidRequest(f"path {path!r} must be absolute inside the sandbox (start with /)")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    _check_parts(parts, f"path {path[:200]!r}")
    return _Path("/" + "/".join(parts), tuple(parts))


@contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


_MESSAGES: dict[int, tuple[type[CorralError], str]] = {
    errno.ENOTDIR: (InvalidRequest, "a component of the path is not a directory"),
    errno.EISDIR: (InvalidRequest, "is a directory"),
    errno.ENOTEMPTY: (InvalidRequest, "directory is not empty (use recursive=True)"),
    errno.EEXIST: (Conflict, "already exists"),
    errno.ELOOP: (PathRefused, "a symlink is in the way where none may be followed"),
    errno.EXDEV: (PathRefused, "resolution would cross a mount point or leave its directory"),
    errno.ENAMETOOLONG: (PathRefused, "the name or resolved path is too long"),
    errno.EACCES: (InvalidRequest, "permission denied"),
    errno.EPERM: (InvalidRequest, "operation not permitted (immutable or append-only?)"),
    errno.EROFS: (InvalidRequest, "read-only file system"),
    # EDQUOT is the sandbox's qgroup limit; ENOSPC is the btrfs scratch filesystem under
    # every sandbox (host/btrfs.py). Neither is a bad request: a 400 here would be logged
    # as a refused path, a security event.
    errno.EDQUOT: (
        QuotaExceeded,
        "disk quota exceeded: the sandbox's disk (Limits.disk) is full; delete files "
        "in the sandbox or create it with a larger Limits.disk (if it holds far less, "
        "retry: btrfs can refuse briefly while metadata waits for a commit)",
    ),
    errno.ENOSPC: (
        ScratchFull,
        "no space left on the node's scratch filesystem (it holds every sandbox's "
        "writes; the sandbox's own quota is not full): retry later or on another node",
    ),
    errno.EBUSY: (Conflict, "is busy (a mount point?)"),
    errno.EAGAIN: (Conflict, "the path kept changing while it was resolved; retry"),
    errno.EMLINK: (InvalidRequest, "too many links"),
    errno.EFBIG: (InvalidRequest, "file too large"),
}


def _translate(err: OSError, where: str) -> CorralError:
    """Turn an OSError into a corral error naming the *inside* path (never err.filename)."""
    if err.errno == errno.ENOENT:
        return NotFound(f"{where}: no such file or directory")
    cls, text = _MESSAGES.get(err.errno or 0, (HostError, os.strerror(err.errno or 0)))
    return cls(f"{where}: {text}")


@contextmanager
def _errors(where: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise _translate(e, where) from None


class _Prefixed(io.RawIOBase):
    """``head`` (already read to sniff the format) followed by the rest of ``src``."""

    def __init__(self, head: bytes, src: BinaryIO) -> None:
        self._head, self._src = head, src

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self._head:
            out = self._head if n < 0 else self._head[:n]
            self._head = self._head[len(out) :]
            return out
        return self._src.read(n)


class _Capped(io.RawIOBase):
    """Fails once more than ``limit`` bytes came out of the (decompressed) tar stream, so
    neither a compression bomb nor a giant PAX or GNU long-name header can fill memory."""

    def __init__(self, src: BinaryIO | io.BufferedIOBase, limit: int) -> None:
        self._src, self._left, self._limit = src, limit, limit

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._src.read(n) or b""
        self._left -= len(data)
        if self._left < 0:
            raise InvalidRequest(
                f"the archive expands past the limit of {self._limit} bytes (headers included)"
            )
        return data


def _tar_stream(src: BinaryIO, limit: int) -> _Capped:
    """The plain tar byte stream of ``src`` (gzip, bzip2 and xz decompressed here rather
    than by tarfile, so that the size cap applies to what comes out of the decompressor)."""
    head = src.read(6)
    prefixed = cast(BinaryIO, _Prefixed(head, src))
    raw: BinaryIO | io.BufferedIOBase = prefixed
    if head.startswith(b"\x1f\x8b"):
        raw = gzip.GzipFile(fileobj=prefixed, mode="rb")
    elif head.startswith(b"BZh"):
        raw = bz2.BZ2File(prefixed)
    elif head.startswith(b"\xfd7zXZ\x00"):
        raw = lzma.LZMAFile(prefixed)
    return _Capped(raw, limit)


@contextmanager
def _archive_errors() -> Iterator[None]:
    """Reading a broken archive raises a zoo of types (some of them OSError): one message."""
    try:
        yield
    except CorralError:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as e:
        raise InvalidRequest(f"not a valid (or a truncated) tar archive: {e}") from None


class _Exact(io.RawIOBase):
    """Reads exactly ``size`` bytes of an fd: a file that a guest truncates under us is
    padded with zeros and one that grows is cut, so the tar stream stays well-formed."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self._left = fd, size

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > self._left:
            n = self._left
        if n == 0:
            return b""
        data = os.read(self._fd, n) or b"\0" * n
        self._left -= len(data)
        return data


class _Budget:
    """Bytes an archive may still carry."""

    def __init__(self, limit: int) -> None:
        self.limit = self.left = limit

    def take(self, n: int, what: str) -> None:
        self.left -= n
        if self.left < 0:
            raise InvalidRequest(f"{what}: the archive exceeds the limit of {self.limit} bytes")


class SandboxFS:
    """Safe file operations inside one sandbox's root directory (see the module docstring).

    ``uid``/``gid`` are the host ids that the guest's root maps to. ``max_file`` caps one
    read or write, and the bytes one archive upload or download may carry. The object
    holds no open fds and is safe to use from several threads.
    """

    def __init__(
        self,
        root: Path,
        uid: int = 100000,
        gid: int = 100000,
        max_file: int = 1 << 30,
        *,
        no_xdev: bool = True,
        require_mount: bool = False,
        open_root: Callable[[], int] | None = None,
    ) -> None:
        """``no_xdev``: refuse to cross mount points below the root (host-side bind mounts
        are not guest content); turn off only if the node mounts volumes into roots.
        ``require_mount``: the root must be a filesystem of its own (a sandbox's overlay);
        once it is unmounted (a destroy in progress) every operation fails instead of
        touching the bare directory on the node's disk. ``open_root``: returns a new
        directory fd of the root (closed by the caller) instead of opening ``root`` (then
        only named in messages): a sandbox whose rootfs is mounted in its own mount
        namespace only is reached through its init's ``/proc/<pid>/root``, raising
        HostError once it is gone. Mounts inside it (its /proc, /dev, tmpfs) are then
        below the root and refused like any other with ``no_xdev``."""
        self.root = Path(root)
        self._open_root = open_root
        self.require_mount = require_mount
        self.uid, self.gid, self.max_file = uid, gid, max_file
        xdev = RESOLVE_NO_XDEV if no_xdev else 0
        # Resolution of guest paths: confined to the root like the guest's own view.
        self._in_root = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | xdev
        # Walking trees and re-opening what we just created: no symlink at all, no escape.
        self._beneath = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | xdev

    # ------------------------------------------------------------------ public API

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of a regular file from ``offset`` (``length`` bytes or to the end).

        Follows a final symlink inside the sandbox. Devices, fifos and sockets are
        refused (PathRefused), directories are an InvalidRequest.
        """
        p = _parse(path)
        if offset < 0 or (length is not None and length < 0):
            raise InvalidRequest(f"{p.text}: offset and length cannot be negative")
        if length is not None and length > self.max_file:
            raise InvalidRequest(f"{p.text}: length {length} is over the limit {self.max_file}")
        with self._root() as root, _errors(p.text):
            with _fd(openat2(root, p.rel, os.O_PATH, resolve=self._in_root)) as opath:
                with _fd(self._reopen_regular(opath, os.O_RDONLY, p.text)) as fd:
                    size = os.fstat(fd).st_size
                    if length is None:
                        length = max(size - offset, 0)
                        if length > self.max_file:
                            raise InvalidRequest(
                                f"{p.text}: {length} bytes is over the read limit of "
                                f"{self.max_file}; read it in ranges with offset/length"
                            )
                    return _pread_all(fd, offset, length)

    def write(
        self,
        path: str,
        data: bytes,
        mode: int = 0o644,
        append: bool = False,
        parents: bool = True,
        *,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        """Write ``data`` to a file, replacing it atomically (temp file + renameat).

        A final-component symlink is replaced by the file, never written through. With
        ``append`` the file is extended in place (created if missing); appending to a
        symlink or a special file is refused. ``parents`` creates missing directories,
        owned by the guest's root. The file is owned by ``owner_uid``/``owner_gid``
        inside the sandbox (root by default) and gets exactly ``mode``.
        """
        p = _parse(path)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidRequest(f"{p.text}: data must be bytes")
        if len(data) > self.max_file:
            raise InvalidRequest(f"{p.text}: {len(data)} bytes is over the limit {self.max_file}")
        self._check_mode(mode, p)
        self._check_name(p, "write")
        if path.endswith("/"):
            raise InvalidRequest(f"{path!r}: a file path cannot end with '/'")
        huid, hgid = self._host_ids(owner_uid, owner_gid)
        with self._root() as root, _errors(p.text):
            with _fd(self._parent_fd(root, p, create=parents)) as dirfd:
                if append:
                    self._append(dirfd, p, bytes(data), mode, huid, hgid)
                else:
                    self._replace_file(dirfd, p, lambda fd: _write_all(fd, data), mode, huid, hgid)

    def list(self, path: str) -> list[FileStat]:
        """Entries of a directory (sorted by name, without ``.`` and ``..``), each with
        lstat semantics. A final symlink to a directory is followed inside the sandbox."""
        p = _parse(path)
        out: list[FileStat] = []
        with self._root() as root, _errors(p.text):
            try:
                dirfd = openat2(root, p.rel, _DIR, resolve=self._in_root)
            except NotADirectoryError:
                raise InvalidRequest(f"{p.text}: is not a directory") from None
            with _fd(dirfd):
                for name in sorted(os.listdir(dirfd)):
                    try:
                        opath, st = _lstat_at(dirfd, name)
                    except FileNotFoundError:
                        continue  # removed by the guest while we listed
                    with _fd(opath):
                        out.append(self._filestat(p.child(name), st, _link_target(opath, st)))
        return out

    def add_watch(self, inotify_fd: int, path: str, mask: int) -> int:
        """``inotify_add_watch`` on the directory ``path`` of the sandbox (resolved inside
        the root as ``list`` does), by way of an O_PATH fd, never a host path string;
        returns the watch descriptor. The fd is closed before returning: it would pin
        the sandbox's root mount."""
        from corral.host.inotify import add_watch

        p = _parse(path)
        with self._root() as root, _errors(p.text):
            try:
                fd = openat2(root, p.rel, os.O_PATH | os.O_DIRECTORY, resolve=self._in_root)
            except NotADirectoryError:
                raise InvalidRequest(f"{p.text}: is not a directory") from None
            with _fd(fd):
                return add_watch(inotify_fd, f"/proc/self/fd/{fd}", mask)

    def stat(self, path: str) -> FileStat:
        """Metadata of the entry at ``path`` itself (a final symlink is not followed)."""
        p = _parse(path)
        with self._root() as root, _errors(p.text):
            if not p.parts or p.parts[-1] == "..":
                with _fd(openat2(root, p.rel, os.O_PATH, resolve=self._in_root)) as fd:
                    return self._filestat(p, os.fstat(fd), None)
            with _fd(self._parent_fd(root, p, create=False)) as dirfd:
                opath, st = _lstat_at(dirfd, p.name)
                with _fd(opath):
                    return self._filestat(p, st, _link_target(opath, st))

    def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, symlink (never its target) or directory (empty unless
        ``recursive``). A recursive remove never follows a symlink nor crosses a mount."""
        p = _parse(path)
        self._check_name(p, "remove")
        with self._root() as root, _errors(p.text):
            with _fd(self._parent_fd(root, p, create=False)) as dirfd:
                st = os.stat(p.name, dir_fd=dirfd, follow_symlinks=False)
                if not st_.S_ISDIR(st.st_mode):
                    try:
                        os.unlink(p.name, dir_fd=dirfd)
                        return
                    except IsADirectoryError:
                        pass  # the guest swapped a directory in: handle it as one
                if recursive:
                    self._rmtree(dirfd, p)
                else:
                    os.rmdir(p.name, dir_fd=dirfd)

    def mkdir(
        self,
        path: str,
        parents: bool = True,
        mode: int = 0o755,
        *,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        """Create a directory. With ``parents`` missing ancestors are created too and an
        existing directory is fine (``mkdir -p``); without, an existing entry is a
        Conflict. New directories get ``mode`` and are owned by the inside owner."""
        p = _parse(path)
        self._check_mode(mode, p)
        huid, hgid = self._host_ids(owner_uid, owner_gid)
        with self._root() as root, _errors(p.text):
            if parents:
                os.close(self._mkdirs(root, p, mode, huid, hgid))
                return
            self._check_name(p, "create")
            with _fd(self._parent_fd(root, p, create=False)) as dirfd:
                os.close(self._mkdir_one(dirfd, p, mode, huid, hgid))

    def upload_tar(
        self,
        path: str,
        data: bytes | BinaryIO,
        *,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> int:
        """Extract a tar archive (plain, gzip, bzip2 or xz) into directory ``path``,
        creating it if missing; return the number of members extracted.

        Members with absolute names or ``..`` components, device and fifo members, and
        hard links whose target is absolute or has ``..`` are refused with PathRefused
        naming the member. Symlink members are created as given (they are guest content);
        every later member is resolved inside the sandbox root, so such a link can
        redirect a write only to elsewhere inside the sandbox. The extracted bytes are
        capped at ``max_file``. Bytes (or a seekable stream) are checked completely
        before anything is written, so a refused archive changes nothing; an unseekable
        stream is checked member by member and may leave earlier members behind.
        Directory modes and file modes and mtimes are kept; owners are not.
        """
        dest = _parse(path)
        huid, hgid = self._host_ids(owner_uid, owner_gid)
        src: BinaryIO = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
        if _seekable(src):
            start = src.tell()
            self._scan_archive(src)
            src.seek(start)
        with self._root() as root:
            with _errors(dest.text):
                os.close(self._mkdirs(root, dest, 0o755, self.uid, self.gid))
            return self._extract(root, dest, src, huid, hgid)

    def download_tar(self, path: str) -> bytes:
        """A tar (PAX) of the file, symlink or tree at ``path``.

        A directory's members are named relative to it (``a``, ``a/b``...); a file or
        symlink gives one member named after it. Symlinks are stored as symlinks, never
        followed; hard links within the tree are stored as hard links; sockets, fifos and
        devices are skipped, and so is the content of mount points below the root (with
        ``no_xdev``). Owners are the ids seen inside the sandbox. At most ``max_file``
        bytes of content.
        """
        p = _parse(path)
        buf = io.BytesIO()
        budget = _Budget(self.max_file)
        with self._root() as root, _errors(p.text):
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
                if not p.parts or p.parts[-1] == "..":
                    with _fd(openat2(root, p.rel, _DIR, resolve=self._in_root)) as top:
                        self._add_tree(tf, top, p, budget)
                else:
                    self._add_path(tf, root, p, budget)
        return buf.getvalue()

    # ------------------------------------------------------------------ resolution

    @contextmanager
    def _root(self) -> Iterator[int]:
        if self._open_root is not None:
            with _fd(self._open_root()) as fd:
                yield fd
            return
        # The root path is the node's own (trusted) host path, so a plain open is right.
        try:
            fd = os.open(self.root, _DIR | os.O_CLOEXEC)
        except OSError:
            raise HostError("the sandbox's root filesystem is not available") from None
        with _fd(fd):
            if self.require_mount and os.fstat(fd).st_dev == os.stat(self.root.parent).st_dev:
                raise HostError("the sandbox's root filesystem is not mounted (any more)")
            yield fd

    def _parent_fd(self, root: int, p: _Path, create: bool) -> int:
        """Directory fd of ``p``'s parent, resolved inside the root (created if asked)."""
        if create:
            return self._mkdirs(root, p.parent, 0o755, self.uid, self.gid)
        return openat2(root, p.parent.rel, _DIR, resolve=self._in_root)

    def _mkdirs(self, root: int, p: _Path, mode: int, huid: int, hgid: int) -> int:
        """``mkdir -p`` inside the root; return an fd of the final directory.

        Each prefix is resolved from the root with RESOLVE_IN_ROOT (so ``..`` and symlinks
        mean what they mean to the guest); only a missing last component is created,
        relative to the fd of the prefix before it. ``mode`` is for the final directory,
        missing ancestors get 0o755 (like ``mkdir -p -m``); all get the owner given.
        """
        fd = os.dup(root)
        try:
            for i in range(len(p.parts)):
                prefix = _Path(_join((), p.parts[: i + 1]), p.parts[: i + 1])
                try:
                    nfd = openat2(root, prefix.rel, _DIR, resolve=self._in_root)
                except FileNotFoundError:
                    try:
                        last = i == len(p.parts) - 1
                        nfd = self._mkdir_one(fd, prefix, mode if last else 0o755, huid, hgid)
                    except FileExistsError:  # raced with the guest, or a dangling symlink
                        nfd = openat2(root, prefix.rel, _DIR, resolve=self._in_root)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _mkdir_one(self, dirfd: int, p: _Path, mode: int, huid: int, hgid: int) -> int:
        """mkdirat one name, then own and chmod it through an fd of the new inode."""
        os.mkdir(p.name, 0o700, dir_fd=dirfd)
        # NO_SYMLINKS: if the guest replaced our new directory by a link, refuse.
        fd = openat2(dirfd, p.name, _DIR | os.O_NOFOLLOW, resolve=self._beneath)
        try:
            os.fchown(fd, huid, hgid)
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_beneath(self, top: int, parts: tuple[str, ...], flags: int) -> int:
        """Open ``parts`` below ``top`` without any symlink, in chunks so that trees
        deeper than PATH_MAX still open (each chunk is itself confined below the last)."""
        fd, start = -1, 0
        try:
            while True:
                end, size = start, 0
                while end < len(parts) and size < 2048:  # a name is at most 255 bytes
                    size += len(os.fsencode(parts[end])) + 1
                    end += 1
                last = end == len(parts)
                nfd = openat2(
                    top if fd < 0 else fd,
                    "/".join(parts[start:end]) or ".",
                    flags if last else _DIR | os.O_NOFOLLOW,
                    resolve=self._beneath,
                )
                if fd >= 0:
                    os.close(fd)
                fd, start = nfd, end
                if last:
                    return fd
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise

    def _reopen_regular(self, opath: int, flags: int, where: str) -> int:
        """Open the regular file behind an O_PATH fd; refuse anything else unopened."""
        st = os.fstat(opath)
        if st_.S_ISDIR(st.st_mode):
            raise InvalidRequest(f"{where}: is a directory")
        if st_.S_ISLNK(st.st_mode):
            raise PathRefused(f"{where}: is a symlink (not followed here)")
        if not st_.S_ISREG(st.st_mode):
            raise PathRefused(f"{where}: is a device, fifo or socket; refused")
        # The O_PATH fd pins the inode we checked; reopening it via procfs cannot reach
        # another one, whatever the guest renames meanwhile.
        try:
            return os.open(f"/proc/self/fd/{opath}", flags | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError:
            raise HostError("/proc is not mounted on the node; file access needs it") from None

    # ------------------------------------------------------------------ writing

    def _replace_file(
        self,
        dirfd: int,
        p: _Path,
        fill: Callable[[int], None],
        mode: int,
        huid: int,
        hgid: int,
        mtime: float | None = None,
    ) -> None:
        """Create a temp file beside ``p``, fill it, then renameat it over ``p``."""
        self._refuse_dir(dirfd, p)
        tmp = _TMP_PREFIX + secrets.token_hex(8)
        # O_EXCL|O_NOFOLLOW: never open something the guest planted under our temp name.
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dirfd,
        )
        try:
            with _fd(fd):
                fill(fd)
                os.fchown(fd, huid, hgid)
                os.fchmod(fd, mode)  # after chown, which clears set-id bits
                if mtime is not None:
                    os.utime(fd, (mtime, mtime))
            os.rename(tmp, p.name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
        except BaseException:
            _unlink_quiet(dirfd, tmp)
            raise

    def _append(self, dirfd: int, p: _Path, data: bytes, mode: int, huid: int, hgid: int) -> None:
        for _ in range(8):
            try:
                opath = os.open(p.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            except FileNotFoundError:
                try:
                    fd = os.open(
                        p.name,
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600,
                        dir_fd=dirfd,
                    )
                except FileExistsError:
                    continue  # created meanwhile: open the existing one
                with _fd(fd):
                    os.fchown(fd, huid, hgid)
                    os.fchmod(fd, mode)
                    _write_all(fd, data)
                return
            with _fd(opath):
                with _fd(self._reopen_regular(opath, os.O_WRONLY | os.O_APPEND, p.text)) as fd:
                    _write_all(fd, data)
            return
        raise Conflict(f"{p.text}: kept changing while appending; retry")

    def _replace_symlink(self, dirfd: int, p: _Path, target: str, huid: int, hgid: int) -> None:
        self._refuse_dir(dirfd, p)
        tmp = _TMP_PREFIX + secrets.token_hex(8)
        os.symlink(target, tmp, dir_fd=dirfd)
        try:
            os.chown(tmp, huid, hgid, dir_fd=dirfd, follow_symlinks=False)
            os.rename(tmp, p.name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
        except BaseException:
            _unlink_quiet(dirfd, tmp)
            raise

    def _replace_hardlink(self, root: int, src: _Path, dirfd: int, p: _Path) -> None:
        with _errors(src.text), _fd(self._parent_fd(root, src, create=False)) as sdir:
            st = os.stat(src.name, dir_fd=sdir, follow_symlinks=False)
            if st_.S_ISDIR(st.st_mode):
                raise InvalidRequest(f"{src.text}: is a directory; cannot hard-link it")
            self._refuse_dir(dirfd, p)
            tmp = _TMP_PREFIX + secrets.token_hex(8)
            # follow_symlinks=False: linkat without AT_SYMLINK_FOLLOW links a symlink
            # itself, never what it points to.
            os.link(src.name, tmp, src_dir_fd=sdir, dst_dir_fd=dirfd, follow_symlinks=False)
        try:
            os.rename(tmp, p.name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
        finally:
            # rename() between two links of one inode succeeds without doing anything
            # (the same archive uploaded twice), so the temp name may still be there.
            _unlink_quiet(dirfd, tmp)

    @staticmethod
    def _refuse_dir(dirfd: int, p: _Path) -> None:
        # rename() would refuse too (EISDIR), but this gives the clearer message early.
        try:
            st = os.stat(p.name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if st_.S_ISDIR(st.st_mode):
            raise InvalidRequest(f"{p.text}: is a directory")

    # ------------------------------------------------------------------ trees

    def _rmtree(self, dirfd: int, p: _Path) -> None:
        """Remove the tree ``p.name`` below ``dirfd``, iteratively and fd-based.

        Directories are opened with RESOLVE_BENEATH|NO_SYMLINKS from ``dirfd``, so an
        entry swapped to a symlink fails to open and is unlinked as the link it now is;
        an entry whose *ancestor* was swapped is dropped, and the ancestor (still on the
        stack) deals with the link when it is visited again. The stack holds paths, not
        fds, so depth does not cost file descriptors.
        """
        stack: list[tuple[str, ...]] = [(p.name,)]
        retries: dict[tuple[str, ...], int] = {}

        def again(parts: tuple[str, ...], where: str) -> None:
            retries[parts] = retries.get(parts, 0) + 1
            if retries[parts] > _RMDIR_RETRIES:
                raise Conflict(f"{where}: keeps changing during removal; retry")

        while stack:
            parts = stack[-1]
            where = p.parent.child(*parts).text
            try:
                fd = self._open_beneath(dirfd, parts, _DIR | os.O_NOFOLLOW)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    raise _translate(e, where) from None
                try:  # not a directory (any more): unlink it as what it is now
                    self._at_parent(dirfd, parts, os.unlink)
                except IsADirectoryError:
                    again(parts, where)  # a directory again: visit it again
                    continue
                except OSError as e2:
                    raise _translate(e2, where) from None
                stack.pop()
                continue
            subdirs: list[str] = []
            with _fd(fd), os.scandir(fd) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                        continue
                    try:
                        os.unlink(entry.name, dir_fd=fd)
                    except FileNotFoundError:
                        pass
                    except IsADirectoryError:
                        subdirs.append(entry.name)
            if subdirs:
                stack.extend(parts + (name,) for name in subdirs)
                continue
            try:
                self._at_parent(dirfd, parts, os.rmdir)
            except OSError as e:
                # ENOTEMPTY: refilled meanwhile; ENOTDIR: swapped to a link. Look again.
                if e.errno not in (errno.ENOTEMPTY, errno.ENOTDIR):
                    raise _translate(e, where) from None
                again(parts, where)
                continue
            stack.pop()

    def _at_parent(self, top: int, parts: tuple[str, ...], op: Callable[..., None]) -> None:
        """Run ``op(name, dir_fd=parent)`` for the last of ``parts`` below ``top``.

        Nothing happens if the entry vanished, or if an ancestor is no longer a plain
        directory (then the entry is not where we found it, and is not ours to touch).
        """
        if len(parts) == 1:
            pfd = top
        else:
            try:
                pfd = self._open_beneath(top, parts[:-1], _DIR | os.O_NOFOLLOW)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    return
                raise
        try:
            op(parts[-1], dir_fd=pfd)
        except FileNotFoundError:
            pass
        finally:
            if pfd != top:
                os.close(pfd)

    def _add_path(self, tf: tarfile.TarFile, root: int, p: _Path, budget: _Budget) -> None:
        """Archive the entry named by ``p`` itself (a symlink stays a symlink)."""
        with _fd(self._parent_fd(root, p, create=False)) as dirfd:
            opath, st = _lstat_at(dirfd, p.name)
            with _fd(opath):
                if not st_.S_ISDIR(st.st_mode):
                    if not self._add_entry(tf, opath, st, p.name, {}, budget):
                        raise PathRefused(f"{p.text}: is a device, fifo or socket")
                    return
            flags = _DIR | os.O_NOFOLLOW
            with _fd(openat2(dirfd, p.name, flags, resolve=self._beneath)) as top:
                self._add_tree(tf, top, p, budget)

    def _add_tree(self, tf: tarfile.TarFile, top: int, p: _Path, budget: _Budget) -> None:
        """Archive everything below the directory ``top``, named relative to it."""
        links: dict[tuple[int, int], str] = {}
        stack: list[tuple[str, ...]] = [()]
        while stack:
            rel = stack.pop()
            where = p.child(*rel).text
            try:
                fd = self._open_beneath(top, rel, _DIR | os.O_NOFOLLOW)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
                    # Vanished or swapped to a link since we listed it, or a mount point
                    # (not guest content): archived as an empty directory at most.
                    continue
                raise _translate(e, where) from None
            with _fd(fd):
                subdirs = []
                for name in sorted(os.listdir(fd)):
                    try:
                        opath, st = _lstat_at(fd, name)
                    except FileNotFoundError:
                        continue
                    arcname = "/".join(rel + (name,))
                    with _fd(opath), _errors(p.child(*rel, name).text):
                        self._add_entry(tf, opath, st, arcname, links, budget)
                    if st_.S_ISDIR(st.st_mode):
                        subdirs.append(rel + (name,))
                stack.extend(reversed(subdirs))  # visit in name order

    def _add_entry(
        self,
        tf: tarfile.TarFile,
        opath: int,
        st: os.stat_result,
        arcname: str,
        links: dict[tuple[int, int], str],
        budget: _Budget,
    ) -> bool:
        """Add the entry behind the O_PATH fd ``opath`` (whose fstat is ``st``) without
        following it; False for the kinds a tar does not carry."""
        info = tarfile.TarInfo(arcname)
        info.mode = st_.S_IMODE(st.st_mode)
        info.mtime = st.st_mtime
        info.uid, info.gid = self._inside(st.st_uid, self.uid), self._inside(st.st_gid, self.gid)
        key = (st.st_dev, st.st_ino)
        if st_.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
        elif st_.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink("", dir_fd=opath)
            tf.addfile(info)
        elif st_.S_ISREG(st.st_mode) and st.st_nlink > 1 and key in links:
            info.type, info.linkname = tarfile.LNKTYPE, links[key]
            tf.addfile(info)
        elif st_.S_ISREG(st.st_mode):
            with _fd(self._reopen_regular(opath, os.O_RDONLY, arcname)) as fd:
                info.size = os.fstat(fd).st_size
                budget.take(info.size, arcname)
                tf.addfile(info, _Exact(fd, info.size))
            if st.st_nlink > 1:
                links[key] = arcname
        else:
            return False
        return True

    # ------------------------------------------------------------------ archives in

    def _members(
        self, src: BinaryIO
    ) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo, tuple[str, ...]]]:
        """Members of an archive read front to back, each checked (names, types, sizes)
        before it is yielded with its name as components below the destination."""
        budget = _Budget(self.max_file)
        with _archive_errors():
            stream = _tar_stream(src, self.max_file + _HEADER_ALLOWANCE)
            tf = tarfile.open(fileobj=cast(BinaryIO, stream), mode="r|")
        with tf:
            members = iter(tf)
            for count in itertools.count(1):
                with _archive_errors():
                    m = next(members, None)
                if m is None:
                    return
                if count > MAX_MEMBERS:
                    raise InvalidRequest(f"the archive has more than {MAX_MEMBERS} members")
                parts = _member_parts(m)
                if m.isreg():
                    budget.take(m.size, f"archive member {m.name!r}")
                yield tf, m, parts

    def _scan_archive(self, src: BinaryIO) -> None:
        for _ in self._members(src):
            pass

    def _extract(self, root: int, dest: _Path, src: BinaryIO, huid: int, hgid: int) -> int:
        count = 0
        for tf, m, parts in self._members(src):
            count += 1
            if not parts:
                continue  # "./": the destination itself, which exists
            target = dest.child(*parts)
            try:
                with _errors(target.text):
                    self._extract_one(root, dest, target, tf, m, huid, hgid)
            except CorralError as e:
                raise type(e)(f"archive member {m.name!r}: {e.message}") from None
        return count

    def _extract_one(
        self,
        root: int,
        dest: _Path,
        target: _Path,
        tf: tarfile.TarFile,
        m: tarfile.TarInfo,
        huid: int,
        hgid: int,
    ) -> None:
        mode = m.mode & 0o7777
        if m.isdir():
            os.close(self._mkdirs(root, target, mode, huid, hgid))
            return
        with _fd(self._parent_fd(root, target, create=True)) as dirfd:
            if m.issym():
                self._replace_symlink(dirfd, target, m.linkname, huid, hgid)
            elif m.islnk():
                self._replace_hardlink(root, dest.child(*_link_parts(m)), dirfd, target)
            elif m.isreg():
                stream = tf.extractfile(m)
                assert stream is not None

                def fill(fd: int) -> None:
                    while True:
                        with _archive_errors():  # decompression happens in this read
                            chunk = stream.read(_CHUNK)
                        if not chunk:
                            return
                        _write_all(fd, chunk)

                self._replace_file(dirfd, target, fill, mode, huid, hgid, mtime=m.mtime)
            else:
                raise InvalidRequest(f"unsupported member type {m.type!r}")

    # ------------------------------------------------------------------ small helpers

    def _host_ids(self, uid: int, gid: int) -> tuple[int, int]:
        for v, what in ((uid, "owner_uid"), (gid, "owner_gid")):
            if not isinstance(v, int) or not 0 <= v < ID_RANGE:
                raise InvalidRequest(f"{what} {v!r} is outside the sandbox's ids 0..{ID_RANGE - 1}")
        return self.uid + uid, self.gid + gid

    @staticmethod
    def _inside(host_id: int, base: int) -> int:
        return host_id - base if base <= host_id < base + ID_RANGE else OVERFLOW_ID

    @staticmethod
    def _check_mode(mode: int, p: _Path) -> None:
        if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"{p.text}: mode {mode!r} is not a permission mode (0..0o7777)")

    @staticmethod
    def _check_name(p: _Path, verb: str) -> None:
        if not p.parts:
            raise InvalidRequest(f"cannot {verb} the sandbox root '/'")
        if p.parts[-1] == "..":
            raise InvalidRequest(f"{p.text}: cannot {verb} '..'; name the entry itself")

    def _filestat(self, p: _Path, st: os.stat_result, target: str | None) -> FileStat:
        m = st.st_mode
        kind: Literal["file", "dir", "symlink", "other"] = "other"
        if st_.S_ISDIR(m):
            kind = "dir"
        elif st_.S_ISLNK(m):
            kind = "symlink"
        elif st_.S_ISREG(m):
            kind = "file"
        return FileStat(
            path=p.text,
            name=p.name,
            type=kind,
            size=st.st_size,
            mode=st_.S_IMODE(m),
            mtime=st.st_mtime,
            uid=self._inside(st.st_uid, self.uid),
            gid=self._inside(st.st_gid, self.gid),
            target=target,
        )


def _lstat_at(dirfd: int, name: str) -> tuple[int, os.stat_result]:
    """An O_PATH fd of the entry ``name`` itself (never followed) and its fstat: one
    inode, so the type, link target and content we report cannot come from two."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def _link_target(opath: int, st: os.stat_result) -> str | None:
    # readlinkat(fd, "") reads the link an O_PATH|O_NOFOLLOW fd refers to.
    return os.readlink("", dir_fd=opath) if st_.S_ISLNK(st.st_mode) else None


def _member_parts(m: tarfile.TarInfo) -> tuple[str, ...]:
    """The member's name as components below the destination; refuse escapes."""
    if m.ischr() or m.isblk() or m.isfifo():
        raise PathRefused(f"archive member {m.name!r} is a device or fifo; refused")
    parts = _safe_rel(m.name, f"archive member {m.name!r}")
    if not parts and not m.isdir():
        raise InvalidRequest(f"archive member {m.name!r} names the destination itself")
    if m.issym() and ("\0" in m.linkname or not m.linkname or len(m.linkname) >= MAX_PATH):
        raise PathRefused(f"archive member {m.name!r} has an invalid symlink target")
    if m.islnk():
        _link_parts(m)
    return parts


def _link_parts(m: tarfile.TarInfo) -> tuple[str, ...]:
    parts = _safe_rel(m.linkname, f"hard link {m.name!r} -> {m.linkname!r}")
    if not parts:
        raise PathRefused(f"hard link {m.name!r} points at the destination directory")
    return parts


def _safe_rel(name: str, what: str) -> tuple[str, ...]:
    if "\0" in name:
        raise PathRefused(f"{what}: the name contains a NUL byte")
    if name.startswith("/"):
        raise PathRefused(f"{what}: absolute names are refused")
    parts = [c for c in name.split("/") if c not in ("", ".")]
    if ".." in parts:
        raise PathRefused(f"{what}: '..' components are refused")
    if len(os.fsencode(name)) > MAX_PATH:
        raise PathRefused(f"{what}: the name is longer than {MAX_PATH} bytes")
    _check_parts(parts, what)
    return tuple(parts)


def _seekable(f: BinaryIO) -> bool:
    try:
        return bool(f.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    chunks, left = [], length
    while left > 0:
        chunk = os.pread(fd, min(left, _CHUNK), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _unlink_quiet(dirfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dirfd)
    except OSError:
        pass
