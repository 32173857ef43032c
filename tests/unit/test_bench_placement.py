"""``corral bench placement`` on a small fleet: the JSON keys, and no node over capacity."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from corral.bench.cli import app
from corral.bench.placement import placement


async def test_burst_with_room_has_no_errors() -> None:
    r = await placement(nodes=8, sandboxes=600, capacity=100, placers=3, report_every=64, k=2)
    assert r["errors"] == 0 and r["admitted"] == 600 and r["overcommit_max"] <= 0


async def test_full_fleet_never_overcommits() -> None:
    # exactly as many slots as sandboxes, stale reports: nodes refuse, nothing goes over
    r = await placement(nodes=8, sandboxes=800, capacity=100, placers=4, report_every=400, k=2)
    assert r["overcommit_max"] == 0
    assert r["admitted"] + r["errors"] == 800 and r["admitted"] <= 800


def test_cli_prints_json_last() -> None:
    out = CliRunner().invoke(app, ["placement", "--nodes", "4", "--sandboxes", "50", "--json"])
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "placements_per_s",
        "burst_admit_s",
        "errors",
        "refusals",
        "overcommit_max",
        "p99_decision_ms",
    ):
        assert key in got
    assert got["scenario"] == "placement" and got["nodes"] == 4 and got["sandboxes"] == 50
