"""``corral bench soak`` at 200 cycles: no errors, nothing left on the host or in the
node's own view, the node's RSS flat. (Create p99 drift and database growth are reported
by the bench; at 200 cycles on a shared machine they are too noisy to assert.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import run_bench

STATE = Path(f"/var/lib/corral-test{TAG}-soak")
RUN = Path(f"/run/corral-test{TAG}-soak")


def test_soak_200_cycles(images_ready) -> None:  # type: ignore[no-untyped-def]
    try:
        out = run_bench(
            "soak",
            "--cycles",
            "200",
            "--concurrency",
            "8",
            state=STATE,
            run=RUN,
            subtree=f"corral-test{TAG}-soak",
            store=TEST_STORE,
            image="test/debian",
            timeout=300,
        )
    finally:
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)
    assert out["scenario"] == "soak" and out["cycles"] == 200
    assert out["errors"] == 0, out["error_examples"]
    assert out["shells"] is True  # test/debian has bash: the shell step ran
    assert out["networked"] == 8  # every 25th: veths and nft entries were made and checked
    assert out["leaked_total"] == 0, out["leaks"]
    assert out["rss_growth"] < 0.10, out["rss_mib"]
    assert out["p99_ratio_last_first"] is not None
