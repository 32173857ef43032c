"""Start the OCI runtime cheaply: a tiny static exec helper and vfork-style spawning.

Every sandbox create starts one runtime process. Done with ``subprocess`` and a
``preexec_fn`` (to move the control socket to fd 3 and, on hybrid-cgroup hosts, to detach
the cgroup2 mount), CPython must ``fork()`` the whole agent: copying its page tables, then
copy-on-write faults in both processes and tearing the copy down again at exec cost
~4-5 ms of the agent's CPU per create here (measured: 8-12 ms before, 4-6 ms after).
Instead the agent ``posix_spawn``s (glibc: ``clone(CLONE_VM|CLONE_VFORK)``, no page-table
copy) ``corral-spawn``, a small static C program that does the same few system calls and
execs the runtime. The agent waits for it through a pidfd on its event loop, so no
child-watcher thread is started per process either.

Example::

    helper = ensure_built(Path("/var/lib/corral/bin"))
    rc = await spawn_helper(helper, ["/usr/bin/crun", "--version"], legacy_view=True,
                            ctl_fd=sock.fileno())
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from pathlib import Path

from corral.errors import HostError
from corral.host._aio import reap
from corral.host.cbuild import build_static

__all__ = ["SOURCE", "ensure_built", "helper_argv", "sealed_copy", "spawn_helper"]

SOURCE = r"""
/* corral-spawn: set up the runtime's process, then exec it (see corral/host/spawn.py).
 *   corral-spawn [-l] [-f FD] [-x FD] [-L LOG] [-U SPEC] [-R SPEC]... -- PROG [ARG...]
 * -l      private mount namespace in which /sys/fs/cgroup/unified is an empty private
 *         tmpfs instead of the hybrid cgroup2 mount (crun on hybrid hosts)
 * -f FD   FD becomes fd 3 (the sandbox control socket; the runtime gets --preserve-fds 1)
 * -x FD   execute the program in FD (a sealed memfd copy of the runtime) instead of PROG
 * -L LOG  append errors of this helper to LOG as a JSON line (the runtime's --log file)
 * -U OWNER:HOSTID:COUNT:FILE
 *         first create the sandbox's user namespace, owned by host uid/gid OWNER and
 *         mapping ids 0..COUNT-1 to HOSTID.., and bind-mount it onto FILE (an existing
 *         empty file) for the runtime to join (see corral/host/userns.py); FILE "@":
 *         hold it as fd 4 instead (needs -f), which the runtime opens as /proc/self/fd/4
 * -R RES:SOFT:HARD
 *         setrlimit(RES) before the exec (repeatable): for runc, which otherwise sets the
 *         container's limits with prlimit from outside its user namespace, and that needs
 *         CAP_SYS_RESOURCE over a namespace root no longer owns
 * Every fd above 2 (above 3 with -f) is closed before the exec. Exit 127 on failure. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *log_path;
static int userns_fd = -1; /* -U ...:@ : the namespace, moved to fd 4 before the exec */

static void __attribute__((noreturn)) die(const char *what)
{
	int e = errno;
	FILE *f = log_path ? fopen(log_path, "ae") : NULL;
	if (f) {
		fprintf(f, "{\"level\":\"error\",\"msg\":\"corral-spawn: %s: %s\"}\n", what,
			strerror(e));
		fclose(f);
	} else {
		fprintf(stderr, "corral-spawn: %s: %s\n", what, strerror(e));
	}
	_exit(127);
}

static int write_file(const char *path, const char *text)
{
	int f = open(path, O_WRONLY | O_CLOEXEC);
	if (f < 0)
		return -1;
	ssize_t n = write(f, text, strlen(text));
	int e = errno;
	close(f);
	errno = e;
	return n == (ssize_t)strlen(text) ? 0 : -1;
}

/* The sandbox's user namespace, owned by the unprivileged host uid/gid OWNER: the kernel
 * charges every per-user count of the guest (inotify instances and watches, pending
 * signals, POSIX mqueue bytes, processes) also to the namespace's owner in the parent
 * namespace, so with a private OWNER per sandbox one guest exhausts only its own budget,
 * never host root's or a neighbour's. The limits of that budget are the creator's rlimits
 * at creation (RLIMIT_SIGPENDING, _MSGQUEUE, _MEMLOCK: the node's); RLIMIT_NPROC, which
 * the kernel enforces for a non-root creator only, is lifted where the node may (it needs
 * CAP_SYS_RESOURCE): the sandbox's pids cgroup is its process limit.
 *
 * Cheap on purpose (every create does it): with only the effective ids switched to OWNER
 * (real and saved stay root, so root comes back), clone(CLONE_NEWUSER) makes a child in a
 * new namespace owned by OWNER. The child never has to run: its namespace exists when
 * clone returns, so the maps are written and the namespace bound at once, and the child,
 * blocked on a pipe from its first instruction, is then killed and reaped. */
static void make_userns(const char *spec)
{
	unsigned owner, hostid, count;
	int off = 0;
	if (sscanf(spec, "%u:%u:%u:%n", &owner, &hostid, &count, &off) != 3 || !off ||
	    !owner || !spec[off]) {
		errno = EINVAL;
		die("bad -U argument");
	}
	const char *file = spec + off;
	int hold[2];
	if (pipe2(hold, O_CLOEXEC) < 0)
		die("pipe");
	struct rlimit nproc, inf = {RLIM_INFINITY, RLIM_INFINITY};
	getrlimit(RLIMIT_NPROC, &nproc);
	(void)setrlimit(RLIMIT_NPROC, &inf);
	if (setresgid(-1, owner, -1) < 0 || setresuid(-1, owner, -1) < 0)
		die("switch to the namespace owner");
	long pid = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
	int err = errno;
	if (pid == 0) {
		char c;
		(void)!read(hold[0], &c, 1); /* EOF when the helper is done (or dies) */
		syscall(SYS_exit, 0);
	}
	if (setresuid(-1, 0, -1) < 0 || setresgid(-1, 0, -1) < 0)
		die("switch back to root");
	(void)setrlimit(RLIMIT_NPROC, &nproc);
	if (pid < 0) {
		errno = err;
		die("clone(CLONE_NEWUSER) as the namespace owner");
	}
	char path[64], map[64];
	snprintf(map, sizeof map, "0 %u %u\n", hostid, count);
	const char *step = "write uid_map";
	snprintf(path, sizeof path, "/proc/%ld/uid_map", pid);
	int bad = write_file(path, map);
	if (!bad) {
		step = "write gid_map";
		snprintf(path, sizeof path, "/proc/%ld/gid_map", pid);
		bad = write_file(path, map);
	}
	if (!bad) {
		/* The runtime joins the namespace through this fd or file; the node unmounts
		 * the file as soon as the runtime is done (the sandbox's processes keep the
		 * namespace alive). */
		snprintf(path, sizeof path, "/proc/%ld/ns/user", pid);
		if (strcmp(file, "@") == 0) {
			step = "open the user namespace";
			int f = open(path, O_RDONLY | O_CLOEXEC);
			bad = f < 0 || (userns_fd = fcntl(f, F_DUPFD_CLOEXEC, 10)) < 0;
			if (f >= 0)
				close(f);
		} else {
			step = "bind-mount the user namespace";
			bad = mount(path, file, NULL, MS_BIND, NULL);
		}
	}
	err = errno;
	kill(pid, SIGKILL);
	close(hold[1]);
	close(hold[0]);
	waitpid(pid, NULL, 0);
	if (bad) {
		errno = err;
		die(step);
	}
}

int main(int argc, char **argv)
{
	int legacy = 0, fd = -1, exe = -1, i = 1;
	const char *userns = NULL;
	for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
		if (!strcmp(argv[i], "-l"))
			legacy = 1;
		else if (!strcmp(argv[i], "-f") && i + 1 < argc)
			fd = atoi(argv[++i]);
		else if (!strcmp(argv[i], "-x") && i + 1 < argc)
			exe = atoi(argv[++i]);
		else if (!strcmp(argv[i], "-L") && i + 1 < argc)
			log_path = argv[++i];
		else if (!strcmp(argv[i], "-U") && i + 1 < argc)
			userns = argv[++i];
		else if (!strcmp(argv[i], "-R") && i + 1 < argc) {
			unsigned res;
			unsigned long long soft, hard;
			struct rlimit rl;
			if (sscanf(argv[++i], "%u:%llu:%llu", &res, &soft, &hard) != 3) {
				errno = EINVAL;
				die("bad -R argument");
			}
			rl.rlim_cur = soft;
			rl.rlim_max = hard;
			if (setrlimit(res, &rl) < 0)
				die("setrlimit");
		}
		else {
			errno = EINVAL;
			die("bad arguments");
		}
	}
	if (i + 1 >= argc) {
		errno = EINVAL;
		die("no program");
	}
	/* Before the private mount namespace below, so that the host sees (and the node can
	 * remove) the bind mount of the namespace too. */
	if (userns)
		make_userns(userns);
	if (legacy) {
		/* Affects only this process's new, private copy of the mount table. */
		if (unshare(CLONE_NEWNS) < 0)
			die("unshare(CLONE_NEWNS)");
		if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
			die("make / private");
		if (umount2("/sys/fs/cgroup/unified", MNT_DETACH) < 0)
			die("detach /sys/fs/cgroup/unified");
		/* crun still creates a directory per container below the (now plain) unified
		 * path and never removes it; without this throwaway tmpfs those would pile up
		 * in the host's /sys/fs/cgroup tmpfs, hidden under the real cgroup2 mount. */
		if (mount("tmpfs", "/sys/fs/cgroup/unified", "tmpfs",
			  MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k") < 0)
			die("tmpfs on /sys/fs/cgroup/unified");
	}
	if (exe >= 0) {
		/* Out of the way of fd 3 and of close_range below; CLOEXEC: the runtime does
		 * not inherit it. */
		int e = fcntl(exe, F_DUPFD_CLOEXEC, 10);
		if (e < 0)
			die("dup executable fd");
		exe = e;
	}
	if (fd >= 0) {
		if (fd != 3) {
			if (dup2(fd, 3) < 0)
				die("dup2 control fd");
		} else if (fcntl(3, F_SETFD, 0) < 0) {
			die("clear FD_CLOEXEC of fd 3");
		}
	}
	/* Only stdio (and the control socket) may reach the runtime, and through it PID 1
	 * (the runtime marks everything above its --preserve-fds CLOEXEC for the container). */
	int first = fd >= 0 ? 4 : 3;
	if (userns_fd >= 0) {
		if (fd < 0 || dup2(userns_fd, 4) < 0) {
			errno = fd < 0 ? EINVAL : errno;
			die("user namespace fd 4 (needs -f)");
		}
		first = 5;
	}
	if (exe >= 0) {
		if (syscall(SYS_close_range, first, exe - 1, 0) < 0 ||
		    syscall(SYS_close_range, exe + 1, ~0U, 0) < 0)
			die("close_range");
		fexecve(exe, argv + i + 1, environ);
	} else {
		if (syscall(SYS_close_range, first, ~0U, 0) < 0)
			die("close_range");
		execv(argv[i + 1], argv + i + 1);
	}
	die("exec");
}
"""

CFLAGS = ("-static", "-O2", "-Wall", "-s")


def ensure_built(out_dir: Path) -> Path:
    """Compile corral-spawn into ``out_dir`` unless this source version is already there
    (see :func:`corral.host.cbuild.build_static`). Raises HostError with the compiler
    output when compiling fails."""
    return build_static("corral-spawn", SOURCE.encode(), CFLAGS, out_dir)


_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def sealed_copy(binary: str) -> int:
    """A sealed memfd holding a copy of ``binary`` (CLOEXEC; the caller closes it).

    runc and crun protect themselves against CVE-2019-5736 (a container overwriting the
    host binary through /proc/self/exe): unless /proc/self/exe is already a fully sealed
    memfd they copy or bind-mount themselves read-only and re-exec, which for crun doubles
    the start-up (a second exec and dynamic link, ~1/4 of its CPU per container). Running
    them from one sealed copy, made once per node, skips that; the seals (no write, no
    resize, no unsealing) give the same protection the runtime's own copy would.
    """
    fd = os.memfd_create(os.path.basename(binary), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(binary, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            off = 0
            while off < size:
                n = os.sendfile(fd, f.fileno(), off, size - off)
                if n == 0:
                    raise HostError(f"copying {binary} into a memfd: short read at {off}")
                off += n
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def helper_argv(
    helper: Path,
    argv: list[str],
    *,
    legacy_view: bool = False,
    ctl_fd: int | None = None,
    exe_fd: int | None = None,
    log: Path | None = None,
    userns: str | None = None,
    rlimits: Sequence[tuple[int, int, int]] = (),
) -> list[str]:
    """The command line that runs ``argv`` through the helper (fds must be inheritable).

    ``userns`` is the helper's ``-U`` argument (see
    :meth:`corral.host.userns.SandboxUserns.helper_arg`)."""
    out = [str(helper)]
    if userns is not None:
        out += ["-U", userns]
    for res, soft, hard in rlimits:
        out += ["-R", f"{res}:{soft}:{hard}"]
    if legacy_view:
        out.append("-l")
    if ctl_fd is not None:
        out += ["-f", str(ctl_fd)]
    if exe_fd is not None:
        out += ["-x", str(exe_fd)]
    if log is not None:
        out += ["-L", str(log)]
    return [*out, "--", *argv]


async def spawn_helper(
    helper: Path,
    argv: list[str],
    *,
    legacy_view: bool = False,
    ctl_fd: int | None = None,
    exe_fd: int | None = None,
    log: Path | None = None,
    userns: str | None = None,
    rlimits: Sequence[tuple[int, int, int]] = (),
) -> int:
    """Run ``argv`` through the helper with stdio on /dev/null; return its exit status
    (negative: killed by that signal; 127: the helper failed, its error is in ``log``).

    ``ctl_fd`` arrives as fd 3 in ``argv``'s process; the helper closes every other fd
    above 2, so fds the agent holds without CLOEXEC never reach the runtime. ``exe_fd``
    (see :func:`sealed_copy`) is executed instead of ``argv[0]``. ``userns``: create the
    sandbox's user namespace first (the helper's ``-U``). If the caller is cancelled, the
    child is still reaped when it exits.
    ``rlimits``: (resource, soft, hard) set before the exec (the helper's ``-R``).
    """
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
    ]
    # Inheritable duplicates only for this spawn: the caller's fds stay CLOEXEC, so
    # processes started meanwhile elsewhere in the agent do not inherit them.
    dups: list[int] = []
    try:
        ctl = exe = None
        if ctl_fd is not None:
            ctl = fcntl.fcntl(ctl_fd, fcntl.F_DUPFD, 0)  # F_DUPFD: without FD_CLOEXEC
            dups.append(ctl)
        if exe_fd is not None:
            exe = fcntl.fcntl(exe_fd, fcntl.F_DUPFD, 0)
            dups.append(exe)
        full = helper_argv(
            helper,
            argv,
            legacy_view=legacy_view,
            ctl_fd=ctl,
            exe_fd=exe,
            log=log,
            userns=userns,
            rlimits=rlimits,
        )
        pid = os.posix_spawn(full[0], full, os.environ, file_actions=actions)
    finally:
        for d in dups:
            os.close(d)
    # 0 if someone else's waitpid(-1) reaped it first: its status is unknown
    return await reap(pid, unknown=0)
