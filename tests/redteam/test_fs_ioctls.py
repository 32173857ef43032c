"""Filesystem ioctls that share or swap extents, set inode flags or freeze a filesystem.

Every one must be refused by the seccomp filter (EPERM) whatever the filesystem would
answer; the probe also tries each command with the upper 32 bits set (the kernel reads a
32-bit command, a 64-bit comparison would miss it).
"""

from __future__ import annotations

import pytest

from tests.redteam.conftest import out, probe_results, run, upload_probe

PROBE = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

static void io(const char *name, int fd, unsigned long cmd, void *arg) {
    long r = syscall(SYS_ioctl, fd, cmd, arg);
    printf("%s %d\n", name, r < 0 ? errno : 0);
    r = syscall(SYS_ioctl, fd, cmd | 0xdead000000000000UL, arg);
    printf("%s_hi %d\n", name, r < 0 ? errno : 0);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* a file in the writable layer and one only in the image layer (read-only lower) */
    int a = open("/tmp/a", O_RDWR | O_CREAT | O_TRUNC, 0600);
    int b = open("/tmp/b", O_RDWR | O_CREAT | O_TRUNC, 0600);
    int lower = open("/etc/passwd", O_RDONLY);
    write(a, "0123456789abcdef", 16);
    static char range[64], dedupe[128];
    long flags = 0x10; /* FS_IMMUTABLE_FL */
    io("FICLONE", b, 0x40049409, (void *)(long)lower);
    io("FICLONERANGE", b, 0x4020940d, range);
    io("FIDEDUPERANGE", a, 0xc0189436, dedupe);
    io("FS_IOC_SETFLAGS", a, 0x40086602, &flags);
    io("FS_IOC32_SETFLAGS", a, 0x40046602, &flags);
    io("FS_IOC_FSSETXATTR", a, 0x401c5820, range);
    io("FIFREEZE", a, 0xc0045877, 0);
    io("FITHAW", a, 0xc0045878, 0);
    io("XFS_IOC_SWAPEXT", a, 0xc0c0586d, range);
    io("BLKGETSIZE64", a, 0x80081272, range);
    io("BLKDISCARD", a, 0x1277, range);
    io("BTRFS_IOC_SNAP_CREATE", a, 0x50009401, range);
    io("BTRFS_IOC_DEFRAG", a, 0x50009402, 0);
    /* control: harmless ioctls still work (or fail in the filesystem, not with EPERM) */
    int n = 0;
    io("FIONREAD", a, 0x541b, &n);
    return 0;
}
"""

EPERM, ENOTTY = 1, 25


@pytest.mark.logs("seccomp", syscall="ioctl", what="FICLONE")
@pytest.mark.logs("seccomp", syscall="ioctl", what="XFS_IOC_SWAPEXT")
async def test_fs_ioctls_refused(guest):  # type: ignore[no-untyped-def]
    await upload_probe(guest, PROBE)
    r = await run(guest, "/tmp/probe")
    got = probe_results(r)
    control = {k: got.pop(k) for k in ("FIONREAD", "FIONREAD_hi")}
    assert control["FIONREAD"] == 0, out(r)
    not_eperm = {k: v for k, v in got.items() if v != EPERM}
    assert not not_eperm, f"refused by something other than seccomp, or allowed: {not_eperm}"
    r = await run(guest, "lsattr /tmp/a 2>&1; chattr +i /tmp/a; echo rc=$?; rm /tmp/a && echo gone")
    assert b"gone" in r.stdout, out(r)
    # every refused command is in the event log, the upper-32-bit variants under the same
    # command (the kernel and the log see only the low 32 bits)
    logged = {e.detail["arg"] for e in await guest.events() if e.detail.get("syscall") == "ioctl"}
    refused = {f"{int(c, 16):#x}" for c in _PROBED.values()}
    assert refused <= logged, f"refused but not logged: {refused - logged}"


_PROBED = {
    "FICLONE": "40049409", "FICLONERANGE": "4020940d", "FIDEDUPERANGE": "c0189436",
    "FS_IOC_SETFLAGS": "40086602", "FS_IOC32_SETFLAGS": "40046602",
    "FS_IOC_FSSETXATTR": "401c5820", "FIFREEZE": "c0045877", "FITHAW": "c0045878",
    "XFS_IOC_SWAPEXT": "c0c0586d", "BLKGETSIZE64": "80081272", "BLKDISCARD": "1277",
    "BTRFS_IOC_SNAP_CREATE": "50009401", "BTRFS_IOC_DEFRAG": "50009402",
}  # fmt: skip
