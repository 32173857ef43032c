"""corral-init: the static PID 1 of every container sandbox, and how to build it.

The C source ships inside the package; the node compiles it once per source version::

    from corral.init import ensure_built
    init = ensure_built(Path("/var/lib/corral/bin"))   # .../corral-init-<12 hex>

The protocol it speaks is docs/init-protocol.md; the client is
:mod:`corral.backends.initclient`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from corral.errors import HostError

__all__ = ["SOURCE", "CFLAGS", "ensure_built"]

SOURCE = Path(__file__).with_name("corral-init.c")
"""The single C file of the init."""

CFLAGS = ("-static", "-O2", "-Wall", "-s")
"""Static, so it runs in any rootfs (no libc needed inside the image); stripped, small."""


def ensure_built(out_dir: Path) -> Path:
    """Compile the init into ``out_dir`` unless this source version is already there.

    The file is named after the source's sha256 (12 hex digits), written to a temporary
    name and renamed into place, so concurrent callers and crashed builds never leave a
    half-written binary under the final name. Raises HostError with the compiler output
    when compiling fails.
    """
    source = SOURCE.read_bytes()
    out = Path(out_dir) / f"corral-init-{hashlib.sha256(source).hexdigest()[:12]}"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".corral-init-", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        try:
            proc = subprocess.run(
                ["gcc", *CFLAGS, "-o", tmp, str(SOURCE)],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except FileNotFoundError as e:
            raise HostError("cannot build corral-init: gcc is not installed on this node") from e
        except subprocess.TimeoutExpired as e:
            raise HostError(f"cannot build corral-init: gcc took over {e.timeout:.0f} s") from e
        if proc.returncode != 0:
            raise HostError(
                f"cannot build corral-init: gcc {' '.join(CFLAGS)} {SOURCE} failed "
                f"(exit {proc.returncode}):\n{proc.stderr.strip() or proc.stdout.strip()}"
            )
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
