/* corral-nothp: run a program with transparent huge pages disabled.
 *
 * Usage: corral-nothp PROGRAM [ARGS...]
 *
 * prctl(PR_SET_THP_DISABLE, 1) and then execvp(PROGRAM, ARGS): the flag is kept across
 * exec (and fork), so everything the program maps is backed by 4 KiB pages whatever the
 * host's THP setting. The microVM engine starts QEMU through it under TCG, where huge
 * pages buy the guest nothing and keep its freed memory held (why: the comment above
 * corral.backends.microvm.qemu.trampoline; built by corral.init.ensure_nothp_built). It
 * replaces a Python interpreter started only to make this one call (~6.6 ms of CPU per VM
 * start: docs/design-notes.md).
 *
 * Exit: the program's, or 127 with "corral-nothp: ..." on stderr if the prctl or the exec
 * fails (2 for a missing PROGRAM).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#ifndef PR_SET_THP_DISABLE
#define PR_SET_THP_DISABLE 41
#endif

int main(int argc, char **argv)
{
	if (argc < 2) {
		fputs("usage: corral-nothp PROGRAM [ARGS...]\n", stderr);
		return 2;
	}
	if (prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0) {
		fprintf(stderr, "corral-nothp: prctl(PR_SET_THP_DISABLE): %s\n", strerror(errno));
		return 127;
	}
	execvp(argv[1], argv + 1);
	fprintf(stderr, "corral-nothp: cannot run %s: %s\n", argv[1], strerror(errno));
	return 127;
}
