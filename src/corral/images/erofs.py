"""Build EROFS layer images with mkfs.erofs (erofs-utils 1.5: directory input only).

Layers must be reproducible, so that the same tree always gives the same digest and two
hosts that build the same layer agree. erofs-utils 1.5 can only make an image
deterministic by flattening every file's mtime (``-T``), which would make every ``.pyc``
stale and confuse ``make``. So ``mkfs`` keeps each file's mtime (``--preserve-mtime``) and
afterwards rewrites the two superblock fields that depend on the moment of the build:

* ``build_time`` / ``build_time_nsec`` are set to 0;
* the UUID (``-U`` all zero while building) becomes the first 16 bytes of the SHA-256 of
  the image, so distinct layers get distinct UUIDs (overlayfs compares lower-layer UUIDs)
  and identical layers identical ones;

then the superblock CRC32C is recomputed. With ``--preserve-mtime`` every inode whose
mtime differs from the build time is stored in extended form with its own mtime, so
changing ``build_time`` afterwards alters no file's timestamp (an inode could only
inherit it if its mtime equalled the build moment to the nanosecond).

Example::

    mkfs(Path("rootfs"), Path("/store/tmp/x.erofs"), compress="lz4")
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import BinaryIO

from corral.errors import BuildError, HostError, InvalidRequest
from corral.images._proc import ToolFailed, run_tool

__all__ = ["mkfs", "version", "COMPRESSIONS", "EROFS_MAGIC"]

MKFS = "mkfs.erofs"
EROFS_MAGIC = 0xE0F5E1E2
_SB_OFFSET = 1024
_SB_FEATURE_SB_CHKSUM = 0x1
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"

COMPRESSIONS = (None, "lz4", "lz4hc")
"""What ``mkfs(compress=...)`` accepts; the kernel here decompresses lz4 (and lz4hc, which
writes lz4 data) and erofs-utils 1.5 offers no other compressor."""
LZ4HC_PCLUSTER = 64 << 10
"""lz4hc compresses 64 KiB physical clusters ("big pclusters", kernel 5.13+): with the
default 4 KiB ones it gains nothing over lz4. Measured on the workspace bench's 50 MiB of
source-like files: none 50.5 MiB, lz4 35.2, lz4hc (4 KiB) 35.2, lz4hc 64 KiB 23.6. A read
then decompresses up to 64 KiB, which a network store fetches in blocks of that size
anyway; it is the choice for layers read over a network by many sandboxes."""


@functools.cache
def version() -> str:
    """The erofs-utils version, e.g. ``"1.5"`` (HostError if mkfs.erofs is missing)."""
    # 1.5 has no --version; it prints "mkfs.erofs 1.5" once its arguments parse, so build
    # an image of an empty directory (a millisecond) and read the banner.
    with tempfile.TemporaryDirectory(prefix="corral-erofs-") as tmp:
        try:
            res = subprocess.run(
                [MKFS, f"{tmp}/v.erofs", tmp],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except FileNotFoundError:
            raise HostError(f"{MKFS} is not installed (Debian package erofs-utils)") from None
    m = re.search(r"mkfs\.erofs\s+(?:\(erofs-utils\)\s+)?(\d[\w.+~-]*)", res.stdout + res.stderr)
    if not m:
        raise HostError(f"could not read the version of {MKFS}: {(res.stdout + res.stderr)[:300]}")
    return m.group(1)


DAX = "dax"
"""The ``compress`` setting for layers a microVM maps with DAX: uncompressed, and no file
tail packed inline beside its inode (EROFS maps only block-aligned, uncompressed file
data: a packed tail, or any compressed file, is copied into the guest's page cache)."""


def _compress_args(compress: str | None) -> list[str]:
    if compress is None or compress in ("", "none"):
        return []
    if compress == DAX:
        return ["-Enoinline_data"]
    algo, _, level = compress.partition(",")
    if algo not in ("lz4", "lz4hc") or (level and not level.isdigit()):
        raise InvalidRequest(
            f"compression {compress!r} is not supported; use None, 'dax', 'lz4' or 'lz4hc[,LEVEL]'"
        )
    return [f"-z{compress}"] + ([f"-C{LZ4HC_PCLUSTER}"] if algo == "lz4hc" else [])


def mkfs(src_dir: Path, out_file: Path, *, compress: str | None = "lz4") -> None:
    """Build ``out_file`` from the tree at ``src_dir``, reproducibly.

    Ownership, modes, mtimes, symlinks, hardlinks, device nodes (overlay whiteouts are
    char 0/0) and xattrs (``trusted.overlay.opaque`` included) are kept as on disk.
    Raises BuildError with mkfs.erofs's output when it fails, HostError when it is absent.
    """
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise BuildError(f"cannot build a layer from {src_dir}: not a directory")
    argv = [
        MKFS,
        f"-U{_ZERO_UUID}",
        "--preserve-mtime",
        *_compress_args(compress),
        str(out_file),
        str(src_dir),
    ]
    try:
        run_tool(argv, what=f"{MKFS} of {src_dir}")
    except ToolFailed as e:
        raise BuildError(f"{MKFS} could not build {out_file} from {src_dir}:\n{e.output}") from None
    _normalize_superblock(Path(out_file))


def _normalize_superblock(path: Path) -> None:
    with open(path, "r+b") as f:
        head = bytearray(f.read(4096))
        if len(head) < _SB_OFFSET + 128:
            raise BuildError(f"{MKFS} wrote {path} too short to be an EROFS image")
        magic, _csum, feature_compat, blkszbits = struct.unpack_from("<IIIB", head, _SB_OFFSET)
        if magic != EROFS_MAGIC:
            raise BuildError(f"{MKFS} wrote {path} without the EROFS magic number")
        block = 1 << blkszbits
        if block != 4096:
            raise BuildError(f"{path}: unexpected EROFS block size {block}")
        # build_time (u64 at +24) and build_time_nsec (u32 at +32).
        struct.pack_into("<QI", head, _SB_OFFSET + 24, 0, 0)
        # Hash with a zero UUID and zero checksum, so the result depends on content only.
        struct.pack_into("<I", head, _SB_OFFSET + 4, 0)
        head[_SB_OFFSET + 48 : _SB_OFFSET + 64] = bytes(16)
        uuid = bytearray(_hash_with_head(f, bytes(head))[:16])
        uuid[6] = (uuid[6] & 0x0F) | 0x80  # RFC 9562 version 8 (custom)
        uuid[8] = (uuid[8] & 0x3F) | 0x80  # RFC 4122 variant
        head[_SB_OFFSET + 48 : _SB_OFFSET + 64] = uuid
        if feature_compat & _SB_FEATURE_SB_CHKSUM:
            crc = crc32c_raw(0xFFFFFFFF, bytes(head[_SB_OFFSET:block]))
            struct.pack_into("<I", head, _SB_OFFSET + 4, crc)
        f.seek(0)
        f.write(head)
        f.flush()
        os.fsync(f.fileno())


def _hash_with_head(f: BinaryIO, head: bytes) -> bytes:
    h = hashlib.sha256(head)
    f.seek(len(head))
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.digest()


@functools.cache
def _crc32c_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


def crc32c_raw(seed: int, data: bytes) -> int:
    """CRC32C without the final inversion, as EROFS stores it (3 KiB: pure Python is fine)."""
    table = _crc32c_table()
    c = seed
    for byte in data:
        c = table[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c
