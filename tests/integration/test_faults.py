"""Injected faults on a real node (issue 17 part 4): the disk, the layer store, the state
database, the host's binaries and the clock fail underneath it.

Every test checks the same four things: a clear error (or event) that names what is
wrong, a sandbox that was running keeps answering exec with its files intact, nothing is
lost (sandbox files and the state database), and the node recovers by itself once the
fault is gone. Each drives its own node on dirs of this module and checks, after closing
it, that nothing of the node is left on the host.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.errors import CorralError, HostError, ScratchFull
from corral.host import leaks
from corral.node import Node
from corral.spec import ExecRequest, Limits, SandboxSpec
from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import node_config

STATE = Path(f"/var/lib/corral-test{TAG}-flt")
RUN = Path(f"/run/corral-test{TAG}-flt")
SUBTREE = f"corral-test{TAG}-flt"
SMALL = Limits(cpus=1, memory="256MiB", pids=128, disk="128MiB")
REPO = Path(__file__).resolve().parents[2]


def _cfg(**kw):  # type: ignore[no-untyped-def]
    return node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, **kw)


def _spec(image: str = "test/busybox", **kw) -> SandboxSpec:  # type: ignore[no-untyped-def]
    return SandboxSpec(image=image, limits=kw.pop("limits", SMALL), **kw)


def _assert_clean() -> None:
    found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    deadline = time.monotonic() + 30  # an autoclear loop device goes asynchronously
    while leaks.total(found) and time.monotonic() < deadline:
        time.sleep(0.2)
        found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    assert leaks.total(found) == 0, {k: v for k, v in found.items() if v}


async def _shutdown(n: Node) -> None:
    try:
        for info in await n.sandbox_list():
            await n.sandbox_destroy(info.id)
    finally:
        await n.close()


async def _fresh() -> Node:
    n = await Node.open(_cfg())
    await n.gc(everything=True)  # what an earlier, crashed run of this module left
    return n


class _Kept:
    """A running sandbox holding a file of random bytes: the witness that a fault left
    running sandboxes and their data alone."""

    def __init__(self, sid: str, data: bytes) -> None:
        self.sid, self.data = sid, data

    @classmethod
    async def make(cls, n: Node) -> _Kept:
        info = await n.sandbox_create(_spec())
        data = os.urandom(256 << 10)
        await n.file_write(info.id, "/tmp/kept.bin", data)
        return cls(info.id, data)

    async def check(self, n: Node) -> None:
        r = await n.exec(self.sid, ExecRequest(cmd=["echo", "alive"]))
        assert r.stdout == b"alive\n", r
        assert await n.file_read(self.sid, "/tmp/kept.bin") == self.data
        r = await n.exec(self.sid, ExecRequest(cmd=["sh", "-c", "wc -c < /tmp/kept.bin"]))
        assert r.stdout.strip() == str(len(self.data)).encode(), r


# ---------------------------------------------------------------- the scratch fs full


def _fill(mountpoint: Path) -> Path:
    """Write zeros into the scratch filesystem itself (outside every sandbox) until the
    kernel says ENOSPC: the node's disk filled by something else."""
    filler = mountpoint / "filler"
    chunk = bytes(4 << 20)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        with_room = True
        while with_room:  # the last partial chunks, so no data room is left at all
            try:
                f.write(bytes(64 << 10))
                f.flush()
            except OSError:
                with_room = False
    os.sync()
    return filler


async def test_scratch_full(images_ready) -> None:  # type: ignore[no-untyped-def]
    n = await Node.open(_cfg(scratch_size="1GiB"))
    filler: Path | None = None
    try:
        await n.gc(everything=True)
        kept = await _Kept.make(n)
        mark = n.state.last_event_id()
        filler = _fill(n.scratch.mountpoint)
        for _ in range(2):  # refused every time, the same way
            with pytest.raises(ScratchFull, match="scratch") as got:
                await n.sandbox_create(_spec())
            assert got.value.status == 503
        failed = [e for e in n.state.events(since_id=mark) if e.kind == "create_failed"]
        assert len(failed) == 2, failed
        assert [i.id for i in await n.sandbox_list()] == [kept.sid]  # nothing half-made
        assert set(n.scratch.subvols()) == {kept.sid}
        await kept.check(n)  # reads and execs still work
        with pytest.raises(ScratchFull, match="scratch filesystem"):
            await n.file_write(kept.sid, "/tmp/more", b"x" * (8 << 20))
        # the space comes back: creates work again, without a restart
        filler.unlink()
        filler = None
        os.sync()
        fresh = await n.sandbox_create(_spec())
        r = await n.exec(fresh.id, ExecRequest(cmd=["sh", "-c", "echo ok > /tmp/x; cat /tmp/x"]))
        assert r.stdout == b"ok\n"
        await kept.check(n)
    finally:
        if filler is not None:
            filler.unlink()
        await _shutdown(n)
    _assert_clean()
