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
import hashlib
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from corral.backends.microvm.dax import DaxPlan
from corral.errors import HostError

__all__ = [
    "GUEST_NET",
    "QEMU",
    "TAP",
    "VMFiles",
    "devices_as_in",
    "mac_of",
    "probe_accel",
    "trampoline",
    "vm_argv",
]

QEMU = "qemu-system-x86_64"

TAP = "tap0"
"""The guest NIC's host end, in the VMM's network namespace."""
GUEST_NET = ("100.127.255.253", "100.127.255.254", 30)
"""(the tap's address, the guest's address, prefix): a link private to one VM's netns,
NATed there to the ``eth0`` the node attaches (so the guest's packets leave with the
sandbox's address, through the node's nft rules like a container's). From the CGNAT
range, which a node subnet is unlikely to overlap."""

# QEMU 7.2 installs its filter before it daemonizes (a fork) and drops to -runas (setuid),
# so spawn=deny and elevateprivileges=deny would kill it at start (SIGSYS, seen here).
_SANDBOX = "on,obsolete=deny,resourcecontrol=deny"

_BALLOON = "virtio-balloon-device,free-page-reporting=on"
"""Free page reporting, no balloon ever inflated (see :func:`vm_argv`)."""


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
    mac: str = ""
    """The guest NIC's MAC (its identity on the sandbox's network); empty: no NIC."""
    qmp_sock: Path | None = None
    """QEMU's QMP control socket (memory snapshots), in the sandbox dir."""
    incoming: bool = False
    """Start waiting for a migration stream (``-incoming defer``): a memory-snapshot restore."""
    dax: DaxPlan | None = None
    """Map the layers as pmem for DAX (:mod:`.dax`); None: virtio-blk disks."""


def vm_argv(
    files: VMFiles,
    *,
    accel: str,
    cpus: int,
    memory_mib: int,
    runas: str | None,
    qemu: str = QEMU,
    dns: str | None = None,
    hostname: str | None = None,
    tb_mib: int = 16,
    tracefs: bool = False,
    report_order: int | None = None,
) -> list[str]:
    """The full QEMU command line of one VM, to be run with the sandbox dir
    (``files.disk.parent``) as its working directory. ``dns``: the resolver the guest's
    /etc/resolv.conf names (the node's); ``hostname``: the guest's; ``tb_mib``: TCG's
    translation cache (MiB); ``tracefs``: keep the guest kernel's tracefs (see below);
    ``report_order``: the guest's free page reporting order (None: the kernel's, 2 MiB
    blocks; the initramfs sets it once the balloon driver is loaded)."""
    append = f"console=ttyS0 quiet panic=-1 corral.layers={len(files.layers)}"
    if report_order is not None:
        append += f" corral.report_order={report_order}"
    if not tracefs:
        # The 6.1 kernel makes a dentry and an inode for every file of every trace event
        # at boot (eventfs, which makes them on demand, came in 6.6): 8.7 MiB of pinned
        # slab in every guest, -8 MiB of host memory per idle VM when skipped. The
        # guest then has no /sys/kernel/tracing (no ftrace, no tracepoints by name).
        append += " initcall_blacklist=tracer_init_tracefs"
    if files.dax is not None:
        append += " corral.dax=1 " + " ".join(files.dax.kernel_args)
    if files.mac:
        tap_addr, guest_addr, prefix = GUEST_NET
        append += f" corral.net={guest_addr}/{prefix},{tap_addr}"
    if dns:
        append += f" corral.dns={dns}"
    if hostname:
        append += f" corral.hostname={hostname}"
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
        # pcie=on for DAX: the guest kernel inserts the pmem ranges in its PCI survey
        "microvm,isa-serial=on" + (",pcie=on" if files.dax is not None else ""),
        "-accel",
        f"tcg,tb-size={tb_mib}" if accel == "tcg" else accel,
        "-cpu",
        "max" if accel == "tcg" else "host",
        *(files.dax.argv if files.dax is not None else ["-m", str(memory_mib)]),
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
        # Free page reporting: the guest hands 2 MiB blocks it frees (the unpacked
        # initramfs after switch_root, the boot's transient allocations, page cache it
        # drops) back to QEMU, which discards them (MADV_DONTNEED): a freed guest page
        # stops counting on the host. Only guest RAM is ever reported (the DAX layer
        # ranges are not the guest allocator's).
        "-device",
        _BALLOON,
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
    if files.mac:
        # The tap the trampoline made in the VMM's netns (see trampoline()); QEMU opens it
        # before it chroots and drops to the VMM uid (the tap is that uid's).
        argv += [
            "-netdev",
            f"tap,id=n0,ifname={TAP},script=no,downscript=no",
            "-device",
            f"virtio-net-device,netdev=n0,mac={files.mac}",
        ]
    if files.qmp_sock is not None:
        argv += ["-qmp", f"unix:{files.qmp_sock},server=on,wait=off"]
    if files.incoming:
        argv += ["-incoming", "defer"]
    for i, layer in enumerate(files.layers if files.dax is None else []):
        # Shared read-only by every VM using the layer: no image locks.
        argv += [
            "-drive",
            f"id=l{i},file={layer},format=raw,if=none,readonly=on,file.locking=off",
            "-device",
            f"virtio-blk-device,drive=l{i},serial=l{i}",
        ]
    # The writable disk by a path relative to the sandbox dir (QEMU's cwd, then its
    # chroot): when a migration (memory snapshot) ends, QEMU reopens the writable disk
    # read-only, by name, from inside the chroot; an absolute host path is not there.
    argv += [
        "-drive",
        f"id=rw,file={files.disk.name},format=raw,if=none,discard=unmap",
        "-device",
        "virtio-blk-device,drive=rw,serial=rw",
    ]
    # Everything is open by now: QEMU runs on in a root it cannot even list (the sandbox
    # dir, 0700 root), as the unprivileged uid, so no host path is reachable by name.
    argv += ["-chroot", str(files.disk.parent)]
    if runas is not None:
        argv += ["-runas", runas]
    return argv


def devices_as_in(argv: list[str], parent: list[str]) -> list[str]:
    """``argv`` (a fork child's) with what ``parent`` (the command line the migrated state
    came from) had where the machine must match it: no balloon device if the parent had
    none (a VM started before free page reporting was added; restoring its state into a
    machine with an extra device fails), and the parent's kernel file (a bzImage boot
    has another option ROM than a PVH boot, and the state names its ROMs)."""
    argv = list(argv)
    if "-kernel" in parent and "-kernel" in argv:
        argv[argv.index("-kernel") + 1] = parent[parent.index("-kernel") + 1]
    if _BALLOON in parent or _BALLOON not in argv:
        return argv
    i = argv.index(_BALLOON)
    return argv[: i - 1] + argv[i + 1 :]


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


def mac_of(name: str) -> str:
    """A locally administered unicast MAC derived from ``name`` (a sandbox id): each
    sandbox, and each fork, has its own."""
    h = hashlib.sha256(name.encode()).digest()
    return "52:54:" + ":".join(f"{b:02x}" for b in h[:4])


# Run by root in the VMM's new network namespace, before QEMU: the tap (owned by the VMM
# uid), forwarding from the tap to the eth0 the node may attach later, NAT out of it, and
# nothing from the guest to the namespace itself. Then a holder process (the VMM uid,
# sleeping) keeps the namespace alive while QEMU is gone (a memory-snapshot pause); its
# pid goes where the backend finds it.
_NETNS_SETUP = r"""
set -e
ip link set lo up
ip tuntap add dev "$CORRAL_TAP" mode tap user "$CORRAL_UID" group "$CORRAL_UID"
ip addr add "$CORRAL_TAP_ADDR" dev "$CORRAL_TAP"
ip link set "$CORRAL_TAP" up
echo 1 > /proc/sys/net/ipv4/ip_forward
echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6
echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6
nft -f - <<EOF
table ip corral_vm {
  chain guest_fwd {
    type filter hook forward priority 0; policy drop;
    iifname "$CORRAL_TAP" oifname "eth0" accept
    iifname "eth0" oifname "$CORRAL_TAP" ct state established,related accept
  }
  chain guest_in {
    type filter hook input priority 0; policy accept;
    iifname "$CORRAL_TAP" drop
  }
  chain guest_nat {
    type nat hook postrouting priority 100;
    oifname "eth0" masquerade
  }
}
EOF
setpriv --reuid="$CORRAL_UID" --regid="$CORRAL_UID" --clear-groups -- sleep infinity \
  </dev/null >/dev/null 2>&1 &
echo $! > "$CORRAL_HOLDER"
set +e
exec "$@"
"""


# Why QEMU runs through corral-nothp (corral/init/corral-nothp.c) under TCG: QEMU
# MADV_HUGEPAGEs all guest RAM, so with THP a 2 MiB host page stays whole while any 4 KiB
# of it is in use: the guest's freed memory returns to the host (free page reporting) only
# in whole 2 MiB blocks, and a smaller block reported splits the huge page without freeing
# it (the kernel's deferred split, under memory pressure only). Under TCG huge pages buy
# the guest nothing (its softmmu TLB maps 4 KiB pages). A static C helper, not a Python
# interpreter started for the one prctl: see docs/design-notes.md for what that saves.


def trampoline(
    procs_files: list[Path],
    argv: list[str],
    *,
    uid: int,
    holder_file: Path,
    join_netns: int | None = None,
    no_thp: Path | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``argv`` run by a shell that first moves itself into the cgroup (every
    ``cgroup.procs`` file given) and then into the VMM's network namespace, so QEMU starts
    there and all its threads stay there. Returns the argv and the environment to run.

    A new namespace (``join_netns`` None) is set up by :data:`_NETNS_SETUP` (the tap, the
    NAT, the holder whose pid goes to ``holder_file``); a restore joins the namespace of the
    holder ``join_netns`` (its tap, and the eth0 the node attached, are still there).
    ``no_thp``: corral-nothp (:func:`corral.init.ensure_nothp_built`), which runs QEMU with
    transparent huge pages disabled (``PR_SET_THP_DISABLE``, kept across exec), so its
    guest RAM is backed by 4 KiB pages (why: the comment above); None: the host's THP."""
    if no_thp is not None:
        argv = [str(no_thp), *argv]
    unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
    if unshare is None or nsenter is None:
        raise HostError("microvm: unshare/nsenter (util-linux) not found")
    script = 'for f in $CORRAL_PROCS; do echo $$ > "$f" || exit 125; done; exec "$@"'
    env_files = " ".join(str(p) for p in procs_files)
    if any(" " in str(p) for p in procs_files):
        raise HostError(f"microvm: cgroup path with a space: {env_files!r}")
    tap_addr, _, prefix = GUEST_NET
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "CORRAL_PROCS": env_files,
        "CORRAL_UID": str(uid),
        "CORRAL_TAP": TAP,
        "CORRAL_TAP_ADDR": f"{tap_addr}/{prefix}",
        "CORRAL_HOLDER": str(holder_file),
    }
    if join_netns is not None:
        enter = [nsenter, f"--net=/proc/{join_netns}/ns/net", "--"]
        return ["/bin/sh", "-c", script, "corral-vmm", *enter, *argv], env
    inner = ["/bin/sh", "-c", _NETNS_SETUP, "corral-vmm-net"]
    return ["/bin/sh", "-c", script, "corral-vmm", unshare, "--net", "--", *inner, *argv], env


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
