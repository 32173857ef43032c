"""Fork bomb, memory bomb and CPU burn in the guest; fd exhaustion.

While the guest attacks, the neighbour's ``true`` exec latency is measured against its idle
value in the same test (a shared 2-core machine is noisy: each round measures idle, then
loaded; the test passes when one of three rounds is within bounds, so only a persistent
slowdown fails it). Bound: loaded p99 <= max(2 x idle p99, idle p99 + 50 ms).
"""

from __future__ import annotations

import asyncio
import time

import pytest

import corral
from tests.redteam.conftest import GUEST_LIMITS, assert_healthy, out, run

SAMPLES = 25
SLACK = 0.05

BOMBS = {
    "fork": "bomb() { bomb | bomb & }; bomb",
    "memory": (
        "while :; do python3 -c 'a=[]\nwhile 1: a.append(bytearray(1<<24))' 2>/dev/null; done"
    ),
    "cpu": "for i in 1 2 3 4; do (while :; do :; done) & done; wait",
}


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


async def _latency(sb) -> float:  # type: ignore[no-untyped-def]
    lat = []
    for _ in range(SAMPLES):
        t = time.perf_counter()
        r = await sb.exec(["true"], timeout=30)
        lat.append(time.perf_counter() - t)
        assert r.exit_code == 0, out(r)
    return _p99(lat)


@pytest.mark.logs("pids_limit")
async def test_bombs_do_not_slow_the_neighbour(red_node, make_sandbox, neighbour):  # type: ignore[no-untyped-def]
    rounds = []
    for _ in range(3):
        idle = await _latency(neighbour)
        guest = await make_sandbox(guest=True)
        # the fork bomb last: once it holds every pid, the guest cannot start more
        for script in (BOMBS["cpu"], BOMBS["memory"], BOMBS["fork"]):
            await guest.spawn(["bash", "-c", script])
        # until the fork bomb holds every pid of the guest (a generous 30 s at most)
        deadline = time.monotonic() + 30
        while (
            red_node.cgroups.pids_current(guest.id) < GUEST_LIMITS.pids
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)
        loaded = await _latency(neighbour)
        try:  # the guest's init may be unable to fork now: that is the guest's own problem
            r = await run(guest, "cat /sys/fs/cgroup/pids/pids.current", timeout=10)
            pids = r.stdout.decode().strip()
        except corral.SandboxError as e:
            pids = str(e)[-40:]
        # destroy works under a fork bomb, and promptly
        t = time.monotonic()
        await guest.destroy()
        took = time.monotonic() - t
        assert took < 60, took  # generous: a destroy stuck on the bomb would hang
        rounds.append((round(idle, 4), round(loaded, 4), pids, round(took, 2)))
        if loaded <= max(2 * idle, idle + SLACK):
            break
    else:
        raise AssertionError(f"neighbour p99 (idle, loaded) in s per round: {rounds}")
    await assert_healthy(red_node, neighbour)
    print(f"resource bombs: neighbour p99 (idle, loaded) per round: {rounds}")


FDS = r"""
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard * 16, hard * 16))
    print("RAISED")
except (ValueError, OSError):
    pass
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    print("stopped", e.errno, len(fds), flush=True)
import time; time.sleep(2)
"""


def _host_files() -> int:
    with open("/proc/sys/fs/file-nr") as f:
        return int(f.read().split()[0])


async def test_fd_exhaustion_contained(red_node, guest, neighbour):  # type: ignore[no-untyped-def]
    """Four processes each open files up to their hard limit (which they cannot raise):
    EMFILE in the guest, while the host keeps most of its file table."""
    before = _host_files()
    await guest.files.write("/tmp/fds.py", FDS)
    r = await run(guest, "for i in 1 2 3 4; do python3 /tmp/fds.py & done; wait", timeout=60)
    assert b"RAISED" not in r.stdout, out(r)
    lines = [ln.split() for ln in r.stdout.decode().splitlines() if ln.startswith("stopped")]
    assert len(lines) == 4, out(r)
    # EMFILE (24) at the per-process limit, or ENOMEM when the memory cgroup runs out first
    assert all(ln[1] in ("24", "12") for ln in lines), out(r)
    with open("/proc/sys/fs/file-max") as f:
        assert _host_files() < int(f.read()) // 2
    await assert_healthy(red_node, guest, neighbour)
    r = await run(neighbour, "exec 3</etc/passwd && echo opened")
    assert r.stdout == b"opened\n"
    print(f"fd exhaustion: per-process {[ln[2] for ln in lines]}, host files {before} -> now")
