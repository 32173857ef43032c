"""Container sandboxes: OCI runtime + overlay of shared EROFS layers + corral-init.

Create, in order (each step undone if a later one fails):
  1. acquire each image layer's node-wide mount (idmapped to the sandbox uid range),
  2. the sandbox dir: a btrfs subvolume with the disk quota (it holds the overlay upper
     and work dirs, the rootfs mountpoint, the bundle and the control socket),
  3. overlay rootfs = layers (lowers) + upper (for corral's launcher a detached mount,
     attached only in the sandbox's own mount namespace: never in the host's table),
  4. a listening control socket in the sandbox dir (host side only; the guest never sees it),
  5. config.json, then ``runc run --detach --preserve-fds 1`` with that socket as fd 3.
No process of ours stays per sandbox: runc exits, the init lives on in the container.
Steps 2-4 are one synchronous ``_prepare`` on the event loop: in a worker thread they cost
the node ~1 ms more CPU per create (GIL handoffs around each syscall) and gained no
creates/s on 2 cores (docs/design-notes.md, "The create's kernel work off the event loop").
The launcher's cgroups are not: their mkdirs and renames wait for the kernel's one cgroup
mutex, which the launchers' own cgroup.procs writes hold for an RCU grace period each, and
on the loop that wait stalled every create in flight (``Launcher.make_cgroup_async``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.backends import oci
from corral.backends.base import (
    Backend,
    CgroupMeters,
    CopyPurpose,
    Freezer,
    HostContext,
    Meters,
    NoPhases,
    Phases,
    Started,
    in_thread,
    no_memory_snapshots,
    run_undo,
)
from corral.backends.config import ContainerConfig
from corral.backends.files import SandboxFS
from corral.backends.initclient import InitClient
from corral.errors import HostError, SandboxError
from corral.host import initfs, launch, mounts
from corral.host._aio import fd_ready
from corral.host._sys import read_small
from corral.host.cgroups import CgroupPool
from corral.host.launch import Launcher
from corral.host.owners import OwnerUids, namespace_owner
from corral.host.runtime import OCIRuntime
from corral.host.userns import SandboxUserns, UserNamespace, drop_file
from corral.images.hotblocks import HotBlocks
from corral.images.mounts import LayerMounts
from corral.images.pack import pack_upper, scrub
from corral.images.store import LayerStore
from corral.init import ensure_built
from corral.policy import qos
from corral.spec import BackendStatus, ImageInfo, LayerInfo, SandboxSpec

__all__ = ["ContainerBackend", "remove_sandbox_dir"]

log = logging.getLogger("corral.backends.container")

_PF_EXITING = 0x4  # include/linux/sched.h: /proc/<pid>/stat field 9
_KEEP = ("upper", "work", "rootfs")  # what a fork base keeps of a sandbox dir
_MIN_SCRATCH_ROOM = 8 << 20
"""Free scratch space below which a create is refused: a sandbox that starts with no room
for its first writes fails at them instead, far from the cause. crun met this by its bundle
write failing; the launcher writes no file there, so it is checked."""
_ROOT_OPTIONS = ("volatile",)
"""Overlay options of every sandbox rootfs. ``volatile``: the overlay never syncs its
upper. Without it, the unmount at a sandbox's end (the last task's exit, or the host
umount) ran ``sync_filesystem`` on the whole btrfs scratch, a transaction commit each,
and concurrent destroys queued behind each other's commits (design notes, "Destroy at
density"); a guest's fsync likewise committed every sandbox's dirty data. Nothing needs
a sandbox's writes to survive a host crash (its processes do not either, and gc removes
what is left); snapshots and forks get their data from btrfs's snapshot, which writes
out the subvolume's dirty data itself. The kernel marks the work dir
(``work/work/incompat/volatile``) so that the upper is never mounted again: corral
never remounts one (a fork base gets a new work dir, :func:`_reset_base`)."""


class ContainerBackend:
    """The container engine (see the module docstring); implements
    :class:`corral.backends.base.Backend`. Built complete by the node, then :meth:`start`."""

    kind = "container"
    memory_snapshots = False
    accel: str | None = None

    runtime: OCIRuntime | Launcher
    userns: UserNamespace
    layers: LayerMounts
    owners: OwnerUids | None
    init_path: Path

    def __init__(self, config: ContainerConfig, ctx: HostContext, *, owner_first: int) -> None:
        self.config = config
        self.ctx = ctx
        self.cgroups = ctx.cgroups
        self.scratch = ctx.scratch
        self.host_uid = ctx.host_uid
        self.id_count = ctx.id_count
        # Each sandbox's dir is its scratch subvolume (see _create).
        self.sandboxes_dir = ctx.scratch.mountpoint
        self._owner_first = owner_first
        self._helper_dir = ctx.state_dir / "bin"
        self._initfs = ctx.run_dir / "initfs"
        self._owner: dict[str, int] = {}
        self._clients: dict[str, InitClient] = {}
        self._fs: dict[str, SandboxFS] = {}
        self._seccomp_bpf: dict[str, str] = {}
        self._adopted_layers: dict[str, int] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._sweep_wake = asyncio.Event()
        """Set when a layer starts to linger (:meth:`_lingered`): the sweeper's wake-up."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False

    # ------------------------------------------------------------------ node-wide
    async def start(self) -> None:
        """Pick the OCI runtime, build and install corral-init, make the node's user
        namespace, claim the owner uid range and prepare the layer mounts."""
        if self._started:
            return
        ctx = self.ctx
        self._loop, self._sweep_wake = asyncio.get_running_loop(), asyncio.Event()
        self.runtime = self._pick_runtime()
        opened: list[Callable[[], object]] = [self.runtime.close]
        try:
            self.init_path = await asyncio.to_thread(self._install_init)
            if not self.host_mounted_root:
                # On the init's tmpfs: one read-only /sys/fs/cgroup tree for every sandbox.
                self.launcher.use_cgroup_tree(self.init_path.parent / "cgroup")
                # Pre-made cgroups renamed at create; runtime.close() removes them.
                await asyncio.to_thread(self.launcher.start_pool)
            self.userns = UserNamespace.create(ctx.host_uid, ctx.id_count)
            opened.append(self.userns.close)
            resolve: Callable[[str], Path] = ctx.store.path_of
            if ctx.eager_layers:
                resolve = _eager_resolver(ctx.store, ctx.state_dir / "eager")
            # Each mounted layer is leased on the store (a marker file), so that a store gc
            # run by any node never removes a layer this node has mounted.
            self.layers = LayerMounts(
                ctx.state_dir / "mnt",
                resolve,
                ctx.store.verify,
                self.userns,
                leases=ctx.store.leases(f"node-{ctx.node_id}"),
                hot=HotBlocks(ctx.store) if ctx.layer_prefetch else None,
                linger=ctx.layer_linger,
                lingered=self._lingered,
                direct_io=ctx.layer_direct_io,
            )
            # Each sandbox's user namespace is owned by a host uid of its own (host/owners.py).
            self.owners = OwnerUids(self._owner_first, self.config.owner_uids)
            opened.append(self.owners.close)
        except BaseException:
            for close in reversed(opened):
                with contextlib.suppress(Exception):
                    close()
            raise
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.ctl_dir.mkdir(mode=0o700, exist_ok=True)
        if self.layers.linger > 0:
            self._sweeper = asyncio.ensure_future(self._sweep_layers())
        self._started = True

    def _lingered(self) -> None:
        """A layer started to linger (called in the thread that released it): wake the
        sweeper."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody sweeps
                self._loop.call_soon_threadsafe(self._sweep_wake.set)

    async def _sweep_layers(self) -> None:
        """Unmount each layer once it has been unused for ``layer_linger`` seconds.
        Asleep while no layer lingers (a release that leaves one lingering wakes it), else
        until the one lingering longest is due: a layer that starts to linger later is due
        later, so nothing has to cut that sleep short."""
        while True:
            self._sweep_wake.clear()  # before the look: a release after it sets it again
            due = self.layers.next_due()
            if due is None:
                await self._sweep_wake.wait()
                continue
            left = due - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)
                continue  # taken again meanwhile? then it is no longer due
            job = asyncio.ensure_future(asyncio.to_thread(self.layers.sweep))
            try:
                await asyncio.shield(job)
            except asyncio.CancelledError:  # stop(): let the unmounts under way finish first
                await asyncio.wait([job])
                raise
            except (HostError, OSError) as e:  # tried again a little later; the node runs on
                log.warning("layer sweep: %s", e)
                await asyncio.sleep(max(self.layers.linger / 4, 0.25))

    def _pick_runtime(self) -> OCIRuntime | Launcher:
        """corral's launcher where the kernel has what it needs (``auto``) or when asked
        for; else the OCI runtime (crun, runc)."""
        ctx, want = self.ctx, self.config.runtime
        if want in ("auto", "launch"):
            why = launch.supported()
            if why is None:
                return Launcher.detect(
                    ctx.cgroups, root=ctx.run_dir / "launch", helper_dir=self._helper_dir
                )
            if want == "launch":
                raise HostError(f"runtime launch: {why}")
            log.info("corral-launch not usable (%s): using an OCI runtime", why)
        return OCIRuntime.detect(
            ctx.cgroups.mode,
            root_base=ctx.run_dir,
            prefer=None if want in ("auto", "launch") else want,
            helper_dir=self._helper_dir,
            root_tmpfs=True,
        )

    def _install_init(self) -> Path:
        """Build corral-init if needed and put it on its own tmpfs (see corral.host.initfs)."""
        return initfs.install(self._initfs, ensure_built(self._helper_dir))

    async def recovered(self) -> None:
        """After the adoptions of a restart: the layer mounts keep the refcounts of the
        adopted sandboxes; mounts no adopted sandbox uses go."""
        counts, self._adopted_layers = self._adopted_layers, {}
        await asyncio.to_thread(self.layers.adopt, counts)

    async def stop(self, keep_running: bool) -> None:
        if not self._started:
            return
        self._started = False
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        try:
            if not keep_running:
                await asyncio.to_thread(self._teardown)
        finally:
            self.userns.close()
            if self.owners is not None:
                self.owners.close()  # its host-wide claims go with it
            self.runtime.close()

    def _teardown(self) -> None:
        initfs.remove(self._initfs)
        self.layers.unmount_all()
        self.runtime.teardown()  # its tmpfs at --root, if it made one
        for d in (self.runtime.root, self.runtime.root.with_name(self.runtime.root.name + "-log")):
            with contextlib.suppress(OSError):
                d.rmdir()

    async def gc(self, live: set[str]) -> dict[str, int]:
        """Runtime containers, rootfs mounts, cgroups, writable layers and dirs of no live
        sandbox; a stray process keeping a cgroup busy (a create cut short) is killed."""
        removed = {"containers": 0, "mounts": 0, "cgroups": 0, "subvols": 0}
        for c in await self.runtime.list():
            cid = c.get("id", "")
            if cid and cid not in live:
                await self.kill_all(cid)
                await self.runtime.delete(cid, force=True)
                removed["containers"] += 1
        for m in mounts.mounts_under(self.sandboxes_dir):
            # Only sandbox rootfs mounts (DIR/<id>/rootfs): DIR itself is the scratch mount.
            if m.parent.parent == self.sandboxes_dir and m.parent.name not in live:
                mounts.umount(m, detach=True)
                removed["mounts"] += 1
        for name in self.cgroups.list():
            if name not in live:
                await self.kill_all(name)
                self.cgroups.remove(name)
                removed["cgroups"] += 1
        for name in self.scratch.subvols():
            if name not in live and name.startswith("sb-"):
                self.scratch.delete_subvol(name)
                removed["subvols"] += 1
        if self.ctl_dir.exists():
            for sock in self.ctl_dir.iterdir():
                if sock.name.endswith(".sock") and sock.name[: -len(".sock")] not in live:
                    sock.unlink(missing_ok=True)
        if self.sandboxes_dir.exists():
            for d in self.sandboxes_dir.iterdir():
                if d.name not in live and d.name.startswith("sb-"):
                    try:
                        remove_sandbox_dir(d)
                    except OSError as e:
                        # Kept, not forced: it may hold guest data (an unmounted rootfs).
                        log.warning("gc: sandbox dir %s left in place: %s", d, e.strerror)
        return removed

    def status(self) -> BackendStatus:
        detail = {
            "runtime": self.runtime.name if self._started else "",
            "layer_mounts": str(len(self.layers.mounted())) if self._started else "0",
        }
        pool = self._cgroup_pool()
        if pool is not None:  # pre-made cgroups: per limits, and creates that got one
            detail["cgroup_pool_size"] = str(pool.size)
            detail["cgroup_pool_taken"] = str(pool.taken)
            detail["cgroup_pool_returned"] = str(pool.returned)
        return BackendStatus(kind=self.kind, ok=self._started, detail=detail)

    def _cgroup_pool(self) -> CgroupPool | None:
        """The launcher's pre-made cgroups (v1 and hybrid); None with an OCI runtime."""
        if not self._started or self.host_mounted_root:
            return None
        return self.launcher.pool

    async def settle(self, timeout: float) -> bool:
        """Until the pre-made cgroups of the limits created lately are all made."""
        pool = self._cgroup_pool()
        return True if pool is None else await asyncio.to_thread(pool.wait_full, timeout)

    # ------------------------------------------------------------------ paths and handles
    @property
    def host_mounted_root(self) -> bool:
        """Whether a sandbox's rootfs is mounted in the host's mount table (at
        :meth:`rootfs`, by an OCI runtime's create), rather than only in the sandbox's own
        mount namespace (corral's launcher: a detached overlay, reached through the init)."""
        return not isinstance(self.runtime, Launcher)

    @property
    def launcher(self) -> Launcher:
        """The runtime, where it is corral's launcher (callers check
        :attr:`host_mounted_root` first)."""
        assert isinstance(self.runtime, Launcher)
        return self.runtime

    def dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def rootfs(self, sandbox_id: str) -> Path:
        return self.dir(sandbox_id) / "rootfs"

    @property
    def ctl_dir(self) -> Path:
        """The control sockets of all sandboxes, in one directory of the scratch's top
        subvolume (not each in its sandbox's subvolume, as before).

        Why: the kernel finds the socket a ``connect`` names in one global table of 256
        buckets hashed by the socket file's inode number (``unix_find_socket_byinode``),
        and every new btrfs subvolume numbers its inodes from the same start, so every
        sandbox's ``ctl.sock`` had the same inode number (266): all sockets in one bucket,
        and every exec, ping and init call walked a list of every live sandbox (design
        notes, "Exec at density"). Here inode numbers differ, so they spread over the
        buckets."""
        return self.sandboxes_dir / ".ctl"

    def socket_path(self, sandbox_id: str) -> Path:
        """Where a new sandbox's control socket is bound."""
        return self.ctl_dir / f"{sandbox_id}.sock"

    def _agent_path(self, sandbox_id: str) -> Path:
        """The control socket to connect to: a sandbox adopted from a node before
        :attr:`ctl_dir` still has its socket in its own dir."""
        p = self.socket_path(sandbox_id)
        old = self.dir(sandbox_id) / "ctl.sock"
        return old if not p.exists() and old.exists() else p

    def agent(self, sandbox_id: str) -> InitClient:
        c = self._clients.get(sandbox_id)
        if c is None:
            c = self._clients[sandbox_id] = InitClient(self._agent_path(sandbox_id))
        return c

    def files(self, sandbox_id: str) -> SandboxFS:
        f = self._fs.get(sandbox_id)
        if f is None:
            hosted = self.host_mounted_root
            f = self._fs[sandbox_id] = SandboxFS(
                self.rootfs(sandbox_id),
                uid=self.host_uid,
                gid=self.host_uid,
                # A host mount must still be there (not the bare dir under it); without
                # one, the root as the guest sees it, through its init.
                require_mount=hosted,
                open_root=None
                if hosted
                else functools.partial(self.launcher.open_root, sandbox_id),
            )
        return f

    def meters(self, sandbox_id: str) -> Meters:
        return CgroupMeters(self.ctx, sandbox_id)

    # lifecycle
    async def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        *,
        writable_from: str | None = None,
        phases: Phases = NoPhases(),
    ) -> Started:
        """Start a sandbox; with ``writable_from`` (a fork base made by
        :meth:`copy_writable`), its writable layer starts as a snapshot of that one."""
        undo: list[Callable[[], object]] = []
        try:
            pid = await self._create(sandbox_id, spec, image, undo, writable_from, phases)
            self.layers.started(image.layers)  # their hot-block prefetch may start now
            return Started(pid=pid, cgroup=sandbox_id)
        except BaseException:
            await run_undo(undo)
            raise

    async def _create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        undo: list[Callable[[], object]],
        base: str | None,
        phases: Phases,
    ) -> int:
        """The steps of the module docstring: the kernel work (the subvolume, the overlay,
        the control socket and, for the launcher, the cgroups) is one synchronous step,
        :meth:`_prepare`, which records each undo as soon as its step is done; for the
        launcher the cgroups follow, off the event loop (:meth:`_make_cgroup`)."""
        with phases.phase("layer_mounts"):
            lowers = await self._acquire_layers(image, undo)
        owner: int | None = None
        if self.owners is not None:
            # Before the cgroup and the launch: its release, undone in reverse, comes only
            # after every process of the sandbox (in the namespace it owns) is killed.
            self._owner[sandbox_id] = owner = self.owners.allocate()
            undo.append(lambda: self._release_owner(sandbox_id))
        latency = spec.qos == "latency"  # its cgroup's place (Cgroups.prepare)
        root = self.rootfs(sandbox_id)
        made = _Made()
        try:
            config, cgroup = None, None
            if not self.host_mounted_root:
                config = self._config(sandbox_id, spec, image, root, None, latency, mappings=True)
                cgroup = (config["linux"]["resources"], latency)
            self._prepare(sandbox_id, spec, base, lowers, undo, made, phases)
            if cgroup is not None:
                await self._make_cgroup(sandbox_id, undo, made, phases, *cgroup)
            if config is not None:
                return await self._launch(sandbox_id, spec, config, undo, phases, made, owner)
            return await self._run_oci(sandbox_id, spec, image, undo, phases, made, owner, latency)
        finally:
            # Ours, not state to undo: the init holds its own copy of the listening socket
            # (so the socket dies with the sandbox), the launcher attached the rootfs in
            # the sandbox's namespace (or failed, and the overlay goes with its copy).
            made.close()

    async def _acquire_layers(
        self, image: ImageInfo, undo: list[Callable[[], object]]
    ) -> list[Path]:
        """Each image layer's node-wide mount (bottom first), released by ``undo``.

        A layer's first use on this node leases, verifies and mounts it: a dozen store
        round trips in a row on a network store. An image's new layers are mounted at once,
        each in a thread (off the event loop), so its first create waits about one first
        mount, not one per layer. If one fails or the create is cancelled meanwhile, every
        acquire still completes and the ones that succeeded are recorded for undo."""
        mounted = self.layers.ready()
        jobs: dict[str, asyncio.Future[Path]] = {
            d: asyncio.ensure_future(asyncio.to_thread(self.layers.acquire, d))
            for d in dict.fromkeys(image.layers)
            if d not in mounted
        }
        if jobs:
            try:
                await asyncio.shield(asyncio.wait(jobs.values()))
            except asyncio.CancelledError:
                await asyncio.wait(jobs.values())
                raise
            finally:
                for d, job in jobs.items():
                    if job.done() and not job.cancelled() and job.exception() is None:
                        undo.append(functools.partial(self.layers.release, d, record=False))
            for job in jobs.values():
                if (err := job.exception()) is not None:
                    raise err
        lowers: list[Path] = []
        for digest in image.layers:
            if digest in jobs:  # mounted above, its undo recorded
                lowers.append(jobs.pop(digest).result())
                continue
            lowers.append(self.layers.acquire(digest))
            undo.append(functools.partial(self.layers.release, digest, record=False))
        return lowers

    def _prepare(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        base: str | None,
        lowers: list[Path],
        undo: list[Callable[[], object]],
        made: _Made,
        phases: Phases,
    ) -> None:
        """The sandbox dir, the overlay rootfs and the control socket. Appends each step's
        undo once it is done."""
        with phases.phase("rootfs"):
            _check_room(self.scratch.mountpoint)
            sub = self._make_dir(sandbox_id, spec, base, undo)
            self._make_rootfs(sandbox_id, sub, base, lowers, undo, made)
        sock_path = self.socket_path(sandbox_id)
        made.lsock = lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(str(sock_path))
        undo.append(lambda: sock_path.unlink(missing_ok=True))
        os.chmod(sock_path, 0o600)
        lsock.listen(64)

    async def _make_cgroup(
        self,
        sandbox_id: str,
        undo: list[Callable[[], object]],
        made: _Made,
        phases: Phases,
        resources: dict[str, Any],
        latency: bool,
    ) -> None:
        """The launcher's cgroups for the sandbox (``resources``: the config's), made in
        the launcher's cgroup thread (:meth:`Launcher.make_cgroup_async`)."""
        launcher = self.launcher
        # In runtime_start, as the OCI runtime's cgroup setup is: the phases compare.
        with phases.phase("runtime_start"):
            # Patient (EBUSY retried, off the event loop): the killed processes of a
            # cancelled best-effort create leave their cgroup only once their exits get
            # idle CPU; a 1 s wait left the cgroup behind under load. Recorded before the
            # thread starts: a failed make removes what it made itself, and a cancelled
            # create's undo runs only once the thread has ended.
            undo.append(lambda: self._remove_cgroup(sandbox_id))
            made.procs = await launcher.make_cgroup_async(sandbox_id, resources, latency)
        undo.append(lambda: launcher.delete(sandbox_id, force=True))

    def _make_dir(
        self, sandbox_id: str, spec: SandboxSpec, base: str | None, undo: list[Callable[[], object]]
    ) -> Path:
        """The sandbox dir; returns the subvolume that holds the overlay's upper and work."""
        d = self.dir(sandbox_id)
        if d.parent == self.scratch.mountpoint:
            # The sandbox's dir is its btrfs subvolume (bundle, control socket, rootfs
            # mountpoint, overlay upper and work), deleted in one call, and refused while the
            # rootfs is still mounted. It also keeps these per-create files off the node's
            # root filesystem: here ext4 without a journal, whose inode allocator rescans
            # recently deleted inodes (~0.3-0.6 ms per new file under create/destroy churn).
            undo.append(lambda: self.scratch.delete_subvol(sandbox_id))
            if base is None:
                self.scratch.create_subvol(sandbox_id, quota=spec.limits.disk)
            else:
                # A snapshot commits a btrfs transaction (2-10 ms).
                self.scratch.snapshot(base, sandbox_id, quota=spec.limits.disk)
            sub = d
        else:
            d.mkdir(mode=0o711)
            undo.append(lambda: remove_sandbox_dir(d))
            undo.append(lambda: self.scratch.delete_subvol(sandbox_id))
            if base is None:
                sub = self.scratch.create_subvol(sandbox_id, quota=spec.limits.disk)
            else:
                sub = self.scratch.snapshot(base, sandbox_id, quota=spec.limits.disk)
        # 0711: runc in the user namespace must traverse it as the mapped uid; no listing.
        os.chmod(d, 0o711)
        return sub

    def _make_rootfs(
        self,
        sandbox_id: str,
        sub: Path,
        base: str | None,
        lowers: list[Path],
        undo: list[Callable[[], object]],
        made: _Made,
    ) -> None:
        """The overlay rootfs: a detached mount for the launcher (``made.root_fd``), else
        mounted at the sandbox's rootfs dir."""
        upper, work = sub / "upper", sub / "work"
        if base is None:
            upper.mkdir()
            work.mkdir()
            # The upper belongs to root inside the sandbox (host uid host_uid), so the guest
            # can write where a normal root could and its files land under the mapped owner.
            os.chown(upper, self.host_uid, self.host_uid)
        if not self.host_mounted_root:
            # A detached mount: the launcher attaches it in the sandbox's own mount
            # namespace only; the host's mount table never holds it (design notes,
            # "Density"). Our fd goes once the launch is over (_create).
            made.root_fd = mounts.overlay_fd(
                list(reversed(lowers)), upper, work, _ROOT_OPTIONS, what=f"{sandbox_id} rootfs"
            )
            undo.append(made.close_root)
        else:
            root = self.rootfs(sandbox_id)
            root.mkdir(exist_ok=base is not None)
            mounts.mount_overlay(list(reversed(lowers)), upper, work, root, _ROOT_OPTIONS)
            undo.append(lambda: mounts.umount(root, detach=True))

    async def _run_oci(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        undo: list[Callable[[], object]],
        phases: Phases,
        made: _Made,
        owner: int | None,
        latency: bool,
    ) -> int:
        """The rest of a create with an OCI runtime: config.json, then ``run --detach``."""
        assert isinstance(self.runtime, OCIRuntime)
        d = self.dir(sandbox_id)
        userns = None
        if owner is not None:
            # crun opens the namespace in its own process: an fd does (no mount churn).
            path = None if self.runtime.name == "crun" else d / "userns"
            userns = SandboxUserns(owner, self.host_uid, self.id_count, path)
        root = self.rootfs(sandbox_id)
        config = self._config(
            sandbox_id, spec, image, root, userns, latency, mappings=self.runtime.name == "runc"
        )
        bpf_key = self._reuse_seccomp_bpf(config)
        if userns is not None and not oci.joins_userns(config):
            userns = None  # runc with a joined network namespace (see build_config)
            self._release_owner(sandbox_id)
        rlimits = oci.take_rlimits(config) if userns and self.runtime.name == "runc" else []
        oci.write_bundle(d, config)
        self.cgroups.prepare(latency=latency)
        # After the runtime's delete (undo runs in reverse): directories it left, e.g.
        # in hierarchies it does not manage.
        # Waits for the killed tasks (a failed create's too: a best-effort init that did
        # not come up on saturated CPUs exits slowly), as destroy does.
        undo.append(lambda: self._remove_cgroup(sandbox_id))
        undo.append(lambda: self.runtime.delete(sandbox_id, force=True))
        assert made.lsock is not None
        with phases.phase("runtime_start"):
            await self.runtime.run_detached(
                sandbox_id, d, pass_fd=made.lsock.fileno(), userns=userns, rlimits=rlimits
            )
        if bpf_key is not None:
            self._remember_seccomp_bpf(bpf_key, sandbox_id)
        made.close()
        pid = self.init_pid(sandbox_id)
        if pid is None:
            raise HostError(f"sandbox {sandbox_id}: the runtime started but reports no init pid")
        # Before any guest command exists, so everything the sandbox starts inherits it.
        qos.apply(pid, spec.qos)
        await self._init_ready(sandbox_id, phases)
        return pid

    async def _init_ready(self, sandbox_id: str, phases: Phases) -> None:
        """The end of a create: wait until the init answers."""
        # The runtime may return while the container is still being set up (its last steps,
        # the seccomp listener handover among them, run inside the sandbox's cgroup: for a
        # best-effort sandbox on idle CPU only). "running" means the init answers: a node
        # killed before that would otherwise leave a sandbox whose setup then fails.
        with phases.phase("init_ready"):
            try:
                await self.agent(sandbox_id).ping()
            except SandboxError as e:
                raise SandboxError(
                    f"sandbox {sandbox_id}: its init did not come up ({e}); a best-effort "
                    "sandbox starts on idle CPU only, so normal-priority load on every CPU "
                    "delays it"
                ) from None

    async def _launch(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        config: dict[str, Any],
        undo: list[Callable[[], object]],
        phases: Phases,
        made: _Made,
        owner: int | None,
    ) -> int:
        """The rest of a create with corral's launcher (:mod:`corral.host.launch`): the
        same OCI config, executed without a runtime; no bundle is written. ``made``: the
        detached rootfs overlay, the control socket and the cgroups (:meth:`_prepare`)."""
        assert made.lsock is not None and made.procs is not None
        procs, cpu_procs = made.procs
        policy, nice_limit = qos.settings(spec.qos)
        with phases.phase("runtime_start"):
            pid = await self.launcher.start(
                sandbox_id,
                config,
                ctl_fd=made.lsock.fileno(),
                owner=0 if owner is None else owner,
                cgroup_procs=procs,
                cpu_procs=cpu_procs,
                rootfs_fd=made.root_fd,
                policy=policy,
                nice_limit=nice_limit,
            )
        # The init holds its own copy of the socket now; the overlay is attached in the
        # sandbox's namespace and lives as long as that.
        made.close()
        await self._init_ready(sandbox_id, phases)
        return pid

    def _config(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        root: Path,
        userns: SandboxUserns | None,
        latency: bool,
        *,
        mappings: bool,
    ) -> dict[str, Any]:
        """The sandbox's OCI config (:func:`corral.backends.oci.build_config`): its whole
        security posture, whichever way it is started."""
        return oci.build_config(
            rootfs=root,
            init_host_path=self.init_path,
            hostname=spec.hostname,
            cgroups_path=self.cgroups.oci_path(sandbox_id, latency=latency),
            limits=spec.limits,
            host_uid=self.host_uid,
            id_count=self.id_count,
            annotations={"corral.sandbox": sandbox_id, "corral.image": image.digest},
            userns_path=None if userns is None else userns.join_path,
            userns_mappings=mappings,
            notify=self.ctx.seccomp_notify,
            extra_mounts=[*self.ctx.extra_mounts, *oci.tmpfs_mounts(spec.tmpfs)],
            readonly_root=spec.readonly_rootfs,
            mask_dir=self.init_path.parent / initfs.EMPTY,
        )

    def _reuse_seccomp_bpf(self, config: dict[str, object]) -> str | None:
        """Hand crun the seccomp filter it compiled for an identical profile before.

        crun compiles the OCI seccomp profile with libseccomp for every container (~7% of
        a create's CPU here). Its ``run.oci.seccomp_bpf_data`` annotation takes the
        compiled program instead; corral reuses crun's own output (the ``seccomp.bpf`` it
        leaves in its state dir), keyed by the exact profile and runtime binary, so the
        guest gets the very filter crun would have built. Returns the cache key when the
        filter is not cached yet (the caller records it after the run), else None.
        """
        if self.runtime.name != "crun":
            return None
        linux = config.get("linux")
        seccomp = linux.get("seccomp") if isinstance(linux, dict) else None
        if not seccomp:
            return None
        key = hashlib.sha256(
            json.dumps([self.runtime.binary, seccomp], sort_keys=True).encode()
        ).hexdigest()
        bpf = self._seccomp_bpf.get(key)
        if bpf is None:
            return key
        annotations = config.setdefault("annotations", {})
        assert isinstance(annotations, dict)
        annotations["run.oci.seccomp_bpf_data"] = bpf
        return None

    def _remember_seccomp_bpf(self, key: str, sandbox_id: str) -> None:
        # Complete: crun wrote it before starting the container, which has started.
        try:
            raw = (self.runtime.root / sandbox_id / "seccomp.bpf").read_bytes()
        except OSError:
            return
        # A classic BPF program is a whole number of 8-byte instructions.
        if raw and len(raw) % 8 == 0:
            self._seccomp_bpf[key] = base64.b64encode(raw).decode()

    def init_pid(self, sandbox_id: str) -> int | None:
        """Host pid of the sandbox's init, read from the runtime's state file (no exec),
        or the launcher's record."""
        if not self.host_mounted_root:
            return self.launcher.init_pid(sandbox_id)
        for name in ("state.json", "status"):
            p = self.runtime.root / sandbox_id / name
            try:
                data = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            pid = data.get("init_process_pid") or data.get("pid")
            if pid:
                return int(pid)
        return None

    def held_in_snapshot(self, sandbox_id: str) -> bool:
        """Never: a container is paused only by freezing its cgroup."""
        return False

    async def pause_memory(self, sandbox_id: str) -> dict[str, object]:
        raise no_memory_snapshots(self.kind)

    async def restore_memory(self, sandbox_id: str) -> object:
        raise no_memory_snapshots(self.kind)

    def alive(self, sandbox_id: str) -> bool:
        pid = self.init_pid(sandbox_id)
        if not pid:
            return False
        try:
            fields = read_small(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
            state, flags = fields[0], int(fields[6])
        except (OSError, IndexError, ValueError):
            return False
        # A killed init stays a zombie until the host's init reaps it (seen: 1.7 s here);
        # it serves nothing any more. Before that it is exiting (PF_EXITING) while the
        # kernel kills the rest of its pid namespace, and the last of those tears down the
        # sandbox's mount namespace, its rootfs overlay with it (a sync of the upper).
        return state not in (b"Z", b"X") and not flags & _PF_EXITING

    async def kill_all(self, sandbox_id: str, wait: float = 5.0) -> bool:
        """SIGKILL the init (the kernel then kills its whole pid namespace) and wait until no
        process of the sandbox is left, so destroy never returns with guest processes alive.
        True when the sandbox's cgroup was seen empty."""
        with contextlib.suppress(Exception):
            # A frozen (paused) task never dies of SIGKILL on cgroup v1 until thawed.
            if self.cgroups.is_frozen(sandbox_id):
                self.cgroups.thaw(sandbox_id, timeout=1.0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + wait
        pid = self.init_pid(sandbox_id)
        if pid:
            # Only if the pid is still the sandbox's: an init that died (and was reaped)
            # before this destroy may have had its pid reused by an unrelated host process.
            fd = _pidfd_kill(
                pid, in_cgroup=lambda q: q in self.cgroups.procs(sandbox_id), keep=True
            )
            if fd is not None:
                try:
                    # Its pidfd turns readable once it has exited, which the init of a pid
                    # namespace does only after every other task in it is gone: one wakeup
                    # instead of reading cgroup.procs every 2 ms meanwhile (a best-effort
                    # sandbox's tasks exit on idle CPU only: under load, seconds of polls,
                    # most of a destroy's CPU).
                    await fd_ready(fd, timeout=deadline - loop.time())
                finally:
                    os.close(fd)
        while True:
            try:
                left = self.cgroups.procs(sandbox_id)
            except Exception:
                return False  # no cgroup (never created, or removed): let the runtime decide
            if not left:
                return True
            if loop.time() >= deadline:
                return False
            if not pid or loop.time() - start > 0.2:
                # No runtime record (a create interrupted between the runtime starting the
                # container and writing its state), or the namespace did not go down with
                # the init: kill what the sandbox's cgroup holds, one by one.
                for p in left:
                    _pidfd_kill(p, in_cgroup=lambda q: q in self.cgroups.procs(sandbox_id))
            await asyncio.sleep(0.002)

    async def adopt(self, sandbox_id: str, image: ImageInfo) -> Started | None:
        if not self.host_mounted_root:
            ok = self.alive(sandbox_id)  # its rootfs lives in its own mount namespace
        else:
            ok = self.alive(sandbox_id) and mounts.is_mountpoint(self.rootfs(sandbox_id))
        pid = self.init_pid(sandbox_id)
        if not ok or not pid:
            return None
        if self.owners is not None:
            # The kernel remembers who owns the namespace: claim that uid again.
            owner = namespace_owner(pid)
            if owner is not None and self.owners.claim(owner):
                self._owner[sandbox_id] = owner
        for d in image.layers:
            self._adopted_layers[d] = self._adopted_layers.get(d, 0) + 1
        return Started(pid=pid, cgroup=sandbox_id)

    def _release_owner(self, sandbox_id: str) -> None:
        owner = self._owner.pop(sandbox_id, None)
        if owner is not None and self.owners is not None:
            self.owners.release(owner)

    async def _remove_cgroup(self, sandbox_id: str, patience: float = 60.0) -> None:
        """Remove the sandbox's cgroup once its killed tasks have left it.

        A killed process leaves its cgroup only when its exit is done, and a best-effort
        sandbox's processes run SCHED_IDLE: on saturated CPUs their exits wait for idle
        time. Seen in bench neighbours at a load average of ~40: the fd-exhaustion
        attacker's destroy took 3.4 s, the old 1 s wait gave up with EBUSY and the cgroup
        stayed behind as a leak. So EBUSY is retried, without blocking the event loop (the
        old wait slept in it), up to ``patience`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        pause = 0.002
        pool = self._cgroup_pool()
        if pool is not None:
            pool.forget(sandbox_id)
        while True:
            try:
                self.cgroups.remove(sandbox_id, timeout=0)
                return
            except HostError as e:
                if "EBUSY" not in str(e) or loop.time() > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)

    async def _remove_cgroup_off_loop(self, sandbox_id: str) -> None:
        """:meth:`_remove_cgroup`, its first try in a worker thread: removing a sandbox's
        cgroup is an rmdir per hierarchy (v1: ten), kernel time the event loop need not
        wait for. Tasks still leaving (EBUSY) get the patient retries on the loop. With
        pre-made cgroups, a cgroup that can be reused goes back to the pool instead
        (:meth:`CgroupPool.give_back`)."""
        pool = self._cgroup_pool()

        def drop() -> None:
            if pool is None or not pool.give_back(sandbox_id):
                self.cgroups.remove(sandbox_id, timeout=0)

        try:
            await in_thread(drop)
        except HostError as e:
            if "EBUSY" not in str(e):
                raise
            await self._remove_cgroup(sandbox_id)

    def _remove_files(self, sandbox_id: str) -> list[str]:
        """The end of a destroy in a worker thread: the namespace file, the writable layer
        and the sandbox dir, in that order; each failure is returned, the next still
        tried (a half-destroyed sandbox is worse)."""
        d = self.dir(sandbox_id)
        errors: list[str] = []
        steps: list[tuple[str, Callable[[], object]]] = [
            # Left mounted only by a node that died while the runtime was starting.
            ("userns file", lambda: drop_file(d / "userns")),
            ("writable layer", lambda: self.scratch.delete_subvol(sandbox_id)),
            ("dir", lambda: remove_sandbox_dir(d)),
            ("control socket", lambda: self.socket_path(sandbox_id).unlink(missing_ok=True)),
        ]
        for what, fn in steps:
            try:
                fn()
            except Exception as e:
                errors.append(f"{what}: {e}")
        return errors

    async def destroy(self, sandbox_id: str, image: ImageInfo | None) -> None:
        self._clients.pop(sandbox_id, None)
        self._fs.pop(sandbox_id, None)
        errors: list[str] = []

        async def step(what: str, fn: Callable[[], object]) -> None:
            try:
                r = fn()
                if hasattr(r, "__await__"):
                    await r  # type: ignore[misc]
            except Exception as e:  # keep going: a half-destroyed sandbox is worse
                errors.append(f"{what}: {e}")

        gone = await self.kill_all(sandbox_id)
        if gone:
            # Every process is gone: remove the runtime's record directly, saving a runtime
            # process per destroy; the cgroup goes after the files (below).
            await step("runtime state", lambda: self.runtime.forget_stopped(sandbox_id))
        else:
            await step("runtime delete", lambda: self.runtime.delete(sandbox_id, force=True))
            await step("cgroup", lambda: self._remove_cgroup(sandbox_id))
        root = self.rootfs(sandbox_id)

        async def umount_root() -> None:
            if not self.host_mounted_root and not mounts.is_mountpoint(root):
                # Its rootfs went with its mount namespace (no host mount; only a sandbox
                # adopted from a node before that change has one).
                return
            try:
                mounts.umount(root)  # the usual case: nothing holds the overlay any more
            except HostError:
                # Busy: host-side file operations still inside. Their wait (up to 1 s, then
                # a lazy detach) must not stall every other request on the event loop.
                await asyncio.to_thread(mounts.umount, root, detach=True, busy_wait=1.0)

        await step("rootfs umount", umount_root)
        # The sandbox's files go in one worker thread: a btrfs subvolume delete waits for
        # the filesystem (~1 ms wall, a fraction of it CPU), and the event loop serves the
        # other requests meanwhile (destroys at a concurrency were serialised on it).
        errors.extend(await in_thread(self._remove_files, sandbox_id))
        if gone:
            # After the writable layer: the page cache of its files, charged to the
            # sandbox's memory cgroup, went with it, and a cgroup the pool may take back
            # holds only what the sandbox really left (CgroupPool.give_back).
            await step("cgroup", lambda: self._remove_cgroup_off_loop(sandbox_id))
        if image is not None:
            for digest in image.layers:
                await step(f"layer {digest[:19]}", functools.partial(self.layers.release, digest))
        if not errors:  # else processes (and so the namespace) may live on: keep the owner
            self._release_owner(sandbox_id)
        if errors:
            raise HostError(f"sandbox {sandbox_id} destroy left problems: " + "; ".join(errors))

    # ------------------------------------------------------------------ snapshot, fork
    async def copy_writable(
        self, sandbox_id: str, dst: str, frozen: Freezer, purpose: CopyPurpose
    ) -> float:
        """Snapshot the sandbox's subvolume as ``dst`` with its processes frozen, so no
        write is caught half done (a write(2) in flight finishes before its task freezes).

        A btrfs snapshot first writes out the subvolume's dirty data (~1 s for 500 MiB just
        written). A throwaway snapshot taken beforehand, while the sandbox runs, does that
        writeback, so the frozen one only flushes what came since: the sandbox stays frozen
        for milliseconds. A ``fork`` copy is then reduced to a fork base (the scrubbed
        upper, an empty work dir, the rootfs mountpoint). Returns the seconds held frozen.
        """
        scratch = self.scratch
        await in_thread(scratch.snapshot, sandbox_id, dst, None)
        await in_thread(scratch.delete_subvol, dst)
        t0 = asyncio.get_running_loop().time()
        async with frozen():
            scratch.snapshot(sandbox_id, dst, None)
        held = asyncio.get_running_loop().time() - t0
        if purpose == "fork":
            await in_thread(_reset_base, scratch.mountpoint / dst)
        return held

    async def pack(self, work: str, *, source: str, max_bytes: int) -> LayerInfo:
        """The copy's upper, scrubbed of corral's own files, as a new EROFS layer; its
        files' owners mapped back from the sandbox's range (an inverse idmapped mount)."""
        inverse = UserNamespace.create(self.host_uid, self.id_count, inverse=True)
        try:
            return await in_thread(
                functools.partial(
                    pack_upper,
                    self.ctx.store,
                    self.scratch.mountpoint / work / "upper",
                    inverse=inverse,
                    mount_dir=self.ctx.state_dir / "pack" / work,
                    source=source,
                    max_bytes=max_bytes,
                )
            )
        finally:
            inverse.close()


def _reset_base(d: Path) -> None:
    """Turn a snapshot of a sandbox dir into a fork base: only the upper (scrubbed of
    corral's files), an empty work dir and the rootfs mountpoint stay."""
    for entry in os.scandir(d):
        if entry.name in _KEEP:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    scrub(d / "upper")
    # Overlay's work dir may hold a half-done copy-up of the parent's: start empty.
    work = d / "work"
    st = os.lstat(work)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(work)
    work.mkdir()


def _eager_resolver(store: LayerStore, local: Path) -> Callable[[str], Path]:
    """Benchmark baseline: copy a layer to node-local disk before its first mount."""
    local.mkdir(parents=True, exist_ok=True)

    def resolve(digest: str) -> Path:
        dst = local / (digest.split(":", 1)[1] + ".erofs")
        if not dst.exists():
            tmp = dst.with_suffix(".tmp")
            shutil.copyfile(store.path_of(digest), tmp)
            os.replace(tmp, dst)
        return dst

    return resolve


def _pidfd_kill(
    pid: int, in_cgroup: Callable[[int], bool] | None = None, keep: bool = False
) -> int | None:
    """SIGKILL ``pid`` through a pidfd; with ``in_cgroup``, only if, once the pidfd pins
    the process, it is still in the sandbox's cgroup (the pid may have been reused). With
    ``keep``, the pidfd of a process signalled is returned (the caller closes it)."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return None
    sent = False
    try:
        if in_cgroup is None or in_cgroup(pid):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            sent = True
    except (ProcessLookupError, OSError, HostError):
        pass
    finally:
        if not (keep and sent):
            os.close(fd)
    return fd if keep and sent else None


class _Made:
    """What a create holds only until its sandbox has started: the detached rootfs
    overlay's fd, the listening control socket (their copies live in the sandbox) and the
    cgroup.procs files the launcher joins. Closed at most once, by the create's undo or
    its end, whichever comes first."""

    def __init__(self) -> None:
        self.root_fd = -1
        self.lsock: socket.socket | None = None
        self.procs: tuple[list[Path], list[Path]] | None = None

    def close_root(self) -> None:
        fd, self.root_fd = self.root_fd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        self.close_root()
        if self.lsock is not None:
            self.lsock.close()


def remove_sandbox_dir(d: Path) -> None:
    """Remove a sandbox dir without ever descending into a still-mounted rootfs."""
    drop_file(d / "userns")  # a namespace bind left by a node that died mid-create
    for name in ("config.json", "ctl.sock"):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()
    with contextlib.suppress(FileNotFoundError):
        (d / "rootfs").rmdir()  # fails (and so keeps guest data) if still mounted
    with contextlib.suppress(FileNotFoundError):
        d.rmdir()


if TYPE_CHECKING:  # mypy checks the engine against the protocol the node uses

    def _conforms(b: ContainerBackend) -> Backend:
        return b


def _check_room(mountpoint: Path) -> None:
    """Raise ENOSPC (the node answers ScratchFull) when the scratch filesystem has less than
    ``_MIN_SCRATCH_ROOM`` free for data."""
    st = os.statvfs(mountpoint)
    free = st.f_bavail * st.f_frsize
    if free < _MIN_SCRATCH_ROOM:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: {free} bytes free on {mountpoint}, "
            f"under the {_MIN_SCRATCH_ROOM >> 20} MiB a new sandbox needs",
        )
