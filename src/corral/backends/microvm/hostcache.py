"""The page cache of the files every VM shares (QEMU, its libraries, the guest kernel and
initramfs), read in by the node so that it is charged to the node, not to one sandbox.

Why: the kernel charges a page-cache page to the cgroup of the task that first reads it,
and a page stays charged there until it is evicted. With a cold cache the first VM to
boot reads QEMU's binary and libraries, the kernel image and the initramfs (measured:
55 MiB, readahead included) and they count against *its* memory limit and stay in its
cgroup after a memory-snapshot pause (its ``pause_released_fraction`` fell to 0.645,
against 0.996 with a warm cache). They are the node's: every VM maps the same pages. So
the engine reads them once at start (:func:`charge_to_node`), from the node's own cgroup.
A page evicted later under memory pressure is charged to the next VM that reads it again;
this is best effort, not a guarantee.

Not the image layers: they are per image, large, and shared with containers, whose first
reader is charged the same way (docs/design-notes.md, "MicroVMs").
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

__all__ = ["charge_to_node", "vmm_files"]

log = logging.getLogger("corral.backends.microvm")

_CHUNK = 1 << 20


def vmm_files(qemu: str) -> list[Path]:
    """QEMU's binary, the shared libraries it links (``ldd``) and its TCG accelerator
    module; empty if QEMU is not found."""
    found = shutil.which(qemu)
    if found is None:
        return []
    binary = Path(found).resolve()
    files = [binary]
    try:
        # Safe: ldd on the host's QEMU binary (a fixed argv, no shell).
        r = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30)
        for line in r.stdout.splitlines():
            _, arrow, rest = line.partition("=>")
            if arrow and rest.split() and rest.split()[0].startswith("/"):
                files.append(Path(rest.split()[0]))
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("ldd %s: %s", binary, e)
    # QEMU loads its accelerator from its module dir (Debian: /usr/lib/<triplet>/qemu)
    files += sorted(binary.parent.parent.glob("lib/*/qemu/accel-tcg-*.so"))
    return files


def charge_to_node(paths: list[Path]) -> int:
    """Read every file of ``paths`` through the page cache (from the calling process, so
    from the node's cgroup); returns the bytes read. A file that cannot be read is
    skipped and logged. Blocking: run it in a thread."""
    total = 0
    for p in paths:
        try:
            with open(p, "rb", buffering=0) as f:
                while chunk := f.read(_CHUNK):
                    total += len(chunk)
        except OSError as e:
            log.warning("reading %s into the page cache: %s", p, e)
    return total
