"""Full-VM sandboxes with a display (``backend="vm"``): the microVM engine on a PC
machine, for computer-use agents.

Everything but the machine is the microVM engine's (:class:`MicroVMBackend`, reused by
subclassing): the sandbox dir and writable disk, the cgroup, the jailed QEMU
(trampoline, ``-chroot``, ``-runas``, seccomp), corral-init as PID 1 over virtio-serial,
exec/files/pause through the same paths. What differs:

- the machine (:mod:`.machine`): ``-M q35`` with std VGA at the requested size, virtio
  keyboard and tablet, a QMP socket; the generic Debian kernel (the cloud kernel has no
  DRM) and an initramfs with PCI, display and input drivers;
- with ``spec.desktop``, create ends by starting the X session through the agent
  (:mod:`.session`) and returns once a terminal runs on the screen;
- :meth:`VMBackend.screen` gives the node the VM's screenshots and input (:mod:`.screen`).
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

from corral.backends.base import Backend, HostContext, NoPhases, Phases, Started
from corral.backends.config import VMConfig
from corral.backends.microvm import guest, qemu
from corral.backends.microvm.backend import MicroVMBackend
from corral.backends.vm import machine, session
from corral.backends.vm.screen import Screen
from corral.errors import HostError, SandboxError
from corral.init import ensure_built
from corral.spec import BackendStatus, Desktop, ImageInfo, SandboxSpec

__all__ = ["VMBackend"]

_HEADLESS = Desktop()
"""The display size of a VM created without a desktop (no X session: the text console)."""


class VMBackend(MicroVMBackend):
    """The full-VM engine (see the module docstring); implements
    :class:`corral.backends.base.Backend`."""

    kind = "vm"

    def __init__(self, config: VMConfig, ctx: HostContext) -> None:
        super().__init__(config, ctx)
        self.config: VMConfig = config
        self._dir = ctx.state_dir / "vm"
        self._screens: dict[str, Screen] = {}

    async def _prepare(self) -> None:
        kdir = self.config.kernel_dir or self._dir / "kernel"
        if self.config.fetch_kernel:
            self.kernel = await asyncio.to_thread(guest.fetch_kernel, kdir, machine.KERNEL_PACKAGE)
        else:
            self.kernel = guest.find_kernel(kdir)
            if self.kernel is None:
                raise HostError(
                    f"vm: no kernel under {kdir} (boot/vmlinuz-* with lib/modules/*) "
                    "and fetch_kernel is off"
                )
        init = await asyncio.to_thread(ensure_built, self.ctx.state_dir / "bin")
        self.initrd = await asyncio.to_thread(
            guest.build_initramfs, self.kernel, init, self._dir, machine.MODULES
        )
        if self.config.accel != "auto":
            self._accel, self.accel_detail = self.config.accel, "configured"
            return
        cache = self._dir / f"accel-{self.kernel.version}"
        try:
            self._accel, _, self.accel_detail = cache.read_text().partition("\n")
        except OSError:
            self._accel, self.accel_detail = await qemu.probe_accel(
                self.kernel.vmlinuz, self.initrd
            )
            cache.write_text(f"{self._accel}\n{self.accel_detail}")

    def status(self) -> BackendStatus:
        s = super().status()
        detail = {**s.detail, "display": "VGA (QMP screendump)", "layers": "virtio-blk"}
        return s.model_copy(update={"detail": detail})

    def _vm_argv(self, files: qemu.VMFiles, spec: SandboxSpec, mem_mib: int, uid: int) -> list[str]:
        size = spec.desktop or _HEADLESS
        return machine.vm_argv(
            files,
            qmp=files.disk.parent / "qmp.sock",
            accel=self._accel,
            cpus=max(1, math.ceil(spec.limits.cpus)),
            memory_mib=mem_mib,
            runas=f"{uid}:{uid}",
            width=size.width,
            height=size.height,
            dns=self._resolver(),
            hostname=spec.hostname,
            tb_mib=self.config.tcg_tb_mib,
        )

    async def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        *,
        writable_from: str | None = None,
        phases: Phases = NoPhases(),
    ) -> Started:
        started = await super().create(
            sandbox_id, spec, image, writable_from=writable_from, phases=phases
        )
        if spec.desktop is None:
            return started
        try:
            with phases.phase("desktop"):
                await self._start_session(sandbox_id, spec.desktop)
        except BaseException:
            await self.destroy(sandbox_id, image)
            raise
        return started

    async def _start_session(self, sandbox_id: str, desktop: Desktop) -> None:
        """Run the X session's start script in the guest; SandboxError with its output
        (the X server's log tail) when it fails."""
        t = self.config.boot_timeout
        r = await self.agent(sandbox_id).exec(
            [
                "/bin/sh",
                "-c",
                session.START,
                "corral-desktop",
                str(desktop.width),
                str(desktop.height),
            ],
            env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
            timeout=t,
        )
        if r.reason != "exited" or r.code != 0:
            out = (r.stdout + r.stderr).decode(errors="replace").strip()[-1500:]
            raise SandboxError(
                f"sandbox {sandbox_id}: the desktop did not start ({r.reason} {r.code or r.signal}, "
                f"accel {self._accel}): {out or '(no output)'}"
            )

    def screen(self, sandbox_id: str, spec: SandboxSpec) -> Screen:
        """The VM's display and input devices (QMP)."""
        s = self._screens.get(sandbox_id)
        if s is None:
            size = spec.desktop or _HEADLESS
            s = self._screens[sandbox_id] = Screen(self.dir(sandbox_id), size.width, size.height)
        return s

    async def destroy(self, sandbox_id: str, image: ImageInfo | None) -> None:
        self._screens.pop(sandbox_id, None)
        await super().destroy(sandbox_id, image)


if TYPE_CHECKING:  # mypy checks the engine against the protocol the node uses

    def _conforms(b: VMBackend) -> Backend:
        return b
