"""corral.host.prefetch: /proc/PID/maps parsing, batching, and the advice loop against the
real kernel on this test's own process (advising oneself needs no privilege)."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import mmap
import os
import subprocess
from collections.abc import Iterator

import pytest

import corral
from corral.host import prefetch
from corral.host.prefetch import Mapping, RangeError
from corral.images.hotblocks import MAP_FAILED, c_mmap, c_munmap
from corral.testing import FakeNode
from tests.unit.test_cli import cli, fake  # noqa: F401 - fixtures
from tests.unit.test_sdk import client, short_dir, sync_client  # noqa: F401 - fixtures

PAGE = os.sysconf("SC_PAGE_SIZE")
GIB = 1 << 30

MAPS = """\
55d0c8a00000-55d0c8a2c000 r--p 00000000 08:01 131 /usr/bin/python3.11
55d0c8a2c000-55d0c8d00000 r-xp 0002c000 08:01 131 /usr/bin/python3.11
55d0c9e00000-55d0c9f21000 rw-p 00000000 00:00 0                          [heap]
7f1a2c000000-7f1a2c021000 rw-p 00000000 00:00 0
7f1a2c021000-7f1a30000000 ---p 00000000 00:00 0
7f1a30000000-7f1a30001000 rw-s 00000000 00:01 77 /memfd:buf (deleted)
7f1a30001000-7f1a30002000 r--p 00000000 08:01 99 /work/a file with spaces.txt
7ffc1c9e0000-7ffc1ca01000 rw-p 00000000 00:00 0                          [stack]
7ffc1cbe0000-7ffc1cbe4000 r--p 00000000 00:00 0                          [vvar]
7ffc1cbe4000-7ffc1cbe6000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
garbage line
"""


def test_parse_maps_keeps_what_a_process_can_touch() -> None:
    got = prefetch.parse_maps(MAPS)
    assert [(m.path, m.perms) for m in got] == [
        ("/usr/bin/python3.11", "r--p"),
        ("/usr/bin/python3.11", "r-xp"),
        ("[heap]", "rw-p"),
        ("", "rw-p"),
        ("/memfd:buf (deleted)", "rw-s"),
        ("/work/a file with spaces.txt", "r--p"),
        ("[stack]", "rw-p"),
    ]
    heap = got[2]
    assert (heap.start, heap.end, heap.size) == (0x55D0C9E00000, 0x55D0C9F21000, 0x121000)
    assert [m.anonymous for m in got] == [False, False, True, True, False, False, True]


def test_batches_respect_iov_max_and_the_byte_cap() -> None:
    ms = [Mapping(i * 2 * PAGE, i * 2 * PAGE + PAGE, "rw-p", "") for i in range(2500)]
    assert [len(b) for b in prefetch.batches(ms)] == [1024, 1024, 452]
    assert [m for b in prefetch.batches(ms) for m in b] == ms
    big = Mapping(0, 3 * GIB + PAGE, "rw-p", "")
    small = Mapping(4 * GIB, 4 * GIB + PAGE, "rw-p", "")
    got = prefetch.batches([big, small], most_bytes=GIB)
    assert [[(m.start, m.size) for m in b] for b in got] == [
        [(0, GIB)],
        [(GIB, GIB)],
        [(2 * GIB, GIB)],
        [(3 * GIB, PAGE), (4 * GIB, PAGE)],
    ]
    assert prefetch.batches([]) == []


_MAP_NORESERVE = 0x4000  # not in this Python's mmap module
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _mmap(size: int) -> Mapping:
    addr = c_mmap(None, size, _PROT_RW, _FLAGS, -1, 0)
    assert addr not in (None, MAP_FAILED), os.strerror(ctypes.get_errno())
    return Mapping(addr, addr + size, "rw-p", "")


@pytest.fixture
def regions() -> Iterator[list[Mapping]]:
    """Three anonymous regions of this process, 4 pages each; unmapped afterwards."""
    got = [_mmap(4 * PAGE) for _ in range(3)]
    yield got
    for m in got:
        c_munmap(m.start, m.size)


@pytest.fixture
def self_pidfd() -> Iterator[int]:
    fd = os.pidfd_open(os.getpid())
    yield fd
    os.close(fd)


def test_advise_in_several_calls(regions: list[Mapping], self_pidfd: int) -> None:
    adv = prefetch.advise(self_pidfd, regions, pid=os.getpid(), most=2)
    assert (adv.processes, adv.ranges, adv.bytes, adv.errors) == (1, 3, 12 * PAGE, [])
    assert adv.anon_bytes == 12 * PAGE and adv.file_bytes == 0


def test_a_refused_range_does_not_stop_the_rest(regions: list[Mapping], self_pidfd: int) -> None:
    gone = regions[1]
    c_munmap(gone.start, gone.size)  # unmapped after the maps were read: ENOMEM
    try:
        adv = prefetch.advise(self_pidfd, regions, pid=7)
        assert adv.errors == [RangeError(7, gone.start, gone.end, errno.ENOMEM)]
        assert (adv.ranges, adv.bytes) == (2, 8 * PAGE)
        assert "ENOMEM" in str(adv.errors[0])
    finally:
        regions[1] = _mmap(PAGE)  # something for the fixture to unmap


def test_a_range_over_the_kernel_cap_is_advised_whole(self_pidfd: int) -> None:
    # The kernel cuts a vector above 2 GiB short without an error; with the split turned
    # off (most_bytes above the cap) the loop still goes on from where the kernel stopped.
    m = _mmap(3 * GIB)  # reserved, never touched: nothing to read, nothing committed
    try:
        for cap in (prefetch.MAX_CALL_BYTES, 4 * GIB):
            adv = prefetch.advise(self_pidfd, [m], most_bytes=cap)
            assert (adv.bytes, adv.errors) == (3 * GIB, []), cap
    finally:
        c_munmap(m.start, m.size)


def test_an_exited_process_ends_its_advice(regions: list[Mapping]) -> None:
    p = subprocess.Popen(["true"])
    fd = os.pidfd_open(p.pid)
    try:
        p.wait()
        adv = prefetch.advise(fd, regions, pid=p.pid)
        assert [e.errno for e in adv.errors] == [errno.ESRCH]  # once, not per range
        assert adv.bytes == 0
    finally:
        os.close(fd)
    assert [e.errno for e in prefetch.willneed(p.pid).errors] == [errno.ESRCH]


def test_willneed_over_all_of_a_process() -> None:
    mine = prefetch.parse_maps(open(f"/proc/{os.getpid()}/maps").read())
    adv = prefetch.willneed_all([os.getpid()])
    assert adv.processes == 1 and adv.errors == [], [str(e) for e in adv.errors]
    assert adv.anon_bytes > 0 and adv.file_bytes > 0  # heap and the python binary at least
    assert adv.ranges >= len(mine) - 5  # mappings may come and go while the test runs


# ---------------------------------------------------------------- the flag, end to end
# (FakeNode records the flag it got in its "resumed" event: the transports must carry it)


async def _resumed_flags(sb: corral.Sandbox) -> list[object]:
    return [e.detail.get("prefetch", False) for e in await sb.events() if e.kind == "resumed"]


async def test_prefetch_flag_through_every_transport(client: corral.AsyncClient) -> None:  # noqa: F811
    sb = await client.sandboxes.create(image="demo/python", labels={"job": "pf"})
    await sb.pause()
    assert (await sb.resume(prefetch=True)).state == "running"
    await sb.pause()
    await sb.resume()
    await sb.pause()
    got = await client.sandboxes.resume(labels={"job": "pf"}, prefetch=True)
    assert [s.id for s in got] == [sb.id]
    await sb.pause()
    await client.sandboxes.resume(labels={"job": "pf"})
    assert await _resumed_flags(sb) == [True, False, True, False]


def test_sync_client_prefetch(sync_client: corral.Client) -> None:  # noqa: F811
    sb = sync_client.sandboxes.create(image="demo/python", labels={"job": "j"})
    sb.pause()
    assert sb.resume(prefetch=True).state == "running"
    sb.pause()
    assert [s.id for s in sync_client.sandboxes.resume(labels={"job": "j"}, prefetch=True)] == [
        sb.id
    ]
    flags = [e.detail.get("prefetch", False) for e in sb.events() if e.kind == "resumed"]
    assert flags == [True, True]


def test_cli_resume_prefetch(fake: FakeNode) -> None:  # noqa: F811
    r = cli("sandbox", "create", "demo/python", "-l", "job=a")
    assert r.exit_code == 0, r.stderr
    sid = r.stdout.strip()
    for args in (["--prefetch", sid], [sid], ["--label", "job=a", "--prefetch"]):
        assert cli("sandbox", "pause", sid).exit_code == 0
        r = cli("sandbox", "resume", *args)
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split()[:2] == [sid, "running"]
    flags = [
        e.detail.get("prefetch", False)
        for e in asyncio.run(fake.events(sid))
        if e.kind == "resumed"
    ]
    assert flags == [True, False, True]
