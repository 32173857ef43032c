"""The terminal route of the API: ``/v1/sandboxes/{id}/pty`` over a websocket.

Query: the fields of :class:`corral.spec.PtyRequest`: ``rows``, ``cols`` (default 24x80),
``cmd`` (repeat for arguments; default ``bash -l`` when the sandbox has bash, else
``/bin/sh``), ``env`` (``K=V``, repeatable), ``cwd``, ``user``.

Frames, client → server: binary = bytes for the terminal's input; text = one JSON control
message, ``{"resize": [rows, cols]}``, ``{"signal": N}`` or ``{"eof": true}``.

Frames, server → client: first a text ``{"started": {"pid": N, "cmd": [...]}}``; then
binary = terminal output; at the end a text ``{"exit": <ExecResult>}`` (the JSON of
:class:`corral.spec.ExecResult`, stdout/stderr empty) and a normal close (1000). When the
terminal cannot be opened or a control message is wrong, a text ``{"error": {"kind", "message"}}`` is sent and the socket closes with code
4000 + the error's HTTP status (4404: no such sandbox, 4409: not running, 4400: bad
request). A client that goes away ends the command: the init kills its process group.

The route only parses: the terminal itself is ``ops.pty`` (a :class:`corral.ops.PtyStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import APIRouter, WebSocket
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from corral.errors import CorralError, InvalidRequest
from corral.ops import NodeOps, PtyStream
from corral.spec import ExecResult, PtyRequest, validation_message

__all__ = ["pty_router", "close_code"]

log = logging.getLogger("corral.api")

_MAX_SIZE = 65535  # a window size is two u16 in the kernel (struct winsize)
# A close reason is at most 123 bytes (RFC 6455 5.5: control frame payload 125 - code).
_REASON_MAX = 123


def close_code(err: CorralError) -> int:
    """The websocket close code for ``err``: 4000 + its HTTP status (4404, 4409, ...)."""
    return 4000 + err.status


def pty_router(ops: NodeOps) -> APIRouter:
    """The websocket route, bound to ``ops``."""
    r = APIRouter()

    @r.websocket("/sandboxes/{sandbox_id}/pty")
    async def pty(ws: WebSocket, sandbox_id: str) -> None:
        await ws.accept()
        try:
            await _serve(ws, ops, sandbox_id)
        except CorralError as exc:
            await _close_with(ws, exc)
        except Exception:
            log.exception("internal error in the terminal of %s", sandbox_id)
            await _close_with(ws, CorralError("internal error (logged on the node)"))

    return r


async def _serve(ws: WebSocket, ops: NodeOps, sandbox_id: str) -> None:
    req = _request(ws)
    async with await ops.pty(sandbox_id, req) as s:
        await ws.send_text(json.dumps({"started": {"pid": s.pid, "cmd": s.cmd}}))
        result = await _pump(ws, s)
    if result is None:
        return  # the client went away; leaving the block above ended the command
    with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
        await ws.send_text('{"exit":' + result.model_dump_json() + "}")
        await ws.close(1000)


def _request(ws: WebSocket) -> PtyRequest:
    q = ws.query_params
    fields: dict[str, object] = {
        "rows": _dimension(q.get("rows", "24"), "rows"),
        "cols": _dimension(q.get("cols", "80"), "cols"),
        "env": _env(q.getlist("env")),
        "cmd": q.getlist("cmd") or None,
        "cwd": q.get("cwd"),
        "user": q.get("user"),
    }
    try:
        return PtyRequest.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest(validation_message(exc)) from None


async def _pump(ws: WebSocket, s: PtyStream) -> ExecResult | None:
    """Copy both ways until the command ends (its result) or the client leaves (None)."""
    inbound = asyncio.create_task(_inbound(ws, s))
    outbound = asyncio.create_task(_outbound(ws, s))
    try:
        done, _ = await asyncio.wait({inbound, outbound}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (inbound, outbound):
            t.cancel()
        for t in (inbound, outbound):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    if outbound in done and not outbound.cancelled():
        if (exc := outbound.exception()) is not None:
            raise exc
        if outbound.result():
            if s.result is None:
                raise CorralError(
                    f"{type(s).__name__} ended the terminal's output without saying how its "
                    "command ended (a PtyStream must set result before its iteration ends)"
                )
            return s.result
        return None
    # inbound ended first: a bad control message (raise it) or the client left
    if (exc := inbound.exception()) is not None:
        raise exc
    return None


async def _inbound(ws: WebSocket, s: PtyStream) -> None:
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return
        if (data := msg.get("bytes")) is not None:
            await s.write(data)
        elif (text := msg.get("text")) is not None:
            await _control(s, text)


async def _outbound(ws: WebSocket, s: PtyStream) -> bool:
    """Terminal output to the client; False when the client is gone before the end."""
    async for data in s:
        try:
            await ws.send_bytes(data)
        except (WebSocketDisconnect, OSError, RuntimeError):
            return False
    return True


async def _control(s: PtyStream, text: str) -> None:
    try:
        msg = json.loads(text)
    except ValueError:
        msg = None
    if not isinstance(msg, dict) or len(msg) != 1:
        raise InvalidRequest(
            f"terminal control message {text[:100]!r} is not one of "
            '{"resize": [rows, cols]}, {"signal": N}, {"eof": true}'
        )
    ((key, value),) = msg.items()
    if key == "resize":
        if not (isinstance(value, list) and len(value) == 2):
            raise InvalidRequest(f"resize: {value!r} is not [rows, cols]")
        await s.resize(_dimension(value[0], "resize rows"), _dimension(value[1], "resize cols"))
    elif key == "signal":
        if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 64):
            raise InvalidRequest(f"signal: {value!r} is not a signal number (1-64)")
        await s.signal(value)
    elif key == "eof":
        if value is not True:
            raise InvalidRequest(f"eof: {value!r} must be true")
        await s.close_stdin()
    else:
        raise InvalidRequest(
            f"terminal control message has unknown key {key!r}; use resize, signal or eof"
        )


def _dimension(value: object, what: str) -> int:
    try:
        n = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else 0
    except ValueError:
        n = 0
    if not 1 <= n <= _MAX_SIZE:
        raise InvalidRequest(f"{what}: {value!r} is not a whole number from 1 to {_MAX_SIZE}")
    return n


def _env(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"env: {item!r} must be KEY=VALUE")
        out[key] = value
    return out


async def _close_with(ws: WebSocket, err: CorralError) -> None:
    if ws.application_state != WebSocketState.CONNECTED:
        return
    reason = err.message.encode()[:_REASON_MAX].decode(errors="ignore")
    # the error frame carries the full message and kind; the close reason is cut short
    with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
        await ws.send_text(json.dumps(err.to_wire()))
        await ws.close(close_code(err), reason)
