/*
 * corral-init: PID 1 of every corral container sandbox.
 *
 * Reaper + exec server. The protocol is docs/init-protocol.md (keep the two in step).
 * fd 3 is a listening unix stream socket handed over by `runc run --preserve-fds 1`;
 * the node connects to it by a host path the guest cannot see. One poll() loop, one
 * helper thread while guest processes live (the landlock spawner, below), no allocation
 * beyond what live requests need, so that thousands of these idle in well under a MiB each.
 *
 * Build: gcc -static -O2 -Wall -o corral-init corral-init.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <pthread.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#ifndef TIOCGPTPEER
#define TIOCGPTPEER _IO('T', 0x41)
#endif

#define VERSION "corral-init 0.1.0 (protocol 1)"
#define LISTEN_FD 3
#define MAX_FRAME (16u << 20)
#define CHUNK 65536                 /* one read from a child pipe */
#define HIGH_WATER (1u << 20)       /* unsent bytes per connection before we stop reading */
#define DATA_FRAME (1u << 20)       /* largest O/E frame we build from a buffer */
#define DRAIN_NS 50000000ull        /* pipes get 50 ms after the direct child's exit */
#define MAX_CONNS 1024
#define MAX_GROUPS 256
#define DEFAULT_LIMIT (1u << 20)
#define FINAL_READS 16              /* bounded last drain: a writer may never stop */
#define TRIM_NS 1000000000ull       /* idle this long: give freed heap back to the kernel */
#define SPAWNER_IDLE_NS 1000000000ull /* no guest process this long: end the spawner */

extern char **environ;

/* field tags */
enum {
	T_OP = 1, T_ARG, T_ENV, T_CWD, T_UID, T_GID, T_TIMEOUT_MS, T_OUTPUT_LIMIT, T_STDIN, T_TTY,
	T_ROWS, T_COLS, T_ID, T_SIGNAL, T_WAIT_MS, T_PID, T_REASON, T_CODE, T_OUT_TRUNC,
	T_ERR_TRUNC, T_DURATION_US, T_RUNNING, T_MESSAGE, T_GROUPS, T_OUT_LEN, T_ERR_LEN,
};

/* child setup stages, reported over the CLOEXEC pipe when one fails */
enum { ST_STDIO = 1, ST_TTY, ST_GROUPS, ST_GID, ST_UID, ST_CWD, ST_EXEC };

enum { C_REQ, C_EXEC, C_WAIT, C_CLOSING, C_ATTACH };
enum { RS_NONE, RS_TIMEOUT, RS_LIMIT };
enum { K_LISTEN, K_SIG, K_CONN, K_OUT, K_ERR, K_CTL, K_IN };

static int trim_wanted;

/* ------------------------------------------------------------------ buffers */

typedef struct {
	char *p;
	size_t off, len, cap;
	int bad; /* an allocation failed: the owner gives up on what this buffer was for */
} buf;

static size_t buf_avail(const buf *b) { return b->len - b->off; }

static int buf_reserve(buf *b, size_t n)
{
	if (b->bad)
		return -1;
	if (b->cap - b->len >= n)
		return 0;
	if (b->off) {
		memmove(b->p, b->p + b->off, b->len - b->off);
		b->len -= b->off;
		b->off = 0;
		if (b->cap - b->len >= n)
			return 0;
	}
	size_t nc = b->cap ? b->cap : 512;
	while (nc - b->len < n) {
		if (nc > ((size_t)1 << 40)) {
			b->bad = 1;
			return -1;
		}
		nc *= 2;
	}
	char *q = realloc(b->p, nc);
	if (!q) {
		b->bad = 1;
		return -1;
	}
	b->p = q;
	b->cap = nc;
	return 0;
}

static void buf_put(buf *b, const void *d, size_t n)
{
	if (buf_reserve(b, n))
		return;
	memcpy(b->p + b->len, d, n);
	b->len += n;
}

static void buf_free(buf *b)
{
	if (b->cap)
		trim_wanted = 1;
	free(b->p);
	memset(b, 0, sizeof *b);
}

static void buf_consumed(buf *b, size_t n)
{
	b->off += n;
	if (b->off == b->len) {
		b->off = b->len = 0;
		/* an idle connection should not pin a big buffer */
		if (b->cap > 65536)
			buf_free(b);
	}
}

static void put_be32(char *p, uint32_t v)
{
	p[0] = (char)(v >> 24);
	p[1] = (char)(v >> 16);
	p[2] = (char)(v >> 8);
	p[3] = (char)v;
}

static uint32_t get_be32(const char *p)
{
	const unsigned char *u = (const unsigned char *)p;
	return (uint32_t)u[0] << 24 | (uint32_t)u[1] << 16 | (uint32_t)u[2] << 8 | u[3];
}

/* Frames. The mark is relative to b->off, which survives compaction in buf_reserve. */
static size_t fr_begin(buf *b, char type)
{
	size_t m = b->len - b->off;
	char h[5] = {0, 0, 0, 0, type};
	buf_put(b, h, 5);
	return m;
}

static void fr_end(buf *b, size_t m)
{
	if (!b->bad)
		put_be32(b->p + b->off + m, (uint32_t)(b->len - b->off - m - 4));
}

static void fr_field(buf *b, int tag, const void *v, size_t n)
{
	char h[5];
	h[0] = (char)tag;
	put_be32(h + 1, (uint32_t)n);
	buf_put(b, h, 5);
	buf_put(b, v, n);
}

static void fr_num(buf *b, int tag, long long v)
{
	char s[24];
	int n = snprintf(s, sizeof s, "%lld", v);
	fr_field(b, tag, s, (size_t)n);
}

static void fr_str(buf *b, int tag, const char *s) { fr_field(b, tag, s, strlen(s)); }

static void fr_data(buf *b, char type, const char *d, size_t n)
{
	size_t m = fr_begin(b, type);
	buf_put(b, d, n);
	fr_end(b, m);
}

/* ------------------------------------------------------------------ state */

struct proc;

typedef struct conn {
	struct conn *next;
	int fd, state, dead;
	buf in, out;
	struct proc *proc;      /* the exec it runs, the background process it waits for, or
	                         * the session it is attached to */
	uint64_t wait_deadline; /* 0: wait until the process ends */
} conn;

typedef struct proc {
	struct proc *next;
	int bg, dead, tty, reaped, ended, status, reason;
	int sess;     /* a background process with a stdin pipe that clients attach to */
	char id[24];
	pid_t pid;
	int fd_out, fd_err, fd_in, fd_ctl; /* our ends; fd_out is the pty master with TTY */
	int fd_pty; /* the pty master once its output ended: kept open until the end */
	uint64_t t_start, t_exit, deadline;
	uint64_t limit, out_len, err_len, out_kept, err_kept;
	int out_trunc, err_trunc;
	conn *c;      /* exec: the connection that gets the output; session: the attached one */
	buf ob, eb;   /* background: the first `limit` bytes of each stream */
	buf ib;       /* exec: stdin not yet written */
	int in_eof;   /* the client closed stdin; close ours once ib is written */
	char *args;   /* NUL-separated argv, for list and error messages */
	size_t args_len;
	char *cwd;
	unsigned uid, gid;
	char ctl[8];
	size_t ctl_len;
} proc;

static conn *conns;
static proc *procs;
static int nconns, accept_paused, sig_fd = -1, devnull_fd = -1;
static unsigned long next_bg_id = 1;
static char rdbuf[CHUNK];

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void xclose(int *fd)
{
	if (*fd >= 0)
		close(*fd);
	*fd = -1;
}

static int set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void killgrp(proc *p, int sig)
{
	/* pid is always a child of ours (> 1): kill(-1) would hit everything */
	if (p->pid <= 1)
		return;
	/* ESRCH: the child has not reached setsid() yet, so its group does not exist. It is
	 * alone then (it forks nothing before its exec): signalling the pid is enough. */
	if (kill(-p->pid, sig) < 0 && errno == ESRCH && !p->reaped)
		kill(p->pid, sig);
}

static void proc_close_fds(proc *p)
{
	xclose(&p->fd_out);
	xclose(&p->fd_err);
	xclose(&p->fd_in);
	xclose(&p->fd_ctl);
	xclose(&p->fd_pty);
}

/* ------------------------------------------------------------------ connections */

static void conn_flush(conn *c);

/* Drop the connection at once. A running exec loses its client: kill its group. */
static void conn_lost(conn *c)
{
	if (c->dead)
		return;
	if (c->state == C_EXEC && c->proc) {
		proc *p = c->proc;
		if (!p->ended)
			killgrp(p, SIGKILL);
		proc_close_fds(p);
		p->c = NULL;
		p->dead = 1; /* the reaper will find no owner for its pid, which is fine */
	} else if (c->state == C_ATTACH && c->proc) {
		c->proc->c = NULL; /* a session only loses its client: it keeps running */
	}
	c->proc = NULL;
	xclose(&c->fd);
	c->dead = 1;
}

/* Close after a complete answer. Unread input is discarded first: closing an AF_UNIX
 * socket with unread data makes the peer's next read fail with ECONNRESET. */
static void conn_close(conn *c)
{
	for (int i = 0; i < 64; i++) {
		if (recv(c->fd, rdbuf, sizeof rdbuf, MSG_DONTWAIT) <= 0)
			break;
	}
	xclose(&c->fd);
	c->dead = 1;
}

static void conn_finish(conn *c)
{
	c->state = C_CLOSING;
	c->proc = NULL;
	conn_flush(c);
}

static void conn_flush(conn *c)
{
	if (c->dead)
		return;
	if (c->out.bad) {
		conn_lost(c);
		return;
	}
	while (buf_avail(&c->out)) {
		ssize_t n = send(c->fd, c->out.p + c->out.off, buf_avail(&c->out),
				 MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n > 0) {
			buf_consumed(&c->out, (size_t)n);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		conn_lost(c);
		return;
	}
	if (c->state == C_CLOSING)
		conn_close(c);
}

static void conn_error(conn *c, int code, const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (c->state == C_EXEC && c->proc) {
		proc *p = c->proc;
		if (!p->ended)
			killgrp(p, SIGKILL);
		proc_close_fds(p);
		p->c = NULL;
		p->dead = 1;
	} else if (c->state == C_ATTACH && c->proc) {
		c->proc->c = NULL;
	}
	size_t m = fr_begin(&c->out, 'R');
	fr_str(&c->out, T_MESSAGE, msg);
	if (code)
		fr_num(&c->out, T_CODE, code);
	fr_end(&c->out, m);
	conn_finish(c);
}

/* ------------------------------------------------------------------ output */

static void put_status(buf *b, proc *p)
{
	const char *reason = p->reason == RS_TIMEOUT ? "timeout"
			     : p->reason == RS_LIMIT ? "output_limit"
			     : WIFSIGNALED(p->status) ? "signaled" : "exited";
	fr_str(b, T_REASON, reason);
	if (WIFEXITED(p->status))
		fr_num(b, T_CODE, WEXITSTATUS(p->status));
	if (WIFSIGNALED(p->status))
		fr_num(b, T_SIGNAL, WTERMSIG(p->status));
}

static void put_exit(buf *b, proc *p)
{
	size_t m = fr_begin(b, 'X');
	put_status(b, p);
	fr_str(b, T_OUT_TRUNC, p->out_trunc ? "1" : "0");
	fr_str(b, T_ERR_TRUNC, p->err_trunc ? "1" : "0");
	fr_num(b, T_DURATION_US, (long long)((p->t_exit - p->t_start) / 1000));
	fr_num(b, T_OUT_LEN, (long long)p->out_len);
	fr_num(b, T_ERR_LEN, (long long)p->err_len);
	fr_num(b, T_PID, p->pid);
	if (p->bg)
		fr_str(b, T_ID, p->id);
	fr_end(b, m);
}

static void put_entry(buf *b, proc *p)
{
	size_t m = fr_begin(b, 'P');
	fr_str(b, T_ID, p->id);
	fr_num(b, T_PID, p->pid);
	fr_str(b, T_RUNNING, p->ended ? "0" : "1");
	for (size_t i = 0; i < p->args_len;) {
		size_t n = strlen(p->args + i);
		fr_field(b, T_ARG, p->args + i, n);
		i += n + 1;
	}
	if (p->ended)
		put_status(b, p);
	fr_end(b, m);
}

static void put_buffer(buf *out, char type, const buf *b)
{
	for (size_t i = 0; i < buf_avail(b); i += DATA_FRAME) {
		size_t n = buf_avail(b) - i;
		fr_data(out, type, b->p + b->off + i, n < DATA_FRAME ? n : DATA_FRAME);
	}
}

/* Answer a wait: the entry, everything buffered, then X or N. */
static void wait_reply(conn *c)
{
	proc *p = c->proc;
	put_entry(&c->out, p);
	put_buffer(&c->out, 'O', &p->ob);
	put_buffer(&c->out, 'E', &p->eb);
	if (p->ended) {
		put_exit(&c->out, p);
	} else {
		size_t m = fr_begin(&c->out, 'N');
		fr_end(&c->out, m);
	}
	conn_finish(c);
}

/* Bytes the process wrote on one stream (stream 0 = stdout, 1 = stderr). */
static void deliver(proc *p, int stream, const char *d, size_t n)
{
	uint64_t *kept = stream ? &p->err_kept : &p->out_kept;
	int *trunc = stream ? &p->err_trunc : &p->out_trunc;
	uint64_t room = p->limit > *kept ? p->limit - *kept : 0;
	size_t take = n < room ? n : (size_t)room;

	*(stream ? &p->err_len : &p->out_len) += n;
	if (p->sess && p->c) {
		/* an attached session streams everything; backpressure instead of a limit */
		fr_data(&p->c->out, stream ? 'E' : 'O', d, n);
		conn_flush(p->c);
		return;
	}
	if (p->bg) {
		buf *b = stream ? &p->eb : &p->ob;
		if (take) {
			buf_put(b, d, take);
			if (b->bad) { /* out of memory: keep nothing rather than die */
				buf_free(b);
				*kept = p->limit;
			} else {
				*kept += take;
			}
		}
		if (take < n)
			*trunc = 1;
		return;
	}
	if (take && p->c) {
		fr_data(&p->c->out, stream ? 'E' : 'O', d, take);
		*kept += take;
	}
	if (take < n) {
		*trunc = 1;
		if (p->reason == RS_NONE) {
			p->reason = RS_LIMIT;
			killgrp(p, SIGKILL);
		}
	}
	if (p->c)
		conn_flush(p->c); /* may drop the connection and with it this proc */
}

static void report_ctl(proc *p)
{
	int m[2];
	char msg[600];
	const char *what = "exec", *obj = p->args;
	char num[16];

	memcpy(m, p->ctl, sizeof m);
	switch (m[0]) {
	case ST_STDIO: what = "stdio setup"; obj = NULL; break;
	case ST_TTY: what = "controlling tty"; obj = NULL; break;
	case ST_GROUPS: what = "setgroups"; obj = NULL; break;
	case ST_GID: what = "setgid"; snprintf(num, sizeof num, "%u", p->gid); obj = num; break;
	case ST_UID: what = "setuid"; snprintf(num, sizeof num, "%u", p->uid); obj = num; break;
	case ST_CWD: what = "chdir"; obj = p->cwd; break;
	}
	int n = obj ? snprintf(msg, sizeof msg, "corral-init: %s %s: %s\n", what, obj, strerror(m[1]))
		    : snprintf(msg, sizeof msg, "corral-init: %s: %s\n", what, strerror(m[1]));
	if (n > (int)sizeof msg - 1)
		n = (int)sizeof msg - 1;
	deliver(p, 1, msg, (size_t)n);
}

/* One read from one of a process's pipes. */
static int proc_read(proc *p, int kind)
{
	if (kind == K_CTL) {
		ssize_t n = read(p->fd_ctl, p->ctl + p->ctl_len, sizeof p->ctl - p->ctl_len);
		if (n > 0) {
			p->ctl_len += (size_t)n;
			if (p->ctl_len == sizeof p->ctl)
				report_ctl(p);
			return 1;
		}
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			return 0;
		xclose(&p->fd_ctl); /* EOF: the exec succeeded (CLOEXEC) or the child is gone */
		return 0;
	}
	int *fd = kind == K_OUT ? &p->fd_out : &p->fd_err;
	ssize_t n = read(*fd, rdbuf, sizeof rdbuf);
	if (n > 0) {
		deliver(p, kind == K_ERR, rdbuf, (size_t)n);
		return 1;
	}
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return 0;
	if (p->tty && kind == K_OUT) {
		/* EIO: no slave fd is left, but the session leader may still be alive (cat
		 * closes its stdio before exiting). Closing the master now would hang up the
		 * tty and SIGHUP it, so the master stays open until the process has ended. */
		p->fd_pty = *fd;
		*fd = -1;
		return 0;
	}
	xclose(fd); /* EOF */
	return 0;
}

static void proc_finish(proc *p)
{
	/* what is already in the pipes belongs to the result (the client may have been
	 * slow, so we were not reading); bounded, since a grandchild may write forever */
	static const int kinds[3] = {K_CTL, K_OUT, K_ERR};
	for (int k = 0; k < 3; k++) {
		for (int i = 0; i < FINAL_READS && !p->dead; i++) {
			int fd = kinds[k] == K_CTL ? p->fd_ctl : kinds[k] == K_OUT ? p->fd_out : p->fd_err;
			if (fd < 0 || !proc_read(p, kinds[k]))
				break;
		}
	}
	if (p->dead)
		return;
	proc_close_fds(p);
	buf_free(&p->ib);
	p->ended = 1;
	if (!p->bg) {
		conn *c = p->c;
		if (c && !c->dead) {
			put_exit(&c->out, p);
			conn_finish(c);
		}
		p->c = NULL;
		p->dead = 1;
		return;
	}
	if (p->sess && p->c && !p->c->dead) {
		conn *c = p->c;
		put_exit(&c->out, p);
		p->c = NULL;
		conn_finish(c);
	}
	for (conn *c = conns; c; c = c->next)
		if (!c->dead && c->state == C_WAIT && c->proc == p)
			wait_reply(c);
}

/* The rule for "ended": the direct child exited, and its pipes reached EOF or got
 * DRAIN_NS to do so (a `sleep 100 &` keeps them open). */
static void proc_check(proc *p, uint64_t now)
{
	if (p->ended || p->dead || !p->reaped)
		return;
	int open = p->fd_out >= 0 || p->fd_err >= 0 || p->fd_ctl >= 0;
	if (open && now < p->t_exit + DRAIN_NS)
		return;
	proc_finish(p);
}

static void stdin_flush(proc *p)
{
	if (p->fd_in < 0)
		return;
	while (buf_avail(&p->ib)) {
		ssize_t n = write(p->fd_in, p->ib.p + p->ib.off, buf_avail(&p->ib));
		if (n > 0) {
			buf_consumed(&p->ib, (size_t)n);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		/* EPIPE: the process closed its stdin; the rest is dropped */
		buf_free(&p->ib);
		xclose(&p->fd_in);
		return;
	}
	if (p->in_eof) {
		if (p->tty) {
			/* a tty has no EOF of its own: type the EOF character, as a user would */
			struct termios t;
			if (tcgetattr(p->fd_in, &t) == 0 && (t.c_lflag & ICANON)) {
				ssize_t r = write(p->fd_in, &t.c_cc[VEOF], 1);
				(void)r;
			}
		}
		xclose(&p->fd_in); /* with TTY this is only our dup of the master */
	}
}

/* ------------------------------------------------------------------ requests */

typedef struct {
	const char *p;
	uint32_t n;
	int set;
} fv;

typedef struct {
	const char *payload;
	size_t plen;
	fv op, cwd, uid, gid, timeout, limit, in, tty, rows, cols, id, sig, wait, groups;
	int argc, envc;
	size_t argbytes, envbytes;
	int has_nul;
} req;

static int fv_is(const fv *f, const char *s)
{
	return f->set && f->n == strlen(s) && memcmp(f->p, s, f->n) == 0;
}

/* ASCII decimal into *out; absent leaves *out alone. -1 when malformed. */
static int fv_num(const fv *f, uint64_t *out, uint64_t max)
{
	if (!f->set)
		return 0;
	if (f->n == 0 || f->n > 20)
		return -1;
	uint64_t v = 0;
	for (uint32_t i = 0; i < f->n; i++) {
		if (f->p[i] < '0' || f->p[i] > '9')
			return -1;
		uint64_t d = (uint64_t)(f->p[i] - '0');
		if (v > (UINT64_MAX - d) / 10)
			return -1;
		v = v * 10 + d;
	}
	if (v > max)
		return -1;
	*out = v;
	return 0;
}

static int parse_req(const char *p, size_t n, req *r)
{
	memset(r, 0, sizeof *r);
	r->payload = p;
	r->plen = n;
	for (size_t i = 0; i < n;) {
		if (n - i < 5)
			return -1;
		int tag = (unsigned char)p[i];
		uint32_t len = get_be32(p + i + 1);
		i += 5;
		if (len > n - i)
			return -1;
		fv v = {p + i, len, 1};
		i += len;
		switch (tag) {
		case T_OP: r->op = v; break;
		case T_CWD: r->cwd = v; break;
		case T_UID: r->uid = v; break;
		case T_GID: r->gid = v; break;
		case T_TIMEOUT_MS: r->timeout = v; break;
		case T_OUTPUT_LIMIT: r->limit = v; break;
		case T_STDIN: r->in = v; break;
		case T_TTY: r->tty = v; break;
		case T_ROWS: r->rows = v; break;
		case T_COLS: r->cols = v; break;
		case T_ID: r->id = v; break;
		case T_SIGNAL: r->sig = v; break;
		case T_WAIT_MS: r->wait = v; break;
		case T_GROUPS: r->groups = v; break;
		case T_ARG:
		case T_ENV:
			if (memchr(v.p, 0, v.n))
				r->has_nul = 1;
			if (tag == T_ARG) {
				r->argc++;
				r->argbytes += len + 1;
			} else {
				r->envc++;
				r->envbytes += len + 1;
			}
			break;
		default: break; /* unknown tags are ignored */
		}
	}
	return 0;
}

/* A NULL-terminated vector of the repeated field `tag`, in one allocation. */
static char **build_vec(const req *r, int tag, int count, size_t bytes)
{
	char **v = malloc((size_t)(count + 1) * sizeof(char *) + bytes);
	if (!v)
		return NULL;
	char *s = (char *)(v + count + 1);
	int k = 0;
	for (size_t i = 0; i < r->plen;) {
		int t = (unsigned char)r->payload[i];
		uint32_t len = get_be32(r->payload + i + 1);
		const char *val = r->payload + i + 5;
		i += 5 + len;
		if (t != tag)
			continue;
		v[k++] = s;
		memcpy(s, val, len);
		s[len] = 0;
		s += len + 1;
	}
	v[k] = NULL;
	return v;
}

static int parse_groups(const fv *f, gid_t *g, int *ng)
{
	*ng = 0;
	if (!f->set || f->n == 0)
		return 0;
	uint64_t v = 0;
	int digits = 0;
	for (uint32_t i = 0; i <= f->n; i++) {
		if (i == f->n || f->p[i] == ',') {
			if (!digits || *ng >= MAX_GROUPS)
				return -1;
			g[(*ng)++] = (gid_t)v;
			v = 0;
			digits = 0;
		} else if (f->p[i] >= '0' && f->p[i] <= '9' && digits < 10) {
			v = v * 10 + (uint64_t)(f->p[i] - '0');
			digits++;
			if (v > 0xfffffffeu)
				return -1;
		} else {
			return -1;
		}
	}
	return 0;
}

static proc *find_bg(const fv *id)
{
	if (!id->set)
		return NULL;
	for (proc *p = procs; p; p = p->next)
		if (p->bg && !p->dead && strlen(p->id) == id->n && memcmp(p->id, id->p, id->n) == 0)
			return p;
	return NULL;
}

struct child_args {
	char **argv, **envp;
	const char *cwd;
	uid_t uid;
	gid_t gid;
	gid_t *groups;
	int ngroups, tty, fd_in, fd_out, fd_err, ctl;
};

static void __attribute__((noreturn)) child_fail(int ctl, int stage, int err)
{
	int m[2] = {stage, err};
	ssize_t r = write(ctl, m, sizeof m);
	(void)r;
	_exit(stage == ST_EXEC && err == ENOENT ? 127 : 126);
}

static void __attribute__((noreturn)) child_main(const struct child_args *a)
{
	/* nothing of init's signal state may leak: SIGPIPE is ignored and SIGCHLD blocked
	 * here, and ignored dispositions and the mask survive execve */
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = SIG_DFL;
	for (int s = 1; s < NSIG; s++)
		sigaction(s, &sa, NULL);
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);

	/* own session and process group, so that init can kill everything it started */
	if (setsid() < 0)
		child_fail(a->ctl, ST_STDIO, errno);
	if (a->tty) {
		if (ioctl(a->fd_out, TIOCSCTTY, 0) < 0)
			child_fail(a->ctl, ST_TTY, errno);
		/* as login(1) does: the user owns its terminal */
		if (fchown(a->fd_out, a->uid, (gid_t)-1) < 0) {
			/* not fatal: a read-only /dev/pts or a userns without that uid */
		}
	}
	/* init's own 0,1,2 are /dev/null, so none of these fds is already 0-2 and every
	 * dup2 clears CLOEXEC on its target */
	if (dup2(a->fd_in, 0) < 0 || dup2(a->fd_out, 1) < 0 || dup2(a->fd_err, 2) < 0)
		child_fail(a->ctl, ST_STDIO, errno);
	if (setgroups((size_t)a->ngroups, a->groups) < 0) {
		/* a userns with setgroups denied: fine if there is nothing to drop */
		if (a->ngroups > 0 || getgroups(0, NULL) != 0)
			child_fail(a->ctl, ST_GROUPS, errno);
	}
	if (setgid(a->gid) < 0)
		child_fail(a->ctl, ST_GID, errno);
	if (setuid(a->uid) < 0)
		child_fail(a->ctl, ST_UID, errno);
	if (chdir(a->cwd) < 0)
		child_fail(a->ctl, ST_CWD, errno);
	/* glibc's execvpe searches the PATH of `environ`, not of envp: make them one */
	environ = a->envp;
	execvpe(a->argv[0], a->argv, a->envp);
	child_fail(a->ctl, ST_EXEC, errno);
}

/* ------------------------------------------------------------------ landlock
 *
 * Every guest process runs in one landlock domain that PID 1 itself is outside of, scoped
 * (ABI 6+) so that nothing in it can signal or ptrace PID 1, nor connect to an abstract
 * unix socket made outside the domain (by PID 1, the host, another sandbox sharing a
 * network namespace). Landlock restricts a thread, and what it forks inherits the domain:
 * so one thread of PID 1, the spawner, restricts itself once and forks every guest
 * command, while the main thread stays free. One domain for all commands (not one per
 * command): guest processes of different exec calls may still signal each other.
 * The spawner lives only while guest processes do: it starts with the first command and
 * ends once PID 1 has had no child for SPAWNER_IDLE_NS (spawner_idle), which in a pid
 * namespace means no guest process is left at all (nothing joins it from outside). So an
 * idle sandbox is one task (what walks every task on the host, as pivot_root did at each
 * create, walks fewer), and everything alive at the same time still shares one domain; a
 * later command gets a fresh one, which can reach nothing of the ended domain (nothing of
 * it runs; scoping refuses its sockets).
 * The spawner is a thread of the init process, so what it forks are the init's children:
 * the main thread waits for, signals and reaps them exactly as if it had forked them. Without landlock (old kernel,
 * seccomp) the main thread forks, as before. No filesystem access is handled: what
 * must stay intact is read-only already (/.corral/init is a read-only bind). */

#ifndef __NR_landlock_create_ruleset
#define __NR_landlock_create_ruleset 444
#endif
#ifndef __NR_landlock_restrict_self
#define __NR_landlock_restrict_self 446
#endif
#define LL_CREATE_RULESET_VERSION (1U << 0)
#define LL_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0)
#define LL_SCOPE_SIGNAL (1ULL << 1)

struct ll_ruleset_attr {
	uint64_t handled_access_fs, handled_access_net, scoped;
};

static int landlock_abi;        /* the kernel's landlock ABI (0: none) */
static int landlock_on;         /* guest commands run in the scoped domain */
static int spawner_up;          /* the spawner thread is alive, restricted, and serving */
static int spawner_broken;      /* its pipes failed: guest commands fail from now on */
static uint64_t spawner_idle_at; /* the spawner is up and PID 1 had no child left then */
static int spawn_req[2] = {-1, -1}, spawn_rep[2] = {-1, -1};

static void __attribute__((noreturn)) child_main(const struct child_args *a);

struct spawn_reply {
	pid_t pid;
	int err;
};

/* A request is a child_args pointer; NULL asks the spawner to end: it acknowledges with
 * a zero reply and returns, so it never takes a request meant for its successor. */
static void *spawner(void *arg)
{
	int rfd = (int)(intptr_t)arg, ok = syscall(__NR_landlock_restrict_self, rfd, 0) == 0;
	int err = ok ? 0 : errno;
	close(rfd);
	if (write(spawn_rep[1], &err, sizeof err) != sizeof err || !ok)
		return NULL;
	for (;;) {
		const struct child_args *a;
		if (read(spawn_req[0], &a, sizeof a) != sizeof a)
			return NULL;
		struct spawn_reply r = {0, 0};
		if (!a) {
			if (write(spawn_rep[1], &r, sizeof r) != sizeof r)
				abort(); /* the main thread waits for this reply: never leave it hanging */
			return NULL;
		}
		r.pid = fork();
		r.err = errno;
		if (r.pid == 0)
			child_main(a);
		if (write(spawn_rep[1], &r, sizeof r) != sizeof r)
			return NULL;
	}
}

/* Called once before the loop: is there landlock scoping to use? The spawner itself starts
 * with the first guest command (spawner_start), not here: an idle sandbox is one task. */
static void landlock_start(void)
{
	landlock_abi = syscall(__NR_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
	if (landlock_abi < 6) { /* scoping came with ABI 6 (Linux 6.12) */
		if (landlock_abi < 0)
			landlock_abi = 0;
		return;
	}
	if (pipe2(spawn_req, O_CLOEXEC) < 0 || pipe2(spawn_rep, O_CLOEXEC) < 0)
		return;
	landlock_on = 1;
}

/* Start the spawner in a new domain; with SIGCHLD blocked (the spawner inherits that).
 * Returns 0 or an errno: the command then fails, it never runs outside a domain. Only a
 * kernel that refuses the restriction itself (the same answer every time) turns landlock
 * off for good, as when it was tried once at start. */
static int spawner_start(void)
{
	struct ll_ruleset_attr attr = {0, 0, LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL};
	int rfd = syscall(__NR_landlock_create_ruleset, &attr, sizeof attr, 0);
	if (rfd < 0)
		return errno;
	pthread_attr_t ta;
	pthread_t t;
	sigset_t all, old;
	sigfillset(&all);
	pthread_attr_init(&ta);
	pthread_attr_setstacksize(&ta, 256 << 10); /* also the children's until they exec */
	pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
	/* every signal blocked in the spawner: signals aimed at it stay pending there */
	pthread_sigmask(SIG_SETMASK, &all, &old);
	int e = pthread_create(&t, &ta, spawner, (void *)(intptr_t)rfd);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&ta);
	if (e != 0) {
		close(rfd);
		return e;
	}
	int err = -1;
	if (read(spawn_rep[0], &err, sizeof err) != sizeof err) {
		spawner_broken = 1; /* a thread may be left reading: never start a second */
		return EIO;
	}
	if (err != 0) {
		landlock_on = 0;
		return 0;
	}
	spawner_up = 1;
	return 0;
}

/* End the spawner and its domain; the next command gets a new one, shared again by
 * everything alive with it. Only called with no child left (spawner_idle). */
static void spawner_stop(void)
{
	if (!spawner_up)
		return;
	const struct child_args *none = NULL;
	struct spawn_reply r;
	spawner_up = 0;
	if (write(spawn_req[1], &none, sizeof none) != sizeof none ||
	    read(spawn_rep[0], &r, sizeof r) != sizeof r)
		spawner_broken = 1; /* never a command outside a domain, nor two spawners */
}

/* The spawner's end, once SPAWNER_IDLE_NS have passed since PID 1 last had no child
 * (reap_all): then, and still now (waitid: ECHILD, WNOWAIT so no status is taken), no guest
 * process is left in the sandbox's pid namespace (every one descends from PID 1 or was
 * reparented to it; nothing joins it from outside). The delay keeps back-to-back commands
 * from paying a thread and a domain each. Returns the deadline to wake for (0: none). */
static uint64_t spawner_idle(uint64_t now)
{
	if (!spawner_up || !spawner_idle_at)
		return 0;
	uint64_t at = spawner_idle_at + SPAWNER_IDLE_NS;
	if (now < at)
		return at;
	siginfo_t si;
	spawner_idle_at = 0;
	if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) < 0 && errno == ECHILD)
		spawner_stop();
	return 0;
}

/* fork() for a guest command: in the landlock domain when there is one. */
static pid_t spawn_child(const struct child_args *a)
{
	if (spawner_broken) {
		errno = EIO;
		return -1;
	}
	if (landlock_on && !spawner_up) {
		int e = spawner_start();
		if (e != 0) {
			errno = e;
			return -1;
		}
	}
	if (!landlock_on) {
		pid_t pid = fork();
		if (pid == 0)
			child_main(a);
		return pid;
	}
	struct spawn_reply r;
	if (write(spawn_req[1], &a, sizeof a) != sizeof a ||
	    read(spawn_rep[0], &r, sizeof r) != sizeof r) {
		errno = EIO;
		return -1;
	}
	if (r.pid > 0)
		spawner_idle_at = 0;
	else if (!spawner_idle_at)
		spawner_idle_at = now_ns(); /* perhaps no child at all: spawner_idle checks */
	errno = r.err;
	return r.pid;
}

static void op_start(conn *c, req *r, int bg)
{
	uint64_t uid = 0, gid = 0, timeout = 0, limit = DEFAULT_LIMIT, rows = 24, cols = 80;
	int want_in = fv_is(&r->in, "1"), tty = fv_is(&r->tty, "1");
	gid_t groups[MAX_GROUPS];
	int ngroups;

	if (r->argc == 0) {
		conn_error(c, EINVAL, "request has no ARG");
		return;
	}
	if (r->has_nul) {
		conn_error(c, EINVAL, "ARG and ENV values cannot contain NUL bytes");
		return;
	}
	if (fv_num(&r->uid, &uid, 0xfffffffeu) || fv_num(&r->gid, &gid, 0xfffffffeu)) {
		conn_error(c, EINVAL, "UID/GID must be decimal ids below 4294967295");
		return;
	}
	if (fv_num(&r->timeout, &timeout, 1000ull * 86400 * 365) ||
	    fv_num(&r->limit, &limit, UINT64_MAX) || fv_num(&r->rows, &rows, 65535) ||
	    fv_num(&r->cols, &cols, 65535)) {
		conn_error(c, EINVAL, "TIMEOUT_MS, OUTPUT_LIMIT, ROWS and COLS must be decimal");
		return;
	}
	if (parse_groups(&r->groups, groups, &ngroups)) {
		conn_error(c, EINVAL, "GROUPS must be at most %d comma-separated decimal gids",
			   MAX_GROUPS);
		return;
	}
	if (bg && tty) {
		conn_error(c, EINVAL, "spawn does not support TTY");
		return;
	}

	proc *p = calloc(1, sizeof *p);
	char **argv = build_vec(r, T_ARG, r->argc, r->argbytes);
	char **envp = build_vec(r, T_ENV, r->envc, r->envbytes);
	char *cwd = r->cwd.set && r->cwd.n ? strndup(r->cwd.p, r->cwd.n) : strdup("/");
	char *args = malloc(r->argbytes);
	int ctl[2] = {-1, -1}, outp[2] = {-1, -1}, errp[2] = {-1, -1}, inp[2] = {-1, -1};
	int master = -1, slave = -1, err = 0;
	const char *what = "out of memory";

	if (!p || !argv || !envp || !cwd || !args) {
		err = ENOMEM;
		goto fail;
	}
	memcpy(args, (char *)(argv + r->argc + 1), r->argbytes);
	what = "pipe";
	if (pipe2(ctl, O_CLOEXEC) < 0)
		goto fail_errno;
	if (tty) {
		what = "pty";
		master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
		if (master < 0 || grantpt(master) < 0 || unlockpt(master) < 0)
			goto fail_errno;
		/* TIOCGPTPEER opens the slave of this very master, with no path lookup */
		slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
		if (slave < 0) {
			char name[64];
			if (ptsname_r(master, name, sizeof name) != 0)
				goto fail_errno;
			slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
			if (slave < 0)
				goto fail_errno;
		}
		struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
		ioctl(master, TIOCSWINSZ, &ws);
	} else {
		if (pipe2(outp, O_CLOEXEC) < 0 || pipe2(errp, O_CLOEXEC) < 0)
			goto fail_errno;
		if (want_in && pipe2(inp, O_CLOEXEC) < 0)
			goto fail_errno;
	}

	struct child_args a = {
		.argv = argv, .envp = envp, .cwd = cwd, .uid = (uid_t)uid, .gid = (gid_t)gid,
		.groups = groups, .ngroups = ngroups, .tty = tty, .ctl = ctl[1],
		.fd_in = tty ? slave : want_in ? inp[0] : devnull_fd,
		.fd_out = tty ? slave : outp[1], .fd_err = tty ? slave : errp[1],
	};
	what = "fork";
	uint64_t t0 = now_ns();
	pid_t pid = spawn_child(&a);
	if (pid < 0)
		goto fail_errno;

	close(ctl[1]);
	xclose(&slave);
	xclose(&outp[1]);
	xclose(&errp[1]);
	xclose(&inp[0]);
	p->bg = bg;
	p->sess = bg && want_in;
	p->tty = tty;
	p->pid = pid;
	p->t_start = t0;
	p->deadline = timeout ? t0 + timeout * 1000000ull : 0;
	p->limit = limit;
	p->fd_ctl = ctl[0];
	p->fd_out = tty ? master : outp[0];
	p->fd_err = tty ? -1 : errp[0];
	p->fd_in = -1;
	p->fd_pty = -1;
	if (want_in)
		p->fd_in = tty ? fcntl(master, F_DUPFD_CLOEXEC, 3) : inp[1];
	set_nonblock(p->fd_ctl);
	set_nonblock(p->fd_out);
	if (p->fd_err >= 0)
		set_nonblock(p->fd_err);
	if (p->fd_in >= 0 && !tty)
		set_nonblock(p->fd_in);
	p->args = args;
	p->args_len = r->argbytes;
	p->cwd = cwd;
	p->uid = (unsigned)uid;
	p->gid = (unsigned)gid;
	free(argv);
	free(envp);
	p->next = procs;
	procs = p;

	size_t m = fr_begin(&c->out, 'S');
	fr_num(&c->out, T_PID, pid);
	if (bg) {
		snprintf(p->id, sizeof p->id, "p%lu", next_bg_id++);
		fr_str(&c->out, T_ID, p->id);
	}
	fr_end(&c->out, m);
	if (bg) {
		conn_finish(c);
	} else {
		p->c = c;
		c->proc = p;
		c->state = C_EXEC;
		conn_flush(c);
	}
	return;

fail_errno:
	err = errno;
fail:
	xclose(&ctl[0]);
	xclose(&ctl[1]);
	xclose(&outp[0]);
	xclose(&outp[1]);
	xclose(&errp[0]);
	xclose(&errp[1]);
	xclose(&inp[0]);
	xclose(&inp[1]);
	xclose(&master);
	xclose(&slave);
	free(p);
	free(argv);
	free(envp);
	free(cwd);
	free(args);
	conn_error(c, err, "%s: %s", what, strerror(err));
}

static void op_wait(conn *c, req *r)
{
	uint64_t ms = 0;
	proc *p = find_bg(&r->id);
	if (!p) {
		conn_error(c, ESRCH, "no background process %.*s", (int)r->id.n, r->id.p);
		return;
	}
	if (fv_num(&r->wait, &ms, UINT64_MAX / 2000000)) {
		conn_error(c, EINVAL, "WAIT_MS must be decimal");
		return;
	}
	c->proc = p;
	if (p->ended || (r->wait.set && ms == 0)) {
		wait_reply(c);
		return;
	}
	c->state = C_WAIT;
	c->wait_deadline = r->wait.set ? now_ns() + ms * 1000000ull : 0;
}

static void op_signal(conn *c, req *r, int forget)
{
	uint64_t sig = SIGKILL;
	proc *p = find_bg(&r->id);
	if (!p) {
		conn_error(c, ESRCH, "no background process %.*s", (int)r->id.n, r->id.p);
		return;
	}
	if (fv_num(&r->sig, &sig, 64) || sig == 0) {
		conn_error(c, EINVAL, "SIGNAL must be a signal number 1-64");
		return;
	}
	if (forget) {
		if (!p->ended)
			killgrp(p, SIGKILL);
		proc_close_fds(p);
		if (p->c && !p->c->dead)
			conn_error(p->c, ESRCH, "session %s was forgotten", p->id);
		p->c = NULL;
		p->dead = 1;
		for (conn *w = conns; w; w = w->next)
			if (!w->dead && w->state == C_WAIT && w->proc == p)
				conn_error(w, ESRCH, "background process %s was forgotten", p->id);
	} else {
		/* after the leader's exit this still reaches what is left of its group */
		killgrp(p, (int)sig);
	}
	size_t m = fr_begin(&c->out, 'A');
	fr_end(&c->out, m);
	conn_finish(c);
}

/* Attach to a session (a spawn with STDIN): `S`, the output buffered while no client was
 * attached, then the live output; I and K frames reach it as for an exec. Closing the
 * connection only detaches; a newer attach replaces the older client. */
static void op_attach(conn *c, req *r)
{
	proc *p = find_bg(&r->id);
	if (!p) {
		conn_error(c, ESRCH, "no background process %.*s", (int)r->id.n, r->id.p);
		return;
	}
	if (!p->sess) {
		conn_error(c, EINVAL, "background process %s has no stdin to attach to", p->id);
		return;
	}
	c->proc = p;
	if (p->ended) {
		wait_reply(c);
		return;
	}
	if (p->c && !p->c->dead)
		conn_error(p->c, EBUSY, "another client attached to session %s", p->id);
	size_t m = fr_begin(&c->out, 'S');
	fr_num(&c->out, T_PID, p->pid);
	fr_str(&c->out, T_ID, p->id);
	fr_end(&c->out, m);
	put_buffer(&c->out, 'O', &p->ob);
	put_buffer(&c->out, 'E', &p->eb);
	buf_free(&p->ob);
	buf_free(&p->eb);
	p->out_kept = p->err_kept = 0;
	p->out_trunc = p->err_trunc = 0;
	p->c = c;
	c->state = C_ATTACH;
	conn_flush(c);
}

static void handle_request(conn *c, const char *payload, size_t n)
{
	req r;
	if (parse_req(payload, n, &r)) {
		conn_error(c, EPROTO, "malformed fields in Q frame");
		return;
	}
	if (fv_is(&r.op, "exec") || fv_is(&r.op, "spawn")) {
		op_start(c, &r, fv_is(&r.op, "spawn"));
	} else if (fv_is(&r.op, "wait")) {
		op_wait(c, &r);
	} else if (fv_is(&r.op, "attach")) {
		op_attach(c, &r);
	} else if (fv_is(&r.op, "kill")) {
		op_signal(c, &r, 0);
	} else if (fv_is(&r.op, "forget")) {
		op_signal(c, &r, 1);
	} else if (fv_is(&r.op, "list") || fv_is(&r.op, "ping")) {
		if (fv_is(&r.op, "list"))
			for (proc *p = procs; p; p = p->next)
				if (p->bg && !p->dead)
					put_entry(&c->out, p);
		size_t m = fr_begin(&c->out, 'A');
		fr_end(&c->out, m);
		conn_finish(c);
	} else {
		conn_error(c, EINVAL, "unknown OP %.*s", r.op.set ? (int)r.op.n : 6,
			   r.op.set ? r.op.p : "(none)");
	}
}

/* I, K and W frames of a running exec */
static void exec_frame(conn *c, char type, const char *payload, size_t n)
{
	proc *p = c->proc;
	req r;
	if (type == 'I') {
		if (p->fd_in < 0 || p->in_eof)
			return; /* no stdin pipe, or already closed: drop */
		if (n == 0)
			p->in_eof = 1;
		else
			buf_put(&p->ib, payload, n);
		if (p->ib.bad) {
			conn_error(c, ENOMEM, "out of memory for stdin");
			return;
		}
		stdin_flush(p);
		return;
	}
	if (parse_req(payload, n, &r)) {
		conn_error(c, EPROTO, "malformed fields in %c frame", type);
		return;
	}
	if (type == 'K') {
		uint64_t sig = 0;
		if (fv_num(&r.sig, &sig, 64) || sig == 0) {
			conn_error(c, EINVAL, "SIGNAL must be a signal number 1-64");
			return;
		}
		if (!p->ended)
			killgrp(p, (int)sig);
	} else if (type == 'W') {
		uint64_t rows = 0, cols = 0;
		if (fv_num(&r.rows, &rows, 65535) || fv_num(&r.cols, &cols, 65535)) {
			conn_error(c, EINVAL, "ROWS and COLS must be decimal");
			return;
		}
		if (p->tty && p->fd_out >= 0) {
			struct winsize ws = {.ws_row = (unsigned short)rows,
					     .ws_col = (unsigned short)cols};
			ioctl(p->fd_out, TIOCSWINSZ, &ws);
		}
	} else {
		conn_error(c, EPROTO, "unexpected %c frame during exec", type);
	}
}

static void conn_parse(conn *c)
{
	while (!c->dead && (c->state == C_REQ || c->state == C_EXEC || c->state == C_ATTACH)) {
		size_t avail = buf_avail(&c->in);
		if (avail < 5)
			break;
		const char *h = c->in.p + c->in.off;
		uint32_t len = get_be32(h);
		if (len == 0 || len > MAX_FRAME) {
			conn_error(c, EPROTO, "bad frame length %u", len);
			return;
		}
		if (avail - 4 < len) {
			if (buf_reserve(&c->in, len + 4 - avail))
				conn_lost(c);
			break;
		}
		char type = h[4];
		c->in.off += 4 + (size_t)len; /* stays valid: nothing below reallocates c->in */
		if (c->state == C_REQ) {
			if (type == 'Q')
				handle_request(c, h + 5, len - 1);
			else
				conn_error(c, EPROTO, "expected a Q frame, got %c", type);
		} else {
			exec_frame(c, type, h + 5, len - 1);
		}
	}
	if (!c->dead && c->in.off == c->in.len) {
		c->in.off = c->in.len = 0;
		if (c->in.cap > 65536)
			buf_free(&c->in);
	}
}

static void conn_readable(conn *c)
{
	if (buf_reserve(&c->in, 4096)) {
		conn_lost(c);
		return;
	}
	ssize_t n = recv(c->fd, c->in.p + c->in.len, c->in.cap - c->in.len, MSG_DONTWAIT);
	if (n > 0) {
		c->in.len += (size_t)n;
		conn_parse(c);
		return;
	}
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	conn_lost(c); /* EOF or error: the client is gone */
}

static void refuse(int fd, const char *msg)
{
	char b[256];
	size_t n = strlen(msg);
	put_be32(b, (uint32_t)(1 + 5 + n));
	b[4] = 'R';
	b[5] = T_MESSAGE;
	put_be32(b + 6, (uint32_t)n);
	memcpy(b + 10, msg, n);
	ssize_t r = send(fd, b, 10 + n, MSG_NOSIGNAL | MSG_DONTWAIT);
	(void)r;
	/* what the peer already sent is dropped unread, or it would see ECONNRESET */
	while (recv(fd, rdbuf, sizeof rdbuf, MSG_DONTWAIT) > 0)
		;
	close(fd);
}

/* The pid SO_PEERCRED must show for the node: 0 (outside our pid namespace) for a
 * container; our own pid in --vmux mode, where our mux thread is the only peer. */
static pid_t peer_pid;

static void do_accept(void)
{
	for (int i = 0; i < 16; i++) {
		int fd = accept4(LISTEN_FD, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
		if (fd < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
				accept_paused = 1; /* until a connection closes */
			return;
		}
		/* Only the node may talk to us. It lives outside our pid namespace, so the
		 * kernel shows its pid as 0; a process of the sandbox has a pid here. */
		struct ucred cr;
		socklen_t l = sizeof cr;
		if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &l) < 0 || cr.pid != peer_pid) {
			refuse(fd, "corral-init: peer refused");
			continue;
		}
		conn *c = nconns < MAX_CONNS ? calloc(1, sizeof *c) : NULL;
		if (!c) {
			refuse(fd, "corral-init: too many connections");
			continue;
		}
		c->fd = fd;
		c->next = conns;
		conns = c;
		nconns++;
		/* the request is usually there already: save a poll round */
		conn_readable(c);
	}
}

static void reap_all(uint64_t now)
{
	struct signalfd_siginfo si[8];
	while (read(sig_fd, si, sizeof si) > 0)
		;
	for (;;) {
		int st;
		pid_t pid = waitpid(-1, &st, WNOHANG);
		if (pid < 0 && errno == ECHILD && spawner_up && !spawner_idle_at)
			spawner_idle_at = now;
		if (pid <= 0)
			break;
		for (proc *p = procs; p; p = p->next) {
			if (p->pid == pid && !p->reaped && !p->dead) {
				p->reaped = 1;
				p->status = st;
				p->t_exit = now;
				break;
			}
		}
	}
}

static void sweep(void)
{
	for (conn **pc = &conns; *pc;) {
		conn *c = *pc;
		if (!c->dead) {
			pc = &c->next;
			continue;
		}
		*pc = c->next;
		buf_free(&c->in);
		buf_free(&c->out);
		free(c);
		nconns--;
		accept_paused = 0;
	}
	for (proc **pp = &procs; *pp;) {
		proc *p = *pp;
		if (!p->dead) {
			pp = &p->next;
			continue;
		}
		*pp = p->next;
		proc_close_fds(p);
		buf_free(&p->ob);
		buf_free(&p->eb);
		buf_free(&p->ib);
		free(p->args);
		free(p->cwd);
		free(p);
	}
}

/* Idle RSS is what counts when thousands of sandboxes sit on one node: once no request
 * has been running for TRIM_NS, hand the freed heap pages back to the kernel. */
static uint64_t trim_deadline(uint64_t now)
{
	static uint64_t at;
	if (!trim_wanted || conns) {
		at = 0;
		return 0;
	}
	if (!at)
		at = now + TRIM_NS;
	if (now >= at) {
		malloc_trim(0);
		trim_wanted = 0;
		at = 0;
		return 0;
	}
	return at;
}

/* ------------------------------------------------------------------ main loop */

struct slot {
	int kind;
	void *obj;
};

static struct pollfd *pfds;
static struct slot *slots;
static size_t pcap;

static int add_pfd(size_t *n, int fd, short ev, int kind, void *obj)
{
	if (*n == pcap) {
		size_t nc = pcap ? pcap * 2 : 16;
		struct pollfd *a = realloc(pfds, nc * sizeof *a);
		if (!a)
			return -1;
		pfds = a;
		struct slot *s = realloc(slots, nc * sizeof *s);
		if (!s)
			return -1;
		slots = s;
		pcap = nc;
	}
	pfds[*n] = (struct pollfd){.fd = fd, .events = ev};
	slots[*n] = (struct slot){kind, obj};
	(*n)++;
	return 0;
}

static void loop(void)
{
	for (;;) {
		size_t n = 0;
		uint64_t now = now_ns(), next = 0;

		if (!accept_paused)
			add_pfd(&n, LISTEN_FD, POLLIN, K_LISTEN, NULL);
		add_pfd(&n, sig_fd, POLLIN, K_SIG, NULL);
		for (conn *c = conns; c; c = c->next) {
			short ev = buf_avail(&c->out) ? POLLOUT : 0;
			if (c->state == C_REQ)
				ev |= POLLIN;
			/* stdin backpressure: do not read more while the child is not reading */
			if ((c->state == C_EXEC || c->state == C_ATTACH) &&
			    (!c->proc || buf_avail(&c->proc->ib) < HIGH_WATER))
				ev |= POLLIN;
			/* events 0 still reports POLLHUP: a waiting client that leaves is noticed */
			add_pfd(&n, c->fd, ev, K_CONN, c);
			if (c->state == C_WAIT && c->wait_deadline && (!next || c->wait_deadline < next))
				next = c->wait_deadline;
		}
		for (proc *p = procs; p; p = p->next) {
			/* output backpressure: a slow client pauses the child, unless the stream is
			 * over its limit anyway and only counted */
			int slow = p->c && buf_avail(&p->c->out) >= HIGH_WATER;
			if (p->fd_out >= 0 && (!slow || p->out_trunc))
				add_pfd(&n, p->fd_out, POLLIN, K_OUT, p);
			if (p->fd_err >= 0 && (!slow || p->err_trunc))
				add_pfd(&n, p->fd_err, POLLIN, K_ERR, p);
			if (p->fd_ctl >= 0)
				add_pfd(&n, p->fd_ctl, POLLIN, K_CTL, p);
			if (p->fd_in >= 0 && buf_avail(&p->ib))
				add_pfd(&n, p->fd_in, POLLOUT, K_IN, p);
			uint64_t d = 0;
			if (!p->reaped && p->deadline)
				d = p->deadline;
			else if (p->reaped && !p->ended)
				d = p->t_exit + DRAIN_NS;
			if (d && (!next || d < next))
				next = d;
		}
		uint64_t t = trim_deadline(now);
		if (t && (!next || t < next))
			next = t;
		t = spawner_idle(now);
		if (t && (!next || t < next))
			next = t;
		int timeout = -1;
		if (next) {
			uint64_t ms = next <= now ? 0 : (next - now + 999999) / 1000000;
			timeout = ms > 3600000 ? 3600000 : (int)ms; /* far deadlines: wake, recompute */
		}

		int r = poll(pfds, n, timeout);
		if (r < 0 && errno != EINTR) {
			struct timespec ts = {0, 10000000}; /* ENOMEM: try again shortly */
			nanosleep(&ts, NULL);
		}
		now = now_ns();
		for (size_t i = 0; r > 0 && i < n; i++) {
			short re = pfds[i].revents;
			if (!re)
				continue;
			struct slot s = slots[i];
			if (s.kind == K_LISTEN) {
				do_accept();
			} else if (s.kind == K_SIG) {
				reap_all(now);
			} else if (s.kind == K_CONN) {
				conn *c = s.obj;
				if (c->dead || c->fd != pfds[i].fd)
					continue;
				if (re & POLLOUT)
					conn_flush(c);
				if (c->dead)
					continue;
				if (re & POLLIN)
					conn_readable(c);
				else if (re & (POLLHUP | POLLERR))
					conn_lost(c);
			} else {
				proc *p = s.obj;
				if (p->dead)
					continue;
				int fd = s.kind == K_OUT ? p->fd_out : s.kind == K_ERR ? p->fd_err
					 : s.kind == K_CTL ? p->fd_ctl : p->fd_in;
				if (fd != pfds[i].fd)
					continue;
				if (s.kind == K_IN)
					stdin_flush(p);
				else
					proc_read(p, s.kind);
			}
		}
		for (proc *p = procs; p; p = p->next) {
			if (p->dead)
				continue;
			if (!p->reaped && p->deadline && now >= p->deadline) {
				p->deadline = 0;
				if (p->reason == RS_NONE)
					p->reason = RS_TIMEOUT;
				killgrp(p, SIGKILL);
			}
			proc_check(p, now);
		}
		for (conn *c = conns; c; c = c->next)
			if (!c->dead && c->state == C_WAIT && c->wait_deadline && now >= c->wait_deadline)
				wait_reply(c);
		sweep();
	}
}

/* ------------------------------------------------------------------ --vmux (microVMs)
 * In a microVM the node reaches us over one virtio-serial port, not a unix socket per
 * request. The mux thread (outside the landlock domain, like the main thread) carries
 * many logical connections over that port and turns each into a real connection to our
 * own listening socket (abstract, autobound; only peers with our own pid are accepted),
 * so the one-request-per-connection protocol above stays exactly as it is.
 * Port framing, both directions: u32 channel (BE) · u8 kind · u32 length (BE) · payload.
 * Kinds: 'o' open (node -> init), 'd' data, 'c' close (that side closed its connection),
 * 'r' reset (node -> init: a new node connection; every channel is closed).
 * Documented in docs/init-protocol.md ("microVMs"). */
#define VMUX_MAX_CHANS 1024
#define VMUX_MAX_PENDING (64u << 20)

struct vchan {
	uint32_t id;
	int fd;
	char *pend; /* bytes for the init not written yet */
	size_t plen, pcap;
	struct vchan *next;
};

static int vmux_dev = -1;
static struct sockaddr_un vmux_addr;
static socklen_t vmux_addrlen;

static int vmux_write_all(const void *p, size_t n)
{
	const char *b = p;
	while (n) {
		ssize_t w = write(vmux_dev, b, n);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN) {
				struct pollfd pf = {vmux_dev, POLLOUT, 0};
				poll(&pf, 1, 100);
				continue;
			}
			return -1;
		}
		b += w;
		n -= (size_t)w;
	}
	return 0;
}

static int vmux_send(uint32_t id, char kind, const void *p, uint32_t n)
{
	unsigned char h[9] = {id >> 24, id >> 16, id >> 8, id, (unsigned char)kind,
			      n >> 24, n >> 16, n >> 8, n};
	if (vmux_write_all(h, 9) < 0)
		return -1;
	return n ? vmux_write_all(p, n) : 0;
}

static void vchan_free(struct vchan **list, struct vchan *c)
{
	for (struct vchan **pp = list; *pp; pp = &(*pp)->next)
		if (*pp == c) {
			*pp = c->next;
			break;
		}
	close(c->fd);
	free(c->pend);
	free(c);
}

static void vchan_flush(struct vchan **list, struct vchan *c)
{
	while (c->plen) {
		ssize_t w = send(c->fd, c->pend, c->plen, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			if (errno != EAGAIN) {
				vmux_send(c->id, 'c', NULL, 0);
				vchan_free(list, c);
			}
			return;
		}
		memmove(c->pend, c->pend + w, c->plen - (size_t)w);
		c->plen -= (size_t)w;
	}
}

static void *vmux_thread(void *arg)
{
	(void)arg;
	struct vchan *chans = NULL;
	size_t nchans = 0;
	static unsigned char in[1 << 17], rd[CHUNK];
	size_t inlen = 0;
	struct pollfd *pf = NULL;
	struct vchan **who = NULL;
	size_t cap = 0;
	for (;;) {
		if (cap < nchans + 1) {
			cap = (nchans + 1) * 2;
			pf = realloc(pf, cap * sizeof *pf);
			who = realloc(who, cap * sizeof *who);
			if (!pf || !who)
				abort();
		}
		size_t n = 0;
		pf[n++] = (struct pollfd){vmux_dev, POLLIN, 0};
		for (struct vchan *c = chans; c; c = c->next) {
			who[n] = c;
			pf[n++] = (struct pollfd){c->fd, (short)(POLLIN | (c->plen ? POLLOUT : 0)), 0};
		}
		if (poll(pf, n, -1) < 0)
			continue;
		for (size_t i = 1; i < n; i++) {
			struct vchan *c = who[i];
			if (!pf[i].revents)
				continue;
			if (pf[i].revents & POLLOUT)
				vchan_flush(&chans, c);
			/* c may be gone: look it up again */
			int alive = 0;
			for (struct vchan *d = chans; d; d = d->next)
				alive |= d == c;
			if (!alive)
				continue;
			if (pf[i].revents & (POLLIN | POLLHUP | POLLERR)) {
				ssize_t r = recv(c->fd, rd, sizeof rd, MSG_DONTWAIT);
				if (r > 0) {
					vmux_send(c->id, 'd', rd, (uint32_t)r);
				} else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
					vmux_send(c->id, 'c', NULL, 0);
					vchan_free(&chans, c);
					nchans--;
				}
			}
		}
		if (!pf[0].revents)
			continue;
		ssize_t r = read(vmux_dev, in + inlen, sizeof in - inlen);
		if (r <= 0) {
			if (r < 0 && (errno == EINTR || errno == EAGAIN))
				continue;
			/* the node is not connected (the port reads EOF and polls as hung up until
			 * it is): its connections are gone; look again in 20 ms */
			while (chans) {
				vchan_free(&chans, chans);
				nchans--;
			}
			inlen = 0;
			struct timespec ts = {0, 20000000};
			nanosleep(&ts, NULL);
			continue;
		}
		inlen += (size_t)r;
		size_t off = 0;
		while (inlen - off >= 9) {
			unsigned char *h = in + off;
			uint32_t id = (uint32_t)h[0] << 24 | h[1] << 16 | h[2] << 8 | h[3];
			uint32_t len = (uint32_t)h[5] << 24 | h[6] << 16 | h[7] << 8 | h[8];
			char kind = (char)h[4];
			if (len > sizeof in - 9) { /* the node never sends that: resync by reset */
				inlen = off = 0;
				break;
			}
			if (inlen - off < 9 + (size_t)len)
				break;
			unsigned char *p = h + 9;
			off += 9 + len;
			struct vchan *c = NULL;
			for (struct vchan *d = chans; d; d = d->next)
				if (d->id == id)
					c = d;
			if (kind == 'r') {
				while (chans) {
					vchan_free(&chans, chans);
					nchans--;
				}
			} else if (kind == 'o' && !c) {
				int fd = nchans < VMUX_MAX_CHANS
						 ? socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0) : -1;
				if (fd < 0 || connect(fd, (struct sockaddr *)&vmux_addr, vmux_addrlen) < 0) {
					if (fd >= 0)
						close(fd);
					vmux_send(id, 'c', NULL, 0);
					continue;
				}
				c = calloc(1, sizeof *c);
				if (!c) {
					close(fd);
					vmux_send(id, 'c', NULL, 0);
					continue;
				}
				c->id = id;
				c->fd = fd;
				c->next = chans;
				chans = c;
				nchans++;
			} else if (kind == 'd' && c) {
				if (c->plen + len > VMUX_MAX_PENDING) {
					vmux_send(id, 'c', NULL, 0);
					vchan_free(&chans, c);
					nchans--;
					continue;
				}
				if (c->plen + len > c->pcap) {
					size_t nc = (c->plen + len) * 2;
					char *b = realloc(c->pend, nc);
					if (!b)
						abort();
					c->pend = b;
					c->pcap = nc;
				}
				memcpy(c->pend + c->plen, p, len);
				c->plen += len;
				vchan_flush(&chans, c);
			} else if (kind == 'c' && c) {
				vchan_free(&chans, c);
				nchans--;
			}
		}
		memmove(in, in + off, inlen - off);
		inlen -= off;
	}
	return NULL;
}

/* Make fd 3 our own listening socket and start the mux thread on the serial port. */
static int vmux_start(const char *dev)
{
	int d = open(dev, O_RDWR | O_CLOEXEC);
	/* above fd 3, which becomes the listening socket */
	vmux_dev = d < 0 ? -1 : fcntl(d, F_DUPFD_CLOEXEC, 10);
	if (d >= 0)
		close(d);
	if (vmux_dev < 0) {
		fprintf(stderr, "corral-init: --vmux %s: %s\n", dev, strerror(errno));
		return -1;
	}
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	/* bind with no name: the kernel autobinds a fresh abstract name */
	if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof(sa_family_t)) < 0 || listen(s, 64) < 0) {
		fprintf(stderr, "corral-init: vmux socket: %s\n", strerror(errno));
		return -1;
	}
	vmux_addrlen = sizeof vmux_addr;
	if (getsockname(s, (struct sockaddr *)&vmux_addr, &vmux_addrlen) < 0)
		return -1;
	if (s != LISTEN_FD) {
		if (dup2(s, LISTEN_FD) < 0)
			return -1;
		close(s);
	}
	peer_pid = getpid();
	pthread_t t;
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old); /* signals stay with the main thread */
	int e = pthread_create(&t, NULL, vmux_thread, NULL);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (e) {
		fprintf(stderr, "corral-init: vmux thread: %s\n", strerror(e));
		return -1;
	}
	return 0;
}

static int check_listen_fd(void)
{
	int v = 0;
	socklen_t l = sizeof v;
	if (getsockopt(LISTEN_FD, SOL_SOCKET, SO_DOMAIN, &v, &l) < 0 || v != AF_UNIX)
		return -1;
	l = sizeof v;
	if (getsockopt(LISTEN_FD, SOL_SOCKET, SO_TYPE, &v, &l) < 0 || v != SOCK_STREAM)
		return -1;
	l = sizeof v;
	if (getsockopt(LISTEN_FD, SOL_SOCKET, SO_ACCEPTCONN, &v, &l) < 0 || !v)
		return -1;
	return 0;
}

int main(int argc, char **argv)
{
	const char *vmux = NULL;
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--version") == 0) {
			puts(VERSION);
			return 0;
		}
		if (strcmp(argv[i], "--vmux") == 0 && i + 1 < argc) {
			vmux = argv[++i];
			continue;
		}
		fprintf(stderr, "usage: corral-init [--version] [--vmux SERIAL-PORT]\n"
				"  runs as PID 1 with a listening unix socket as fd 3, or (--vmux)\n"
				"  serving the node over a virtio-serial port (microVMs)\n");
		return 2;
	}
	if (vmux) {
		/* fds above 2 the kernel or the initramfs left us go first: fd 3 becomes ours */
		close_range(3, ~0u, 0);
		if (vmux_start(vmux) < 0)
			return 1;
	} else if (check_listen_fd() < 0) {
		fprintf(stderr, "corral-init: fd 3 is not a listening unix stream socket "
				"(start it with runc run --preserve-fds 1)\n");
		return 1;
	}
	/* /proc/1 of a non-dumpable process is root-owned and closed to ptrace, so the
	 * guest cannot reach our fds (fd 3 is the control socket) through /proc/1/fd */
	prctl(PR_SET_DUMPABLE, 0);
	/* outside a pid namespace (tests, debugging) orphans still come to us */
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	/* nothing of ours may reach a child: only 0-3 are expected, 3 becomes CLOEXEC */
	if (!vmux)
		close_range(LISTEN_FD + 1, ~0u, 0);
	fcntl(LISTEN_FD, F_SETFD, FD_CLOEXEC);
	set_nonblock(LISTEN_FD);

	/* our stdio is /dev/null: whatever the runtime gave us (a log file shows its host
	 * path in /proc/1/fd) goes away. If /dev/null is missing, an empty pipe stands in. */
	devnull_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (devnull_fd < 0) {
		int pp[2];
		if (pipe2(pp, O_CLOEXEC) == 0) {
			close(pp[1]);
			devnull_fd = pp[0];
		}
	}
	if (devnull_fd < 0) {
		fprintf(stderr, "corral-init: cannot open /dev/null: %s\n", strerror(errno));
		return 1;
	}
	for (int fd = 0; fd <= 2; fd++)
		dup2(devnull_fd, fd);

	signal(SIGPIPE, SIG_IGN);
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGCHLD);
	sigprocmask(SIG_BLOCK, &set, NULL);
	sig_fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
	if (sig_fd < 0)
		return 1;
	landlock_start();
	loop();
	return 0;
}
