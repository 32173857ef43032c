"""Whether CRIU (process checkpoint/restore) works on this host: ``criu check``.

corral never depends on it: snapshots and forks copy the filesystem only. The answer is
reported in the node's status, so an operator knows why processes are not carried over.
On the kernels we run on ``criu check`` fails (vDSO layout); CRIU may not be installed.

Example::

    ok, why = checkpoint_support()   # (False, "criu check: ... vdso ...")
"""

from __future__ import annotations

import functools
import shutil
import subprocess

__all__ = ["checkpoint_support"]


@functools.cache
def checkpoint_support() -> tuple[bool, str]:
    """(works, reason when it does not); runs ``criu check`` once per process (~40 ms)."""
    criu = shutil.which("criu")
    if criu is None:
        return False, "criu is not installed"
    try:
        proc = subprocess.run(
            [criu, "check"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"criu check could not run: {e}"
    if proc.returncode == 0:
        return True, ""
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    # The first error names the missing feature; the rest is its consequences.
    first = next((ln for ln in lines if ln.startswith("Error")), lines[0] if lines else "")
    return False, f"criu check failed (exit {proc.returncode}): {first[:300]}"
