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

from corral.errors import HostError, ScratchFull
from corral.host import leaks
from corral.node import Node
from corral.spec import ExecRequest, Limits, SandboxSpec
from tests.conftest import TAG
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


# ---------------------------------------------------------------- the state database

_LOCKER = r"""
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin
db.execute("ROLLBACK")
"""


async def test_state_db_locked_by_another_process(images_ready) -> None:  # type: ignore[no-untyped-def]
    """An sqlite3 shell (here a helper process) holds a write transaction on state.db:
    creates wait, then fail clearly; running sandboxes keep working; released, all works."""
    n = await _fresh()
    holder: subprocess.Popen[bytes] | None = None
    try:
        kept = await _Kept.make(n)
        db = STATE / "state.db"
        holder = subprocess.Popen(
            [sys.executable, "-c", _LOCKER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"locked\n"
        with pytest.raises(HostError, match=r"state database .*state\.db is locked") as got:
            await n.sandbox_create(_spec())
        assert "fuser" in str(got.value)
        assert len(n.table) == 1  # no ghost 'creating' entry left behind
        await kept.check(n)  # exec and files need no write to the database
        # a reaper pass writes activity stamps: it fails the same way (its loop logs it
        # and goes on), and the node still serves the running sandbox after it
        with pytest.raises(HostError, match="locked"):
            await n.reaper.once()
        await kept.check(n)
        holder.stdin.close()  # type: ignore[union-attr]
        assert holder.wait(timeout=30) == 0
        holder = None
        fresh = await n.sandbox_create(_spec())
        assert {i.id for i in await n.sandbox_list()} == {kept.sid, fresh.id}
        await kept.check(n)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        await _shutdown(n)
    # every sandbox the node reported is in the database, nothing more
    _assert_clean()


_CRASHER = r"""
import asyncio, os, signal, sys
from corral.node import Node
from corral.spec import Limits, SandboxSpec
from tests.integration.test_faults import _cfg, SMALL

async def main():
    n = await Node.open(_cfg())
    for _ in range(2):
        info = await n.sandbox_create(SandboxSpec(image="test/busybox", limits=SMALL))
        await n.file_write(info.id, "/tmp/kept.bin", info.id.encode() * 100)
        print("created", info.id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the agent dies with its last commits in the WAL

asyncio.run(main())
"""


async def _crash_with_two() -> list[str]:
    """An agent in a child process creates two sandboxes and is SIGKILLed."""
    n = await _fresh()
    await _shutdown(n)  # cleanly closed: the WAL is checkpointed and removed
    assert not (STATE / "state.db-wal").exists()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASHER, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == -signal.SIGKILL, out
    ids = [ln.split()[1] for ln in out.decode().splitlines() if ln.startswith("created")]
    assert len(ids) == 2, out
    return ids


@pytest.mark.parametrize("damage", ["removed", "truncated"])
async def test_state_db_wal_lost_while_down(images_ready, damage: str) -> None:  # type: ignore[no-untyped-def]
    """The WAL holding the last commits is removed or cut while the agent is down: the
    next open refuses, naming the file, and destroys nothing; with the WAL restored it
    adopts both sandboxes, files intact."""
    ids = await _crash_with_two()
    wal = STATE / "state.db-wal"
    saved = STATE / "wal.saved"
    shutil.copy(wal, saved)
    try:
        if damage == "removed":
            wal.unlink()
        else:
            os.truncate(wal, wal.stat().st_size // 2)
        for _ in range(2):
            with pytest.raises(HostError, match=r"write-ahead log .*state\.db-wal") as got:
                await Node.open(_cfg())
            assert "state.db-shm" in str(got.value)
        shutil.copy(saved, wal)
    finally:
        saved.unlink()
    n = await Node.open(_cfg())
    try:
        assert sorted(i.id for i in await n.sandbox_list()) == sorted(ids)
        for sid in ids:
            assert await n.file_read(sid, "/tmp/kept.bin") == sid.encode() * 100
            r = await n.exec(sid, ExecRequest(cmd=["echo", sid]))
            assert r.stdout == sid.encode() + b"\n"
    finally:
        await _shutdown(n)
    _assert_clean()


async def test_state_db_wal_loss_accepted(images_ready) -> None:  # type: ignore[no-untyped-def]
    """The operator accepts the loss (removes the -shm as the refusal says): the node
    opens on the older database and `gc` removes what it forgot, leaving nothing."""
    await _crash_with_two()
    (STATE / "state.db-wal").unlink()
    (STATE / "state.db-shm").unlink()
    n = await Node.open(_cfg())
    try:
        assert await n.sandbox_list() == []  # forgotten: their rows were in the WAL
        removed = await n.gc(everything=True)
        assert removed["cgroups"] + removed["subvols"] >= 2, removed
    finally:
        await _shutdown(n)
    _assert_clean()


# ---------------------------------------------------------------- the layer store

STORE = Path(f"/var/tmp/corral-test{TAG}-flt-store")


def _make_store() -> tuple[str, str]:
    """A throwaway local store with two small busybox images, flt/ok and flt/other."""
    from corral.images.store import LayerStore

    shutil.rmtree(STORE, ignore_errors=True)
    store = LayerStore(STORE)
    digests = []
    for name in ("ok", "other"):
        src = STORE / "tmp" / f"src-{name}"
        for d in ("bin", "etc", "tmp", "root", "proc", "sys", "dev"):
            (src / d).mkdir(parents=True, exist_ok=True)
        shutil.copy("/bin/busybox", src / "bin" / "busybox")
        for applet in ("sh", "echo", "cat", "true", "wc"):
            os.symlink("busybox", src / "bin" / applet)
        (src / "etc" / "which").write_text(name + "\n")
        layer = store.add_dir(src, kind="dir")
        shutil.rmtree(src)
        store.put_image(f"flt/{name}", [layer.digest])
        digests.append(layer.digest)
    return digests[0], digests[1]


async def test_local_store_unreachable_or_damaged(images_ready) -> None:  # type: ignore[no-untyped-def]
    """The local store loses a layer file, then the whole directory, then holds a
    truncated layer: each create of an image not yet mounted fails naming the layer or
    the store; a sandbox already running (its layer mounted) is untouched; put back, the
    same create works without a restart."""
    from corral.errors import LayerCorrupt, LayerNotFound, StoreUnavailable
    from corral.images.store import LayerStore

    ok_digest, other_digest = _make_store()
    layer = LayerStore(STORE).path_of(other_digest)
    n = await Node.open(_cfg(store=STORE))
    try:
        await n.gc(everything=True)
        running = await n.sandbox_create(_spec("flt/ok"))
        await n.file_write(running.id, "/tmp/kept.bin", b"k" * 4096)

        async def running_fine() -> None:
            r = await n.exec(running.id, ExecRequest(cmd=["cat", "/etc/which"]))
            assert r.stdout == b"ok\n"
            assert await n.file_read(running.id, "/tmp/kept.bin") == b"k" * 4096

        async def other_works() -> None:
            sb = await n.sandbox_create(_spec("flt/other"))
            r = await n.exec(sb.id, ExecRequest(cmd=["cat", "/etc/which"]))
            assert r.stdout == b"other\n"
            await n.sandbox_destroy(sb.id)

        # 1. the layer file removed
        aside = STORE / "aside.erofs"
        layer.rename(aside)
        with pytest.raises(LayerNotFound, match=other_digest) as got:
            await n.sandbox_create(_spec("flt/other"))
        assert str(STORE) in str(got.value)
        await running_fine()
        aside.rename(layer)
        await other_works()
        # 2. the whole store directory gone (an unmounted share, a renamed dir)
        gone = STORE.with_name(STORE.name + "-gone")
        STORE.rename(gone)
        try:
            with pytest.raises(StoreUnavailable, match=f"layer store {STORE} is not there"):
                await n.sandbox_create(_spec("flt/other"))
            await running_fine()
        finally:
            gone.rename(STORE)
        await other_works()
        # 3. a truncated layer file: the first mount refuses it by its digest (the layer's
        # mount from the creates above lingers: swept first, as after layer_linger)
        await asyncio.to_thread(n.backend.layers.sweep, time.monotonic() + n.config.layer_linger)
        saved = layer.read_bytes()
        os.truncate(layer, len(saved) // 2)
        try:
            with pytest.raises(LayerCorrupt, match=other_digest):
                await n.sandbox_create(_spec("flt/other"))
            await running_fine()
        finally:
            layer.write_bytes(saved)
        await other_works()
        assert [i.id for i in await n.sandbox_list()] == [running.id]
        assert set(n.backend.layers.mounted()) == {ok_digest}
    finally:
        await _shutdown(n)
        shutil.rmtree(STORE, ignore_errors=True)
    _assert_clean()


# ---------------------------------------------------------------- missing binaries


def _path_without(tmp: Path, *missing: str) -> str:
    """A PATH of one directory holding links to every program of the usual PATH but
    ``missing``: the host as if those packages were not installed."""
    tmp.mkdir(parents=True, exist_ok=True)
    for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            link = tmp / name
            if name in missing or link.exists() or link.is_symlink():
                continue
            os.symlink(os.path.join(d, name), link)
    return str(tmp)


@pytest.mark.parametrize("runtime", ["crun", "auto"])
async def test_oci_runtime_missing(images_ready, monkeypatch, tmp_path, runtime) -> None:  # type: ignore[no-untyped-def]
    """Neither crun nor runc on PATH. A node configured for an OCI runtime refuses to start,
    naming both and the Debian packages; the default (corral's launcher) needs neither and
    starts. Either way the sandboxes of the earlier agent keep running and are adopted
    (once the runtime is back, for the OCI one)."""
    from corral.backends.config import ContainerConfig

    backends = [ContainerConfig(runtime=runtime)]
    n = await Node.open(_cfg(backends=backends))
    await n.gc(everything=True)  # what an earlier, crashed run of this module left
    kept = await _Kept.make(n)
    await n.close()  # the agent goes; its sandboxes keep running
    with monkeypatch.context() as m:
        m.setenv("PATH", _path_without(tmp_path / "bin", "runc", "crun"))
        if runtime == "crun":
            with pytest.raises(HostError) as got:
                await Node.open(_cfg(backends=backends))
            text = str(got.value)
            assert "runc" in text and "crun" in text and "apt-get install" in text, text
        else:
            n = await Node.open(_cfg(backends=backends))
            try:
                assert n.backends.get("container").runtime.name == "launch"
                assert [i.id for i in await n.sandbox_list()] == [kept.sid]
                await kept.check(n)
                fresh = await n.sandbox_create(_spec())
                r = await n.exec(fresh.id, ExecRequest(cmd=["echo", "ok"]))
                assert r.stdout == b"ok\n"
                await n.sandbox_destroy(fresh.id)
            finally:
                await n.close()
    n = await Node.open(_cfg(backends=backends))
    try:
        assert [i.id for i in await n.sandbox_list()] == [kept.sid]
        await kept.check(n)
    finally:
        await _shutdown(n)
    _assert_clean()


_BUILD = r"""
import sys
from pathlib import Path
from corral.errors import CorralError
from corral.images import build
from corral.images.store import LayerStore
try:
    build.build_dir(LayerStore(Path(sys.argv[1])), Path(sys.argv[2]))
except CorralError as e:
    print(type(e).__name__, e)
else:
    print("built")
"""


def test_mkfs_erofs_missing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A layer build without mkfs.erofs on PATH fails naming it and erofs-utils; with it
    back the same build works (a new process: the erofs-utils version is cached)."""
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_text("hi\n")
    store = tmp_path / "store"
    env = {**os.environ, "PATH": _path_without(tmp_path / "bin", "mkfs.erofs")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    argv = [sys.executable, "-c", _BUILD, str(store), str(src)]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.stdout.startswith("HostError"), (r.stdout, r.stderr[-2000:])
    assert "mkfs.erofs" in r.stdout and "erofs-utils" in r.stdout, r.stdout
    env["PATH"] = os.environ["PATH"]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.stdout.strip() == "built", (r.stdout, r.stderr[-2000:])


# ---------------------------------------------------------------- the clock jumps


class _JumpedClock:
    """``time`` as the reaper sees it after the wall clock jumped ``offset`` s forward.

    The reaper compares ``time.time()`` with each sandbox's ``expires_at`` (wall time, so
    that a TTL survives an agent restart). A time namespace cannot move CLOCK_REALTIME,
    and setting the host's clock would move it for everyone on the machine, so the jump is
    a stand-in for the reaper module's ``time`` (no seam in the node's code)."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def time(self) -> float:
        return time.time() + self.offset

    def monotonic(self) -> float:
        return time.monotonic()


async def test_clock_jumps_past_ttls(images_ready, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The wall clock jumps an hour: sandboxes whose TTL (or idle timeout) passed are
    reaped exactly once, paused ones included; the others are untouched."""
    from corral.node import reaper as reaper_mod

    n = await _fresh()
    try:
        mark = n.state.last_event_id()
        short = await n.sandbox_create(_spec(ttl=600))
        short_paused = await n.sandbox_create(_spec(ttl=600))
        await n.sandbox_pause(short_paused.id)
        idle = await n.sandbox_create(_spec(idle_timeout=1800))
        long = await _Kept.make(n)  # no TTL
        longer = await n.sandbox_create(_spec(ttl=86400))
        monkeypatch.setattr(reaper_mod, "time", _JumpedClock(3600))
        doomed = {short.id, short_paused.id, idle.id}
        deadline = time.monotonic() + 60
        while doomed & {i.id for i in await n.sandbox_list()}:
            assert time.monotonic() < deadline, "the reaper never took the expired ones"
            await asyncio.sleep(0.05)
        for _ in range(3):  # more passes with the clock still ahead: nothing more happens
            await n.reaper.once()
        assert {i.id for i in await n.sandbox_list()} == {long.sid, longer.id}
        events = [e for e in n.state.events(since_id=mark) if e.sandbox_id in doomed]
        ends = sorted((e.sandbox_id, e.kind) for e in events if e.kind in _ENDS)
        assert ends == sorted(
            [(short.id, "ttl_expired"), (short_paused.id, "ttl_expired"), (idle.id, "idle_timeout")]
        ), ends
        await long.check(n)
        r = await n.exec(longer.id, ExecRequest(cmd=["true"]))
        assert r.exit_code == 0
    finally:
        monkeypatch.undo()
        await _shutdown(n)
    _assert_clean()


_ENDS = {"ttl_expired", "idle_timeout", "destroyed", "destroy_error", "died", "lost"}


# ---------------------------------------------------------------- the agent's memory tight

_AGENT = r"""
import asyncio, os, sys
from pathlib import Path
Path(sys.argv[1], "cgroup.procs").write_text(str(os.getpid()))  # before anything is loaded
from corral.api.server import NodeServer
from corral.node import Node
from corral.backends.config import ContainerConfig
from tests.integration.test_faults import _cfg, RUN

async def main():
    n = await Node.open(_cfg(backends=[ContainerConfig(runtime=sys.argv[2])]))
    async with NodeServer(n, uds=RUN / "agent.sock"):
        print("ready", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


class _AgentCgroup:
    """A memory cgroup for the node agent itself, beside the node's subtree and named
    after it (never one of the machine's own cgroups). v1: memory.limit_in_bytes (the
    hybrid hosts here); v2: memory.max."""

    def __init__(self) -> None:
        v1 = Path("/sys/fs/cgroup/memory")
        self.v1 = v1.is_dir() and (v1 / "memory.limit_in_bytes").exists()
        base = v1 if self.v1 else Path("/sys/fs/cgroup")
        self.path = base / f"{SUBTREE}-agent"
        self.path.mkdir(exist_ok=True)

    def usage(self) -> int:
        f = "memory.usage_in_bytes" if self.v1 else "memory.current"
        return int((self.path / f).read_text())

    def failures(self) -> int:
        if self.v1:
            return int((self.path / "memory.failcnt").read_text())
        events = dict(ln.split() for ln in (self.path / "memory.events").read_text().splitlines())
        return int(events.get("max", 0))

    def limit(self, value: int) -> None:
        f = "memory.limit_in_bytes" if self.v1 else "memory.max"
        (self.path / f).write_text(str(value))

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.05)  # the killed agent's exit is being accounted
        self.path.rmdir()


async def _start_agent(cg: _AgentCgroup, runtime: str) -> asyncio.subprocess.Process:
    argv = [sys.executable, "-c", _AGENT, str(cg.path), runtime]
    proc = await asyncio.create_subprocess_exec(*argv, cwd=REPO, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    async with asyncio.timeout(120):
        line = await proc.stdout.readline()
    assert line == b"ready\n", (line, proc.returncode)
    return proc


@pytest.mark.parametrize("runtime", ["crun", "auto"])
async def test_agent_memory_tight(images_ready, runtime) -> None:  # type: ignore[no-untyped-def]
    """The agent runs in a memory cgroup squeezed to what it uses (crun: 4 MiB above); 18
    creates and execs go on over its API, 6 at a time. Each works or fails with a
    CorralError that has a message. What happens here (2026-12): with crun, the OCI runtime
    processes the agent starts are charged to its cgroup, the cgroup's OOM killer picks the
    agent (the largest process) and clients get TransportError; corral's launcher joins
    the sandbox's cgroups before it clones, so only the agent's own growth (its heap, the
    database's pages) meets the limit, hence no headroom. The sandboxes live in their own
    cgroups and survive. Once the limit is raised, a restarted agent (as a supervisor
    would) adopts the sandbox made before, its file intact, and creates work again."""
    import corral
    from corral.backends.config import ContainerConfig

    n = await _fresh()
    await _shutdown(n)
    cg = _AgentCgroup()
    agent: asyncio.subprocess.Process | None = None
    outcomes: dict[str, int] = {}
    try:
        cg.limit(1 << 30)
        agent = await _start_agent(cg, runtime)
        address = f"unix://{RUN / 'agent.sock'}"
        async with corral.AsyncClient(address) as c:
            kept = await c.sandboxes.create(image="test/busybox", limits=SMALL)
            await kept.files.write("/tmp/kept.bin", b"k" * 65536)
            tight = cg.usage() + (4 << 20 if runtime == "crun" else 0)
            cg.limit(tight)
            before = cg.failures()

            async def one(i: int) -> None:
                try:
                    sb = await c.sandboxes.create(image="test/busybox", limits=SMALL)
                    r = await sb.exec(["echo", str(i)], timeout=60)
                    key = "ok" if r.stdout == f"{i}\n".encode() else "wrong"
                    outcomes[key] = outcomes.get(key, 0) + 1
                    await sb.destroy()
                except corral.CorralError as e:
                    kind = f"{type(e).__name__}: {e.message[:160]}"
                    outcomes[kind] = outcomes.get(kind, 0) + 1

            for rnd in range(3):  # 6 creates at once: 6 runtime processes in the cgroup
                await asyncio.gather(*(one(6 * rnd + k) for k in range(6)))
                if agent.returncode is not None:
                    break
            pressure = cg.failures() - before
        print("outcomes", outcomes, "limit hits", pressure, "agent", agent.returncode)
        if agent.returncode is not None:  # killed: by the OOM killer, not a crash of ours
            assert agent.returncode == -signal.SIGKILL, agent.returncode
        assert pressure > 0, "the limit was never reached: no pressure was applied"
        cg.limit(1 << 30)
        if agent.returncode is None:
            # A kill issued just before the raise may not be reaped yet: a refused ping
            # means the listener is gone, so the process is dead or dying; wait for it.
            try:
                async with corral.AsyncClient(address) as c:
                    await c.sandboxes.list()
            except corral.TransportError:
                await asyncio.wait_for(agent.wait(), 60)
                assert agent.returncode == -signal.SIGKILL, agent.returncode
        if agent.returncode is not None:  # the kernel killed the agent: a supervisor's restart
            agent = await _start_agent(cg, runtime)
        async with corral.AsyncClient(address) as c:
            again = await c.sandboxes.get(kept.id)
            assert await again.files.read("/tmp/kept.bin") == b"k" * 65536
            sb = await c.sandboxes.create(image="test/busybox", limits=SMALL)
            assert (await sb.exec(["echo", "back"])).stdout == b"back\n"
            for s in await c.sandboxes.list():
                await s.destroy()
    finally:
        if agent is not None and agent.returncode is None:
            agent.kill()
            await agent.wait()
        try:  # the node's seccomp fd holder, started by the agent, is in its cgroup:
            # the next node's gc ends it with the rest. Of the same runtime: a node of
            # another leaves this one's runtime root (crun's tmpfs) mounted.
            n = await Node.open(_cfg(backends=[ContainerConfig(runtime=runtime)]))
            await n.gc(everything=True)
            await _shutdown(n)
        finally:
            cg.remove()
    _assert_clean()
