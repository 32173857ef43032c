"""Robustness against a real node: races, crashes, corruption and pressure.

What a demanding user expects: no lost data, no leaked resources, clear errors. Each test
drives its own Node on dirs of this module and checks, after closing it, that nothing of
the node is left on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from corral.errors import (
    Conflict,
    CorralError,
    ImageNotFound,
    InvalidRequest,
    LayerCorrupt,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
)
from corral.host import leaks
from corral.node import Node
from corral.spec import ExecChunk, ExecRequest, ExecResult, Limits, SandboxSpec
from tests.conftest import TAG
from tests.integration.conftest import node_config

STATE = Path(f"/var/lib/corral-test{TAG}-rob")
RUN = Path(f"/run/corral-test{TAG}-rob")
SUBTREE = f"corral-test{TAG}-rob"
STORE2 = Path(f"/var/tmp/corral-test{TAG}-rob-store")
SMALL = Limits(cpus=1, memory="256MiB", pids=128, disk="128MiB")
REPO = Path(__file__).resolve().parents[2]


def _cfg(**kw):  # type: ignore[no-untyped-def]
    return node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, **kw)


def _start_name(runtime: object) -> str:
    """The method that starts a container: the launcher's ``start`` or the OCI runtime's
    ``run_detached`` (the tests below hook it)."""
    return "start" if getattr(runtime, "name", "") == "launch" else "run_detached"


def _spec(image: str = "test/busybox", **kw) -> SandboxSpec:  # type: ignore[no-untyped-def]
    return SandboxSpec(image=image, limits=kw.pop("limits", SMALL), **kw)


def _assert_clean() -> None:
    """Nothing of the node left on the host, and no sandbox dir (guest data) either."""
    found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    assert leaks.total(found) == 0, found
    left = [
        str(p)
        for d in (STATE / "sandboxes", STATE / "scratch")
        if d.is_dir()
        for p in d.iterdir()
        if p.name.startswith("sb-")
    ]
    assert left == [], f"sandbox dirs left: {left}"


def _dirs(n: Node) -> set[str]:
    """Names of the sandbox dirs the node's backend has."""
    d = n.backend.sandboxes_dir
    return {p.name for p in d.iterdir() if p.name.startswith("sb-")} if d.is_dir() else set()


async def _shutdown(n: Node) -> None:
    try:
        for info in await n.sandbox_list():
            try:
                await n.sandbox_destroy(info.id)
            except (Conflict, SandboxNotFound):
                pass  # being destroyed by someone else already
    finally:
        await n.close()


@pytest.fixture
async def rnode(images_ready):  # type: ignore[no-untyped-def]
    n = await Node.open(_cfg())
    try:
        await n.gc(everything=True)  # leftovers of an earlier, crashed run
        yield n
    finally:
        await _shutdown(n)
        _assert_clean()


async def _until_running(node: Node, sid: str, cmdline: bytes) -> None:
    """Wait (a generous 30 s at most) until a process with ``cmdline`` (NUL-separated, as
    in /proc) runs in the sandbox: the readiness signal of a request under test."""
    listing = ExecRequest(cmd=["sh", "-c", "cat /proc/[0-9]*/cmdline"])
    deadline = time.monotonic() + 30
    while cmdline not in (await node.exec(sid, listing)).stdout:
        assert time.monotonic() < deadline, f"{cmdline!r} never started in {sid}"
        await asyncio.sleep(0.02)


def _destroy_events(n: Node, sid: str) -> list[str]:
    return [e.kind for e in n.state.events(sid)]


# ---------------------------------------------------------------- destroy races


async def test_concurrent_destroys(rnode: Node) -> None:
    info = await rnode.sandbox_create(_spec())
    results = await asyncio.gather(
        rnode.sandbox_destroy(info.id), rnode.sandbox_destroy(info.id), return_exceptions=True
    )
    assert sum(r is None for r in results) == 1, results
    (err,) = [r for r in results if r is not None]
    assert isinstance(err, (Conflict, SandboxNotFound)), repr(err)
    assert info.id in str(err)
    with pytest.raises(SandboxNotFound, match=info.id):
        await rnode.sandbox_destroy(info.id)
    kinds = _destroy_events(rnode, info.id)
    assert kinds.count("destroyed") == 1 and "destroy_error" not in kinds, kinds
    assert info.id not in [i.id for i in await rnode.sandbox_list()]


async def test_destroy_while_creating(rnode: Node) -> None:
    """A destroy of a sandbox still being created waits for the create, then wins."""
    gate = asyncio.Event()
    rt = rnode.backend.runtime
    name = _start_name(rt)
    orig = getattr(rt, name)

    async def held(*a, **kw):  # type: ignore[no-untyped-def]
        await gate.wait()
        return await orig(*a, **kw)

    setattr(rt, name, held)
    try:
        create = asyncio.create_task(rnode.sandbox_create(_spec()))
        while not (listed := await rnode.sandbox_list()):
            await asyncio.sleep(0.001)
        sid = listed[0].id
        assert listed[0].state == "creating"
        destroys = [asyncio.create_task(rnode.sandbox_destroy(sid)) for _ in range(2)]
        await asyncio.sleep(0.1)
        assert not any(d.done() for d in destroys)  # waiting for the create
        gate.set()
        info = await create
        assert info.id == sid
        results = await asyncio.gather(*destroys, return_exceptions=True)
    finally:
        setattr(rt, name, orig)
    assert sum(r is None for r in results) == 1, results
    assert all(r is None or isinstance(r, (Conflict, SandboxNotFound)) for r in results)
    assert await rnode.sandbox_list() == []
    assert (await rnode.sandbox_get(sid)).state == "destroyed"
    kinds = _destroy_events(rnode, sid)
    assert kinds.count("destroyed") == 1 and "destroy_error" not in kinds, kinds
    assert rnode.cgroups.list() == [] and rnode.scratch.subvols() == []
    assert [c["id"] for c in await rnode.backend.runtime.list()] == []


async def test_reaper_racing_user_destroys(images_ready) -> None:  # type: ignore[no-untyped-def]
    """TTL expiry and user destroys of the same sandboxes at once: each is destroyed once
    (a double destroy would release its layers twice, under a neighbour's feet).

    Both orders are forced, not hoped for: every destroy is held in the backend until the
    other party has tried the same sandbox. The reaper takes the first sandbox and is held
    there; users then destroy all of them (the first must be refused as already being
    destroyed, the others start their destroys, held); the reaper, let go, must pass over
    the sandboxes users are destroying and finish while those are still held."""
    # The background reaper stays asleep: the test runs the reaper passes itself.
    n = await Node.open(_cfg(reaper_interval=3600))
    try:
        await n.gc(everything=True)
        keeper = await n.sandbox_create(_spec())
        made = await asyncio.gather(*(n.sandbox_create(_spec(ttl=0.5)) for _ in range(6)))
        # in the order the reaper takes them (its heap: expiry, then id); the creates
        # ran at once, so gather's order is not the order they expire in
        doomed = [i.id for i in sorted(made, key=lambda i: (i.expires_at or 0, i.id))]
        # Their TTL runs out; nothing acts on it until this test's reaper pass.
        while time.time() <= max(i.expires_at or 0 for i in made):
            await asyncio.sleep(0.05)
        gates = {sid: asyncio.Event() for sid in doomed}
        started: dict[str, list[str]] = {sid: [] for sid in doomed}
        progress = asyncio.Condition()
        phase = "reaper"  # whose destroys can start now: the reaper alone, then users too
        destroy = n.backend.destroy

        async def held_destroy(sid, image):  # type: ignore[no-untyped-def]
            if sid in gates:  # not the keeper, at the end
                async with progress:
                    started[sid].append(phase)
                    progress.notify_all()
                await gates[sid].wait()
            return await destroy(sid, image)

        n.backend.destroy = held_destroy  # type: ignore[method-assign]

        first, rest = doomed[0], doomed[1:]
        reaper = asyncio.create_task(n.reap_once())
        async with progress:
            await asyncio.wait_for(progress.wait_for(lambda: started[first]), 30)
        assert started[first] == ["reaper"] and not any(started[s] for s in rest)

        phase = "users"
        users = [asyncio.create_task(n.sandbox_destroy(sid)) for sid in doomed]
        async with progress:
            await asyncio.wait_for(progress.wait_for(lambda: all(started[s] for s in rest)), 30)
        with pytest.raises(Conflict, match="already being destroyed"):
            await asyncio.wait_for(users[0], 30)  # the reaper got there first
        assert all(started[s] == ["users"] for s in rest)  # users got there first

        gates[first].set()
        await asyncio.wait_for(reaper, 30)  # passes over the ones users are destroying
        assert all(not gates[s].is_set() for s in rest)
        for sid in rest:
            gates[sid].set()
        assert await asyncio.gather(*users[1:]) == [None] * len(rest)

        await n.reap_once()  # and a later pass finds nothing more to do
        for sid in doomed:
            assert len(started[sid]) == 1, (sid, started[sid])  # one destroy each
            kinds = _destroy_events(n, sid)
            ends = [k for k in kinds if k in ("destroyed", "ttl_expired")]
            want = ["ttl_expired"] if sid == first else ["destroyed"]
            assert ends == want and "destroy_error" not in kinds, (sid, kinds)
        assert [i.id for i in await n.sandbox_list()] == [keeper.id]
        assert n.backend.layers.mounted() == {keeper.layers[0]: 1}
        r = await n.exec(keeper.id, ExecRequest(cmd=["echo", "still here"]))
        assert r.stdout == b"still here\n"
    finally:
        for g in locals().get("gates", {}).values():
            g.set()
        await _shutdown(n)
    _assert_clean()


@pytest.mark.parametrize("who", ["reaper_then_close", "cancelled_caller"])
async def test_destroy_once_started_finishes(images_ready, who: str) -> None:
    """Half a destroy leaks mounts, cgroups and processes: a destroy must finish even when
    whoever started it is cancelled (close() stopping the reaper, a client going away)."""
    n = await Node.open(_cfg(reaper_interval=0.05))
    try:
        await n.gc(everything=True)
        orig = n.backend.kill_all
        started = asyncio.Event()

        async def slow_kill_all(*a, **kw):  # type: ignore[no-untyped-def]
            started.set()
            await asyncio.sleep(0.3)
            return await orig(*a, **kw)

        n.backend.kill_all = slow_kill_all  # type: ignore[method-assign]
        if who == "reaper_then_close":
            info = await n.sandbox_create(_spec(ttl=0.1))
            await asyncio.wait_for(started.wait(), 10)
            await n.close()
        else:
            info = await n.sandbox_create(_spec())
            task = asyncio.create_task(n.sandbox_destroy(info.id))
            await asyncio.wait_for(started.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await n.close()
    finally:
        if not n.life.closed:
            await n.close()
    _assert_clean()  # the destroy ran to its end: nothing of the sandbox is left
    n = await Node.open(_cfg())
    try:
        assert await n.sandbox_list() == []
        assert n.state.get_sandbox(info.id).state == "destroyed"  # type: ignore[union-attr]
    finally:
        await _shutdown(n)
    _assert_clean()


async def test_destroy_with_execs_in_flight(rnode: Node) -> None:
    info = await rnode.sandbox_create(_spec())
    sid = info.id
    first_chunk = asyncio.Event()
    chunks: list[ExecChunk | ExecResult] = []

    async def stream() -> None:
        req = ExecRequest(cmd=["sh", "-c", "while true; do echo tick; sleep 0.05; done"])
        async for item in rnode.exec_stream(sid, req):
            chunks.append(item)
            first_chunk.set()

    exec_task = asyncio.create_task(rnode.exec(sid, ExecRequest(cmd=["sleep", "30"])))
    stream_task = asyncio.create_task(stream())
    await asyncio.wait_for(first_chunk.wait(), 10)
    await _until_running(rnode, sid, b"sleep\x0030\x00")  # both requests are live
    t0 = time.monotonic()
    await rnode.sandbox_destroy(sid)
    assert time.monotonic() - t0 < 30  # generous: a destroy waiting on its execs would hang
    done = await asyncio.wait_for(asyncio.gather(exec_task, stream_task, return_exceptions=True), 5)
    for r in done:
        # a result (killed) or a clear corral error, never anything raw
        assert r is None or isinstance(r, (ExecResult, CorralError)), repr(r)
        if isinstance(r, CorralError):
            assert isinstance(r, SandboxNotFound), repr(r)
            assert f"sandbox {sid} was destroyed while the exec was running" in str(r)
    assert any(isinstance(c, ExecChunk) for c in chunks)
    kinds = _destroy_events(rnode, sid)
    assert "destroy_error" not in kinds, rnode.state.events(sid)


async def test_ops_racing_destroy(rnode: Node) -> None:
    """Every op runs in a loop until destroy stops it; each must end in a clear error."""
    rng = random.Random(1234)
    outcomes: dict[str, int] = {}

    async def until_error(make) -> BaseException:  # type: ignore[no-untyped-def]
        for _ in range(100_000):
            try:
                await make()
            except BaseException as e:  # noqa: BLE001 - the test classifies it
                return e
        raise AssertionError("op never failed")

    for i in range(50):
        info = await rnode.sandbox_create(_spec())
        sid = info.id
        ops = [
            lambda: rnode.exec(sid, ExecRequest(cmd=["echo", "hi"])),
            lambda: rnode.exec(sid, ExecRequest(cmd=["sleep", "5"])),
            lambda: rnode.file_write(sid, f"/tmp/f{i}", b"x" * 1_000_000),
            lambda: rnode.file_read(sid, "/bin/busybox"),
            lambda: rnode.file_list(sid, "/bin"),
            lambda: rnode.file_mkdir(sid, f"/tmp/d{i}/e"),
            lambda: rnode.file_download_tar(sid, "/bin"),
            lambda: rnode.file_upload_tar(sid, "/tmp/up", _TAR),
        ]
        tasks = [asyncio.create_task(until_error(o)) for o in ops]
        await asyncio.sleep(rng.uniform(0.005, 0.05))
        await rnode.sandbox_destroy(sid)
        done = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        for r in done:
            # never a raw init error (socket paths, "connection reset"): the reason
            assert isinstance(r, (SandboxNotFound, Conflict)), repr(r)
            assert f"sandbox {sid} " in str(r), str(r)
            assert "running" not in str(r).replace("not running", "").replace("was running", ""), (
                str(r)
            )  # a destroyed sandbox never claims to run
            key = f"{type(r).__name__}: {str(r).replace(sid, '<id>')[:90]}"
            outcomes[key] = outcomes.get(key, 0) + 1
        kinds = _destroy_events(rnode, sid)
        assert "destroy_error" not in kinds, rnode.state.events(sid)
        assert sid not in _dirs(rnode), f"{sid}: dir left (iteration {i})"
    for k, v in sorted(outcomes.items()):
        print(f"{v:5d}  {k}")


def _tarball() -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for k in range(20):
            data = bytes(50_000)
            ti = tarfile.TarInfo(f"dir/f{k}")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


_TAR = _tarball()


async def test_destroy_with_busy_root_does_not_stall_the_node(rnode: Node) -> None:
    """Host-side file reads still inside the overlay make its unmount wait; that wait must
    not block the event loop (every other sandbox's requests) meanwhile."""
    info = await rnode.sandbox_create(_spec(limits=Limits(memory="256MiB", disk="1GiB")))
    other = await rnode.sandbox_create(_spec())
    r = await rnode.exec(
        info.id,
        ExecRequest(cmd=["dd", "if=/dev/urandom", "of=/tmp/big", "bs=1M", "count=200"], timeout=60),
    )
    assert r.exit_code == 0, r.stderr
    stall = 0.0

    async def beat() -> None:
        nonlocal stall
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.002)
            stall = max(stall, time.monotonic() - t)

    hb = asyncio.create_task(beat())
    reads = [asyncio.create_task(rnode.file_read(info.id, "/tmp/big")) for _ in range(2)]
    await asyncio.sleep(0.05)
    destroy = asyncio.create_task(rnode.sandbox_destroy(info.id))
    r = await rnode.exec(other.id, ExecRequest(cmd=["echo", "served"]))
    assert r.stdout == b"served\n"
    await destroy
    hb.cancel()
    for res in await asyncio.gather(*reads, return_exceptions=True):
        assert isinstance(res, (bytes, SandboxNotFound)), repr(res)
    # Generous (a loaded machine delays a 2 ms heartbeat too); the unmount's busy-wait
    # on the event loop would stall it for as long as the reads keep the overlay busy.
    assert stall < 2.0, f"event loop stalled {stall:.2f} s during destroy"
    assert "destroy_error" not in _destroy_events(rnode, info.id)


async def test_files_never_touch_an_unmounted_root(rnode: Node) -> None:
    """The moment between destroy's unmount and its rmdir: a file op that opens the root
    then must fail, not write guest data into the bare directory on the node's disk."""
    from corral.host import mounts

    info = await rnode.sandbox_create(_spec())
    root = rnode.backend.rootfs(info.id)
    await rnode.file_write(info.id, "/tmp/a", b"in the overlay")
    if rnode.backend.runtime.name == "launch":
        # No host mount: the root is reached through the init, which destroy kills first.
        os.kill(info.pid, signal.SIGKILL)
        while True:  # readiness: the init's root is gone (its exit let go of it)
            try:
                os.close(rnode.backend.runtime.open_root(info.id))
            except CorralError:
                break
            await asyncio.sleep(0.01)
        # Not available (the node's reaper may be destroying it already: not found).
        with pytest.raises(CorralError, match="not available|destroyed|not found"):
            await rnode.file_write(info.id, "/tmp/b", b"must not land on the host disk")
        assert not root.exists() or list(root.iterdir()) == []
        with contextlib.suppress(SandboxNotFound):
            await rnode.sandbox_destroy(info.id)
        return
    mounts.umount(root, detach=True)  # what destroy does, just before removing the dir
    with pytest.raises(CorralError, match="not mounted"):
        await rnode.file_write(info.id, "/tmp/b", b"must not land on the host disk")
    with pytest.raises(CorralError, match="not mounted"):
        await rnode.file_mkdir(info.id, "/work/x")
    assert list(root.iterdir()) == []
    await rnode.sandbox_destroy(info.id)
    assert "destroy_error" not in _destroy_events(rnode, info.id)


# ---------------------------------------------------------------- many at once


async def test_thirty_concurrent(rnode: Node) -> None:
    infos = await asyncio.gather(*(rnode.sandbox_create(_spec()) for _ in range(30)))
    assert len({i.id for i in infos}) == 30
    rs = await asyncio.gather(*(rnode.exec(i.id, ExecRequest(cmd=["echo", i.id])) for i in infos))
    assert [r.stdout for r in rs] == [i.id.encode() + b"\n" for i in infos]
    await asyncio.gather(*(rnode.sandbox_destroy(i.id) for i in infos))
    assert await rnode.sandbox_list() == []
    assert rnode.backend.layers.mounted() == {}


async def test_thirty_concurrent_with_failures(rnode: Node) -> None:
    huge = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 2
    specs: list[SandboxSpec] = [_spec() for _ in range(30)]
    bad = [
        _spec("no/such-image"),
        _spec(limits=Limits(memory=huge)),
        _spec(limits=Limits(disk="1TiB")),
        _spec("sha256:" + "0" * 64),
        _spec("test/debian", limits=Limits(disk="1TiB")),
    ]
    for k, b in enumerate(bad):
        specs.insert(k * 6, b)
    results = await asyncio.gather(
        *(rnode.sandbox_create(s) for s in specs), return_exceptions=True
    )
    ok = [r for r in results if not isinstance(r, BaseException)]
    errs = [r for r in results if isinstance(r, BaseException)]
    assert len(ok) == 30, errs
    assert len(errs) == 5
    for e in errs:
        assert isinstance(e, (ImageNotFound, InvalidRequest)), repr(e)
    live = await rnode.sandbox_list()
    assert sorted(i.id for i in live) == sorted(i.id for i in ok)
    assert all(i.state == "running" for i in live)
    await asyncio.gather(*(rnode.sandbox_destroy(i.id) for i in ok))
    assert await rnode.sandbox_list() == []


# ---------------------------------------------------------------- close / crash


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.01, 0.02, 0.04, 0.08, "first"])
async def test_close_with_creates_in_flight(images_ready, delay: float | str) -> None:
    n = await Node.open(_cfg())
    made: list[str] = []
    try:
        await n.gc(everything=True)
        tasks = [asyncio.create_task(n.sandbox_create(_spec())) for _ in range(6)]
        if delay == "first":  # once one is done, the others are inside their create
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(float(delay))
        closer = asyncio.create_task(n.close())
        await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await closer
        for r in results:
            if not isinstance(r, BaseException):
                made.append(r.id)
            else:
                assert isinstance(r, (asyncio.CancelledError, CorralError)), repr(r)
        with pytest.raises(Conflict):
            await n.sandbox_create(_spec())
    finally:
        if not n.life.closed:
            await n.close()
    n = await Node.open(_cfg())
    try:
        live = await n.sandbox_list()
        for info in live:
            assert info.state == "running"
            r = await n.exec(info.id, ExecRequest(cmd=["echo", "ok"]))
            assert r.stdout == b"ok\n"
        # every create that returned is still there; the cancelled ones are cleaned up
        assert set(made) == {i.id for i in live}
        removed = await n.gc()
        assert sum(removed.values()) == 0, removed  # nothing was left for gc to find
        assert {c["id"] for c in await n.backend.runtime.list()} == {i.id for i in live}
        assert set(n.cgroups.list()) == {i.id for i in live}
        assert set(n.scratch.subvols()) == {i.id for i in live}
    finally:
        await _shutdown(n)
    _assert_clean()


async def test_create_cancelled_mid_run_leaves_nothing(rnode: Node) -> None:
    """A create cancelled while the runtime is starting the container must not leave that
    container running untracked (it did, about 1 in 20 times, before run_detached waited
    for the runtime it started)."""
    rt = rnode.backend.runtime
    name = _start_name(rt)
    orig = getattr(rt, name)
    delay = 0.0

    async def cut_short(*a, **kw):  # type: ignore[no-untyped-def]
        job = asyncio.ensure_future(orig(*a, **kw))
        await asyncio.sleep(delay)
        if job.done():  # the runtime was quicker: the cancel arrives just after it started
            await job
            raise asyncio.CancelledError
        job.cancel()
        return await job

    setattr(rt, name, cut_short)
    try:
        for k in range(40):
            delay = 0.002 + (k % 20) * 0.001
            with pytest.raises(asyncio.CancelledError):
                await rnode.sandbox_create(_spec())
            await asyncio.sleep(0.05)  # an abandoned runtime would be done by now
            assert await rnode.sandbox_list() == []
            stray = {c: rnode.cgroups.procs(c) for c in rnode.cgroups.list()}
            assert stray == {}, f"delay {delay:.3f}: untracked sandbox processes {stray}"
            assert [c["id"] for c in await rnode.backend.runtime.list()] == []
            assert _dirs(rnode) == set()
    finally:
        setattr(rt, name, orig)


async def test_exec_outlives_close(images_ready) -> None:
    """An exec running when the node closes still gets its result (not a database error);
    the sandbox is adopted by the next open."""
    n = await Node.open(_cfg())
    try:
        await n.gc(everything=True)
        info = await n.sandbox_create(_spec())
        pending = asyncio.create_task(n.exec(info.id, ExecRequest(cmd=["sleep", "5"], timeout=0.5)))
        await asyncio.sleep(0.1)
    finally:
        await n.close()
    r = await asyncio.wait_for(pending, 10)
    assert r.reason == "timeout"
    n = await Node.open(_cfg())
    try:
        assert [i.id for i in await n.sandbox_list()] == [info.id]
    finally:
        await _shutdown(n)
    _assert_clean()


async def test_failed_open_releases_the_state_dir(images_ready, monkeypatch) -> None:
    """An open that fails in recovery must not keep the state dir locked in this process."""
    from corral.errors import HostError
    from corral.node.lifecycle import Lifecycle

    async def broken(self: Lifecycle) -> None:
        raise HostError("recovery failed (simulated)")

    with monkeypatch.context() as m:
        m.setattr(Lifecycle, "recover", broken)
        with pytest.raises(HostError, match="simulated"):
            await Node.open(_cfg())
    n = await Node.open(_cfg())  # not "another corral node already owns ..."
    await _shutdown(n)
    _assert_clean()


_CHILD = r"""
import asyncio, sys, time
from corral.node import Node
from corral.spec import Limits, SandboxSpec
from tests.integration.test_robustness import _cfg, SMALL

async def main(mode):
    n = await Node.open(_cfg())
    for _ in range(3):
        info = await n.sandbox_create(SandboxSpec(image="test/busybox", limits=SMALL))
        print("created", info.id, flush=True)
    if mode == "mid_destroy":
        info = await n.sandbox_create(SandboxSpec(image="test/busybox", limits=SMALL))
        def stuck_destroy(*a, **kw):
            print("stuck", flush=True)
            time.sleep(3600)
        n.scratch.delete_subvol = stuck_destroy  # after the kill and the rootfs unmount
        await n.sandbox_destroy(info.id)
        return
    if mode == "before_run":
        orig = n.scratch.create_subvol
        def stuck(*a, **kw):
            p = orig(*a, **kw)
            print("stuck", flush=True)
            time.sleep(3600)
            return p
        n.scratch.create_subvol = stuck
    else:
        rt = n.backend.runtime
        name = "start" if rt.name == "launch" else "run_detached"
        orig = getattr(rt, name)
        async def stuck(*a, **kw):
            await orig(*a, **kw)
            print("stuck", flush=True)
            await asyncio.sleep(3600)
        setattr(rt, name, stuck)
    await n.sandbox_create(SandboxSpec(image="test/busybox", limits=SMALL))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("mode", ["before_run", "after_run", "mid_destroy"])
async def test_agent_crash(images_ready, mode: str) -> None:
    """SIGKILL of the agent in the middle of a 4th create (or of a destroy): the next open
    keeps the 3 finished sandboxes and cleans up the half-made (half-destroyed) one."""
    n = await Node.open(_cfg())
    try:
        await n.gc(everything=True)
        mark = n.state.last_event_id()
    finally:
        await n.close()
    _assert_clean()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, mode, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    survivors: list[str] = []
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            while True:
                line = (await proc.stdout.readline()).decode().split()
                assert line, "child ended before it got stuck"
                if line[0] == "created":
                    survivors.append(line[1])
                elif line[0] == "stuck":
                    break
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert len(survivors) == 3
    n = await Node.open(_cfg())
    try:
        live = {i.id: i for i in await n.sandbox_list()}
        assert set(live) == set(survivors), (live.keys(), survivors)
        for sid in survivors:
            r = await n.exec(sid, ExecRequest(cmd=["echo", sid]))
            assert r.stdout == sid.encode() + b"\n"
        lost = [e for e in n.state.events(since_id=mark) if e.kind == "lost"]
        assert len(lost) == 1, lost
        removed = await n.gc()
        assert sum(removed.values()) == 0, removed  # recovery already cleaned up
        assert set(n.cgroups.list()) == set(survivors)
        assert set(n.scratch.subvols()) == set(survivors)
        assert _dirs(n) == set(survivors)
    finally:
        await _shutdown(n)
    _assert_clean()


async def test_scratch_never_mounted_twice(images_ready) -> None:
    """The scratch btrfs outlives its unmount while anything still holds it (a leaked
    sandbox's overlay; here a private mount namespace). The next open must mount that same
    filesystem again, never a second loop device on the image: two btrfs instances on one
    file corrupt it (seen: "bad tree block start", forced read-only)."""
    import subprocess

    from corral.host import loop

    n = await Node.open(_cfg())
    try:
        await n.gc(everything=True)
        sb = await n.sandbox_create(_spec())
        await n.file_write(sb.id, "/tmp/kept", b"data")
        holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "120"])
        try:
            deadline = time.monotonic() + 10
            while str(STATE / "scratch") not in Path(f"/proc/{holder.pid}/mountinfo").read_text():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await n.sandbox_destroy(sb.id)
            await n.close()  # no sandbox left: unmounts the scratch fs; the holder keeps it
            assert len(loop.backed_by(STATE)) == 1
            n = await Node.open(_cfg())
            assert len(loop.backed_by(STATE)) == 1, loop.backed_by(STATE)
            sb = await n.sandbox_create(_spec())
            r = await n.exec(
                sb.id,
                ExecRequest(
                    cmd=["sh", "-c", "dd if=/dev/zero of=/tmp/x bs=1M count=20 2>&1 && sync"]
                ),
            )
            assert r.exit_code == 0, r.stdout
            assert await n.file_read(sb.id, "/tmp/x", 0, 4) == bytes(4)
        finally:
            holder.kill()
            holder.wait()
    finally:
        await _shutdown(n)
    _assert_clean()


# ---------------------------------------------------------------- corruption


def _make_store2() -> tuple[str, str]:
    """A throwaway store with two small runnable busybox images: rob/ok and rob/bad."""
    from corral.images.store import LayerStore

    shutil.rmtree(STORE2, ignore_errors=True)
    store = LayerStore(STORE2)
    digests = []
    for name in ("ok", "bad"):
        src = STORE2 / "tmp" / f"src-{name}"
        for d in ("bin", "etc", "tmp", "root", "proc", "sys", "dev"):
            (src / d).mkdir(parents=True, exist_ok=True)
        shutil.copy("/bin/busybox", src / "bin" / "busybox")
        for applet in ("sh", "echo", "cat", "true"):
            os.symlink("busybox", src / "bin" / applet)
        (src / "etc" / "which").write_text(name + "\n")
        layer = store.add_dir(src, kind="dir")
        shutil.rmtree(src)
        store.put_image(f"rob/{name}", [layer.digest])
        digests.append(layer.digest)
    return digests[0], digests[1]


async def test_corrupt_layer(images_ready) -> None:
    ok_digest, bad_digest = _make_store2()
    from corral.images.store import LayerStore

    bad_file = LayerStore(STORE2).path_of(bad_digest)
    n = await Node.open(_cfg(store=STORE2))
    try:
        await n.gc(everything=True)
        mark = n.state.last_event_id()
        good = await n.sandbox_create(_spec("rob/ok"))
        size = bad_file.stat().st_size
        with open(bad_file, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]))
        for _ in range(2):  # refused every time, not only the first
            with pytest.raises(LayerCorrupt, match=bad_digest):
                await n.sandbox_create(_spec("rob/bad"))
        # nothing half-made
        assert [i.id for i in await n.sandbox_list()] == [good.id]
        assert _dirs(n) == {good.id}
        assert set(n.scratch.subvols()) == {good.id}
        assert set(n.cgroups.list()) == {good.id}
        assert set(n.backend.layers.mounted()) == {ok_digest}
        bad_hex = bad_digest.split(":")[1]
        assert not any(bad_hex in m for m in leaks.scan(STATE, RUN, SUBTREE)["mounts"])
        kinds = [e.kind for e in n.state.events(since_id=mark) if e.kind == "create_failed"]
        assert len(kinds) == 2
        # the neighbour is unaffected
        r = await n.exec(good.id, ExecRequest(cmd=["cat", "/etc/which"]))
        assert r.stdout == b"ok\n"
        # repaired, the image works again
        with open(bad_file, "r+b") as f:
            f.seek(size // 2)
            f.write(b)
        fixed = await n.sandbox_create(_spec("rob/bad"))
        r = await n.exec(fixed.id, ExecRequest(cmd=["cat", "/etc/which"]))
        assert r.stdout == b"bad\n"
    finally:
        await _shutdown(n)
        shutil.rmtree(STORE2, ignore_errors=True)
    _assert_clean()


# ---------------------------------------------------------------- a dying init


async def test_init_dies(rnode: Node) -> None:
    victim = await rnode.sandbox_create(_spec())
    neighbour = await rnode.sandbox_create(_spec())
    assert victim.pid
    pending = asyncio.create_task(rnode.exec(victim.id, ExecRequest(cmd=["sleep", "30"])))
    await _until_running(rnode, victim.id, b"sleep\x0030\x00")  # the init dies under it
    os.kill(victim.pid, signal.SIGKILL)
    r = await asyncio.wait_for(asyncio.gather(pending, return_exceptions=True), 5)
    stopped = f"sandbox {victim.id} has stopped: its init is not running"
    gone = f"sandbox {victim.id} was destroyed"
    assert isinstance(r[0], (SandboxError, SandboxNotFound)), repr(r[0])
    assert stopped in str(r[0]) or gone in str(r[0]), str(r[0])
    # before or after the reaper: a clear error naming the sandbox, never a hang
    for op in (
        lambda: rnode.exec(victim.id, ExecRequest(cmd=["true"])),
        lambda: rnode.spawn(victim.id, ExecRequest(cmd=["true"])),
        lambda: rnode.process_list(victim.id),
    ):
        try:
            await asyncio.wait_for(op(), 5)
        except (SandboxError, SandboxNotFound, Conflict) as e:
            assert victim.id in str(e)
            assert "ctl.sock" not in str(e), str(e)
        else:
            raise AssertionError("a request to a sandbox whose init is dead succeeded")
    deadline = time.monotonic() + 10
    while victim.id in [i.id for i in await rnode.sandbox_list()]:
        assert time.monotonic() < deadline, "the reaper did not notice the dead init"
        await asyncio.sleep(0.1)
    kinds = _destroy_events(rnode, victim.id)
    assert "died" in kinds and "destroy_error" not in kinds, rnode.state.events(victim.id)
    with pytest.raises(SandboxNotFound, match=victim.id):
        await rnode.exec(victim.id, ExecRequest(cmd=["true"]))
    with pytest.raises(SandboxNotFound, match=victim.id):
        await rnode.file_read(victim.id, "/etc/passwd")
    assert victim.id not in _dirs(rnode)
    r2 = await rnode.exec(neighbour.id, ExecRequest(cmd=["echo", "fine"]))
    assert r2.stdout == b"fine\n"


async def test_destroy_never_kills_a_reused_pid(images_ready) -> None:
    """The runtime's record keeps a dead init's pid; if the host reuses it before the
    destroy, the destroy must not kill that unrelated process (simulated: the record is
    pointed at a process of ours)."""
    import json
    import subprocess

    n = await Node.open(_cfg(reaper_interval=3600))
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        await n.gc(everything=True)
        info = await n.sandbox_create(_spec())
        assert info.pid
        os.kill(info.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while n.backend.alive(info.id):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        if n.backend.runtime.name == "launch":
            from corral.host.launch import _start_time

            rec = n.backend.runtime.root / info.id
            rec.write_text(f"{bystander.pid} {_start_time(bystander.pid)}\n")
        for name in ("state.json", "status"):
            f = n.backend.runtime.root / info.id / name
            if f.exists():
                data = json.loads(f.read_text())
                key = "init_process_pid" if "init_process_pid" in data else "pid"
                data[key] = bystander.pid
                f.write_text(json.dumps(data))
        assert n.backend.init_pid(info.id) == bystander.pid
        await n.sandbox_destroy(info.id)
        assert bystander.poll() is None, "destroy killed a process that is not the sandbox's"
    finally:
        bystander.kill()
        bystander.wait()
        await _shutdown(n)
    _assert_clean()


async def test_stuck_init_gives_an_error_not_a_hang(rnode: Node) -> None:
    """A frozen init (SIGSTOP from the host) still accepts connections in the kernel;
    an exec without a timeout must not wait forever for it."""
    info = await rnode.sandbox_create(_spec())
    assert info.pid
    rnode.backend.agent(info.id).start_timeout = 0.5
    os.kill(info.pid, signal.SIGSTOP)
    try:
        with pytest.raises(SandboxError, match="did not start exec within 0.5 s"):
            await asyncio.wait_for(rnode.exec(info.id, ExecRequest(cmd=["true"])), 10)
        with pytest.raises(SandboxError, match=info.id):
            async with asyncio.timeout(10):
                async for _ in rnode.exec_stream(info.id, ExecRequest(cmd=["true"])):
                    pass
    finally:
        os.kill(info.pid, signal.SIGCONT)
    r = await rnode.exec(info.id, ExecRequest(cmd=["echo", "thawed"]))
    assert r.stdout == b"thawed\n"
    os.kill(info.pid, signal.SIGSTOP)  # destroy copes with a stopped init too
    t0 = time.monotonic()
    await rnode.sandbox_destroy(info.id)
    assert time.monotonic() - t0 < 30  # generous: a destroy waiting on the stopped init hangs
    assert "destroy_error" not in _destroy_events(rnode, info.id)


# ---------------------------------------------------------------- disk pressure


async def test_disk_pressure_is_per_sandbox(rnode: Node) -> None:
    lim = Limits(cpus=1, memory="256MiB", pids=128, disk="64MiB")
    hog = await rnode.sandbox_create(_spec(limits=lim))
    other = await rnode.sandbox_create(_spec(limits=lim))
    r = await rnode.exec(
        hog.id,
        ExecRequest(
            cmd=["sh", "-c", "dd if=/dev/zero of=/tmp/fill bs=1M count=200 2>&1; sync"], timeout=60
        ),
    )
    assert b"No space left" in r.stdout or b"quota" in r.stdout.lower(), r.stdout
    r = await rnode.exec(hog.id, ExecRequest(cmd=["sh", "-c", "echo more > /tmp/more"]))
    assert r.exit_code != 0  # still full
    # the files API says so clearly, and its half-written temporary file does not stay
    with pytest.raises(QuotaExceeded, match="/tmp/api: disk quota exceeded"):
        await rnode.file_write(hog.id, "/tmp/api", b"z" * (8 << 20))
    assert {e.name for e in await rnode.file_list(hog.id, "/tmp")} == {"fill"}
    # the other sandbox writes 32 MiB, by exec and through the files API
    r = await rnode.exec(
        other.id,
        ExecRequest(
            cmd=["sh", "-c", "dd if=/dev/zero of=/tmp/data bs=1M count=32 2>&1 && sync"], timeout=60
        ),
    )
    assert r.exit_code == 0, r.stdout
    await rnode.file_write(other.id, "/tmp/api", b"y" * (8 << 20))
    assert (await rnode.file_stat(other.id, "/tmp/api")).size == 8 << 20
    # the hog recovers once it frees its space
    r = await rnode.exec(
        hog.id,
        ExecRequest(
            cmd=["sh", "-c", "rm /tmp/fill && sync && echo ok > /tmp/more && cat /tmp/more"]
        ),
    )
    assert r.stdout == b"ok\n", r
