"""The full VM's machine: QEMU ``-M q35`` with a standard VGA display, virtio input and
QMP, booting the generic Debian kernel with the microVM's initramfs and corral-init.

Why not ``-M microvm``: it has no PCI display. Why the generic ``linux-image-amd64``
rather than the cloud kernel: the cloud kernel is built without DRM (no ``bochs``
driver for the VGA, no framebuffer an X server could use).

Display: ``-device VGA`` with ``xres``/``yres`` puts the requested size in the EDID the
guest's ``bochs`` driver reads, so the X server's preferred mode is the desktop's size.
Input: ``virtio-tablet-pci`` (absolute pointer: QMP ``abs`` events land where asked) and
``virtio-keyboard-pci``; ``i8042=off`` so no PS/2 device competes for QMP's key and
button events. QMP listens on ``qmp.sock`` in the sandbox dir (made before QEMU chroots
and drops to its uid); screendumps go to a memfd passed over it (:mod:`.screen`), so
the jail gains no writable path.
"""

from __future__ import annotations

from pathlib import Path

from corral.backends.microvm import qemu

__all__ = ["KERNEL_PACKAGE", "MODULES", "vm_argv"]

KERNEL_PACKAGE = "linux-image-amd64"

MODULES = (
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "virtio_net",  # the NIC on the sandbox's network (a tap in the VMM's netns)
    "crc32c_generic",  # ext4 and erofs checksums (crypto API, not a modules.dep entry)
    "ext4",
    "erofs",
    "overlay",
    "virtio_input",
    "evdev",
    "bochs",
)
"""Modules the initramfs loads (dependencies first, from modules.dep)."""


def vgamem_mb(width: int, height: int) -> int:
    """Video memory for a 32-bit frame of ``width`` x ``height`` twice over (the guest may
    flip between two buffers), a power of two, at least QEMU's default 16 MiB."""
    need = (width * height * 4 * 2 + (1 << 20) - 1) >> 20
    mb = 16
    while mb < need:
        mb *= 2
    return mb


def vm_argv(
    files: qemu.VMFiles,
    *,
    qmp: Path,
    accel: str,
    cpus: int,
    memory_mib: int,
    runas: str | None,
    width: int,
    height: int,
    binary: str = qemu.QEMU,
    dns: str | None = None,
    hostname: str | None = None,
    tb_mib: int = 64,
) -> list[str]:
    """The full QEMU command line of one desktop VM (same files, jail and network as a
    microVM: the tap the trampoline made in the VMM's netns, see qemu.vm_argv)."""
    append = f"console=ttyS0 quiet panic=-1 corral.layers={len(files.layers)}"
    if files.mac:
        tap_addr, guest_addr, prefix = qemu.GUEST_NET
        append += f" corral.net={guest_addr}/{prefix},{tap_addr}"
    if dns:
        append += f" corral.dns={dns}"
    if hostname:
        append += f" corral.hostname={hostname}"
    if accel == "tcg":
        khz = qemu.host_tsc_khz()  # as for microVMs: no calibration on a loaded host
        if khz:
            append += f" tsc_early_khz={khz} tsc=reliable"
    argv = [
        binary,
        *("-M", "q35,i8042=off"),
        *("-accel", f"tcg,tb-size={tb_mib}" if accel == "tcg" else accel),
        *("-cpu", "max" if accel == "tcg" else "host"),
        *("-m", str(memory_mib), "-smp", str(cpus)),
        *("-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"),
        *("-kernel", str(files.kernel), "-initrd", str(files.initrd), "-append", append),
        *("-chardev", f"file,id=con,path={files.console}", "-serial", "chardev:con"),
        *("-device", "virtio-serial-pci"),
        *("-chardev", f"socket,id=ctl,path={files.vm_sock},server=on,wait=off"),
        *("-device", "virtserialport,chardev=ctl,name=corral.ctl"),
        "-device",
        f"VGA,xres={width},yres={height},edid=on,vgamem_mb={vgamem_mb(width, height)}",
        *("-device", "virtio-keyboard-pci", "-device", "virtio-tablet-pci"),
        *("-qmp", f"unix:{qmp},server=on,wait=off"),
        *("-sandbox", qemu._SANDBOX, "-daemonize", "-pidfile", str(files.pidfile)),
    ]
    if files.mac:
        argv += [
            *("-netdev", f"tap,id=n0,ifname={qemu.TAP},script=no,downscript=no"),
            *("-device", f"virtio-net-pci,netdev=n0,mac={files.mac}"),
        ]
    for i, layer in enumerate(files.layers):
        argv += [
            "-drive",
            f"id=l{i},file={layer},format=raw,if=none,readonly=on,file.locking=off",
            "-device",
            f"virtio-blk-pci,drive=l{i},serial=l{i}",
        ]
    # the writable disk by its name in the sandbox dir, as for a microVM: the end of a
    # migration (memory-snapshot pause, fork) reopens it from inside QEMU's chroot
    argv += [
        *("-drive", f"id=rw,file={files.disk.name},format=raw,if=none,discard=unmap"),
        *("-device", "virtio-blk-pci,drive=rw,serial=rw"),
        *("-chroot", str(files.disk.parent)),
    ]
    if runas is not None:
        argv += ["-runas", runas]
    return argv
