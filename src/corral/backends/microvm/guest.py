"""What a microVM boots: a Debian cloud kernel and a tiny initramfs built by corral.

The kernel is Debian's ``linux-image-*-cloud-amd64`` (virtio drivers as modules, ~2 s to
its root mount under TCG with ``-M microvm``). :func:`fetch_kernel` takes it from the host's
apt sources with ``apt-get download`` and extracts it into a directory of the node's state
(the host's /boot is never touched); ``depmod`` there gives the module dependencies.

The initramfs (:func:`build_initramfs`, a gzip'd newc cpio made in Python) holds a static
busybox, the static corral-init, the few modules the guest needs (virtio-mmio, -blk,
-console, erofs, overlay, with their dependencies, in load order) and ``/init``
(:data:`INIT_SCRIPT`), which

  1. mounts /proc, /sys, /dev and loads the modules,
  2. mounts each EROFS layer read-only: from ``/dev/pmem<i>`` with DAX when the node
     mapped the layers as memory (``corral.dax=1``, see :mod:`.dax`), else from its
     virtio-blk disk (serial ``l<i>``),
  3. mounts the writable disk (serial ``rw``, ext4 made by the host in the sandbox's
     scratch subvolume) and composes the root with overlayfs as containers do,
  4. puts corral-init, busybox and corral-tar on a read-only tmpfs at ``/.corral``, with
     the upper dir bound read-only at ``/.corral/upper`` (a snapshot streams it out), and
  5. ``switch_root``s to corral-init as PID 1, serving the node over the virtio-serial
     port named ``corral.ctl`` (``--vmux``, see docs/init-protocol.md).

Any failure prints ``corral-initramfs: <what>`` on the console and powers the VM off, so the
node's boot wait ends with that line instead of a timeout.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from corral.errors import HostError
from corral.init import ensure_tar_built

__all__ = [
    "INIT_SCRIPT",
    "Kernel",
    "build_initramfs",
    "fetch_kernel",
    "find_kernel",
    "pvh_kernel",
]

MODULES = (
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio_net",
    "erofs",
    "overlay",
    "nd_pmem",
    "nd_e820",
    "virtio_balloon",
)
"""Modules the guest loads (their dependencies come first, from modules.dep); nd_pmem and
nd_e820 make the layer ranges of a DAX boot (corral.backends.microvm.dax) /dev/pmem*;
virtio_balloon reports the pages the guest frees to the host (free page reporting)."""

BUSYBOX = Path("/bin/busybox")
"""Debian's busybox-static."""

INIT_SCRIPT = r"""#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
fail() { echo "corral-initramfs: $*" > /dev/console; $B sync; $B poweroff -f; }
for m in $($B cat /modules.list); do $B insmod "/modules/$m" || fail "insmod $m"; done
n=0
for a in $($B cat /proc/cmdline); do
  case "$a" in
    corral.layers=*) n=${a#corral.layers=};; corral.probe=1) probe=1;;
    corral.net=*) net=${a#corral.net=};; corral.dns=*) dns=${a#corral.dns=};;
    corral.hostname=*) hn=${a#corral.hostname=};; corral.dax=1) dax=1;;
    corral.report_order=*) ro=${a#corral.report_order=};;
  esac
done
# free page reporting's block order (virtio_balloon set it to 2 MiB when it registered;
# the kernel's own command line parameter is overwritten then in 6.1)
if [ -n "$ro" ]; then
  echo "$ro" > /sys/module/page_reporting/parameters/page_reporting_order \
    || fail "page_reporting_order $ro"
fi
if [ -n "$probe" ]; then echo "corral-probe-ok" > /dev/console; $B poweroff -f; fi
disk() {  # the /dev node of the virtio disk with this serial
  for t in 1 2 3 4 5 6 7 8 9 10; do
    for d in /sys/block/vd*; do
      [ "$($B cat "$d/serial" 2>/dev/null)" = "$1" ] && { echo "/dev/${d##*/}"; return 0; }
    done
    $B usleep 100000
  done
  return 1
}
pmem() {  # layer i of a DAX boot: the i-th pmem range (regions are numbered by address)
  for t in 1 2 3 4 5 6 7 8 9 10; do
    [ -b "/dev/pmem$1" ] && { echo "/dev/pmem$1"; return 0; }
    $B usleep 100000
  done
  return 1
}
$B mkdir -p /layers /rw /newroot
lower=""
i=0
while [ "$i" -lt "$n" ]; do
  if [ -n "$dax" ]; then
    dev=$(pmem "$i") || fail "no pmem device for layer $i"; opts=ro,dax=always
  else
    dev=$(disk "l$i") || fail "no disk for layer $i"; opts=ro
  fi
  $B mkdir -p "/layers/$i"
  $B mount -t erofs -o "$opts" "$dev" "/layers/$i" || fail "mount layer $i ($dev, $opts)"
  lower="/layers/$i${lower:+:$lower}"
  i=$((i + 1))
done
dev=$(disk rw) || fail "no writable disk"
$B mount -t ext4 "$dev" /rw || fail "mount writable disk ($dev)"
$B mkdir -p /rw/upper /rw/work
if [ -z "$lower" ]; then $B mkdir -p /rw/empty; lower=/rw/empty; fi
$B mount -t overlay overlay -o "lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work" /newroot \
  || fail "overlay root"
$B mkdir -p /newroot/.corral /newroot/proc /newroot/sys /newroot/dev /newroot/tmp
$B mount -t tmpfs -o mode=0755,size=4m corral /newroot/.corral
$B cp /bin/corral-init /newroot/.corral/init
$B cp /bin/busybox /newroot/.corral/busybox
$B cp /bin/corral-tar /newroot/.corral/tar
# The NIC (a tap NATed to the sandbox's eth0 on the host; no eth0 there: no network)
$B ip link set lo up
if [ -n "$net" ] && [ -e /sys/class/net/eth0 ]; then
  $B ip link set eth0 up && $B ip addr add "${net%,*}" dev eth0 \
    && $B ip route add default via "${net#*,}" || fail "network"
fi
[ -n "$hn" ] && $B hostname "$hn"
if [ -n "$dns" ]; then  # as containers: the node resolver, bound read-only
  echo "nameserver $dns" > /newroot/.corral/resolv.conf
  echo "options timeout:1 attempts:2" >> /newroot/.corral/resolv.conf
  [ -e /newroot/etc/resolv.conf ] || { $B mkdir -p /newroot/etc; : > /newroot/etc/resolv.conf; }
  $B mount --bind /newroot/.corral/resolv.conf /newroot/etc/resolv.conf \
    && $B mount -o remount,bind,ro /newroot/etc/resolv.conf
fi
# shell sessions keep a command's stdin in /.corral/shells (corral.backends.shell): a dir
# on the writable disk beside the upper dir (the disk quota; never in a snapshot)
$B mkdir -p /rw/shells /newroot/.corral/shells
$B chmod 0700 /rw/shells
# the upper dir, read-only, for a snapshot: the node streams it out with /.corral/tar
# (the guest's own files; the host never mounts the disk)
$B mkdir -p /newroot/.corral/upper
$B mount -o remount,ro,nosuid,nodev /newroot/.corral
$B mount --bind /rw/shells /newroot/.corral/shells || fail "shells dir"
$B mount --bind /rw/upper /newroot/.corral/upper && $B mount -o remount,bind,ro /newroot/.corral/upper \
  || fail "upper dir"
port=""
for p in /sys/class/virtio-ports/*; do
  [ "$($B cat "$p/name" 2>/dev/null)" = corral.ctl ] && port="/dev/${p##*/}"
done
[ -n "$port" ] || fail "no virtio-serial port corral.ctl"
$B mount --move /proc /newroot/proc
$B mount --move /sys /newroot/sys
$B mount --move /dev /newroot/dev
$B mkdir -p /newroot/dev/pts /newroot/dev/shm
$B mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts /newroot/dev/pts
$B mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
exec $B switch_root /newroot /.corral/init --vmux "$port"
"""


@dataclass(frozen=True)
class Kernel:
    """An extracted Debian kernel package: the image and its modules."""

    vmlinuz: Path
    modules: Path
    """``lib/modules/<version>`` (with modules.dep)."""

    @property
    def version(self) -> str:
        return self.modules.name


def find_kernel(root: Path) -> Kernel | None:
    """The kernel extracted under ``root`` (by :func:`fetch_kernel`), if there is one."""
    images = sorted((root / "boot").glob("vmlinuz-*"))
    for img in reversed(images):
        version = img.name.removeprefix("vmlinuz-")
        mods = root / "lib" / "modules" / version
        if (mods / "modules.dep").is_file():
            return Kernel(img, mods)
    return None


def fetch_kernel(root: Path, package: str = "linux-image-cloud-amd64") -> Kernel:
    """Download ``package``'s kernel image .deb with apt-get (the host's apt sources) and
    extract it under ``root``; idempotent. HostError naming the step that failed."""
    found = find_kernel(root)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    # The metapackage depends on the versioned image package, which holds the files.
    deps = _run(["apt-cache", "depends", package], "apt-cache depends")
    names = [
        line.split(":", 1)[1].strip()
        for line in deps.splitlines()
        if line.strip().startswith("Depends:") and "linux-image-" in line
    ]
    real = names[0] if names else package
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        _run(["apt-get", "download", "-q", real], "apt-get download", cwd=tmp)
        debs = list(Path(tmp).glob("*.deb"))
        if not debs:
            raise HostError(f"microvm kernel: apt-get download {real} produced no .deb")
        _run(["dpkg-deb", "-x", str(debs[0]), str(root)], "dpkg-deb -x")
    versions = [p.name for p in (root / "lib" / "modules").iterdir()]
    for v in versions:
        _run(["depmod", "-b", str(root), v], "depmod")
    found = find_kernel(root)
    if found is None:
        raise HostError(f"microvm kernel: no vmlinuz-* with modules under {root} after extract")
    return found


def _run(argv: list[str], what: str, cwd: str | None = None) -> str:
    try:
        # Safe: fixed argv of host packaging tools, no shell.
        r = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostError(f"microvm kernel: {what}: {e}") from None
    if r.returncode != 0:
        raise HostError(f"microvm kernel: {what} failed: {r.stderr.strip()[-500:]}")
    return r.stdout


def module_order(kernel: Kernel, wanted: tuple[str, ...] = MODULES) -> list[str]:
    """Relative paths of ``wanted`` modules and their dependencies, dependencies first;
    modules built into the kernel are skipped."""
    deps: dict[str, list[str]] = {}
    for line in (kernel.modules / "modules.dep").read_text().splitlines():
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
    by_name = {Path(m).name.split(".ko")[0].replace("-", "_"): m for m in deps}
    builtin = (kernel.modules / "modules.builtin").read_text()
    order: list[str] = []

    def add(mod: str) -> None:
        for d in reversed(deps.get(mod, [])):  # modules.dep lists the deepest last
            add(d)
        if mod not in order:
            order.append(mod)

    for name in wanted:
        found = by_name.get(name)
        if found is None:
            if f"/{name}.ko" in builtin:
                continue
            raise HostError(f"microvm kernel {kernel.version}: no module {name}")
        add(found)
    return order


def build_initramfs(
    kernel: Kernel, init_bin: Path, out_dir: Path, modules: tuple[str, ...] = MODULES
) -> Path:
    """The initramfs for ``kernel`` with ``init_bin`` (corral-init) and ``modules`` (the
    full-VM backend loads PCI, display and input drivers), cached in ``out_dir`` by the
    digest of everything in it."""
    if not BUSYBOX.is_file():
        raise HostError(f"microvm: {BUSYBOX} missing (apt-get install busybox-static)")
    mods = module_order(kernel, modules)
    tar_bin = ensure_tar_built(init_bin.parent)
    h = hashlib.sha256(INIT_SCRIPT.encode())
    for p in (init_bin, tar_bin, BUSYBOX, kernel.vmlinuz):
        h.update(hashlib.sha256(p.read_bytes()).digest())
    h.update("\n".join(mods).encode())
    out = out_dir / f"initramfs-{h.hexdigest()[:16]}.img"
    if out.exists():
        return out
    files: list[tuple[str, int, bytes]] = [  # (path, mode, content); dirs have b""
        (d, 0o040755, b"")
        for d in ("bin", "dev", "proc", "sys", "modules", "layers", "rw", "newroot")
    ]
    files += [
        ("init", 0o100755, INIT_SCRIPT.encode()),
        ("bin/busybox", 0o100755, BUSYBOX.read_bytes()),
        ("bin/sh", 0o120777, b"busybox"),
        ("bin/corral-init", 0o100755, init_bin.read_bytes()),
        ("bin/corral-tar", 0o100755, tar_bin.read_bytes()),
        ("modules.list", 0o100644, "\n".join(Path(m).name for m in mods).encode() + b"\n"),
    ]
    for m in mods:
        files.append((f"modules/{Path(m).name}", 0o100644, (kernel.modules / m).read_bytes()))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(gzip.compress(_cpio(files), compresslevel=1))
    os.replace(tmp, out)
    return out


def _cpio(files: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive (what the kernel unpacks as initramfs)."""
    buf = io.BytesIO()
    entries = [*files, ("TRAILER!!!", 0, b"")]
    for ino, (name, mode, data) in enumerate(entries, 1):
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(
            f"{v:08x}" for v in (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0)
        )
        buf.write(hdr.encode() + nb)
        buf.write(b"\0" * (-(110 + len(nb)) % 4))
        buf.write(data)
        buf.write(b"\0" * (-len(data) % 4))
    return buf.getvalue()


_DECOMPRESS = {
    b"\x02\x21\x4c\x18": ["lz4", "-d", "-c"],  # lz4 legacy frame (CONFIG_KERNEL_LZ4)
    b"\x1f\x8b": ["gzip", "-d", "-c"],
    b"\xfd7zXZ": ["xz", "-d", "-c"],
    b"\x28\xb5\x2f\xfd": ["zstd", "-d", "-c"],
}
"""Decompressors (host tools) by the magic of a bzImage's payload."""

_PVH_NOTE = 18
"""XEN_ELFNOTE_PHYS32_ENTRY: the kernel's 32-bit PVH entry point (CONFIG_PVH)."""


def pvh_kernel(kernel: Kernel, out_dir: Path) -> Path | None:
    """The uncompressed ELF kernel (``vmlinux``) inside ``kernel``'s bzImage, cached in
    ``out_dir``, if it has a PVH entry point; None if not (or if its payload cannot be
    unpacked here): boot the bzImage then.

    Why: QEMU boots an ELF kernel with a PVH note by mapping the file and copying its
    segments into guest RAM at reset (the mapping is page cache, shared by every VM and
    charged to the node, :mod:`.hostcache`), where a bzImage is read into a buffer of
    QEMU's own heap that stays for the VM's life (13.5 MiB per VM for the Debian cloud
    kernel) and is then decompressed by the guest. The kernel then runs at its link
    address (no KASLR in the guest)."""
    out = out_dir / f"vmlinux-{kernel.version}"
    if out.exists():  # written below only once its note was found (atomically)
        return out
    data = kernel.vmlinuz.read_bytes()
    if len(data) < 0x250 or data[0x202:0x206] != b"HdrS":
        return None
    setup_sects = data[0x1F1] or 4
    offset, length = struct.unpack_from("<II", data, 0x248)
    start = (setup_sects + 1) * 512 + offset
    payload = data[start : start + length]
    tool = next((t for m, t in _DECOMPRESS.items() if payload.startswith(m)), None)
    if tool is None or shutil.which(tool[0]) is None:
        return None
    # The payload ends with the uncompressed size (4 bytes), which no decompressor wants.
    try:
        # Safe: a fixed decompressor argv on the kernel package's own image, no shell.
        r = subprocess.run(tool, input=payload[:-4], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    elf = r.stdout
    if len(elf) != struct.unpack("<I", payload[-4:])[0] or not _has_pvh_note(elf):
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(elf)
    os.replace(tmp, out)
    return out


def _has_pvh_note(elf: bytes) -> bool:
    """``elf`` is an x86-64 ELF with a Xen PHYS32_ENTRY note (QEMU boots it by PVH)."""
    if elf[:5] != b"\x7fELF\x02" or len(elf) < 64:
        return False
    phoff, phentsize, phnum = (
        struct.unpack_from("<Q", elf, 0x20)[0],
        *struct.unpack_from("<HH", elf, 0x36),
    )
    for i in range(phnum):
        ptype, _, off, _, _, filesz = struct.unpack_from("<IIQQQQ", elf, phoff + i * phentsize)
        if ptype != 4:  # PT_NOTE
            continue
        pos, end = off, off + filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            name = elf[pos + 12 : pos + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and ntype == _PVH_NOTE:
                return True
            pos += 12 + (namesz + 3) // 4 * 4 + (descsz + 3) // 4 * 4
    return False


def copy_kernel(kernel: Kernel, dst: Path) -> Path:
    """``kernel``'s image copied to ``dst`` (a path QEMU may open)."""
    if not dst.exists():
        shutil.copyfile(kernel.vmlinuz, dst)
    return dst
