"""Percentiles and figure helpers of corral bench (no kernel facilities)."""

from __future__ import annotations

import asyncio

import pytest

from corral.bench import hostmem
from corral.bench.scenarios import machine, many, ratio
from corral.bench.stats import p50, p99, percentile, rate, summary_ms


def test_nearest_rank_returns_measured_samples() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert p50(values) == 50.0
    assert p99(values) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile(values, 1) == 1.0
    assert percentile(values, 0.5) == 1.0


def test_small_counts() -> None:
    assert p50([7.0]) == 7.0
    assert p99([7.0]) == 7.0
    assert p50([3.0, 1.0, 2.0]) == 2.0
    assert p50([4.0, 1.0, 3.0, 2.0]) == 2.0  # lower middle, never an interpolated 2.5
    assert p99([1.0, 2.0, 3.0, 4.0, 5.0]) == 5.0  # fewer than 100 samples: the maximum


def test_p99_of_1000() -> None:
    values = [float(v) for v in range(1000)]
    assert p99(values) == 989.0  # the 990th smallest


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="no samples"):
        p50([])
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 0)
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="empty interval"):
        rate(3, 0)


def test_summary_in_milliseconds() -> None:
    s = summary_ms([0.010, 0.030, 0.020, 0.040])
    assert s == {"p50_ms": 20.0, "p99_ms": 40.0, "min_ms": 10.0, "max_ms": 40.0, "n": 4}
    assert rate(50, 4.0) == 12.5


def test_ratio_says_how_many_times_better() -> None:
    corral = {"p50_ms": 10.0, "p99_ms": 20.0, "per_s": 40.0}
    docker = {"p50_ms": 400.0, "p99_ms": 500.0, "per_s": 4.0}
    assert ratio(corral, docker) == {"p50_ms": 40.0, "p99_ms": 25.0, "per_s": 10.0}
    assert ratio(corral, None) is None


def test_many_bounds_concurrency_and_counts_errors() -> None:
    in_flight = peak = 0

    async def op(i: int) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        if i == 3:
            raise RuntimeError("boom")

    t = asyncio.run(many(10, 3, op))
    assert peak == 3
    assert len(t.latencies) == 9
    assert t.errors == ["RuntimeError: boom"]
    fig = t.figures()
    assert fig["errors"] == 1 and fig["n"] == 9 and fig["per_s"] > 0


def test_many_says_progress_on_long_runs_only(capsys: pytest.CaptureFixture[str]) -> None:
    async def op(i: int) -> None:
        if i == 0:
            raise RuntimeError("boom")

    asyncio.run(many(999, 8, op, "made"))
    asyncio.run(many(2000, 8, op))  # no label: silent
    assert capsys.readouterr().err == ""
    asyncio.run(many(2000, 8, op, "made"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10
    assert lines[0] == "[bench] made: 200/2000 (1 failed)"
    assert lines[-1] == "[bench] made: 2000/2000 (1 failed)"


def test_machine_says_how_fast_the_cpu_ran() -> None:
    m = machine()
    assert m["cpus"] >= 1 and m["cpu_loop_ms"] > 0


def test_meminfo_parse() -> None:
    text = (
        "MemTotal:       24683584 kB\nMemFree:        20000000 kB\n"
        "MemAvailable:   23000000 kB\nShmem:              9000 kB\n"
        "Slab:             100000 kB\nSUnreclaim:        40000 kB\nHugePages_Total:       0\n"
    )
    s = hostmem.sample(text)
    assert s.total == 24683584 * 1024
    assert s.used == (24683584 - 23000000) * 1024
    assert s.sunreclaim == 40000 * 1024
