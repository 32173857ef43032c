"""A fake isolation engine, so that the real :class:`corral.node.Node` runs without root.

:class:`FakeBackend` implements :class:`corral.backends.base.Backend` with no kernel: a
sandbox is a directory (its filesystem, host-side like a container's rootfs) and an agent
that runs commands as host subprocesses *with that directory as cwd and HOME* - not
isolated at all, which is the point: the node's own logic (state machine, admission,
reaper, recovery, fork all-or-nothing, pause transitions, events) runs for real, fast.
:class:`FakeCgroups` and :class:`FakeScratch` stand in for the node-wide kernel pieces
(the freezer flips a flag; "subvolumes" are directories).

Example::

    async with open_fake_node(tmp_path) as node:      # no root needed
        info = await node.sandbox_create(SandboxSpec(image="fake/base"))
        r = await node.exec(info.id, ExecRequest(cmd=["echo", "hi"]))
        assert r.stdout == b"hi\\n"

Only for tests of logic: nothing here confines anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from corral.backends.base import (
    Backend,
    CopyPurpose,
    FixedMeters,
    Freezer,
    HostContext,
    Meters,
    NoPhases,
    Phases,
    Started,
    no_memory_snapshots,
)
from corral.backends.files import SandboxFS
from corral.backends.initclient import ExecStream, InitExit, InitProc
from corral.errors import HostError, ProcessNotFound, SandboxError
from corral.host.btrfs import Scratch
from corral.host.cgroups import Cgroups
from corral.images.erofs import EROFS_MAGIC
from corral.images.store import LayerStore
from corral.spec import BackendStatus, ImageInfo, LayerInfo, SandboxSpec

if TYPE_CHECKING:
    from corral.node.node import Node

__all__ = ["FakeBackend", "FakeCgroups", "FakeScratch", "FakeAgent", "open_fake_node"]


class FakeCgroups(Cgroups):
    """In-memory cgroups: freeze flags, memory figures a test may set, no kernel."""

    def __init__(self, subtree: str = "corral-fake") -> None:  # no super(): no kernel
        self.subtree = subtree
        self.mode = "v2"
        self.frozen: dict[str, bool] = {}
        self.memory: dict[str, tuple[int, int]] = {}
        """name -> (resident, swapped) bytes; reclaim moves resident to swapped."""
        self.pids: dict[str, list[int]] = {}
        self.ooms: dict[str, int] = {}
        self.limits: dict[str, int] = {}

    def add(self, name: str) -> None:
        self.frozen[name] = False
        self.memory.setdefault(name, (1 << 20, 0))

    def freeze(
        self, name: str, timeout: float = 5.0, abort: Callable[[], bool] | None = None
    ) -> None:
        self._need(name)
        self.frozen[name] = True

    def thaw(self, name: str, timeout: float = 5.0) -> None:
        self._need(name)
        self.frozen[name] = False

    def is_frozen(self, name: str) -> bool:
        return self.frozen.get(name, False)

    def memory_usage(self, name: str) -> tuple[int, int]:
        self._need(name)
        return self.memory.get(name, (0, 0))

    def reclaim(self, name: str, stop: Callable[[], bool], step: int = 64 << 20) -> None:
        resident, swapped = self.memory_usage(name)
        self.memory[name] = (0, swapped + resident)

    def set_memory(self, name: str, memory: int, swap: int | None = 0) -> None:
        self.limits[name] = memory

    def procs(self, name: str) -> list[int]:
        self._need(name)
        return list(self.pids.get(name, []))

    def oom_kills(self, name: str) -> int:
        return self.ooms.get(name, 0)

    def exists(self, name: str) -> bool:
        return name in self.frozen

    def list(self) -> list[str]:
        return list(self.frozen)

    def remove(self, name: str, timeout: float = 1.0) -> None:
        self.frozen.pop(name, None)
        self.memory.pop(name, None)
        self.pids.pop(name, None)

    def remove_subtree_if_empty(self) -> None:
        pass

    def _need(self, name: str) -> None:
        if name not in self.frozen:
            raise HostError(f"cgroups: no cgroup {name}")


class FakeScratch(Scratch):
    """Plain directories for "subvolumes"; usage is the bytes of their files."""

    def __init__(self, root: Path) -> None:
        super().__init__(root / "scratch.img", root / "scratch", 1 << 40)

    def setup(self) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        pass

    def teardown(self, delete_image: bool = False) -> None:
        pass

    def create_subvol(self, name: str, quota: int | None) -> Path:
        p = self.mountpoint / name
        p.mkdir()
        return p

    def delete_subvol(self, name: str) -> None:
        shutil.rmtree(self.mountpoint / name, ignore_errors=True)

    def snapshot(self, src: str, dst: str, quota: int | None) -> Path:
        shutil.copytree(self.mountpoint / src, self.mountpoint / dst, symlinks=True)
        return self.mountpoint / dst

    def usage(self, name: str) -> int:
        total = 0
        for root, _, files in os.walk(self.mountpoint / name):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, f)).st_size
        return total

    def wait_cleaned(self, timeout: float) -> bool:
        return True  # deletes are done when they return

    def subvols(self) -> list[str]:
        if not self.mountpoint.is_dir():
            return []
        return [p.name for p in self.mountpoint.iterdir() if p.is_dir()]


@dataclass
class _Proc:
    id: str
    argv: list[str]
    proc: asyncio.subprocess.Process
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    started: float = field(default_factory=time.monotonic)
    exit: InitExit | None = None


class FakeAgent:
    """Runs commands as host subprocesses in the sandbox's directory (not isolated)."""

    def __init__(self, root: Path, alive: Callable[[], bool]) -> None:
        self.root = root
        self._alive = alive
        self._procs: dict[str, _Proc] = {}
        self._n = 0

    def _check(self) -> None:
        if not self._alive():
            raise SandboxError("fake sandbox: its agent is not running")

    async def ping(self) -> None:
        self._check()

    async def exec(
        self,
        argv: Iterable[str],
        *,
        env: Mapping[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        groups: Iterable[int] = (),
        timeout: float | None = None,
        output_limit: int = 1 << 20,
        output_rate: int | None = None,
        stdin: bytes | None = None,
    ) -> InitExit:
        self._check()
        t0 = time.monotonic()
        env = {**env, "HOME": str(self.root)}
        try:
            p = await asyncio.create_subprocess_exec(
                *argv,
                cwd=self.root,
                env=env,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            return _exit(127, b"", str(e).encode(), output_limit, 0.0)
        try:
            out, err = await asyncio.wait_for(p.communicate(stdin), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            out, err = await p.communicate()
            r = _exit(-9, out, err, output_limit, time.monotonic() - t0)
            r.reason = "timeout"
            return r
        return _exit(p.returncode, out, err, output_limit, time.monotonic() - t0)

    def stream(
        self,
        argv: Iterable[str],
        *,
        env: Mapping[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        groups: Iterable[int] = (),
        timeout: float | None = None,
        output_limit: int = 1 << 20,
        output_rate: int | None = None,
        stdin: bytes | None = None,
        stdin_pipe: bool = False,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        keep_output: bool = True,
    ) -> ExecStream:
        s = _FakeStream(self, list(argv), dict(env), stdin_pipe=stdin_pipe, tty=tty)
        return s  # type: ignore[return-value]  # the same interface, duck-typed

    async def spawn(
        self,
        argv: Iterable[str],
        *,
        env: Mapping[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        groups: Iterable[int] = (),
        output_limit: int = 1 << 20,
        stdin_pipe: bool = False,
    ) -> tuple[str, int]:
        self._check()
        if stdin_pipe:
            raise SandboxError("fake sandbox: no shell sessions (spawn with stdin_pipe)")
        argv = list(argv)
        p = await asyncio.create_subprocess_exec(
            *argv,
            cwd=self.root,
            env={**env, "HOME": str(self.root)},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._n += 1
        pid = f"p{self._n}"
        self._procs[pid] = _Proc(pid, argv, p)
        return pid, p.pid

    async def wait(self, proc_id: str, timeout: float | None = 0) -> InitProc:
        pr = self._procs.get(proc_id)
        if pr is None:
            raise ProcessNotFound(f"no background process {proc_id!r}")
        if pr.exit is None:
            try:
                out, err = await asyncio.wait_for(pr.proc.communicate(), timeout or 0.001)
                pr.exit = _exit(pr.proc.returncode, out, err, 1 << 20, 0.0)
            except TimeoutError:
                pass
        e = pr.exit
        return InitProc(
            pr.id,
            pr.proc.pid,
            e is None,
            pr.argv,
            e.stdout if e else b"",
            e.stderr if e else b"",
            e,
        )

    async def kill(self, proc_id: str, sig: int = 9) -> None:
        pr = self._procs.get(proc_id)
        if pr is None:
            raise ProcessNotFound(f"no background process {proc_id!r}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pr.proc.pid, sig)

    async def list(self) -> list[InitProc]:
        return [await self.wait(i, 0.001) for i in list(self._procs)]

    def attach(self, proc_id: str, output_rate: int | None = None) -> ExecStream:
        raise SandboxError("fake sandbox: no shell sessions to attach to")

    async def forget(self, proc_id: str) -> None:
        pr = self._procs.pop(proc_id, None)
        if pr is None:
            raise ProcessNotFound(f"no background process {proc_id!r}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pr.proc.pid, 9)

    async def close(self) -> None:
        for pr in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pr.proc.pid, 9)
            with contextlib.suppress(Exception):
                await pr.proc.wait()


def _exit(
    code: int | None, out: bytes, err: bytes, limit: int, took: float, pid: int = 0
) -> InitExit:
    code = code if code is not None else -9
    n_out, n_err = len(out), len(err)
    ot, et = n_out > limit, n_err > limit
    out, err = out[:limit], err[:limit]
    if code < 0:
        return InitExit("signaled", None, -code, out, err, ot, et, took, pid, n_out, n_err)
    return InitExit("exited", code, None, out, err, ot, et, took, pid, n_out, n_err)


class _FakeStream:
    """The agent's stream: output chunks as the process writes them, then ``result``."""

    def __init__(
        self, agent: FakeAgent, argv: list[str], env: dict[str, str], *, stdin_pipe: bool, tty: bool
    ) -> None:
        self._agent, self._argv, self._env = agent, argv, env
        self._stdin_pipe, self._tty = stdin_pipe, tty
        self._p: asyncio.subprocess.Process | None = None
        self._result: InitExit | None = None
        self.pid = 0

    async def __aenter__(self) -> _FakeStream:
        self._agent._check()
        self._p = await asyncio.create_subprocess_exec(
            *self._argv,
            cwd=self._agent.root,
            env={**self._env, "HOME": str(self._agent.root)},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if self._tty else asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self.pid = self._p.pid
        if not self._stdin_pipe and self._p.stdin is not None:
            self._p.stdin.close()
        return self

    async def __aexit__(self, *exc: object) -> None:
        p = self._p
        if p is not None and p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            await p.wait()

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[tuple[str, bytes]]:
        p = self._p
        assert p is not None and p.stdout is not None
        t0 = time.monotonic()
        while data := await p.stdout.read(65536):
            yield "stdout", data
        if p.stderr is not None:
            if err := await p.stderr.read():
                yield "stderr", err
        code = await p.wait()
        self._result = _exit(code, b"", b"", 1 << 40, time.monotonic() - t0)

    @property
    def result(self) -> InitExit:
        if self._result is None:
            raise SandboxError("fake stream: not finished")
        return self._result

    async def write(self, data: bytes) -> None:
        assert self._p is not None and self._p.stdin is not None
        self._p.stdin.write(data)
        await self._p.stdin.drain()

    async def close_stdin(self) -> None:
        if self._p is not None and self._p.stdin is not None:
            self._p.stdin.close()

    async def signal(self, sig: int) -> None:
        if self._p is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._p.pid, sig)

    async def resize(self, rows: int, cols: int) -> None:
        pass


class FakeBackend:
    """A :class:`Backend` without a kernel (see the module docstring).

    ``fail_creates``: how many of the next creates raise HostError (fault injection);
    ``kill(sid)`` makes a sandbox's agent die (the reaper then finds it dead).
    ``memory_snapshots``: the engine answers :meth:`pause_memory` as a microVM's does (the
    sandbox is marked held in a snapshot; nothing is saved), else refuses it as a
    container's does."""

    accel: str | None = None

    def __init__(
        self, ctx: HostContext, kind: str = "container", *, memory_snapshots: bool = False
    ) -> None:
        self.kind = kind
        self.memory_snapshots = memory_snapshots
        self.ctx = ctx
        self.cgroups = ctx.cgroups
        self.scratch = ctx.scratch
        self.fail_creates = 0
        self._dead: set[str] = set()
        self._agents: dict[str, FakeAgent] = {}
        self._meta = ctx.state_dir / "fake-backend"

    async def start(self) -> None:
        self._meta.mkdir(parents=True, exist_ok=True)

    async def stop(self, keep_running: bool) -> None:
        for a in self._agents.values():
            await a.close()
        self._agents.clear()

    async def recovered(self) -> None:
        pass

    async def settle(self, timeout: float) -> bool:
        return True

    async def gc(self, live: set[str]) -> dict[str, int]:
        n = 0
        for name in self.cgroups.list():
            if name not in live:
                self.cgroups.remove(name)
                n += 1
        return {"cgroups": n}

    def status(self) -> BackendStatus:
        return BackendStatus(kind=self.kind, detail={"engine": "fake"})

    def root(self, sandbox_id: str) -> Path:
        return self.scratch.mountpoint / sandbox_id / "rootfs"

    async def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        *,
        writable_from: str | None = None,
        phases: Phases = NoPhases(),
    ) -> Started:
        if self.fail_creates > 0:
            self.fail_creates -= 1
            raise HostError(f"fake backend: injected create failure of {sandbox_id}")
        if writable_from is None:
            d = self.scratch.create_subvol(sandbox_id, spec.limits.disk)
            (d / "rootfs").mkdir()
        else:
            self.scratch.snapshot(writable_from, sandbox_id, spec.limits.disk)
        self.cgroups.add(sandbox_id)  # type: ignore[attr-defined]
        (self._meta / sandbox_id).write_text(json.dumps({"image": image.digest}))
        return Started(pid=os.getpid(), cgroup=sandbox_id)

    async def adopt(self, sandbox_id: str, image: ImageInfo) -> Started | None:
        if not (self._meta / sandbox_id).exists() or sandbox_id in self._dead:
            return None
        self.cgroups.add(sandbox_id)  # type: ignore[attr-defined]
        return Started(pid=os.getpid(), cgroup=sandbox_id)

    async def destroy(self, sandbox_id: str, image: ImageInfo | None) -> None:
        agent = self._agents.pop(sandbox_id, None)
        if agent is not None:
            await agent.close()
        self.cgroups.remove(sandbox_id)
        self.scratch.delete_subvol(sandbox_id)
        with contextlib.suppress(FileNotFoundError):
            (self._meta / sandbox_id).unlink()
        self._dead.discard(sandbox_id)

    def alive(self, sandbox_id: str) -> bool:
        return (self._meta / sandbox_id).exists() and sandbox_id not in self._dead

    def kill(self, sandbox_id: str) -> None:
        """Fault injection: the sandbox's agent dies."""
        self._dead.add(sandbox_id)

    def hold_in_snapshot(self, sandbox_id: str) -> None:
        """Test hook: the sandbox is held in a memory snapshot, as a microVM's memory pause
        leaves it. Kept in the sandbox's record, so a restarted node's backend answers the
        same (the node's recovery is what this is for)."""
        self._mark_in_snapshot(sandbox_id, True)

    def _mark_in_snapshot(self, sandbox_id: str, held: bool) -> None:
        rec = self._meta / sandbox_id
        rec.write_text(json.dumps({**json.loads(rec.read_text()), "in_snapshot": held}))

    def held_in_snapshot(self, sandbox_id: str) -> bool:
        try:
            rec = json.loads((self._meta / sandbox_id).read_text())
        except (OSError, ValueError):
            return False
        return bool(rec.get("in_snapshot"))

    async def pause_memory(self, sandbox_id: str) -> dict[str, object]:
        if not self.memory_snapshots:
            raise no_memory_snapshots(self.kind)
        self._mark_in_snapshot(sandbox_id, True)
        return {"memory_snapshot": True, "snapshot_bytes": 0}

    async def restore_memory(self, sandbox_id: str) -> object:
        if not self.memory_snapshots:
            raise no_memory_snapshots(self.kind)
        self._mark_in_snapshot(sandbox_id, False)
        return 0.0

    async def kill_all(self, sandbox_id: str) -> bool:
        agent = self._agents.get(sandbox_id)
        if agent is not None:
            await agent.close()
        return True

    async def copy_writable(
        self, sandbox_id: str, dst: str, frozen: Freezer, purpose: CopyPurpose
    ) -> float:
        t0 = time.monotonic()
        async with frozen():
            self.scratch.snapshot(sandbox_id, dst, None)
        return time.monotonic() - t0

    async def pack(self, work: str, *, source: str, max_bytes: int) -> LayerInfo:
        raise HostError("fake backend: snapshots into the layer store need the real engine")

    def agent(self, sandbox_id: str) -> FakeAgent:
        a = self._agents.get(sandbox_id)
        if a is None:
            a = self._agents[sandbox_id] = FakeAgent(
                self.root(sandbox_id), lambda: self.alive(sandbox_id)
            )
        return a

    def files(self, sandbox_id: str) -> SandboxFS:
        uid = os.getuid()
        return SandboxFS(self.root(sandbox_id), uid=uid, gid=os.getgid())

    def meters(self, sandbox_id: str) -> Meters:
        resident, swapped = (
            self.cgroups.memory_usage(sandbox_id)
            if self.cgroups.exists(sandbox_id)
            else (None, None)
        )
        return FixedMeters(
            oom_kills=self.cgroups.oom_kills(sandbox_id),
            pids_refused=0,
            disk_used=self.scratch.usage(sandbox_id),
            memory_resident=resident,
            memory_swapped=swapped,
        )


@contextlib.asynccontextmanager
async def open_fake_node(
    root: Path, *, memory_snapshots: bool = False, **config: object
) -> AsyncIterator[Node]:
    """A real :class:`Node` on :class:`FakeBackend` in ``root`` (no root privileges), with
    one image ``fake/base`` (an empty layer list) in its store; ``memory_snapshots``: the
    backend's (see :class:`FakeBackend`), ``config``: the node's."""
    from corral.node.config import NodeConfig
    from corral.node.node import Node

    cfg = NodeConfig.model_validate(
        {"state_dir": root / "state", "run_dir": root / "run", **config}
    )
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    store = LayerStore(cfg.store_dir)
    layer = root / "fake.erofs"
    # An EROFS superblock's magic at 1024 is all the store checks; nothing mounts it.
    layer.write_bytes(bytes(1024) + EROFS_MAGIC.to_bytes(4, "little") + bytes(3068))
    info = store.add_file(layer, kind="dir", source="corral.testing_backend")
    store.put_image("fake/base", [info.digest])
    node = await Node.assemble(
        cfg,
        lambda ctx: [FakeBackend(ctx, memory_snapshots=memory_snapshots)],
        (FakeCgroups(), FakeScratch(root / "state")),
    )
    try:
        yield node
    finally:
        await node.close()


if TYPE_CHECKING:

    def _conforms(b: FakeBackend) -> Backend:
        return b
