"""Exec results with a lot of output, answered without stopping the node's event loop.

An exec may return up to its ``output_limit`` of each stream (64 MiB when a caller asks
for it). ``model_dump_json`` of such a result is one call that base64-encodes it all:
~0.3 s of CPU for 64 MiB on this machine, during which the agent's event loop answers no
one, so one sandbox flooding its output held up every other sandbox's exec and the API
(``corral bench neighbours``: the output flood). Here the same bytes are produced in
slices of :data:`SLICE` input bytes, the response streams them, and other requests run
between the slices; the socket's flow control paces it to the client.

Each slice is encoded by pybase64 in a worker thread: pybase64 (SIMD) takes ~1 ms of CPU a
MiB where binascii took ~3-5, and it lets go of the GIL while it works, so the loop's own
share of a 64 MiB body is a thread hop per slice. (Before, the slices were 48 KiB encoded on
the loop: binascii holds the GIL, so a worker thread would have taken the same CPU from the
loop in 5 ms turns, and every request in flight waited at each of its steps for one slice of
every big body being encoded.)

The body is byte for byte what ``model_dump_json`` writes (URL-safe base64 with padding,
pydantic's ``ser_json_bytes="base64"``): clients see no difference.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import pybase64
from fastapi.responses import Response, StreamingResponse

from corral import execwire
from corral.host.sched import bulk_thread
from corral.spec import ExecResult

__all__ = ["exec_result_response", "exec_result_chunks", "exec_raw_response", "BIG", "SLICE"]

BIG = 1 << 20
"""Output (both streams) above which the body is streamed in slices."""
RAW_SLICE = 1 << 20
"""Bytes per piece of a binary answer (corral.execwire): each is one ``send`` on the loop's
thread (the kernel's copy), so a request waits at most that long behind it."""
SLICE = 3 << 20
"""Input bytes per slice (3 MiB in, 4 MiB of base64 out, one worker-thread call): a
multiple of 3, so the slices' base64 joins without padding."""
_ENCODERS = 4
_encoders = ThreadPoolExecutor(
    _ENCODERS, thread_name_prefix="corral-exec-b64", initializer=bulk_thread
)
"""The slices' encoders: threads of their own at nice 19 (host/sched.py), so a flood's
base64 yields the CPU to the event loop and to other sandboxes' work (in asyncio's default
pool they took an equal share of it with the loop's thread)."""


def exec_result_response(res: ExecResult, status: int = 200) -> Response:
    """``res`` as its JSON body: in one piece when small, streamed in slices when big.

    The streamed body's length is known before its first byte (base64 is 4 bytes for
    every 3, padded), so it is sent with ``Content-Length`` rather than chunked: h11
    frames each chunk of a chunked body by joining it with its size line, one more copy
    of every slice (85 MiB for a 64 MiB output) on the loop's thread."""
    if len(res.stdout) + len(res.stderr) <= BIG:
        return Response(res.model_dump_json(), status_code=status, media_type="application/json")
    head, mid, tail = _frame(res)
    length = len(head) + _b64_len(res.stdout) + len(mid) + _b64_len(res.stderr) + len(tail)
    return StreamingResponse(
        exec_result_chunks(res),
        status_code=status,
        media_type="application/json",
        headers={"content-length": str(length)},
    )


def exec_raw_response(res: ExecResult, status: int = 200) -> Response:
    """``res`` in the binary form of :mod:`corral.execwire` (the client asked for it): no
    encoding at all; a big output is sent in pieces of :data:`RAW_SLICE`."""
    head, out, err = execwire.frame(res)
    headers = {execwire.HEADER: execwire.framing_header(head, out, err)}
    if len(out) + len(err) <= BIG:
        return Response(head + out + err, status, headers, execwire.MEDIA_TYPE)
    headers["content-length"] = str(len(head) + len(out) + len(err))
    return StreamingResponse(_raw_chunks(head, out, err), status, headers, execwire.MEDIA_TYPE)


async def _raw_chunks(head: bytes, *streams: bytes) -> AsyncIterator[bytes | memoryview]:
    yield head
    for data in streams:
        view = memoryview(data)
        for start in range(0, len(view), RAW_SLICE):
            # a view, no copy: the server's h11 connection passes it on as it is (server.py)
            yield view[start : start + RAW_SLICE]


def _b64_len(data: bytes) -> int:
    return 4 * ((len(data) + 2) // 3)


def _frame(res: ExecResult) -> tuple[bytes, bytes, bytes]:
    """The JSON of ``res`` around its two bytes fields: before stdout's base64, between
    it and stderr's, after stderr's."""
    light = res.model_copy(update={"stdout": b"", "stderr": b""}).model_dump_json().encode()
    blank = b'"stdout":"","stderr":""'
    at = light.index(blank)  # the only bytes fields; the ones before are numbers or null
    return light[:at] + b'"stdout":"', b'","stderr":"', b'"' + light[at + len(blank) :]


async def exec_result_chunks(res: ExecResult) -> AsyncIterator[bytes]:
    """The JSON of ``res`` in pieces, each slice's base64 made in a worker thread."""
    head, mid, tail = _frame(res)
    yield head
    async for piece in _b64(res.stdout):
        yield piece
    yield mid
    async for piece in _b64(res.stderr):
        yield piece
    yield tail


async def _b64(data: bytes) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    for start in range(0, len(view), SLICE):
        yield await loop.run_in_executor(
            _encoders, pybase64.urlsafe_b64encode, view[start : start + SLICE]
        )
