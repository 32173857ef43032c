"""The probe process of ``bench neighbours`` against a fake node over its real HTTP server:
a window holds exactly ``seconds * hz`` probes of each kind (started at a fixed rate, not
one after the other), none failed, and the agent's loop was timed meanwhile; an error of
the node is counted, not fatal."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.api.server import NodeServer
from corral.bench.neighbours_probe import Probes
from corral.testing import FakeNode


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="corral-nbr-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_a_window_holds_the_same_fixed_rate_mix(short_dir: Path) -> None:
    async with NodeServer(FakeNode(), uds=short_dir / "api.sock") as srv:
        async with corral.AsyncClient(srv.address) as client:
            sb = await client.sandboxes.create(image="demo/python")
            async with Probes(srv.address, sb.id, hz=20) as probes:
                first = await probes.window(0.5)
                second = await probes.window(1.0)
                await sb.destroy()
                gone = await probes.window(0.25)
    assert (len(first.api_s), len(first.exec_s)) == (10, 10)
    assert (len(second.api_s), len(second.exec_s)) == (20, 20)
    assert first.errors == second.errors == []
    assert first.lag_s and second.lag_s  # the agent's loop was timed during each window
    assert len(first.late_s) == 20  # how late each probe started
    assert first.loop_cpu_s > 0  # the loop thread served the probes meanwhile
    assert len(gone.exec_s) == len(gone.errors) == 5  # each failed exec is counted
    assert all(e.startswith("exec: ") for e in gone.errors), gone.errors
