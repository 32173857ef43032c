"""Session-wide fixtures and the leak check.

The leak check snapshots the host before the first test (mounts, corral cgroups, loop
devices, network namespaces, nft tables, runtime containers, swap) and fails the run if
anything new is left after the last one.

``CORRAL_TEST_TAG=-x`` (lowercase letters and digits after the dash) gives every test node
its own state dir, run dir and cgroup subtree (``corral-test-x...``), so that several test
runs can share one machine; the leak check then counts only what carries the tag. CI runs
untagged, with the full check.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

TAG = os.environ.get("CORRAL_TEST_TAG", "")
if TAG and not re.fullmatch(r"-[a-z0-9]{1,8}", TAG):
    raise SystemExit(f"CORRAL_TEST_TAG must look like -a1 (a dash, 1-8 of a-z0-9), got {TAG!r}")
TEST_STATE = Path(f"/var/lib/corral-test{TAG}")
TEST_RUN = Path(f"/run/corral-test{TAG}")
TEST_STORE = Path("/var/tmp/corral-test-store")
TEST_SUBTREE = f"corral-test{TAG}"


def _host_snapshot() -> set[str]:
    items: set[str] = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            p = line.split()
            items.add(f"mount {p[4]}")
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        depth = root.count("/") - 3
        for d in dirs:
            if "corral" in d:
                items.add(f"cgroup {root}/{d}")
        if depth >= 3:
            dirs[:] = []
        else:
            dirs[:] = [d for d in dirs if "corral" in d or depth == 0]
    for dev in Path("/sys/block").glob("loop*"):
        bf = dev / "loop" / "backing_file"
        if bf.exists():
            items.add(f"loop {dev.name} {bf.read_text().strip()}")
    if Path("/run/netns").is_dir():
        items.update(f"netns {n}" for n in os.listdir("/run/netns"))
    for cmd, kind in ((["nft", "list", "tables"], "nft"), (["runc", "list", "-q"], "runc")):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        items.update(f"{kind} {x}" for x in out.splitlines() if x.strip())
    for root in (TEST_RUN / "runc", TEST_RUN / "crun", TEST_RUN / "launch"):
        if root.is_dir():
            items.update(f"container {root}/{d}" for d in os.listdir(root))
    with open("/proc/swaps") as f:
        items.update(f"swap {ln.split()[0]}" for ln in list(f)[1:])
    from corral.host.leaks import fd_holders  # seccomp fd holders (host/fdstore.py)

    items.update(f"fd-holder {h}" for h in fd_holders())
    return items


_before: set[str] = set()


def pytest_sessionstart(session: pytest.Session) -> None:
    global _before
    _before = _host_snapshot()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = sorted(_host_snapshot() - _before)
    if TAG:
        left = [x for x in left if f"corral-test{TAG}" in x]
    if left:
        msg = "corral left these on the host:\n  " + "\n  ".join(left)
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(msg, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
