"""A MooseFS store's work dir belongs to one run at a time (bench/dfs.py, ``<workdir>.lock``).

Session 17 saw why: a second run on the same state dir started by removing what it took for
a crashed run's leftovers, which was the first run's live store. Only the lock is tested
here (no servers start): the claim, the refusal in this process and in another, the
refused object's stop touching nothing, and a crashed owner's lock coming free.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.bench.dfs import MooseStore
from corral.errors import Conflict

_CLAIM = """
import sys
from pathlib import Path
from corral.bench.dfs import MooseStore
from corral.errors import Conflict
s = MooseStore(Path(sys.argv[1]), name="lk")
try:
    s._claim()
except Conflict as e:
    print("refused:", e)
    sys.exit(3)
print("claimed")
sys.exit(0)  # without _release: as a crashed run ends
"""


def _claim_elsewhere(work: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CLAIM, str(work)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_a_second_run_on_the_same_work_dir_is_refused_and_touches_nothing(
    tmp_path: Path,
) -> None:
    work = tmp_path / "bench-dfs"
    work.mkdir()
    (work / "chunks-of-the-running-store").write_text("x")
    first = MooseStore(work, name="lk")
    first._claim()
    assert first.lock_path == tmp_path / "bench-dfs.lock"
    assert first.lock_path.read_text() == f"{os.getpid()}\n"

    second = MooseStore(work, name="lk")
    with pytest.raises(Conflict, match=rf"belongs to a run still going \(pid {os.getpid()},"):
        second._claim()
    second.stop()  # refused: owns nothing, so stops nothing
    assert (work / "chunks-of-the-running-store").exists()

    other = _claim_elsewhere(work)  # another process is refused the same way
    assert other.returncode == 3, other
    assert f"pid {os.getpid()}" in other.stdout

    first._release()
    assert not first.lock_path.exists()
    second._claim()  # free again
    second._release()


def test_the_work_dirs_parent_is_made(tmp_path: Path) -> None:
    s = MooseStore(tmp_path / "not" / "yet" / "dfs", name="lk")
    s._claim()
    assert s.lock_path == tmp_path / "not" / "yet" / "dfs.lock" and s.lock_path.exists()
    s._release()


def test_a_crashed_owners_lock_comes_free(tmp_path: Path) -> None:
    work = tmp_path / "bench-dfs"
    crashed = _claim_elsewhere(work)  # claims and exits without releasing
    assert crashed.returncode == 0 and "claimed" in crashed.stdout, crashed
    assert work.with_name("bench-dfs.lock").exists()  # the file stays; its lock does not
    s = MooseStore(work, name="lk")
    s._claim()
    assert s.lock_path.read_text() == f"{os.getpid()}\n"
    s._release()
    assert not s.lock_path.exists()
