"""One static C probe calls the dangerous kernel interfaces; every one must be refused.

The probe prints ``name errno`` (0 = the call succeeded). Each call runs in a child so a
success cannot change the probe's own state.
"""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.redteam.conftest import out, probe_results, run, upload_probe

PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/if_ether.h>

#define SC(label, ...) do { pid_t p_ = fork(); \
    if (p_ == 0) { errno = 0; long r_ = syscall(__VA_ARGS__); _exit(r_ < 0 ? errno : 0); } \
    int st_; waitpid(p_, &st_, 0); \
    printf("%s %d\n", label, WIFEXITED(st_) ? WEXITSTATUS(st_) : 200 + WTERMSIG(st_)); \
} while (0)

/* open + write (or read) a file; errno of the first failing step, 0 if all worked */
static void wr(const char *label, const char *path, const char *data) {
    int fd = open(path, O_WRONLY), e = 0;
    if (fd < 0) e = errno; else if (write(fd, data, strlen(data)) < 0) e = errno;
    if (fd >= 0) close(fd);
    printf("%s %d\n", label, e);
}
static void rd(const char *label, const char *path) {
    char buf[256]; int fd = open(path, O_RDONLY | O_NONBLOCK), e = 0; ssize_t n = 0;
    if (fd < 0) e = errno; else if ((n = read(fd, buf, sizeof buf)) < 0) e = errno;
    if (fd >= 0) close(fd);
    /* a read of 0 bytes (a /dev/null mask) counts as refused: report it as -1 */
    printf("%s %d\n", label, e ? e : (n == 0 ? -1 : 0));
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    SC("bpf", SYS_bpf, 0 /* BPF_MAP_CREATE */, 0, 0);
    SC("perf_event_open", SYS_perf_event_open, 0, 0, -1, -1, 0);
    SC("userfaultfd", SYS_userfaultfd, 0);
    SC("io_uring_setup", SYS_io_uring_setup, 1, 0);
    SC("keyctl", SYS_keyctl, 0 /* GET_KEYRING_ID */, -3, 0, 0, 0);
    SC("add_key", SYS_add_key, "user", "red", "x", 1, -3);
    SC("kexec_load", SYS_kexec_load, 0, 0, 0, 0);
    SC("init_module", SYS_init_module, 0, 0, "");
    SC("mount", SYS_mount, "none", "/tmp", "tmpfs", 0, 0);
    SC("mount_proc", SYS_mount, "proc", "/tmp", "proc", 0, 0);
    SC("umount2", SYS_umount2, "/proc/kcore", 2 /* MNT_DETACH */);
    SC("pivot_root", SYS_pivot_root, "/tmp", "/tmp");
    SC("unshare_user", SYS_unshare, CLONE_NEWUSER);
    SC("unshare_mnt", SYS_unshare, CLONE_NEWNS);
    SC("mknod_chr", SYS_mknodat, AT_FDCWD, "/tmp/kmsg", S_IFCHR | 0600, makedev(1, 11));
    SC("mknod_blk", SYS_mknodat, AT_FDCWD, "/tmp/vda", S_IFBLK | 0600, makedev(254, 0));
    SC("socket_packet", SYS_socket, AF_PACKET, SOCK_RAW, htons(ETH_P_ALL));
    SC("socket_raw", SYS_socket, AF_INET, SOCK_RAW, 1 /* ICMP */);
    SC("socket_vsock", SYS_socket, 40, SOCK_STREAM, 0);
    SC("settimeofday", SYS_settimeofday, 0, 0);
    SC("sethostname", SYS_sethostname, "pwned-host", 10);
    SC("setdomainname", SYS_setdomainname, "pwned", 5);
    SC("reboot", SYS_reboot, 0xfee1dead, 672274793, 0x4321fedc /* RESTART */, 0);
    SC("swapon", SYS_swapon, "/tmp", 0);
    SC("syslog", SYS_syslog, 3 /* READ_ALL */, 0, 0);
    SC("chroot", SYS_chroot, "/tmp");
    SC("open_by_handle_at", SYS_open_by_handle_at, AT_FDCWD, 0, 0);
    wr("write_sysrq", "/proc/sysrq-trigger", "h");
    wr("write_core_pattern", "/proc/sys/kernel/core_pattern", "|/tmp/x");
    wr("write_hostname_sysctl", "/proc/sys/kernel/hostname", "pwned");
    wr("release_agent", "/sys/fs/cgroup/memory/release_agent", "/tmp/x");
    wr("notify_on_release", "/sys/fs/cgroup/memory/notify_on_release", "1");
    wr("cgroup_limit", "/sys/fs/cgroup/memory/memory.limit_in_bytes", "-1");
    wr("uevent_helper", "/sys/kernel/uevent_helper", "/tmp/x");
    wr("oom_score_adj_lower", "/proc/self/oom_score_adj", "-1000");
    {   /* steal the control socket (fd 3) of PID 1 through a pidfd */
        pid_t p = fork();
        if (p == 0) {
            long pfd = syscall(SYS_pidfd_open, 1, 0);
            if (pfd < 0) _exit(100 + errno);
            _exit(syscall(SYS_pidfd_getfd, pfd, 3, 0) < 0 ? errno : 0);
        }
        int st; waitpid(p, &st, 0);
        printf("pidfd_getfd_init %d\n", WEXITSTATUS(st));
    }
    rd("read_dev_kmsg", "/dev/kmsg");
    rd("read_proc_kmsg", "/proc/kmsg");
    return 0;
}
"""

# Expected errno per probe line. EPERM (1) is the seccomp default action; others are the
# kernel refusing first (or instead): noted so a change of *which* layer refuses is seen.
EPERM, ENOENT, EACCES, EROFS = 1, 2, 13, 30
EXPECTED: dict[str, set[int]] = {
    "bpf": {EPERM},
    "perf_event_open": {EPERM},
    "userfaultfd": {EPERM},
    "io_uring_setup": {EPERM},
    "keyctl": {EPERM},
    "add_key": {EPERM},
    "kexec_load": {EPERM},
    "init_module": {EPERM},
    "mount": {EPERM},
    "mount_proc": {EPERM},
    "umount2": {EPERM},
    "pivot_root": {EPERM},
    "unshare_user": {EPERM},
    "unshare_mnt": {EPERM},
    "mknod_chr": {EPERM},  # seccomp (and no CAP_MKNOD, and the devices cgroup)
    "mknod_blk": {EPERM},
    "socket_packet": {EPERM},  # family not in the seccomp allowlist
    "socket_raw": {EPERM},  # seccomp (and no CAP_NET_RAW)
    "socket_vsock": {EPERM},
    "settimeofday": {EPERM},
    "sethostname": {EPERM},
    "setdomainname": {EPERM},
    "reboot": {EPERM},
    "swapon": {EPERM},
    "syslog": {EPERM},
    "chroot": {EPERM},
    "open_by_handle_at": {EPERM},
    # /proc/sysrq-trigger is masked with /dev/null: a write "succeeds" into nothing
    # (ENOENT where the kernel has no sysrq).
    "write_sysrq": {0, ENOENT},
    # /proc/sys files belong to the initial namespace's root (EACCES); the mount is ro too
    "write_core_pattern": {EACCES, EROFS},
    "write_hostname_sysctl": {EACCES, EROFS},
    # the cgroup namespace shows only the sandbox's own cgroup: no release_agent there
    "release_agent": {ENOENT, EROFS},
    "notify_on_release": {EACCES, EROFS},
    "cgroup_limit": {EACCES, EROFS},
    "uevent_helper": {ENOENT, EACCES, EROFS},
    # lowering it needs CAP_SYS_RESOURCE: the guest stays the OOM killer's first choice
    "oom_score_adj_lower": {EACCES},
    "pidfd_getfd_init": {EPERM},  # seccomp (pidfd_open itself is allowed)
    "read_dev_kmsg": {ENOENT},  # not in the sandbox's /dev
    "read_proc_kmsg": {-1},  # masked: reads 0 bytes
}


# Probe lines refused by seccomp that must leave a "seccomp" event naming the call.
LOGGED_SYSCALLS = {
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "keyctl", "add_key",
    "kexec_load", "init_module", "mount", "umount2", "pivot_root", "unshare", "socket", "mknodat",
    "settimeofday", "sethostname", "setdomainname", "reboot", "swapon", "syslog", "chroot",
    "open_by_handle_at", "pidfd_getfd",
}  # fmt: skip


def _sysrq_lines() -> int:
    r = subprocess.run(["dmesg"], capture_output=True, text=True)
    return sum("sysrq" in ln.lower() for ln in r.stdout.splitlines())


@pytest.mark.logs("seccomp", syscall="bpf")
@pytest.mark.logs("seccomp", syscall="socket", what="AF_PACKET")
@pytest.mark.logs("seccomp", syscall="socket", what="AF_INET SOCK_RAW")
@pytest.mark.logs("seccomp", syscall="mknodat", what="S_IFCHR")
@pytest.mark.logs("seccomp", syscall="mknodat", what="S_IFBLK")
async def test_kernel_interfaces_refused(red_node, guest):  # type: ignore[no-untyped-def]
    hostname = socket.gethostname()
    sysrq_before = _sysrq_lines()
    await upload_probe(guest, PROBE)
    r = await run(guest, "/tmp/probe")
    got = probe_results(r)
    assert set(got) == set(EXPECTED), out(r)
    wrong = {k: v for k, v in got.items() if v not in EXPECTED[k]}
    assert not wrong, f"unexpected results (name: errno): {wrong}\n{out(r)}"
    assert socket.gethostname() == hostname
    r = await run(guest, "hostname; ls /tmp")
    assert r.stdout.split()[0] == b"sandbox" and b"kmsg" not in r.stdout, out(r)
    assert _sysrq_lines() == sysrq_before, "HOLE: a sysrq write reached the host kernel"
    evs = [e for e in await guest.events() if e.kind == "seccomp"]
    logged = {e.detail["syscall"] for e in evs}
    assert LOGGED_SYSCALLS <= logged, f"refused but not logged: {LOGGED_SYSCALLS - logged}"
    assert {e.detail["comm"] for e in evs} == {"probe"}  # which program made the calls
    # two mount calls: the first is logged at once, the repeat is counted (its event comes
    # when the coalescing window ends), not logged as a second row now
    assert sum(e.detail["syscall"] == "mount" for e in evs) == 1, evs
