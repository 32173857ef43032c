"""The seccomp profile of container sandboxes (an OCI ``linux.seccomp`` object).

Starting point: Docker's default profile for a process without CAP_SYS_ADMIN (default
action ``SCMP_ACT_ERRNO``/EPERM, an allowlist, ``clone`` without namespace flags, ``clone3``
answered ENOSYS so glibc falls back to ``clone``, a few ``personality`` values). On top of it
corral removes from the allowlist what a hostile root guest should not reach at all
(:data:`DENIED`), filters ``ioctl`` (:data:`DENIED_IOCTLS`, :data:`DENIED_IOCTL_TYPES`) and
admits ``socket`` only for :data:`ALLOWED_SOCKET_FAMILIES`. 32-bit ABIs (int 0x80, x32) are
not in the filter: the runtime kills a process that uses them (SIGSYS).

How the ioctl filter is built, and why (verified with libseccomp 2.5.4 as used by runc
1.1.5 and crun 1.8.1, see tests/integration/test_policy.py):

* An ``SCMP_ACT_ERRNO`` rule whose errno equals the default's is refused by libseccomp
  ("rule matches the default action", -EACCES) and runc drops it silently: such a
  "deny" entry would be a no-op.
* With any other errno, an unconditional ``SCMP_ACT_ALLOW`` rule for ``ioctl`` wins over
  argument-conditional ERRNO rules for ``ioctl``, in whichever order they are added.
* One rule cannot compare the same argument twice (-EINVAL), so "allow if cmd != A and
  cmd != B" is not expressible as one rule.
* The kernel reads the ioctl command as a 32-bit ``unsigned int`` (and the socket family as
  an ``int``): a guest can set the upper 32 bits of the register freely.
  ``SCMP_CMP_EQ``/``NE``/``LT``/``GT`` compare all 64 bits and are therefore bypassable for
  deny decisions. Docker's ``socket`` rule (allow if family != AF_VSOCK) is an example:
  ``socket(0xffffffff00000028, ...)`` passes it and creates an AF_VSOCK socket.

So ``ioctl`` is allowed only through ``SCMP_CMP_MASKED_EQ`` rules (mask within the low 32
bits) whose union is exactly the complement of the denied commands; denied commands fall
through to the default action (EPERM). :func:`ioctl_allow_rules` computes that cover.

Logging (the security event log): with ``notify=LISTENER_PATH`` the profile answers the
interesting denials (:data:`DENIED` but :data:`QUIET`, the denied ioctl commands, socket
families outside the allowlist, ``clone`` with namespace flags) with ``SCMP_ACT_NOTIFY``
instead of falling through to the default: the runtime sends the filter's notification fd
to ``listenerPath`` (OCI ``linux.seccomp.listenerPath``, crun and runc >= 1.1), the node's
listener (:mod:`corral.host.seccomp_notify`) records the call and answers EPERM, exactly
what the default action would. The notify rules are disjoint from the allow rules, so the
set of allowed calls is the same with and without them. If nobody listens any more (the
node restarted and lost the fd) the kernel answers ENOSYS: still refused.

One trap with notifications: when several stacked filters return the same action, the
newest filter's listener is asked, and a listener may answer "continue" (run the call). A
guest that installs a filter with a listener of its own could thus run what corral refuses
the moment corral's listener is gone (verified after an agent restart). ``seccomp(2)`` is
therefore allowed only without ``SECCOMP_FILTER_FLAG_NEW_LISTENER`` (in every profile): the
guest may filter itself, never answer for a filter.

``SCMP_ACT_LOG`` *allows* the call, so it is never used for denials. The
``SECCOMP_FILTER_FLAG_LOG`` filter flag makes the kernel write an audit record (type 1326,
host pid and uid, syscall number; to the kernel log when no audit daemon listens) for every
ERRNO result. runc 1.1.x refuses to start a profile with ``flags`` ("seccomp flags are not
yet supported by runc"; support arrived in runc 1.2); crun 1.8 applies it. So
``log_denials=True`` only for crun. Without the flag only kills (the SIGSYS of a foreign
ABI) are logged. The kernel rate-limits these records, so a guest cannot flood the log,
but it can crowd other records out of it.

Example:
    >>> p = default_profile()
    >>> p["defaultAction"], p["defaultErrnoRet"]
    ('SCMP_ACT_ERRNO', 1)
    >>> ioctl_allowed(0x5412)  # TIOCSTI
    False
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from corral.errors import InvalidRequest

__all__ = [
    "DENIED",
    "DENIED_IOCTLS",
    "DENIED_IOCTL_TYPES",
    "ALLOWED",
    "ALLOWED_SOCKET_FAMILIES",
    "EPERM",
    "ENOSYS",
    "QUIET",
    "NOTIFY_SOCKET_FAMILIES",
    "default_profile",
    "profile_json",
    "complement_cover",
    "ioctl_allow_rules",
    "ioctl_allowed",
]

EPERM = 1
ENOSYS = 38

# Docker's unconditional allowlist (moby profiles/seccomp/default.json), by name. Names the
# runtime's libseccomp does not know are skipped by runc; names that do not exist on an
# architecture are simply absent from its filter.
# fmt: off
_DOCKER_ALLOWED: tuple[str, ...] = (
    "accept", "accept4", "access", "adjtimex", "alarm", "bind", "brk", "capget", "capset",
    "chdir", "chmod", "chown", "chown32", "clock_adjtime", "clock_adjtime64",
    "clock_getres", "clock_getres_time64", "clock_gettime", "clock_gettime64",
    "clock_nanosleep", "clock_nanosleep_time64", "close", "close_range", "connect",
    "copy_file_range", "creat", "dup", "dup2", "dup3", "epoll_create", "epoll_create1",
    "epoll_ctl", "epoll_ctl_old", "epoll_pwait", "epoll_pwait2", "epoll_wait",
    "epoll_wait_old", "eventfd", "eventfd2", "execve", "execveat", "exit", "exit_group",
    "faccessat", "faccessat2", "fadvise64", "fadvise64_64", "fallocate", "fanotify_mark",
    "fchdir", "fchmod", "fchmodat", "fchown", "fchown32", "fchownat", "fcntl", "fcntl64",
    "fdatasync", "fgetxattr", "flistxattr", "flock", "fork", "fremovexattr", "fsetxattr",
    "fstat", "fstat64", "fstatat64", "fstatfs", "fstatfs64", "fsync", "ftruncate",
    "ftruncate64", "futex", "futex_time64", "futex_waitv", "futimesat", "getcpu", "getcwd",
    "getdents", "getdents64", "getegid", "getegid32", "geteuid", "geteuid32", "getgid",
    "getgid32", "getgroups", "getgroups32", "getitimer", "getpeername", "getpgid", "getpgrp",
    "getpid", "getppid", "getpriority", "getrandom", "getresgid", "getresgid32", "getresuid",
    "getresuid32", "getrlimit", "get_robust_list", "getrusage", "getsid", "getsockname",
    "getsockopt", "get_thread_area", "gettid", "gettimeofday", "getuid", "getuid32",
    "getxattr", "inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch",
    "io_cancel", "ioctl", "io_destroy", "io_getevents", "io_pgetevents",
    "io_pgetevents_time64", "ioprio_get", "ioprio_set", "io_setup", "io_submit",
    "io_uring_enter", "io_uring_register", "io_uring_setup", "ipc", "kill",
    "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self", "lchown",
    "lchown32", "lgetxattr", "link", "linkat", "listen", "listxattr", "llistxattr",
    "_llseek", "lremovexattr", "lseek", "lsetxattr", "lstat", "lstat64", "madvise",
    "membarrier", "memfd_create", "memfd_secret", "mincore", "mkdir", "mkdirat",
    "mlock", "mlock2", "mlockall", "mmap", "mmap2", "mprotect", "mq_getsetattr",
    "mq_notify", "mq_open", "mq_timedreceive", "mq_timedreceive_time64", "mq_timedsend",
    "mq_timedsend_time64", "mq_unlink", "mremap", "msgctl", "msgget", "msgrcv", "msgsnd",
    "msync", "munlock", "munlockall", "munmap", "name_to_handle_at", "nanosleep",
    "newfstatat", "_newselect", "open", "openat", "openat2", "pause", "pidfd_open",
    "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc", "pkey_free", "pkey_mprotect",
    "poll", "ppoll", "ppoll_time64", "prctl", "pread64", "preadv", "preadv2", "prlimit64",
    "process_mrelease", "pselect6", "pselect6_time64", "pwrite64", "pwritev", "pwritev2",
    "read", "readahead", "readlink", "readlinkat", "readv", "recv", "recvfrom", "recvmmsg",
    "recvmmsg_time64", "recvmsg", "remap_file_pages", "removexattr", "rename", "renameat",
    "renameat2", "restart_syscall", "rmdir", "rseq", "rt_sigaction", "rt_sigpending",
    "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend",
    "rt_sigtimedwait", "rt_sigtimedwait_time64", "rt_tgsigqueueinfo", "sched_getaffinity",
    "sched_getattr", "sched_getparam", "sched_get_priority_max", "sched_get_priority_min",
    "sched_getscheduler", "sched_rr_get_interval", "sched_rr_get_interval_time64",
    "sched_setaffinity", "sched_setattr", "sched_setparam", "sched_setscheduler",
    "sched_yield", "seccomp", "select", "semctl", "semget", "semop", "semtimedop",
    "semtimedop_time64", "send", "sendfile", "sendfile64", "sendmmsg", "sendmsg", "sendto",
    "setfsgid", "setfsgid32", "setfsuid", "setfsuid32", "setgid", "setgid32", "setgroups",
    "setgroups32", "setitimer", "setpgid", "setpriority", "setregid", "setregid32",
    "setresgid", "setresgid32", "setresuid", "setresuid32", "setreuid", "setreuid32",
    "setrlimit", "set_robust_list", "setsid", "setsockopt", "set_thread_area",
    "set_tid_address", "setuid", "setuid32", "setxattr", "shmat", "shmctl", "shmdt",
    "shmget", "shutdown", "sigaltstack", "signalfd", "signalfd4", "sigprocmask",
    "sigreturn", "socketcall", "socketpair", "splice", "stat", "stat64", "statfs",
    "statfs64", "statx", "symlink", "symlinkat", "sync", "sync_file_range", "syncfs",
    "sysinfo", "tee", "tgkill", "time", "timer_create", "timer_delete", "timer_getoverrun",
    "timer_gettime", "timer_gettime64", "timer_settime", "timer_settime64",
    "timerfd_create", "timerfd_gettime", "timerfd_gettime64", "timerfd_settime",
    "timerfd_settime64", "times", "tkill", "truncate", "truncate64", "ugetrlimit", "umask",
    "uname", "unlink", "unlinkat", "utime", "utimensat", "utimensat_time64", "utimes",
    "vfork", "vmsplice", "wait4", "waitid", "waitpid", "write", "writev",
)

# Harmless syscalls newer than that list (glibc >= 2.39 and recent runtimes call them). A
# runtime whose libseccomp predates them skips the names, and runc answers ENOSYS for
# unknown syscalls, so libc falls back to the older call.
_NEWER_ALLOWED: tuple[str, ...] = (
    "cachestat", "fchmodat2", "futex_requeue", "futex_wait", "futex_wake",
    "map_shadow_stack", "mseal",
)
# fmt: on

# Syscalls a guest never gets, with the reason. Every one is refused with EPERM (the
# default action). Some are in Docker's allowlist, the others are only granted by Docker
# together with a capability the guest does not have; listing them here keeps them out
# even if someone later widens the capability set.
DENIED: dict[str, str] = {
    "bpf": "kernel attack surface; BPF programs and maps",
    "perf_event_open": "kernel attack surface; side channels on the host",
    "userfaultfd": "stalls kernel copies at will: the classic race-widener for exploits",
    "io_uring_setup": "bypasses seccomp for the operations it runs; many CVEs",
    "io_uring_enter": "see io_uring_setup",
    "io_uring_register": "see io_uring_setup",
    "keyctl": "kernel keyrings are not namespaced",
    "add_key": "kernel keyrings are not namespaced",
    "request_key": "kernel keyrings are not namespaced",
    "kexec_load": "replaces the host kernel",
    "kexec_file_load": "replaces the host kernel",
    "init_module": "loads kernel code",
    "finit_module": "loads kernel code",
    "delete_module": "unloads kernel code",
    "mount": "mounts are the node's job; a guest mount could hide or replace files",
    "umount": "see mount",
    "umount2": "would uncover what masked paths hide",
    "pivot_root": "see mount",
    "move_mount": "new mount API",
    "open_tree": "new mount API: clones mounts, idmaps",
    "fsopen": "new mount API",
    "fsmount": "new mount API",
    "fsconfig": "new mount API",
    "fspick": "new mount API",
    "mount_setattr": "new mount API: could drop ro/nosuid from the guest's mounts",
    "unshare": "new user namespaces regain a full capability set inside them",
    "setns": "see unshare",
    "ptrace": "would reach PID 1 (the control socket) and bypass seccomp of tracees",
    "process_vm_readv": "reads another process's memory (PID 1)",
    "process_vm_writev": "writes another process's memory (PID 1)",
    "kcmp": "compares kernel pointers of other processes",
    "pidfd_getfd": "steals file descriptors (PID 1's control socket)",
    "process_madvise": "acts on another process's memory",
    "settimeofday": "host clock",
    "stime": "host clock",
    "clock_settime": "host clock",
    "clock_settime64": "host clock",
    "adjtimex": "host clock discipline",
    "clock_adjtime": "host clock discipline",
    "clock_adjtime64": "host clock discipline",
    "swapon": "host swap",
    "swapoff": "host swap",
    "reboot": "host power",
    "acct": "process accounting to a file, host-wide",
    "quotactl": "filesystem quotas are the node's",
    "quotactl_fd": "filesystem quotas are the node's",
    "nfsservctl": "kernel NFS server",
    "open_by_handle_at": "opens files by handle outside the mount (the 'shocker' escape)",
    "name_to_handle_at": "the other half of open_by_handle_at",
    "lookup_dcookie": "kernel profiling interface",
    "vhangup": "hangs up terminals",
    "syslog": "kernel log of the host",
    "sethostname": "the hostname is set by the runtime",
    "setdomainname": "the domain name is set by the runtime",
    "chroot": "not needed by agent tasks; classic escape building block",
    "fanotify_init": "filesystem-wide monitoring",
    "iopl": "raw port I/O",
    "ioperm": "raw port I/O",
    "modify_ldt": "rarely used (16-bit code), a long CVE history",
    "get_mempolicy": "NUMA policy is the node's",
    "mbind": "NUMA policy is the node's",
    "set_mempolicy": "NUMA policy is the node's",
    "set_mempolicy_home_node": "NUMA policy is the node's",
    "uselib": "obsolete a.out loader",
    "socketcall": "i386 multiplexer: its arguments are in memory, so the socket family "
    "filter could not see them",
}
# Denied but not worth an event: NUMA-aware runtimes (hwloc, OpenBLAS, the JVM) probe these
# routinely. They fall through to the default action (EPERM) without a notification.
QUIET: frozenset[str] = frozenset(
    {"get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node", "socketcall"}
)

# Allowed only conditionally (see _build): clone without namespace flags, personality with a
# few values, socket for ALLOWED_SOCKET_FAMILIES, ioctl except DENIED_IOCTLS; clone3 is
# answered ENOSYS.
_CONDITIONAL = ("clone", "clone3", "personality", "ioctl", "socket", "seccomp")

# seccomp(2) is allowed (programs sandbox themselves) but not with a notification listener
# of the guest's own: among filters that answer a call with the same action the newest one
# decides, so a guest listener could receive the USER_NOTIF of a call corral refuses and
# answer it "continue", i.e. run it. While corral's own listener is open the kernel refuses
# a second one (EBUSY), but after an agent restart it is gone. arg 1 is the flags word.
_SECCOMP_FLAG_NEW_LISTENER = 0x8

# ioctl commands refused (EPERM). The kernel compares only the low 32 bits.
DENIED_IOCTLS: dict[str, int] = {
    # Sharing or swapping file extents: lets a guest change data it cannot write through
    # normal paths and defeats per-sandbox quota accounting.
    "FICLONE": 0x40049409,
    "FICLONERANGE": 0x4020940D,
    "FIDEDUPERANGE": 0xC0189436,
    "XFS_IOC_SWAPEXT": 0xC0C0586D,
    # Inode flags (immutable, append-only, nodump...) and project ids / xflags.
    "FS_IOC_SETFLAGS": 0x40086602,
    "FS_IOC32_SETFLAGS": 0x40046602,
    "FS_IOC_FSSETXATTR": 0x401C5820,
    # Freezing a filesystem stalls every writer on the node.
    "FIFREEZE": 0xC0045877,
    "FITHAW": 0xC0045878,
    # Block devices (none are reachable, but the filter does not depend on that).
    "BLKROSET": 0x125D,
    "BLKRRPART": 0x125F,
    "BLKFLSBUF": 0x1261,
    "BLKPG": 0x1269,
    "BLKDISCARD": 0x1277,
    "BLKSECDISCARD": 0x127D,
    "BLKZEROOUT": 0x127F,
    # Terminal injection: pushes input into a terminal another process reads (PID 1's
    # sessions, the node's tty when one is shared), and console tricks.
    "TIOCSTI": 0x5412,
    "TIOCLINUX": 0x541C,
}

# Whole ioctl families, by the "type" byte (bits 8..15 of the command): every command of
# the family is refused, whatever its direction and size bits.
DENIED_IOCTL_TYPES: dict[str, int] = {
    "btrfs (and FICLONE/FIDEDUPERANGE, which share its type)": 0x94,
    "block layer BLK*": 0x12,
    # 'X': XFS (XFS_IOC_SWAPEXT...), FIFREEZE/FITHAW, FS_IOC_FS[GS]ETXATTR. Only xfs_io
    # and `lsattr -p` use these; denying the family halves the size of the ioctl filter.
    "XFS, FIFREEZE/FITHAW, FS_IOC_FS[GS]ETXATTR": 0x58,
}

_TYPE_MASK = 0xFF00
_LOW32 = 0xFFFFFFFF

# socket(2) families a guest may open. An allowlist, not Docker's "anything but AF_VSOCK":
# rare families (RDS, TIPC, CAN, X.25, ATM, PPPoX, ALG...) are where socket CVEs live, and on
# a microVM host AF_VSOCK reaches the hypervisor's listeners. AF_NETLINK serves iproute2,
# getifaddrs() and libaudit; AF_PACKET would need CAP_NET_RAW anyway.
ALLOWED_SOCKET_FAMILIES: dict[str, int] = {
    "AF_UNIX": 1,
    "AF_INET": 2,
    "AF_INET6": 10,
    "AF_NETLINK": 16,
}


# Socket families whose socket() call is recorded when refused: every family the kernel knows
# (AF_MAX is 46 in 6.x) that is not allowed. Beyond it the kernel answers EAFNOSUPPORT.
NOTIFY_SOCKET_FAMILIES: tuple[int, ...] = tuple(
    f for f in range(1, 46) if f not in ALLOWED_SOCKET_FAMILIES.values()
)


def _deny_cubes() -> list[tuple[int, int]]:
    """Denied ioctl commands as (mask, value) pairs over the low 32 bits."""
    cubes = [(_TYPE_MASK, t << 8) for t in DENIED_IOCTL_TYPES.values()]
    cubes += [(_LOW32, cmd) for cmd in DENIED_IOCTLS.values()]
    return cubes


# Bits of the ioctl command in the order the cover decides them: the type byte first, so a
# denied family is a prefix; then the rest of the 32-bit word.
_BIT_ORDER: tuple[int, ...] = tuple(range(15, 7, -1)) + tuple(
    b for b in range(31, -1, -1) if not 8 <= b <= 15
)


def complement_cover(
    denied: list[tuple[int, int]], bit_order: tuple[int, ...] = _BIT_ORDER
) -> list[tuple[int, int]]:
    """(mask, value) pairs whose union is every 32-bit word outside the ``denied`` cubes.

    A cube (m, v) is the set {x : x & m == v}. Built as a binary trie over ``bit_order``:
    walking towards the denied words, each sibling subtree that holds none of them becomes
    one pair "these bits equal this prefix". The pairs are disjoint and their masks never
    include bits 32..63, which the kernel ignores for 32-bit arguments.
    """
    rules: list[tuple[int, int]] = []

    def fully_denied(mask: int, value: int) -> bool:
        # The subtree (mask, value) lies inside one denied cube.
        return any(cm & ~mask == 0 and value & cm == cv for cm, cv in denied)

    def touches_denied(mask: int, value: int) -> bool:
        return any((value & cm) == (cv & mask) for cm, cv in denied)

    def walk(depth: int, mask: int, value: int) -> None:
        if fully_denied(mask, value):
            return
        if not touches_denied(mask, value):
            rules.append((mask, value))
            return
        bit = 1 << bit_order[depth]
        walk(depth + 1, mask | bit, value)
        walk(depth + 1, mask | bit, value | bit)

    walk(0, 0, 0)
    return rules


@functools.cache
def ioctl_allow_rules() -> tuple[tuple[int, int], ...]:
    """(mask, value) pairs of ioctl commands (arg 1) the profile allows."""
    return tuple(complement_cover(_deny_cubes()))


def ioctl_allowed(cmd: int) -> bool:
    """Whether the profile lets ``ioctl(fd, cmd, ...)`` through (cmd as the register holds it)."""
    return any(cmd & m == v for m, v in ioctl_allow_rules())


_ARCHES: dict[str, dict[str, Any]] = {
    # 32-bit x86 (int 0x80) is left out: it doubles the filter for binaries agent tasks do
    # not need, and its compat paths have their own CVE history. x32 is off in Debian.
    "x86_64": {
        "architectures": ["SCMP_ARCH_X86_64"],
        "compat": ["SCMP_ARCH_X86"],
        "extra": ["arch_prctl"],
    },
    "aarch64": {
        "architectures": ["SCMP_ARCH_AARCH64"],
        "compat": ["SCMP_ARCH_ARM"],
        "extra": [
            "arm_fadvise64_64",
            "arm_sync_file_range",
            "sync_file_range2",
            "breakpoint",
            "cacheflush",
            "set_tls",
        ],
    },
}
_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}

ALLOWED: tuple[str, ...] = tuple(
    n for n in (*_DOCKER_ALLOWED, *_NEWER_ALLOWED) if n not in DENIED and n not in _CONDITIONAL
)

# Namespace flags refused in clone(): NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID
# | NEWNET (Docker's mask 0x7E020000). CLONE_NEWTIME cannot be passed to clone().
_CLONE_NS_MASK = 0x7E020000
# personality(): PER_LINUX, PER_LINUX32, UNAME26, UNAME26|PER_LINUX32, and the query value.
_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)


# mknod(2)/mknodat(2): regular files, fifos and sockets are fine; character and block
# devices are refused (no CAP_MKNOD in the host namespace anyway) and, with a listener,
# recorded. The mode is argument 1 of mknod and 2 of mknodat.
S_IFMT = 0o170000
_MKNOD_OK = (0, 0o100000, 0o010000, 0o140000)  # unspecified (= regular), S_IFREG, FIFO, SOCK
_MKNOD_DEVICES = (0o020000, 0o060000)  # S_IFCHR, S_IFBLK
MKNOD_MODE_ARG = {"mknod": 1, "mknodat": 2}
# socket(2) types for the allowed IP families: all but SOCK_RAW (3), which needs CAP_NET_RAW
# the guest does not have; raw sockets are refused here so that the attempt is recorded.
SOCK_TYPE_MASK = 0xF
SOCK_RAW = 3
_IP_SOCKET_TYPES = (1, 2, 4, 5, 6, 10)  # STREAM, DGRAM, RDM, SEQPACKET, DCCP, PACKET
IP_FAMILIES = {2: "AF_INET", 10: "AF_INET6"}


def _mknod_rules(action: str, kinds: tuple[int, ...]) -> list[dict[str, Any]]:
    return [
        _rule(
            [name],
            action,
            [{"index": i, "value": S_IFMT, "valueTwo": k, "op": "SCMP_CMP_MASKED_EQ"}],
        )
        for name, i in MKNOD_MODE_ARG.items()
        for k in kinds
    ]


def _socket_rule(action: str, fam: int, sock_type: int | None = None) -> dict[str, Any]:
    args = [{"index": 0, "value": _LOW32, "valueTwo": fam, "op": "SCMP_CMP_MASKED_EQ"}]
    if sock_type is not None:
        args.append(
            {
                "index": 1,
                "value": SOCK_TYPE_MASK,
                "valueTwo": sock_type,
                "op": "SCMP_CMP_MASKED_EQ",
            }
        )
    return _rule(["socket"], action, args)


def _rule(
    names: list[str],
    action: str,
    args: list[dict[str, Any]] | None = None,
    errno: int | None = None,
) -> dict[str, Any]:
    rule: dict[str, Any] = {"names": names, "action": action}
    if errno is not None:
        rule["errnoRet"] = errno
    if args:
        rule["args"] = args
    return rule


def _notify_rules() -> list[dict[str, Any]]:
    """SCMP_ACT_NOTIFY for the refused calls worth an event; disjoint from every allow rule."""
    rules = [_rule(sorted(n for n in DENIED if n not in QUIET), "SCMP_ACT_NOTIFY")]
    # clone with any namespace flag (the allow rule wants all of them clear).
    rules += [
        _rule(
            ["clone"],
            "SCMP_ACT_NOTIFY",
            [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        )
        for flag in (1 << b for b in range(32) if _CLONE_NS_MASK >> b & 1)
    ]
    rules += [_socket_rule("SCMP_ACT_NOTIFY", fam) for fam in NOTIFY_SOCKET_FAMILIES]
    rules += [_socket_rule("SCMP_ACT_NOTIFY", fam, SOCK_RAW) for fam in IP_FAMILIES]
    rules += _mknod_rules("SCMP_ACT_NOTIFY", _MKNOD_DEVICES)
    rules.append(
        _rule(
            ["seccomp"],
            "SCMP_ACT_NOTIFY",
            [
                {
                    "index": 1,
                    "value": _SECCOMP_FLAG_NEW_LISTENER,
                    "valueTwo": _SECCOMP_FLAG_NEW_LISTENER,
                    "op": "SCMP_CMP_MASKED_EQ",
                }
            ],
        )
    )
    # The denied ioctl cubes, exactly the complement of the allow cover (a command inside a
    # denied family needs no rule of its own).
    cubes = _deny_cubes()
    rules += [
        _rule(
            ["ioctl"],
            "SCMP_ACT_NOTIFY",
            [{"index": 1, "value": m, "valueTwo": v, "op": "SCMP_CMP_MASKED_EQ"}],
        )
        for m, v in cubes
        if not any((m2, v2) != (m, v) and m2 & ~m == 0 and v & m2 == v2 for m2, v2 in cubes)
    ]
    return rules


def _build(
    arch: str, compat32: bool, log_denials: bool, notify: str | None = None
) -> dict[str, Any]:
    key = _ARCH_ALIASES.get(arch, arch)
    if key not in _ARCHES:
        raise InvalidRequest(
            f"no seccomp profile for architecture {arch!r}; supported: {sorted(_ARCHES)}"
        )
    a = _ARCHES[key]
    syscalls: list[dict[str, Any]] = [
        _rule(sorted({*ALLOWED, *a["extra"]}), "SCMP_ACT_ALLOW"),
        # clone(2) flags are the first argument on x86_64 and aarch64 (s390 differs).
        _rule(
            ["clone"],
            "SCMP_ACT_ALLOW",
            [{"index": 0, "value": _CLONE_NS_MASK, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
        ),
        # clone3 passes its flags in memory, which seccomp cannot read: pretend it does not
        # exist, and glibc retries with clone (where the flags are checked).
        _rule(["clone3"], "SCMP_ACT_ERRNO", errno=ENOSYS),
        _rule(
            ["seccomp"],
            "SCMP_ACT_ALLOW",
            [
                {
                    "index": 1,
                    "value": _SECCOMP_FLAG_NEW_LISTENER,
                    "valueTwo": 0,
                    "op": "SCMP_CMP_MASKED_EQ",
                }
            ],
        ),
    ]
    # An EQ test on personality fails closed: upper bits set by the guest only mismatch.
    syscalls += [
        _rule(
            ["personality"],
            "SCMP_ACT_ALLOW",
            [{"index": 0, "value": p, "valueTwo": 0, "op": "SCMP_CMP_EQ"}],
        )
        for p in _PERSONALITIES
    ]
    # socket() family is an int: compare only the low 32 bits, or a guest passing
    # 0xffffffff00000028 would slip AF_VSOCK past a 64-bit "!= 40" test (as in Docker's).
    # For MASKED_EQ, OCI "value" is the mask and "valueTwo" the datum (runc/libseccomp).
    syscalls += [
        _socket_rule("SCMP_ACT_ALLOW", fam)
        for fam in ALLOWED_SOCKET_FAMILIES.values()
        if fam not in IP_FAMILIES
    ]
    syscalls += [
        _socket_rule("SCMP_ACT_ALLOW", fam, t) for fam in IP_FAMILIES for t in _IP_SOCKET_TYPES
    ]
    syscalls += _mknod_rules("SCMP_ACT_ALLOW", _MKNOD_OK)
    syscalls += [
        _rule(
            ["ioctl"],
            "SCMP_ACT_ALLOW",
            [{"index": 1, "value": m, "valueTwo": v, "op": "SCMP_CMP_MASKED_EQ"}],
        )
        for m, v in ioctl_allow_rules()
    ]
    if notify:
        syscalls += _notify_rules()
    profile: dict[str, Any] = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        "architectures": list(a["architectures"]) + (list(a["compat"]) if compat32 else []),
        "syscalls": syscalls,
    }
    if log_denials:
        profile["flags"] = ["SECCOMP_FILTER_FLAG_LOG"]
    if notify:
        profile["listenerPath"] = notify
    return profile


@functools.cache
def _cached(arch: str, compat32: bool, log_denials: bool, notify: str | None) -> dict[str, Any]:
    return _build(arch, compat32, log_denials, notify)


def default_profile(
    arch: str = "x86_64",
    *,
    compat32: bool = False,
    log_denials: bool = False,
    notify: str | None = None,
) -> dict[str, Any]:
    """The OCI ``linux.seccomp`` object for a guest on ``arch`` (x86_64 or aarch64).

    ``compat32`` also admits the 32-bit ABI (i386 on x86_64, arm on aarch64).
    ``log_denials`` sets ``SECCOMP_FILTER_FLAG_LOG`` (kernel audit log of every refused
    call); runc 1.1 refuses profiles with flags, so leave it off there.
    ``notify`` is the path of a seccomp notification listener (``listenerPath``): the
    refused calls worth an event are sent there (see the module docstring).
    Returns a fresh copy the caller may modify.
    """
    return copy.deepcopy(_cached(arch, compat32, log_denials, notify))


def shared_profile(
    arch: str = "x86_64",
    *,
    compat32: bool = False,
    log_denials: bool = False,
    notify: str | None = None,
) -> dict[str, Any]:
    """The cached profile itself, not a copy (saves ~4 ms per sandbox create): read-only."""
    return _cached(arch, compat32, log_denials, notify)


@functools.cache
def profile_json(arch: str = "x86_64", *, compat32: bool = False, log_denials: bool = False) -> str:
    """:func:`default_profile` as compact JSON (cached: it is the same for every sandbox)."""
    return json.dumps(_cached(arch, compat32, log_denials, None), separators=(",", ":"))
