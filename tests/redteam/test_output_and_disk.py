"""Floods: unbounded output, a disk filled to its quota, inode pressure.

Each is contained to the guest: output is truncated and reported, the writable layer stops
at its quota while the node's scratch filesystem keeps space, and the neighbour works.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

import corral
from corral.host.btrfs import qgroup_limit
from tests.redteam.conftest import RED_STATE, assert_healthy, out, run

DISK = 64 << 20
GUEST_OUTPUT = 1 << 20
"""The default per-stream output cap (Limits.output)."""


def _scratch_used() -> int:
    """Bytes the scratch btrfs uses (data + metadata + system, logical)."""
    subprocess.run(["btrfs", "filesystem", "sync", str(RED_STATE / "scratch")], check=True)
    r = subprocess.run(
        ["btrfs", "filesystem", "df", "-b", str(RED_STATE / "scratch")],
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(int(x) for x in re.findall(r"used=(\d+)", r.stdout))


def _scratch_free() -> int:
    st = os.statvfs(RED_STATE / "scratch")
    return st.f_bavail * st.f_frsize


@pytest.mark.logs("output_limit")
async def test_output_is_capped(red_node, guest, neighbour):  # type: ignore[no-untyped-def]
    t = time.monotonic()
    r = await guest.exec(["yes"], output_limit=65536, timeout=30)
    assert r.reason == "output_limit" and r.stdout_truncated, r.reason
    assert len(r.stdout) <= 65536
    assert time.monotonic() - t < 30  # generous: uncapped, `yes` runs to the 30 s timeout
    r = await guest.exec(["sh", "-c", "yes >&2"], output_limit=4096, timeout=30)
    assert r.reason == "output_limit" and r.stderr_truncated and len(r.stderr) <= 4096
    # default cap (the sandbox's Limits.output, 1 MiB) without an explicit limit
    r = await guest.exec(["sh", "-c", "head -c 50000000 /dev/zero"], timeout=30)
    assert r.stdout_truncated and len(r.stdout) <= GUEST_OUTPUT, r.reason
    await assert_healthy(red_node, guest, neighbour)


@pytest.mark.logs("disk_quota")
async def test_disk_fill_stops_at_quota(red_node, make_sandbox, neighbour):  # type: ignore[no-untyped-def]
    guest = await make_sandbox(guest=True, limits=corral.Limits(memory="256MiB", disk=DISK))
    free_before = _scratch_free()
    r = await run(guest, "cat /dev/zero > /tmp/fill; echo rc=$?; stat -c %s /tmp/fill", timeout=60)
    assert b"rc=1" in r.stdout, out(r)
    assert b"No space left on device" in r.stderr or b"Disk quota exceeded" in r.stderr, out(r)
    size = int(r.stdout.split()[-1])
    # stops at the quota plus its metadata allowance (host/btrfs.py); btrfs reserves in chunks
    assert DISK // 2 < size <= qgroup_limit(DISK) + (4 << 20), size
    assert _scratch_free() > free_before - 2 * qgroup_limit(DISK)
    assert _scratch_free() > 1 << 30
    # a second file, a dd with direct I/O and a fallocate cannot get past it either
    r = await run(
        guest,
        "dd if=/dev/zero of=/tmp/f2 bs=1M count=200 oflag=direct 2>&1 | tail -1; "
        "fallocate -l 500M /tmp/f3; echo rc=$?; du -sm /tmp/f2 /tmp/f3 2>/dev/null",
    )
    assert b"rc=1" in r.stdout, out(r)
    # the neighbour still writes, and the guest recovers by deleting
    await neighbour.files.write("/tmp/n", b"x" * (1 << 20))
    r = await run(guest, "rm -f /tmp/fill /tmp/f2 /tmp/f3; echo ok > /tmp/after && cat /tmp/after")
    assert r.stdout == b"ok\n", out(r)
    await assert_healthy(red_node, guest, neighbour)


INODES = r"""
import os, sys
os.makedirs("/tmp/many", exist_ok=True)
n = 0
try:
    for i in range(200_000):
        d = "/tmp/many/%d" % (i // 1000)
        if i % 1000 == 0: os.mkdir(d)
        fd = os.open("%s/%d" % (d, i), os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, b"x"); os.close(fd); n += 1
except OSError as e:
    print("stopped", e.errno)
print("created", n)
"""


SMALL_DISK = 16 << 20


@pytest.mark.logs("disk_quota")
async def test_inode_pressure_contained(red_node, make_sandbox, neighbour):  # type: ignore[no-untyped-def]
    # A 16 MiB quota stops 200k files early (btrfs charges their metadata): fast, and the
    # charge is what this test is about.
    guest = await make_sandbox(guest=True, limits=corral.Limits(memory="256MiB", disk=SMALL_DISK))
    used_before = _scratch_used()
    await guest.files.write("/tmp/inodes.py", INODES)
    t = time.monotonic()
    r = await run(guest, "python3 /tmp/inodes.py", timeout=120)
    took = time.monotonic() - t
    assert r.exit_code == 0, out(r)
    created = int(r.stdout.split()[-1])
    assert b"stopped 28" in r.stdout or b"stopped 122" in r.stdout, out(r)
    grew = _scratch_used() - used_before
    print(f"inode pressure: {created} files in {took:.1f}s, scratch used +{grew >> 20} MiB")
    assert grew < 4 * qgroup_limit(SMALL_DISK), (created, grew)
    r = await neighbour.exec(["sh", "-c", "touch /tmp/a && ls /tmp/a"], timeout=30)
    assert r.stdout == b"/tmp/a\n", out(r)
    await assert_healthy(red_node, guest, neighbour)
