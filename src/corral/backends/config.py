"""Backend configuration: a closed, discriminated union over the isolation engines.

``NodeConfig.backends`` lists the engines a node runs (``[[node.backends]]`` in TOML, each
with its ``kind``); the microVM issue adds ``MicroVMConfig`` (``kind = "microvm"``) and
``VMConfig`` to :data:`BackendConfig`.

Example:
    >>> ContainerConfig(runtime="runc").kind
    'container'
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BackendConfig", "ContainerConfig", "MicroVMConfig", "VMConfig"]


class ContainerConfig(BaseModel):
    """Container sandboxes: an OCI runtime, overlays of idmapped EROFS layers, corral-init."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["container"] = "container"
    runtime: Literal["auto", "launch", "runc", "crun"] = "auto"
    """How sandboxes start: ``launch`` is corral's own launcher (corral.host.launch, no OCI
    runtime per sandbox), picked by ``auto`` where the kernel supports it (5.12+,
    libseccomp); else, or when named, an OCI runtime (crun, runc)."""
    owner_uid: int | None = Field(None, ge=1)
    """First of the host uids that own sandbox user namespaces, one per sandbox (see
    corral.host.owners; nothing else on the host may use them); default
    ``host_uid + id_count``, right after the mapped range."""
    owner_uids: int = Field(65536, ge=1)
    """How many owner uids (at most that many container sandboxes on the host at once)."""


class MicroVMConfig(BaseModel):
    """MicroVM sandboxes: QEMU ``-M microvm``, a Debian cloud kernel, corral-init as PID 1
    over virtio-serial (corral.backends.microvm)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["microvm"] = "microvm"
    kernel_dir: Path | None = None
    """An extracted Debian kernel package (``boot/vmlinuz-*``, ``lib/modules/*``); default
    ``<state_dir>/microvm/kernel``, fetched there with apt-get on first start."""
    fetch_kernel: bool = True
    """Without a kernel in ``kernel_dir``, fetch one with apt-get (else the backend reports
    itself not ok and refuses creates, naming what is missing; the node runs on)."""
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    """``auto``: KVM if a probe boot succeeds (this node's /dev/kvm may not run a stock
    kernel), else TCG."""
    boot_timeout: float = Field(120.0, gt=0)
    """Seconds from QEMU's start to the guest agent's first answer (TCG boots take ~2-5 s
    on an idle host, far more under load); past it the VMM is killed."""
    vmm_uid: int | None = Field(None, ge=1)
    """Host uid QEMU drops to once it has opened its files; default ``host_uid - 1`` (below
    the range sandbox uids map to, used by nothing else)."""
    memory_overhead: int = Field(256 << 20, ge=0)
    """Bytes the sandbox's cgroup allows beyond the guest's memory (QEMU itself, its
    translation cache under TCG)."""
    tcg_tb_mib: int = Field(16, ge=1, le=2048)
    """TCG's translation cache per VM (QEMU ``tb-size``, MiB; ignored under KVM): host
    memory each VM holds once its guest has run that much code (an idle microVM filled
    56 of 64 MiB). Smaller re-translates more often (a flush when full: 8-9 over a boot
    and a 96 MiB read at 16; a boot perhaps ~3 s slower under load; docs/design-notes.md,
    "MicroVMs")."""
    guest_tracefs: bool = False
    """Keep the guest kernel's tracefs (ftrace and trace events under /sys/kernel/tracing).
    Off by default: the Debian 6.1 kernel builds every trace event's files at boot, 8.7
    MiB of slab that no page reporting can return (an idle microVM held 8 MiB more host
    memory with it; docs/design-notes.md, "MicroVMs"). Full VMs (``backend="vm"``) keep it."""
    dax: bool = True
    """Map the image layers into the guest as pmem and mount them with DAX (one host page
    cache, no copy in the guest) where the layout allows (corral.backends.microvm.dax);
    False: virtio-blk disks always (the baseline the bench compares against)."""


class VMConfig(MicroVMConfig):
    """Full-VM sandboxes with a display (corral.backends.vm): QEMU ``-M q35`` with std VGA
    and virtio input, the generic Debian kernel (``linux-image-amd64``: the cloud kernel
    has no DRM), an X session for ``spec.desktop``. The fields are the microVM's."""

    kind: Literal["vm"] = "vm"  # type: ignore[assignment]
    kernel_dir: Path | None = None
    """An extracted Debian kernel package; default ``<state_dir>/vm/kernel``, fetched
    there with apt-get on first start."""
    boot_timeout: float = Field(300.0, gt=0)
    """Seconds for the guest agent's first answer, and again for the X session to start
    (under TCG a desktop boot takes tens of seconds on an idle host)."""
    memory_overhead: int = Field(384 << 20, ge=0)
    """Bytes the sandbox's cgroup allows beyond the guest's memory (QEMU, its translation
    cache under TCG, the video memory)."""
    tcg_tb_mib: int = Field(64, ge=1, le=2048)
    """TCG's translation cache (MiB): a desktop runs far more code (Xorg, a window
    manager) than a microVM's agent; its smaller cache is not measured."""


BackendConfig = Annotated[
    Union[ContainerConfig, MicroVMConfig, VMConfig],  # noqa: UP007
    Field(discriminator="kind"),
]
