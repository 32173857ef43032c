"""A sandbox terminal over the node API's websocket (``/v1/sandboxes/{id}/pty``).

:class:`PtySession` is a :class:`corral.ops.PtyStream`, like the embedded node's and the
FakeNode's terminals, so ``corral sandbox shell`` drives them all alike::

    async with await ops.pty(sandbox_id, PtyRequest(cmd=["/bin/sh"])) as s:
        await s.write(b"echo hi; exit 3\\n")
        async for data in s:               # bytes (a tty merges stdout and stderr)
            ...
    s.result.exit_code                     # 3

The wire protocol is described in :mod:`corral.api._pty`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlencode

from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection, connect, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from corral.errors import (
    KINDS,
    CorralError,
    SandboxError,
    TransportError,
    error_from_wire,
)
from corral.spec import ExecResult, PtyRequest

__all__ = ["PtySession", "pty_session", "pty_query"]

# Terminal output comes in chunks of at most a pipe's worth; 4 MiB leaves ample room.
_MAX_MESSAGE = 4 << 20
_OPEN_TIMEOUT = 30.0


def pty_query(req: PtyRequest) -> list[tuple[str, str | int]]:
    """The websocket's query for ``req`` (the API's ``_pty`` parses it back)."""
    query: list[tuple[str, str | int]] = [("rows", req.rows), ("cols", req.cols)]
    query += [("cmd", c) for c in req.cmd or []]
    query += [("env", f"{k}={v}") for k, v in req.env.items()]
    if req.cwd is not None:
        query.append(("cwd", req.cwd))
    if req.user is not None:
        query.append(("user", req.user))
    return query


def pty_session(
    kind: str,
    where: str,
    sandbox_id: str,
    req: PtyRequest,
    *,
    token: str | None = None,
) -> PtySession:
    """A not-yet-connected session; ``kind``/``where`` as from ``parse_target``."""
    path = f"/v1/sandboxes/{quote(sandbox_id, safe='')}/pty?{urlencode(pty_query(req))}"
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
    """One terminal (a :class:`corral.ops.PtyStream`): ``async with`` it, iterate its
    output, then read ``result``."""

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
        self._result: ExecResult | None = None
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

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[bytes]:
        while self._result is None:
            msg = await self._recv()
            if isinstance(msg, bytes):
                yield msg
                continue
            exit_ = self._control(msg).get("exit")
            if exit_ is not None:
                try:
                    # JSON validation: its bytes fields travel as base64
                    self._result = ExecResult.model_validate_json(json.dumps(exit_))
                except ValidationError as exc:
                    raise SandboxError(
                        f"the node ended the terminal with an exit that is not one: {exc}"
                    ) from None

    async def wait(self) -> ExecResult:
        """Read (and drop) the rest of the output; return how the command ended."""
        async for _ in self:
            pass
        assert self._result is not None  # the iteration ends only with a result
        return self._result

    @property
    def result(self) -> ExecResult | None:
        """How the command ended; None until the iteration has reached the end."""
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
