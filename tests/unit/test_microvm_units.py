"""Pieces of the microVM backend that need no QEMU: the host multiplexer against a fake
guest end, the initramfs archive, module ordering, the QEMU command line."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

from corral.backends.microvm import guest, qemu
from corral.backends.microvm.vmux import HostMux

HDR = struct.Struct(">IcI")


async def test_host_mux_carries_one_connection_per_channel(tmp_path: Path) -> None:
    """Two client connections become two channels; the fake guest echoes each one's
    bytes upper-cased and closes it; the first frame on the port is a reset."""
    seen: list[bytes] = []

    async def guest_end(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            try:
                chan, kind, n = HDR.unpack(await r.readexactly(HDR.size))
            except asyncio.IncompleteReadError:
                return
            data = await r.readexactly(n) if n else b""
            seen.append(kind)
            if kind == b"d":
                w.write(HDR.pack(chan, b"d", n) + data.upper() + HDR.pack(chan, b"c", 0))

    vm = tmp_path / "vm.sock"
    server = await asyncio.start_unix_server(guest_end, str(vm))
    mux = HostMux(vm, tmp_path / "ctl.sock")
    await mux.start()
    try:

        async def ask(msg: bytes) -> bytes:
            r, w = await asyncio.open_unix_connection(str(tmp_path / "ctl.sock"))
            w.write(msg)
            out = await r.read()  # until the guest's close
            w.close()
            return out

        assert await asyncio.gather(ask(b"one"), ask(b"two")) == [b"ONE", b"TWO"]
        assert seen[0] == b"r" and seen.count(b"o") == 2
    finally:
        await mux.close()
        server.close()
    assert not (tmp_path / "ctl.sock").exists()


async def test_host_mux_clients_see_eof_when_qemu_goes(tmp_path: Path) -> None:
    vm = tmp_path / "vm.sock"
    conns: list[asyncio.StreamWriter] = []

    async def guest_end(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(w)
        await r.read(HDR.size)

    server = await asyncio.start_unix_server(guest_end, str(vm))
    mux = HostMux(vm, tmp_path / "ctl.sock")
    await mux.start()
    try:
        r, w = await asyncio.open_unix_connection(str(tmp_path / "ctl.sock"))
        w.write(b"request")
        while not conns:
            await asyncio.sleep(0.01)
        conns[0].close()  # QEMU gone
        assert await r.read() == b""
        w.close()
    finally:
        await mux.close()
        server.close()


def test_cpio_newc_archive() -> None:
    raw = guest._cpio([("bin", 0o040755, b""), ("init", 0o100755, b"#!/bin/sh\n")])
    assert raw.startswith(b"070701")
    assert b"init\0" in raw and b"#!/bin/sh\n" in raw and b"TRAILER!!!\0" in raw
    assert len(raw) % 4 == 0


def test_module_order_puts_dependencies_first(tmp_path: Path) -> None:
    mods = tmp_path / "lib" / "modules" / "6.1.0-test"
    mods.mkdir(parents=True)
    (mods / "modules.dep").write_text(
        "kernel/a/virtio_mmio.ko: kernel/v/virtio.ko kernel/v/virtio_ring.ko\n"
        "kernel/v/virtio.ko:\nkernel/v/virtio_ring.ko:\n"
        "kernel/fs/erofs.ko: kernel/lib/libcrc32c.ko\nkernel/lib/libcrc32c.ko:\n"
    )
    (mods / "modules.builtin").write_text("kernel/fs/overlayfs/overlay.ko\n")
    (tmp_path / "boot").mkdir()
    (tmp_path / "boot" / "vmlinuz-6.1.0-test").write_bytes(b"k")
    k = guest.find_kernel(tmp_path)
    assert k is not None and k.version == "6.1.0-test"
    order = guest.module_order(k, ("virtio_mmio", "erofs", "overlay"))
    assert order == [
        "kernel/v/virtio_ring.ko",
        "kernel/v/virtio.ko",
        "kernel/a/virtio_mmio.ko",
        "kernel/lib/libcrc32c.ko",
        "kernel/fs/erofs.ko",
    ]


def _files(tmp_path: Path, layers: list[Path], **kw: Any) -> qemu.VMFiles:
    """A VM's files, all under ``tmp_path`` (the argv tests only read their names)."""
    return qemu.VMFiles(
        kernel=tmp_path / "k",
        initrd=tmp_path / "i",
        layers=layers,
        disk=tmp_path / "disk.img",
        console=tmp_path / "c.log",
        vm_sock=tmp_path / "vm.sock",
        pidfile=tmp_path / "vmm.pid",
        **kw,
    )


def test_vm_argv_layers_read_only_and_disk_serials(tmp_path: Path) -> None:
    f = _files(tmp_path, [tmp_path / "l0.erofs", tmp_path / "l1.erofs"])
    argv = qemu.vm_argv(f, accel="tcg", cpus=1, memory_mib=256, runas="999:999")
    text = " ".join(argv)
    assert "corral.layers=2" in text
    assert f"file={tmp_path / 'l1.erofs'},format=raw,if=none,readonly=on" in text
    assert "serial=l0" in text and "serial=rw" in text
    assert argv[-2:] == ["-runas", "999:999"]
    assert "-sandbox" in argv


async def test_host_mux_drops_a_guest_that_forges_a_huge_frame(tmp_path: Path) -> None:
    """The guest can write the port itself: a 4 GiB length ends the channel, the node
    buffers nothing and its clients see EOF."""

    async def guest_end(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readexactly(HDR.size)  # the reset
        chan, kind, _ = HDR.unpack(await r.readexactly(HDR.size))  # the open
        w.write(HDR.pack(chan, b"d", 0xFFFFFFFF) + b"x" * 100)
        await r.read()

    vm = tmp_path / "vm.sock"
    server = await asyncio.start_unix_server(guest_end, str(vm))
    mux = HostMux(vm, tmp_path / "ctl.sock")
    await mux.start()
    try:
        r, w = await asyncio.open_unix_connection(str(tmp_path / "ctl.sock"))
        assert await r.read() == b""
        assert not mux.connected
        w.close()
    finally:
        await mux.close()
        server.close()


def test_dax_plan_lays_out_aligned_pmem_ranges_with_gaps(tmp_path: Path) -> None:
    """Each layer file is a NUMA node of guest RAM; its pmem range (file + pad) starts and
    ends 2 MiB aligned, a RAM gap separates ranges, a RAM tail for the initramfs comes
    last, and the guest keeps exactly its memory size as RAM."""
    import re

    from corral.backends.microvm import dax

    mib = 1 << 20
    layers = [(tmp_path / "a.erofs", 1515520), (tmp_path / "b.erofs", 4 * mib)]
    p = dax.plan(layers, 256, initrd_size=5 * mib)
    assert p is not None
    assert p.total_mib == 256 + 2 + 4  # the layer ranges on top of the guest's memory
    text = " ".join(p.argv)
    assert f"mem-path={tmp_path / 'a.erofs'},size=1515520,share=on,readonly=on" in text
    sizes = [
        int(m) for m in re.findall(r"memory-backend-\w+,id=\w+,(?:mem-path=\S+,)?size=(\d+)", text)
    ]
    assert sum(sizes) == p.total_mib * mib
    ranges = [(int(s), int(a, 16)) for s, a in (k[7:].split("!") for k in p.kernel_args)]
    assert len(ranges) == 2
    for size, start in ranges:
        assert size % dax.ALIGN == 0 and start % dax.ALIGN == 0
    (s0, a0), (s1, a1) = ranges
    assert a1 >= a0 + s0 + dax.ALIGN  # a RAM gap: the kernel would merge adjacent ranges
    ram = p.total_mib * mib - s0 - s1
    assert ram == 256 * mib


def test_dax_plan_falls_back_when_it_cannot_map(tmp_path: Path) -> None:
    from corral.backends.microvm import dax

    assert dax.plan([(tmp_path / "odd", 4097)], 256, 1 << 20) is None  # not 4 KiB pages
    assert dax.plan([(tmp_path / "big", 3 << 30)], 256, 1 << 20) is None  # past 3 GiB
    assert dax.plan([(tmp_path / "a", 4096)], 16, 1 << 20) is None  # no room for RAM
    assert dax.plan([(tmp_path / "a,b", 4096)], 256, 1 << 20) is None  # QEMU option syntax


def test_vm_argv_with_dax_maps_layers_and_has_no_layer_disks(tmp_path: Path) -> None:
    from corral.backends.microvm import dax

    layer = tmp_path / "l0.erofs"
    plan = dax.plan([(layer, 8192)], 256, 1 << 20)
    f = _files(tmp_path, [layer], dax=plan)
    argv = qemu.vm_argv(f, accel="tcg", cpus=1, memory_mib=256, runas="999:999")
    text = " ".join(argv)
    assert "microvm,isa-serial=on,pcie=on" in argv
    assert "corral.dax=1" in text and "memmap=2097152!" in text
    assert "serial=l0" not in text and "serial=rw" in text
    assert argv[argv.index("-m") + 1] == f"{256 + 2}M"


def test_vm_argv_returns_freed_pages_and_sizes_the_translation_cache(tmp_path: Path) -> None:
    """Every microVM has a balloon device with free page reporting (the guest's freed
    memory goes back to the host) and TCG's translation cache at the size asked."""
    f = _files(tmp_path, [])
    argv = qemu.vm_argv(f, accel="tcg", cpus=1, memory_mib=256, runas=None, tb_mib=12)
    assert "virtio-balloon-device,free-page-reporting=on" in argv
    assert argv[argv.index("-accel") + 1] == "tcg,tb-size=12"
    kvm = qemu.vm_argv(f, accel="kvm", cpus=1, memory_mib=256, runas=None, tb_mib=12)
    assert kvm[kvm.index("-accel") + 1] == "kvm"
    assert "virtio_balloon" in guest.MODULES
    # a fork child of a VM started before the balloon keeps its parent's devices
    old = [a for a in argv if a != "virtio-balloon-device,free-page-reporting=on"]
    old.remove("-device")  # the balloon's own -device (the first one)
    assert qemu.devices_as_in(argv, old) == old
    assert qemu.devices_as_in(argv, argv) == argv


def test_smaps_breakdown_tells_mappings_apart(tmp_path: Path) -> None:
    """The bench's breakdown of QEMU's memory: guest RAM by its backend's size, the rwx
    translation cache, the layer files, QEMU's files, the rest as heap."""
    from corral.bench import microvm_mem

    argv = ["-m", "430M", "-object", "memory-backend-ram,id=ram,size=4194304"]
    assert microvm_mem.ram_sizes(argv) == {430 << 20, 4 << 20}
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f00-7f01 rw-p 00000000 00:00 0 \nSize: 4096 kB\nRss: 2048 kB\nAnonHugePages: 2048 kB\n"
        "7f02-7f03 rwxp 00000000 00:00 0 \nSize: 16384 kB\nRss: 1024 kB\n"
        "7f04-7f05 r--s 00000000 fe:00 9 /store/layers/ab.erofs\nSize: 8 kB\nRss: 8 kB\n"
        "7f06-7f07 r-xp 00000000 fe:00 7 /usr/bin/qemu\nSize: 100 kB\nRss: 100 kB\n"
        "7f08-7f09 rw-p 00000000 00:00 0 [heap]\nSize: 64 kB\nRss: 64 kB\n"
    )
    got = microvm_mem.smaps_breakdown(0, {4 << 20}, path=smaps)
    assert got["guest_ram"] == 2.0 and got["guest_ram_thp"] == 2.0
    assert got["tcg_code_buffer"] == 1.0
    assert got["layer_files"] == round(8 / 1024, 1) and got["qemu_files"] == 0.1
    assert got["qemu_heap"] == 0.1


def test_own_cache_drop_skips_missing_files(tmp_path: Path) -> None:
    """After a memory-snapshot save the node drops the page cache of the VM's own disk
    and console; a file that is not there (a VM without a console yet) is no error."""
    from corral.backends.microvm.backend import _drop_own_cache

    (tmp_path / "disk.img").write_bytes(b"x" * 8192)
    _drop_own_cache(tmp_path)
    assert (tmp_path / "disk.img").read_bytes() == b"x" * 8192


def test_vmm_files_and_charge_to_node(tmp_path: Path) -> None:
    """The files every VM shares are found (QEMU, its libraries) and read whole by the
    caller; an unreadable one is skipped."""
    import shutil

    from corral.backends.microvm import hostcache

    a = tmp_path / "a"
    a.write_bytes(b"y" * 5000)
    assert hostcache.charge_to_node([a, tmp_path / "missing"]) == 5000
    assert hostcache.vmm_files("no-such-qemu-binary") == []
    if shutil.which("qemu-system-x86_64") is None:
        return
    files = hostcache.vmm_files("qemu-system-x86_64")
    assert files[0].name == "qemu-system-x86_64"
    assert any(f.name.startswith("libc.so") for f in files)


def test_vm_argv_skips_the_guest_tracefs_unless_asked(tmp_path: Path) -> None:
    """The guest kernel builds no tracefs by default (its pinned slab per VM); asked for,
    the kernel command line is left alone."""
    f = _files(tmp_path, [])
    off = qemu.vm_argv(f, accel="tcg", cpus=1, memory_mib=256, runas=None)
    assert "initcall_blacklist=tracer_init_tracefs" in off[off.index("-append") + 1]
    on = qemu.vm_argv(f, accel="tcg", cpus=1, memory_mib=256, runas=None, tracefs=True)
    assert "initcall_blacklist" not in on[on.index("-append") + 1]


def _elf_with_notes(notes: list[tuple[bytes, int]]) -> bytes:
    """A minimal x86-64 ELF whose one program header is a PT_NOTE with ``notes``
    (name, type)."""
    body = b""
    for name, ntype in notes:
        n = name + b"\0"
        body += struct.pack("<III", len(n), 8, ntype) + n.ljust(-(-len(n) // 4) * 4, b"\0")
        body += b"\0" * 8
    ehdr = bytearray(64)
    ehdr[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", ehdr, 0x20, 64)  # e_phoff
    struct.pack_into("<HH", ehdr, 0x36, 56, 1)  # e_phentsize, e_phnum
    phdr = struct.pack("<IIQQQQQQ", 4, 0, 64 + 56, 0, 0, len(body), len(body), 4)
    return bytes(ehdr) + phdr + body


def _bzimage(payload_elf: bytes) -> bytes:
    """A bzImage-shaped file: setup sectors with the header fields pvh_kernel reads, then
    the gzip'd ELF and its size, as the kernel's build appends it."""
    import gzip

    setup_sects = 1
    head = bytearray((setup_sects + 1) * 512)
    head[0x1F1] = setup_sects
    head[0x202:0x206] = b"HdrS"
    payload = gzip.compress(payload_elf) + struct.pack("<I", len(payload_elf))
    struct.pack_into("<II", head, 0x248, 0, len(payload))
    return bytes(head) + payload


def test_pvh_kernel_unpacks_the_elf_with_a_pvh_entry(tmp_path: Path) -> None:
    """The bzImage's payload is decompressed to the ELF (cached by kernel version) when
    the ELF has Xen's PHYS32_ENTRY note; without the note, or from something that is not
    a bzImage, there is no PVH kernel (the bzImage is booted)."""
    mods = tmp_path / "k" / "lib" / "modules" / "6.1.0-test"
    mods.mkdir(parents=True)
    img = tmp_path / "k" / "vmlinuz-6.1.0-test"
    elf = _elf_with_notes([(b"Linux", 6), (b"Xen", 18)])
    img.write_bytes(_bzimage(elf))
    k = guest.Kernel(img, mods)
    out = guest.pvh_kernel(k, tmp_path / "out")
    assert out == tmp_path / "out" / "vmlinux-6.1.0-test"
    assert out.read_bytes() == elf
    assert guest.pvh_kernel(k, tmp_path / "out") == out  # cached
    img.write_bytes(_bzimage(_elf_with_notes([(b"Xen", 5)])))
    assert guest.pvh_kernel(k, tmp_path / "other") is None
    img.write_bytes(b"not a kernel" * 100)
    assert guest.pvh_kernel(k, tmp_path / "third") is None


def test_no_thp_wrapper_disables_huge_pages_for_what_it_runs(tmp_path: Path) -> None:
    """Under TCG QEMU runs through corral-nothp (THP disabled, the prctl kept across exec);
    the trampoline puts it in front of QEMU only when given; a program it cannot run is a
    clear error."""
    import subprocess

    from corral.init import ensure_nothp_built

    nothp = ensure_nothp_built(tmp_path / "bin")
    assert nothp.name.startswith("corral-nothp-")
    r = subprocess.run([nothp, "cat", "/proc/self/status"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "THP_enabled:\t0" in r.stdout
    plain = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True)
    assert "THP_enabled:\t1" in plain.stdout
    r = subprocess.run([nothp, tmp_path / "no-such"], capture_output=True, text=True)
    assert r.returncode == 127 and "corral-nothp: cannot run" in r.stderr, r
    assert "no-such" in r.stderr
    procs = [tmp_path / "cgroup.procs"]
    run, _ = qemu.trampoline(procs, ["qemu"], uid=1000, holder_file=tmp_path / "h", no_thp=nothp)
    assert run[-2:] == [str(nothp), "qemu"]
    run, _ = qemu.trampoline(procs, ["qemu"], uid=1000, holder_file=tmp_path / "h")
    assert str(nothp) not in run and run[-1] == "qemu"


def test_report_order_and_fork_kernel(tmp_path: Path) -> None:
    """The reporting order goes to the initramfs (which writes it to sysfs once the
    balloon driver registered); a fork child boots its parent's kernel file."""
    f = _files(tmp_path, [])
    argv = qemu.vm_argv(f, accel="tcg", cpus=1, memory_mib=256, runas=None, report_order=0)
    assert "corral.report_order=0" in argv[argv.index("-append") + 1]
    assert "page_reporting_order" in guest.INIT_SCRIPT
    plain = qemu.vm_argv(f, accel="tcg", cpus=1, memory_mib=256, runas=None)
    assert "report_order" not in plain[plain.index("-append") + 1]
    parent = list(argv)
    parent[parent.index("-kernel") + 1] = "/old/vmlinuz"
    child = qemu.devices_as_in(argv, parent)
    assert child[child.index("-kernel") + 1] == "/old/vmlinuz"
    assert argv[argv.index("-kernel") + 1] != "/old/vmlinuz"  # not changed in place


def test_held_in_snapshot_is_the_memory_snapshot_file(tmp_path: Path) -> None:
    """What a restarted node asks to keep a memory-paused VM paused: its snapshot file
    (the VMM is gone, its cgroup not frozen)."""
    from corral.backends.base import HostContext
    from corral.backends.config import MicroVMConfig
    from corral.backends.microvm.backend import _SNAP, MicroVMBackend
    from corral.images.store import LayerStore
    from corral.testing import FakeCgroups, FakeScratch

    ctx = HostContext(
        node_id="n",
        state_dir=tmp_path,
        run_dir=tmp_path / "run",
        cgroups=FakeCgroups(),
        scratch=FakeScratch(tmp_path),
        store=LayerStore(tmp_path / "store"),
        host_uid=100000,
        id_count=65536,
    )
    b = MicroVMBackend(MicroVMConfig(), ctx)
    b.dir("sb-1").mkdir(parents=True)
    assert not b.held_in_snapshot("sb-1") and not b.held_in_snapshot("sb-2")
    (b.dir("sb-1") / _SNAP).write_bytes(b"state")
    assert b.held_in_snapshot("sb-1") and not b.held_in_snapshot("sb-2")


def test_vm_engines_offer_memory_snapshots_and_an_accelerator(tmp_path: Path) -> None:
    """What the node asks every engine (Backend.memory_snapshots, Backend.accel): the VM
    engines save to memory snapshots and know their accelerator once started; containers
    do neither."""
    from corral.backends.base import HostContext
    from corral.backends.config import MicroVMConfig, VMConfig
    from corral.backends.container import ContainerBackend
    from corral.backends.microvm.backend import MicroVMBackend
    from corral.backends.vm.backend import VMBackend
    from corral.images.store import LayerStore
    from corral.testing import FakeCgroups, FakeScratch

    ctx = HostContext(
        node_id="n",
        state_dir=tmp_path,
        run_dir=tmp_path / "run",
        cgroups=FakeCgroups(),
        scratch=FakeScratch(tmp_path),
        store=LayerStore(tmp_path / "store"),
        host_uid=100000,
        id_count=65536,
    )
    for b in (MicroVMBackend(MicroVMConfig(), ctx), VMBackend(VMConfig(), ctx)):
        assert b.memory_snapshots and b.accel is None  # not started: no probe yet
        assert b.status().accel is None
    assert not ContainerBackend.memory_snapshots and ContainerBackend.accel is None
