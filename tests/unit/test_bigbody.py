"""A big exec result's streamed JSON body (corral.api.bigbody) is byte for byte what
pydantic writes, and reads back to the same result."""

from __future__ import annotations

import os

from corral.api.bigbody import BIG, SLICE, exec_result_chunks
from corral.spec import ExecResult


async def _body(res: ExecResult) -> bytes:
    return b"".join([piece async for piece in exec_result_chunks(res)])


async def test_the_sliced_body_is_pydantics_json() -> None:
    cases = [
        ExecResult(exit_code=0, reason="exited"),
        ExecResult(
            exit_code=None,
            signal=9,
            stdout=b"y\n" * (BIG // 2 + 7),
            reason="output_limit",
            stdout_truncated=True,
            duration=1.25,
        ),
        # random bytes over several slices, lengths that are not multiples of 3
        ExecResult(
            exit_code=3,
            stdout=os.urandom(2 * SLICE + 1),
            stderr=os.urandom(SLICE + 2),
            reason="exited",
            stderr_truncated=True,
        ),
    ]
    for res in cases:
        body = await _body(res)
        assert body == res.model_dump_json().encode()
        assert ExecResult.model_validate_json(body) == res
