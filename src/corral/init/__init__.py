"""corral-init: the static PID 1 of every container sandbox, and how to build it.

The C source ships inside the package; the node compiles it once per source version::

    from corral.init import ensure_built
    init = ensure_built(Path("/var/lib/corral/bin"))   # .../corral-init-<12 hex>

The protocol it speaks is docs/init-protocol.md; the client is
:mod:`corral.backends.initclient`.
"""

from __future__ import annotations

from pathlib import Path

from corral.host.cbuild import build_static

__all__ = [
    "SOURCE",
    "TAR_SOURCE",
    "NOTHP_SOURCE",
    "CFLAGS",
    "ensure_built",
    "ensure_tar_built",
    "ensure_nothp_built",
]

SOURCE = Path(__file__).with_name("corral-init.c")
"""The single C file of the init."""

TAR_SOURCE = Path(__file__).with_name("corral-tar.c")
"""corral-tar: writes a guest's overlay upper as a pax tar (microVM snapshots)."""

NOTHP_SOURCE = Path(__file__).with_name("corral-nothp.c")
"""corral-nothp: runs a program (QEMU under TCG) with transparent huge pages disabled."""

CFLAGS = ("-static", "-O2", "-Wall", "-s")
"""Static, so it runs in any rootfs (no libc needed inside the image); stripped, small."""


def ensure_built(out_dir: Path) -> Path:
    """Compile corral-init into ``out_dir`` unless this source version is already there
    (see :func:`corral.host.cbuild.build_static`). Raises HostError with the compiler
    output when compiling fails."""
    return build_static("corral-init", SOURCE.read_bytes(), CFLAGS, out_dir)


def ensure_tar_built(out_dir: Path) -> Path:
    """Compile corral-tar (the microVM guest's upper-dir streamer) into ``out_dir``, as
    :func:`ensure_built` does for the init."""
    return build_static("corral-tar", TAR_SOURCE.read_bytes(), CFLAGS, out_dir)


def ensure_nothp_built(out_dir: Path) -> Path:
    """Compile corral-nothp (the host-side wrapper the microVM engine starts QEMU through
    under TCG) into ``out_dir``, as :func:`ensure_built` does for the init."""
    return build_static("corral-nothp", NOTHP_SOURCE.read_bytes(), CFLAGS, out_dir)
