"""A sandbox terminal over the node API's websocket (``/v1/sandboxes/{id}/pty``).

:class:`PtySession` has the interface of the embedded node's pty stream (the init's
``ExecStream``), so ``corral sandbox shell`` drives both alike::

    async with ops.pty(sandbox_id, ["/bin/sh"], 24, 80) as s:
        await s.write(b"echo hi; exit 3\\n")
        async for _name, data in s:        # _name is always "stdout" (a tty merges them)
            ...
    s.result.code                          # 3

The wire protocol is described in :mod:`corral.api._pty`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlencode

from websockets.asyncio.client import ClientConnection, connect, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from corral.errors import (
    KINDS,
    CorralError,
    SandboxError,
    TransportError,
    error_from_wire,
)

__all__ = ["PtyExit", "PtySession", "pty_session"]

# Terminal output comes in chunks of at most a pipe's worth; 4 MiB leaves ample room.
_MAX_MESSAGE = 4 << 20
_OPEN_TIMEOUT = 30.0


@dataclass(frozen=True)
class PtyExit:
    """How the terminal's command ended."""

    reason: str
    """exited | signaled | timeout | output_limit"""
    code: int | None
    """Exit status when the command exited by itself."""
    signal: int | None
    """Terminating signal when it was killed."""


def pty_session(
    kind: str,
    where: str,
    sandbox_id: str,
    cmd: list[str] | None,
    rows: int,
    cols: int,
    *,
    env: dict[str, str] | None = None,
    token: str | None = None,
) -> PtySession:
    """A not-yet-connected session; ``kind``/``where`` as from ``parse_target``."""
    query: list[tuple[str, str | int]] = [("rows", rows), ("cols", cols)]
    query += [("cmd", c) for c in cmd or []]
    query += [("env", f"{k}={v}") for k, v in (env or {}).items()]
    path = f"/v1/sandboxes/{quote(sandbox_id, safe='')}/pty?{urlencode(query)}"
    headers = {"authorization": f"Bearer {token}"} if token else {}
    opts: dict[str, Any] = {
        "additional_headers": headers,
        "max_size": _MAX_MESSAGE,
        "open_timeout": _OPEN_TIMEOUT,
        # keystrokes are a few bytes each: compressing them only adds latency
        "compression": None,
    }
    if kind == "unix":
        target = f"unix://{where}"

        def opener() -> Awaitable[ClientConnection]:
            return unix_connect(where, uri="ws://corral" + path, **opts)
    else:
        target = where
        uri = "ws" + where[len("http") :] + path  # http→ws, https→wss

        def opener() -> Awaitable[ClientConnection]:
            return connect(uri, **opts)

    return PtySession(opener, target, sandbox_id)


class PtySession:
    """One terminal: ``async with`` it, iterate its output, then read ``result``."""

    def __init__(
        self,
        opener: Callable[[], Awaitable[ClientConnection]],
        target: str,
        sandbox_id: str,
    ) -> None:
        self._opener = opener
        self._target = target
        self._sandbox_id = sandbox_id
        self._ws: ClientConnection | None = None
        self._result: PtyExit | None = None
        self.pid = 0
        """The pid of the command inside the sandbox, known once the block is entered."""
        self.cmd: list[str] = []
        """The command the node started (its default shell when none was asked)."""

    async def __aenter__(self) -> PtySession:
        try:
            self._ws = await self._opener()
        except InvalidStatus as exc:
            raise _refused(exc) from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise TransportError(
                f"cannot open a terminal on the corral node at {self._target}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        try:
            msg = await self._recv()
            if not isinstance(msg, str):
                raise SandboxError("the node sent terminal output before saying it started")
            started = self._control(msg).get("started")
            if not isinstance(started, dict):
                raise SandboxError(f"the node opened the terminal with {msg[:200]!r}")
            self.pid = int(started.get("pid") or 0)
            self.cmd = [str(c) for c in started.get("cmd") or []]
        except BaseException:
            await self._ws.close()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        # closing before the end makes the node leave the command's block: the init kills it
        if self._ws is not None:
            await self._ws.close()

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[tuple[str, bytes]]:
        while self._result is None:
            msg = await self._recv()
            if isinstance(msg, bytes):
                yield "stdout", msg
                continue
            exit_ = self._control(msg).get("exit")
            if isinstance(exit_, dict):
                self._result = PtyExit(
                    reason=str(exit_.get("reason")),
                    code=exit_.get("code"),
                    signal=exit_.get("signal"),
                )

    async def wait(self) -> PtyExit:
        """Read (and drop) the rest of the output; return the exit."""
        async for _ in self:
            pass
        return self.result

    @property
    def result(self) -> PtyExit:
        """How the command ended; available once the iteration has finished."""
        if self._result is None:
            raise SandboxError("the terminal has not ended yet: iterate the stream to its end")
        return self._result

    async def write(self, data: bytes) -> None:
        """Send bytes to the terminal's input."""
        if data:
            await self._send(bytes(data))

    async def close_stdin(self) -> None:
        """End of input (the EOF character, in canonical mode)."""
        await self._send(json.dumps({"eof": True}))

    async def signal(self, sig: int) -> None:
        """Send ``sig`` to the command's process group."""
        await self._send(json.dumps({"signal": sig}))

    async def resize(self, rows: int, cols: int) -> None:
        """Set the terminal's window size (the command gets SIGWINCH)."""
        await self._send(json.dumps({"resize": [rows, cols]}))

    # ------------------------------------------------------------ plumbing
    def _live(self) -> ClientConnection:
        if self._ws is None:
            raise SandboxError("use the terminal inside `async with`")
        return self._ws

    async def _send(self, msg: bytes | str) -> None:
        try:
            await self._live().send(msg)
        except ConnectionClosed:
            pass  # the command ended and the node closed; the iteration reports how

    async def _recv(self) -> bytes | str:
        ws = self._live()
        try:
            return await ws.recv()
        except ConnectionClosed as exc:
            raise self._closed(exc) from None

    def _control(self, text: str) -> dict[str, Any]:
        try:
            msg = json.loads(text)
        except ValueError:
            msg = None
        if not isinstance(msg, dict):
            raise SandboxError(f"the node sent an unexpected terminal message: {text[:200]!r}")
        if "error" in msg:
            raise error_from_wire(msg)
        return msg

    def _closed(self, exc: ConnectionClosed) -> CorralError:
        rcvd = exc.rcvd
        if rcvd is not None and 4000 <= rcvd.code < 5000:
            # the node closed with 4000 + an HTTP status and no error frame before it
            cls = next((c for c in KINDS.values() if c.status == rcvd.code - 4000), CorralError)
            return cls(rcvd.reason or f"the node closed the terminal with code {rcvd.code}")
        return TransportError(
            f"the terminal of sandbox {self._sandbox_id} on {self._target} closed before "
            f"its command ended: {exc}"
        )


def _refused(exc: InvalidStatus) -> CorralError:
    resp = exc.response
    try:
        body: object = json.loads(resp.body or b"")
    except ValueError:
        body = (resp.body or b"").decode(errors="replace")
    return error_from_wire(body, resp.status_code)
