"""The node agent: the single owner of sandbox state on one host.

Every API (embedded SDK, REST) ends here as a typed call; the node decides what is allowed
in which state, talks to its backends only through :class:`corral.backends.base.Backend`,
and records the outcome in SQLite. The work is split by concern, each part given the
narrow pieces it needs (never the node itself):

* :class:`SandboxTable` (table.py): live sandboxes, busy/touched marks, state transitions;
* :class:`Lifecycle` (lifecycle.py): create, adopt after a restart, get, destroy;
* :class:`Execs` (execs.py): exec, streams, pty, background processes, shells;
* :class:`FileOps` (files.py), :class:`Pauser` (pause.py), :class:`Snapshots`
  (snapshot.py), :class:`Reaper` (reaper.py), status (status.py), gc (gc.py).

This module assembles them (:meth:`Node.open`, :meth:`Node.close`) and implements
:class:`corral.ops.NodeOps` by delegation.

Example:
    node = await Node.open(NodeConfig(state_dir=Path("/var/lib/corral")))
    info = await node.sandbox_create(SandboxSpec(image="demo/python"))
    print((await node.exec(info.id, ExecRequest(cmd=["true"]))).reason)
    await node.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from corral.backends.base import Backend, HostContext, no_memory_snapshots
from corral.backends.initclient import InitExit
from corral.errors import Conflict, CorralError, InvalidRequest
from corral.host.btrfs import Scratch
from corral.host.cgroups import Cgroups
from corral.node import gc as gcmod
from corral.node import limits
from corral.node import status as statusmod
from corral.node.config import NodeConfig
from corral.node.doctor import check_host
from corral.node.events import page_events
from corral.node.execs import Execs
from corral.node.files import FileOps
from corral.node.fncall import FnCallService
from corral.node.host import NodeHost, Parts, open_host
from corral.node.lifecycle import Lifecycle
from corral.node.metrics import PhaseTimer
from corral.node.pause import Pauser
from corral.node.ports import connect_port
from corral.node.pty import NodePty
from corral.node.reaper import Reaper
from corral.node.retention import Pruner, Retention
from corral.node.snapshot import Snapshots
from corral.node.stats import Observer
from corral.node.watch import WatchHub
from corral.ops import DirWatch, NodeOps, PortOps, WatchOps
from corral.spec import (
    CallRequest,
    CallResult,
    DesktopInput,
    Event,
    EventSummary,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileStat,
    ForkRequest,
    ImageInfo,
    JudgeRequest,
    JudgeResult,
    LayerInfo,
    NetworkPolicy,
    NodeStatus,
    ProcessInfo,
    PtyRequest,
    SandboxInfo,
    SandboxSpec,
    ShellInfo,
    Stats,
    TimelineEntry,
    validation_message,
)

__all__ = ["Node"]

log = logging.getLogger("corral.node")

T = TypeVar("T")


class Node:
    """One host's sandboxes. Create with :meth:`open`; implements :class:`corral.ops.NodeOps`."""

    def __init__(self, config: NodeConfig, host: NodeHost) -> None:
        # Private: use Node.open(), which opens the host pieces.
        self.config = config
        self.node_id = host.node_id
        self.state = host.state
        self.store = host.store
        self.cgroups = host.cgroups
        self.scratch = host.scratch
        self.swap = host.swap
        self.security = host.security
        self.network = host.network
        self.backends = host.backends
        self._lock_fd = host.lock_fd
        self.table = host.table
        self.pauser = Pauser(
            self.cgroups,
            self.table,
            self.state.add_event,
            save_memory=self._save_memory,
            restore_memory=self._restore_memory,
        )
        self.observer = Observer.for_node(
            self.state,
            config.metrics,
            live=self.table.values,  # a copy per call: safe from the scrape's thread
            capacity=config.max_sandboxes,
            scratch_dir=self.scratch.mountpoint,
            layer_files=self._layer_files,
        )
        self.life = Lifecycle(
            config,
            self.node_id,
            self.table,
            self.state,
            self.backends,
            self.network,
            self.security,
            self.pauser,
            self.observer,
        )
        self.execs = Execs(self.life, self.table, self.state, self.security, config.id_count)
        self.files = FileOps(self.life, self.table, self.state)
        self.watches = WatchHub()
        self.snapshots = Snapshots(
            self.life, self.table, self.pauser, self.state, self.store, self.scratch
        )
        self.reaper = Reaper(
            self.life,
            self.table,
            self.state,
            self.security,
            self.pauser,
            config.reaper_interval,
            Pruner(self.state, Retention.of(config)),
            self.observer,
        )
        self.fncall = FnCallService(self, config.fncall)

    # ------------------------------------------------------------------ open / close
    @classmethod
    async def open(cls, config: NodeConfig | None = None) -> Node:
        """Open the node of ``config.state_dir`` (one process at a time), adopting the
        sandboxes a previous agent left running."""
        return await cls._open(config or NodeConfig(), None)

    @classmethod
    async def assemble(
        cls,
        config: NodeConfig,
        make_backends: Callable[[HostContext], list[Backend]],
        host: tuple[Cgroups, Scratch],
    ) -> Node:
        """A node on the given node-wide pieces and engines, without a seccomp listener:
        for tests of the node's logic on :class:`corral.testing.FakeBackend` (no root)."""
        return await cls._open(config, (make_backends, host))

    @classmethod
    async def _open(
        cls,
        cfg: NodeConfig,
        parts: Parts | None,
    ) -> Node:
        if parts is None:  # a real host: refuse to start where sandboxes cannot be served
            limits.raise_nofile(cfg.max_sandboxes)  # before the doctor checks it
            await check_host(cfg)
            limits.warn_short(cfg.max_sandboxes)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(cfg.state_dir / "node.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise Conflict(
                f"another corral node already owns {cfg.state_dir}; connect to it "
                f"(AsyncClient('unix://{cfg.socket_path}')) or use another state_dir"
            ) from None
        closers: list[Callable[[], object]] = []
        try:
            host = await open_host(cfg, lock_fd, closers, parts)
            node = cls(cfg, host)
            await node.life.recover()
            node.snapshots.drop_crashed_work()
        except BaseException:
            # Release the state dir: otherwise this process could never open it again.
            for close in reversed(closers):
                with contextlib.suppress(Exception):
                    r = close()
                    if asyncio.iscoroutine(r):
                        await r
            os.close(lock_fd)
            raise
        await node.fncall.start()
        node.reaper.start()
        return node

    async def close(self) -> None:
        """Stop serving. Running sandboxes keep running (a later open adopts them); shared
        resources (layer mounts, scratch filesystem, cgroup subtree) go if none is left."""
        if self.life.closed:
            return
        self.life.closed = True
        self.watches.close()
        await self.fncall.close()
        await self.execs.detach_shells()
        await self.reaper.stop()
        await self.pauser.close()
        try:
            await self.life.settle()
            self.table.flush_touches()
            with contextlib.suppress(Exception):
                await self.network.close(keep=bool(len(self.table)))
            keep = bool(len(self.table))
            try:
                await self._stop_backends(keep_running=keep)
                if not keep:
                    await self.teardown_node_wide()
            except CorralError as e:
                # Something the node does not know holds them (a process left by a create
                # cut short): the next open adopts them; gc removes the rest.
                log.warning("close: shared resources stay mounted (run gc): %s", e.message)
            self.scratch.close()
        finally:
            # Even when the teardown fails (a mount still busy): release the state dir, or
            # this process could never open a node on it again.
            with contextlib.suppress(Exception):
                self.observer.flush()
            self.security.close()
            self.state.close()
            os.close(self._lock_fd)

    async def _stop_backends(self, keep_running: bool) -> None:
        errors: list[CorralError] = []
        for b in self.backends.all():
            try:
                await b.stop(keep_running)
            except CorralError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    async def teardown_node_wide(self) -> None:
        await asyncio.to_thread(self.scratch.teardown)
        self.cgroups.remove_subtree_if_empty()
        await asyncio.to_thread(self.swap.teardown)

    async def __aenter__(self) -> Node:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ for other parts
    @property
    def backend(self) -> Backend:
        """The node's default backend."""
        b = self.backends.get(self.config.default_backend)
        assert b is not None
        return b

    def backend_of(self, sandbox_id: str) -> Backend:
        """The backend running a live sandbox (SandboxNotFound if none)."""
        return self.backends.of(self.table.need(sandbox_id))

    def _layer_files(self) -> list[Path]:
        """The layer files live sandboxes use (for the page-cache gauge; a scrape thread)."""
        digests = {d for i in self.table.values() for d in i.layers}
        return [self.store.path_of(d) for d in digests]

    async def _timed(self, op: str, sandbox_id: str, job: Awaitable[T]) -> T:
        """``job`` recorded as operation ``op`` of the sandbox (its metrics and timings)."""
        t = PhaseTimer()
        info = self.table.get(sandbox_id)
        failed = True
        try:
            out = await job
            failed = False
            return out
        finally:
            if info is not None:
                self.life.record(op, t, info, failed=failed)

    # ------------------------------------------------------------------ images
    async def image_get(self, name: str) -> ImageInfo:
        return self.store.image(name)

    async def image_list(self) -> list[ImageInfo]:
        return self.store.images()

    async def image_compose(
        self, name: str, layers: list[str], env: dict[str, str] | None = None, workdir: str = "/"
    ) -> ImageInfo:
        return self.store.put_image(name, layers, env=env, workdir=workdir)

    async def image_remove(self, name: str) -> None:
        self.store.remove_image(name)

    async def layer_list(self) -> list[LayerInfo]:
        return self.store.layers()

    # ------------------------------------------------------------------ lifecycle
    async def sandbox_create(self, spec: SandboxSpec) -> SandboxInfo:
        self.life.check_open()
        # Awaited, not waited for: on a network store the lookup is a round trip, and the
        # loop serves the node's other creates and execs meanwhile.
        return await self.life.create(spec, await self.store.image_async(spec.image))

    async def sandbox_get(self, sandbox_id: str) -> SandboxInfo:
        return await self.life.get(sandbox_id)

    async def sandbox_list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return self.table.with_labels(labels)

    async def sandbox_destroy(self, sandbox_id: str) -> None:
        await self.life.destroy_request(sandbox_id)

    async def sandbox_set_ttl(self, sandbox_id: str, ttl: float | None) -> SandboxInfo:
        """Move the deadline the reaper destroys the sandbox at (running or paused); the
        table records ``expires_at`` and its listener re-arms the reaper's heap."""
        if ttl is not None and not ttl > 0:
            raise InvalidRequest(f"ttl: {ttl!r} is not a positive number of seconds")
        self.life.check_open()
        cur = self.table.need(sandbox_id)
        if cur.state in ("creating", "destroying"):
            raise Conflict(f"sandbox {sandbox_id} is {cur.state}; its TTL cannot change")
        expires_at = None if ttl is None else time.time() + ttl
        info = self.table.update(sandbox_id, expires_at=expires_at)
        self.state.add_event(sandbox_id, "ttl_set", {"expires_at": str(expires_at or "")})
        return info

    async def network_update(
        self, sandbox_id: str, allow: list[str] | None = None, deny: list[str] | None = None
    ) -> SandboxInfo:
        """Change a live sandbox's egress policy (None keeps that list); in effect when this
        returns, without touching its processes."""
        info = self.life.active(sandbox_id)
        try:
            policy = NetworkPolicy(
                allow=info.spec.network.allow if allow is None else allow,
                deny=info.spec.network.deny if deny is None else deny,
            )
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
        address = await self.network.update(sandbox_id, info.pid, info.address, policy)
        cur = self.table.get(sandbox_id) or info
        info = self.table.update(
            sandbox_id,
            spec=cur.spec.model_copy(update={"network": policy}),
            address=address,
        )
        detail = {"allow": ",".join(policy.allow), "deny": ",".join(policy.deny)}
        self.state.add_event(sandbox_id, "network_updated", detail)
        return info

    # ------------------------------------------------------------------ desktop
    def _screen(self, sandbox_id: str) -> Any:
        """The display of a running sandbox's VM (corral.backends.vm.screen.Screen)."""
        info = self.life.active(sandbox_id)
        screen = getattr(self.backends.of(info), "screen", None)
        if screen is None:
            raise InvalidRequest(
                f"sandbox {sandbox_id} has no display (backend {info.backend!r}); "
                "desktops run on the 'vm' backend"
            )
        return screen(sandbox_id, info.spec)

    async def desktop_screenshot(self, sandbox_id: str) -> bytes:
        screen = self._screen(sandbox_id)
        with self.table.working(sandbox_id):
            async with self.life.agent_errors(sandbox_id, "the screenshot"):
                data: bytes = await screen.screenshot()
                return data

    async def desktop_input(self, sandbox_id: str, req: DesktopInput) -> None:
        screen = self._screen(sandbox_id)
        with self.table.working(sandbox_id):
            async with self.life.agent_errors(sandbox_id, f"the desktop {req.action}"):
                await screen.act(req)

    async def sandbox_snapshot(self, sandbox_id: str, name: str | None = None) -> ImageInfo:
        return await self._timed("snapshot", sandbox_id, self.snapshots.snapshot(sandbox_id, name))

    async def sandbox_fork(self, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        return await self._timed("fork", sandbox_id, self.snapshots.fork(sandbox_id, req))

    # ------------------------------------------------------------------ pause / resume
    async def sandbox_pause(self, sandbox_id: str, memory_snapshot: bool = False) -> SandboxInfo:
        """Freeze the sandbox and reclaim its memory to swap (see :mod:`corral.node.pause`).
        ``memory_snapshot`` (microVMs): save the whole machine to a file and end its VMM,
        releasing all of its memory; the next request or resume restores it."""
        self.life.check_open()
        info = self.table.need(sandbox_id)
        backend = self.backends.of(info)
        if memory_snapshot and not backend.memory_snapshots:
            raise no_memory_snapshots(backend.kind)
        await self._timed("pause", sandbox_id, self.pauser.pause(sandbox_id, memory_snapshot))
        return await self.sandbox_get(sandbox_id)

    async def _save_memory(self, sandbox_id: str) -> dict[str, Any]:
        backend = self.backends.of(self.table.need(sandbox_id))
        return dict(await backend.pause_memory(sandbox_id))

    async def _restore_memory(self, sandbox_id: str) -> None:
        await self.backends.of(self.table.need(sandbox_id)).restore_memory(sandbox_id)

    async def sandbox_resume(self, sandbox_id: str, prefetch: bool = False) -> SandboxInfo:
        """Thaw a paused sandbox; its pages come back from swap as they are touched, or with
        ``prefetch`` are all read back at once (returns when the reads are started)."""
        self.life.check_open()
        self.table.need(sandbox_id)
        await self._timed("resume", sandbox_id, self.pauser.resume(sandbox_id, prefetch))
        self.table.touch(sandbox_id)
        return await self.sandbox_get(sandbox_id)

    async def sandboxes_pause(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Pause every sandbox with these labels (e.g. a job's) at once; returns those paused."""
        self.life.check_open()
        if not labels:
            raise InvalidRequest("labels: name at least one label (e.g. job=...) to pause by")
        done = await self.pauser.pause_many(self.table.with_labels(labels))
        return [await self.sandbox_get(i.id) for i in done if i.id in self.table]

    async def sandboxes_resume(
        self, labels: dict[str, str], prefetch: bool = False
    ) -> list[SandboxInfo]:
        """Resume every paused sandbox with these labels (``prefetch``: as in
        :meth:`sandbox_resume`); returns those resumed."""
        self.life.check_open()
        if not labels:
            raise InvalidRequest("labels: name at least one label (e.g. job=...) to resume by")
        done = await self.pauser.resume_many(self.table.with_labels(labels), prefetch)
        for i in done:
            self.table.touch(i.id)
        return [await self.sandbox_get(i.id) for i in done if i.id in self.table]

    # ------------------------------------------------------------------ exec
    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await self.execs.exec(sandbox_id, req)

    def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[ExecChunk | ExecResult]:
        return self.execs.exec_stream(sandbox_id, req)

    async def pty(self, sandbox_id: str, req: PtyRequest) -> NodePty[InitExit]:
        """An interactive terminal (see :class:`corral.ops.PtyStream`)."""
        return await self.execs.pty(sandbox_id, req)

    async def port_connect(self, sandbox_id: str, port: int) -> socket.socket:
        """A socket connected to ``127.0.0.1:port`` in the sandbox (see
        :class:`corral.ops.PortOps`): the port proxy's way in."""
        info = self.life.active(sandbox_id)  # a paused sandbox wakes, as for any request
        return await connect_port(self.table, info, sandbox_id, port)

    def port_hold(self, sandbox_id: str) -> contextlib.AbstractContextManager[None]:
        """Busy while a port connection is open (see :class:`corral.ops.PortOps`)."""
        return self.table.working(sandbox_id)

    async def file_watch(self, sandbox_id: str, path: str, recursive: bool = False) -> DirWatch:
        """Watch a directory of the sandbox with inotify (see :mod:`corral.node.watch`)."""
        info = self.life.active(sandbox_id)
        fs = self.life.backend_of(info).files(sandbox_id)
        return await self.watches.watch(fs, path, recursive)

    async def spawn(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        return await self.execs.spawn(sandbox_id, req)

    async def process_get(
        self, sandbox_id: str, process_id: str, wait: float | None = None
    ) -> ProcessInfo:
        return await self.execs.process_get(sandbox_id, process_id, wait)

    async def process_kill(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        await self.execs.process_kill(sandbox_id, process_id, signal)

    async def process_list(self, sandbox_id: str) -> list[ProcessInfo]:
        return await self.execs.process_list(sandbox_id)

    async def shell_open(
        self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ShellInfo:
        return await self.execs.shell_open(sandbox_id, cwd, env)

    async def shell_run(
        self,
        sandbox_id: str,
        shell_id: str,
        command: str,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        return await self.execs.shell_run(sandbox_id, shell_id, command, timeout, stdin)

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        await self.execs.shell_close(sandbox_id, shell_id)

    async def shell_interrupt(self, sandbox_id: str, shell_id: str) -> None:
        await self.execs.shell_interrupt(sandbox_id, shell_id)

    # ------------------------------------------------------------------ files
    async def file_read(
        self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None
    ) -> bytes:
        return await self.files.read(sandbox_id, path, offset, length)

    async def file_write(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, append: bool = False
    ) -> None:
        await self.files.write(sandbox_id, path, data, mode, append)

    async def file_list(self, sandbox_id: str, path: str) -> list[FileStat]:
        return await self.files.list(sandbox_id, path)

    async def file_stat(self, sandbox_id: str, path: str) -> FileStat:
        return await self.files.stat(sandbox_id, path)

    async def file_remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self.files.remove(sandbox_id, path, recursive)

    async def file_mkdir(
        self,
        sandbox_id: str,
        path: str,
        parents: bool = True,
        mode: int = 0o755,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        await self.files.mkdir(sandbox_id, path, parents, mode, owner_uid, owner_gid)

    async def file_upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self.files.upload_tar(sandbox_id, path, data)

    async def file_download_tar(self, sandbox_id: str, path: str) -> bytes:
        return await self.files.download_tar(sandbox_id, path)

    # ------------------------------------------------------------------ fncall
    async def fncall_run(self, req: CallRequest) -> CallResult:
        """One short call in a warm pool sandbox (see corral.node.fncall)."""
        r = await self.fncall.run(req)
        self.observer.metrics.fncall(req.language, r.status)
        return r

    async def fncall_judge(self, req: JudgeRequest) -> JudgeResult:
        r = await self.fncall.judge(req)
        self.observer.metrics.fncall(req.language, r.verdict)
        return r

    # ------------------------------------------------------------------ observability
    async def stats(
        self,
        labels: dict[str, str] | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> Stats:
        """p50/p90/p99 per operation and phase for sandboxes with these labels, and event
        counts by kind (see corral.node.stats)."""
        self.observer.flush()
        return await asyncio.to_thread(self.observer.stats, labels, since, until)

    async def timeline(self, sandbox_id: str, limit: int = 2000) -> list[TimelineEntry]:
        """One sandbox's operations and events in time order."""
        self.observer.flush()
        return await asyncio.to_thread(self.observer.timeline, sandbox_id, limit)

    # ------------------------------------------------------------------ events, status
    async def events(
        self,
        sandbox_id: str | None = None,
        after: str | None = None,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        limit: int = 1000,
    ) -> list[Event]:
        """Events after the cursor ``after`` (an earlier event's ``cursor``), oldest first,
        at most ``limit``; the label filter applies before the limit."""
        self.security.flush()  # denials counted so far are part of the answer
        if sandbox_id is not None:
            await self.sandbox_get(sandbox_id)
        return page_events(self.state, self.node_id, sandbox_id, after, labels, kinds, limit)

    async def events_summary(
        self,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        sandbox_id: str | None = None,
    ) -> EventSummary:
        """Occurrences of each event kind per sandbox (live or destroyed) and in total."""
        if sandbox_id is not None:
            await self.sandbox_get(sandbox_id)
        return self.security.summary(self.state, labels, kinds, sandbox_id)

    async def node_status(self) -> NodeStatus:
        return await statusmod.node_status(self)

    async def wait_settled(self, timeout: float) -> bool:
        """Wait until every backend's background preparation for later creates is done
        (:meth:`corral.backends.base.Backend.settle`: the container engine's pre-made
        cgroups) and the scratch filesystem's cleaner has dropped the subvolumes deleted
        before (:meth:`corral.host.btrfs.Scratch.wait_cleaned`), as on a node that has been
        up for a while; False if that was not within ``timeout`` seconds. For benches and
        tests that time creates.

        Example::

            await node.sandbox_create(spec)    # the first of these limits: a pool for them
            assert await node.wait_settled(60)  # the next create takes a pre-made cgroup
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        settled = True
        for backend in self.backends.all():
            left = max(deadline - loop.time(), 0.0)
            settled = await backend.settle(left) and settled
        # The cleaner's queue: an earlier node's destroys, dropped after this one's mount.
        left = max(deadline - loop.time(), 0.0)
        return await asyncio.to_thread(self.scratch.wait_cleaned, left) and settled

    # ------------------------------------------------------------------ gc, reaper
    async def gc(self, everything: bool = False) -> dict[str, int]:
        """Remove what a crash left behind; with ``everything``, destroy all sandboxes too."""
        return await gcmod.collect(self, everything)

    async def reap_once(self) -> None:
        """One reaper pass now (tests; the reaper runs every ``reaper_interval``)."""
        await self.reaper.once()


if TYPE_CHECKING:  # mypy checks the node against the operations interface

    def _conforms(n: Node) -> NodeOps:
        return n

    def _has_ports(n: Node) -> PortOps:
        return n

    def _has_watches(n: Node) -> WatchOps:
        return n
