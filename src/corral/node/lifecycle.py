"""Creating, adopting, looking up and destroying sandboxes: the node's side of a life.

A create is admitted (capacity, limits that fit the node, a known network permission and
backend), recorded as ``creating``, started by its backend, plugged into the node's
network, and recorded ``running``; a failure at any step undoes the earlier ones and
leaves a ``create_failed`` event. A destroy, once begun, runs to its end even if its caller
goes away (half a destroy would leak mounts, cgroups and processes). Requests to a
sandbox pass :meth:`Lifecycle.active`, which resumes a paused one transparently.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from corral.backends.base import Backend
from corral.errors import (
    CapacityError,
    Conflict,
    CorralError,
    HostError,
    InvalidRequest,
    SandboxError,
    SandboxNotFound,
    ScratchFull,
)
from corral.node.config import NodeConfig
from corral.node.metrics import PhaseTimer
from corral.node.network import NodeNetwork
from corral.node.pause import Pauser
from corral.node.registry import Backends
from corral.node.security import NodeSecurity
from corral.node.state import StateStore
from corral.node.stats import Observer
from corral.node.table import SandboxTable, shown_id
from corral.spec import ImageInfo, SandboxInfo, SandboxSpec, new_sandbox_id

__all__ = ["Lifecycle"]

log = logging.getLogger("corral.node")


class Lifecycle:
    """Creates, adopts, finds and destroys the sandboxes of one node."""

    def __init__(
        self,
        config: NodeConfig,
        node_id: str,
        table: SandboxTable,
        state: StateStore,
        backends: Backends,
        network: NodeNetwork,
        security: NodeSecurity,
        pauser: Pauser,
        observer: Observer,
    ) -> None:
        self.config = config
        self.observer = observer
        self.node_id = node_id
        self.table = table
        self.state = state
        self.backends = backends
        self.network = network
        self.security = security
        self.pauser = pauser
        self.closed = False
        self.tasks: set[asyncio.Task[None]] = set()
        """Destroys and background jobs in flight (close waits for them)."""

    # ------------------------------------------------------------------ create
    async def create(
        self,
        spec: SandboxSpec,
        image: ImageInfo,
        *,
        writable_from: str | None = None,
        **why: str,
    ) -> SandboxInfo:
        """Create from ``image``; with ``writable_from`` (a fork base of the backend's), the
        writable layer starts as a copy of it (see corral.node.snapshot)."""
        t = PhaseTimer()
        with t.phase("admission"):
            self.check_open()
            _check_fits(spec, self.config)
            backend = self.backends.for_spec(spec)
            self.network.compile(spec.network)  # unknown permission names: refused up front
            if len(self.table) >= self.config.max_sandboxes:
                raise CapacityError(
                    f"node {self.node_id} is full: {len(self.table)} sandboxes "
                    f"(max_sandboxes={self.config.max_sandboxes})"
                )
        sid = new_sandbox_id(self.node_id)
        now = time.time()
        info = SandboxInfo(
            id=sid,
            state="creating",
            image=spec.image,
            image_digest=image.digest,
            layers=list(image.layers),
            image_env=dict(image.env),
            spec=spec,
            created_at=now,
            expires_at=now + spec.ttl if spec.ttl else None,
            last_active_at=now,
            backend=backend.kind,
            accel=backend.accel,
            node_id=self.node_id,
        )
        if spec.workdir == "/" and image.workdir != "/":
            info.spec = spec.model_copy(update={"workdir": image.workdir})
        self.table.add(info)
        try:
            started = await backend.create(
                sid, info.spec, image, writable_from=writable_from, phases=t
            )
            try:
                with t.phase("network_attach"):
                    address = await self.network.attach(sid, started.pid, spec.network)
            except BaseException:
                with contextlib.suppress(Exception):
                    await backend.destroy(sid, image)
                raise
        except BaseException as e:
            self.table.remove(sid)
            self.state.add_event(sid, "create_failed", {"error": str(e)[:2000]})
            self.record("create", t, info, failed=True)
            if _out_of_space(e) and not isinstance(e, ScratchFull):
                raise _no_space_error(sid, e, self.config.state_dir / "scratch") from e
            if isinstance(e, CorralError):
                raise
            if isinstance(e, Exception):
                raise HostError(f"creating sandbox failed: {e}") from e
            raise
        with self.state.batch():  # one commit for the record and its event
            info = self.table.set_state(
                sid, "running", pid=started.pid, address=address, layer_access=started.layer_access
            )
            self.state.add_event(sid, "created", {"image": spec.image, "pid": started.pid, **why})
        self.security.created(sid)
        self.record("create", t, info)
        return info

    def record(self, op: str, t: PhaseTimer, info: SandboxInfo, failed: bool = False) -> None:
        """One finished operation on ``info`` into the node's metrics and timings."""
        self.observer.record(
            op,
            t.total(),
            t.phases,
            sandbox_id=info.id,
            labels=info.spec.labels,
            backend=info.backend,
            qos=info.spec.qos,
            failed=failed,
        )

    async def recover(self) -> None:
        """Reconcile the database with what is really running after a (re)start."""
        lost: list[SandboxInfo] = []
        for info in self.state.live_sandboxes():
            backend = self.backends.get(info.backend)
            adoptable = info.state in ("running", "pausing", "paused", "resuming")
            started = None
            if adoptable and backend is not None:
                started = await backend.adopt(info.id, info.image_info())
            if backend is None or started is None:
                lost.append(info)
                continue
            self.table.add(info)
            self.pauser.recovered(info, saved=backend.held_in_snapshot(info.id))
            self.security.adopted(info.id)
        for backend in self.backends.all():
            await backend.recovered()

        self.security.recovered()  # the fd holder forgets sandboxes not adopted
        await self.network.adopt(
            (i.id, i.pid, i.address, i.spec.network) for i in self.table.values() if i.address
        )
        for info in lost:
            log.warning("sandbox %s did not survive (state %s); cleaning up", info.id, info.state)
            backend = self.backends.get(info.backend)
            if backend is not None:
                with contextlib.suppress(Exception):
                    await backend.destroy(info.id, None)
            self.state.mark_destroyed(info.id)
            self.state.add_event(info.id, "lost", {"state": info.state})

    # ------------------------------------------------------------------ look up
    def check_open(self) -> None:
        if self.closed:
            raise Conflict("this node has been closed")

    def backend_of(self, info: SandboxInfo) -> Backend:
        return self.backends.of(info)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        info = self.table.get(sandbox_id)
        if info is None:
            info = self.table.recorded(sandbox_id)
            if info is None:
                raise SandboxNotFound(f"no sandbox {shown_id(sandbox_id)} on node {self.node_id}")
        update: dict[str, object] = {
            "last_active_at": self.table.last_active(sandbox_id, info.last_active_at)
        }
        if sandbox_id in self.table and info.state not in ("creating", "destroying"):
            m = self.backends.of(info).meters(sandbox_id)
            update["memory_resident"], update["memory_swapped"] = (
                m.memory_resident,
                m.memory_swapped,
            )
            update["cpu_seconds"], update["disk_used"] = m.cpu_seconds, m.disk_used
        return info.model_copy(update=update)

    def active(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox a request is for, running (a paused one is resumed transparently)."""
        self.check_open()
        info = self.table.need(sandbox_id)
        if info.state in ("pausing", "paused", "resuming"):
            info = self.pauser.wake(sandbox_id)  # transparent resume
        if info.state not in ("running", "resuming") and not self.pauser.held(sandbox_id):
            # resuming: the pause being stopped thaws it in a moment; the request waits
            raise Conflict(f"sandbox {sandbox_id} is {info.state}, not running")
        self.table.touch(sandbox_id)
        return info

    @contextlib.asynccontextmanager
    async def agent_errors(self, sandbox_id: str, what: str) -> AsyncIterator[None]:
        """Say why an agent connection broke: the sandbox was destroyed meanwhile, or its
        agent died (the reaper then cleans it up). Other agent errors pass unchanged."""
        try:
            yield
        except SandboxError as e:
            for _ in range(5):
                info = self.table.get(sandbox_id)
                if info is None or info.state == "destroying":
                    raise SandboxNotFound(
                        f"sandbox {sandbox_id} was destroyed while {what} was running"
                    ) from e
                if not self.backends.of(info).alive(sandbox_id):
                    raise SandboxError(
                        f"sandbox {sandbox_id} has stopped: its init is not running any more "
                        f"({what} failed; the node cleans the sandbox up)"
                    ) from e
                # An agent that closed our connection may still be exiting: look again.
                await asyncio.sleep(0.01)
            raise

    # ------------------------------------------------------------------ destroy
    async def destroy_request(self, sandbox_id: str) -> None:
        """A caller's destroy (SandboxNotFound, or Conflict if one is already running)."""
        info = self.table.need(sandbox_id)
        if info.state == "creating":
            # Destroying under a create would race it (the create may make what destroy
            # just removed, and come back "running"): let it end, then destroy.
            await self.table.created(sandbox_id)
            if sandbox_id not in self.table:
                return  # the create failed and undid itself: nothing is left to destroy
            info = self.table.need(sandbox_id)
        if info.state == "destroying":
            raise Conflict(f"sandbox {sandbox_id} is already being destroyed")
        await self.destroy(info, "destroyed")

    async def destroy(self, info: SandboxInfo, why: str) -> None:
        sid = info.id
        cur = self.table.get(sid)
        if cur is None or cur.state == "destroying":
            # Someone else (the reaper, a user, gc) got there first: a second destroy would
            # release the sandbox's layer references twice, from under its neighbours.
            return
        cur = self.table.set_state(sid, "destroying")
        self.pauser.forget(sid)
        # Once started, a destroy runs to its end even if its caller is cancelled (a client
        # that goes away, the reaper stopped by close(), which then waits for it): half a
        # destroy, already marked destroyed, would leak its mounts, cgroups and processes.
        task = asyncio.create_task(self._finish_destroy(cur, why), name=f"destroy-{sid}")
        self.keep(task)
        await asyncio.shield(task)

    async def _finish_destroy(self, info: SandboxInfo, why: str) -> None:
        sid = info.id
        t = PhaseTimer()
        with contextlib.suppress(Exception):
            self.security.before_destroy(sid, info.spec.limits.disk)
        try:
            await self.backends.of(info).destroy(sid, info.image_info())
        except CorralError as e:
            self.state.add_event(sid, "destroy_error", {"error": e.message[:2000]})
            log.error("%s", e.message)
        finally:
            with contextlib.suppress(Exception):
                await self.network.detach(sid)
            with self.state.batch():  # one commit for the record and its event
                self.table.remove(sid)
                self.state.add_event(sid, why, {})
            self.record("destroy", t, info)

    def keep(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def background(self, job: object, name: str) -> None:
        """Run ``job`` (a coroutine) as a task the node keeps a reference to; failures are
        logged (the reaper's idle pauses)."""

        async def run() -> None:
            try:
                await job  # type: ignore[misc]
            except CorralError as e:
                log.warning("%s: %s", name, e.message)
            except Exception:
                log.exception("%s failed", name)

        self.keep(asyncio.create_task(run(), name=name))

    async def settle(self, timeout: float = 60.0) -> None:
        """Wait for creates and destroys in flight (new ones are refused now): each records
        its outcome in the state db, which closes next. A create that finishes is adopted by
        the next open; one cancelled meanwhile undoes itself."""
        deadline = time.monotonic() + timeout
        while self.table.in_flight():
            if time.monotonic() > deadline:
                log.warning("closing with creates/destroys still in flight after %.0f s", timeout)
                return
            await asyncio.sleep(0.005)


def _out_of_space(e: BaseException | None) -> bool:
    """Whether ENOSPC is behind ``e`` (an OSError in its chain, or a runtime's message):
    a full scratch filesystem is the node's room running out, not a host failure."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


SCRATCH_LOW = 8 << 20
"""Free bytes under which the scratch filesystem counts as full (a create's own needs)."""


def _no_space_error(sid: str, e: BaseException, scratch: Path) -> CapacityError:
    """What a create that met ENOSPC (``e``) reports: :class:`ScratchFull` only when the
    scratch filesystem is the one that ran out (the failing path lies in it, or, with no
    path known, it has less than :data:`SCRATCH_LOW` free); otherwise a CapacityError
    naming what did (a host tmpfs such as the launcher's records: reporting those as a
    full scratch sent operators to the wrong filesystem)."""
    path = _failed_path(e)
    free = _free_bytes(scratch)
    if path is not None:
        is_scratch = path == scratch or scratch in path.parents
    else:
        is_scratch = free is None or free < SCRATCH_LOW
    if is_scratch:
        return ScratchFull(
            f"creating sandbox {sid}: the node's scratch filesystem (every sandbox's "
            f"writable layer, {scratch}) is full: retry later or on another node; the "
            "operator frees space by destroying sandboxes or gives the node a larger "
            f"scratch_size ({e})"
        )
    where = f"the filesystem of {path}" if path is not None else "a host filesystem"
    room = f"{free >> 20} MiB free" if free is not None else "room"
    return CapacityError(
        f"creating sandbox {sid}: {where} ran out of space (not the node's scratch "
        f"filesystem {scratch}, which has {room}): retry later or on another node; the "
        f"operator should look at that filesystem's size ({e})"
    )


def _free_bytes(path: Path) -> int | None:
    """Bytes free for unprivileged data on ``path``'s filesystem (None: not known)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _failed_path(e: BaseException | None) -> Path | None:
    """The file named by the first ENOSPC OSError in ``e``'s chain, if it names one."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename:
            return Path(os.fsdecode(e.filename))
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _check_fits(spec: SandboxSpec, cfg: NodeConfig) -> None:
    """Refuse limits no sandbox of this node can have: past them the kernel would wrap the
    number (a btrfs quota is a u64, the OCI memory limit an int64) or ignore it."""
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if spec.limits.memory > mem:
        raise InvalidRequest(
            f"limits.memory: {spec.limits.memory} bytes is more than this node's memory "
            f"({mem} bytes)"
        )
    if spec.limits.disk > cfg.scratch_size:
        raise InvalidRequest(
            f"limits.disk: {spec.limits.disk} bytes is more than this node's scratch "
            f"filesystem ({cfg.scratch_size} bytes)"
        )
