"""A small blocking QMP client (QEMU's JSON control protocol) for memory snapshots.

One VM's QMP socket (``qmp.sock`` in the sandbox dir, root's: QEMU made it before it
dropped to the VMM uid) is used by the node only, one caller at a time, from a worker
thread: a save or restore is a handful of commands and a poll, so a blocking socket is the
simplest correct client. File descriptors go to QEMU with ``getfd`` (SCM_RIGHTS): QEMU runs
chrooted into a directory it cannot list, so it is handed the snapshot file, never a path.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from corral.errors import SandboxError

__all__ = ["Qmp"]


class Qmp:
    """One QMP session (capabilities negotiated on open); use as a context manager."""

    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self._buf = b""
        try:
            self.sock.connect(str(path))
            self._read()  # the greeting
            self.cmd("qmp_capabilities")
        except OSError as e:
            self.sock.close()
            raise SandboxError(f"QMP {path}: {e}") from None

    def __enter__(self) -> Qmp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            try:
                chunk = self.sock.recv(65536)
            except OSError as e:  # a reset when QEMU exits mid-command (a failed restore)
                raise SandboxError(f"QMP {self.path}: {e}") from None
            if not chunk:
                raise SandboxError(f"QMP {self.path}: QEMU closed the connection")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        msg: dict[str, Any] = json.loads(line)
        return msg

    def cmd(self, name: str, fds: list[int] | None = None, **args: Any) -> Any:
        """Run one command; its ``return`` value. Events met meanwhile are skipped."""
        data = json.dumps({"execute": name, "arguments": args}).encode() + b"\n"
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.sendall(data)
        except OSError as e:  # QEMU gone (EPIPE) or stuck (timeout)
            raise SandboxError(f"QMP {name}: {e}") from None
        while True:
            msg = self._read()
            if "return" in msg:
                return msg["return"]
            if "error" in msg:
                err = msg["error"]
                raise SandboxError(f"QMP {name}: {err.get('class')}: {err.get('desc')}")

    def wait_migration(self, timeout: float) -> dict[str, Any]:
        """Poll ``query-migrate`` until it completes; SandboxError if it fails or takes
        longer than ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.cmd("query-migrate")
            status = st.get("status", "")
            if status == "completed":
                return dict(st)
            if status in ("failed", "cancelled"):
                raise SandboxError(f"migration {status}: {st.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise SandboxError(f"migration not done within {timeout:g} s ({status})")
            time.sleep(0.01)

    def wait_status(self, want: str, timeout: float) -> None:
        """Poll ``query-status`` until the VM is in run state ``want``."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.cmd("query-status").get("status", "")
            if st == want:
                return
            if st in ("internal-error", "shutdown", "guest-panicked"):
                raise SandboxError(f"VM is {st}, not {want}")
            if time.monotonic() > deadline:
                raise SandboxError(f"VM is {st}, not {want}, after {timeout:g} s")
            time.sleep(0.01)
