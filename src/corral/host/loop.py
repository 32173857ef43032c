"""Loop devices, attached with LOOP_CONFIGURE and autoclear.

With ``LO_FLAGS_AUTOCLEAR`` the kernel detaches the device when its last user goes away,
so a filesystem mounted from it frees the device on unmount and a crash of the agent
leaks nothing once the mount is gone. Used by the btrfs scratch filesystem and, on
kernels without file-backed EROFS, by layer mounts.

Example::

    dev = loop.attach(Path("/var/lib/corral/scratch.img"))
    mount(dev.path, ...)      # the mount takes its own reference
    dev.close()               # now the unmount frees /dev/loopN
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from corral.errors import HostError
from corral.host._sys import errtext

__all__ = ["LoopDevice", "attach", "detach", "backed_by"]

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LOOP_CLR_FD = 0x4C01
_LO_FLAGS_READ_ONLY = 1
_LO_FLAGS_AUTOCLEAR = 4


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_char * 64),
        ("lo_crypt_name", ctypes.c_char * 64),
        ("lo_encrypt_key", ctypes.c_char * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", _LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    ]


@dataclass
class LoopDevice:
    """An attached loop device; ``fd`` keeps it alive until :meth:`close`."""

    path: Path
    fd: int

    def close(self) -> None:
        """Drop our reference; with autoclear and no other user the device detaches."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def attach(backing: Path, read_only: bool = False, autoclear: bool = True) -> LoopDevice:
    """Attach ``backing`` to a free loop device (retrying if another attach races us)."""
    flags = os.O_RDONLY if read_only else os.O_RDWR
    try:
        file_fd = os.open(backing, flags | os.O_CLOEXEC)
    except OSError as e:
        raise HostError(f"loop attach: cannot open {backing}: {errtext(e.errno or 0)}") from None
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(32):
                number = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
                dev = Path(f"/dev/loop{number}")
                try:
                    dev_fd = os.open(dev, flags | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue  # udev-less hosts: the node appears a moment later
                cfg = _LoopConfig()
                cfg.fd = file_fd
                cfg.info.lo_flags = (_LO_FLAGS_AUTOCLEAR if autoclear else 0) | (
                    _LO_FLAGS_READ_ONLY if read_only else 0
                )
                cfg.info.lo_file_name = os.fsencode(backing)[:63]
                try:
                    # Safe: binds a corral-owned image file to a device nobody else
                    # holds (EBUSY if someone took it first, then we pick another).
                    fcntl.ioctl(dev_fd, _LOOP_CONFIGURE, bytes(cfg))
                except OSError as e:
                    os.close(dev_fd)
                    if e.errno == errno.EBUSY:
                        continue
                    raise HostError(
                        f"loop attach {backing} to {dev}: {errtext(e.errno or 0)}"
                    ) from None
                return LoopDevice(dev, dev_fd)
            raise HostError(f"loop attach {backing}: no free loop device after 32 tries")
        finally:
            os.close(ctl)
    except OSError as e:
        raise HostError(f"loop attach {backing}: {errtext(e.errno or 0)}") from None
    finally:
        os.close(file_fd)  # the loop device holds its own reference to the file


def detach(dev: Path) -> None:
    """Detach a loop device now (not needed with autoclear); unbound is not an error."""
    try:
        fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        # Safe: only devices whose backing file corral named (see backed_by).
        fcntl.ioctl(fd, _LOOP_CLR_FD)
    except OSError as e:
        if e.errno != errno.ENXIO:
            raise HostError(f"loop detach {dev}: {errtext(e.errno or 0)}") from None
    finally:
        os.close(fd)


def backed_by(prefix: Path) -> dict[Path, Path]:
    """Loop devices whose backing file lies under ``prefix``: {device: backing file}."""
    base = os.path.normpath(str(prefix)).rstrip("/") + "/"
    found: dict[Path, Path] = {}
    for entry in Path("/sys/block").glob("loop*"):
        try:
            backing = (entry / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if backing.startswith(base) or backing == base.rstrip("/"):
            found[Path("/dev") / entry.name] = Path(backing)
    return found
