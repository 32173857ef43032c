"""MicroVM sandboxes: one QEMU ``-M microvm`` per sandbox, corral-init as the guest's PID 1.

Create, in order (each step undone if a later one fails):
  1. the sandbox dir: a btrfs subvolume with the disk quota, holding the writable disk
     (a sparse ext4 image the size of the disk limit, made here with mkfs), the console
     log, QEMU's control socket ``vm.sock`` (the node's ``ctl.sock`` is in ``.ctl/``,
     see :meth:`MicroVMBackend.ctl_path`);
  2. the sandbox's cgroup (the guest's memory plus QEMU's overhead, its cpus, a pids cap);
  3. QEMU, through a trampoline that enters that cgroup and a network namespace of its own
     first (:mod:`.qemu`); it daemonizes once its sockets exist, then drops to the VMM uid;
  4. the host multiplexer (:mod:`.vmux`) connected to ``vm.sock``, serving ``ctl.sock``;
  5. the first ping through it, within ``boot_timeout`` (else: the console's last lines
     in the error, the VMM killed, nothing left).

The image's EROFS layers are given to the guest read-only straight from the layer store's
files (one host page cache with every container using them): mapped as pmem for DAX
(:mod:`.dax`), or as virtio-blk disks where that cannot be laid out. Memory the guest frees
goes back to the host (free page reporting, see :mod:`.qemu`).

Network: QEMU's netns (made by the trampoline) holds a tap NATed to the ``eth0`` the node
attaches there, as for a container (see :mod:`.qemu`); a holder process keeps that netns
and is the pid the node knows the sandbox by. Pause: the node's shared cgroup freeze, or
:meth:`MicroVMBackend.pause_memory` (QEMU migrates the machine into ``mem.snap`` and ends;
the first request, or :meth:`MicroVMBackend.restore_memory`, starts it again from the file).
Fork: the machine is migrated into the fork copy with the disk (:meth:`copy_writable`),
each child restored from it (:meth:`_create_fork`). Snapshot to a store layer: the
writable layer is an ext4 image the host never mounts, so the guest streams its overlay
upper dir (bound read-only at ``/.corral/upper`` by the initramfs) out through the agent
as a tar (``/.corral/tar``), the node unpacks it with its own checks into a scratch
subvolume and packs that as containers do (:meth:`_copy_upper`, :meth:`pack`), the
guest's processes frozen meanwhile by the guest itself (:mod:`.freeze`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    run_undo,
)
from corral.backends.config import MicroVMConfig
from corral.backends.initclient import InitClient
from corral.backends.microvm import dax, freeze, guest, hostcache, qemu
from corral.backends.microvm.files import AgentFiles
from corral.backends.microvm.qmp import Qmp
from corral.backends.microvm.vmux import HostMux
from corral.errors import BuildError, Conflict, HostError, SandboxError
from corral.images.pack import pack_tree
from corral.images.uppertar import unpack_upper
from corral.init import ensure_built, ensure_nothp_built
from corral.policy import qos
from corral.spec import BackendStatus, ImageInfo, LayerInfo, SandboxSpec

__all__ = ["MicroVMBackend"]

log = logging.getLogger("corral.backends.microvm")

_PIDS = 256  # QEMU's threads: vCPUs, I/O workers, RCU; the guest's processes are its own


class MicroVMBackend:
    """The microVM engine (see the module docstring); implements
    :class:`corral.backends.base.Backend`."""

    kind = "microvm"
    memory_snapshots = True

    def __init__(self, config: MicroVMConfig, ctx: HostContext) -> None:
        self.config = config
        self.ctx = ctx
        self.cgroups = ctx.cgroups
        self.scratch = ctx.scratch
        self.sandboxes_dir = ctx.scratch.mountpoint
        self._dir = ctx.state_dir / "microvm"
        self._mux: dict[str, HostMux] = {}
        # One restore at a time per sandbox: resume() and a request's wake (the mux) may
        # both start one; the second waits and finds the VMM running.
        self._restoring: dict[str, asyncio.Lock] = {}
        self._clients: dict[str, InitClient] = {}
        self._cgroup_base: dict[str, dict[str, float]] = {}
        """sandbox -> what its recycled cgroups counted (:meth:`_recycle_cgroup`)."""
        self._recycles: dict[str, asyncio.Future[int | None]] = {}
        """sandbox -> its cgroup recycle in progress (a destroy waits for it: else it could
        remove the cgroup the recycle then makes again, with the holder in it)."""
        self._started = False
        self._accel = ""
        """``kvm`` or ``tcg`` once :meth:`start` knows (config, cached probe or a probe boot)."""
        self.accel_detail = ""
        self._no_thp: Path | None = None
        """corral-nothp, built at :meth:`start` when QEMU is to run without THP (:attr:`_thp`)."""
        self.kernel: guest.Kernel | None = None
        self.boot_kernel: Path | None = None
        """What QEMU boots: the kernel's uncompressed ELF for a PVH boot where it has one
        (:func:`.guest.pvh_kernel`), else its bzImage."""
        self.initrd: Path | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.broken = ""
        """Why this engine cannot create sandboxes (a missing kernel...); empty when it can."""

    # ------------------------------------------------------------------ node-wide
    async def start(self) -> None:
        """Find (or fetch) the kernel, build corral-init and the initramfs, pick the
        accelerator (a probe boot under KVM, cached per kernel in the state dir)."""
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        self._dir.mkdir(parents=True, exist_ok=True)
        try:
            await self._prepare()
            if not self._thp:
                self._no_thp = await asyncio.to_thread(
                    ensure_nothp_built, self.ctx.state_dir / "bin"
                )
            await asyncio.to_thread(self._charge_shared_files)
        except HostError as e:
            # The node runs on (its other engines are fine); this one says why it cannot.
            self.broken = e.message
            log.warning("microvm backend unavailable: %s", e.message)
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.ctl_path("x").parent.mkdir(mode=0o700, exist_ok=True)
        self._started = True

    async def _prepare(self) -> None:
        kdir = self.config.kernel_dir or self._dir / "kernel"
        if self.config.fetch_kernel:
            self.kernel = await asyncio.to_thread(guest.fetch_kernel, kdir)
        else:
            self.kernel = guest.find_kernel(kdir)
            if self.kernel is None:
                raise HostError(
                    f"microvm: no kernel under {kdir} (boot/vmlinuz-* with lib/modules/*) "
                    "and fetch_kernel is off"
                )
        init = await asyncio.to_thread(ensure_built, self.ctx.state_dir / "bin")
        self.initrd = await asyncio.to_thread(guest.build_initramfs, self.kernel, init, self._dir)
        pvh = await asyncio.to_thread(guest.pvh_kernel, self.kernel, self._dir)
        self.boot_kernel = pvh or self.kernel.vmlinuz
        if self.config.accel != "auto":
            self._accel, self.accel_detail = self.config.accel, "configured"
        else:
            cache = self._dir / f"accel-{self.kernel.version}"
            try:
                self._accel, _, self.accel_detail = cache.read_text().partition("\n")
            except OSError:
                self._accel, self.accel_detail = await qemu.probe_accel(
                    self.kernel.vmlinuz, self.initrd
                )
                cache.write_text(f"{self._accel}\n{self.accel_detail}")

    def _charge_shared_files(self) -> None:
        """QEMU, its libraries, the kernel and the initramfs into the page cache from the
        node's cgroup, not the first VM's (:mod:`.hostcache`)."""
        files = hostcache.vmm_files(qemu.QEMU)
        if self.kernel is not None:
            files.append(self.kernel.vmlinuz)
        if self.boot_kernel is not None and self.boot_kernel not in files:
            files.append(self.boot_kernel)
        if self.initrd is not None:
            files.append(self.initrd)
        hostcache.charge_to_node(files)

    async def stop(self, keep_running: bool) -> None:
        """Disconnect from every VM (they keep running for the next node process to
        adopt; without ``keep_running`` the node has destroyed its sandboxes first)."""
        self._started = False
        for mux in list(self._mux.values()):
            await mux.close()
        self._mux.clear()
        self._clients.clear()

    async def recovered(self) -> None:
        """Nothing node-wide is held per VM."""

    async def settle(self, timeout: float) -> bool:
        """Nothing is prepared in the background."""
        return True

    async def gc(self, live: set[str]) -> dict[str, int]:
        """VMMs, cgroups and sandbox dirs of no live sandbox (the container engine's gc
        removes the same kinds of leftovers by the same rule; whichever runs first)."""
        removed = {"vmms": 0, "cgroups": 0, "subvols": 0}
        for name in self.cgroups.list():
            if name not in live and self._is_vm_dir(name):
                await self.kill_all(name)
                self.cgroups.remove(name)
                removed["cgroups"] += 1
                removed["vmms"] += 1
        for name in self.scratch.subvols():
            if name not in live and name.startswith("sb-") and self._is_vm_dir(name):
                await self.kill_all(name)
                self.scratch.delete_subvol(name)
                removed["subvols"] += 1
        ctl = self.ctl_path("x").parent
        if ctl.exists():  # the container engine's gc applies the same rule to this dir
            for sock in ctl.iterdir():
                if sock.name.endswith(".sock") and sock.name[: -len(".sock")] not in live:
                    sock.unlink(missing_ok=True)
        return removed

    def _is_vm_dir(self, name: str) -> bool:
        return (self.dir(name) / "disk.img").exists()

    def status(self) -> BackendStatus:
        detail = {"error": self.broken} if self.broken else {}
        return BackendStatus(
            kind=self.kind,
            ok=self._started and not self.broken,
            accel=self.accel,
            detail={
                "kernel": self.kernel.version if self.kernel else "",
                "accel_detail": self.accel_detail,
                "layers": "dax, virtio-blk fallback" if self.config.dax else "virtio-blk",
                "network": "tap+nat in the VMM netns",
                "pause": "freeze, memory_snapshot",
                "fork": "memory + disk",
                **detail,
            },
        )

    # ------------------------------------------------------------------ paths, handles
    def dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def ctl_path(self, sandbox_id: str) -> Path:
        """The node's control socket of a VM (the multiplexer listens there; every request
        connects to it): in the scratch's one ``.ctl`` dir, as the container engine's
        (``ContainerBackend.ctl_dir``), not in the sandbox's own subvolume, where every
        VM's socket had the same inode number and so the same bucket of the kernel's
        unix socket table, walked by every connect. An adopted VM's multiplexer
        listens here too (it is the node's socket, made again at each start)."""
        return self.sandboxes_dir / ".ctl" / f"{sandbox_id}.sock"

    def agent(self, sandbox_id: str) -> InitClient:
        c = self._clients.get(sandbox_id)
        if c is None:
            c = self._clients[sandbox_id] = InitClient(self.ctl_path(sandbox_id))
        return c

    def files(self, sandbox_id: str) -> AgentFiles:
        assert self._loop is not None
        return AgentFiles(self.agent(sandbox_id), self._loop)

    def meters(self, sandbox_id: str) -> Meters:
        return CgroupMeters(self.ctx, sandbox_id, self._base_of(sandbox_id))

    def _base_of(self, sandbox_id: str) -> dict[str, float]:
        """The counters of the sandbox's earlier cgroups (from its ``cgroup.json``)."""
        base = self._cgroup_base.get(sandbox_id)
        if base is None:
            base = self._cgroup_base[sandbox_id] = _read_json(
                self.dir(sandbox_id) / _CGROUP_FILE
            ).get("base", {})
        return base

    def vmm_pid(self, sandbox_id: str) -> int | None:
        """QEMU's pid (its -pidfile), if it is still a process of the sandbox's cgroup."""
        try:
            pid = int((self.dir(sandbox_id) / "vmm.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            if pid not in self.cgroups.procs(sandbox_id):
                return None  # gone, and the pid maybe reused by someone else
        except Exception:
            return None
        return pid

    def alive(self, sandbox_id: str) -> bool:
        """The VMM runs, or the VM is saved to a memory snapshot (its netns holder runs)."""
        if _running(self.vmm_pid(sandbox_id)):
            return True
        if not self.held_in_snapshot(sandbox_id):
            return False
        try:  # a VMM just ended by a save or a failed restore may still be a zombie
            return _running(self._holder(sandbox_id))
        except SandboxError:
            return False

    # ------------------------------------------------------------------ lifecycle
    async def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        *,
        writable_from: str | None = None,
        phases: Phases = NoPhases(),
    ) -> Started:
        if not self._started:
            raise HostError("microvm backend not started")
        if self.broken:
            raise HostError(f"microvm backend unavailable: {self.broken}")
        undo: list[Callable[[], object]] = []
        try:
            if writable_from is not None:
                await self._create_fork(sandbox_id, spec, image, writable_from, undo, phases)
            else:
                await self._create(sandbox_id, spec, image, undo, phases)
            return Started(
                pid=self._holder(sandbox_id),
                cgroup=sandbox_id,
                layer_access=self._layer_access(sandbox_id),
            )
        except BaseException:
            await run_undo(undo)
            raise

    async def _create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        undo: list[Callable[[], object]],
        phases: Phases,
    ) -> None:
        assert self.kernel is not None and self.initrd is not None
        d = self.dir(sandbox_id)
        with phases.phase("layer_mounts"):
            layers = [self.ctx.store.path_of(digest) for digest in image.layers]
        with phases.phase("rootfs"):
            undo.append(lambda: self.scratch.delete_subvol(sandbox_id))
            await asyncio.to_thread(self.scratch.create_subvol, sandbox_id, quota=spec.limits.disk)
            # QEMU's chroot: the VMM uid may look names up here but not list the dir, and
            # owns only its writable disk (a migration's end reopens it by name, as that
            # uid); the node's sockets and the snapshot file stay root's, 0600.
            os.chmod(d, 0o711)
            await asyncio.to_thread(_make_disk, d / "disk.img", int(spec.limits.disk))
            # Safe: chown of the file just made in the sandbox's own subvolume.
            os.chown(d / "disk.img", self._uid, self._uid)
            os.chmod(d / "disk.img", 0o600)
        latency = spec.qos == "latency"
        self.cgroups.create(
            sandbox_id,
            cpus=spec.limits.cpus,
            memory=int(spec.limits.memory) + self.config.memory_overhead,
            pids=_PIDS,
            latency=latency,
        )
        undo.append(lambda: self.cgroups.remove(sandbox_id))
        undo.append(lambda: self.kill_all(sandbox_id))
        files = qemu.VMFiles(
            kernel=self.boot_kernel or self.kernel.vmlinuz,
            initrd=self.initrd,
            layers=layers,
            disk=d / "disk.img",
            console=d / "console.log",
            vm_sock=d / "vm.sock",
            pidfile=d / "vmm.pid",
            mac=qemu.mac_of(sandbox_id),
            qmp_sock=d / "qmp.sock",
        )
        argv = self._vm_argv(files, spec, max(64, int(spec.limits.memory) >> 20), self._uid)
        # a restore starts the same VM
        (d / "vm.json").write_text(json.dumps({"argv": argv, "qos": spec.qos}))
        run, env = qemu.trampoline(
            self.cgroups.procs_files(sandbox_id),
            argv,
            uid=self._uid,
            holder_file=d / "netns.pid",
            no_thp=self._no_thp,
        )
        with phases.phase("runtime_start"):
            # Safe: QEMU with corral's own argv (no shell splicing: the trampoline passes
            # "$@"), in the sandbox's cgroup and a new netns, dropping to an unprivileged
            # uid under its seccomp sandbox. -daemonize: this returns once it is set up.
            await _start_qemu(run, env, d, f"sandbox {sandbox_id}: QEMU did not start")
            pid = self.vmm_pid(sandbox_id)
            if pid is None:
                raise SandboxError(f"sandbox {sandbox_id}: QEMU started but is not running")
            qos.apply(pid, spec.qos)
            mux = self._new_mux(sandbox_id)
            await mux.start()
            self._mux[sandbox_id] = mux
            undo.append(lambda: self._drop_mux(sandbox_id))
        with phases.phase("init_ready"):
            await self._boot_wait(sandbox_id)

    @property
    def accel(self) -> str | None:
        """The accelerator the VMs run under; None until :meth:`start` found it."""
        return self._accel or None

    @property
    def _thp(self) -> bool:
        """Back guest RAM with host huge pages: under KVM (the guest's memory accesses go
        through 2 MiB mappings), not under TCG, where they buy nothing and keep freed
        guest memory held (corral-nothp, see :func:`.qemu.trampoline`)."""
        return self._accel != "tcg"

    @property
    def _uid(self) -> int:
        return self.config.vmm_uid or self.ctx.host_uid - 1

    def _vm_argv(self, files: qemu.VMFiles, spec: SandboxSpec, mem_mib: int, uid: int) -> list[str]:
        """QEMU's command line, run with the sandbox dir as its cwd (a subclass with another
        machine overrides this; a restore reuses what it returned, from ``vm.json``). The
        layers go as pmem for DAX when the config allows and :func:`.dax.plan` finds a
        layout (a fork's children get the same one: same layers, memory and initramfs)."""
        if self.config.dax and files.layers and self.initrd is not None:
            sizes = [(p, p.stat().st_size) for p in files.layers]
            files = dataclasses.replace(
                files, dax=dax.plan(sizes, mem_mib, self.initrd.stat().st_size)
            )
        return qemu.vm_argv(
            files,
            accel=self._accel,
            cpus=max(1, math.ceil(spec.limits.cpus)),
            memory_mib=mem_mib,
            runas=f"{uid}:{uid}",
            dns=self._resolver(),
            hostname=spec.hostname,
            tb_mib=self.config.tcg_tb_mib,
            tracefs=self.config.guest_tracefs,
            # 4 KiB blocks where guest RAM is in 4 KiB host pages (TCG, see _thp): with
            # 2 MiB ones the guest's free memory in smaller pieces, and all of its DMA
            # zone (16 MiB, under the reporting watermark of 32 blocks), is never returned
            report_order=None if self._thp else 0,
        )

    def _layer_access(self, sandbox_id: str) -> str:
        """``dax`` if the VM's command line maps its layers as pmem, else ``virtio-blk``."""
        try:
            argv = json.loads((self.dir(sandbox_id) / "vm.json").read_text())["argv"]
        except (OSError, ValueError, KeyError):
            return "virtio-blk"
        return "dax" if any("corral.dax=1" in a for a in argv) else "virtio-blk"

    def _resolver(self) -> str | None:
        """The nameserver the node gives containers (its resolv.conf mount), if any."""
        for m in self.ctx.extra_mounts:
            if m.get("destination") == "/etc/resolv.conf":
                with contextlib.suppress(OSError):
                    for line in Path(str(m["source"])).read_text().splitlines():
                        if line.startswith("nameserver "):
                            return line.split()[1]
        return None

    def _holder(self, sandbox_id: str) -> int:
        """The pid holding the VMM's network namespace (the node plugs its veth in there;
        it outlives QEMU across a memory-snapshot pause)."""
        try:
            pid = int((self.dir(sandbox_id) / "netns.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            raise SandboxError(f"sandbox {sandbox_id}: the VMM's netns holder is gone") from None
        if pid not in self.cgroups.procs(sandbox_id):
            raise SandboxError(f"sandbox {sandbox_id}: the VMM's netns holder is gone")
        return pid

    async def _boot_wait(self, sandbox_id: str) -> None:
        """The guest's first answer, within boot_timeout; else SandboxError with the
        console's last lines (the caller's undo kills the VMM)."""
        t = self.config.boot_timeout
        client = InitClient(self.ctl_path(sandbox_id), connect_timeout=t)
        try:
            async with asyncio.timeout(t):  # the client's own guard adds a margin
                await client.ping()
            return
        except SandboxError as e:
            why = str(e)
        except TimeoutError:
            why = "no answer to ping"
        console = self.dir(sandbox_id) / "console.log"
        tail = ""
        with contextlib.suppress(OSError):
            lines = console.read_bytes()[-4096:].decode(errors="replace").splitlines()
            tail = " | ".join(x.strip() for x in lines[-5:] if x.strip())
        gone = "" if self.alive(sandbox_id) else " (the VMM exited)"
        raise SandboxError(
            f"sandbox {sandbox_id}: the microVM's agent did not answer within {t:g} s "
            f"(accel {self._accel}){gone}: {why}; VMM killed; console: {tail or '(empty)'}"
        )

    async def _drop_mux(self, sandbox_id: str) -> None:
        self._clients.pop(sandbox_id, None)
        mux = self._mux.pop(sandbox_id, None)
        self._restoring.pop(sandbox_id, None)
        if mux is not None:
            await mux.close()

    async def adopt(self, sandbox_id: str, image: ImageInfo) -> Started | None:
        """Reconnect to a running VM after a node restart (QEMU is free for a new client
        once the old node's connection closed); a VM saved to a memory snapshot gets its
        listener back and is restored on its first request."""
        await asyncio.to_thread(self._finish_recycle, sandbox_id)
        if not self.alive(sandbox_id):
            return None
        saved = self.vmm_pid(sandbox_id) is None
        mux = self._new_mux(sandbox_id)
        try:
            await mux.start(attach=not saved)
        except SandboxError as e:
            log.warning("adopt %s: %s", sandbox_id, e)
            return None
        self._mux[sandbox_id] = mux
        try:
            return Started(
                pid=self._holder(sandbox_id),
                cgroup=sandbox_id,
                layer_access=self._layer_access(sandbox_id),
            )
        except SandboxError as e:
            log.warning("adopt %s: %s", sandbox_id, e)
            await self._drop_mux(sandbox_id)
            return None

    async def kill_all(self, sandbox_id: str, wait: float = 5.0) -> bool:
        """SIGKILL every process of the sandbox's cgroup (QEMU and whatever it left) and
        wait until it is empty. True once it was seen empty."""
        with contextlib.suppress(Exception):
            if self.cgroups.is_frozen(sandbox_id):
                self.cgroups.thaw(sandbox_id, timeout=1.0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            try:
                left = self.cgroups.procs(sandbox_id)
            except Exception:
                return False
            if not left:
                return True
            if loop.time() > deadline:
                return False
            for p in left:
                _pidfd_kill(p, lambda q: q in self.cgroups.procs(sandbox_id))
            await asyncio.sleep(0.01)

    async def destroy(self, sandbox_id: str, image: ImageInfo | None) -> None:
        errors: list[str] = []
        await self._drop_mux(sandbox_id)
        self._cgroup_base.pop(sandbox_id, None)
        recycle = self._recycles.get(sandbox_id)
        with contextlib.suppress(Exception):
            if recycle is not None:
                await asyncio.shield(recycle)
            # a recycle cut short: its processes back where kill_all finds them
            await asyncio.to_thread(self._finish_recycle, sandbox_id)
        if not await self.kill_all(sandbox_id) and self.cgroups.exists(sandbox_id):
            errors.append("VMM: processes left in the cgroup after SIGKILL")
        for what, fn in (
            ("cgroup", lambda: self.cgroups.remove(sandbox_id)),
            ("writable disk", lambda: self.scratch.delete_subvol(sandbox_id)),
        ):
            try:
                fn()
            except Exception as e:  # keep going: a half-destroyed sandbox is worse
                errors.append(f"{what}: {e}")
        if errors:
            raise HostError(f"sandbox {sandbox_id} destroy left problems: " + "; ".join(errors))

    # ------------------------------------------------------------------ memory snapshots
    def held_in_snapshot(self, sandbox_id: str) -> bool:
        """The VM is saved to its memory snapshot file (the VMM gone until a request)."""
        return (self.dir(sandbox_id) / _SNAP).exists()

    def _new_mux(self, sandbox_id: str) -> HostMux:
        d = self.dir(sandbox_id)
        return HostMux(
            d / "vm.sock", self.ctl_path(sandbox_id), wake=lambda: self.restore_memory(sandbox_id)
        )

    async def pause_memory(self, sandbox_id: str, timeout: float = 300.0) -> dict[str, object]:
        """Save the VM's whole state (devices, memory) to ``mem.snap`` in the sandbox dir
        and end the VMM: nothing of the guest stays in host memory (the file's page cache
        is dropped too). The node keeps listening on the sandbox's control socket; the
        next request (or :meth:`restore_memory`) brings the VM back from the file. Returns figures
        for the node's ``paused`` event."""
        d = self.dir(sandbox_id)
        pid = self.vmm_pid(sandbox_id)
        if pid is None:
            raise SandboxError(f"sandbox {sandbox_id}: no VMM to save")
        t0 = time.monotonic()
        tmp = d / (_SNAP + ".tmp")
        # Safe: a new file in the sandbox's own dir (root's, 0700), handed to QEMU by fd.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        mux = self._mux.get(sandbox_id)
        if mux is not None:
            mux.hold()  # a request arriving now waits for the save, then restores
        try:
            stats = await asyncio.to_thread(_save, d / "qmp.sock", fd, timeout)
            os.fsync(fd)
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            with contextlib.suppress(Exception):  # the guest runs on as before
                await asyncio.to_thread(_qmp_cont, d / "qmp.sock")
            if mux is not None:
                mux.release()
            raise
        os.close(fd)
        os.replace(tmp, d / _SNAP)
        if mux is not None:
            await mux.detach()
        # QEMU quits on its own after "quit"; a VMM that lingers is killed (the state is
        # saved): only QEMU, not the netns holder.
        _pidfd_kill(pid, lambda q: q in self.cgroups.procs(sandbox_id))
        while self.vmm_pid(sandbox_id) is not None:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(_drop_own_cache, d)
        # before the release: a waiting request restores QEMU into the new cgroup
        recycle = self._recycles[sandbox_id] = asyncio.ensure_future(
            asyncio.to_thread(self._recycle_cgroup, sandbox_id)
        )
        recycle.add_done_callback(lambda _: self._recycles.pop(sandbox_id, None))
        recycled = await asyncio.shield(recycle)
        if mux is not None:
            mux.release()
        return {
            "memory_snapshot": True,
            "snapshot_bytes": size,
            "recycled_cgroup_bytes": recycled,
            "save_ms": round((time.monotonic() - t0) * 1000, 1),
            "migrate_ms": stats.get("total-time"),
        }

    def _recycle_cgroup(self, sandbox_id: str) -> int | None:
        """Once the VMM is gone: the sandbox's memory cgroup made anew
        (:meth:`.Cgroups.recycle`), so what is still charged to it goes to the parent, as
        at a destroy. That is the page cache of the layer files this VM read first (the
        store's files, which the other VMs and containers using the layer map: no reclaim
        can drop it while they do) and the holder's kernel memory. What the counters lost
        with the old cgroup (CPU time, OOM kills, refused forks: what fell) goes into
        ``cgroup.json`` so the meters go on from it. Returns the bytes the old cgroup held
        (None: it could not be done; the pause stands)."""
        d = self.dir(sandbox_id)
        try:
            settings = self.cgroups.settings(sandbox_id)
            base = self._base_of(sandbox_id)
            # the settings first: a node that dies half-way finishes from them (adopt)
            _write_json(d / _CGROUP_FILE, {"settings": settings, "base": base})
            before = _counters(CgroupMeters(self.ctx, sandbox_id))
            held = self.cgroups.recycle(sandbox_id, settings)
            after = _counters(CgroupMeters(self.ctx, sandbox_id))
            base = {k: base.get(k, 0) + max(0, before[k] - after[k]) for k in before}
            _write_json(d / _CGROUP_FILE, {"settings": settings, "base": base})
            self._cgroup_base[sandbox_id] = base
            return held
        except (HostError, OSError) as e:  # the pause worked; only the accounting is worse
            log.warning("recycling the cgroup of paused %s: %s", sandbox_id, e)
            with contextlib.suppress(HostError, OSError):
                self._finish_recycle(sandbox_id)
            return None

    def _finish_recycle(self, sandbox_id: str) -> None:
        """Complete a :meth:`_recycle_cgroup` that was cut short (the node died in it, or a
        step failed): the cgroup made again with its settings, the holder moved back."""
        tmp = self.cgroups.recycling(sandbox_id)
        if tmp is None:
            return
        settings = _read_json(self.dir(sandbox_id) / _CGROUP_FILE).get("settings", {})
        log.warning("finishing the cgroup recycle of %s", sandbox_id)
        self.cgroups.finish_recycle(sandbox_id, settings, tmp)

    async def restore_memory(
        self, sandbox_id: str, timeout: float = 300.0, new_netns: bool = False
    ) -> float:
        """Start the VMM again from ``mem.snap`` (same machine, same netns and disks); the
        snapshot file is removed once the guest runs. Returns the seconds it took. A
        corrupt or missing snapshot is a SandboxError naming it (the VMM killed, and gone
        before it returns; the snapshot file kept)."""
        lock = self._restoring.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            return await self._restore(sandbox_id, timeout, new_netns)

    async def _restore(self, sandbox_id: str, timeout: float, new_netns: bool) -> float:
        d = self.dir(sandbox_id)
        if self.vmm_pid(sandbox_id) is not None:
            return 0.0
        snap = d / _SNAP
        if not snap.exists():
            raise SandboxError(f"sandbox {sandbox_id}: no memory snapshot to restore")
        t0 = time.monotonic()
        vm = json.loads((d / "vm.json").read_text())
        argv = [*vm["argv"], "-incoming", "defer"]
        run, env = qemu.trampoline(
            self.cgroups.procs_files(sandbox_id),
            argv,
            uid=self._uid,
            holder_file=d / "netns.pid",
            join_netns=None if new_netns else self._holder(sandbox_id),
            no_thp=self._no_thp,
        )
        # Safe: QEMU with the argv this backend wrote at create, joining the sandbox's
        # netns and cgroup (see create()).
        await _start_qemu(run, env, d, f"sandbox {sandbox_id}: QEMU did not start for the restore")
        fd = os.open(snap, os.O_RDONLY | os.O_CLOEXEC)
        try:
            await asyncio.to_thread(_load, d / "qmp.sock", fd, timeout)
        except BaseException as e:
            pid = self.vmm_pid(sandbox_id)
            if pid is not None:
                _pidfd_kill(pid, lambda q: q in self.cgroups.procs(sandbox_id))
                while self.vmm_pid(sandbox_id) is not None:  # gone before the error is
                    await asyncio.sleep(0.01)  # seen: the sandbox is saved, not half up
            if isinstance(e, SandboxError):
                raise SandboxError(
                    f"sandbox {sandbox_id}: restore from {snap.name} failed: {e}"
                ) from None
            raise
        finally:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        snap.unlink()
        pid = self.vmm_pid(sandbox_id)
        if pid is not None:
            qos.apply(pid, vm["qos"])
        mux = self._mux.get(sandbox_id)
        if mux is not None and not mux.connected:
            await mux.attach()
        return time.monotonic() - t0

    # ------------------------------------------------------------------ snapshot, fork
    async def copy_writable(
        self, sandbox_id: str, dst: str, frozen: Freezer, purpose: CopyPurpose
    ) -> float:
        """Snapshot: the guest's upper dir, streamed out by its agent (:meth:`_copy_upper`).
        Fork: the whole machine. QEMU stops the guest and migrates it into ``fork.snap``
        in the sandbox dir, the subvolume (writable disk + that file) is snapshotted as
        ``dst``, and the guest goes on (``cont``). Returns the seconds it was stopped. A VM
        saved by a memory-snapshot pause is copied as it is. (``frozen`` is not used: QMP
        cannot talk to a frozen QEMU; ``stop`` is the freeze.)"""
        if purpose == "snapshot":
            return await self._copy_upper(sandbox_id, dst)
        d = self.dir(sandbox_id)
        scratch = self.scratch
        if self.held_in_snapshot(sandbox_id):
            await in_thread(scratch.snapshot, sandbox_id, dst, None)
            os.replace(scratch.mountpoint / dst / _SNAP, scratch.mountpoint / dst / _FORK)
            return 0.0
        if self.cgroups.is_frozen(sandbox_id):
            raise Conflict(
                f"sandbox {sandbox_id} is paused (frozen): resume it, or pause it with "
                "memory_snapshot=True, before forking a microVM"
            )
        t0 = time.monotonic()
        # Safe: a new file in the sandbox's own dir (root's), handed to QEMU by fd.
        fd = os.open(d / _FORK, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            await asyncio.to_thread(_save, d / "qmp.sock", fd, 300.0, False)
            os.fsync(fd)
            await in_thread(scratch.snapshot, sandbox_id, dst, None)
        finally:
            os.close(fd)
            (d / _FORK).unlink(missing_ok=True)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(_qmp_cont, d / "qmp.sock")
        return time.monotonic() - t0

    async def _create_fork(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        base: str,
        undo: list[Callable[[], object]],
        phases: Phases,
    ) -> None:
        """A child from a fork copy: its subvolume a snapshot of ``base`` (the parent's
        disk and machine state), a netns and tap of its own, QEMU restored from the state,
        then its own identity (MAC, hostname, a reseeded random pool) set through the agent."""
        d = self.dir(sandbox_id)
        with phases.phase("rootfs"):
            undo.append(lambda: self.scratch.delete_subvol(sandbox_id))
            await in_thread(self.scratch.snapshot, base, sandbox_id, spec.limits.disk)
            for stale in (
                "vmm.pid",
                "netns.pid",
                "console.log",
                "ctl.sock",
                "qmp.sock",
                "vm.sock",
                _CGROUP_FILE,  # the parent's counters
            ):
                (d / stale).unlink(missing_ok=True)
            os.replace(d / _FORK, d / _SNAP)
        self.cgroups.create(
            sandbox_id,
            cpus=spec.limits.cpus,
            memory=int(spec.limits.memory) + self.config.memory_overhead,
            pids=_PIDS,
            latency=spec.qos == "latency",
        )
        undo.append(lambda: self.cgroups.remove(sandbox_id))
        undo.append(lambda: self.kill_all(sandbox_id))
        assert self.kernel is not None and self.initrd is not None
        layers = [self.ctx.store.path_of(digest) for digest in image.layers]
        files = qemu.VMFiles(
            kernel=self.boot_kernel or self.kernel.vmlinuz,
            initrd=self.initrd,
            layers=layers,
            disk=d / "disk.img",
            console=d / "console.log",
            vm_sock=d / "vm.sock",
            pidfile=d / "vmm.pid",
            mac=qemu.mac_of(sandbox_id),
            qmp_sock=d / "qmp.sock",
        )
        argv = self._vm_argv(files, spec, max(64, int(spec.limits.memory) >> 20), self._uid)
        # the parent's command line (its vm.json, in the copy): the migrated state has its
        # devices, so a parent started before free page reporting gives children without
        try:
            parent = json.loads((d / "vm.json").read_text())["argv"]
        except (OSError, ValueError, KeyError):
            parent = argv
        argv = qemu.devices_as_in(argv, parent)
        (d / "vm.json").write_text(json.dumps({"argv": argv, "qos": spec.qos}))
        mux = self._new_mux(sandbox_id)
        with phases.phase("runtime_start"):
            await mux.start(attach=False)
            self._mux[sandbox_id] = mux
            undo.append(lambda: self._drop_mux(sandbox_id))
            await self.restore_memory(sandbox_id, new_netns=True)
        with phases.phase("init_ready"):
            await self._boot_wait(sandbox_id)
            mac = files.mac
            script = (
                "B=/.corral/busybox; $B cat > /dev/urandom; "
                f"$B ip link set eth0 down; $B ip link set eth0 address {mac}; "
                f"$B ip link set eth0 up; $B ip route add default via {qemu.GUEST_NET[0]} "
                f"2>/dev/null; $B hostname {spec.hostname}"
            )
            r = await self.agent(sandbox_id).exec(
                ["/.corral/busybox", "sh", "-c", script], env={}, stdin=os.urandom(512)
            )
            if r.code != 0:
                raise SandboxError(
                    f"sandbox {sandbox_id}: fork identity not set: {r.stderr[-300:]!r}"
                )

    async def _copy_upper(self, sandbox_id: str, dst: str) -> float:
        """The guest's overlay upper dir into ``dst/upper`` (a new scratch subvolume):
        the guest's ``/.corral/tar`` (corral-tar) writes it as a tar to the agent's stdout,
        the node keeps the stream in ``dst/upper.tar`` and unpacks it with its own checks
        (:func:`corral.images.uppertar.unpack_upper`: the archive is the guest's, so
        untrusted). The host never mounts the guest's disk.

        The guest's user processes are frozen meanwhile by the guest itself (its cgroup2
        freezer, :mod:`.freeze`: QMP ``stop`` would stop the agent too), thawed when the
        stream ends, and by a second exec if the stream was cut. Returns 0.0 (the host
        held nothing frozen)."""
        if self.held_in_snapshot(sandbox_id) or self.cgroups.is_frozen(sandbox_id):
            raise Conflict(
                f"sandbox {sandbox_id} is paused: resume it before a snapshot of a microVM "
                "(its agent streams the files out)"
            )
        disk = (self.dir(sandbox_id) / "disk.img").stat().st_size
        # tar framing: 512 B per entry (1.5 KiB with a pax header) on top of the data; an
        # ext4 disk of this size holds at most one inode per 16 KiB
        limit = 2 * disk + (64 << 20)
        work = await in_thread(self.scratch.create_subvol, dst, None)
        os.chmod(work, 0o700)  # setuid files of the guest's: no one else may reach them
        archive = work / "upper.tar"
        err = bytearray()
        got = 0
        stream = self.agent(sandbox_id).stream(
            freeze.snapshot_argv(_TAR, _UPPER),
            env={"PATH": "/usr/bin:/bin"},
            output_limit=limit,
            timeout=_SNAPSHOT_TIMEOUT,
            keep_output=False,
        )
        ended = False
        try:
            # Safe: a new file in the node's own new scratch subvolume.
            with open(archive, "wb") as f:
                async with stream:
                    async for kind, data in stream:
                        if kind == "stdout":
                            got += len(data)
                            await asyncio.to_thread(f.write, data)
                        elif len(err) < 4096:
                            err += data[: 4096 - len(err)]
            ended = stream.result.reason == "exited"
        finally:
            if not ended:  # killed (no trap ran in the guest) or cut: thaw from outside
                await self._thaw_guest(sandbox_id)
        r = stream.result
        if r.reason == "output_limit" or got > limit:
            raise SandboxError(
                f"snapshot of {sandbox_id}: the guest's upper dir streamed more than "
                f"{limit} bytes (its disk is {disk}); refused"
            )
        if r.reason != "exited" or r.code != 0:
            raise SandboxError(
                f"snapshot of {sandbox_id}: streaming the guest's upper dir failed "
                f"({r.reason}, code {r.code}): {bytes(err).decode(errors='replace')[-500:]}"
            )

        def unpack() -> None:
            try:
                with open(archive, "rb") as f:
                    unpack_upper(f, work / "upper", max_bytes=disk, id_count=self.ctx.id_count)
            finally:
                archive.unlink(missing_ok=True)

        try:
            await in_thread(unpack)
        except BuildError as e:
            raise SandboxError(f"snapshot of {sandbox_id}: {e.message}") from None
        except OSError as e:  # e.g. the scratch fs full, or a name past PATH_MAX
            raise HostError(
                f"snapshot of {sandbox_id}: unpacking the guest's files failed: {e}"
            ) from None
        return 0.0

    async def _thaw_guest(self, sandbox_id: str) -> None:
        """Undo a snapshot's freeze in the guest (:data:`.freeze.THAW`); a guest that
        cannot be reached is logged (its next snapshot thaws first)."""
        try:
            r = await self.agent(sandbox_id).exec(freeze.thaw_argv(), env={}, timeout=60)
            if r.code != 0:
                log.warning("thaw of %s after a snapshot: %r", sandbox_id, r.stderr[-300:])
        except Exception as e:  # the stream's own error is the one to report
            log.warning("thaw of %s after a snapshot failed: %s", sandbox_id, e)

    async def pack(self, work: str, *, source: str, max_bytes: int) -> LayerInfo:
        """The guest's upper dir, unpacked by :meth:`_copy_upper` (owners already the
        guest's own ids, image-relative), as a new EROFS layer: the same mkfs path as a
        container's snapshot."""
        return await in_thread(
            functools.partial(
                pack_tree,
                self.ctx.store,
                self.scratch.mountpoint / work / "upper",
                id_count=self.ctx.id_count,
                source=source,
                max_bytes=max_bytes,
            )
        )


_SNAP = "mem.snap"
_CGROUP_FILE = "cgroup.json"  # settings and counters of recycled cgroups (_recycle_cgroup)
_SNAPSHOT_TIMEOUT = 600.0  # seconds for the guest to stream its upper dir out
_TAR = "/.corral/tar"  # corral-tar in the guest (the initramfs puts it there)
_UPPER = "/.corral/upper"  # the guest's overlay upper dir, bound read-only
_FORK = "fork.snap"  # the machine state in a fork copy (mem.snap in each child)


def _save(qmp_sock: Path, fd: int, timeout: float, quit: bool = True) -> dict[str, object]:
    """Stop the guest, migrate its state into ``fd``, quit QEMU unless not ``quit`` (then
    the guest stays stopped for the caller to ``cont``). Blocking: run in a thread."""
    with Qmp(qmp_sock) as q:
        _ignore_shared(q)
        q.cmd("stop")
        q.cmd("getfd", fds=[fd], fdname="snap")
        q.cmd("migrate", uri="fd:snap")
        stats = q.wait_migration(timeout)
        if quit:
            q.cmd("quit")
    return stats


def _load(qmp_sock: Path, fd: int, timeout: float) -> None:
    """Feed ``fd`` to a QEMU started with ``-incoming defer``; wait until the guest runs."""
    with Qmp(qmp_sock) as q:
        _ignore_shared(q)
        q.cmd("getfd", fds=[fd], fdname="snap")
        q.cmd("migrate-incoming", uri="fd:snap")
        q.wait_migration(timeout)
        # the source was stopped before it was saved, so the state arrives stopped
        if q.cmd("query-status").get("status") != "running":
            q.cmd("cont")
        q.wait_status("running", timeout)


def _ignore_shared(q: Qmp) -> None:
    """Leave shared memory (the DAX-mapped layer files) out of the state file: it is the
    store's file, there again on restore (read-only, so restoring into it would fail)."""
    q.cmd(
        "migrate-set-capabilities",
        capabilities=[{"capability": "x-ignore-shared", "state": True}],
    )


def _qmp_cont(qmp_sock: Path) -> None:
    with Qmp(qmp_sock, timeout=5.0) as q:
        q.cmd("cont")


_OWN_FILES = ("disk.img", "console.log")
"""Files of the sandbox dir that QEMU writes and no one else reads (see _drop_own_cache)."""


def _drop_own_cache(d: Path) -> None:
    """Drop the host page cache of the files only this VM's QEMU wrote (:data:`_OWN_FILES`)
    once it has exited: that cache stays charged to the sandbox's cgroup after the VMM is
    gone (whatever the guest wrote to its disk: a guest that wrote 40 MiB kept 40 MiB
    charged), so a memory-snapshot pause would not release it. fsync first: dirty pages are not dropped
    (the end of the migration has flushed the disk already). Not the layer files: their
    cache is shared with every VM and container reading them."""
    for name in _OWN_FILES:
        try:
            fd = os.open(d / name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:  # the pause worked; only the accounting is worse
            log.warning("dropping the page cache of %s/%s: %s", d.name, name, e)
        finally:
            os.close(fd)


def _counters(m: CgroupMeters) -> dict[str, float]:
    """The cumulative counters of a sandbox's cgroups (what a recycle may reset)."""
    return {
        "cpu_seconds": m.cpu_seconds or 0.0,
        "oom_kills": m.oom_kills or 0,
        "pids_refused": m.pids_refused or 0,
    }


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; {} if it is missing or not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` into ``path`` whole or not at all (a temporary file renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    # Safe: a file of the node's in the sandbox's own dir (root's, 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _make_disk(path: Path, size: int) -> None:
    """A sparse ext4 image of ``size`` bytes (the guest's writable layer)."""
    with open(path, "wb") as f:
        f.truncate(size)
    # Safe: mkfs on a file we just created in the sandbox's own subvolume.
    r = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise HostError(f"microvm writable disk: mkfs.ext4 failed: {r.stderr.strip()[-300:]}")


def _running(pid: int | None) -> bool:
    """``pid`` is a process that has not exited (not a zombie)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _pidfd_kill(pid: int, in_cgroup: Callable[[int], bool]) -> None:
    """SIGKILL ``pid`` if, pinned by a pidfd, it is still in the sandbox's cgroup."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if in_cgroup(pid):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (OSError, HostError):
        pass
    finally:
        os.close(fd)


if TYPE_CHECKING:  # mypy checks the engine against the protocol the node uses

    def _conforms(b: MicroVMBackend) -> Backend:
        return b


async def _start_qemu(run: list[str], env: dict[str, str], cwd: Path, failed: str) -> None:
    """Run the trampoline (QEMU with -daemonize: it returns once the VM is set up); a
    SandboxError starting with ``failed`` and QEMU's last output if it did not start."""
    proc = await asyncio.create_subprocess_exec(
        *run,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=cwd,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxError(
            f"{failed} (exit {proc.returncode}): " + out.decode(errors="replace").strip()[-1000:]
        )
