"""``OutputPace``: a sandbox's output budget (a virtual clock, on a fake clock here) and the
InitClient reading a fake init's big answer at the pace asked for, or unpaced when none is.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from corral.backends import initclient
from corral.backends.initclient import InitClient, _field, _frame
from corral.backends.outpace import BURST_S, MIN_WAIT_S, OutputPace

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_passes_then_the_rate_holds() -> None:
    clock = Clock()
    pace = OutputPace(clock)
    rate = 8 * MIB
    burst = int(rate * BURST_S)
    assert pace.take(burst, rate) == 0.0  # an ordinary exec after a quiet spell: not held
    assert pace.take(MIB, rate) == pytest.approx(1 / 8)  # past the burst: 1 MiB at 8 MiB/s
    clock.now += 1 / 8  # the reader waited as told
    assert pace.take(2 * MIB, rate) == pytest.approx(2 / 8)
    assert pace.waited == pytest.approx(3 / 8)


def test_a_quiet_spell_gives_one_burst_back_not_more() -> None:
    clock = Clock()
    pace = OutputPace(clock)
    rate = 4 * MIB
    pace.take(4 * MIB, rate)  # a second's worth: 0.75 s in debt
    clock.now += 60  # a minute of silence
    burst = int(rate * BURST_S)
    assert pace.take(burst, rate) == 0.0
    assert pace.take(rate, rate) == pytest.approx(1.0)  # the silence is not saved up


def test_execs_of_one_sandbox_share_its_budget() -> None:
    clock = Clock()
    pace = OutputPace(clock)
    rate = 2 * MIB
    pace.take(int(rate * BURST_S), rate)
    a = pace.take(MIB, rate)  # two readers, each 1 MiB, at the same instant
    b = pace.take(MIB, rate)
    assert (a, b) == (pytest.approx(0.5), pytest.approx(1.0))  # the second waits for both


def test_small_debts_are_carried_not_slept() -> None:
    clock = Clock()
    pace = OutputPace(clock)
    rate = 64 * MIB
    pace.take(int(rate * BURST_S), rate)
    step = rate * MIN_WAIT_S / 4  # a quarter of the smallest wait
    waits = [pace.take(int(step), rate) for _ in range(5)]
    assert waits[:3] == [0.0, 0.0, 0.0]  # carried: 7.5 ms of debt, not slept
    assert waits[4] >= MIN_WAIT_S  # then slept, the carried debt with it
    assert pace.waited == pytest.approx(sum(waits))


def test_a_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        OutputPace().take(1, 0)


async def _serve_output(tmp_path: Path, size: int) -> tuple[asyncio.Server, InitClient]:
    """A fake init answering every exec with ``size`` bytes of stdout in 64 KiB frames."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            n = int.from_bytes(await r.readexactly(4), "big")
            await r.readexactly(n)
            w.write(_frame(b"S"[0], _field(initclient.PID, 7)))
            chunk = b"y" * (64 << 10)
            for _ in range(size // len(chunk)):
                w.write(_frame(b"O"[0], chunk))
                await w.drain()  # backpressure, as the init's HIGH_WATER
            w.write(
                _frame(b"X"[0], _field(initclient.REASON, "exited") + _field(initclient.CODE, 0))
            )
            await w.drain()
        finally:
            w.close()

    path = tmp_path / "ctl.sock"
    server = await asyncio.start_unix_server(serve, path)
    return server, InitClient(path)


@pytest.mark.parametrize("size", [512 << 10, 4 * MIB], ids=["on-the-loop", "in-a-thread"])
async def test_an_exec_is_read_at_its_rate(tmp_path: Path, size: int) -> None:
    server, init = await _serve_output(tmp_path, size)
    rate = MIB  # the smallest a sandbox may ask for
    try:
        t0 = time.monotonic()
        res = await init.exec(["yes"], env={}, output_limit=8 * MIB, output_rate=rate)
        took = time.monotonic() - t0
    finally:
        server.close()
        await server.wait_closed()
    assert res.stdout == b"y" * size  # slowed, nothing lost
    # the pace's virtual clock: the last byte is paid for at (first read - burst) + size /
    # rate, and the reader waits for it (to within the debt it carries)
    least = (size - rate * BURST_S) / rate - MIN_WAIT_S
    assert init.pace.waited > 0 and took >= least


async def test_streams_and_execs_of_a_sandbox_share_one_pace(tmp_path: Path) -> None:
    server, init = await _serve_output(tmp_path, 2 * MIB)
    rate = MIB
    try:
        t0 = time.monotonic()
        got = 0

        async def stream() -> None:
            nonlocal got
            async with init.stream(["yes"], env={}, output_rate=rate) as s:
                async for _, data in s:
                    got += len(data)

        res, _ = await asyncio.gather(
            init.exec(["yes"], env={}, output_limit=8 * MIB, output_rate=rate), stream()
        )
        took = time.monotonic() - t0
    finally:
        server.close()
        await server.wait_closed()
    assert len(res.stdout) == got == 2 * MIB
    least = (4 * MIB - rate * BURST_S) / rate - MIN_WAIT_S  # 4 MiB in all at 1 MiB/s
    assert took >= least


async def test_without_a_rate_nothing_is_held(tmp_path: Path) -> None:
    """The node's own calls (a snapshot's stream, files through the agent) pass none."""
    server, init = await _serve_output(tmp_path, 4 * MIB)
    try:
        res = await init.exec(["yes"], env={}, output_limit=8 * MIB)
    finally:
        server.close()
        await server.wait_closed()
    assert len(res.stdout) == 4 * MIB and init.pace.waited == 0.0
