"""The container security policy, checked inside real runc containers.

Each test builds a config with ``corral.backends.oci.build_config`` and runs it with
``runc --root <tmp> run`` on a busybox rootfs owned by the mapped host uid. A static C probe
stands in for corral-init at ``/.corral/init`` (``probe exec PROG ARGS`` execs PROG) and
makes raw syscalls and ioctls, printing the errno of each.

Needs root, runc, gcc with static libc, and /bin/busybox (busybox-static). The tests that
build or check the profile without a kernel run anywhere.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from corral.backends.oci import build_config, write_bundle
from corral.bench.netns_host import delete_netns
from corral.errors import InvalidRequest
from corral.policy import seccomp
from corral.policy.caps import GUEST_CAPS, cap_mask
from corral.policy.masks import MASKED_PATHS, READONLY_PATHS
from corral.spec import Limits

HOST_UID = 100000
CGROUP_ROOT = Path("/sys/fs/cgroup")
IS_X86_64 = os.uname().machine == "x86_64"

needs_runc = pytest.mark.skipif(
    os.geteuid() != 0
    or not shutil.which("runc")
    or not shutil.which("gcc")
    or not Path("/bin/busybox").exists(),
    reason="needs root, runc, gcc and /bin/busybox",
)

PROBE_C = r"""
/* corral policy probe.
 *   probe exec PROG ARGS...  exec PROG (stands in for corral-init as PID 1)
 *   probe syscalls           call each syscall/ioctl of interest, print "name errno"
 *   probe args               read "i HEX" / "s HEX" lines on stdin; print the ones refused
 *                            with EPERM: ioctl(-1, HEX) (else EBADF) / socket(HEX, ...) */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* One call per child, so side effects (a new namespace, a leaked fd) stay there.
 * Prints the errno, 0 on success, or -SIGNAL when the child was killed. */
#define SC(label, ...) do { \
    pid_t p_ = fork(); \
    if (p_ == 0) { errno = 0; long r_ = syscall(__VA_ARGS__); _exit(r_ < 0 ? errno : 0); } \
    int st_; waitpid(p_, &st_, 0); \
    printf("%s %d\n", label, WIFEXITED(st_) ? WEXITSTATUS(st_) : -WTERMSIG(st_)); \
} while (0)

/* The kernel reads an ioctl command as 32 bits: also try it with the upper ones set. */
static void io(const char *name, int fd, unsigned long cmd, void *arg) {
    char hi[80];
    SC(name, SYS_ioctl, fd, cmd, arg);
    snprintf(hi, sizeof hi, "%s_hi", name);
    SC(hi, SYS_ioctl, fd, cmd | 0xdead000000000000UL, arg);
}

static int syscalls(void) {
    SC("bpf", SYS_bpf, -1, 0, 0);
    SC("perf_event_open", SYS_perf_event_open, 0, 0, -1, -1, 0);
    SC("userfaultfd", SYS_userfaultfd, 0);
    SC("io_uring_setup", SYS_io_uring_setup, 0, 0);
    SC("io_uring_enter", SYS_io_uring_enter, -1, 0, 0, 0, 0, 0);
    SC("io_uring_register", SYS_io_uring_register, -1, 0, 0, 0);
    SC("keyctl", SYS_keyctl, 0x7fff, 0, 0, 0, 0);
    SC("add_key", SYS_add_key, 0, 0, 0, 0, 0);
    SC("request_key", SYS_request_key, 0, 0, 0, 0);
    SC("kexec_load", SYS_kexec_load, 0, 0, 0, 0);
    SC("kexec_file_load", SYS_kexec_file_load, -1, -1, 0, 0, 0);
    SC("init_module", SYS_init_module, 0, 0, 0);
    SC("finit_module", SYS_finit_module, -1, 0, 0);
    SC("delete_module", SYS_delete_module, 0, 0);
    SC("mount", SYS_mount, "none", "/tmp", "tmpfs", 0, 0);
    SC("umount2", SYS_umount2, "/proc/kpagecgroup", 0);
    SC("pivot_root", SYS_pivot_root, 0, 0);
    SC("move_mount", SYS_move_mount, -1, 0, -1, 0, 0);
    SC("open_tree", SYS_open_tree, -1, "/", 1 /* OPEN_TREE_CLONE */);
    SC("fsopen", SYS_fsopen, "tmpfs", 0);
    SC("fsmount", SYS_fsmount, -1, 0, 0);
    SC("fsconfig", SYS_fsconfig, -1, 0, 0, 0, 0);
    SC("fspick", SYS_fspick, -1, "/", 0);
    SC("mount_setattr", SYS_mount_setattr, -1, "/", 0, 0, 0);
    SC("unshare_user", SYS_unshare, CLONE_NEWUSER);
    SC("unshare_ns", SYS_unshare, CLONE_NEWNS);
    SC("setns", SYS_setns, -1, 0);
    SC("ptrace", SYS_ptrace, 16 /* PTRACE_ATTACH */, 999999, 0, 0);
    SC("process_vm_readv", SYS_process_vm_readv, 1, 0, 0, 0, 0, 0);
    SC("process_vm_writev", SYS_process_vm_writev, 1, 0, 0, 0, 0, 0);
    SC("pidfd_getfd", SYS_pidfd_getfd, -1, 3, 0);
    SC("settimeofday", SYS_settimeofday, 0, 0);
    SC("clock_settime", SYS_clock_settime, 0, 0);
    SC("adjtimex", SYS_adjtimex, 0);
    SC("clock_adjtime", SYS_clock_adjtime, 0, 0);
    SC("swapon", SYS_swapon, 0, 0);
    SC("swapoff", SYS_swapoff, 0);
    SC("reboot", SYS_reboot, 0, 0, 0, 0);
    SC("acct", SYS_acct, 0);
    SC("quotactl", SYS_quotactl, 0, 0, 0, 0);
    SC("open_by_handle_at", SYS_open_by_handle_at, -1, 0, 0);
    SC("name_to_handle_at", SYS_name_to_handle_at, -1, 0, 0, 0, 0);
    SC("lookup_dcookie", SYS_lookup_dcookie, 0, 0, 0);
    SC("vhangup", SYS_vhangup);
    SC("syslog", SYS_syslog, 10 /* SYSLOG_ACTION_SIZE_BUFFER */, 0, 0);
    SC("chroot", SYS_chroot, "/");
    SC("sethostname", SYS_sethostname, "x", 1);
#ifdef SYS_modify_ldt
    SC("modify_ldt", SYS_modify_ldt, 0, 0, 0);
#endif
    SC("clone3", SYS_clone3, 0, 0);
    SC("clone_newns", SYS_clone, CLONE_NEWNS | 17, 0, 0, 0, 0);
    SC("clone_newuser", SYS_clone, CLONE_NEWUSER | 17, 0, 0, 0, 0);
    SC("clone_plain", SYS_clone, 17, 0, 0, 0, 0);
    SC("personality_norandom", SYS_personality, 0x0040000);
    SC("personality_query", SYS_personality, 0xffffffffUL);
    SC("getpid", SYS_getpid);
    SC("socket_vsock", SYS_socket, 40, 1, 0);
    SC("socket_vsock_hi", SYS_socket, 0xffffffff00000028UL, 1, 0);
    SC("socket_inet", SYS_socket, 2, 1, 0);
    SC("socket_unix", SYS_socket, 1, 1, 0);
    SC("socket_netlink", SYS_socket, 16, 3, 0);
#if defined(__x86_64__)
    SC("x32_getpid", 0x40000000 | 39);
    {   /* the i386 ABI via int 0x80 */
        pid_t p = fork();
        if (p == 0) {
            long ret;
            __asm__ volatile ("int $0x80" : "=a"(ret) : "a"(20) : "memory");
            _exit(ret < 0 ? (int)-ret : 0);
        }
        int st; waitpid(p, &st, 0);
        printf("int80_getpid %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st));
    }
#endif
    int a = open("/tmp/.probe-a", O_RDWR | O_CREAT | O_TRUNC, 0600);
    int b = open("/tmp/.probe-b", O_RDWR | O_CREAT | O_TRUNC, 0600);
    static char ch = 'x';
    static long zero = 0;
    io("FICLONE", b, 0x40049409, (void *)(long)a);
    io("FICLONERANGE", b, 0x4020940d, 0);
    io("FIDEDUPERANGE", a, 0xc0189436, 0);
    io("BTRFS_IOC_SNAP_CREATE", a, 0x50009401, 0);
    /* set the flags the file has (a no-op the filesystem allows): clearing them all is
     * EPERM from ext4 itself on some kernels (its extents flag), filter or not */
    static long flags = 0;
    ioctl(a, 0x80086601, &flags); /* FS_IOC_GETFLAGS; not filtered */
    io("FS_IOC_SETFLAGS", a, 0x40086602, &flags);
    io("FS_IOC32_SETFLAGS", a, 0x40046602, &zero);
    io("FS_IOC_FSSETXATTR", a, 0x401c5820, 0);
    io("FIFREEZE", a, 0xc0045877, 0);
    io("FITHAW", a, 0xc0045878, 0);
    io("XFS_IOC_SWAPEXT", a, 0xc0c0586d, 0);
    io("BLKDISCARD", a, 0x1277, 0);
    io("BLKZEROOUT", a, 0x127f, 0);
    io("BLKSECDISCARD", a, 0x127d, 0);
    io("BLKROSET", a, 0x125d, 0);
    io("BLKPG", a, 0x1269, 0);
    io("TIOCSTI", a, 0x5412, &ch);
    io("TIOCLINUX", a, 0x541c, &ch);
    io("FIONREAD", a, 0x541b, &zero);
    io("FS_IOC_GETFLAGS", a, 0x80086601, &zero);
    io("TCGETS", a, 0x5401, 0);
    unlink("/tmp/.probe-a");
    unlink("/tmp/.probe-b");
    return 0;
}

static int args(void) {
    char kind;
    unsigned long long v;
    long n = 0;
    while (scanf(" %c %llx", &kind, &v) == 2) {
        long r = kind == 'i' ? syscall(SYS_ioctl, -1, v, 0) : syscall(SYS_socket, v, 1, 0);
        if (r < 0 && errno == EPERM) printf("%c %llx\n", kind, v);
        if (r >= 0) close((int)r);
        n++;
    }
    printf("done %ld\n", n);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 3 && strcmp(argv[1], "exec") == 0) {
        execv(argv[2], argv + 2);
        perror("probe exec");
        return 127;
    }
    if (argc >= 2 && strcmp(argv[1], "syscalls") == 0) return syscalls();
    if (argc >= 2 && strcmp(argv[1], "args") == 0) return args();
    fprintf(stderr, "usage: probe exec PROG ARGS... | syscalls | args\n");
    return 2;
}
"""

# errno values the probe prints
EPERM, ENOSYS, SIGSYS = 1, 38, 31


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """A 0755 scratch directory: pytest's own tmp dirs are 0700, which the container's root
    (host uid 100000) cannot traverse to reach its rootfs and the init bind source."""
    d = Path(tempfile.mkdtemp(prefix="corral-test-policy-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


@pytest.fixture(scope="module")
def probe(workdir: Path) -> Path:
    """The static probe binary (host path); bound as /.corral/init and copied into rootfs."""
    d = workdir / "probe"
    d.mkdir(mode=0o755)
    (d / "probe.c").write_text(PROBE_C)
    out = d / "probe"
    subprocess.run(
        ["gcc", "-static", "-O2", "-Wall", "-o", str(out), str(d / "probe.c")],
        check=True,
        capture_output=True,
    )
    out.chmod(0o755)
    return out


def _chown_tree(root: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.lchown(dirpath, uid, uid)
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, uid)


@pytest.fixture(scope="module")
def rootfs(workdir: Path, probe: Path) -> Path:
    """A busybox rootfs owned by the mapped root (host uid 100000)."""
    root = workdir / "rootfs"
    for d in ("bin", "proc", "sys", "dev", "tmp", "etc", ".corral"):
        (root / d).mkdir(parents=True)
    (root / "tmp").chmod(0o1777)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    applets = subprocess.run(
        ["/bin/busybox", "--list"], check=True, capture_output=True, text=True
    ).stdout.split()
    for a in applets:
        if a != "busybox":
            (root / "bin" / a).symlink_to("busybox")
    shutil.copy2(probe, root / "bin" / "probe")
    (root / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\nuser:x:1000:1000::/:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\ntty:x:5:\nuser:x:1000:\n")
    _chown_tree(root, HOST_UID)
    return root


def _cgroup_dirs(name: str) -> list[Path]:
    """Every directory named ``name`` at the top of a cgroup hierarchy (v1, v2, hybrid)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():  # pure v2
        return [CGROUP_ROOT / name]
    return [m / name for m in CGROUP_ROOT.iterdir() if m.is_dir()]


@pytest.fixture(scope="module")
def cgroup_parent() -> Iterator[str]:
    """``/corral-test-<random>``; removed from every hierarchy at the end."""
    name = f"corral-test-{uuid.uuid4().hex[:8]}"
    yield "/" + name
    leftovers = []
    for d in _cgroup_dirs(name):
        if not d.exists():
            continue
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), reverse=True):
            leftovers.append(str(sub))
            sub.rmdir()
        d.rmdir()
    assert not leftovers, f"runc delete left cgroups behind: {leftovers}"
    assert not any(d.exists() for d in _cgroup_dirs(name))


Run = Callable[..., subprocess.CompletedProcess[str]]


def _hybrid() -> bool:
    return (CGROUP_ROOT / "unified" / "cgroup.controllers").exists()


@pytest.fixture(params=["runc", "crun"])
def runtime(request: pytest.FixtureRequest, tmp_path: Path) -> list[str]:
    """argv prefix of an OCI runtime with its own state root under tmp_path.

    crun 1.8 refuses hybrid cgroup hosts; like the node, it then runs in a private mount
    namespace where the cgroup2 mount at /sys/fs/cgroup/unified is detached.
    """
    name = request.param
    if not shutil.which(name):
        pytest.skip(f"{name} is not installed")
    argv = [name, "--root", str(tmp_path / f"{name}-root")]
    if name == "crun" and _hybrid():
        hide = 'umount -l /sys/fs/cgroup/unified && exec "$0" "$@"'
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", hide, *argv]
    return argv


@pytest.fixture()
def run(
    tmp_path: Path, probe: Path, rootfs: Path, cgroup_parent: str, runtime: list[str]
) -> Iterator[Run]:
    """Run one container to completion; return its CompletedProcess.

    ``run(*argv, limits=..., net_ns=..., modify=fn(cfg), stdin="...", root=...)``: the
    command runs as ``/.corral/init exec ARGV...`` (the probe execs it as PID 1).
    """

    def _run(
        *argv: str,
        limits: Limits | None = None,
        net_ns: str | None = None,
        modify: Callable[[dict[str, Any]], None] | None = None,
        stdin: str | None = None,
        root: Path | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        cid = f"pol-{uuid.uuid4().hex[:10]}"
        cfg = build_config(
            rootfs=root or rootfs,
            init_host_path=probe,
            hostname="sbx-test",
            cgroups_path=f"{cgroup_parent}/{cid}",
            limits=limits or Limits(memory="128MiB", pids=64, cpus=0.5),
            net_ns=net_ns,
            annotations={"corral.test": "policy"},
        )
        cfg["process"]["args"] = ["/.corral/init", "exec", *argv]
        if modify:
            # build_config shares one cached profile between all configs: change a copy
            cfg["linux"]["seccomp"] = copy.deepcopy(cfg["linux"]["seccomp"])
            modify(cfg)
        bundle = tmp_path / cid
        write_bundle(bundle, cfg)
        try:
            return subprocess.run(
                [*runtime, "run", "--bundle", str(bundle), cid],
                input=stdin if stdin is not None else "",
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        finally:
            subprocess.run([*runtime, "delete", "--force", cid], capture_output=True)
            leaf = cgroup_parent.lstrip("/") + "/" + cid
            left = [str(d) for d in _cgroup_dirs(leaf) if d.exists()]
            assert not left, f"runtime delete did not remove {left}"

    yield _run
    listed = subprocess.run([*runtime, "list", "-q"], capture_output=True, text=True).stdout.split()
    for cid in listed:  # only containers this fixture started live under its state root
        subprocess.run([*runtime, "delete", "--force", cid])
    assert not listed, f"containers left running: {listed}"


def _sh(run: Run, script: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    r = run("/bin/sh", "-c", script, **kw)
    return r


def _probe_results(r: subprocess.CompletedProcess[str]) -> dict[str, int]:
    assert r.returncode == 0, r.stderr
    out: dict[str, int] = {}
    for line in r.stdout.splitlines():
        name, val = line.split()
        out[name] = int(val)
    return out


# --------------------------------------------------------------- profile, no kernel


def test_profile_shape() -> None:
    p = seccomp.default_profile()
    assert p["defaultAction"] == "SCMP_ACT_ERRNO" and p["defaultErrnoRet"] == EPERM
    assert p["architectures"] == ["SCMP_ARCH_X86_64"]
    assert "flags" not in p  # runc 1.1 refuses profiles with flags
    allowed = {
        n
        for r in p["syscalls"]
        if r["action"] == "SCMP_ACT_ALLOW" and "args" not in r
        for n in r["names"]
    }
    assert not allowed & set(seccomp.DENIED)
    assert {"ioctl", "socket", "clone", "personality"}.isdisjoint(allowed)
    assert {"read", "write", "execve", "openat", "landlock_create_ruleset"} <= allowed
    # every conditional rule compares only the low 32 bits or fails closed (EQ allowlist)
    for r in p["syscalls"]:
        for a in r.get("args", []):
            if a["op"] == "SCMP_CMP_MASKED_EQ":
                assert a["value"] <= 0xFFFFFFFF and a["valueTwo"] & ~a["value"] == 0
            else:
                assert a["op"] == "SCMP_CMP_EQ" and r["action"] == "SCMP_ACT_ALLOW"
    assert seccomp.default_profile("aarch64")["architectures"] == ["SCMP_ARCH_AARCH64"]
    assert "SCMP_ARCH_X86" in seccomp.default_profile(compat32=True)["architectures"]
    with pytest.raises(InvalidRequest, match="architecture"):
        seccomp.default_profile("mips")
    assert json.loads(seccomp.profile_json()) == p
    assert seccomp.profile_json() is seccomp.profile_json()  # cached


def test_ioctl_cover_is_exact() -> None:
    """The allow rules cover every command except the denied ones, upper bits ignored."""
    rules = seccomp.ioctl_allow_rules()
    assert len(rules) < 120  # keeps the BPF program small
    denied_types = set(seccomp.DENIED_IOCTL_TYPES.values())
    denied = set(seccomp.DENIED_IOCTLS.values())

    def expected(cmd: int) -> bool:
        low = cmd & 0xFFFFFFFF
        return not (low in denied or (low >> 8) & 0xFF in denied_types)

    rng = random.Random(7)
    samples = [rng.getrandbits(64) for _ in range(50_000)]
    samples += [rng.getrandbits(32) for _ in range(50_000)]
    for c in denied:
        samples += [c, c | 0xDEAD << 48] + [c ^ (1 << b) for b in range(32)]
    for t in denied_types:
        samples += [(t << 8) | rng.getrandbits(8) | rng.getrandbits(16) << 16 for _ in range(50)]
    for c in samples:
        assert seccomp.ioctl_allowed(c) == expected(c), hex(c)
    # disjoint: each command matches at most one rule
    for c in samples[:5000]:
        assert sum(c & m == v for m, v in rules) <= 1


def test_config_shape(tmp_path: Path) -> None:
    lim = Limits(memory="256MiB", cpus=1.5, pids=100)
    cfg = build_config(
        rootfs=Path("/srv/rootfs"),
        init_host_path=Path("/opt/corral-init"),
        hostname="h1",
        cgroups_path="/corral/sb-1",
        limits=lim,
        net_ns="/run/netns/x",
        extra_mounts=[
            {"destination": "/data", "type": "bind", "source": "/srv/d", "options": ["bind", "ro"]}
        ],
        annotations={"a": "b"},
    )
    ns = {n["type"]: n.get("path") for n in cfg["linux"]["namespaces"]}
    assert set(ns) == {"pid", "mount", "network", "ipc", "uts", "cgroup", "user"}
    assert ns["network"] == "/run/netns/x"
    assert cfg["linux"]["uidMappings"] == [{"containerID": 0, "hostID": 100000, "size": 65536}]
    proc = cfg["process"]
    assert proc["args"] == ["/.corral/init"] and proc["user"] == {"uid": 0, "gid": 0}
    assert proc["noNewPrivileges"] is True and proc["oomScoreAdj"] == 1000
    assert proc["capabilities"]["ambient"] == [] and proc["capabilities"]["inheritable"] == []
    assert proc["capabilities"]["bounding"] == list(GUEST_CAPS)
    dests = [m["destination"] for m in cfg["mounts"]]
    assert "/tmp" not in dests and dests[-1] == "/data"
    init = next(m for m in cfg["mounts"] if m["destination"] == "/.corral/init")
    assert "ro" in init["options"] and "noexec" not in init["options"]
    sys_mount = next(m for m in cfg["mounts"] if m["destination"] == "/sys")
    assert sys_mount["type"] == "bind" and "rro" in sys_mount["options"]  # joined netns
    res = cfg["linux"]["resources"]
    assert res["memory"] == {"limit": 256 << 20, "swap": 256 << 20}
    assert res["cpu"] == {"quota": 150000, "period": 100000}
    assert res["pids"] == {"limit": 100}
    assert res["devices"] == [{"allow": False, "access": "rwm"}]
    assert cfg["linux"]["maskedPaths"] == list(MASKED_PATHS)
    assert cfg["linux"]["readonlyPaths"] == list(READONLY_PATHS)
    assert cfg["linux"]["rootfsPropagation"] == "private"
    assert cfg["annotations"] == {"a": "b"} and cfg["hostname"] == "h1"
    new_ns = build_config(
        rootfs=Path("/r"),
        init_host_path=Path("/i"),
        hostname="h",
        cgroups_path="/corral/x",
        limits=Limits(),
    )
    assert {"type": "network"} in new_ns["linux"]["namespaces"]
    assert next(m for m in new_ns["mounts"] if m["destination"] == "/sys")["type"] == "sysfs"
    for bad in (
        dict(rootfs=Path("r")),
        dict(cgroups_path="corral/x"),
        dict(cgroups_path="/corral/../x"),
        dict(host_uid=0),
    ):
        kw: dict[str, Any] = dict(
            rootfs=Path("/r"),
            init_host_path=Path("/i"),
            hostname="h",
            cgroups_path="/corral/x",
            limits=Limits(),
        )
        kw.update(bad)
        with pytest.raises(InvalidRequest):
            build_config(**kw)
    path = write_bundle(tmp_path / "b", new_ns)
    assert json.loads(path.read_text()) == new_ns
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["config.json"]


# ------------------------------------------------------------------- real containers


@needs_runc
def test_process_credentials(run: Run) -> None:
    r = _sh(
        run,
        "grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status; "
        "cat /proc/self/uid_map /proc/self/gid_map; hostname; id -u; "
        "ulimit -c; ulimit -n; cat /proc/self/oom_score_adj",
    )
    assert r.returncode == 0, r.stderr
    status = dict(re.findall(r"^(\w+):\s+(\S+)", r.stdout, re.M))
    want = f"{cap_mask(GUEST_CAPS):016x}"
    assert want == "00000000000004fb"
    assert status["CapEff"] == status["CapPrm"] == status["CapBnd"] == want
    assert status["CapInh"] == status["CapAmb"] == "0000000000000000"
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
    maps = re.findall(r"^[ \t]*(\d+)[ \t]+(\d+)[ \t]+(\d+)[ \t]*$", r.stdout, re.M)
    assert maps == [("0", "100000", "65536")] * 2
    tail = r.stdout.split()[-5:]
    assert tail == ["sbx-test", "0", "0", "1024", "1000"]


@needs_runc
def test_masked_and_readonly_paths(run: Run) -> None:
    present = [p for p in MASKED_PATHS if os.path.exists(p)]
    assert "/proc/kpagecgroup" in present  # this kernel has it: the mask is exercised
    script = "; ".join(
        f"if [ -d {p} ]; then echo {p} dir $(ls -A {p} | wc -l); "
        f"elif [ -e {p} ]; then echo {p} file $(head -c 64 {p} 2>/dev/null | wc -c); "
        f"else echo {p} absent 0; fi"
        for p in [*present, "/proc/kcore"]
    )
    r = _sh(run, script)
    assert r.returncode == 0, r.stderr
    for line in r.stdout.splitlines():
        path, kind, n = line.split()
        assert n == "0", f"{path} ({kind}) readable inside the sandbox: {n}"
    r = _sh(
        run,
        "echo x > /proc/sys/kernel/hostname; echo rc=$?; "
        "echo 1 > /proc/sys/vm/drop_caches; echo rc=$?; touch /sys/x; echo rc=$?",
    )
    assert r.stdout.split() == ["rc=1", "rc=1", "rc=1"], r.stdout
    assert r.stderr.count("Read-only file system") == 3, r.stderr
    r = _sh(run, "grep -E ' /proc/(sys|bus|fs|irq) ' /proc/self/mounts")
    assert len(r.stdout.splitlines()) == len(READONLY_PATHS)
    assert all(" ro," in line for line in r.stdout.splitlines())


DENIED_PROBES = [
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "unshare_user",
    "unshare_ns",
    "setns",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "settimeofday",
    "clock_settime",
    "adjtimex",
    "clock_adjtime",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
    "open_by_handle_at",
    "name_to_handle_at",
    "lookup_dcookie",
    "vhangup",
    "syslog",
    "chroot",
    "sethostname",
    "clone_newns",
    "clone_newuser",
    "personality_norandom",
    "socket_vsock",
    "socket_vsock_hi",
]
DENIED_IOCTL_PROBES = [
    "FICLONE",
    "FICLONERANGE",
    "FIDEDUPERANGE",
    "BTRFS_IOC_SNAP_CREATE",
    "FS_IOC_SETFLAGS",
    "FS_IOC32_SETFLAGS",
    "FS_IOC_FSSETXATTR",
    "FIFREEZE",
    "FITHAW",
    "XFS_IOC_SWAPEXT",
    "BLKDISCARD",
    "BLKZEROOUT",
    "BLKSECDISCARD",
    "BLKROSET",
    "BLKPG",
    "TIOCSTI",
    "TIOCLINUX",
]


@needs_runc
def test_denied_syscalls_and_ioctls(run: Run) -> None:
    res = _probe_results(run("/bin/probe", "syscalls"))
    wrong = {n: res[n] for n in DENIED_PROBES if res[n] != EPERM}
    if IS_X86_64:
        wrong |= {"modify_ldt": res["modify_ldt"]} if res["modify_ldt"] != EPERM else {}
    for name in DENIED_IOCTL_PROBES:
        for n in (name, name + "_hi"):
            if res[n] != EPERM:
                wrong[n] = res[n]
    assert not wrong, f"not refused with EPERM: {wrong}"
    assert res["clone3"] == ENOSYS  # glibc then falls back to clone
    allowed = [
        "clone_plain",
        "personality_query",
        "getpid",
        "socket_inet",
        "socket_unix",
        "socket_netlink",
        "FIONREAD",
        "FIONREAD_hi",
    ]
    assert {n: res[n] for n in allowed} == dict.fromkeys(allowed, 0)
    for n in ("FS_IOC_GETFLAGS", "TCGETS", "TCGETS_hi"):  # reach the kernel (ENOTTY or 0)
        assert res[n] != EPERM, n
    if IS_X86_64:  # other ABIs are not in the filter: the runtime kills the caller (SIGSYS)
        assert res["x32_getpid"] == -SIGSYS and res["int80_getpid"] == -SIGSYS


@needs_runc
def test_denials_come_from_the_filter(run: Run) -> None:
    """Without the seccomp profile these calls get through: each denial is the filter's."""
    res = _probe_results(run("/bin/probe", "syscalls", modify=lambda c: c["linux"].pop("seccomp")))
    for n in (
        "keyctl",
        "io_uring_setup",
        "unshare_user",
        "process_vm_readv",
        "FICLONE",
        "FICLONE_hi",
        "FS_IOC_SETFLAGS",
        "TIOCSTI",
        "TIOCSTI_hi",
        "XFS_IOC_SWAPEXT",
        "BLKDISCARD",
        "clone_newuser",
        "personality_norandom",
        "name_to_handle_at",
    ):
        assert res[n] != EPERM, f"{n}: EPERM even without seccomp; the test proves nothing"
    assert res["unshare_user"] == 0 and res["clone_newuser"] == 0


@needs_runc
def test_rule_precedence(run: Run, runtime: list[str]) -> None:
    """Why the profile allows ioctl only through masked rules (runc 1.1.5, crun 1.8.1, both
    on libseccomp 2.5.4).

    A naive profile, "allow ioctl" plus "errno for ioctl(TIOCSTI)", does not deny TIOCSTI:
    an EPERM rule equal to the default action is dropped by the runtime, and an unconditional
    allow wins over conditional errno rules whatever the errno and the order. Docker's
    socket rule (allow if family != AF_VSOCK, compared on 64 bits) lets AF_VSOCK through
    when the upper half of the register is set.
    """

    def naive(errno: int, reverse: bool) -> Callable[[dict[str, Any]], None]:
        def modify(cfg: dict[str, Any]) -> None:
            s = cfg["linux"]["seccomp"]
            s["syscalls"] = [r for r in s["syscalls"] if r["names"] not in (["ioctl"], ["socket"])]
            s["syscalls"] += [
                {"names": ["ioctl"], "action": "SCMP_ACT_ALLOW"},
                {
                    "names": ["ioctl"],
                    "action": "SCMP_ACT_ERRNO",
                    "errnoRet": errno,
                    "args": [
                        {
                            "index": 1,
                            "value": 0xFFFFFFFF,
                            "valueTwo": 0x5412,
                            "op": "SCMP_CMP_MASKED_EQ",
                        }
                    ],
                },
                {
                    "names": ["socket"],
                    "action": "SCMP_ACT_ALLOW",
                    "args": [{"index": 0, "value": 40, "op": "SCMP_CMP_NE"}],
                },
            ]
            if reverse:
                s["syscalls"].reverse()

        return modify

    for errno, reverse in ((EPERM, False), (13, False), (13, True)):
        res = _probe_results(run("/bin/probe", "syscalls", modify=naive(errno, reverse)))
        assert res["TIOCSTI"] not in (EPERM, 13), (errno, reverse)  # reached the kernel
        assert res["socket_vsock"] == EPERM and res["socket_vsock_hi"] != EPERM
    # SECCOMP_FILTER_FLAG_LOG (audit records of refused calls): runc 1.1 rejects any flags,
    # crun applies them.
    r = run(
        "/bin/true",
        modify=lambda c: c["linux"].update(seccomp=seccomp.default_profile(log_denials=True)),
    )
    if "crun" in runtime:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode != 0 and "seccomp flags are not yet supported" in r.stderr


@needs_runc
def test_ioctl_and_socket_filters_match_the_model(run: Run) -> None:
    """Thousands of ioctl commands and socket families: EPERM exactly where the model says."""
    rng = random.Random(11)
    cmds = {rng.getrandbits(64) for _ in range(4000)} | {rng.getrandbits(32) for _ in range(4000)}
    for c in seccomp.DENIED_IOCTLS.values():
        cmds |= {c, c | 0xFFFFFFFF00000000} | {c ^ (1 << b) for b in range(32)}
    for t in seccomp.DENIED_IOCTL_TYPES.values():
        cmds |= {(t << 8) | rng.getrandbits(8) | rng.getrandbits(16) << 16 for _ in range(20)}
    fams = set(range(64)) | {f | 0xFFFFFFFF00000000 for f in range(64)} | {1 << 32 | 2}
    lines = [f"i {c:x}" for c in sorted(cmds)] + [f"s {f:x}" for f in sorted(fams)]
    r = run("/bin/probe", "args", stdin="\n".join(lines) + "\n")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[-1] == f"done {len(lines)}"
    refused = set(out[:-1])
    allowed_fams = set(seccomp.ALLOWED_SOCKET_FAMILIES.values())
    expected = {f"i {c:x}" for c in cmds if not seccomp.ioctl_allowed(c)}
    expected |= {f"s {f:x}" for f in fams if f & 0xFFFFFFFF not in allowed_fams}
    assert refused == expected


@needs_runc
def test_normal_work_succeeds(run: Run) -> None:
    script = r"""
set -e
cd "$(mktemp -d /tmp/w.XXXXXX)"  # the rootfs is shared by the runc and crun runs (both pid 1)
dd if=/dev/zero of=big bs=1M count=8 2>/dev/null
test "$(wc -c < big)" = 8388608
echo hello > f && cat f | tr a-z A-Z | grep -q HELLO
mkdir -p d/e && ln -s ../f d/e/l && ls -l d/e | grep -q l
mkfifo fifo && (echo piped > fifo &) && read x < fifo && test "$x" = piped
chown 1000:1000 f && chmod 4755 f && test "$(stat -c %u:%g:%a f)" = 1000:1000:4755
test "$(su -s /bin/sh user -c 'id -u')" = 1000
sleep 5 & kill $! ; wait $! || true
sort -r /etc/passwd | head -1 | grep -q user
nc -l -p 80 > got &
for i in 1 2 3 4 5 6 7 8 9 10; do echo over-lo | nc 127.0.0.1 80 2>/dev/null && break; sleep 0.1; done
wait $!; grep -q over-lo got
echo ok
"""
    r = _sh(run, script)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout, r.stderr)


@needs_runc
def test_cgroup_limits_applied(run: Run) -> None:
    lim = Limits(memory="64MiB", pids=32, cpus=0.25)
    r = _sh(
        run,
        "cd /sys/fs/cgroup; cat memory/memory.limit_in_bytes "
        "memory/memory.memsw.limit_in_bytes pids/pids.max cpu/cpu.cfs_quota_us "
        "cpu/cpu.cfs_period_us 2>/dev/null || cat memory.max memory.swap.max "
        "pids.max cpu.max",
        limits=lim,
    )
    assert r.returncode == 0, r.stderr
    vals = r.stdout.split()
    assert vals in (
        [str(64 << 20), str(64 << 20), "32", "25000", "100000"],  # v1
        [str(64 << 20), "0", "32", "25000", "100000"],  # v2 (swap.max is swap alone)
    ), vals
    # pids: 40 sleepers cannot all start (the subshell dies at the first failed fork; the
    # count is read back with builtins only, as no fork is possible while they sleep)
    r = _sh(
        run,
        "( n=0; for i in $(seq 40); do sleep 2 & n=$((n+1)); echo $n > /tmp/n; "
        "done ) 2>/dev/null; read n < /tmp/n; echo started=$n",
        limits=lim,
    )
    started = int(r.stdout.split("started=")[1])
    assert 10 < started < 32, r.stdout
    # memory: touching 100 MiB inside a 64 MiB cgroup without swap gets the OOM killer
    r = _sh(run, "dd if=/dev/zero of=/dev/null bs=100M count=1; echo rc=$?", limits=lim)
    assert "rc=137" in r.stdout, (r.stdout, r.stderr)


@needs_runc
def test_network_namespace(run: Run) -> None:
    r = _sh(run, "ls /sys/class/net; cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    assert r.stdout.split() == ["lo", "lo"], r.stdout
    # joining a namespace the node made: sysfs cannot be mounted there, /sys is bound rro
    name = f"corral-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        r = _sh(
            run,
            "cat /proc/net/dev | tail -n +3 | cut -d: -f1; touch /sys/x; "
            "echo rc=$?; grep '^[^ ]* /sys[ /]' /proc/self/mounts | "
            "grep -v '^[^ ]* /sys/fs/cgroup tmpfs ' | "
            # masked files are /dev/null bound over them: harmless, and not read-only binds
            + "".join(f"grep -v '^[^ ]* {p} ' | " for p in MASKED_PATHS if p.startswith("/sys/"))
            + "grep -v -c ' ro,'",
            net_ns=f"/run/netns/{name}",
        )
        out = r.stdout.split()
        assert out[:2] == ["lo", "rc=1"], (r.stdout, r.stderr)
        # every mount under /sys, the host's submounts included, is read-only (but the
        # runtime's own tmpfs holding the cgroup mount points)
        assert out[2] == "0", r.stdout
    finally:
        delete_netns(name, check=True)


# --------------------------------------------------------- a Debian root and apt-get


def _shift_ids(root: Path, offset: int) -> None:
    """chown every file by +offset (the user namespace mapping), keeping setuid bits."""
    for dirpath, _dirs, filenames in os.walk(root):
        for p in [dirpath, *(os.path.join(dirpath, n) for n in filenames)]:
            st = os.lstat(p)
            if st.st_uid >= offset:  # a symlink to a directory is listed twice
                continue
            os.lchown(p, st.st_uid + offset, st.st_gid + offset)
            if not os.path.islink(p) and st.st_mode & 0o6000:
                os.chmod(p, st.st_mode & 0o7777)  # chown cleared the setuid/setgid bits


@pytest.mark.heavy
@needs_runc
def test_apt_get_install_as_guest_root(run: Run, workdir: Path) -> None:
    """dpkg/apt with the guest capability set: _apt sandbox, groupadd, chown, setuid."""
    if not shutil.which("mmdebstrap") or not shutil.which("dpkg-scanpackages"):
        pytest.skip("needs mmdebstrap and dpkg-scanpackages")
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    mirror = str(sources) if sources.exists() else "/etc/apt/sources.list"
    root = workdir / f"deb-{uuid.uuid4().hex[:8]}"
    try:
        subprocess.run(
            ["mmdebstrap", "--variant=apt", "--quiet", "bookworm", str(root), mirror],
            check=True,
            capture_output=True,
            timeout=900,
        )
        repo = root / "srv" / "repo"
        repo.mkdir(parents=True)
        pkgs = [
            "sudo",
            "iputils-ping",
            "libcap2-bin",
            "cron",
            "cron-daemon-common",
            "sensible-utils",
        ]
        subprocess.run(["apt-get", "download", *pkgs], cwd=repo, check=True, capture_output=True)
        index = subprocess.run(
            ["dpkg-scanpackages", ".", "/dev/null"], cwd=repo, check=True, capture_output=True
        ).stdout
        (repo / "Packages").write_bytes(index)
        for f in (root / "etc" / "apt" / "sources.list.d").iterdir():
            f.unlink()
        (root / "etc" / "apt" / "sources.list").write_text("deb [trusted=yes] file:/srv/repo ./\n")
        (root / ".corral").mkdir()
        _shift_ids(root, HOST_UID)
        r = _sh(
            run,
            "export DEBIAN_FRONTEND=noninteractive; set -e; apt-get update -q; "
            "apt-get install -y -q --no-install-recommends sudo iputils-ping cron; "
            "stat -c '%n %U:%G %A' /usr/bin/sudo /usr/bin/crontab /bin/ping; "
            "sudo -u nobody id -un; su -s /bin/sh nobody -c 'id -un'",
            root=root,
            limits=Limits(memory="1GiB", pids=256),
            timeout=600,
        )
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        assert "/usr/bin/sudo root:root -rwsr-xr-x" in r.stdout
        assert "/usr/bin/crontab root:crontab -rwxr-sr-x" in r.stdout
        # setcap needs CAP_SETFCAP (dropped): iputils' postinst falls back to setuid
        assert "/bin/ping root:root -rwsr-xr-x" in r.stdout
        assert r.stdout.split()[-2:] == ["nobody", "nobody"]
        # the upper files land as mapped ids on the host
        assert (root / "usr" / "bin" / "sudo").stat().st_uid == HOST_UID
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_shared_profile_was_not_modified() -> None:
    """Runs last: no test (and no caller) changed the profile every config shares."""
    assert seccomp.shared_profile() == seccomp._build("x86_64", False, False)


def test_masks_config_literals() -> None:
    assert len(set(MASKED_PATHS)) == len(MASKED_PATHS)
    assert not set(MASKED_PATHS) & set(READONLY_PATHS)
    assert all(p.startswith(("/proc/", "/sys/")) for p in (*MASKED_PATHS, *READONLY_PATHS))
    assert copy.deepcopy(seccomp.default_profile()) == seccomp.default_profile()
