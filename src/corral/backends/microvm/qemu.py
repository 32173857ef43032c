"""QEMU command lines for corral microVMs, and the accelerator probe.

One VM = one ``qemu-system-x86_64 -M microvm`` process, started ``-daemonize`` (so it
outlives the node process that started it and is adopted after a restart) through a
trampoline that first puts itself in the sandbox's cgroup and a network namespace of its
own, so every VMM thread and allocation is the sandbox's. QEMU opens every file it needs
(kernel, initramfs, layer files read-only, the writable disk, its sockets) before it
chroots into the sandbox dir (``-chroot``; root-owned, 0700) and drops to an unprivileged
uid (``-runas``); its seccomp filter (``-sandbox on``) forbids obsolete
syscalls and resource-control changes (not spawning or setuid: see ``_SANDBOX``).

Accelerator: this host's /dev/kvm is PVM, where a stock kernel hangs after the boot stub.
:func:`probe_accel` boots the guest kernel once with KVM in a probe mode (the initramfs
prints ``corral-probe-ok`` and powers off) and falls back to TCG if that line does not come.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from corral.errors import HostError

__all__ = ["QEMU", "VMFiles", "probe_accel", "vm_argv"]

QEMU = "qemu-system-x86_64"

# QEMU 7.2 installs its filter before it daemonizes (a fork) and drops to -runas (setuid),
# so spawn=deny and elevateprivileges=deny would kill it at start (SIGSYS, seen here).
_SANDBOX = "on,obsolete=deny,resourcecontrol=deny"


@dataclass(frozen=True)
class VMFiles:
    """What one VM's QEMU is given, all paths in the sandbox dir except the shared ones."""

    kernel: Path
    initrd: Path
    layers: list[Path]
    """The image's EROFS layer files, base first (the node's layer store)."""
    disk: Path
    console: Path
    vm_sock: Path
    pidfile: Path


def vm_argv(
    files: VMFiles,
    *,
    accel: str,
    cpus: int,
    memory_mib: int,
    runas: str | None,
    qemu: str = QEMU,
) -> list[str]:
    """The full QEMU command line of one VM."""
    append = f"console=ttyS0 quiet panic=-1 corral.layers={len(files.layers)}"
    if accel == "tcg":
        # TCG's TSC runs at the host's rate, but -M microvm has no HPET or PM timer to
        # calibrate it against and PIT calibration fails on a loaded host (seen: "tsc:
        # Marking TSC unstable", then the boot hangs): tell the guest the rate.
        khz = host_tsc_khz()
        if khz:
            append += f" tsc_early_khz={khz} tsc=reliable"
    argv = [
        qemu,
        "-M",
        "microvm,isa-serial=on",
        "-accel",
        "tcg,tb-size=64" if accel == "tcg" else accel,
        "-cpu",
        "max" if accel == "tcg" else "host",
        "-m",
        str(memory_mib),
        "-smp",
        str(cpus),
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-kernel",
        str(files.kernel),
        "-initrd",
        str(files.initrd),
        "-append",
        append,
        "-chardev",
        f"file,id=con,path={files.console}",
        "-serial",
        "chardev:con",
        "-device",
        "virtio-serial-device",
        "-chardev",
        f"socket,id=ctl,path={files.vm_sock},server=on,wait=off",
        "-device",
        "virtserialport,chardev=ctl,name=corral.ctl",
        "-sandbox",
        _SANDBOX,
        "-daemonize",
        "-pidfile",
        str(files.pidfile),
    ]
    for i, layer in enumerate(files.layers):
        # Shared read-only by every VM using the layer: no image locks.
        argv += [
            "-drive",
            f"id=l{i},file={layer},format=raw,if=none,readonly=on,file.locking=off",
            "-device",
            f"virtio-blk-device,drive=l{i},serial=l{i}",
        ]
    argv += [
        "-drive",
        f"id=rw,file={files.disk},format=raw,if=none,discard=unmap",
        "-device",
        "virtio-blk-device,drive=rw,serial=rw",
    ]
    # Everything is open by now: QEMU runs on in a root it cannot even list (the sandbox
    # dir, 0700 root), as the unprivileged uid, so no host path is reachable by name.
    argv += ["-chroot", str(files.disk.parent)]
    if runas is not None:
        argv += ["-runas", runas]
    return argv


def host_tsc_khz() -> int | None:
    """The host's TSC rate in kHz (the ``cpu MHz`` of /proc/cpuinfo), None if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def trampoline(procs_files: list[Path], argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` run by a shell that first moves itself into the cgroup (every
    ``cgroup.procs`` file given) and then into a new network namespace, so QEMU starts
    there and all its threads stay there. Returns the argv and the environment to run."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise HostError("microvm: unshare (util-linux) not found")
    script = 'for f in $CORRAL_PROCS; do echo $$ > "$f" || exit 125; done; exec "$@"'
    env_files = " ".join(str(p) for p in procs_files)
    if any(" " in str(p) for p in procs_files):
        raise HostError(f"microvm: cgroup path with a space: {env_files!r}")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CORRAL_PROCS": env_files}
    return ["/bin/sh", "-c", script, "corral-vmm", unshare, "--net", "--", *argv], env


async def probe_accel(kernel: Path, initrd: Path, timeout: float = 15.0) -> tuple[str, str]:
    """``("kvm", why)`` if the guest kernel boots under KVM here, else ``("tcg", why)``."""
    if not os.path.exists("/dev/kvm"):
        return "tcg", "no /dev/kvm"
    argv = [
        QEMU,
        *("-M", "microvm,isa-serial=on", "-accel", "kvm", "-cpu", "host", "-m", "256"),
        *("-nodefaults", "-no-user-config", "-nographic", "-no-reboot"),
        *("-kernel", str(kernel), "-initrd", str(initrd)),
        *("-append", "console=ttyS0 panic=-1 corral.probe=1", "-serial", "stdio"),
    ]
    # Safe: fixed QEMU argv with corral's own kernel and initramfs; killed on timeout.
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    seen = b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await proc.stdout.read(4096):
                seen = (seen + chunk)[-8192:]
                if b"corral-probe-ok" in seen:
                    return "kvm", "probe boot under kvm succeeded"
    except TimeoutError:
        return "tcg", f"probe boot under kvm gave no sign within {timeout:g} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
    tail = seen.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    return "tcg", f"probe boot under kvm failed: {tail[0][:200]}"
