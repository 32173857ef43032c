"""Swap space that corral adds for paused sandboxes: a zram device or a swap file.

A node adds swap only when its config asks for it, records what it added in a small JSON
file in its state dir, and removes exactly that (swapoff, then zram reset and hot_remove,
or unlink of the file) when it tears down or in ``corral node gc``. Swap it did not add is
never touched: zram devices come from ``/sys/class/zram-control/hot_add`` (a new device,
never an existing /dev/zram0), swap files are corral's own files.

Example::

    rec = SwapRecord(Path("/var/lib/corral/swap.json"))
    dev = add_file(Path("/var/lib/corral/swap/corral.swap"), 8 << 30)   # or add_zram(8 << 30)
    rec.save(dev)
    ...
    remove(dev); rec.clear()

zram keeps compressed pages in RAM: memory of random bytes does not shrink there, only a
swap file on disk releases it (see :func:`zram_stats` to count the compressed size).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from corral.errors import HostError
from corral.host._sys import errtext, libc

__all__ = [
    "SwapDevice",
    "SwapRecord",
    "add_zram",
    "add_file",
    "remove",
    "active",
    "zram_stats",
]

_ZRAM_CONTROL = Path("/sys/class/zram-control")
_SWAP_FLAG_PREFER = 0x8000
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_NOCOW_FL = 0x00800000


@dataclass(frozen=True)
class SwapDevice:
    """One swap area corral added."""

    kind: Literal["zram", "file"]
    path: str
    """``/dev/zramN`` or the swap file's path."""
    size: int


def active() -> dict[str, int]:
    """Swap areas in use on the host: path -> bytes used (from /proc/swaps)."""
    out: dict[str, int] = {}
    with open("/proc/swaps") as f:
        for line in list(f)[1:]:
            p = line.split()
            if len(p) >= 4:
                out[p[0].replace("\\040", " ")] = int(p[3]) * 1024
    return out


def _swapon(path: str, priority: int) -> None:
    # Safe: the area is one corral just made (a fresh zram device or its own file).
    flags = _SWAP_FLAG_PREFER | (priority & 0x7FFF)
    if libc.swapon(path.encode(), flags) != 0:
        e = ctypes.get_errno()
        raise HostError(f"swap: swapon {path}: {errtext(e)}")


def _swapoff(path: str) -> None:
    if path not in active():
        return
    # swapoff pages everything back into RAM first; it can take a while for a full area.
    if libc.swapoff(path.encode()) != 0:
        e = ctypes.get_errno()
        if e != errno.EINVAL:  # EINVAL: not (any more) a swap area
            raise HostError(f"swap: swapoff {path}: {errtext(e)}")


def _mkswap(path: str) -> None:
    try:
        r = subprocess.run(["mkswap", path], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise HostError("swap: mkswap not found (install util-linux)") from None
    if r.returncode != 0:
        raise HostError(f"swap: mkswap {path} failed: {r.stderr.strip()[:300]}")


def add_zram(size: int, algorithm: str = "lz4", priority: int = 100) -> SwapDevice:
    """A new zram device of ``size`` bytes (uncompressed), made swap and switched on."""
    control = _ZRAM_CONTROL / "hot_add"
    try:
        num = int(control.read_text().strip())
    except OSError as e:
        raise HostError(
            f"swap: cannot add a zram device ({control}: {errtext(e.errno or 0)}); "
            "is the zram module loaded (modprobe zram)?"
        ) from None
    dev = SwapDevice("zram", f"/dev/zram{num}", size)
    try:
        sysdir = Path(f"/sys/block/zram{num}")
        algos = (sysdir / "comp_algorithm").read_text().replace("[", "").replace("]", "").split()
        if algorithm in algos:
            (sysdir / "comp_algorithm").write_text(algorithm)
        (sysdir / "disksize").write_text(str(size))
        _wait_for(dev.path)
        _mkswap(dev.path)
        _swapon(dev.path, priority)
    except BaseException:
        with contextlib.suppress(Exception):
            remove(dev)
        raise
    return dev


def _wait_for(path: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise HostError(f"swap: {path} did not appear")
        time.sleep(0.01)


def add_file(path: Path, size: int, priority: int = 10) -> SwapDevice:
    """A swap file of ``size`` bytes at ``path`` (created; must not exist), switched on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    dev = SwapDevice("file", str(path), size)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise HostError(f"swap: {path} exists already (left by a crash? run corral node gc)")
    try:
        try:
            # btrfs refuses swap files with copy-on-write; the flag must be set while the
            # file is empty. Other filesystems do not know the flag: that is fine.
            flags = ctypes.c_int(0)
            fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags)
            flags.value |= _FS_NOCOW_FL
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags)
        except OSError:
            pass
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise HostError(f"swap: allocating {size} bytes for {path}: {errtext(e.errno or 0)}")
    finally:
        os.close(fd)
    try:
        _mkswap(str(path))
        _swapon(str(path), priority)
    except BaseException:
        with contextlib.suppress(Exception):
            remove(dev)
        raise
    return dev


def remove(dev: SwapDevice) -> None:
    """swapoff ``dev`` and remove it (zram: reset + hot_remove; file: unlink). Idempotent."""
    _swapoff(dev.path)
    if dev.kind == "zram":
        num = dev.path.removeprefix("/dev/zram")
        sysdir = Path(f"/sys/block/zram{num}")
        if sysdir.exists():
            with contextlib.suppress(OSError):
                (sysdir / "reset").write_text("1")
            try:
                (_ZRAM_CONTROL / "hot_remove").write_text(num)
            except OSError as e:
                if e.errno != errno.ENODEV:
                    raise HostError(
                        f"swap: zram{num} hot_remove: {errtext(e.errno or 0)}"
                    ) from None
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dev.path)


def zram_stats(dev: SwapDevice) -> dict[str, int]:
    """Bytes stored (``orig``), compressed (``compr``) and RAM used (``mem_used``) by a zram
    device; empty for a swap file."""
    if dev.kind != "zram":
        return {}
    num = dev.path.removeprefix("/dev/zram")
    try:
        f = Path(f"/sys/block/zram{num}/mm_stat").read_text().split()
    except OSError:
        return {}
    return {"orig": int(f[0]), "compr": int(f[1]), "mem_used": int(f[2])}


class SwapRecord:
    """What a node added, kept in a JSON file so that a later open or gc removes it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[SwapDevice]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except ValueError:
            raise HostError(f"swap: {self.path} is not valid JSON; remove it after checking")
        return [SwapDevice(d["kind"], d["path"], int(d["size"])) for d in data]

    def save(self, devices: list[SwapDevice]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps([asdict(d) for d in devices]))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
