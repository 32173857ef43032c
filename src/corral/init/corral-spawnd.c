/* corral-spawnd: start corral-launch on the node's behalf (corral/host/spawnd.py).
 *
 * Why: a process that starts a program copies its fd table into the child (dup_fd) and the
 * exec then walks it to close the CLOEXEC ones (do_close_on_exec). The node holds ~2 fds
 * per live sandbox, so each launch it started itself cost more with every sandbox alive
 * (0.24 -> 0.94 ms per create from 0-200 to 600-800 live, several ms at 3,200). This
 * server is started by the node at start-up, while it has a handful of fds, and forks the
 * launcher from its own small table instead.
 *
 *   corral-spawnd LAUNCHER NODEPID
 * fds: 0-2 /dev/null (the launcher's stdio), 3 a SOCK_SEQPACKET socket to the node.
 * A request is one message: 4 bytes, the bit mask of the launcher fds 3..7 present (bit 0:
 * fd 3), then the launcher's arguments after argv[0], each NUL-terminated; SCM_RIGHTS
 * carries a reply socket first, then the present fds in ascending target order. The
 * server forks, puts exactly those fds at 3..7 (stdio inherited, everything else closed),
 * unblocks signals and execs LAUNCHER (only that program, with an empty environment).
 * Once forked, the server sends "P" with a pidfd of the launcher (SCM_RIGHTS) on the reply
 * socket. When the launcher exits, the server writes "X <wait status> <user us> <system us>" (its
 * CPU time, which the node's own children times no longer include) on its reply socket and
 * closes it; a request it cannot run gets "E <why>". The launcher's own report (its pipe
 * on fd 4) goes straight to the node.
 *
 * It exits when the node closes its end of the socket (or dies: PR_SET_PDEATHSIG too).
 * Launchers still running then are reparented like the sandboxes' inits; the node sees
 * the reply sockets close and fails those creates (its undo kills their cgroups). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define SOCK 3
#define FIRST 3	 /* the launcher's fds: 3 control socket, 4 report, 5 BPF, 6 rootfs, */
#define NFDS 5	 /* 7 template */
#define MAXMSG 65536
#define MAXARGS 1024

static const char *launcher;
static int sfd = -1;

/* Launchers running, with the reply socket of each. */
struct job {
	pid_t pid;
	int reply;
};
static struct job *jobs;
static size_t njobs, capjobs;

static void reply(int fd, const char *text)
{
	/* MSG_DONTWAIT: a node that stopped reading cannot block the server. */
	(void)send(fd, text, strlen(text), MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* "P" with a pidfd of the launcher: if this server dies first, the node still waits for the
 * launcher itself to end (as after a cancelled create) before its undo cleans up. */
static void send_pidfd(int fd, pid_t pid)
{
	int pfd = syscall(SYS_pidfd_open, pid, 0);
	if (pfd < 0) {
		reply(fd, "P");
		return;
	}
	union {
		char b[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} cbuf;
	struct iovec iov = {"P", 1};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.b,
			   .msg_controllen = sizeof cbuf.b};
	struct cmsghdr *c = CMSG_FIRSTHDR(&m);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &pfd, sizeof(int));
	(void)sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
	close(pfd);
}

static void __attribute__((noreturn)) child(int *fds, char **argv)
{
	static char *const envp[] = {NULL};
	int tmp[NFDS];
	sigset_t none;
	/* Out of the way of 3..7 first (F_DUPFD picks >= 8), so no dup2 below clobbers a
	 * source still to be moved. */
	for (int i = 0; i < NFDS; i++) {
		tmp[i] = -1;
		if (fds[i] >= 0 && (tmp[i] = fcntl(fds[i], F_DUPFD, FIRST + NFDS)) < 0)
			_exit(126);
	}
	for (int i = 0; i < NFDS; i++) {
		if (tmp[i] >= 0) {
			if (dup2(tmp[i], FIRST + i) < 0) /* dup2 clears FD_CLOEXEC */
				_exit(126);
		} else {
			close(FIRST + i);
		}
	}
	/* Only stdio and the request's fds cross: the server's socket, the other jobs' reply
	 * sockets and this request's own are above 7. */
	if (syscall(SYS_close_range, FIRST + NFDS, ~0U, 0) < 0)
		_exit(126);
	sigemptyset(&none);
	if (sigprocmask(SIG_SETMASK, &none, NULL) < 0)
		_exit(126);
	execve(launcher, argv, envp);
	_exit(127);
}

static void request(void)
{
	static char buf[MAXMSG];
	static char *argv[MAXARGS + 2];
	union {
		char b[CMSG_SPACE(sizeof(int) * (NFDS + 1))];
		struct cmsghdr align;
	} cbuf;
	struct iovec iov = {buf, sizeof buf - 1};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.b,
			   .msg_controllen = sizeof cbuf.b};
	ssize_t n = recvmsg(SOCK, &m, MSG_CMSG_CLOEXEC);
	if (n == 0)
		exit(0); /* the node closed its end */
	if (n < 0) {
		if (errno == EINTR || errno == EAGAIN)
			return;
		exit(1);
	}
	int got[NFDS + 1], ngot = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		int k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		int *p = (int *)CMSG_DATA(c);
		for (int j = 0; j < k; j++) {
			if (ngot < NFDS + 1)
				got[ngot++] = p[j];
			else
				close(p[j]);
		}
	}
	const char *bad = NULL;
	uint32_t mask = 0;
	int fds[NFDS], want = 0, argc = 0;
	if (ngot == 0)
		goto drop; /* no reply socket: nobody to tell */
	if (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
		bad = "E request truncated";
	else if (n < 4)
		bad = "E request too short";
	else {
		memcpy(&mask, buf, 4);
		for (int i = 0; i < NFDS; i++)
			want += (mask >> i) & 1;
		if (mask >> NFDS || want != ngot - 1)
			bad = "E fd mask does not match the fds sent";
	}
	if (!bad) {
		buf[n] = 0;
		if (n > 4 && buf[n - 1] != 0)
			bad = "E arguments not NUL-terminated";
		argv[argc++] = (char *)launcher;
		for (char *s = buf + 4; !bad && s < buf + n; s += strlen(s) + 1) {
			if (argc > MAXARGS)
				bad = "E too many arguments";
			else
				argv[argc++] = s;
		}
		argv[argc] = NULL;
	}
	if (!bad) {
		for (int i = 0, j = 1; i < NFDS; i++)
			fds[i] = (mask >> i) & 1 ? got[j++] : -1;
		if (njobs == capjobs) {
			size_t cap = capjobs ? 2 * capjobs : 64;
			struct job *nj = realloc(jobs, cap * sizeof *nj);
			if (!nj)
				bad = "E out of memory";
			else {
				jobs = nj;
				capjobs = cap;
			}
		}
	}
	if (!bad) {
		pid_t pid = fork();
		if (pid == 0)
			child(fds, argv);
		if (pid < 0) {
			char e[96];
			snprintf(e, sizeof e, "E fork: %s", strerror(errno));
			reply(got[0], e);
		} else {
			send_pidfd(got[0], pid);
			jobs[njobs].pid = pid;
			jobs[njobs++].reply = got[0];
			got[0] = -1; /* closed when the launcher exits */
		}
	} else {
		reply(got[0], bad);
	}
drop:
	for (int i = 0; i < ngot; i++)
		if (got[i] >= 0)
			close(got[i]);
}

static void reap(void)
{
	struct signalfd_siginfo si;
	while (read(sfd, &si, sizeof si) > 0)
		;
	int st;
	pid_t pid;
	struct rusage ru;
	while ((pid = wait4(-1, &st, WNOHANG, &ru)) > 0) {
		for (size_t i = 0; i < njobs; i++) {
			if (jobs[i].pid != pid)
				continue;
			/* With the launcher's CPU time: reaped here, it no longer shows in the
			 * node's children times (the benches' CPU per create). */
			char out[80];
			snprintf(out, sizeof out, "X %d %lld %lld", st,
				 (long long)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec,
				 (long long)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec);
			reply(jobs[i].reply, out);
			close(jobs[i].reply);
			jobs[i] = jobs[--njobs];
			break;
		}
	}
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: corral-spawnd LAUNCHER NODEPID\n");
		return 2;
	}
	launcher = argv[1];
	/* Dies with the node; if the node is already gone, now (the check after the prctl
	 * closes the race with its exit). */
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != (pid_t)atol(argv[2]))
		return 1;
	if (fcntl(SOCK, F_SETFD, FD_CLOEXEC) < 0)
		return 1;
	sigset_t chld;
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	if (sigprocmask(SIG_BLOCK, &chld, NULL) < 0)
		return 1;
	sfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
	if (sfd < 0)
		return 1;
	/* Out of 3..7: keeps the launcher's fd numbers free in the server's table too. */
	int hi = fcntl(sfd, F_DUPFD_CLOEXEC, 64);
	if (hi < 0)
		return 1;
	close(sfd);
	sfd = hi;
	for (;;) {
		struct pollfd p[2] = {{SOCK, POLLIN, 0}, {sfd, POLLIN, 0}};
		if (poll(p, 2, -1) < 0) {
			if (errno == EINTR)
				continue;
			return 1;
		}
		if (p[1].revents)
			reap();
		if (p[0].revents & POLLIN)
			request();
		else if (p[0].revents & (POLLHUP | POLLERR))
			return 0;
	}
}
