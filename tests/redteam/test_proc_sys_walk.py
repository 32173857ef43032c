"""The guest reads everything under /proc and /sys; the sensitive files stay closed."""

from __future__ import annotations

import time

from tests.redteam.conftest import assert_healthy, out, run

SENSITIVE = (
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/proc/kcore",
    "/proc/kallsyms",
    "/proc/kmsg",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/slabinfo",
    "/proc/iomem",
    "/proc/cmdline",
    "/sys/kernel/vmcoreinfo",
)
SENSITIVE_DIRS = (
    "/sys/kernel/debug",
    "/sys/kernel/tracing",
    "/sys/kernel/security",
    "/sys/firmware",
    "/sys/fs/bpf",
)


async def test_walk_finishes_and_node_stays_healthy(red_node, guest, neighbour):  # type: ignore[no-untyped-def]
    # Every file but pagemap (a 2^36-entry view of the reader's own address space that no
    # walk finishes): the walk must end by itself, well before the timeout.
    t = time.monotonic()
    r = await run(
        guest,
        "timeout -s KILL 60 grep -r --exclude=pagemap x /proc /sys 2>&1 | wc -l; "
        "echo rc=${PIPESTATUS[0]}",
        timeout=90,
    )
    assert r.reason == "exited" and b"rc=137" not in r.stdout, out(r)
    assert time.monotonic() - t < 90  # generous: the exec's own timeout
    # The literal walk (with pagemap) is stopped by the exec timeout, promptly.
    t = time.monotonic()
    r = await run(guest, "grep -r x /proc /sys >/dev/null 2>&1 | cat", timeout=3)
    assert r.reason in ("timeout", "exited"), out(r)
    assert time.monotonic() - t < 60  # generous: a walk the timeout cannot stop hangs
    await assert_healthy(red_node, guest, neighbour)


async def test_sensitive_files_unreadable(guest):  # type: ignore[no-untyped-def]
    # "readable" = open and read return at least one byte; a /dev/null mask reads nothing
    script = "; ".join(
        f'[ -n "$(head -c 64 {p} 2>/dev/null | od -An -c | head -1)" ] && echo READ {p}'
        for p in SENSITIVE
    )
    script += "; " + "; ".join(
        f'[ -n "$(ls -A {d} 2>/dev/null)" ] && echo LISTED {d}' for d in SENSITIVE_DIRS
    )
    r = await run(guest, script + "; echo checked")
    assert r.stdout == b"checked\n", out(r)
