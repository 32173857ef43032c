"""``corral bench crash`` at a small count: the agent is SIGKILLed with live, paused and
busy sandboxes and creates, forks, pauses and destroys in flight, then opened again."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import run_bench

STATE = Path(f"/var/lib/corral-test{TAG}-crash")
RUN = Path(f"/run/corral-test{TAG}-crash")


@pytest.fixture(scope="module")
def result(images_ready) -> Any:  # type: ignore[no-untyped-def]
    # a private store: the children write nothing to it, but a fork snapshot may
    shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(TEST_STORE), str(STATE / "store")], check=True)
    try:
        yield run_bench(
            "crash",
            "--count",
            "12",
            "--rounds",
            "2",
            state=STATE,
            run=RUN,
            subtree=f"corral-test{TAG}-crash",
            store=STATE / "store",
            image="test/debian",
            timeout=600,
        )
    finally:
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)


def test_crash_loses_no_sandbox(result: dict[str, Any]) -> None:
    assert result["scenario"] == "crash" and result["rounds"] == 2
    assert len(result["per_round"]) == 2
    assert result["lost"] == 0, result["per_round"]
    assert result["leaks_after"] == {}  # destroying everything at the end leaves nothing


def test_crash_finishes_or_rolls_back_half_done_work(result: dict[str, Any]) -> None:
    assert result["not_answering"] == 0, result["per_round"]
    assert result["leftovers"] == 0, result["per_round"]
