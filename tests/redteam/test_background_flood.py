"""Output flood from a background process (spawn): the node keeps only the cap, the
process is not stopped for it, and the truncation is in the event log."""

from __future__ import annotations

import pytest

from tests.redteam.conftest import assert_healthy

CAP = 1 << 20


@pytest.mark.logs("output_truncated")
async def test_background_output_is_capped_and_logged(red_node, guest, neighbour):  # type: ignore[no-untyped-def]
    p = await guest.spawn(["sh", "-c", "head -c 200000000 /dev/zero; echo end >&2"])
    r = await p.wait(timeout=60)
    assert r.exit_code == 0 and r.stdout_truncated and len(r.stdout) <= CAP, r
    assert r.stderr == b"end\n"
    await assert_healthy(red_node, guest, neighbour)
