"""``corral bench neighbours`` with 1-second attacks: every attack reached full strength
(its own counters say so), nobody outside the attacker was harmed, each attacker was destroyed,
and nothing is left on the host. Latency ratios are the bench's figures, not asserted
here (a shared machine's load moves them more than any attack does)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import run_bench

STATE = Path(f"/var/lib/corral-test{TAG}-nbr")
RUN = Path(f"/run/corral-test{TAG}-nbr")


def test_neighbours_harm_nobody(images_ready) -> None:  # type: ignore[no-untyped-def]
    try:
        out = run_bench(
            "neighbours",
            "--seconds",
            "1",
            state=STATE,
            run=RUN,
            subtree=f"corral-test{TAG}-nbr",
            store=TEST_STORE,
            image="test/debian",
            timeout=600,
        )
    finally:
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)
    assert out["scenario"] == "neighbours"
    attacks = {a["name"]: a for a in out["attacks"]}
    assert set(attacks) == {
        "fork_bomb",
        "memory_bomb",
        "disk_fill",
        "output_flood",
        "inotify",
        "fds",
        "cpu_burn",
    }
    assert out["harmed"] == 0, {n: a["harmed"] for n, a in attacks.items() if a["harmed"]}
    for name, a in attacks.items():
        assert "destroy_error" not in a, (name, a["destroy_error"])
        assert a["neighbour"]["n"] > 0 and a["api"]["n"] > 0, name
    # each attack reached full strength before its window was measured: the kernel
    # refused or killed something of it, its disk filled, its processes ran out
    assert all(a["bit"] for a in attacks.values()), {n: a["effect"] for n, a in attacks.items()}
    assert attacks["fork_bomb"]["effect"]["pids_refused"] > 0, attacks["fork_bomb"]
    assert attacks["memory_bomb"]["effect"]["oom_kills"] > 0, attacks["memory_bomb"]
    assert attacks["disk_fill"]["effect"]["fill_bytes"] >= 32 << 20, attacks["disk_fill"]
    flood = attacks["output_flood"]
    assert flood.get("flood_truncated") is True, flood  # stopped at its cap by the node
    assert flood["output_rate"] == 32 << 20  # relayed at the sandbox default's pace
    assert out["probe_errors"] == 0
    assert out["leaked_total"] == 0, out["leaks"]
