"""corral's own launcher (corral.host.launch) enforces what the OCI runtime enforced.

Every property test runs against both ways of starting a sandbox (``runtime`` crun and
launch, one node each), from inside the guest where the property is visible there and
from the host where it is a cgroup value. Then: the launcher's seccomp filter is crun's,
byte for byte; a launcher killed at any step leaves nothing ``node gc`` cannot remove; a
restarted node finds a launched sandbox's init again.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral.backends.config import ContainerConfig
from corral.errors import PathRefused, SandboxNotFound
from corral.host import sched
from corral.policy.caps import GUEST_CAPS, cap_mask
from corral.spec import ExecRequest, ExecResult, Limits, SandboxSpec
from tests.conftest import TEST_RUN, TEST_STATE, TEST_SUBTREE
from tests.integration.conftest import assert_no_leaks, node_config, open_node
from tests.integration.test_qos import PROBE as QOS_PROBE

RUNTIMES = ["crun", "launch"]
BUSYBOX = "test/busybox"
DEBIAN = "test/debian"


def _dirs(suffix: str) -> dict[str, Any]:
    return dict(
        state_dir=Path(f"{TEST_STATE}-{suffix}"),
        run_dir=Path(f"{TEST_RUN}-{suffix}"),
        cgroup_subtree=f"{TEST_SUBTREE}-{suffix}",
    )


@pytest.fixture(scope="module", params=RUNTIMES)
async def rt_node(request, images_ready):  # type: ignore[no-untyped-def]
    rt = request.param
    async with open_node(backends=[ContainerConfig(runtime=rt)], **_dirs(f"l{rt[:2]}")) as n:
        assert n.backends.get("container").runtime.name == rt  # type: ignore[union-attr]
        yield n


@contextlib.asynccontextmanager
async def sandbox(node, **spec: Any) -> AsyncIterator[str]:  # type: ignore[no-untyped-def]
    spec.setdefault("image", BUSYBOX)
    info = await node.sandbox_create(SandboxSpec(**spec))
    try:
        yield info.id
    finally:
        await node.sandbox_destroy(info.id)


async def sh(node, sid: str, script: str, timeout: float = 60) -> ExecResult:  # type: ignore[no-untyped-def]
    return await node.exec(sid, ExecRequest(cmd=["sh", "-c", script], timeout=timeout))


def _status(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (ln.partition(":") for ln in text.splitlines())}


# ------------------------------------------------------------------ process properties


async def test_root_is_not_host_root(rt_node) -> None:  # type: ignore[no-untyped-def]
    backend = rt_node.backends.get("container")
    async with sandbox(rt_node) as sid:
        r = await sh(rt_node, sid, "cat /proc/self/uid_map /proc/self/gid_map; id -u")
        lines = [ln.split() for ln in r.stdout.decode().splitlines()]
        assert lines[0] == ["0", str(backend.host_uid), str(backend.id_count)]
        assert lines[1] == lines[0]
        assert lines[2] == ["0"]
        pid = backend.init_pid(sid)
        host = _status(Path(f"/proc/{pid}/status").read_text())
        assert host["Uid"].split() == [str(backend.host_uid)] * 4
        assert host["Gid"].split() == [str(backend.host_uid)] * 4
        assert host["Groups"] == ""


async def test_capabilities_and_no_new_privs(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node) as sid:
        st = _status((await sh(rt_node, sid, "cat /proc/self/status")).stdout.decode())
    want = f"{cap_mask(GUEST_CAPS):016x}"
    assert (st["CapEff"], st["CapPrm"], st["CapBnd"]) == (want, want, want)
    assert st["CapInh"] == st["CapAmb"] == "0" * 16
    assert st["NoNewPrivs"] == "1"
    assert st["Seccomp"] == "2" and st["Seccomp_filters"] == "1"
    assert st["Groups"] == ""


@pytest.mark.parametrize("klass", ["best_effort", "latency"])
async def test_cpu_class(rt_node, klass: str) -> None:  # type: ignore[no-untyped-def]
    """The class's scheduling policy is on every thread of the init before a guest command
    runs (the node sets it under crun, the launcher itself before the init's exec), the
    guest's commands inherit it, and a best-effort guest cannot switch back (RLIMIT_NICE
    0/0)."""
    backend = rt_node.backends.get("container")
    async with sandbox(rt_node, image=DEBIAN, qos=klass) as sid:
        pid = backend.init_pid(sid)
        want = "idle" if klass == "best_effort" else "other"
        assert {sched.policy_of(int(t)) for t in os.listdir(f"/proc/{pid}/task")} == {want}
        r = await rt_node.exec(sid, ExecRequest(cmd=["python3", "-c", QOS_PROBE]))
        assert r.ok, r
        policy, escape, nice = r.stdout.decode().splitlines()
        if klass == "best_effort":
            assert (policy, escape, nice) == (str(os.SCHED_IDLE), "refused", "['0', '0']")
        else:
            assert policy == str(os.SCHED_OTHER)


async def test_guest_signals_start_default(rt_node) -> None:  # type: ignore[no-untyped-def]
    """No ignored signal of the node reaches the sandbox's init (a shell ignores SIGINT for
    a node started with `&`; an ignored disposition survives exec), nor a guest command."""
    import signal

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a node started with `&`
    try:
        async with sandbox(rt_node) as sid:
            pid = rt_node.backends.get("container").init_pid(sid)
            init = _status(Path(f"/proc/{pid}/status").read_text())
            r = await sh(rt_node, sid, "grep -E '^Sig(Ign|Blk)' /proc/self/status")
    finally:
        signal.signal(signal.SIGINT, old)
    sigint = 1 << (signal.SIGINT - 1)
    assert not int(init["SigIgn"], 16) & sigint, init["SigIgn"]
    st = _status(r.stdout.decode())
    ignored = int(st["SigIgn"], 16)
    assert not ignored & (sigint | 1 << (signal.SIGPIPE - 1)), st
    assert st["SigBlk"] == "0" * 16, st


async def test_init_has_a_session_of_its_own(rt_node) -> None:  # type: ignore[no-untyped-def]
    """The sandbox's init is in neither the node's process group nor its session: a signal
    to the node's group (a terminal's Ctrl-C, Ray killing an agent worker's group) must
    not reach the sandbox."""
    async with sandbox(rt_node) as sid:
        pid = rt_node.backends.get("container").init_pid(sid)
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        pgid, session = int(fields[2]), int(fields[3])
    assert pgid != os.getpgid(0) and session != os.getsid(0), (pgid, session)


async def test_rlimits_oom_score_hostname(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node, hostname="box-7") as sid:
        r = await sh(rt_node, sid, "cat /proc/self/limits; cat /proc/1/oom_score_adj; hostname")
    out = r.stdout.decode()
    limits = {ln[:26].strip(): ln[26:].split()[:2] for ln in out.splitlines()[1:18]}
    assert limits["Max open files"][0] == "1024"
    assert limits["Max core file size"] == ["0", "0"]
    assert out.splitlines()[-2:] == ["1000", "box-7"]


async def test_seccomp_denies_and_notifies(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node, image=DEBIAN) as sid:
        # keyctl (denied) -> EPERM; unshare(CLONE_NEWUSER) is a notify rule -> EPERM too.
        r = await sh(
            rt_node,
            sid,
            "python3 -c 'import ctypes; c=ctypes.CDLL(None, use_errno=True); "
            "print(c.syscall(250, 0, 0, 0, 0, 0), ctypes.get_errno()); "
            "print(c.unshare(0x10000000), ctypes.get_errno())'",
        )
        assert r.stdout.decode().split() == ["-1", "1", "-1", "1"], r
        listener = rt_node.security.listener
        if listener is not None:  # the notify path: the node holds the sandbox's listener fd
            assert sid in listener.watched()


async def test_masked_and_readonly_paths(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node) as sid:
        r = await sh(
            rt_node,
            sid,
            "for f in /proc/kcore /proc/kpagecgroup /proc/kpageflags /proc/timer_list "
            "/proc/keys /proc/kallsyms /sys/kernel/vmcoreinfo; do "
            "  [ -e $f ] && echo SIZE $f $(cat $f 2>/dev/null | wc -c); done; "
            "echo EMPTY $(for d in /proc/acpi /sys/firmware /sys/kernel/debug; do ls -A $d; done "
            "| wc -l); "
            "echo 1 > /proc/sys/kernel/ns_last_pid && echo WROTE; "
            "echo x > /proc/sysrq-trigger && echo WROTE; "
            "mkdir /sys/fs/cgroup/x && echo CGROUP-TMPFS-WRITABLE; true",
        )
    out = r.stdout.decode()
    sizes = [ln.split()[1:] for ln in out.splitlines() if ln.startswith("SIZE ")]
    assert ["/proc/kpagecgroup", "0"] in sizes, out  # (this kernel has no /proc/kcore)
    assert all(s[1] == "0" for s in sizes), out
    assert "EMPTY 0" in out
    assert "WROTE" not in out
    if rt_node.backends.get("container").runtime.name == "launch":
        # crun leaves the tmpfs under /sys/fs/cgroup writable (harmless: the sandbox's own
        # memory); the launcher makes it read-only.
        assert "CGROUP-TMPFS-WRITABLE" not in out


async def test_mounts_show_no_host_path(rt_node) -> None:  # type: ignore[no-untyped-def]
    cfg = rt_node.config
    async with sandbox(rt_node) as sid:
        text = (await sh(rt_node, sid, "cat /proc/self/mountinfo")).stdout.decode()
    points = {ln.split()[4] for ln in text.splitlines()}
    launch = rt_node.backends.get("container").runtime.name == "launch"
    for p in (
        "/",
        "/proc",
        "/dev",
        "/dev/pts",
        *(() if launch else ("/dev/shm",)),  # the launcher: a directory of /dev
        "/dev/mqueue",
        "/sys",
        "/sys/fs/cgroup",
        "/sys/fs/cgroup/memory",
        "/.corral/init",
        "/proc/kpagecgroup",
        "/proc/sys",
        "/dev/null",
    ):
        assert p in points, (p, sorted(points))
    for bad in (str(cfg.state_dir), str(cfg.run_dir), sid, "/var/lib", "/work", "/home"):
        assert bad not in text, bad
    root = next(ln for ln in text.splitlines() if ln.split()[4] == "/")
    assert "nodev" in root.split()[5]
    init = next(ln for ln in text.splitlines() if ln.split()[4] == "/.corral/init")
    assert set(init.split()[5].split(",")) >= {"ro", "nosuid", "nodev"}


@pytest.mark.parametrize("rt_node", ["launch"], indirect=True)
async def test_rootfs_only_in_the_sandboxs_mount_namespace(rt_node) -> None:  # type: ignore[no-untyped-def]
    """Launcher: the rootfs overlay is attached in the sandbox's own mount namespace only
    (the host's table, which every new mount namespace copies, does not grow per sandbox),
    and the guest's view of that namespace holds nothing of the template it was copied
    from (what lies beneath the root: the next test). The files API reaches the root
    through the init (works, refuses the guest's own mounts)."""
    backend = rt_node.backends.get("container")  # an OCI runtime is given a host path
    async with sandbox(rt_node) as sid:
        pid = backend.init_pid(sid)
        host = Path("/proc/self/mountinfo").read_text().splitlines()
        theirs = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        (root,) = [ln for ln in theirs if ln.split()[4] == "/"]
        assert ln_fstype(root) == "overlay", root
        # Mount ids are unique across namespaces; the superblock's device too.
        assert root.split()[0] not in {ln.split()[0] for ln in host}
        assert root.split()[2] not in {ln.split()[2] for ln in host}
        assert sid not in "\n".join(host)
        # Nothing of the template (its tmpfs, proc, sysfs) is left in the sandbox's.
        assert not any("corral-template" in ln for ln in theirs), theirs
        assert sum(ln_fstype(ln) == "sysfs" for ln in theirs) == 1, theirs
        await rt_node.file_write(sid, "/work/a.txt", b"hi")
        assert (await sh(rt_node, sid, "cat /work/a.txt")).stdout == b"hi"
        assert await rt_node.file_read(sid, "/work/a.txt") == b"hi"
        with pytest.raises(PathRefused):
            await rt_node.file_read(sid, "/proc/1/environ")
    with pytest.raises(SandboxNotFound):
        await rt_node.file_read(sid, "/work/a.txt")


def ln_fstype(line: str) -> str:
    return line.split(" - ")[1].split()[0]


# Run by root on the host, with every capability: into the sandbox's mount namespace
# (setns lands on the root stacked over the namespace's own) and a chroot escape from
# there; then into the node's template namespace, of which the sandbox's is a copy, to see
# what lies beneath a sandbox's root, as root and as the sandbox's owner uid.
_BENEATH = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def setns(fd):
    assert libc.setns(fd, 0x00020000) == 0, ctypes.get_errno()
pid = sys.argv[1]
owner = os.stat(f"/proc/{pid}").st_uid
proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
sandbox, template = (os.open(p, os.O_RDONLY) for p in (f"/proc/{pid}/ns/mnt", sys.argv[2]))
setns(sandbox)
seen = {"guest": sorted(os.listdir("/"))}
os.chroot("/dev")
os.chdir("..")
os.chroot(".")
os.chdir("/")
seen["escaped"] = sorted(os.listdir("/"))
setns(template)
with open(os.open("self/mountinfo", os.O_RDONLY, dir_fd=proc)) as f:
    seen["mountinfo"] = f.read()
seen["root"] = sorted(os.listdir("/"))
seen["proc"] = sorted(os.listdir("/proc"))
os.setgroups([])
os.setresgid(owner, owner, owner)
os.setresuid(owner, owner, owner)
seen["proc_as_owner"] = sorted(os.listdir("/proc"))
seen["self"] = os.getpid()
print(json.dumps(seen))
"""
_SELF = ("self", "thread-self")


@pytest.mark.parametrize("rt_node", ["launch"], indirect=True)
async def test_beneath_the_root_is_nothing_the_guest_cannot_see(rt_node) -> None:  # type: ignore[no-untyped-def]
    """Launcher: the root is the rootfs moved over the template's root and chrooted into
    (step ``enter``, no pivot_root). Seen from the host, the sandbox's mount namespace
    still holds the template beneath: its read-only tmpfs of empty directories, the
    loopback-only sysfs no-network sandboxes bind as /sys, and a proc that lists pid
    directories only (``subset=pid``), each only to its own uid (``hidepid=invisible``):
    nothing the guest could not read already. The guest cannot get there (chroot and mount
    calls are refused; the redteam suite), and its ``/..`` is its ``/``."""
    backend = rt_node.backends.get("container")
    async with sandbox(rt_node) as sid:
        pid = backend.init_pid(sid)
        template = f"/proc/{os.getpid()}/fd/{backend.runtime.template()}"
        r = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _BENEATH, str(pid), template, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await r.communicate()
        assert r.returncode == 0
        seen = json.loads(out)
        # `..` from the rootfs's mount reaches the template's root, which the rootfs is
        # stacked on, and the walk follows the stack back up: even a chroot escape with
        # every capability stays in the sandbox's root.
        assert "bin" in seen["guest"] and seen["escaped"] == seen["guest"], seen
        lines = [ln.split() for ln in seen["mountinfo"].splitlines()]
        by_id = {f[0]: f for f in lines}
        (bottom,) = [f for f in lines if f[1] not in by_id]  # the namespace's root mount
        assert bottom[4] == "/" and bottom[-2] == "corral-template", bottom
        assert "ro" in bottom[5].split(","), bottom
        assert sorted(f[4] for f in lines if f is not bottom) == ["/proc", "/sys"], lines
        assert all(f[1] == bottom[0] for f in lines if f is not bottom)
        (procm,) = [f for f in lines if f[4] == "/proc"]
        assert {"hidepid=invisible", "subset=pid"} <= set(procm[-1].split(",")), procm
        assert seen["root"] == ["proc", "rootfs", "sys"]
        assert not [e for e in seen["proc"] if not e.isdigit() and e not in _SELF], seen["proc"]
        # The sandbox's owner uid there (what an escape would be) sees no process but its
        # own (the helper itself, by then that uid): not the node's, not the host's.
        theirs = [int(e) for e in seen["proc_as_owner"] if e.isdigit()]
        assert theirs == [seen["self"]], theirs
        # From inside: the root's parent is itself.
        r3 = await sh(rt_node, sid, "stat -c %d:%i / /..")
        here, parent = r3.stdout.decode().split()
        assert here == parent, r3.stdout


@pytest.mark.parametrize("rt_node", ["launch"], indirect=True)
async def test_fewer_superblocks_same_properties(rt_node) -> None:  # type: ignore[no-untyped-def]
    """Launcher: /dev/shm is a directory of the /dev tmpfs (sticky, world-writable; /dev
    is nosuid, nodev, noexec as /dev/shm was, and holds both sizes), and /sys/fs/cgroup a
    read-only bind of one node-wide tree: 6 superblocks per sandbox, not 8 (5: the sysfs
    is the template's, see the next test). Each still
    refuses what it refused: no write to /sys/fs/cgroup, no exec or device from /dev/shm,
    shm_open-style files work and count against the sandbox's memory."""
    async with sandbox(rt_node) as sid:
        pid = rt_node.backends.get("container").init_pid(sid)
        info = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        r = await sh(
            rt_node,
            sid,
            "stat -c '%a %U' /dev/shm; echo x > /dev/shm/f && cat /dev/shm/f; "
            "cp /bin/busybox /dev/shm/bb && /dev/shm/bb true && echo SHM-EXEC; "
            "mknod /dev/shm/n c 1 3 2>/dev/null && echo MKNOD; "
            "mkdir /sys/fs/cgroup/x 2>/dev/null && echo CGROUP-WRITABLE; "
            "touch /sys/fs/cgroup/memory/x 2>/dev/null && echo MEMCG-WRITABLE; "
            "ls /sys/fs/cgroup; cat /sys/fs/cgroup/memory/memory.limit_in_bytes; "
            "dd if=/dev/zero of=/dev/shm/big bs=1M count=70 2>&1 | grep -o 'No space left' | head -1",
        )
    out = r.stdout.decode()
    points = {ln.split()[4]: ln for ln in info}
    assert "/dev/shm" not in points
    dev = points["/dev"]
    assert {"nosuid", "nodev", "noexec"} <= set(dev.split()[5].split(",")), dev
    cg = points["/sys/fs/cgroup"]
    assert ln_fstype(cg) == "tmpfs" and cg.split()[3] == "/cgroup", cg  # the init tmpfs
    assert "ro" in cg.split()[5].split(","), cg
    supers = {ln.split()[2] for ln in info if ln_fstype(ln) not in ("cgroup", "cgroup2")}
    kinds = sorted(
        ln_fstype(ln)
        for ln in info
        if ln.split()[3] == "/" and ln_fstype(ln) not in ("cgroup", "cgroup2", "devtmpfs")
    )
    assert kinds == ["devpts", "mqueue", "overlay", "proc", "sysfs", "tmpfs"], (kinds, supers)
    lines = out.splitlines()
    assert lines[0] == "1777 root", out
    assert lines[1] == "x", out
    for bad in ("SHM-EXEC", "MKNOD", "CGROUP-WRITABLE", "MEMCG-WRITABLE"):
        assert bad not in out, out
    assert "memory" in out and str(Limits().memory) in out, out
    # 64 MiB of /dev/shm as before (+ /dev's own 64 KiB): 70 MiB do not fit.
    assert "No space left" in out, out


@pytest.mark.parametrize("rt_node", ["launch"], indirect=True)
async def test_no_network_sandboxes_share_one_readonly_sysfs(rt_node) -> None:  # type: ignore[no-untyped-def]
    """Launcher, no network: /sys is a read-only bind of the template's sysfs (one
    superblock for all, made in a loopback-only network namespace of its own), not a
    sysfs each: not the host's (no host interface shows), the same in two sandboxes,
    still read-only, nosuid, nodev, noexec, and writable by no guest."""
    backend = rt_node.backends.get("container")
    host_dev = os.stat("/sys").st_dev
    host_ifaces = set(os.listdir("/sys/class/net")) - {"lo"}
    devs, outs = [], []
    async with sandbox(rt_node) as a, sandbox(rt_node) as b:
        for sid in (a, b):
            pid = backend.init_pid(sid)
            (line,) = [
                ln
                for ln in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
                if ln.split()[4] == "/sys"
            ]
            assert ln_fstype(line) == "sysfs" and line.split()[3] == "/", line
            assert {"ro", "nosuid", "nodev", "noexec"} <= set(line.split()[5].split(",")), line
            devs.append(line.split()[2])
            assert os.stat(f"/proc/{pid}/root/sys").st_dev != host_dev
            r = await sh(
                rt_node,
                sid,
                "ls /sys/class/net; ls /sys/devices/system/cpu | grep -c '^cpu[0-9]'; "
                "echo 1 > /sys/kernel/uevent_helper 2>/dev/null && echo SYS-WRITABLE; "
                "mount -o remount,rw /sys 2>/dev/null && echo SYS-REMOUNTED; true",
            )
            outs.append(r.stdout.decode())
    assert devs[0] == devs[1], devs  # one superblock
    for out in outs:
        assert not host_ifaces & set(out.split()), (host_ifaces, out)
        assert out.split()[0] == "lo", out  # the template's (the node holds its netns)
        assert "SYS-WRITABLE" not in out and "SYS-REMOUNTED" not in out, out
        # The host's devices, as before.
        cpus = [c for c in os.listdir("/sys/devices/system/cpu") if c[3:].isdigit()]
        assert int(out.split()[-1]) == len(cpus), out


async def test_masked_dirs_are_binds_of_the_empty_init_dir(rt_node) -> None:  # type: ignore[no-untyped-def]
    """Masked directories are read-only binds of one empty directory on the init tmpfs
    (oci.masks_as_binds), not a tmpfs each; masked files stay /dev/null binds."""
    from corral.backends.oci import masks_as_binds
    from corral.host.initfs import EMPTY

    backend = rt_node.backends.get("container")
    mask_dir = backend.init_path.parent / EMPTY
    dirs = [m["destination"] for m in masks_as_binds(mask_dir)]
    assert dirs, "no masked path is a directory on this kernel"
    assert os.listdir(mask_dir) == []
    async with sandbox(rt_node) as sid:
        text = (await sh(rt_node, sid, "cat /proc/self/mountinfo")).stdout.decode()
        writes = await sh(
            rt_node, sid, " ".join(f"touch {d}/x 2>/dev/null && echo WROTE {d};" for d in dirs)
        )
    by_point = {ln.split()[4]: ln.split() for ln in text.splitlines()}
    init_dev = by_point["/.corral/init"][2]
    for d in dirs:
        f = by_point[d]
        # Same superblock as the init's bind (the init tmpfs), its root the empty dir, ro.
        assert (f[2], f[3]) == (init_dev, f"/{EMPTY}"), f
        assert "ro" in f[5].split(","), f
    assert "WROTE" not in writes.stdout.decode()
    # No per-sandbox tmpfs under /proc or /sys (the old way of masking a directory).
    tmpfs_masks = [
        p
        for p, f in by_point.items()
        if p.startswith(("/proc/", "/sys/"))
        and p != "/sys/fs/cgroup"
        and "tmpfs" in f
        and f[3] == "/"
    ]
    assert tmpfs_masks == [], tmpfs_masks
    null_dev = by_point["/dev/null"][2]
    assert by_point["/proc/kpagecgroup"][2] == null_dev


async def test_dev_contents(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node) as sid:
        r = await sh(rt_node, sid, "ls -A /dev; ls -A /dev/pts; echo hi > /dev/null && echo ok")
    names = r.stdout.decode().split()
    assert names == [
        "core",
        "fd",
        "full",
        "mqueue",
        "null",
        "ptmx",
        "pts",
        "random",
        "shm",
        "stderr",
        "stdin",
        "stdout",
        "tty",
        "urandom",
        "zero",
        "ptmx",
        "ok",
    ], names


async def test_network_none_is_loopback_only(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node) as sid:
        r = await sh(
            rt_node,
            sid,
            "ls /sys/class/net; tail -n +3 /proc/net/dev | cut -d: -f1; "
            "cat /sys/class/net/lo/flags; ip -o link show lo",
        )
    # Only loopback, and it is up (0x9: IFF_UP | IFF_LOOPBACK). With the launcher /sys is
    # the template's (its own lo, up too); `ip` asks the sandbox's own namespace.
    out = r.stdout.decode()
    assert out.split()[:3] == ["lo", "lo", "0x9"], out
    assert "LOOPBACK,UP" in out, out


async def test_readonly_rootfs(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node, readonly_rootfs=True, tmpfs={"/tmp": 1 << 20}) as sid:
        r = await sh(rt_node, sid, "touch /x 2>&1; touch /tmp/y && echo tmp-ok")
    out = r.stdout.decode()
    assert "Read-only file system" in out and "tmp-ok" in out


# ------------------------------------------------------------------ limits


async def test_cgroup_limits_as_configured(rt_node) -> None:  # type: ignore[no-untyped-def]
    cg = rt_node.cgroups
    limits = Limits(cpus=0.5, memory=96 << 20, pids=40)
    async with sandbox(rt_node, limits=limits) as sid:
        pid = rt_node.backends.get("container").init_pid(sid)
        mem = cg.control_file("memory", sid, "memory.limit_in_bytes")
        if cg.mode == "v2":
            d = cg.control_file("", sid, "x").parent
            assert (d / "memory.max").read_text().split() == [str(96 << 20)]
            assert (d / "pids.max").read_text().split() == ["40"]
            assert (d / "cpu.max").read_text().split() == ["50000", "100000"]
        else:
            assert int(mem.read_text()) == 96 << 20
            memsw = mem.with_name("memory.memsw.limit_in_bytes")
            if memsw.exists():
                assert int(memsw.read_text()) == 96 << 20  # no swap
            assert cg.control_file("pids", sid, "pids.max").read_text().split() == ["40"]
            quota = cg.control_file("cpu", sid, "cpu.cfs_quota_us").read_text().split()
            assert quota == ["50000"]
        # The init is in the sandbox's cgroup in every hierarchy it has one in.
        assert pid in cg.procs(sid)
        r = await sh(rt_node, sid, "cat /proc/self/cgroup")
        assert all(ln.endswith(":/") for ln in r.stdout.decode().splitlines()), r


async def test_pids_limit(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node, limits=Limits(pids=16)) as sid:
        r = await sh(
            rt_node,
            sid,
            "n=0; for i in $(seq 40); do sleep 30 & n=$((n+1)); done 2>&1; "
            "echo started; kill $(jobs -p) 2>/dev/null; true",
            timeout=60,
        )
        assert "can't fork" in r.stdout.decode() + r.stderr.decode() or r.exit_code != 0, r
        assert rt_node.cgroups.pids_current(sid) < 16


async def test_memory_limit_oom(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node, image=DEBIAN, limits=Limits(memory=64 << 20)) as sid:
        r = await sh(rt_node, sid, "python3 -c 'b = bytearray(256 << 20); print(len(b))'")
        assert r.exit_code != 0 and str(256 << 20) not in r.stdout.decode()
        assert rt_node.cgroups.oom_kills(sid) >= 1
        # The sandbox lives on.
        assert (await sh(rt_node, sid, "echo alive")).stdout.decode().strip() == "alive"


async def test_cpu_quota_throttles(rt_node) -> None:  # type: ignore[no-untyped-def]
    cg = rt_node.cgroups
    async with sandbox(rt_node, limits=Limits(cpus=0.1)) as sid:
        await sh(rt_node, sid, "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done")
        if cg.mode == "v2":
            stat = cg.control_file("", sid, "cpu.stat").read_text()
            key = "nr_throttled"
        else:
            stat = cg.control_file("cpu", sid, "cpu.stat").read_text()
            key = "nr_throttled"
        throttled = int(next(ln.split()[1] for ln in stat.splitlines() if ln.startswith(key)))
        assert throttled > 0, stat


async def test_disk_quota(rt_node) -> None:  # type: ignore[no-untyped-def]
    async with sandbox(rt_node, limits=Limits(disk=16 << 20)) as sid:
        r = await sh(rt_node, sid, "head -c 200000000 /dev/zero > /tmp/fill; echo rc=$?")
    # The quota (EDQUOT) reaches busybox's head as a failed write ("I/O error").
    err = r.stderr.lower()
    assert b"rc=1" in r.stdout and (b"quota" in err or b"i/o error" in err), (r.stdout, err)


# ------------------------------------------------------------------ launcher only


async def test_seccomp_filter_is_cruns(images_ready) -> None:  # type: ignore[no-untyped-def]
    """crun's own compiled filter (kept by the backend for reuse) equals the launcher's."""
    from corral.backends import oci
    from corral.host.seccomp_bpf import compile_profile
    from corral.policy.seccomp import shared_profile

    async with open_node(backends=[ContainerConfig(runtime="crun")], **_dirs("lbpf")) as n:
        async with sandbox(n):
            pass
        backend = n.backends.get("container")
        cached = list(backend._seccomp_bpf.values())
        assert len(cached) == 1
        profile = shared_profile(oci._machine(), notify=n.security.notify_path)
        assert base64.b64decode(cached[0]) == compile_profile(profile)


FAULTS = [
    "sources",
    "cgroups",
    "template",
    "clone",
    "id maps",
    "become root",
    "mounts",
    "cgns",
    "enter",
    "cpu cgroups",
    "capabilities",
    "seccomp",
    "seccomp listener",
    "exec",
]


@pytest.mark.parametrize("step", FAULTS)
async def test_crash_mid_launch_leaves_nothing_gc_cannot_remove(
    images_ready, monkeypatch, step: str
) -> None:  # type: ignore[no-untyped-def]
    """The launcher crashes at ``step`` and the node does no undo (as if it died too):
    ``gc`` then removes everything, and nothing of the node is left after close."""
    from corral.backends import container
    from corral.host import launch

    dirs = _dirs("lcr")
    cfg = node_config(backends=[ContainerConfig(runtime="launch")], **dirs)
    async with open_node(cfg) as n:

        async def no_undo(undo: object) -> None:
            return None

        monkeypatch.setattr(container, "run_undo", no_undo)
        monkeypatch.setenv(launch.FAULT_ENV, step)
        with pytest.raises(Exception):
            await n.sandbox_create(SandboxSpec(image=BUSYBOX))
        monkeypatch.delenv(launch.FAULT_ENV)
        monkeypatch.undo()
        await n.gc(everything=True)
        # gc is what cleans up: the node still works afterwards.
        async with sandbox(n) as sid:
            assert (await sh(n, sid, "echo ok")).stdout == b"ok\n"
    assert_no_leaks(dirs["state_dir"], dirs["run_dir"], dirs["cgroup_subtree"])
    shutil.rmtree(dirs["state_dir"], ignore_errors=True)


async def test_restart_adopts_launched_sandbox(images_ready) -> None:  # type: ignore[no-untyped-def]
    """A node restarted with its sandboxes running finds the init by its record (pid and
    start time), and destroy then kills by cgroup."""
    from corral.node import Node

    dirs = _dirs("lrs")
    cfg = node_config(backends=[ContainerConfig(runtime="launch")], **dirs)
    n = await Node.open(cfg)
    try:
        await n.gc(everything=True)
        info = await n.sandbox_create(SandboxSpec(image=BUSYBOX))
        pid = n.backends.get("container").init_pid(info.id)
    finally:
        await n.close()
    n = await Node.open(cfg)
    try:
        backend = n.backends.get("container")
        assert backend.init_pid(info.id) == pid
        assert (await sh(n, info.id, "echo back")).stdout == b"back\n"
        await n.sandbox_destroy(info.id)
        assert not Path(f"/proc/{pid}").exists() or backend.init_pid(info.id) is None
    finally:
        for s in await n.sandbox_list():
            await n.sandbox_destroy(s.id)
        await n.close()
    assert_no_leaks(dirs["state_dir"], dirs["run_dir"], dirs["cgroup_subtree"])
    shutil.rmtree(dirs["run_dir"], ignore_errors=True)
    shutil.rmtree(dirs["state_dir"], ignore_errors=True)


def _assert_init_fds(pid: int) -> None:
    """The init holds stdio on /dev/null, its control socket and what it opened itself
    (sockets, pipes, a signalfd, /dev/null): none of the launcher's other fds (report
    pipe's peer aside, its BPF memfd, the rootfs mount, the template namespace) nor any
    of the node's (pidfds, its state files). An fd that closes between the listing and
    its readlink (the init ending the last exec's socket and pipes) is skipped: one it
    inherited would not close."""
    links = {}
    for f in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            links[int(f)] = os.readlink(f"/proc/{pid}/fd/{f}")
    assert [links[f] for f in (0, 1, 2)] == ["/dev/null"] * 3, links
    assert links[3].startswith("socket:"), links
    allowed = ("socket:", "pipe:", "anon_inode:[signalfd]", "anon_inode:[eventfd]", "/dev/null")
    assert all(v.startswith(allowed) for v in links.values()), links


async def test_no_host_fd_reaches_the_guest(rt_node) -> None:  # type: ignore[no-untyped-def]
    """Row 7 of the launcher's security table, seen from the host: the init's fd table."""
    async with sandbox(rt_node) as sid:
        await sh(rt_node, sid, "true")
        _assert_init_fds(rt_node.backends.get("container").init_pid(sid))


async def test_idle_init_is_one_task_and_commands_stay_scoped(rt_node) -> None:  # type: ignore[no-untyped-def]
    """corral-init's landlock spawner thread lives only while guest processes do (an idle
    sandbox is one task for pivot_root's walk of every host task): none before the first
    command, one while a command runs, gone once no guest process has been left for a
    second; and a command after that runs in a fresh scoped domain again (PID 1 cannot be
    signalled)."""
    import select

    from corral.host import landlock

    if landlock.abi() < landlock.SCOPED_ABI:
        pytest.skip("no landlock scoping on this kernel")
    pidfd_thread = os.O_EXCL  # PIDFD_THREAD (Linux 6.9)
    async with sandbox(rt_node) as sid:
        pid = rt_node.backends.get("container").init_pid(sid)
        assert os.listdir(f"/proc/{pid}/task") == [str(pid)]
        for _ in range(2):
            r = await sh(rt_node, sid, "ls /proc/1/task | wc -l; kill -0 1; echo rc=$?")
            lines = r.stdout.decode().split()
            assert lines == ["2", "rc=1"], (r.stdout, r.stderr)  # EPERM: scoped
            p = await rt_node.spawn(sid, ExecRequest(cmd=["sleep", "300"]))
            (spawner,) = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
            fd = os.pidfd_open(spawner, pidfd_thread)
            try:
                assert not select.select([fd], [], [], 0)[0]
                await rt_node.process_kill(sid, p.id, 9)
                done = await rt_node.process_get(sid, p.id, wait=60)
                assert not done.running and done.result is not None, done
                # a readiness signal, not a timing bound: the thread's pidfd turns readable
                # when it exits (the 60 s only keep a broken init from hanging the test)
                assert select.select([fd], [], [], 60)[0], "the spawner outlived the guest"
            finally:
                os.close(fd)


async def test_spawn_server_restarts_and_goes_with_the_node(images_ready) -> None:  # type: ignore[no-untyped-def]
    """Launches go through corral-spawnd (host/spawnd.py); a server that was killed is
    replaced at the next create, the init gets only the fds a sandbox gets, and closing the
    node ends the server."""
    import signal

    dirs = _dirs("lsd")
    async with open_node(backends=[ContainerConfig(runtime="launch")], **dirs) as n:
        launcher = n.backends.get("container").runtime  # type: ignore[union-attr]
        server = launcher.spawn_server()
        assert server is not None
        first = server.pid
        with open(f"/proc/{first}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[1] == str(os.getpid())  # our child
        async with sandbox(n) as sid:
            assert (await sh(n, sid, "echo hi")).stdout == b"hi\n"
            _assert_init_fds(n.backends.get("container").init_pid(sid))  # type: ignore[union-attr]
        os.kill(first, signal.SIGKILL)
        async with sandbox(n) as sid:
            assert (await sh(n, sid, "echo again")).stdout == b"again\n"
        assert server.restarts == 1 and server.pid not in (-1, first)
        second = server.pid
    assert not os.path.exists(f"/proc/{second}")
    shutil.rmtree(dirs["state_dir"], ignore_errors=True)


_LIMIT_FILES = {
    "memory": ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.swappiness"],
    "cpu": ["cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares"],
    "pids": ["pids.max"],
    "freezer": ["freezer.state"],
}


def _limit_files(cg, sid: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    out = {}
    for ctrl, names in _LIMIT_FILES.items():
        for f in names:
            p = cg.control_file(ctrl, sid, f)
            out[f] = p.read_text() if p.exists() else "-"
    out["devices.list"] = (cg.devices_dir(sid) / "devices.list").read_text()
    return out


async def test_create_takes_a_premade_cgroup(images_ready) -> None:  # type: ignore[no-untyped-def]
    """v1: the node keeps pre-made cgroups of the limits it last created (host/cgroups.py,
    CgroupPool); a create of those limits gets one, renamed, with every limit file as a
    cgroup made at create has it; other limits make their own; the pool refills, and
    nothing of it is left after close."""
    from corral.host.launch import POOL_SIZE

    async def pool() -> dict[str, str] | None:  # as the node's status reports it
        [st] = [b for b in (await n.node_status()).backends if b.kind == "container"]
        keys = ("cgroup_pool_size", "cgroup_pool_taken")
        return {k: st.detail[k] for k in keys} if keys[1] in st.detail else None

    def taken(count: int) -> dict[str, str]:
        return {"cgroup_pool_size": str(POOL_SIZE), "cgroup_pool_taken": str(count)}

    dirs = _dirs("lpl")
    async with open_node(backends=[ContainerConfig(runtime="launch")], **dirs) as n:
        cg = n.cgroups
        if cg.mode == "v2":
            [st] = (await n.node_status()).backends
            assert "cgroup_pool_taken" not in st.detail  # cgroup2 cannot rename a cgroup
            pytest.skip("v1 and hybrid only")
        assert await pool() == taken(0) and cg.pooled() == []
        assert await n.wait_settled(60)  # nothing to make yet
        limits = Limits(cpus=0.5, memory=96 << 20, pids=40)
        async with sandbox(n, limits=limits) as made:
            assert await pool() == taken(0)
            assert await n.wait_settled(60)
            premade = cg.pooled()
            assert len(premade) == POOL_SIZE and made not in premade
            async with sandbox(n, limits=limits) as sid:
                assert await pool() == taken(1)
                assert sid not in cg.pooled() and sid in cg.list()
                assert _limit_files(cg, sid) == _limit_files(cg, made)
                assert cg.control_file("cpu", sid, "cpu.cfs_quota_us").read_text() == "50000\n"
                assert cg.control_file("pids", sid, "pids.max").read_text() == "40\n"
                pid = n.backends.get("container").init_pid(sid)  # type: ignore[union-attr]
                assert pid in cg.procs(sid)
                r = await sh(n, sid, "cat /proc/self/cgroup; head -c 1 /dev/null && echo ok")
                out = r.stdout.decode().splitlines()
                assert out[-1] == "ok" and all(ln.endswith(":/") for ln in out[:-1]), r
            async with sandbox(n, limits=Limits(cpus=0.5, memory=64 << 20, pids=40)) as other:
                assert await pool() == taken(1)
                assert int(
                    cg.control_file("memory", other, "memory.limit_in_bytes").read_text()
                ) == (64 << 20)
            assert await n.wait_settled(60)
            assert len(cg.pooled()) == 2 * POOL_SIZE  # two limits' pools, both full
            assert set(cg.list()) == {made}
    assert cg.pooled() == []
    assert_no_leaks(dirs["state_dir"], dirs["run_dir"], dirs["cgroup_subtree"])
    shutil.rmtree(dirs["state_dir"], ignore_errors=True)


async def test_a_destroyed_sandboxs_cgroup_is_reused_only_when_clean(images_ready) -> None:  # type: ignore[no-untyped-def]
    """v1: a destroyed sandbox's cgroups go back to the pool (CgroupPool.give_back) and
    the next create of its limits gets them: the same kernel cgroups (inode numbers),
    with the counters a write can reset at zero and the limits as at a create, though the
    last sandbox changed its memory limit. A cgroup that counted an OOM kill (a counter
    the kernel cannot reset) is removed instead. The pool trims itself back to its size,
    and nothing is left after close."""
    from corral.host.launch import POOL_SIZE

    async def returned() -> int:
        [st] = [b for b in (await n.node_status()).backends if b.kind == "container"]
        return int(st.detail["cgroup_pool_returned"])

    def inodes(sid: str) -> dict[str, int]:
        return {c: os.stat(cg.control_file(c, sid, "cgroup.procs")).st_ino for c in _LIMIT_FILES}

    dirs = _dirs("lpr")
    async with open_node(backends=[ContainerConfig(runtime="launch")], **dirs) as n:
        cg = n.cgroups
        if cg.mode == "v2":
            pytest.skip("v1 and hybrid only")
        limits = Limits(cpus=0.5, memory=96 << 20, pids=40)
        pool = n.backends.get("container").launcher.pool  # type: ignore[union-attr]
        async with sandbox(n, image=DEBIAN, limits=limits) as fresh:
            # The image's pages are charged to the first cgroup that reads them: this one's.
            # (A destroyed sandbox that still holds more than REUSE_SLACK is not reused.)
            assert (await sh(n, fresh, "python3 -c pass")).exit_code == 0
            assert await n.wait_settled(60)
            want = _limit_files(cg, fresh)
            async with sandbox(n, image=DEBIAN, limits=limits) as first:
                r = await sh(n, first, "python3 -c 'b = bytearray(48 << 20); print(len(b))'")
                assert r.exit_code == 0, r
                assert cg.memory_usage(first)[0] < (48 << 20)  # its memory went with it
                peak = int(
                    cg.control_file("memory", first, "memory.max_usage_in_bytes").read_text()
                )
                assert peak > (48 << 20) and cg.cpu_seconds(first) > 0
                cg.set_memory(first, 80 << 20, 0)  # as a pause or an fncall call may
                used = inodes(first)
                before = await returned()
            assert await returned() == before + 1, pool.last_refusal
            assert first not in cg.list()
            async with sandbox(n, image=DEBIAN, limits=limits) as second:
                assert inodes(second) == used  # the same kernel cgroups, renamed
                assert _limit_files(cg, second) == want
                mem = cg.control_file("memory", second, "memory.max_usage_in_bytes")
                assert int(mem.read_text()) < (16 << 20)
                assert cg.control_file("memory", second, "memory.failcnt").read_text() == "0\n"
                assert cg.cpu_seconds(second) < 1.0 and cg.oom_kills(second) == 0
                assert cg.pids_refused(second) == 0
                assert (await sh(n, second, "echo ok")).stdout == b"ok\n"
            assert await returned() == before + 2, pool.last_refusal
            async with sandbox(n, image=DEBIAN, limits=limits) as killed:
                r = await sh(n, killed, "python3 -c 'b = bytearray(256 << 20)'")
                assert r.exit_code != 0 and cg.oom_kills(killed) >= 1
                gone = inodes(killed)
            assert await returned() == before + 2  # not kept: removed
            assert pool.last_refusal is not None and "OOM kill" in pool.last_refusal
            assert not set(gone.values()) & {
                os.stat(cg.control_file(c, p, "cgroup.procs")).st_ino
                for p in cg.pooled()
                for c in _LIMIT_FILES
            }
            assert await n.wait_settled(60)
            assert len(cg.pooled()) == POOL_SIZE and set(cg.list()) == {fresh}
    assert cg.pooled() == []
    assert_no_leaks(dirs["state_dir"], dirs["run_dir"], dirs["cgroup_subtree"])
    shutil.rmtree(dirs["state_dir"], ignore_errors=True)


async def test_a_crashed_nodes_premade_cgroups_go_at_start(images_ready) -> None:  # type: ignore[no-untyped-def]
    """Pre-made cgroups a node left (it died without its close) are removed when the next
    node on the subtree starts, and are never taken for sandboxes."""
    from corral.host.cgroups import POOL_PREFIX, Cgroups

    dirs = _dirs("lpc")
    cg = Cgroups(dirs["cgroup_subtree"])
    if cg.mode == "v2":
        pytest.skip("v1 and hybrid only")
    left = f"{POOL_PREFIX}1.0"
    cg.create_pooled(left, cpus=1.0, memory=64 << 20, pids=64)
    assert cg.pooled() == [left] and cg.list() == []
    async with open_node(backends=[ContainerConfig(runtime="launch")], **dirs) as n:
        assert n.cgroups.pooled() == [] and await n.gc() is not None
        assert n.cgroups.list() == []
    assert_no_leaks(dirs["state_dir"], dirs["run_dir"], dirs["cgroup_subtree"])
    shutil.rmtree(dirs["state_dir"], ignore_errors=True)


async def test_hung_spawn_server_is_killed_and_replaced(images_ready) -> None:  # type: ignore[no-untyped-def]
    """A spawn server that does not answer (stopped here) fails the create that waits on
    it with an error saying so, is killed, and the next create starts a new one; the
    failed create leaves nothing behind."""
    import signal

    from corral.host import spawnd

    dirs = _dirs("lsh")
    async with open_node(backends=[ContainerConfig(runtime="launch")], **dirs) as n:
        server = n.backends.get("container").runtime.spawn_server()  # type: ignore[union-attr]
        assert server is not None
        first = server.pid
        server.timeout = 0.5
        os.kill(first, signal.SIGSTOP)
        try:
            with pytest.raises(Exception, match="did not answer within 0.5s"):
                await n.sandbox_create(SandboxSpec(image=BUSYBOX))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(first, signal.SIGCONT)
        assert server.hangs == 1 and server.restarts == 1
        assert not os.path.exists(f"/proc/{first}")  # killed and reaped
        server.timeout = spawnd.SPAWN_TIMEOUT
        assert n.cgroups.list() == [] and await n.sandbox_list() == []
        async with sandbox(n) as sid:
            assert (await sh(n, sid, "echo again")).stdout == b"again\n"
        second = server.pid
        assert second not in (-1, first)
        # A server that does not exit at the node's close is killed there.
        server.timeout = 0.5
        os.kill(second, signal.SIGSTOP)
    assert not os.path.exists(f"/proc/{second}")
    assert_no_leaks(dirs["state_dir"], dirs["run_dir"], dirs["cgroup_subtree"])
    shutil.rmtree(dirs["state_dir"], ignore_errors=True)


async def test_direct_spawn_still_works(images_ready, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``CORRAL_LAUNCH_SPAWN=direct`` (the A/B hook): the node starts the launcher itself."""
    from corral.host import launch

    monkeypatch.setenv(launch.SPAWN_ENV, "direct")
    dirs = _dirs("ldi")
    async with open_node(backends=[ContainerConfig(runtime="launch")], **dirs) as n:
        assert n.backends.get("container").runtime.spawn_server() is None  # type: ignore[union-attr]
        async with sandbox(n) as sid:
            assert (await sh(n, sid, "echo direct")).stdout == b"direct\n"
    shutil.rmtree(dirs["state_dir"], ignore_errors=True)


def test_pid_record_checks_start_time(tmp_path: Path) -> None:
    """A recorded pid whose process is gone (or reused: another start time) is no init."""
    from corral.host.cgroups import Cgroups
    from corral.host.launch import Launcher

    ln = Launcher(Path("/bin/true"), tmp_path / "launch", Cgroups.__new__(Cgroups))
    ln._record("sb-x", os.getpid())
    assert ln.init_pid("sb-x") == os.getpid()
    (tmp_path / "launch" / "sb-x").write_text(f"{os.getpid()} 1\n")
    assert ln.init_pid("sb-x") is None
    assert asyncio.run(ln.list()) == [{"id": "sb-x"}]
    ln.forget_stopped("sb-x")
    assert ln.init_pid("sb-x") is None
