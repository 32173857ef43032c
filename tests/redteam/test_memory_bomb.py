"""A memory bomb in the foreground: the exec ends as ``oom``, only the guest's process dies,
and the kill is in the event log (the exec's ``oom`` and the cgroup's ``oom_kill`` count)."""

from __future__ import annotations

import pytest

from tests.redteam.conftest import assert_healthy, out, run

BOMB = "a = []\nwhile True:\n    a.append(bytearray(1 << 24))\n"


@pytest.mark.logs("oom")
@pytest.mark.logs("oom_kill")
async def test_memory_bomb_is_killed_and_logged(red_node, guest, neighbour):  # type: ignore[no-untyped-def]
    await guest.files.write("/tmp/bomb.py", BOMB)
    r = await run(guest, "exec python3 /tmp/bomb.py", timeout=60)
    assert r.reason == "oom", (r.reason, out(r))
    r = await run(guest, "echo still-here")
    assert r.stdout == b"still-here\n", out(r)
    await assert_healthy(red_node, guest, neighbour)
