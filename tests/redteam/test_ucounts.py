"""Per-user kernel counters shared through the user namespace chain.

Objects a guest creates in its user namespace are also charged to the *owner* of that
namespace in the parent one (kernel/ucount.c). Were that host root (as when the runtime
creates the namespace), guests together could use up host root's allowance, and with it
every neighbour's; corral makes each sandbox's namespace owned by a host uid of its own
(corral.host.owners), so a guest exhausts only its own budget. The attacks:

* inotify instances (fs.inotify.max_user_instances, global): then every root process on
  the host (the node, systemd) and every other sandbox fails inotify_init with EMFILE;
  the same holds for inotify watches (fs.inotify.max_user_watches; not tested here).
* POSIX message queue bytes (RLIMIT_MSGQUEUE of the process that created the namespace,
  i.e. the node's): then mq_open fails in every other sandbox, for as long as the
  guest's queues exist (its lifetime: they outlive its processes).
* pending real-time signals (RLIMIT_SIGPENDING of host root): then sigqueue() and
  timer_create() fail with EAGAIN for host root and every other sandbox.

Each test holds the resource for well under a second of host time, then releases it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import time

import pytest

from tests.redteam.conftest import out, run

HOLD = r"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < 4096:
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0: break
    fds.append(fd)
print("held", len(fds), ctypes.get_errno() if len(fds) < 4096 else 0, flush=True)
open("/tmp/held", "w").write(str(len(fds)))
time.sleep(LINGER)
"""


def _host_inotify_works() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        return False
    os.close(fd)
    return True


async def test_guest_cannot_exhaust_host_inotify(guest, neighbour):  # type: ignore[no-untyped-def]
    assert _host_inotify_works()
    await guest.files.write("/tmp/hold.py", HOLD.replace("LINGER", "3"))
    proc = await guest.spawn(["python3", "/tmp/hold.py"])
    try:
        for _ in range(100):
            if await guest.files.exists("/tmp/held"):
                break
            await asyncio.sleep(0.05)
        held = int(await guest.files.read("/tmp/held"))
        host_ok = _host_inotify_works()
        r = await run(
            neighbour,
            "python3 -c 'import ctypes,os; l=ctypes.CDLL(None); print(l.inotify_init1(0))'",
        )
        neighbour_ok = r.stdout.strip() not in (b"-1", b"")
    finally:
        await proc.kill()
    # released with the guest's process, once it is gone (a generous 30 s at most)
    deadline = time.monotonic() + 30
    while not _host_inotify_works() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _host_inotify_works()
    assert host_ok and neighbour_ok, (
        f"guest held {held} inotify instances; host root inotify_init works: {host_ok}; "
        f"neighbour's works: {neighbour_ok}; {out(r)}"
    )


MQ = r"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.restype = ctypes.c_int
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
n = 0
while n < 1000:
    a = Attr(0, 10, 8192, 0)
    fd = libc.mq_open(b"/red%d" % n, os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(a))
    if fd < 0: break
    n += 1
print("queues", n, ctypes.get_errno(), flush=True)
"""
MQ_TRY = MQ.replace("while n < 1000:", "while n < 1:")


async def test_guest_cannot_exhaust_shared_mqueue_budget(guest, neighbour):  # type: ignore[no-untyped-def]
    await guest.files.write("/tmp/mq.py", MQ)
    r = await run(guest, "python3 /tmp/mq.py")
    assert r.stdout.startswith(b"queues"), out(r)
    await neighbour.files.write("/tmp/mq.py", MQ_TRY)
    r2 = await run(neighbour, "python3 /tmp/mq.py")
    assert r2.stdout.split()[1] == b"1", f"guest: {out(r)}; neighbour: {out(r2)}"


SIGQ = r"""
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
class Val(ctypes.Union): _fields_ = [("i", ctypes.c_int), ("p", ctypes.c_void_p)]
sig = signal.SIGRTMIN
signal.pthread_sigmask(signal.SIG_BLOCK, [sig])
n = 0
while n < LIMIT:
    if libc.sigqueue(os.getpid(), sig, Val(0)) != 0: break
    n += 1
print("queued", n, ctypes.get_errno(), flush=True)
if HOLD: open("/tmp/queued", "w").write(str(n)); time.sleep(HOLD)
"""


def _host_sigqueue_works() -> bool:
    """A fresh host-root process can queue one real-time signal to itself."""
    import subprocess
    import sys

    code = SIGQ.replace("LIMIT", "1").replace("HOLD", "0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    return r.stdout.split()[:2] == ["queued", "1"]


async def test_guest_cannot_exhaust_host_sigpending(guest, neighbour):  # type: ignore[no-untyped-def]
    assert _host_sigqueue_works()
    # The guest inherits the node's RLIMIT_SIGPENDING, which is also the budget of host root
    # and of the namespace chain; queueing that many exhausts all of them at once.
    soft = resource.getrlimit(resource.RLIMIT_SIGPENDING)[0]
    if soft == resource.RLIM_INFINITY or soft > 2_000_000:
        pytest.skip(f"RLIMIT_SIGPENDING is {soft}: too large to exhaust in a test")
    limit = soft + 16
    await guest.files.write("/tmp/sigq.py", SIGQ.replace("LIMIT", str(limit)).replace("HOLD", "3"))
    proc = await guest.spawn(["python3", "/tmp/sigq.py"])
    try:
        for _ in range(200):
            if await guest.files.exists("/tmp/queued"):
                break
            await asyncio.sleep(0.05)
        queued = (await guest.files.read("/tmp/queued")).decode()
        host_ok = _host_sigqueue_works()
        await neighbour.files.write("/tmp/sigq.py", SIGQ.replace("LIMIT", "1").replace("HOLD", "0"))
        r = await run(neighbour, "python3 /tmp/sigq.py")
        neighbour_ok = r.stdout.split()[:2] == [b"queued", b"1"]
    finally:
        await proc.kill()
    await proc.wait(timeout=30)
    assert _host_sigqueue_works()
    assert host_ok and neighbour_ok, (
        f"guest queued {queued}; host root sigqueue works: {host_ok}; neighbour: {out(r)}"
    )


async def test_each_sandbox_owns_its_user_namespace(red_node, guest, neighbour):  # type: ignore[no-untyped-def]
    """The layer under the three attacks above: the owner of a sandbox's user namespace
    (whom the kernel charges) is an unprivileged host uid of that sandbox alone."""
    from corral.host.owners import namespace_owner

    owners = []
    for sb in (guest, neighbour):
        pid = (await red_node.sandbox_get(sb.id)).pid
        owners.append(namespace_owner(pid))
    container = red_node.config.backends[0]
    first = red_node.config.owner_first(container)
    assert all(o is not None and first <= o < first + container.owner_uids for o in owners)
    assert owners[0] != owners[1], owners
    # Not a uid the sandboxes map to either: the guest can never become its own owner.
    r = await run(guest, "cat /proc/self/uid_map")
    assert r.stdout.split() == [b"0", str(red_node.config.host_uid).encode(), b"65536"], out(r)
