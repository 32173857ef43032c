"""``corral bench pause``, ``qos`` and ``share`` end to end at tiny counts: the last stdout
line is one JSON object of the documented shape, and nothing of the bench node is left.
Heavy (real memory churn and CPU burners): run with ``-m heavy``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from corral.images.store import LayerStore
from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import assert_no_leaks, run_bench

pytestmark = pytest.mark.heavy

STATE = Path(f"/var/lib/corral-test{TAG}-dbench")
RUN = Path(f"/run/corral-test{TAG}-dbench")
SUBTREE = f"corral-test{TAG}-dbench"


@pytest.fixture(scope="module")
def bench(images_ready):  # type: ignore[no-untyped-def]
    # A store of its own (share adds and removes layer copies in the store it reads).
    store = LayerStore(STATE / "store")
    src = LayerStore(TEST_STORE)
    img = src.image("test/debian")
    for d in img.layers:
        store.add_file(src.path_of(d), kind="debian", source="copy of test/debian")
    store.put_image("test/debian", img.layers, env=img.env)

    def run(*args: str) -> dict:  # type: ignore[type-arg]
        return run_bench(
            *args,
            state=STATE,
            run=RUN,
            subtree=SUBTREE,
            store=None,
            image="test/debian",
            timeout=600,
        )

    try:
        yield run
    finally:
        try:
            assert_no_leaks(STATE, RUN, SUBTREE)
        finally:
            shutil.rmtree(RUN, ignore_errors=True)
            shutil.rmtree(STATE, ignore_errors=True)


def test_pause_bench(bench) -> None:  # type: ignore[no-untyped-def]
    out = bench("pause", "--count", "2", "--mem", "32MiB")
    assert out["scenario"] == "pause" and out["count"] == 2
    assert out["state_intact"] is True
    assert out["released_fraction"] > 0.5  # a swap file: random memory leaves RAM
    for k in ("pause_ms_p50", "resume_first_exec_ms_p50", "resume_first_exec_ms_p99"):
        assert out[k] > 0, (k, out)
    assert out["swap_left"] == []
    assert out["prefetch"] is False and out["resume_prefetch_ms_p50"] is None
    assert out["touch_after_resume_ms_p50"] > 0


def test_pause_bench_prefetch(bench) -> None:  # type: ignore[no-untyped-def]
    out = bench("pause", "--count", "2", "--mem", "32MiB", "--prefetch")
    assert out["prefetch"] is True and out["state_intact"] is True
    assert out["resume_prefetch_ms_p50"] > 0 and out["touch_after_resume_ms_p50"] > 0
    # the node's own figures: the swapped memory came back within the resume calls
    assert out["prefetch_swapped_after_mib"] < out["prefetch_swapped_before_mib"] / 4, out
    assert out["swap_left"] == []


def test_qos_bench(bench) -> None:  # type: ignore[no-untyped-def]
    out = bench("qos", "--count", "50", "--burners", "1")
    assert out["scenario"] == "qos"
    for k in ("idle_p99_ms", "loaded_p99_ms", "loaded_noqos_p99_ms"):
        assert out[k] > 0, (k, out)
    assert out["core_scheduling"] in (True, False)


def test_share_bench(bench) -> None:  # type: ignore[no-untyped-def]
    out = bench("share", "--count", "2")
    assert out["scenario"] == "share" and out["program"].startswith("python3")
    assert 0 < out["shared_mib"] < out["copied_mib"]  # the second sandbox shared the cache
    first, second = out["shared"]["per_sandbox_mib"]
    assert second < first, out["shared"]  # the first one read the shared pages in
    assert out["shared"]["layer_file_cache_mib"] >= 0 and out["copied"]["layer_file_cache_mib"] >= 0
    assert out["ratio"] == round(out["shared_mib"] / out["copied_mib"], 3)
    # the copies are gone from the store again
    assert [i.name for i in LayerStore(STATE / "store").images()] == ["test/debian"]
