"""A guest hammers refused system calls from many threads to flood the event log or burn
the node's CPU through its seccomp listener (which answers a sandbox at most
~2000 times a second: beyond that its callers wait in the kernel).

Every call is still refused (EPERM); the event log stays bounded (repeats are coalesced
into a few events with a count), and the neighbour's exec and the node answer meanwhile.
"""

from __future__ import annotations

import time

import pytest

from tests.redteam.conftest import assert_healthy, out, probe_results, run, upload_probe

PROBE = r"""
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CALLS 1000
static long refused[8];
static void *hammer(void *arg) {
    long i = (long)arg;
    for (int n = 0; n < CALLS; n++)
        if (syscall(SYS_bpf, 0, 0, 0) < 0 && errno == EPERM) refused[i]++;
    return 0;
}
int main(void) {
    pthread_t t[8];
    for (long i = 0; i < 8; i++) pthread_create(&t[i], 0, hammer, (void *)i);
    long sum = 0;
    for (int i = 0; i < 8; i++) { pthread_join(t[i], 0); sum += refused[i]; }
    printf("refused %ld\n", sum);
    printf("total %d\n", 8 * CALLS);
    return 0;
}
"""


@pytest.mark.logs("seccomp", syscall="bpf")
async def test_refused_call_flood_is_bounded(red_node, guest, neighbour):  # type: ignore[no-untyped-def]
    await upload_probe(guest, PROBE)
    t = time.monotonic()
    r = await guest.spawn(["/tmp/probe"])
    # the node and the neighbour answer while the flood runs
    for _ in range(5):
        n = await run(neighbour, "echo ok", timeout=30)
        assert n.stdout == b"ok\n", out(n)
    res = probe_results(await r.wait(timeout=120))
    took = time.monotonic() - t
    assert res["refused"] == res["total"] == 8000, res
    evs = [e for e in await guest.events() if e.kind == "seccomp"]
    assert 1 <= len(evs) <= 2 + took / 10, evs  # one at once, then one per window
    await assert_healthy(red_node, guest, neighbour)
    print(f"seccomp flood: 8000 refused calls in {took:.1f}s, {len(evs)} events")
