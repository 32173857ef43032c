"""schemathesis against the node's OpenAPI spec over real HTTP, a real node and real
sandboxes behind it (``corral bench fuzz`` at a bounded count, fixed seed): no answer
>= 500, every status documented, every body of its documented schema, the node healthy
and leak-free after."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import run_bench

pytest.importorskip("schemathesis")

STATE = Path(f"/var/lib/corral-test{TAG}-fuzz")
RUN = Path(f"/run/corral-test{TAG}-fuzz")


@pytest.fixture
def private_store(images_ready):  # type: ignore[no-untyped-def]
    """A copy of the test store (hard links: layers are immutable) that fuzzed snapshots
    and image deletes may change without touching the store other runs share."""
    store = STATE / "store"
    shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(TEST_STORE), str(store)], check=True)
    try:
        yield store
    finally:
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)


def test_fuzz_api_bounded(private_store: Path) -> None:
    out = run_bench(
        "fuzz",
        "--cases",
        "300",
        "--seed",
        "0",
        state=STATE,
        run=RUN,
        subtree=f"corral-test{TAG}-fuzz",
        store=private_store,
        image="test/debian",
        timeout=300,
    )
    assert out["scenario"] == "fuzz"
    assert out["cases"] >= 200, out  # hypothesis stops early only on exhausted operations
    assert out["deep_cases"] >= out["cases"] // 3, out
    assert out["server_errors"] == 0, out["failures"]
    assert out["undocumented_status"] == 0, out["failures"]
    assert out["schema_violations"] == 0, out["failures"]
    assert out["content_type_violations"] == 0, out["failures"]
    assert out["timeouts"] == 0, out["failures"]
    assert out["healthy_after"] is True
    assert out["leaked_total"] == 0, out["leaks"]
    # the real sandbox paths were reached: successes, not only refusals
    assert sum(v for k, v in out["statuses"].items() if k.startswith("2")) >= 20, out
