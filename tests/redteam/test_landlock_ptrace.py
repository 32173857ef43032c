"""ptrace of PID 1 and reads of its memory and fds: refused to root in the guest.

Three layers refuse it: PID 1 is non-dumpable, the guest has no CAP_SYS_PTRACE, and guest
commands run in a landlock domain PID 1 is outside of (landlock refuses ptrace, and the
ptrace-mode checks of /proc/1/mem, /proc/1/fd, /proc/1/environ, across domains).
"""

from __future__ import annotations

from tests.redteam.conftest import out, probe_results, run, upload_probe

PROBE = r"""
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ptrace.h>
#include <sys/uio.h>
#include <unistd.h>

static void report(const char *name, long r) { printf("%s %d\n", name, r < 0 ? errno : 0); }

int main(void)
{
	DIR *d = opendir("/proc/1/task");
	struct dirent *e;
	char name[64], buf[16];
	while (d && (e = readdir(d))) {
		if (e->d_name[0] == '.')
			continue;
		int tid = atoi(e->d_name);
		snprintf(name, sizeof name, "attach-%d", tid);
		report(name, ptrace(PTRACE_ATTACH, tid, 0, 0));
		snprintf(name, sizeof name, "seize-%d", tid);
		report(name, ptrace(PTRACE_SEIZE, tid, 0, 0));
	}
	struct iovec local = {buf, sizeof buf}, remote = {(void *)0x400000, sizeof buf};
	report("process_vm_readv", process_vm_readv(1, &local, 1, &remote, 1, 0));
	report("open-mem", open("/proc/1/mem", O_RDONLY));
	report("open-environ", open("/proc/1/environ", O_RDONLY));
	report("readlink-fd3", readlink("/proc/1/fd/3", buf, sizeof buf));
	report("open-fd3", open("/proc/1/fd/3", O_RDWR));
	report("open-task-fd3", open("/proc/1/task/1/fd/3", O_RDWR));
	return 0;
}
"""


async def test_guest_cannot_ptrace_pid1(guest):  # type: ignore[no-untyped-def]
    path = await upload_probe(guest, PROBE)
    r = await run(guest, path)
    results = probe_results(r)
    assert results and sum(k.startswith("attach-") for k in results) >= 1, out(r)
    allowed = {k: v for k, v in results.items() if v == 0}
    assert not allowed, f"reached PID 1: {allowed}; {out(r)}"
    r2 = await run(guest, "echo alive")
    assert r2.stdout == b"alive\n", out(r2)
