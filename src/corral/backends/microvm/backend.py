"""MicroVM sandboxes: one QEMU ``-M microvm`` per sandbox, corral-init as the guest's PID 1.

Create, in order (each step undone if a later one fails):
  1. the sandbox dir: a btrfs subvolume with the disk quota, holding the writable disk
     (a sparse ext4 image the size of the disk limit, made here with mkfs), the console
     log, QEMU's control socket ``vm.sock`` and the node's ``ctl.sock``;
  2. the sandbox's cgroup (the guest's memory plus QEMU's overhead, its cpus, a pids cap);
  3. QEMU, through a trampoline that enters that cgroup and a network namespace of its own
     first (:mod:`.qemu`); it daemonizes once its sockets exist, then drops to the VMM uid;
  4. the host multiplexer (:mod:`.vmux`) connected to ``vm.sock``, serving ``ctl.sock``;
  5. the first ping through it, within ``boot_timeout`` (else: the console's last lines
     in the error, the VMM killed, nothing left).

The image's EROFS layers are given to the guest read-only as virtio-blk disks, straight
from the layer store's files (one host page cache with every container using them).
Pause/resume use the node's shared cgroup freeze (QEMU is in the sandbox's cgroup).
Not yet: virtio-pmem with DAX for the layers (why: docs/design-notes.md, "MicroVMs"),
network (a policy with names is refused), memory-snapshot pause, snapshot/fork/pack
(``copy_writable`` and ``pack`` refuse with InvalidRequest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

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
    run_undo,
)
from corral.backends.config import MicroVMConfig
from corral.backends.initclient import InitClient
from corral.backends.microvm import guest, qemu
from corral.backends.microvm.files import AgentFiles
from corral.backends.microvm.vmux import HostMux
from corral.errors import HostError, InvalidRequest, SandboxError
from corral.init import ensure_built
from corral.policy import qos
from corral.spec import BackendStatus, ImageInfo, LayerInfo, SandboxSpec

__all__ = ["MicroVMBackend"]

log = logging.getLogger("corral.backends.microvm")

_PIDS = 256  # QEMU's threads: vCPUs, I/O workers, RCU; the guest's processes are its own


class MicroVMBackend:
    """The microVM engine (see the module docstring); implements
    :class:`corral.backends.base.Backend`."""

    kind = "microvm"

    def __init__(self, config: MicroVMConfig, ctx: HostContext) -> None:
        self.config = config
        self.ctx = ctx
        self.cgroups = ctx.cgroups
        self.scratch = ctx.scratch
        self.sandboxes_dir = ctx.scratch.mountpoint
        self._dir = ctx.state_dir / "microvm"
        self._mux: dict[str, HostMux] = {}
        self._clients: dict[str, InitClient] = {}
        self._started = False
        self.accel = ""
        self.accel_detail = ""
        self.kernel: guest.Kernel | None = None
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
        except HostError as e:
            # The node runs on (its other engines are fine); this one says why it cannot.
            self.broken = e.message
            log.warning("microvm backend unavailable: %s", e.message)
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
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
        if self.config.accel != "auto":
            self.accel, self.accel_detail = self.config.accel, "configured"
        else:
            cache = self._dir / f"accel-{self.kernel.version}"
            try:
                self.accel, _, self.accel_detail = cache.read_text().partition("\n")
            except OSError:
                self.accel, self.accel_detail = await qemu.probe_accel(
                    self.kernel.vmlinuz, self.initrd
                )
                cache.write_text(f"{self.accel}\n{self.accel_detail}")

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
        return removed

    def _is_vm_dir(self, name: str) -> bool:
        return (self.dir(name) / "disk.img").exists()

    def status(self) -> BackendStatus:
        detail = {"error": self.broken} if self.broken else {}
        return BackendStatus(
            kind=self.kind,
            ok=self._started and not self.broken,
            accel=self.accel or None,
            detail={
                "kernel": self.kernel.version if self.kernel else "",
                "accel_detail": self.accel_detail,
                "layers": "virtio-blk",
                **detail,
            },
        )

    # ------------------------------------------------------------------ paths, handles
    def dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def agent(self, sandbox_id: str) -> InitClient:
        c = self._clients.get(sandbox_id)
        if c is None:
            c = self._clients[sandbox_id] = InitClient(self.dir(sandbox_id) / "ctl.sock")
        return c

    def files(self, sandbox_id: str) -> AgentFiles:
        assert self._loop is not None
        return AgentFiles(self.agent(sandbox_id), self._loop)

    def meters(self, sandbox_id: str) -> Meters:
        return CgroupMeters(self.ctx, sandbox_id)

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
        pid = self.vmm_pid(sandbox_id)
        if pid is None:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in (b"Z", b"X")

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
        if writable_from is not None:
            raise InvalidRequest("fork: not yet for microvm sandboxes")
        if spec.network.allow:
            raise InvalidRequest("network: not yet for microvm sandboxes (default: none)")
        undo: list[Callable[[], object]] = []
        try:
            pid = await self._create(sandbox_id, spec, image, undo, phases)
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
        phases: Phases,
    ) -> int:
        assert self.kernel is not None and self.initrd is not None
        d = self.dir(sandbox_id)
        with phases.phase("layer_mounts"):
            layers = [self.ctx.store.path_of(digest) for digest in image.layers]
        with phases.phase("rootfs"):
            undo.append(lambda: self.scratch.delete_subvol(sandbox_id))
            await asyncio.to_thread(self.scratch.create_subvol, sandbox_id, quota=spec.limits.disk)
            os.chmod(d, 0o700)
            await asyncio.to_thread(_make_disk, d / "disk.img", int(spec.limits.disk))
        latency = spec.qos == "latency"
        mem_mib = max(64, int(spec.limits.memory) >> 20)
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
            kernel=self.kernel.vmlinuz,
            initrd=self.initrd,
            layers=layers,
            disk=d / "disk.img",
            console=d / "console.log",
            vm_sock=d / "vm.sock",
            pidfile=d / "vmm.pid",
        )
        uid = self.config.vmm_uid or self.ctx.host_uid - 1
        argv = self._vm_argv(files, spec, mem_mib, uid)
        run, env = qemu.trampoline(self.cgroups.procs_files(sandbox_id), argv)
        with phases.phase("runtime_start"):
            # Safe: QEMU with corral's own argv (no shell splicing: the trampoline passes
            # "$@"), in the sandbox's cgroup and a new netns, dropping to an unprivileged
            # uid under its seccomp sandbox. -daemonize: this returns once it is set up.
            proc = await asyncio.create_subprocess_exec(
                *run,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            out, _ = await proc.communicate()
            if proc.returncode != 0:
                raise SandboxError(
                    f"sandbox {sandbox_id}: QEMU did not start (exit {proc.returncode}): "
                    + out.decode(errors="replace").strip()[-1000:]
                )
            pid = self.vmm_pid(sandbox_id)
            if pid is None:
                raise SandboxError(f"sandbox {sandbox_id}: QEMU started but is not running")
            qos.apply(pid, spec.qos)
            mux = HostMux(d / "vm.sock", d / "ctl.sock")
            await mux.start()
            self._mux[sandbox_id] = mux
            undo.append(lambda: self._drop_mux(sandbox_id))
        with phases.phase("init_ready"):
            await self._boot_wait(sandbox_id)
        return pid

    def _vm_argv(self, files: qemu.VMFiles, spec: SandboxSpec, mem_mib: int, uid: int) -> list[str]:
        """QEMU's command line (the full-VM backend, corral.backends.vm, overrides this)."""
        return qemu.vm_argv(
            files,
            accel=self.accel,
            cpus=max(1, math.ceil(spec.limits.cpus)),
            memory_mib=mem_mib,
            runas=f"{uid}:{uid}",
        )

    async def _boot_wait(self, sandbox_id: str) -> None:
        """The guest's first answer, within boot_timeout; else SandboxError with the
        console's last lines (the caller's undo kills the VMM)."""
        t = self.config.boot_timeout
        client = InitClient(self.dir(sandbox_id) / "ctl.sock", connect_timeout=t)
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
            f"(accel {self.accel}){gone}: {why}; VMM killed; console: {tail or '(empty)'}"
        )

    async def _drop_mux(self, sandbox_id: str) -> None:
        self._clients.pop(sandbox_id, None)
        mux = self._mux.pop(sandbox_id, None)
        if mux is not None:
            await mux.close()

    async def adopt(self, sandbox_id: str, image: ImageInfo) -> Started | None:
        """Reconnect to a running VM after a node restart (QEMU is free for a new client
        once the old node's connection closed)."""
        if not self.alive(sandbox_id):
            return None
        pid = self.vmm_pid(sandbox_id)
        assert pid is not None
        mux = HostMux(self.dir(sandbox_id) / "vm.sock", self.dir(sandbox_id) / "ctl.sock")
        try:
            await mux.start()
        except SandboxError as e:
            log.warning("adopt %s: %s", sandbox_id, e)
            return None
        self._mux[sandbox_id] = mux
        return Started(pid=pid, cgroup=sandbox_id)

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

    # ------------------------------------------------------------------ not yet
    async def copy_writable(
        self, sandbox_id: str, dst: str, frozen: Freezer, purpose: CopyPurpose
    ) -> float:
        raise InvalidRequest(f"{purpose}: not yet for microvm sandboxes")

    async def pack(self, work: str, *, source: str, max_bytes: int) -> LayerInfo:
        raise InvalidRequest("snapshot: not yet for microvm sandboxes")


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
