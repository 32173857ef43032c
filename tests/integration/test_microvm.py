"""The microVM backend on a real node: QEMU (TCG on this host), the Debian cloud kernel,
corral-init over virtio-serial. One node per module; the kernel is fetched once into a
cache kept between runs (/var/cache/corral-test-microvm)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from tests.conftest import TAG
from tests.integration.conftest import assert_no_leaks, node_config, open_node, run_bench
from tests.integration.nethosts import PKGS_IP, TestHosts, guest_http, network_config

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs QEMU"),
    pytest.mark.skipif(not Path("/bin/busybox").exists(), reason="needs busybox-static"),
]

STATE = Path(f"/var/lib/corral-test{TAG}-vm")
RUN = Path(f"/run/corral-test{TAG}-vm")
SUBTREE = f"corral-test{TAG}-vm"
KERNEL = Path("/var/cache/corral-test-microvm/kernel")


def _cfg(suffix: str = "", network=None, **vm):  # type: ignore[no-untyped-def]
    from corral.backends.config import ContainerConfig, MicroVMConfig

    extra = {"network": network} if network is not None else {}
    return node_config(
        state_dir=Path(f"{STATE}{suffix}"),
        run_dir=Path(f"{RUN}{suffix}"),
        cgroup_subtree=SUBTREE + suffix,
        backends=[ContainerConfig(), MicroVMConfig(kernel_dir=KERNEL, **vm)],
        **extra,
    )


@pytest.fixture(scope="module")
def hosts():  # type: ignore[no-untyped-def]
    with TestHosts() as h:
        yield h


@pytest.fixture(scope="module")
async def vmnode(images_ready, hosts):  # type: ignore[no-untyped-def]
    # the test hosts' subnet is the network tests' own: this module's differs
    async with open_node(_cfg(network=network_config(subnet="10.212.16.0/22"))) as n:
        yield n
    assert_no_leaks(STATE, RUN, SUBTREE)


# this module's state dirs: corral-test{TAG}-vm{suffix}/, not another run's tag
_MINE = re.compile(rb"corral-test" + re.escape(TAG.encode()) + rb"-vm[a-z0-9]*/")


def _vmm_procs() -> list[int]:
    """QEMU processes whose command line names this module's state dirs."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(b"qemu-system") and _MINE.search(cmd):
            out.append(int(p))
    return out


def _spec(**kw):  # type: ignore[no-untyped-def]
    from corral.spec import Limits, SandboxSpec

    return SandboxSpec(
        image="test/busybox",
        backend="microvm",
        limits=Limits(cpus=1, memory="256MiB", disk="256MiB"),
        qos="latency",  # TCG boots on a busy 2-core host: not on idle CPU only
        **kw,
    )


async def test_node_status_lists_the_backends_and_accelerator(vmnode):  # type: ignore[no-untyped-def]
    """``corral node status``'s source: every engine of the node, the microVM one with its
    accelerator (kvm when a probe boot worked, else tcg) and how it gives layers."""
    from corral.cli.node import _backend_row

    st = await vmnode.node_status()
    by_kind = {b.kind: b for b in st.backends}
    assert set(by_kind) == {"container", "microvm"}, st.backends
    vm = by_kind["microvm"]
    assert vm.ok and vm.accel in ("kvm", "tcg") and vm.detail["layers"], vm
    key, value = _backend_row(vm, st.default_backend)
    assert key == "backend microvm" and value.startswith(f"ok (accel={vm.accel}, "), value


async def test_create_exec_files_destroy(vmnode):  # type: ignore[no-untyped-def]
    status = vmnode.backends.get("microvm").status()
    assert status.ok and status.accel in ("kvm", "tcg")
    from corral.spec import ExecRequest

    info = await vmnode.sandbox_create(_spec())
    try:
        assert info.accel == status.accel and info.backend == "microvm"
        # under TCG QEMU was started through corral-nothp: THP off (kept across its exec)
        b = vmnode.backends.get("microvm")
        thp = Path(f"/proc/{b.vmm_pid(info.id)}/status").read_text()
        assert ("THP_enabled:\t0" in thp) == (status.accel == "tcg"), thp
        # the image's layers are mapped from the store's files as pmem, mounted with DAX
        assert info.layer_access == "dax", info
        r = await vmnode.exec(info.id, ExecRequest(cmd=["sh", "-c", "ls /sys/block"]))
        assert b"pmem0" in r.stdout, r
        d = vmnode.backends.get("microvm").dir(info.id)
        r = await vmnode.exec(info.id, ExecRequest(cmd=["cat", "/proc/sys/kernel/osrelease"]))
        assert r.exit_code == 0, r
        # the guest's own kernel, not the host's
        assert r.stdout.strip().endswith(b"cloud-amd64"), r.stdout
        assert r.stdout.strip().decode() != os.uname().release
        cmd = ["sh", "-c", "echo hi > /tmp/x; cat /tmp/x; id -u"]
        r = await vmnode.exec(info.id, ExecRequest(cmd=cmd))
        assert r.stdout == b"hi\n0\n", r
        await vmnode.file_write(info.id, "/root/f.txt", b"hello\x00bytes")
        assert await vmnode.file_read(info.id, "/root/f.txt") == b"hello\x00bytes"
        assert await vmnode.file_read(info.id, "/root/f.txt", 5, 3) == b"\x00by"
        await vmnode.file_write(info.id, "/new/dir/g", b"made")  # parents made, as containers
        assert await vmnode.file_read(info.id, "/new/dir/g") == b"made"
        st = await vmnode.file_stat(info.id, "/root/f.txt")
        assert st.type == "file" and st.size == 11
        names = [s.name for s in await vmnode.file_list(info.id, "/root")]
        assert "f.txt" in names
        from corral.errors import NotFound

        with pytest.raises(NotFound):
            await vmnode.file_read(info.id, "/nope")
        await vmnode.file_mkdir(info.id, "/root/a/b")
        assert (await vmnode.file_stat(info.id, "/root/a/b")).type == "dir"
        await vmnode.file_mkdir(info.id, "/root/o/p", True, 0o750, 1000, 1001)  # an owner
        for made in ("/root/o", "/root/o/p"):
            st = await vmnode.file_stat(info.id, made)
            assert (st.uid, st.gid) == (1000, 1001), made
        assert (await vmnode.file_stat(info.id, "/root")).uid == 0
        await vmnode.file_remove(info.id, "/root/o", recursive=True)
        tar = await vmnode.file_download_tar(info.id, "/root")
        await vmnode.file_remove(info.id, "/root/a", recursive=True)
        with pytest.raises(NotFound):
            await vmnode.file_stat(info.id, "/root/a")
        await vmnode.file_upload_tar(info.id, "/work/copy", tar)
        assert await vmnode.file_read(info.id, "/work/copy/f.txt") == b"hello\x00bytes"
        # 768 KiB in and out: many frames each way through both multiplexers
        big = bytes(range(256)) * 3072
        r = await vmnode.exec(info.id, ExecRequest(cmd=["cat"], stdin=big))
        assert r.exit_code == 0, r.reason
        assert r.stdout == big
        assert (d / "vm.sock").exists() and (d / "disk.img").exists()
        # the jail: QEMU in the sandbox's cgroup and a netns of its own, chrooted into the
        # sandbox dir, not root
        (pid,) = _vmm_procs()
        b = vmnode.backends.get("microvm")
        assert pid in b.cgroups.procs(info.id) and pid == b.vmm_pid(info.id)
        # the node's pid is the netns holder's (it outlives QEMU in a memory-snapshot pause)
        assert os.readlink(f"/proc/{info.pid}/ns/net") == os.readlink(f"/proc/{pid}/ns/net")
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/{pid}/root") == str(d)
        status = Path(f"/proc/{pid}/status").read_text()
        uids = status.split("Uid:")[1].split()[:4]
        assert "0" not in uids, uids
        assert "\nSeccomp:\t2\n" in status  # QEMU's -sandbox filter is on
    finally:
        await vmnode.sandbox_destroy(info.id)
    assert not _vmm_procs()
    assert not d.exists()


async def _events(node, sid: str, kind: str, wait: float = 6.0):  # type: ignore[no-untyped-def]
    import asyncio
    import time

    deadline = time.monotonic() + wait
    while True:
        evs = [e for e in await node.events(sid) if e.kind == kind]
        if evs or time.monotonic() > deadline:
            return evs
        await asyncio.sleep(0.2)


async def test_network_default_none_then_allowlist_live(vmnode):  # type: ignore[no-untyped-def]
    """The guest's NIC is a tap in the VMM's netns, NATed to the eth0 the node attaches
    there: no policy, no way out; a named allowlist (granted live) reaches its ``.test``
    host through the node's resolver and nft rules, another host is denied with an event."""
    from corral.node.network import veth_name
    from corral.spec import ExecRequest

    info = await vmnode.sandbox_create(_spec())
    sid = info.id
    try:
        assert info.address is None
        r = await vmnode.exec(sid, ExecRequest(cmd=["cat", "/sys/class/net/eth0/address"]))
        assert r.exit_code == 0 and r.stdout.startswith(b"52:54:"), r
        ok, out = await guest_http(vmnode, sid, PKGS_IP, "/simple/")
        assert not ok, out
        got = await vmnode.network_update(sid, allow=["pkgs"], deny=["npm"])
        assert got.address
        assert Path(f"/sys/class/net/{veth_name(sid)}").exists()
        r = await vmnode.exec(sid, ExecRequest(cmd=["cat", "/etc/resolv.conf"]))
        assert vmnode.network.gateway in r.stdout.decode(), r
        ok, out = await guest_http(vmnode, sid, "pkgs.test", "/simple/")
        assert ok and "tinypkg" in out, out
        ok, out = await guest_http(vmnode, sid, "npm.test")
        assert not ok, out
        assert await _events(vmnode, sid, "dns_denied"), "no dns_denied event for npm.test"
        # an address outside the policy, without DNS: dropped by nft, as for a container
        ok, out = await guest_http(vmnode, sid, "10.250.2.2")
        assert not ok, out
        assert await _events(vmnode, sid, "net_denied"), "no net_denied event"
    finally:
        await vmnode.sandbox_destroy(sid)
    assert not Path(f"/sys/class/net/{veth_name(sid)}").exists()
    assert not _vmm_procs()


async def test_pause_resume_through_the_shared_cgroup_path(vmnode):  # type: ignore[no-untyped-def]
    """The node's freeze (and reclaim) works on a VM as on a container: QEMU is in the
    sandbox's cgroup. The guest's state survives; exec works after resume."""
    from corral.spec import ExecRequest

    info = await vmnode.sandbox_create(_spec())
    try:
        await vmnode.exec(info.id, ExecRequest(cmd=["sh", "-c", "echo kept > /root/s"]))
        paused = await vmnode.sandbox_pause(info.id)
        assert paused.state == "paused"
        b = vmnode.backends.get("microvm")
        assert b.cgroups.is_frozen(info.id)
        await vmnode.sandbox_resume(info.id)
        r = await vmnode.exec(info.id, ExecRequest(cmd=["cat", "/root/s"]))
        assert r.stdout == b"kept\n", r
    finally:
        await vmnode.sandbox_destroy(info.id)
    assert not _vmm_procs()


async def test_pause_with_memory_snapshot_releases_everything(vmnode):  # type: ignore[no-untyped-def]
    """pause(memory_snapshot=True): the machine is saved to a file in the sandbox dir and
    its VMM ends (the cgroup's memory falls to the netns holder's); the next request
    restores it transparently, with its processes and tmpfs intact; resume() restores too.
    What the guest wrote to its disk (host page cache charged to the VM) is released too."""
    from corral.spec import ExecRequest

    info = await vmnode.sandbox_create(_spec())
    sid = info.id
    b = vmnode.backends.get("microvm")
    try:
        bg = await vmnode.spawn(sid, ExecRequest(cmd=["sleep", "600"]))
        cmd = [
            "sh",
            "-c",
            "echo tmpfs-kept > /dev/shm/v; echo disk-kept > /root/d; "
            "dd if=/dev/zero of=/root/big bs=1M count=32 2>/dev/null && sync",
        ]
        assert (await vmnode.exec(sid, ExecRequest(cmd=cmd))).exit_code == 0
        before = b.cgroups.memory_current(sid)
        paused = await vmnode.sandbox_pause(sid, memory_snapshot=True)
        assert paused.state == "paused"
        assert not _vmm_procs() and b.held_in_snapshot(sid) and b.alive(sid)
        after = b.cgroups.memory_current(sid)
        assert after < before * 0.1, (before, after)
        ev = [e for e in await vmnode.events(sid) if e.kind == "paused"][-1]
        assert ev.detail["memory_snapshot"] and ev.detail["snapshot_bytes"] > 0, ev
        # any request restores it (transparent resume)
        r = await vmnode.exec(sid, ExecRequest(cmd=["cat", "/dev/shm/v", "/root/d"]))
        assert r.stdout == b"tmpfs-kept\ndisk-kept\n", r
        assert (await vmnode.process_get(sid, bg.id)).running
        assert not b.held_in_snapshot(sid) and len(_vmm_procs()) == 1
        # again, with an explicit resume
        await vmnode.sandbox_pause(sid, memory_snapshot=True)
        assert not _vmm_procs()
        got = await vmnode.sandbox_resume(sid)
        assert got.state == "running" and len(_vmm_procs()) == 1
        r = await vmnode.exec(sid, ExecRequest(cmd=["cat", "/dev/shm/v"]))
        assert r.stdout == b"tmpfs-kept\n", r
        assert (await vmnode.process_get(sid, bg.id)).running
        # a request racing the save: it waits (or the save waits for it), then it runs
        import asyncio

        _, r = await asyncio.gather(
            vmnode.sandbox_pause(sid, memory_snapshot=True),
            vmnode.exec(sid, ExecRequest(cmd=["cat", "/dev/shm/v"])),
        )
        assert r.stdout == b"tmpfs-kept\n", r
        r = await vmnode.exec(sid, ExecRequest(cmd=["cat", "/dev/shm/v"]))
        assert r.stdout == b"tmpfs-kept\n", r
        # a corrupt snapshot: a clear error, no VMM left, the sandbox still destroyable
        await vmnode.sandbox_pause(sid, memory_snapshot=True)
        snap = b.dir(sid) / "mem.snap"
        with open(snap, "r+b") as f:  # cut short: the stream ends mid-way (no checksums
            f.truncate(snap.stat().st_size // 2)  # in it to catch flipped bytes)
        from corral.errors import CorralError

        with pytest.raises(CorralError, match="restore from mem.snap failed"):
            await vmnode.sandbox_resume(sid)
        assert not _vmm_procs()
        # still saved and paused (not "running" with no VMM, which the reaper would take
        # for a dead sandbox and destroy under the caller)
        assert (await vmnode.sandbox_get(sid)).state == "paused"
        assert b.held_in_snapshot(sid) and b.alive(sid)
    finally:
        await vmnode.sandbox_destroy(sid)
    assert not _vmm_procs()


def _cached_pages(path: Path) -> int:
    """Pages of ``path`` in the host's page cache (util-linux fincore)."""
    import subprocess

    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "PAGES", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out.split()[0])


async def test_memory_snapshot_pause_hands_shared_layer_cache_to_the_parent(vmnode):  # type: ignore[no-untyped-def]
    """The first VM on a cold layer reads the layer file into the host's page cache, so
    that cache is charged to its cgroup; a second VM uses the same pages. Paused with a
    memory snapshot, the first one's cgroup is made anew: its charge falls to ~0 while
    the pages stay cached for the second (the old charge went to the parent, as at a
    destroy), its limits and counters carry over, and it restores and is destroyed as
    before."""
    from corral.spec import ExecRequest

    b = vmnode.backends.get("microvm")
    layers = [b.ctx.store.path_of(d) for d in (await vmnode.image_get("test/busybox")).layers]
    for p in layers:  # cold: the first VM's QEMU reads the layers in
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    first = await vmnode.sandbox_create(_spec())
    sibling = await vmnode.sandbox_create(_spec())
    sid = first.id
    try:
        read = "cat /bin/busybox /etc/* > /dev/null 2>&1; echo ok"
        for i in (sid, sibling.id):
            r = await vmnode.exec(i, ExecRequest(cmd=["sh", "-c", read]))
            assert r.stdout == b"ok\n", r
        cached = sum(_cached_pages(p) for p in layers)
        assert cached > 0
        assert b.cgroups.memory_breakdown(sid)["file"] > 0  # the layer cache it read first
        limits = b.cgroups.settings(sid)
        cpu_before = (await vmnode.sandbox_get(sid)).cpu_seconds
        before = b.cgroups.memory_current(sid)
        await vmnode.sandbox_pause(sid, memory_snapshot=True)
        after = b.cgroups.memory_current(sid)
        assert after < before * 0.01, (before, after)
        ev = [e for e in await vmnode.events(sid) if e.kind == "paused"][-1]
        assert ev.detail["recycled_cgroup_bytes"] > after, ev
        assert b.cgroups.settings(sid) == limits  # same limits on the new cgroup
        assert not b.cgroups.recycling(sid) and b.alive(sid)
        assert sum(_cached_pages(p) for p in layers) == cached  # kept for the sibling
        got = await vmnode.sandbox_get(sid)
        assert got.state == "paused" and got.cpu_seconds >= cpu_before, (got, cpu_before)
        r = await vmnode.exec(sibling.id, ExecRequest(cmd=["sh", "-c", read]))
        assert r.stdout == b"ok\n", r
        # restored into the new cgroup (QEMU in it: its meters count again)
        r = await vmnode.exec(sid, ExecRequest(cmd=["sh", "-c", read]))
        assert r.stdout == b"ok\n", r
        assert b.vmm_pid(sid) in b.cgroups.procs(sid)
        assert b.cgroups.memory_current(sid) > after
        # destroy of a VM that is paused again
        await vmnode.sandbox_pause(sid, memory_snapshot=True)
        await vmnode.sandbox_destroy(sid)
        assert not b.cgroups.exists(sid) and not b.cgroups.recycling(sid)
    finally:
        for i in (sid, sibling.id):
            with contextlib.suppress(Exception):
                await vmnode.sandbox_destroy(i)
    assert not _vmm_procs()


async def test_fork_carries_processes_and_memory(vmnode):  # type: ignore[no-untyped-def]
    """fork(2) of a running microVM: each child is restored from one memory snapshot of
    the parent plus a btrfs copy of its disk, so a running process, a tmpfs value and a
    file carry over; each child has its own MAC and its own VMM; the parent runs on."""
    from corral.spec import ExecRequest, ForkRequest

    info = await vmnode.sandbox_create(_spec())
    sid = info.id
    kids: list[str] = []
    try:
        bg = await vmnode.spawn(sid, ExecRequest(cmd=["sleep", "600"]))
        cmd = ["sh", "-c", "echo shm > /dev/shm/v; echo disk > /root/d"]
        assert (await vmnode.exec(sid, ExecRequest(cmd=cmd))).exit_code == 0
        made = await vmnode.sandbox_fork(sid, ForkRequest(count=2))
        kids = [k.id for k in made]
        assert len(kids) == 2 and len(_vmm_procs()) == 3
        macs = set()
        for k in kids:
            r = await vmnode.exec(k, ExecRequest(cmd=["cat", "/dev/shm/v", "/root/d"]))
            assert r.stdout == b"shm\ndisk\n", r
            assert (await vmnode.process_get(k, bg.id)).running
            r = await vmnode.exec(k, ExecRequest(cmd=["cat", "/sys/class/net/eth0/address"]))
            macs.add(r.stdout.strip())
            # the child's writes are its own
            await vmnode.exec(k, ExecRequest(cmd=["sh", "-c", f"echo {k} > /root/d"]))
        r = await vmnode.exec(sid, ExecRequest(cmd=["cat", "/root/d"]))
        assert r.stdout == b"disk\n", r
        r = await vmnode.exec(sid, ExecRequest(cmd=["cat", "/sys/class/net/eth0/address"]))
        macs.add(r.stdout.strip())
        assert len(macs) == 3, macs
        assert (await vmnode.process_get(sid, bg.id)).running
    finally:
        for k in kids:
            await vmnode.sandbox_destroy(k)
        await vmnode.sandbox_destroy(sid)
    assert not _vmm_procs()


async def test_stream_pty_shell_and_limits_in_a_microvm(vmnode):  # type: ignore[no-untyped-def]
    """The SDK's other ways in, on a microVM: exec_stream, a pty, and sb.shell() (the
    guest's corral-init, the same C program, runs the session's shell with a stdin pipe
    and lets the node attach to it; state kept between commands, a command's stdin goes
    through a file in the guest, a timeout interrupts the command and keeps the session,
    close ends the shell). The limits hold inside the guest: its cpus, its memory, and
    its disk (the writable disk is the disk limit: a bigger write is ENOSPC)."""
    import asyncio

    import corral

    async with corral.AsyncClient(ops=vmnode, own_ops=False) as c:
        sb = await c.sandboxes.create(
            image="test/busybox",
            backend="microvm",
            limits=corral.Limits(cpus=1, memory="256MiB", disk="64MiB"),
            qos="latency",
        )
        try:
            chunks = []
            async with sb.exec_stream(["sh", "-c", "echo a; echo b >&2; echo c"]) as st:
                async for ch in st:
                    chunks.append((ch.stream, ch.data))
            assert b"".join(d for s, d in chunks if s == "stdout") == b"a\nc\n", chunks
            assert st.result.exit_code == 0
            async with await sb.pty(["/bin/sh"]) as t:
                await t.write(b"tty; echo $((6*7)); exit 3\n")
                out = bytearray()
                async with asyncio.timeout(60):
                    async for d in t:
                        out += d
            assert b"/dev/pts/" in out and b"42" in out, bytes(out)
            assert t.result is not None and t.result.exit_code == 3, t.result

            sh = await sb.shell(cwd="/tmp")
            await sh.run("x=1; f() { echo fn; }; cd /")
            r = await sh.run("echo $x; f; pwd; printf tail")
            assert (r.stdout, r.exit_code) == (b"1\nfn\n/\ntail", 0), r
            r = await sh.run("sleep 300", timeout=1)
            assert (r.reason, r.signal) == ("timeout", 2), r
            r = await sh.run("echo $x; cat", stdin=b"in")
            assert (r.stdout, r.exit_code) == (b"1\nin", 0), r
            await sh.close()
            ps = await sb.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
            assert b"corral-shell" not in ps.stdout, ps

            # the same image's files in a container of the same node
            same = ["sh", "-c", "ls -l /bin | md5sum; md5sum $(readlink -f /bin/sh) 2>&1"]
            async with await c.sandboxes.create(image="test/busybox") as ctr:
                assert ctr.info.accel is None and ctr.info.backend == "container"
                in_ctr = (await ctr.exec(same)).stdout
            in_vm = (await sb.exec(same)).stdout
            assert in_vm == in_ctr and in_vm.count(b"\n") == 2, (in_vm, in_ctr)

            r = await sb.exec(["sh", "-c", "nproc; grep MemTotal /proc/meminfo"])
            cpus, mem = r.stdout.decode().splitlines()
            assert cpus == "1" and int(mem.split()[1]) <= 256 * 1024, r.stdout
            r = await sb.exec(["sh", "-c", "dd if=/dev/zero of=/root/big bs=1M count=100"])
            assert r.exit_code != 0 and b"No space left" in r.stderr, r
        finally:
            await sb.destroy()
    assert not _vmm_procs()


_CHANGES = (
    "mkdir -p /data/sub && echo hello > /data/f && ln /data/f /data/h && ln -s f /data/l"
    " && chown 1000:1000 /data/f && chmod 4750 /data/f && mknod /data/fifo p"
    " && rm /bin/yes /etc/group && rmdir /work && mkdir /work && echo x > /work/only"
)
_LISTING = (
    "cat /data/h; readlink /data/l; stat -c '%u %a %h' /data/f; ls /work; test -p /data/fifo"
    " && echo fifo; test -e /bin/yes || echo yes-gone; test -e /etc/group || echo group-gone;"
    " ls -a /.corral | grep -c upper"
)
_EXPECTED = "hello\nf\n1000 4750 2\nonly\nfifo\nyes-gone\ngroup-gone\n"


async def test_snapshot_to_a_layer_then_container_and_microvm(vmnode):  # type: ignore[no-untyped-def]
    """snapshot() of a microVM: the guest streams its overlay upper out through the agent
    (the host never mounts its disk), the node packs it as it packs a container's. A
    container and a microVM made from the new image both see the files, the hardlink, the
    owner and setuid bit, a deleted image file (a whiteout) and a directory that replaced
    the image's (opaque)."""
    from corral.host import mounts
    from corral.spec import ExecRequest, SandboxSpec

    async def sh(sid: str, script: str, ok: tuple[int, ...] = (0,)) -> str:
        r = await vmnode.exec(sid, ExecRequest(cmd=["sh", "-c", script]))
        assert r.exit_code in ok, r
        return r.stdout.decode()

    src = await vmnode.sandbox_create(_spec())
    try:
        assert (await sh(src.id, _CHANGES + " && echo ok")) == "ok\n"
        assert (await sh(src.id, _LISTING)).startswith(_EXPECTED)
        snap = await vmnode.sandbox_snapshot(src.id, name="vmtest/snap:one")
        assert snap.layers[:-1] == src.layers and len(snap.layers) == len(src.layers) + 1
        layer = vmnode.store.layer(snap.layers[-1])
        assert layer.kind == "snapshot" and layer.source == src.id
        await sh(src.id, "echo after > /data/after")  # the source runs on
        # the layer: image-relative owners, the whiteouts, the opaque dir, no corral files
        probe = vmnode.config.state_dir / "probe"
        probe.mkdir(exist_ok=True)
        mounts.mount_erofs(vmnode.store.path_of(snap.layers[-1]), probe)
        try:
            assert os.stat(probe / "data/f").st_uid == 1000 and os.stat(probe).st_uid == 0
            assert not (probe / ".corral").exists()
            for gone in ("bin/yes", "etc/group"):
                wh = os.lstat(probe / gone)
                assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0, gone
            assert os.getxattr(probe / "work", "trusted.overlay.opaque") == b"y"
        finally:
            mounts.umount(probe)
            probe.rmdir()
    finally:
        await vmnode.sandbox_destroy(src.id)
    for backend in ("container", "microvm"):
        spec = _spec() if backend == "microvm" else SandboxSpec(image="test/busybox")
        copy = await vmnode.sandbox_create(spec.model_copy(update={"image": snap.name}))
        try:
            out = await sh(copy.id, _LISTING + "; test -e /data/after || echo after-absent")
            # (grep -c of nothing exits 1: the last command decides)
            # corral's own files are not in the layer (/.corral/upper: a microVM's mount only)
            want_upper = "1" if backend == "microvm" else "0"
            assert out == _EXPECTED + f"{want_upper}\nafter-absent\n", (backend, out)
        finally:
            await vmnode.sandbox_destroy(copy.id)
    assert not _vmm_procs()


_UNSHARED = ["/.corral/busybox", "unshare", "-m", "sh", "-c"]
_CG = "B=/.corral/busybox; G=/sys/fs/cgroup; $B mount -t cgroup2 none $G && "
"""The guest's cgroup2 tree at $G, for a script run under :data:`_UNSHARED` (a mount
namespace of its own: the guest's one tree, mounted where no one else sees it)."""


async def test_snapshot_freezes_the_guest_while_it_streams(vmnode):  # type: ignore[no-untyped-def]
    """Processes writing while a snapshot streams the guest's upper dir out: the guest's
    processes are frozen meanwhile, so the layer holds one instant of them. One writer
    puts a round number into 40 files in turn, round after round: in the layer the files
    hold round n up to some file and n-1 after it (read one by one while the writer ran,
    they would span several rounds). Another rewrites a 1 MiB file with one write() of
    all-A or all-B: whole in the layer. Both run on once it is done. The second runs in a
    cgroup the guest made itself, two levels down (as Docker in the VM would put it): it
    is frozen where it is and thawed after; a guest cgroup the guest froze itself (a
    ``docker pause``) stays frozen. (No Docker in the test image: the test makes the
    cgroups the way it would.)"""
    from corral.backends.microvm import freeze
    from corral.host import mounts
    from corral.spec import ExecRequest

    async def sh(sid: str, script: str) -> str:
        r = await vmnode.exec(sid, ExecRequest(cmd=["sh", "-c", script]))
        assert r.exit_code == 0, r
        return r.stdout.decode()

    src = await vmnode.sandbox_create(_spec())
    try:
        await sh(
            src.id,
            "mkdir -p /data/s && for c in A B; do dd if=/dev/zero bs=1M count=1 2>/dev/null"
            " | tr '\\0' $c > /dev/shm/$c; done && cp /dev/shm/A /data/f",
        )
        whole = (  # one write() of 1 MiB per copy (dd bs=1M from tmpfs), in place
            "while :; do for c in A B; do"
            " dd if=/dev/shm/$c of=/data/f bs=1M count=1 conv=notrunc 2>/dev/null; done; done"
        )
        rounds = (
            "all=$(seq 1 40); n=0; while :; do n=$((n + 1));"
            " for i in $all; do echo $n > /data/s/$i; done; done"
        )

        async def cg(script: str) -> str:
            r = await vmnode.exec(src.id, ExecRequest(cmd=[*_UNSHARED, _CG + script]))
            assert r.exit_code == 0, r
            return r.stdout.decode()

        # the writer of the 1 MiB file in a cgroup of the guest's own, two levels down
        await cg("$B mkdir -p $G/mine/a $G/held")
        own = _CG + 'echo $$ > $G/mine/a/cgroup.procs && exec sh -c "$0"'
        await vmnode.spawn(src.id, ExecRequest(cmd=[*_UNSHARED, own, whole]))
        await vmnode.spawn(src.id, ExecRequest(cmd=["sh", "-c", rounds]))
        await cg("until grep -q . $G/mine/a/cgroup.procs; do :; done")  # (size 0 in stat)
        held = _CG + "echo $$ > $G/held/cgroup.procs && echo 1 > $G/held/cgroup.freeze && sleep 600"
        await vmnode.spawn(src.id, ExecRequest(cmd=[*_UNSHARED, held]))
        await cg('until grep -q "^frozen 1" $G/held/cgroup.events; do :; done')
        await sh(src.id, 'until [ "$(cat /data/s/40 2>/dev/null)" -gt 2 ] 2>/dev/null; do :; done')
        snap = await vmnode.sandbox_snapshot(src.id, name="vmtest/snap:frozen")
        probe = vmnode.config.state_dir / "probe-frozen"
        probe.mkdir(exist_ok=True)
        mounts.mount_erofs(vmnode.store.path_of(snap.layers[-1]), probe)
        try:
            data = (probe / "data/f").read_bytes()
            seen = [(probe / f"data/s/{i}").read_text().strip() for i in range(1, 41)]
        finally:
            mounts.umount(probe)
            probe.rmdir()
        assert len(data) == 1 << 20 and set(data) in ({ord("A")}, {ord("B")}), set(data)
        # one file may be caught between its truncate and its write (empty)
        got = [int(v) for v in seen if v]
        assert len(got) >= 39 and got == sorted(got, reverse=True), seen
        assert got[0] - got[-1] <= 1, seen
        # thawed: the writer goes on, and the freezer cgroup is gone
        # (the writer may have the file truncated and not yet written: read until not empty)
        n = int(await sh(src.id, 'until v=$(cat /data/s/40) && [ -n "$v" ]; do :; done; echo $v'))
        await sh(src.id, f'until [ "$(cat /data/s/40)" -gt {n} ] 2>/dev/null; do :; done')
        left = await sh(
            src.id,
            "/.corral/busybox unshare -m sh -c 'mount -t cgroup2 none /sys/fs/cgroup"
            " && ls /sys/fs/cgroup | grep -c corral-snapshot || true'",
        )
        assert left.strip() == "0", left
        # the guest's own: the writer's thawed where it was, the guest's freeze kept
        state = await cg(
            "cat $G/mine/cgroup.freeze $G/held/cgroup.freeze"
            f" && grep frozen $G/mine/a/cgroup.events && test ! -e {freeze.FROZEN}"
        )
        assert state == "0\n1\nfrozen 0\n", state
        f0 = await sh(src.id, "md5sum < /data/f")
        await sh(src.id, f'until [ "$(md5sum < /data/f)" != "{f0}" ]; do :; done')
    finally:
        await vmnode.sandbox_destroy(src.id)
    assert not _vmm_procs()


async def test_snapshot_of_a_hostile_guest_is_refused(vmnode):  # type: ignore[no-untyped-def]
    """A guest that replaces its tar streamer (it owns its root) and sends a crafted
    archive: the snapshot fails with a clear error, nothing is written outside the scratch
    dir, the sandbox runs on."""
    from corral.errors import SandboxError
    from corral.spec import ExecRequest

    sb = await vmnode.sandbox_create(_spec())
    try:
        # /.corral is read-only in the guest, but its root can mount over it
        evil = (
            "B=/.corral/busybox; mkdir -p /tmp/e/real && cd /tmp/e && echo pwned > real/pwned"
            " && $B ln -s real up && $B tar -cf /tmp/evil.tar up up/pwned"
            " && printf '#!/.corral/busybox sh\\n/.corral/busybox cat /tmp/evil.tar\\n'"
            " > /tmp/tar && chmod 755 /tmp/tar && $B mount --bind /tmp/tar /.corral/tar"
            " && echo ok"
        )
        r = await vmnode.exec(sb.id, ExecRequest(cmd=["sh", "-c", evil]))
        assert r.stdout == b"ok\n", r
        with pytest.raises(SandboxError, match="guest upper tar: .*refused"):
            await vmnode.sandbox_snapshot(sb.id)
        r = await vmnode.exec(sb.id, ExecRequest(cmd=["true"]))
        assert r.exit_code == 0, r
    finally:
        await vmnode.sandbox_destroy(sb.id)


_ATTACKS = r"""
B=/.corral/busybox
for d in /sys/block/vd*; do
  [ "$($B cat $d/serial)" = l0 ] && layer=/dev/${d##*/}
done
[ -n "$layer" ] || layer=/dev/pmem0  # a DAX boot: the layer is guest memory
$B blockdev --setrw "$layer" 2>/dev/null
before=$($B dd if="$layer" bs=4096 count=1 2>/dev/null | $B md5sum)
if $B dd if=/dev/zero of="$layer" bs=4096 count=1 conv=fsync 2>/dev/null; then
  echo "LAYER-WRITTEN"
  # the zeros are in the guest's own block cache of the device (EROFS reads its metadata
  # there: left in place they make the guest's next path lookup fail, EUCLEAN); dropped,
  # the device reads as before if the write went nowhere
  $B blockdev --flushbufs "$layer"
  after=$($B dd if="$layer" bs=4096 count=1 2>/dev/null | $B md5sum)
  [ "$after" = "$before" ] && echo "layer-unchanged" || echo "LAYER-CHANGED"
else
  echo "layer-refused"
fi
for p in /sys/class/virtio-ports/*; do
  [ "$($B cat $p/name)" = corral.ctl ] && port=/dev/${p##*/}
done
# a forged frame on the node's channel: open(2) of the port corral-init holds
if $B printf '\0\0\0\1d\0\0\0\4abcd' > "$port" 2>/dev/null; then
  echo "PORT-OPENED"
else
  echo "port-refused"
fi
"""


async def test_guest_attacks_stay_in_the_vm(vmnode):  # type: ignore[no-untyped-def]
    """Root in the guest: the layers cannot be written (virtio-blk disks read-only to QEMU,
    pmem ranges a read-only mapping; the host's layer file unchanged); the node's virtio-serial port cannot be opened a second time
    (no forged frames beside corral-init's); a console flood lands in the sandbox's own
    subvolume (under its disk quota); a memory bomb is the guest kernel's OOM, not the
    host's: QEMU lives on and answers."""
    import hashlib

    from corral.spec import ExecRequest

    info = await vmnode.sandbox_create(_spec())
    sid = info.id
    b = vmnode.backends.get("microvm")
    image = await vmnode.image_get("test/busybox")
    layer = vmnode.store.path_of(image.layers[0])
    digest = hashlib.sha256(layer.read_bytes()).hexdigest()
    try:
        r = await vmnode.exec(sid, ExecRequest(cmd=["/.corral/busybox", "sh", "-c", _ATTACKS]))
        assert b"port-refused" in r.stdout, r
        # virtio-blk: the write fails; pmem: the guest's write goes nowhere (QEMU maps
        # the store's file read-only as ROM): the guest may believe it wrote, but once
        # it drops its block cache the device reads as before
        if info.layer_access == "dax":
            assert b"layer-unchanged" in r.stdout, r
        else:
            assert b"layer-refused" in r.stdout, r
        assert hashlib.sha256(layer.read_bytes()).hexdigest() == digest
        # console flood: 1 MiB to the serial console
        flood = "/.corral/busybox head -c 1048576 /dev/zero | /.corral/busybox tr '\\0' A"
        r = await vmnode.exec(
            sid, ExecRequest(cmd=["/.corral/busybox", "sh", "-c", flood + " > /dev/console"])
        )
        assert r.exit_code == 0, r
        console = b.dir(sid) / "console.log"
        assert console.stat().st_size >= 1 << 20
        # memory bomb: 512 MiB in a 256 MiB guest
        bomb = "x=$(/.corral/busybox head -c 536870912 /dev/zero | /.corral/busybox tr '\\0' a)"
        await vmnode.exec(sid, ExecRequest(cmd=["/.corral/busybox", "sh", "-c", bomb], timeout=120))
        assert b.alive(sid) and b.cgroups.oom_kills(sid) == 0
        r = await vmnode.exec(sid, ExecRequest(cmd=["echo", "alive"]))
        assert r.stdout == b"alive\n", r
    finally:
        await vmnode.sandbox_destroy(sid)
    assert not _vmm_procs()


async def test_guest_that_never_answers(images_ready, tmp_path):  # type: ignore[no-untyped-def]
    """A guest whose agent never comes up: a clear timeout, the VMM killed, nothing left.
    (Here: a boot timeout far below what a TCG boot takes.)"""
    from corral.errors import CorralError

    # accel given: no second probe boot on this node's fresh state dir
    async with open_node(_cfg("t", boot_timeout=0.5, accel="tcg")) as n:
        with pytest.raises(CorralError) as e:
            await n.sandbox_create(_spec())
        assert "did not answer within 0.5 s" in str(e.value)
        assert "VMM killed" in str(e.value)
        assert not _vmm_procs()
        assert await n.sandbox_list() == []
        assert not [p for p in n.config.state_dir.glob("scratch/sb-*")]
    assert_no_leaks(Path(f"{STATE}t"), Path(f"{RUN}t"), SUBTREE + "t")
    shutil.rmtree(f"{STATE}t")


async def test_adopt_after_restart(images_ready):  # type: ignore[no-untyped-def]
    """A node that closes leaves its VMs running; the next one adopts them over a new
    connection to QEMU's socket (the guest's mux drops the old channels on reset). A VM
    paused with a memory snapshot stays paused, with its cgroup's limits, and its first
    request restores it; one whose cgroup recycle was cut short (the node died between
    moving the holder out and making the cgroup again) is completed at adopt."""
    from corral.node import Node
    from corral.spec import ExecRequest

    cfg = _cfg("r", accel="tcg")
    node = await Node.open(cfg)
    try:
        await node.gc(everything=True)
        info = await node.sandbox_create(_spec())
        await node.file_write(info.id, "/root/kept", b"before")
        saved = await node.sandbox_create(_spec())
        await node.file_write(saved.id, "/root/kept", b"saved")
        await node.sandbox_pause(saved.id, memory_snapshot=True)
        cg = node.backends.get("microvm").cgroups
        limits = cg.settings(saved.id)
    finally:
        await node.close()
    assert len(_vmm_procs()) == 1  # the running one, without a node
    # cut a recycle short by hand: the holder in the sibling, the cgroup gone
    d = cg.control_file("memory", saved.id, "cgroup.procs").parent
    tmp = d.with_name(saved.id + ".recycle")
    tmp.mkdir()
    for pid in cg.procs(saved.id):
        (tmp / "cgroup.procs").write_text(str(pid))
    d.rmdir()
    node = await Node.open(cfg)
    try:
        got = await node.sandbox_get(info.id)
        assert got.state == "running", got
        r = await node.exec(info.id, ExecRequest(cmd=["cat", "/root/kept"]))
        assert r.stdout == b"before", r
        await node.sandbox_destroy(info.id)
        assert not _vmm_procs()
        got = await node.sandbox_get(saved.id)
        assert got.state == "paused", got
        assert not tmp.exists() and cg.settings(saved.id) == limits
        r = await node.exec(saved.id, ExecRequest(cmd=["cat", "/root/kept"]))
        assert r.stdout == b"saved", r
        assert len(_vmm_procs()) == 1
        assert (await node.sandbox_get(saved.id)).state == "running"
        await node.sandbox_destroy(saved.id)
        assert not _vmm_procs()
    finally:
        for i in await node.sandbox_list():
            await node.sandbox_destroy(i.id)
        await node.close()
    assert_no_leaks(Path(f"{STATE}r"), Path(f"{RUN}r"), SUBTREE + "r")
    shutil.rmtree(f"{STATE}r")
    shutil.rmtree(f"{RUN}r", ignore_errors=True)


@pytest.mark.heavy
def test_bench_microvm_keys(images_ready):  # type: ignore[no-untyped-def]
    """``corral bench microvm --json``: the issue's keys, measured ones filled."""
    from tests.conftest import TEST_STORE

    state, run, sub = Path(f"{STATE}b"), Path(f"{RUN}b"), SUBTREE + "b"
    out = run_bench(
        "microvm", "--count", "2", "--kernel-dir", str(KERNEL),
        state=state, run=run, subtree=sub, store=TEST_STORE, image="test/busybox",
        timeout=600,
    )  # fmt: skip
    assert out["scenario"] == "microvm" and out["accel"] in ("kvm", "tcg")
    assert out["boot_to_exec_ms"]["p50"] > 0 and out["exec_p50_ms"] > 0
    assert out["host_mem_per_vm_mib"] > 0 and out["container_boot_to_exec_ms"] > 0
    assert "dax" in out and out["fork_per_s"] > 0
    assert 0.5 < out["pause_released_fraction"] <= 1.0, out
    assert set(out["pause_left_mib"]) == {"anon", "file", "kernel", "swap"}, out
    # the paused VM's cgroup is made anew: what it held went to the parent
    assert out["pause_recycled_mib"] >= 0 and 0 < out["pause_released_before_recycle"] <= 1
    assert out["snapshot_resume_to_exec_ms"] > 0
    assert_no_leaks(state, run, sub)
    shutil.rmtree(state)
    shutil.rmtree(run, ignore_errors=True)


async def test_kernel_missing_is_a_clear_error_and_the_node_runs(images_ready, tmp_path):  # type: ignore[no-untyped-def]
    from corral.errors import CorralError

    cfg = _cfg("k", accel="tcg")
    cfg.backends[1] = cfg.backends[1].model_copy(
        update={"kernel_dir": tmp_path / "none", "fetch_kernel": False}
    )
    async with open_node(cfg) as n:
        st = n.backends.get("microvm").status()
        assert not st.ok and "no kernel under" in st.detail["error"]
        with pytest.raises(CorralError, match="microvm backend unavailable: .*no kernel"):
            await n.sandbox_create(_spec())
        assert n.backends.get("container").status().ok
    assert_no_leaks(Path(f"{STATE}k"), Path(f"{RUN}k"), SUBTREE + "k")
    shutil.rmtree(f"{STATE}k")
