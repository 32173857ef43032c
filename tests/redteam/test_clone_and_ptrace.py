"""New namespaces through clone(2) itself (not unshare), clone3, and ptrace/process_vm of
PID 1 and of a sibling: refused, and each refusal logged with the call and its flags."""

from __future__ import annotations

import pytest

from tests.redteam.conftest import probe_results, run, upload_probe

PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static void rc(const char *label, long r) { printf("%s %d\n", label, r < 0 ? errno : 0); }

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* raw clone with namespace flags: the child would exit at once if it were created */
    long r = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (r == 0) _exit(0);
    rc("clone_newuser", r);
    r = syscall(SYS_clone, CLONE_NEWNS | CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0);
    if (r == 0) _exit(0);
    rc("clone_newns_newpid", r);
    /* clone3 passes its flags in memory: answered ENOSYS, so libc falls back to clone */
    rc("clone3", syscall(SYS_clone3, 0, 0));
    rc("ptrace_attach_init", syscall(SYS_ptrace, PTRACE_ATTACH, 1, 0, 0));
    pid_t kid = fork();
    if (kid == 0) { pause(); _exit(0); }
    rc("ptrace_seize_sibling", syscall(SYS_ptrace, PTRACE_SEIZE, kid, 0, 0));
    char buf[16]; struct iovec l = {buf, sizeof buf}, rv = {(void *)0x400000, sizeof buf};
    rc("process_vm_readv_init", syscall(SYS_process_vm_readv, 1, &l, 1, &rv, 1, 0));
    rc("process_vm_writev_init", syscall(SYS_process_vm_writev, 1, &l, 1, &rv, 1, 0));
    rc("kcmp", syscall(SYS_kcmp, 1, kid, 0, 0, 0));
    rc("setns", syscall(SYS_setns, 0, CLONE_NEWNET));
    kill(kid, SIGKILL); waitpid(kid, 0, 0);
    rc("traceme", syscall(SYS_ptrace, PTRACE_TRACEME, 0, 0, 0));
    return 0;
}
"""

EPERM, ENOSYS = 1, 38


@pytest.mark.logs("seccomp", syscall="clone", arg="0x10000011")
@pytest.mark.logs("seccomp", syscall="ptrace")
async def test_clone_namespaces_and_ptrace_refused(guest):  # type: ignore[no-untyped-def]
    await upload_probe(guest, PROBE)
    got = probe_results(await run(guest, "/tmp/probe"))
    assert got.pop("clone3") == ENOSYS
    assert got == dict.fromkeys(got, EPERM), got
    logged = {e.detail["syscall"] for e in await guest.events() if e.kind == "seccomp"}
    want = {"clone", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "setns"}
    assert want <= logged, f"refused but not logged: {want - logged}"
