"""The guest installs a seccomp filter of its own with a notification listener, hoping to
receive the notifications of calls corral refuses and answer them CONTINUE (run the call).

Filters stack and, among equal actions, the newest filter's listener would be asked. The
profile refuses seccomp(2) with SECCOMP_FILTER_FLAG_NEW_LISTENER (EPERM, logged), and the
kernel would refuse it anyway while corral's own listener is open (one per filter chain);
io_uring_setup stays refused and logged. test_seccomp_after_restart tries the same when
corral's listener is gone.
"""

from __future__ import annotations

import pytest

from tests.redteam.conftest import probe_results, run, upload_probe

PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    long nfd = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
    printf("own_listener %d\n", nfd < 0 ? errno : 0);
    if (nfd >= 0) {  /* it worked: try to let the refused call through */
        pid_t kid = fork();
        if (kid == 0) {
            char p[120] = {0};
            _exit(syscall(SYS_io_uring_setup, 1, p) < 0 ? errno : 0);
        }
        struct seccomp_notif req; struct seccomp_notif_resp resp;
        memset(&req, 0, sizeof req); memset(&resp, 0, sizeof resp);
        if (ioctl(nfd, SECCOMP_IOCTL_NOTIF_RECV, &req) == 0) {
            resp.id = req.id; resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
            ioctl(nfd, SECCOMP_IOCTL_NOTIF_SEND, &resp);
        }
        int st; waitpid(kid, &st, 0);
        printf("io_uring_setup %d\n", WEXITSTATUS(st));
        return 0;
    }
    char p[120] = {0};
    printf("io_uring_setup %d\n", syscall(SYS_io_uring_setup, 1, p) < 0 ? errno : 0);
    return 0;
}
"""

EPERM = 1


@pytest.mark.logs("seccomp", syscall="io_uring_setup")
@pytest.mark.logs("seccomp", syscall="seccomp")
async def test_guest_cannot_answer_refused_calls(guest):  # type: ignore[no-untyped-def]
    await upload_probe(guest, PROBE)
    got = probe_results(await run(guest, "timeout 20 /tmp/probe", timeout=30))
    assert got == {"own_listener": EPERM, "io_uring_setup": EPERM}, got
