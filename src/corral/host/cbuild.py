"""Build corral's small static C programs (the sandbox init, the runtime spawn helper).

Each binary is named after the sha256 of its source (12 hex digits), compiled to a
temporary name and renamed into place, so concurrent callers and crashed builds never
leave a half-written binary under the final name, and a changed source gets a new file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from corral.errors import HostError

__all__ = ["build_static", "built_path"]


def built_path(name: str, source: bytes, out_dir: Path) -> Path:
    """Where :func:`build_static` puts ``name`` built from ``source`` (it may not exist)."""
    return Path(out_dir) / f"{name}-{hashlib.sha256(source).hexdigest()[:12]}"


def build_static(name: str, source: bytes, cflags: Sequence[str], out_dir: Path) -> Path:
    """``out_dir/<name>-<hash>``, compiled with gcc from ``source`` unless already there.

    Raises HostError naming the program and carrying the compiler output on failure."""
    out = built_path(name, source, out_dir)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        try:
            proc = subprocess.run(
                ["gcc", *cflags, "-x", "c", "-o", tmp, "-"],
                input=source,
                capture_output=True,
                timeout=300,
            )
        except FileNotFoundError as e:
            raise HostError(f"cannot build {name}: gcc is not installed on this node") from e
        except subprocess.TimeoutExpired as e:
            raise HostError(f"cannot build {name}: gcc took over {e.timeout:.0f} s") from e
        if proc.returncode != 0:
            raise HostError(
                f"cannot build {name}: gcc {' '.join(cflags)} failed (exit {proc.returncode}):\n"
                + (proc.stderr or proc.stdout).decode(errors="replace").strip()
            )
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
