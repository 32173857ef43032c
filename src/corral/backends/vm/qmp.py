"""A small QMP client: one short, blocking session per request on a VM's ``qmp.sock``
(callers run it in a thread).

QEMU's QMP socket serves one client at a time; the desktop serializes its requests per
sandbox (a lock in :class:`corral.backends.vm.screen.Screen`) and opens a session for
each, so nothing is held between requests and a restarted node needs no reconnect.
Blocking sockets because a screendump passes a file descriptor (``SCM_RIGHTS``), which
asyncio's streams cannot send.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from corral.errors import SandboxError

__all__ = ["QMP"]


class QMP:
    """``with QMP(path) as q: q.execute("input-send-event", events=[...])``."""

    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = b""

    def __enter__(self) -> QMP:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(str(self.path))
        except OSError as e:
            s.close()
            raise SandboxError(f"QMP at {self.path}: cannot connect: {e}") from None
        self._sock = s
        try:
            greeting = self._line()
            if "QMP" not in greeting:
                raise SandboxError(f"QMP at {self.path}: unexpected greeting {greeting!r}")
            self.execute("qmp_capabilities")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _line(self) -> dict[str, Any]:
        assert self._sock is not None
        while b"\n" not in self._buf:
            try:
                chunk = self._sock.recv(65536)
            except OSError as e:  # includes the timeout
                raise SandboxError(f"QMP at {self.path}: {e or 'no answer'}") from None
            if not chunk:
                raise SandboxError(f"QMP at {self.path}: QEMU closed the connection")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        msg = json.loads(line)
        if not isinstance(msg, dict):
            raise SandboxError(f"QMP at {self.path}: not an object: {line[:200]!r}")
        return msg

    def execute(self, command: str, fds: list[int] | None = None, **arguments: Any) -> Any:
        """Run one command (``fds`` passed along with it, for ``add-fd``); its
        ``return`` value, or SandboxError with QEMU's words."""
        assert self._sock is not None
        req: dict[str, Any] = {"execute": command}
        if arguments:
            req["arguments"] = arguments
        data = json.dumps(req).encode() + b"\n"
        try:
            if fds:
                sent = socket.send_fds(self._sock, [data], fds)
                data = data[sent:]
            if data:
                self._sock.sendall(data)
        except OSError as e:
            raise SandboxError(f"QMP {command} at {self.path}: {e}") from None
        while True:
            msg = self._line()
            if "event" in msg:
                continue  # asynchronous events: not answers
            if "error" in msg:
                desc = msg["error"].get("desc", msg["error"])
                raise SandboxError(f"QMP {command}: {desc}")
            return msg.get("return")
