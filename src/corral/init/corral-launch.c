/* corral-launch: start one container sandbox without an OCI runtime (corral/host/launch.py).
 *
 * The node translates the sandbox's OCI config (corral/backends/oci.py: the one place that
 * says what a sandbox is) into the flat list of steps below; this program only executes
 * them, in order, and reports. It exists because a full OCI runtime run costs ~30 ms of CPU
 * per sandbox, most of it parsing, validating and generalising what corral always asks
 * for the same way.
 *
 *   corral-launch [OPTION]... -- STEP...
 * Options (the launcher process, on the host side, before the sandbox exists):
 *   -n PATH        join this network namespace (the node's prepared one) before the clone
 *   -c FILE        write our pid to this cgroup.procs (repeatable): the sandbox starts in
 *                  its cgroups (memory, pids, ...: everything it makes is charged there)
 *   -k FILE        move the sandbox's process to this cgroup.procs at the step cgns
 *                  (repeatable): the cpu cgroups, so that the launcher's own work is not
 *                  done in a best-effort sandbox's idle CPU class
 *   -r RES:SOFT:HARD  setrlimit before the clone (inherited by the sandbox)
 *   -u OWNER       create the user namespace as host uid/gid OWNER (owners.py); 0: as root
 *   -m HOSTID:COUNT  uid and gid map 0..COUNT-1 -> HOSTID..
 *   -N             a new network namespace (only loopback)
 *   -h NAME        hostname          -o ADJ  oom_score_adj
 *   -P POLICY      the init's scheduling policy (SCHED_* number), set just before its exec:
 *                  the setup runs at the launcher's, the sandbox's first process already
 *                  has its class's (corral/policy/qos.py; with -r for RLIMIT_NICE)
 *   -C BND:EFF:PRM:INH:AMB  capability sets (hex masks)
 *   -s FLAGS       load the BPF seccomp program read from fd 5 with these filter flags
 *   -l PATH:ID     with a listener: send its fd to the node's listener socket PATH, for ID
 *   -e ENV         environment entry of the init (repeatable)
 *   -x PATH        the program to exec inside (the init), as PID 1, with fd 3 kept
 *   -t             the mount namespace to start from is the template on fd 7 (made once
 *                  per node by -T), not the node's: the clone copies its 3 mounts, not the
 *                  host's whole table. Bind sources (host paths) are cloned as detached
 *                  mounts (open_tree) before, while still in the node's namespace.
 *   -F STEP        test hook: exit abruptly (SIGKILL self) before the step with this name
 *
 *   corral-launch -T DIR
 * makes the template mount namespace (a read-only tmpfs with fully visible proc and sysfs
 * mounts, which mounting a new proc or sysfs in a user namespace requires; the proc lists
 * pid directories only, each to its own uid: hidepid=invisible,subset=pid; and an empty
 * `rootfs` directory; the sysfs is of a loopback-only network namespace of its own, lo
 * up, and no-network sandboxes bind it: step tbind), pivoted into with DIR as a scratch
 * mountpoint; says "READY" on fd 1 and waits for EOF on fd 0, while the node opens
 * /proc/<pid>/ns/mnt and /proc/<pid>/ns/net.
 * Steps (inside the new namespaces, paths relative to the rootfs, resolved in it):
 *   root:PATH               the rootfs (host path); first step. PATH `-`: the detached
 *                           mount on fd 6 (the node's fsmount of the overlay), moved onto
 *                           the template's /rootfs (needs -t): it never is in the host's
 *                           mount table
 *   fs:TYPE:SRC:DST:FLAGS:DATA   mount a new filesystem (FLAGS: hex MS_*)
 *   bind:SRC:DST:FLAGS:REC  bind SRC (host path) onto DST, then remount with FLAGS
 *   tbind:SRC:DST:FLAGS     bind SRC, a mount of the template (-t; its /sys), onto DST,
 *                           then remount with FLAGS
 *   rro:DST                 make DST and everything below read-only (mount_setattr)
 *   ln:TARGET:DST           symlink
 *   dir:DST:MODE            a directory (octal MODE) on what is mounted there already
 *   mask:DST                hide DST (a directory: empty read-only tmpfs; else /dev/null)
 *   ro:DST                  bind DST onto itself read-only
 *   remount:DST:FLAGS       remount DST (a mount made before) with FLAGS
 *   cgns                    join the -k cgroups, then a new cgroup namespace (rooted at
 *                           the sandbox's cgroups in every hierarchy); before cgroup mounts
 *   enter                   (-t) move the rootfs mount over the template's root and chroot
 *                           into it: no pivot_root, whose walk of every task on the host
 *                           grew each create with the live count. Nothing the guest could
 *                           not see lies beneath (a read-only tmpfs of empty directories,
 *                           the sysfs no-network sandboxes bind, a pid-only proc showing a
 *                           uid its own processes), and no path leads there: `..` from the
 *                           root's mount reaches the template's root, which the rootfs is
 *                           stacked on, so the walk comes back up
 *   pivot                   pivot_root into the rootfs (a host-path rootfs: the namespace
 *                           is a copy of the host's, detached after the pivot)
 *   roroot                  the root read-only (after enter or pivot)
 * Fields are separated by a tab, not ':' (shown above for reading).
 *
 * Reports on fd 4: "PID <host pid of the init>\n", or "ERR <step>: <error> (errno N)\n".
 * Exit 0 on success. fds: 0-2 /dev/null, 3 the control socket (the init's fd 3), 4 the
 * report pipe, 5 the BPF program; nothing else crosses into the sandbox. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/if.h>
#include <linux/mount.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXV 64
#define REPORT_FD 4
#define BPF_FD 5
#define ROOT_FD 6
#define TEMPLATE_FD 7
#define TEMPLATE_ROOT "/rootfs"

static const char *step = "start";
static const char *fault; /* -F */
static int err_fd = REPORT_FD; /* the child reports through its own pipe */

static void say(int fd, const char *fmt, const char *a, int e)
{
	char buf[512];
	int n = snprintf(buf, sizeof buf, fmt, step, a, e ? strerror(e) : "", e);
	if (n > 0)
		(void)!write(fd, buf, n < (int)sizeof buf ? n : (int)sizeof buf - 1);
}

static void __attribute__((noreturn)) die(const char *what)
{
	int e = errno;
	say(err_fd, "ERR %s: %s: %s (errno %d)\n", what, e);
	_exit(1);
}

static void at(const char *name)
{
	step = name;
	if (fault && strcmp(fault, name) == 0) {
		/* A crash: no report, no cleanup. The sandbox's init (pid 1 of its namespace)
		 * cannot SIGKILL itself, so it just exits. */
		if (getpid() == 1)
			_exit(137);
		kill(getpid(), SIGKILL);
	}
}

/* Split s at tabs into at most MAXV fields (in place). */
static int split(char *s, char **f, int max)
{
	int n = 0;
	f[n++] = s;
	for (char *p = s; *p && n < max; p++)
		if (*p == '\t') {
			*p = 0;
			f[n++] = p + 1;
		}
	return n;
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

/* ------------------------------------------------------------------ paths in the rootfs */

static int root_fd = -1;
static int sync_sock = -1; /* the child's end of the socketpair with the launcher */
/* With -t: per step, a detached clone of its bind source made in the node's mount
 * namespace, and whether that source is a directory. */
static int *src_fd;
static char *src_dir;
static int cur_step;

/* Open DST inside the rootfs: symlinks resolve as if the rootfs were /, so an image can
 * never point a mount at a host path. Missing components are created (directories; the
 * last one a file when `file`). Returns an O_PATH fd, or -1 (errno ENOENT: missing and
 * `create` 0). */
static int open_in_root(const char *dst, int create, int file)
{
	struct open_how how = {
		.flags = O_PATH | O_CLOEXEC,
		.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
	};
	while (*dst == '/')
		dst++;
	if (!*dst)
		return (int)syscall(SYS_openat2, root_fd, ".", &how, sizeof how);
	int fd = (int)syscall(SYS_openat2, root_fd, dst, &how, sizeof how);
	if (fd >= 0 || errno != ENOENT || !create)
		return fd;
	char path[4096];
	if (strlen(dst) >= sizeof path) {
		errno = ENAMETOOLONG;
		return -1;
	}
	strcpy(path, dst);
	/* Create each missing component below the deepest existing one. */
	for (char *p = path;; p++) {
		if (*p != '/' && *p)
			continue;
		int last = !*p;
		char save = *p;
		*p = 0;
		int e = (int)syscall(SYS_openat2, root_fd, path, &how, sizeof how);
		if (e < 0 && errno == ENOENT) {
			char *slash = strrchr(path, '/');
			const char *name = slash ? slash + 1 : path;
			int parent;
			if (slash) {
				*slash = 0;
				parent = (int)syscall(SYS_openat2, root_fd, path, &how, sizeof how);
				*slash = '/';
			} else {
				parent = (int)syscall(SYS_openat2, root_fd, ".", &how, sizeof how);
			}
			if (parent < 0)
				return -1;
			int r;
			if (last && file) {
				/* O_PATH parents cannot create files: reopen the parent as a directory. */
				char pp[64];
				snprintf(pp, sizeof pp, "/proc/self/fd/%d", parent);
				int dfd = open(pp, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
				r = dfd < 0 ? -1 : openat(dfd, name, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | O_NOFOLLOW, 0644);
				if (r >= 0)
					close(r);
				if (dfd >= 0)
					close(dfd);
			} else {
				r = mkdirat(parent, name, 0755);
			}
			close(parent);
			if (r < 0 && errno != EEXIST)
				return -1;
		} else if (e >= 0) {
			close(e);
		} else {
			return -1;
		}
		*p = save;
		if (last)
			break;
	}
	return (int)syscall(SYS_openat2, root_fd, dst, &how, sizeof how);
}

static void fdpath(char *buf, size_t n, int fd)
{
	snprintf(buf, n, "/proc/self/fd/%d", fd);
}

/* The MS_* flags a bind remount must repeat (a mount's locked flags cannot be dropped). */
static unsigned long kept_flags(const char *path)
{
	struct statvfs s;
	unsigned long f = 0;
	if (statvfs(path, &s) < 0)
		return 0;
	if (s.f_flag & ST_NOSUID)
		f |= MS_NOSUID;
	if (s.f_flag & ST_NODEV)
		f |= MS_NODEV;
	if (s.f_flag & ST_NOEXEC)
		f |= MS_NOEXEC;
	if (s.f_flag & ST_NOATIME)
		f |= MS_NOATIME;
	if (s.f_flag & ST_NODIRATIME)
		f |= MS_NODIRATIME;
	if (s.f_flag & ST_RELATIME)
		f |= MS_RELATIME;
	if (s.f_flag & ST_RDONLY)
		f |= MS_RDONLY;
	return f;
}

static void remount_bind(const char *p, unsigned long flags)
{
	if (mount(NULL, p, NULL, MS_BIND | MS_REMOUNT | flags | kept_flags(p), NULL) < 0)
		die("remount");
}

/* After enter or pivot: the rootfs is /; paths resolve from it, no longer through root_fd. */
static void rooted(void)
{
	if (chdir("/") < 0)
		die("chdir /");
	close(root_fd);
	root_fd = -1;
}

static void do_step(char *s)
{
	char *f[MAXV], p[64];
	int n = split(s, f, MAXV);
	at(f[0]);
	if (!strcmp(f[0], "root") && n == 2 && !strcmp(f[1], "-")) {
		/* The node's detached overlay, attached only in this (template-copied) namespace. */
		if (!src_fd) {
			errno = EINVAL;
			die("root - needs -t");
		}
		if (syscall(SYS_move_mount, ROOT_FD, "", AT_FDCWD, TEMPLATE_ROOT,
			    MOVE_MOUNT_F_EMPTY_PATH) < 0)
			die("move the rootfs mount");
		close(ROOT_FD);
		root_fd = open(TEMPLATE_ROOT, O_PATH | O_DIRECTORY | O_CLOEXEC);
		if (root_fd < 0 || chdir(TEMPLATE_ROOT) < 0)
			die(TEMPLATE_ROOT);
	} else if (!strcmp(f[0], "root") && n == 2) {
		/* The rootfs becomes a mount of its own in our private mount table. */
		if (mount(f[1], f[1], NULL, MS_BIND | MS_REC, NULL) < 0)
			die(f[1]);
		root_fd = open(f[1], O_PATH | O_DIRECTORY | O_CLOEXEC);
		if (root_fd < 0)
			die(f[1]);
		if (chdir(f[1]) < 0)
			die(f[1]);
	} else if (!strcmp(f[0], "fs") && n == 6) {
		int fd = open_in_root(f[3], 1, 0);
		if (fd < 0)
			die(f[3]);
		fdpath(p, sizeof p, fd);
		if (mount(f[2], p, f[1], strtoul(f[4], NULL, 16), *f[5] ? f[5] : NULL) < 0)
			die(f[3]);
		close(fd);
	} else if (!strcmp(f[0], "bind") && n == 5) {
		int sfd = src_fd ? src_fd[cur_step] : -1, isdir;
		if (sfd >= 0) {
			isdir = src_dir[cur_step];
		} else {
			struct stat st;
			if (stat(f[1], &st) < 0)
				die(f[1]);
			isdir = S_ISDIR(st.st_mode);
		}
		int fd = open_in_root(f[2], 1, !isdir);
		if (fd < 0)
			die(f[2]);
		fdpath(p, sizeof p, fd);
		if (sfd >= 0) {
			/* The clone made in the node's namespace (see prepare_sources). */
			if (syscall(SYS_move_mount, sfd, "", fd, "",
				    MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) < 0)
				die(f[2]);
			close(sfd);
			src_fd[cur_step] = -1;
		} else if (mount(f[1], p, NULL, MS_BIND | (atoi(f[4]) ? MS_REC : 0), NULL) < 0) {
			die(f[2]);
		}
		close(fd);
		unsigned long fl = strtoul(f[3], NULL, 16);
		if (fl) {
			/* Reopen: the fd still names the directory under the new mount. */
			fd = open_in_root(f[2], 0, 0);
			if (fd < 0)
				die(f[2]);
			fdpath(p, sizeof p, fd);
			remount_bind(p, fl);
			close(fd);
		}
	} else if (!strcmp(f[0], "tbind") && n == 4) {
		/* A mount of the template (-t), still reachable here at its absolute path (the
		 * root is the template's until pivot): its sysfs, made in a loopback-only network
		 * namespace of its own, one superblock for every no-network sandbox of the node
		 * instead of one each (each walked by every later sysfs mount: sget). */
		if (!src_fd || f[1][0] != '/') {
			errno = EINVAL;
			die("tbind needs -t and an absolute template path");
		}
		int fd = open_in_root(f[2], 0, 0);
		if (fd < 0)
			die(f[2]);
		fdpath(p, sizeof p, fd);
		/* Safe: a path of the template namespace (its 3 mounts), no host path. */
		if (mount(f[1], p, NULL, MS_BIND, NULL) < 0)
			die(f[2]);
		close(fd);
		fd = open_in_root(f[2], 0, 0);
		if (fd < 0)
			die(f[2]);
		fdpath(p, sizeof p, fd);
		remount_bind(p, strtoul(f[3], NULL, 16));
		close(fd);
	} else if (!strcmp(f[0], "dir") && n == 3) {
		/* A directory on a filesystem mounted before (/dev/shm on the /dev tmpfs). */
		int fd = open_in_root(f[1], 1, 0);
		struct stat st;
		if (fd < 0 || fstat(fd, &st) < 0)
			die(f[1]);
		if (!S_ISDIR(st.st_mode)) {
			errno = ENOTDIR;
			die(f[1]);
		}
		fdpath(p, sizeof p, fd);
		if (chmod(p, strtoul(f[2], NULL, 8)) < 0)
			die(f[1]);
		close(fd);
	} else if (!strcmp(f[0], "rro") && n == 2) {
		int fd = open_in_root(f[1], 0, 0);
		struct mount_attr attr = {.attr_set = MOUNT_ATTR_RDONLY};
		if (fd < 0 || syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr,
				      sizeof attr) < 0)
			die(f[1]);
		close(fd);
	} else if (!strcmp(f[0], "ln") && n == 3) {
		char *slash = strrchr(f[2], '/');
		if (!slash)
			die(f[2]);
		*slash = 0;
		int dir = open_in_root(f[2], 1, 0);
		*slash = '/';
		if (dir < 0 || symlinkat(f[1], dir, slash + 1) < 0)
			die(f[2]);
		close(dir);
	} else if (!strcmp(f[0], "mask") && n == 2) {
		int fd = open_in_root(f[1], 0, 0);
		if (fd < 0) {
			if (errno == ENOENT)
				return; /* not on this kernel */
			die(f[1]);
		}
		struct stat st;
		fdpath(p, sizeof p, fd);
		if (fstat(fd, &st) < 0)
			die(f[1]);
		if (S_ISDIR(st.st_mode)) {
			if (mount("tmpfs", p, "tmpfs", MS_RDONLY, "size=0k") < 0)
				die(f[1]);
		} else {
			if (src_fd) {
				/* No host path here (-t): the sandbox's own /dev/null, the bind of
				 * the host's made by an earlier step (checked: the null device). */
				char q[64];
				struct stat ns;
				int nfd = open_in_root("/dev/null", 0, 0);
				if (nfd < 0 || fstat(nfd, &ns) < 0 || !S_ISCHR(ns.st_mode) ||
				    ns.st_rdev != makedev(1, 3)) {
					errno = ENODEV;
					die("/dev/null (a mask's source)");
				}
				fdpath(q, sizeof q, nfd);
				if (mount(q, p, NULL, MS_BIND, NULL) < 0)
					die(f[1]);
				close(nfd);
			} else if (mount("/dev/null", p, NULL, MS_BIND, NULL) < 0) {
				die(f[1]);
			}
			close(fd);
			fd = open_in_root(f[1], 0, 0);
			if (fd < 0)
				die(f[1]);
			fdpath(p, sizeof p, fd);
			remount_bind(p, MS_RDONLY);
		}
		close(fd);
	} else if (!strcmp(f[0], "ro") && n == 2) {
		int fd = open_in_root(f[1], 0, 0);
		if (fd < 0) {
			if (errno == ENOENT)
				return;
			die(f[1]);
		}
		fdpath(p, sizeof p, fd);
		if (mount(p, p, NULL, MS_BIND | MS_REC, NULL) < 0)
			die(f[1]);
		close(fd);
		fd = open_in_root(f[1], 0, 0);
		if (fd < 0)
			die(f[1]);
		fdpath(p, sizeof p, fd);
		remount_bind(p, MS_RDONLY);
		close(fd);
	} else if (!strcmp(f[0], "remount") && n == 3) {
		int fd = open_in_root(f[1], 0, 0);
		if (fd < 0)
			die(f[1]);
		fdpath(p, sizeof p, fd);
		if (mount(NULL, p, NULL, MS_REMOUNT | strtoul(f[2], NULL, 16) | kept_flags(p), NULL) < 0)
			die(f[1]);
		close(fd);
	} else if (!strcmp(f[0], "cgns") && n == 1) {
		char c = 'C';
		if (write(sync_sock, &c, 1) != 1 || read(sync_sock, &c, 1) != 1 || c != 'K') {
			errno = EPIPE;
			die("join the cpu cgroups");
		}
		if (unshare(CLONE_NEWCGROUP) < 0)
			die("unshare(CLONE_NEWCGROUP)");
	} else if (!strcmp(f[0], "enter") && n == 1) {
		/* Why this is as safe as the pivot: the header, step enter. */
		if (!src_fd) {
			errno = EINVAL;
			die("enter needs -t");
		}
		if (mount(".", "/", NULL, MS_MOVE, NULL) < 0)
			die("move the rootfs over the template's root");
		if (chroot(".") < 0)
			die("chroot");
		rooted();
	} else if (!strcmp(f[0], "pivot") && n == 1) {
		/* pivot_root(".", "."): the old root ends up on top; detaching it leaves only the
		 * sandbox's mounts in this namespace. */
		if (syscall(SYS_pivot_root, ".", ".") < 0)
			die("pivot_root");
		if (umount2(".", MNT_DETACH) < 0)
			die("detach the old root");
		rooted();
	} else if (!strcmp(f[0], "roroot") && n == 1) {
		remount_bind("/", MS_RDONLY);
	} else {
		errno = EINVAL;
		die(f[0]);
	}
}

/* ------------------------------------------------------------------ the sandbox's process */

struct plan {
	char **steps;
	int nsteps;
	const char *hostname, *exe, *listener;
	char *env[MAXV];
	int nenv;
	int oom_adj, has_oom;
	unsigned long long caps[5]; /* bnd eff prm inh amb */
	int has_caps;
	int seccomp, seccomp_flags, newnet;
	int policy; /* -P, or -1 */
	struct sock_fprog prog;
};

/* A new network namespace starts with its loopback down; runtimes bring it up. */
static void loopback_up(void)
{
	at("loopback");
	struct ifreq ifr = {0};
	int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	strcpy(ifr.ifr_name, "lo");
	if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
		die("lo");
	ifr.ifr_flags |= IFF_UP;
	if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
		die("bring lo up");
	close(s);
}

static void set_caps(const struct plan *pl)
{
	at("capabilities");
	int last = 40;
	FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
	if (f) {
		if (fscanf(f, "%d", &last) != 1)
			last = 40;
		fclose(f);
	}
	for (int c = 0; c <= last; c++)
		if (!(pl->caps[0] >> c & 1) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0)
			die("drop from the bounding set");
	struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
	struct __user_cap_data_struct d[2];
	for (int i = 0; i < 2; i++) {
		d[i].effective = (unsigned)(pl->caps[1] >> (32 * i));
		d[i].permitted = (unsigned)(pl->caps[2] >> (32 * i));
		d[i].inheritable = (unsigned)(pl->caps[3] >> (32 * i));
	}
	if (syscall(SYS_capset, &h, d) < 0)
		die("capset");
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0)
		die("clear the ambient set");
	for (int c = 0; c <= last; c++)
		if ((pl->caps[4] >> c & 1) &&
		    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, c, 0, 0) < 0)
			die("raise an ambient capability");
}

/* Runs in the new namespaces; never returns. `go` is readable once the id maps are written;
 * `sock` carries the seccomp listener fd to the launcher. */
static void __attribute__((noreturn)) child(struct plan *pl, int go, int sock)
{
	char c;
	at("wait for id maps");
	if (read(go, &c, 1) != 1)
		_exit(1); /* the launcher died or gave up */
	close(go);
	sync_sock = sock;
	/* The sandbox starts with default signal handling and nothing blocked, whatever the
	 * node inherited: an ignored disposition survives exec (Python ignores SIGPIPE and
	 * SIGXFSZ; a node started in the background by a shell ignores SIGINT and SIGQUIT),
	 * and the init would keep it (corral-init resets its children's signals, not its
	 * own). crun resets them the same way. */
	at("signals");
	sigset_t none;
	if (sigemptyset(&none) < 0 || sigprocmask(SIG_SETMASK, &none, NULL) < 0)
		die("unblock signals");
	for (int sig = 1; sig < NSIG; sig++) {
		struct sigaction sa = {.sa_handler = SIG_DFL};
		/* SIGKILL, SIGSTOP and the C library's internal signals refuse: EINVAL. */
		if (sigaction(sig, &sa, NULL) < 0 && errno != EINVAL)
			die("reset a signal's disposition");
	}
	/* A session of its own: sharing the node's process group, the sandbox would get
	 * whatever is sent to that group (a terminal's Ctrl-C to `corral node serve`, Ray
	 * killing an agent worker's group), and a SIGKILL there ended every sandbox. */
	at("session");
	if (setsid() < 0)
		die("setsid");
	at("become root");
	if (setresgid(0, 0, 0) < 0 || setgroups(0, NULL) < 0 || setresuid(0, 0, 0) < 0)
		die("setresuid/setgroups to the sandbox's root");
	/* The IPC namespace only now, as the sandbox's root: its mqueue filesystem belongs to
	 * whoever creates it (made at clone time it would show the unmapped owner). */
	at("ipc namespace");
	if (unshare(CLONE_NEWIPC) < 0)
		die("unshare(CLONE_NEWIPC)");
	if (pl->newnet)
		loopback_up();
	at("hostname");
	if (pl->hostname && sethostname(pl->hostname, strlen(pl->hostname)) < 0)
		die(pl->hostname);
	at("mounts");
	/* rootfsPropagation private: nothing mounted here ever reaches the host, nor back. */
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		die("make / private");
	for (int i = 0; i < pl->nsteps; i++) {
		cur_step = i;
		do_step(pl->steps[i]);
	}
	if (src_fd)
		for (int i = 0; i < pl->nsteps; i++)
			if (src_fd[i] >= 0)
				close(src_fd[i]); /* not used (cannot happen: each bind takes its own) */
	at("fds");
	/* fd 3 (the control socket) is the only descriptor the init inherits beyond stdio. */
	if (fcntl(3, F_SETFD, 0) < 0)
		die("fd 3");
	if (syscall(SYS_close_range, 4, ~0U, CLOSE_RANGE_CLOEXEC) < 0)
		die("close_range");
	if (pl->policy >= 0) {
		/* Lowering one's own policy needs no privilege; the way back (SCHED_IDLE ->
		 * SCHED_OTHER) needs RLIMIT_NICE, which -r set for the class. */
		at("policy");
		struct sched_param sp = {0};
		if (sched_setscheduler(0, pl->policy, &sp) < 0)
			die("sched_setscheduler");
	}
	at("no_new_privs");
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		die("PR_SET_NO_NEW_PRIVS");
	if (pl->has_caps)
		set_caps(pl);
	if (pl->seccomp) {
		at("seccomp");
		int lfd = (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, pl->seccomp_flags, &pl->prog);
		if (lfd < 0)
			die("load the filter");
		if (pl->seccomp_flags & SECCOMP_FILTER_FLAG_NEW_LISTENER) {
			char b = 'L';
			struct iovec iov = {&b, 1};
			char cbuf[CMSG_SPACE(sizeof(int))] = {0};
			struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
					   .msg_controllen = sizeof cbuf};
			struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
			cm->cmsg_level = SOL_SOCKET;
			cm->cmsg_type = SCM_RIGHTS;
			cm->cmsg_len = CMSG_LEN(sizeof(int));
			memcpy(CMSG_DATA(cm), &lfd, sizeof(int));
			if (sendmsg(sock, &m, 0) != 1)
				die("hand over the seccomp listener");
			close(lfd);
		}
	}
	close(sock);
	at("exec");
	char *argv[] = {(char *)pl->exe, NULL};
	pl->env[pl->nenv] = NULL;
	execve(pl->exe, argv, pl->env);
	die(pl->exe);
}

/* The launcher's side of the seccomp listener handover: what crun sends (corral's listener
 * reads the container state as JSON and one fd, seccomp_notify.NotifyListener._take). */
static void forward_listener(const char *spec, int lfd, long pid)
{
	char path[256], id[128], js[512];
	const char *tab = strchr(spec, '\t');
	if (!tab || (size_t)(tab - spec) >= sizeof path || strlen(tab + 1) >= sizeof id) {
		errno = EINVAL;
		die("bad -l");
	}
	memcpy(path, spec, tab - spec);
	path[tab - spec] = 0;
	strcpy(id, tab + 1);
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof a.sun_path) {
		errno = ENAMETOOLONG;
		die(path);
	}
	strcpy(a.sun_path, path);
	if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) < 0)
		die(path);
	int n = snprintf(js, sizeof js,
			 "{\"ociVersion\":\"1.0.2\",\"fds\":[\"seccompFd\"],\"pid\":%ld,"
			 "\"metadata\":\"\",\"state\":{\"ociVersion\":\"1.0.2\",\"id\":\"%s\","
			 "\"status\":\"creating\",\"pid\":%ld,\"bundle\":\"\"}}",
			 pid, id, pid);
	struct iovec iov = {js, (size_t)n};
	char cbuf[CMSG_SPACE(sizeof(int))] = {0};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			   .msg_controllen = sizeof cbuf};
	struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &lfd, sizeof(int));
	if (sendmsg(s, &m, 0) != n)
		die("send the seccomp listener");
	close(s);
	close(lfd);
}

/* One message from the child: its kind ('C': move me to the -k cgroups; 'L': the seccomp
 * listener, whose fd goes to *fd), or 0 at EOF (it exec'd or died). */
static char recv_msg(int sock, int *fd)
{
	char b, cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec iov = {&b, 1};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			   .msg_controllen = sizeof cbuf};
	ssize_t r = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
	if (r <= 0)
		return 0;
	*fd = -1;
	struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
	if (cm && cm->cmsg_type == SCM_RIGHTS)
		memcpy(fd, CMSG_DATA(cm), sizeof *fd);
	return b;
}

static void read_bpf(struct plan *pl)
{
	struct stat st;
	if (fstat(BPF_FD, &st) < 0 || st.st_size <= 0 || st.st_size % sizeof(struct sock_filter))
		die("the BPF program on fd 5");
	struct sock_filter *ins = malloc(st.st_size);
	if (!ins || pread(BPF_FD, ins, st.st_size, 0) != st.st_size)
		die("read the BPF program");
	pl->prog.filter = ins;
	pl->prog.len = st.st_size / sizeof(struct sock_filter);
	close(BPF_FD);
}

/* -T: the template mount namespace (see the header). Runs as host root in a process of
 * its own; nothing of it reaches the node's namespace (it is private from the first call). */
static int make_template(const char *dir)
{
	err_fd = 1; /* the node reads READY or ERR ... on our stdout */
	at("template");
	if (unshare(CLONE_NEWNS) < 0)
		die("unshare(CLONE_NEWNS)");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		die("make / private");
	if (mount("corral-template", dir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
		  "size=16k,mode=755") < 0 || chdir(dir) < 0)
		die(dir);
	if (mkdir("proc", 0555) < 0 || mkdir("sys", 0555) < 0 || mkdir("rootfs", 0755) < 0)
		die("mkdir");
	/* Mounting proc or sysfs in a user namespace needs one already fully visible in the
	 * mount namespace (fs/namespace.c, mount_too_revealing): these, with no flag set, so
	 * no flag of theirs is locked against the sandbox's own mounts. Each sandbox's copy
	 * keeps them beneath its root (step enter): this proc shows nothing but pid
	 * directories, and to a uid only the processes it may ptrace (its own). The launcher
	 * child resolves /proc/self/fd/N through it before its own proc is up. */
	if (mount("proc", "proc", "proc", 0, "hidepid=invisible,subset=pid") < 0)
		die("mount proc");
	/* The sysfs of a network namespace of its own (loopback only, never up): bound
	 * read-only by every no-network sandbox (step tbind) instead of a sysfs each, so it
	 * shows no host interface and no other sandbox's. */
	if (unshare(CLONE_NEWNET) < 0)
		die("unshare(CLONE_NEWNET)");
	/* Up, as every sandbox's own loopback is: its sysfs entry is what they read. */
	loopback_up();
	at("template");
	if (mount("sysfs", "sys", "sysfs", 0, NULL) < 0)
		die("mount sysfs");
	if (syscall(SYS_pivot_root, ".", ".") < 0 || umount2(".", MNT_DETACH) < 0 || chdir("/") < 0)
		die("pivot_root");
	if (mount(NULL, "/", NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
		  NULL) < 0)
		die("remount / read-only");
	if (write(1, "READY\n", 6) != 6)
		die("report");
	char c;
	while (read(0, &c, 1) > 0)
		;
	return 0;
}

/* -t: a detached clone of every bind step's source, made here, in the node's mount
 * namespace, where the host paths resolve; the child moves them into place. Same sources,
 * same resolution as a bind by path before. (Masks bind the sandbox's own /dev/null.) */
static void prepare_sources(const struct plan *pl)
{
	at("sources");
	src_fd = malloc(sizeof *src_fd * (pl->nsteps + 1));
	src_dir = calloc(pl->nsteps + 1, 1);
	if (!src_fd || !src_dir)
		die("malloc");
	for (int i = 0; i < pl->nsteps; i++) {
		char *f[MAXV], *copy = strdup(pl->steps[i]);
		src_fd[i] = -1;
		if (!copy)
			die("strdup");
		int n = split(copy, f, MAXV);
		const char *src = NULL;
		int rec = 0;
		if (!strcmp(f[0], "bind") && n == 5) {
			src = f[1];
			rec = atoi(f[4]);
		}
		if (src) {
			struct stat st;
			if (stat(src, &st) < 0)
				die(src);
			src_dir[i] = S_ISDIR(st.st_mode);
			/* Safe: a detached copy of a mount the config names as a bind source; only
			 * the sandbox's child, in its own namespace, attaches it. */
			src_fd[i] = (int)syscall(SYS_open_tree, AT_FDCWD, src,
						 OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC |
							 (rec ? AT_RECURSIVE : 0));
			if (src_fd[i] < 0)
				die(src);
		}
		free(copy);
	}
}

int main(int argc, char **argv)
{
	if (argc == 3 && !strcmp(argv[1], "-T"))
		return make_template(argv[2]);
	static struct plan pl = {.policy = -1};
	const char *netns = NULL, *cgroups[16], *late[16];
	int ncg = 0, nlate = 0, i = 1, newnet = 0, template = 0;
	unsigned owner = 0, hostid = 0, count = 0;
	for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
		const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(o, "-N")) {
			newnet = pl.newnet = 1;
			continue;
		}
		if (!strcmp(o, "-t")) {
			template = 1;
			continue;
		}
		if (!v) {
			errno = EINVAL;
			die(o);
		}
		i++;
		if (!strcmp(o, "-n"))
			netns = v;
		else if (!strcmp(o, "-c") && ncg < 16)
			cgroups[ncg++] = v;
		else if (!strcmp(o, "-k") && nlate < 16)
			late[nlate++] = v;
		else if (!strcmp(o, "-r")) {
			unsigned res;
			unsigned long long soft, hard;
			if (sscanf(v, "%u:%llu:%llu", &res, &soft, &hard) != 3) {
				errno = EINVAL;
				die(o);
			}
			struct rlimit rl = {soft, hard};
			at("rlimits");
			if (setrlimit(res, &rl) < 0)
				die(v);
		} else if (!strcmp(o, "-u"))
			owner = strtoul(v, NULL, 10);
		else if (!strcmp(o, "-m")) {
			if (sscanf(v, "%u:%u", &hostid, &count) != 2 || !hostid || !count) {
				errno = EINVAL;
				die(o);
			}
		} else if (!strcmp(o, "-h"))
			pl.hostname = v;
		else if (!strcmp(o, "-o")) {
			pl.oom_adj = atoi(v);
			pl.has_oom = 1;
		} else if (!strcmp(o, "-P")) {
			char *end;
			long n = strtol(v, &end, 10);
			if (*end || n < 0 || n > 7) {
				errno = EINVAL;
				die(o);
			}
			pl.policy = (int)n;
		} else if (!strcmp(o, "-C")) {
			if (sscanf(v, "%llx:%llx:%llx:%llx:%llx", &pl.caps[0], &pl.caps[1], &pl.caps[2],
				   &pl.caps[3], &pl.caps[4]) != 5) {
				errno = EINVAL;
				die(o);
			}
			pl.has_caps = 1;
		} else if (!strcmp(o, "-s")) {
			pl.seccomp = 1;
			pl.seccomp_flags = (int)strtoul(v, NULL, 16);
		} else if (!strcmp(o, "-l"))
			pl.listener = v;
		else if (!strcmp(o, "-e") && pl.nenv < MAXV - 1)
			pl.env[pl.nenv++] = (char *)v;
		else if (!strcmp(o, "-x"))
			pl.exe = v;
		else if (!strcmp(o, "-F"))
			fault = v;
		else {
			errno = EINVAL;
			die(o);
		}
	}
	if (i >= argc || !pl.exe || !count) {
		errno = EINVAL;
		die("need -x, -m and --");
	}
	pl.steps = argv + i + 1;
	pl.nsteps = argc - i - 1;
	if ((pl.listener != NULL) != ((pl.seccomp_flags & SECCOMP_FILTER_FLAG_NEW_LISTENER) != 0)) {
		errno = EINVAL;
		die("-l goes with SECCOMP_FILTER_FLAG_NEW_LISTENER");
	}
	if (pl.seccomp)
		read_bpf(&pl);
	if (template)
		prepare_sources(&pl);

	at("network namespace");
	if (netns) {
		int fd = open(netns, O_RDONLY | O_CLOEXEC);
		if (fd < 0 || setns(fd, CLONE_NEWNET) < 0)
			die(netns);
		close(fd);
	}
	at("cgroups");
	char me[24];
	snprintf(me, sizeof me, "%d", getpid());
	for (int k = 0; k < ncg; k++)
		if (write_file(cgroups[k], me) < 0)
			die(cgroups[k]);

	int go[2], sp[2], ep[2];
	at("clone");
	if (pipe2(go, O_CLOEXEC) < 0 || pipe2(ep, O_CLOEXEC) < 0 ||
	    socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
		die("pipes");
	/* As the owner (effective ids only; real and saved stay root to come back): the new
	 * user namespace belongs to the sandbox's own host uid (see corral/host/owners.py and
	 * corral-spawn's make_userns for why). RLIMIT_NPROC is lifted around the clone: the
	 * kernel enforces it for a non-root creator, and the pids cgroup is the real limit. */
	struct rlimit nproc, inf = {RLIM_INFINITY, RLIM_INFINITY};
	getrlimit(RLIMIT_NPROC, &nproc);
	/* With -t the clone copies the template's mount namespace (3 mounts), not the node's
	 * (every mount on the host: the cost grew with the number of mounts). */
	int host_mnt = -1;
	if (template) {
		at("template");
		host_mnt = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
		if (host_mnt < 0 || setns(TEMPLATE_FD, CLONE_NEWNS) < 0)
			die("join the template mount namespace");
		at("clone");
	}
	if (owner) {
		(void)setrlimit(RLIMIT_NPROC, &inf);
		if (setresgid(-1, owner, -1) < 0 || setresuid(-1, owner, -1) < 0)
			die("switch to the namespace owner");
	}
	/* No CLONE_NEWCGROUP here: the child unshares it at the step cgns, once it is in all
	 * of its cgroups. */
	long flags = CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS |
		     (newnet ? CLONE_NEWNET : 0) | SIGCHLD;
	long pid = syscall(SYS_clone, flags, 0, 0, 0, 0);
	int cerr = errno;
	if (pid == 0) {
		if (template) {
			close(host_mnt);
			close(TEMPLATE_FD);
		}
		close(go[1]);
		close(ep[0]);
		close(sp[0]);
		close(REPORT_FD);
		err_fd = ep[1];
		child(&pl, go[0], sp[1]);
	}
	if (owner) {
		if (setresuid(-1, 0, -1) < 0 || setresgid(-1, 0, -1) < 0)
			die("switch back to root");
		(void)setrlimit(RLIMIT_NPROC, &nproc);
	}
	if (template) {
		/* Back in the node's namespace: the paths below (cgroups, /proc, the seccomp
		 * listener's socket) are host paths. */
		if (setns(host_mnt, CLONE_NEWNS) < 0) {
			int e = errno;
			if (pid > 0) {
				kill(pid, SIGKILL);
				waitpid(pid, NULL, 0);
			}
			errno = e;
			die("return to the node's mount namespace");
		}
		close(host_mnt);
		close(TEMPLATE_FD);
		close(ROOT_FD);
		for (int k = 0; k < pl.nsteps; k++)
			if (src_fd[k] >= 0)
				close(src_fd[k]);
	}
	if (pid < 0) {
		errno = cerr;
		die("clone");
	}
	close(go[0]);
	close(ep[1]);
	close(sp[1]);
	/* From here on a failure must not leave the half-made sandbox behind. */
	char path[64], map[64];
	snprintf(map, sizeof map, "0 %u %u\n", hostid, count);
	at("id maps");
	snprintf(path, sizeof path, "/proc/%ld/uid_map", pid);
	int bad = write_file(path, map);
	if (!bad) {
		snprintf(path, sizeof path, "/proc/%ld/gid_map", pid);
		bad = write_file(path, map);
	}
	if (!bad && pl.has_oom) {
		/* From here (host root): inside, the process is no longer dumpable after its id
		 * change, so its own /proc files are not its to write. */
		char v[16];
		snprintf(v, sizeof v, "%d", pl.oom_adj);
		snprintf(path, sizeof path, "/proc/%ld/oom_score_adj", pid);
		bad = write_file(path, v);
	}
	if (bad) {
		int e = errno;
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		errno = e;
		die(path);
	}
	at("start");
	if (write(go[1], "g", 1) != 1)
		die("start the sandbox");
	close(go[1]);
	char kind;
	int lfd = -1;
	while ((kind = recv_msg(sp[0], &lfd)) != 0) {
		if (kind == 'C') {
			at("cpu cgroups");
			snprintf(me, sizeof me, "%ld", pid);
			for (int k = 0; k < nlate; k++)
				if (write_file(late[k], me) < 0) {
					int e = errno;
					kill(pid, SIGKILL);
					waitpid(pid, NULL, 0);
					errno = e;
					die(late[k]);
				}
			if (write(sp[0], "K", 1) != 1)
				die("resume the sandbox");
		} else if (kind == 'L' && lfd >= 0 && pl.listener) {
			at("seccomp listener");
			forward_listener(pl.listener, lfd, pid);
			break; /* the last message */
		} else {
			errno = EPROTO;
			die("a message from the sandbox's process");
		}
	}
	/* The child's error pipe closes at its exec (CLOEXEC) or its exit. */
	char msg[512];
	ssize_t n = read(ep[0], msg, sizeof msg - 1);
	if (n > 0) {
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		(void)!write(REPORT_FD, msg, n);
		_exit(1);
	}
	/* EOF: exec'd, or dead without a word (killed). */
	int st;
	if (waitpid(pid, &st, WNOHANG) == pid) {
		errno = ECHILD;
		step = "exec";
		die("the sandbox's process died before its init ran");
	}
	char out[32];
	int m = snprintf(out, sizeof out, "PID %ld\n", pid);
	if (write(REPORT_FD, out, m) != m)
		die("report");
	return 0;
}
