"""Cores for the node and for a co-located store (bench/cores.py, ``bench ondemand
--store-cores``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from typer.testing import CliRunner

from corral.bench import cores
from corral.cli.app import app

ALLOWED = sorted(os.sched_getaffinity(0))
multicore = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 or more usable cores")


@multicore
def test_the_store_gets_the_last_cores_and_the_node_keeps_the_rest() -> None:
    node, store = cores.split(1)
    assert store == {ALLOWED[-1]} and node == set(ALLOWED[:-1])
    assert not node & store


@pytest.mark.parametrize("n", [0, len(ALLOWED), len(ALLOWED) + 3])
def test_a_split_that_leaves_the_node_nothing_is_refused_by_count(n: int) -> None:
    with pytest.raises(ValueError, match=f"store cores {n} must be 1..{len(ALLOWED) - 1}"):
        cores.split(n)


@pytest.mark.parametrize("n", [len(ALLOWED), len(ALLOWED) + 3])
def test_the_cli_refuses_too_many_store_cores_before_any_set_up(n: int) -> None:
    # (0 is the default, no split: the CLI would run the whole bench.)
    r = CliRunner().invoke(app, ["bench", "ondemand", "--store-cores", str(n), "--json"])
    assert r.exit_code == 2
    assert f"store cores {n} must be 1..{len(ALLOWED) - 1}" in r.output


@multicore
def test_pinned_moves_every_thread_and_children_and_restores_after() -> None:
    node, _ = cores.split(1)
    started = threading.Event()
    stop = threading.Event()

    def idle() -> None:
        started.set()
        stop.wait()

    t = threading.Thread(target=idle)
    t.start()
    started.wait()
    try:
        with cores.pinned(node):
            assert os.sched_getaffinity(t.native_id) == node  # a thread that was running
            child = subprocess.run(
                [sys.executable, "-c", "import os; print(*sorted(os.sched_getaffinity(0)))"],
                capture_output=True,
                text=True,
                check=True,
            )
            assert [int(c) for c in child.stdout.split()] == sorted(node)
        assert os.sched_getaffinity(0) == set(ALLOWED)
        assert os.sched_getaffinity(t.native_id) == set(ALLOWED)
    finally:
        stop.set()
        t.join()


@multicore
def test_taskset_runs_a_program_on_the_cores_given() -> None:
    _, store = cores.split(1)
    argv = cores.taskset(
        store, [sys.executable, "-c", "import os; print(*os.sched_getaffinity(0))"]
    )
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert [int(c) for c in out.split()] == sorted(store)
    assert cores.cpu_list([3, 0, 1]) == "0,1,3"
