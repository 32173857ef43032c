"""The seam between the node and an isolation engine: the :class:`Backend` protocol.

The node uses a backend only through this protocol (``corral.node`` imports no engine's
internals). A backend owns everything specific to its engine: for containers the OCI
runtime, corral-init's build, user namespaces and their owner uids, the idmapped layer
mounts and the rootfs overlays; for a microVM the VMM, its kernel and its disks. What every
engine shares is the node's, handed over once in a :class:`HostContext`: the cgroup
subtree, the btrfs scratch filesystem (writable layers with quotas, cheap snapshots), the
layer store, the seccomp listener and the node's extra mounts.

**The invariant** that lets pause, reclaim, prefetch, QoS and limits stay shared: every
backend keeps all of a sandbox's processes (container tasks, or a VMM's threads) in the
sandbox's cgroup, ``HostContext.cgroups`` under the name of :attr:`Started.cgroup`. The
node freezes, squeezes, meters and kills through that cgroup and never asks the backend how.

What is done *in* a sandbox goes through three handles a backend hands out: :meth:`agent`
(exec, streams, background processes: corral-init over a unix socket for containers, over
a virtio-serial channel for VMs), :meth:`files` (host-side resolution for containers,
agent-side for VMs) and :meth:`meters` (kernel counters, None where an engine cannot see
one).

Life of a backend: constructed complete by the node (``make_backend``), :meth:`start` once,
then per sandbox :meth:`create` (or :meth:`adopt` after an agent restart), ..., and
:meth:`destroy`; :meth:`gc` with every live id of the node (whatever its backend: the
subtree and the scratch fs are shared, so nobody removes another's), :meth:`stop` last.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from corral.errors import InvalidRequest
from corral.spec import BackendStatus, FileStat, ImageInfo, LayerInfo, SandboxSpec

if TYPE_CHECKING:
    from corral.backends.initclient import ExecStream, InitExit, InitProc
    from corral.host.btrfs import Scratch
    from corral.host.cgroups import Cgroups
    from corral.images.store import LayerStore

__all__ = [
    "Agent",
    "Backend",
    "Files",
    "HostContext",
    "Meters",
    "FixedMeters",
    "CgroupMeters",
    "run_undo",
    "in_thread",
    "Started",
    "CopyPurpose",
    "Freezer",
    "NoPhases",
    "Phases",
    "no_memory_snapshots",
]


@dataclass(frozen=True)
class Started:
    """A sandbox a backend has started (or adopted)."""

    pid: int
    """Host pid whose network namespace the node's network code plugs into (the init of a
    container, the VMM of a VM)."""
    cgroup: str
    """Name of the sandbox's cgroup under the node's subtree (all its processes are there)."""
    layer_access: str | None = None
    """How a VM's guest reads the image layers (``dax`` or ``virtio-blk``); None: not a VM."""


class Meters(Protocol):
    """Kernel counters of one sandbox; None where the backend cannot see one. Read only the
    ones you need: an implementation may read each from the kernel when it is asked for."""

    @property
    def oom_kills(self) -> int | None: ...
    @property
    def pids_refused(self) -> int | None: ...
    @property
    def disk_used(self) -> int | None: ...
    @property
    def memory_resident(self) -> int | None: ...
    @property
    def memory_swapped(self) -> int | None: ...
    @property
    def cpu_seconds(self) -> float | None: ...


@dataclass(frozen=True)
class FixedMeters:
    """Meters known up front (a sandbox no backend runs: all None)."""

    oom_kills: int | None = None
    pids_refused: int | None = None
    disk_used: int | None = None
    memory_resident: int | None = None
    memory_swapped: int | None = None
    cpu_seconds: float | None = None


class CgroupMeters:
    """Meters of a sandbox whose processes are in its cgroup and whose writable layer is its
    scratch subvolume (the invariant every backend keeps). Each figure is read from the
    kernel on first use only: an exec's OOM check costs one cgroup read, not five."""

    def __init__(
        self, ctx: HostContext, sandbox_id: str, base: Mapping[str, float] | None = None
    ) -> None:
        self._ctx, self._sid = ctx, sandbox_id
        self._base = base or {}
        """What earlier cgroups of the sandbox counted (``oom_kills``, ``pids_refused``,
        ``cpu_seconds``): a microVM's cgroup is made anew at a memory-snapshot pause
        (:meth:`corral.host.cgroups.Cgroups.recycle`), and its counters go on from there."""

    @functools.cached_property
    def oom_kills(self) -> int | None:
        with contextlib.suppress(Exception):
            return self._ctx.cgroups.oom_kills(self._sid) + int(self._base.get("oom_kills", 0))
        return None

    @functools.cached_property
    def pids_refused(self) -> int | None:
        with contextlib.suppress(Exception):
            return self._ctx.cgroups.pids_refused(self._sid) + int(
                self._base.get("pids_refused", 0)
            )
        return None

    @functools.cached_property
    def disk_used(self) -> int | None:
        with contextlib.suppress(Exception):
            return self._ctx.scratch.usage(self._sid)
        return None

    @functools.cached_property
    def _memory(self) -> tuple[int | None, int | None]:
        with contextlib.suppress(Exception):
            return self._ctx.cgroups.memory_usage(self._sid)
        return None, None

    @property
    def memory_resident(self) -> int | None:
        return self._memory[0]

    @property
    def memory_swapped(self) -> int | None:
        return self._memory[1]

    @functools.cached_property
    def cpu_seconds(self) -> float | None:
        with contextlib.suppress(Exception):
            return self._ctx.cgroups.cpu_seconds(self._sid) + self._base.get("cpu_seconds", 0.0)
        return None


@dataclass
class HostContext:
    """What the node shares with every backend: built once by the node, never changed."""

    node_id: str
    """The node's id: its name on shared things (lease markers on the layer store)."""
    state_dir: Path
    run_dir: Path
    cgroups: Cgroups
    scratch: Scratch
    store: LayerStore
    host_uid: int
    """First host uid that root inside a sandbox maps to."""
    id_count: int
    seccomp_notify: str | None = None
    """The node's seccomp listener socket (corral.node.security), if it has one."""
    extra_mounts: list[dict[str, object]] = field(default_factory=list)
    """OCI-style mounts every sandbox gets (the node resolver's /etc/resolv.conf)."""
    eager_layers: bool = False
    """Benchmark baseline: copy each layer to node-local disk before its first use."""
    layer_prefetch: bool = True
    """Prefetch and record layers' hot blocks (images/hotblocks.py)."""
    layer_linger: float = 0.0
    """Seconds an unused layer stays mounted (images/mounts.py, ``linger``)."""
    layer_direct_io: str = "auto"
    """Mount layers with direct I/O: ``auto``, ``on``, ``off`` (images/mounts.py)."""


T = TypeVar("T")

CopyPurpose = Literal["snapshot", "fork"]


class Phases(Protocol):
    """Where a backend reports the phases of its work (the node's PhaseTimer), so that a
    create's time is split where it is spent: ``layer_mounts``, ``rootfs``,
    ``runtime_start``, ``init_ready``."""

    def phase(self, name: str) -> AbstractContextManager[None]: ...


class NoPhases:
    """Phases nobody records."""

    def phase(self, name: str) -> AbstractContextManager[None]:
        return contextlib.nullcontext()


Freezer = Callable[[], AbstractAsyncContextManager[None]]
"""Holds the sandbox's processes frozen for a block (the node's Pauser.frozen)."""


class Agent(Protocol):
    """The in-sandbox agent (corral-init), whatever carries its protocol (a unix socket for
    containers, a virtio-serial channel for VMs). Its reports are the init's own types.

    ``output_rate`` (bytes a second; the sandbox's ``limits.output_rate``, the node passes
    it to every exec and stream it relays for a client) paces how fast the node takes the
    sandbox's output, over all its execs together (corral.backends.outpace); ``None``:
    not paced (the node's own calls: a snapshot's stream, files through the agent).
    """

    async def ping(self) -> None: ...

    async def exec(
        self,
        argv: list[str],
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
    ) -> InitExit: ...

    def stream(
        self,
        argv: list[str],
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
    ) -> ExecStream: ...

    async def spawn(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        groups: Iterable[int] = (),
        output_limit: int = 1 << 20,
        stdin_pipe: bool = False,
    ) -> tuple[str, int]: ...

    def attach(self, proc_id: str, output_rate: int | None = None) -> ExecStream: ...
    async def wait(self, proc_id: str, timeout: float | None = 0) -> InitProc: ...
    async def kill(self, proc_id: str, sig: int = 9) -> None: ...
    async def list(self) -> list[InitProc]: ...
    async def forget(self, proc_id: str) -> None: ...


class Files(Protocol):
    """A sandbox's filesystem as the node's file API sees it (blocking calls: the node runs
    them in threads)."""

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes: ...
    def write(self, path: str, data: bytes, mode: int = 0o644, append: bool = False) -> None: ...
    def list(self, path: str) -> list[FileStat]: ...
    def stat(self, path: str) -> FileStat: ...
    def remove(self, path: str, recursive: bool = False) -> None: ...
    def mkdir(
        self,
        path: str,
        parents: bool = True,
        mode: int = 0o755,
        *,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        """New directories belong to ``owner_uid``/``owner_gid`` (ids inside the guest)."""
        ...

    def upload_tar(self, path: str, data: bytes) -> Any: ...
    def download_tar(self, path: str) -> bytes: ...


class Backend(Protocol):
    """One isolation engine of a node (see the module docstring for the life cycle)."""

    kind: str
    """``container``, ``microvm`` or ``vm``."""

    memory_snapshots: bool
    """The engine can pause a sandbox by saving it whole to a file (:meth:`pause_memory`):
    the VM engines. The node asks before it pauses anything, and refuses
    ``pause(memory_snapshot=True)`` on any other engine."""

    @property
    def accel(self) -> str | None:
        """The accelerator this engine's sandboxes run under (``kvm`` or ``tcg``, as the
        config says or a probe boot at :meth:`start` found), copied into each sandbox's
        info; None for an engine without one (containers), or not known yet."""
        ...

    # node-wide
    async def start(self) -> None:
        """Prepare what every sandbox of this engine needs (idempotent after a crash)."""
        ...

    async def stop(self, keep_running: bool) -> None:
        """Release this process's hold. ``keep_running``: sandboxes stay up for the next
        agent to adopt; else node-wide pieces (mounts, helpers) are torn down too."""
        ...

    async def gc(self, live: set[str]) -> dict[str, int]:
        """Remove what a crash left of sandboxes not in ``live`` (every live id of the node
        and the node's work names); returns counts by kind."""
        ...

    def status(self) -> BackendStatus: ...

    async def settle(self, timeout: float) -> bool:
        """Wait until the work this engine does in the background to make later creates
        quick is done (the container engine's pre-made cgroups), as on a node that has been
        up for a while; False if it was not within ``timeout`` seconds. For benches and
        tests that measure creates, never on a request's path."""
        ...

    async def recovered(self) -> None:
        """After the :meth:`adopt` calls of a restart: release node-wide pieces (layer
        mounts) that no adopted sandbox holds."""
        ...

    # per sandbox
    async def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        *,
        writable_from: str | None = None,
        phases: Phases = NoPhases(),
    ) -> Started:
        """Start the sandbox and return once its agent answers (``phases``: where the
        backend times its steps). ``writable_from``: a work
        copy made by :meth:`copy_writable` (purpose ``fork``) that the writable layer starts
        as. Leaves nothing behind on failure or cancellation."""
        ...

    async def adopt(self, sandbox_id: str, image: ImageInfo) -> Started | None:
        """After an agent restart: take over a running sandbox; None if it is gone."""
        ...

    async def destroy(self, sandbox_id: str, image: ImageInfo | None) -> None:
        """Remove every trace: processes, mounts, cgroup, writable layer, engine state."""
        ...

    def alive(self, sandbox_id: str) -> bool: ...

    def held_in_snapshot(self, sandbox_id: str) -> bool:
        """The sandbox is paused by being saved to a memory snapshot (a microVM whose VMM
        ended, its state in a file until a request or a resume restores it) rather than by
        a frozen cgroup. A restarted node keeps such a sandbox paused though its cgroup is
        not frozen (:meth:`corral.node.pause.Pauser.recovered`). False on an engine that
        never saves one."""
        ...

    async def pause_memory(self, sandbox_id: str) -> dict[str, object]:
        """Save the sandbox's whole machine (devices, memory) to a file and end it: nothing
        of it stays in host memory until :meth:`restore_memory` (or its next request)
        brings it back. Returns figures for the node's ``paused`` event. An engine without
        :attr:`memory_snapshots` raises :func:`no_memory_snapshots`'s error."""
        ...

    async def restore_memory(self, sandbox_id: str) -> object:
        """Bring back a sandbox that :meth:`pause_memory` saved (a no-op if it runs). An
        engine without :attr:`memory_snapshots` raises :func:`no_memory_snapshots`'s
        error."""
        ...

    async def copy_writable(
        self, sandbox_id: str, dst: str, frozen: Freezer, purpose: CopyPurpose
    ) -> float:
        """Copy the sandbox's writable layer to the scratch work name ``dst``, consistent
        (taken inside ``frozen()``); ``fork`` also prepares it as a base for
        ``create(writable_from=dst)``. Returns the seconds the sandbox was held frozen."""
        ...

    async def pack(self, work: str, *, source: str, max_bytes: int) -> LayerInfo:
        """Pack a ``snapshot`` copy's changes into a new layer of the store."""
        ...

    def agent(self, sandbox_id: str) -> Agent: ...
    def files(self, sandbox_id: str) -> Files: ...
    def meters(self, sandbox_id: str) -> Meters: ...

    # for the reaper and gc of stray processes
    async def kill_all(self, sandbox_id: str) -> bool:
        """Kill every process of the sandbox; True once its cgroup was seen empty."""
        ...


def no_memory_snapshots(kind: str) -> InvalidRequest:
    """The error for ``pause(memory_snapshot=True)`` on an engine that cannot save one: the
    node raises it before it pauses anything, such an engine's :meth:`Backend.pause_memory`
    too."""
    return InvalidRequest(f"pause(memory_snapshot=True): not for {kind} sandboxes")


async def run_undo(undo: list[Callable[[], object]]) -> None:
    """Undo the steps of a create that failed, last first, each even if another fails
    (a step may be a coroutine function)."""
    for step in reversed(undo):
        with contextlib.suppress(Exception):
            r = step()
            if hasattr(r, "__await__"):
                await r


async def in_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a worker thread; if the caller is cancelled, it still waits for the
    thread to end, so the caller's undo never runs before what it undoes exists."""
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        raise
