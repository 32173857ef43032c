"""Run a build tool, keep the tail of its output for error messages, and show its latest
line on a progress Step."""

from __future__ import annotations

import collections
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence

from corral.errors import BuildError, HostError
from corral.images._progress import Step

__all__ = ["run_tool", "ToolFailed"]

_TAIL_LINES = 40
_PACKAGES = {
    "mkfs.erofs": "erofs-utils",
    "mmdebstrap": "mmdebstrap",
    "debootstrap": "debootstrap",
    "tar": "tar",
    "cp": "coreutils",
    "unshare": "util-linux",
}
"""The Debian package of each tool a build runs, for the error when one is missing."""


class ToolFailed(BuildError):
    """A build tool exited non-zero; ``output`` holds the tail of what it printed."""

    def __init__(self, message: str, output: str, returncode: int | None) -> None:
        super().__init__(message)
        self.output = output
        self.returncode = returncode


def run_tool(
    argv: Sequence[str],
    *,
    what: str,
    step: Step | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    on_line: Callable[[str], None] | None = None,
) -> str:
    """Run ``argv`` with stdout and stderr merged; return its output tail.

    Raises HostError when the program is missing and ToolFailed (a BuildError) naming
    ``what`` with the last lines of output when it fails or runs past ``timeout``.
    ``on_line`` is called with every output line (e.g. to count files for a progress bar).
    """
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            # Its own process group, so a timeout kills helpers the tool started too.
            start_new_session=True,
        )
    except FileNotFoundError:
        tool = os.path.basename(argv[0])
        package = _PACKAGES.get(tool)
        fix = f" (Debian package {package}: apt-get install {package})" if package else ""
        raise HostError(f"{what}: {tool} is not installed on this host{fix}") from None
    timed_out = threading.Event()

    def _kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, _kill) if timeout else None
    if timer is not None:
        timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            tail.append(line)
            if on_line is not None:
                on_line(line)
            elif step is not None and line.strip():
                step.note(line)
        rc = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        if proc.poll() is None:
            _kill()
            proc.wait()
    out = "\n".join(tail)
    if timed_out.is_set():
        raise ToolFailed(
            f"{what} ran past its timeout of {timeout:g} s; last output:\n{out}", out, None
        )
    if rc != 0:
        raise ToolFailed(f"{what} failed with exit code {rc}; last output:\n{out}", out, rc)
    return out
