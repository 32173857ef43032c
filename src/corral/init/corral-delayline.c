/* corral-delayline: the pump of the benches' delay line (corral/bench/delayline.py).
 *
 * Usage: corral-delayline FD_A FD_B DELAY_US
 *
 * FD_A and FD_B are two TUN devices (IFF_TUN | IFF_NO_PI), inherited open. Every packet
 * read from one is written to the other DELAY_US microseconds later (one FIFO per
 * direction: the delay is constant, so order is kept). A packet that finds its queue full
 * (QUEUE_MAX packets) or its device's queue full is dropped, as a congested link would.
 *
 * It prints "ready" on stdout once it runs, ends on SIGTERM, and ends with its parent
 * (PR_SET_PDEATHSIG): a bench killed with -9 cannot end it by pid. Its devices go with it.
 *
 * It replaces a Python pump that spent ~1.6x the CPU per byte on the node's two cores,
 * where a real link costs the node nothing, and rounded its waits up to whole
 * milliseconds. Per packet it costs a read, a write (which runs the receiving side's
 * network stack in this process's context) and a share of a ppoll.
 */
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
#include <time.h>
#include <unistd.h>

#define QUEUE_MAX 8192  /* packets in flight per direction */
#define PKT_MAX 65536

struct pkt {
	int64_t due_ns;
	size_t len;
	char *data;
};

struct queue {
	struct pkt ring[QUEUE_MAX];
	unsigned head, count;
};

static volatile sig_atomic_t stop;

static void on_term(int sig) { (void)sig; stop = 1; }

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int parse_fd(const char *s)
{
	char *end;
	long v = strtol(s, &end, 10);
	if (*s == '\0' || *end != '\0' || v < 0 || v > 1 << 20) {
		fprintf(stderr, "corral-delayline: bad fd %s\n", s);
		exit(2);
	}
	return (int)v;
}

/* Read every packet waiting on src into q, each due at now + delay. */
static void take(int src, struct queue *q, int64_t delay_ns, char *buf)
{
	for (;;) {
		ssize_t n = read(src, buf, PKT_MAX);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN)
				return;
			perror("corral-delayline: read");
			exit(1);
		}
		if (n == 0)
			return;
		if (q->count == QUEUE_MAX)
			continue; /* the line is full: dropped */
		char *copy = malloc((size_t)n);
		if (copy == NULL)
			continue;
		memcpy(copy, buf, (size_t)n);
		struct pkt *p = &q->ring[(q->head + q->count) % QUEUE_MAX];
		p->due_ns = now_ns() + delay_ns;
		p->len = (size_t)n;
		p->data = copy;
		q->count++;
	}
}

/* Write every packet of q that is due to dst. */
static void give(int dst, struct queue *q, int64_t now)
{
	while (q->count > 0 && q->ring[q->head].due_ns <= now) {
		struct pkt *p = &q->ring[q->head];
		ssize_t n;
		do
			n = write(dst, p->data, p->len);
		while (n < 0 && errno == EINTR);
		/* EAGAIN (the device's queue is full) or any other error: dropped. */
		free(p->data);
		q->head = (q->head + 1) % QUEUE_MAX;
		q->count--;
	}
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: corral-delayline FD_A FD_B DELAY_US\n");
		return 2;
	}
	int fd[2] = {parse_fd(argv[1]), parse_fd(argv[2])};
	char *end;
	long long delay_us = strtoll(argv[3], &end, 10);
	if (*argv[3] == '\0' || *end != '\0' || delay_us < 0 || delay_us > 60000000LL) {
		fprintf(stderr, "corral-delayline: bad delay %s (microseconds, 0..60000000)\n",
			argv[3]);
		return 2;
	}
	int64_t delay_ns = (int64_t)delay_us * 1000;
	for (int i = 0; i < 2; i++) {
		int fl = fcntl(fd[i], F_GETFL);
		if (fl < 0 || fcntl(fd[i], F_SETFL, fl | O_NONBLOCK) < 0) {
			perror("corral-delayline: fcntl");
			return 1;
		}
	}
	struct sigaction sa = {.sa_handler = on_term};
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	prctl(PR_SET_PDEATHSIG, SIGTERM);
	if (getppid() == 1)
		return 0; /* the parent is already gone */
	/* q[i]: packets read from fd[i], to be written to fd[1 - i]. */
	struct queue *q = calloc(2, sizeof(struct queue));
	char *buf = malloc(PKT_MAX);
	if (q == NULL || buf == NULL) {
		fprintf(stderr, "corral-delayline: out of memory\n");
		return 1;
	}
	printf("ready\n");
	fflush(stdout);
	while (!stop) {
		int64_t now = now_ns(), next = -1;
		for (int i = 0; i < 2; i++) {
			if (q[i].count > 0) {
				int64_t due = q[i].ring[q[i].head].due_ns;
				if (next < 0 || due < next)
					next = due;
			}
		}
		/* Sleep until a packet arrives or the first queued one is due (ns, not poll's ms:
		 * the benches' delays are fractions of a millisecond). */
		struct pollfd pfd[2] = {{fd[0], POLLIN, 0}, {fd[1], POLLIN, 0}};
		struct timespec ts, *tsp = NULL;
		if (next >= 0) {
			int64_t wait = next <= now ? 0 : next - now;
			ts.tv_sec = wait / 1000000000;
			ts.tv_nsec = wait % 1000000000;
			tsp = &ts;
		}
		int r = ppoll(pfd, 2, tsp, NULL);
		if (r < 0 && errno != EINTR) {
			perror("corral-delayline: ppoll");
			return 1;
		}
		for (int i = 0; i < 2; i++)
			if (r > 0 && (pfd[i].revents & POLLIN))
				take(fd[i], &q[i], delay_ns, buf);
		now = now_ns();
		for (int i = 0; i < 2; i++)
			give(fd[1 - i], &q[i], now);
	}
	return 0;
}
