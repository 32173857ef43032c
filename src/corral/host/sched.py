"""Scheduling class of processes: SCHED_IDLE for best-effort sandboxes, core scheduling probe.

A process in SCHED_IDLE runs only on CPU time nobody else wants. Policies are inherited
across fork and exec, so setting it on a sandbox's init (before any guest command runs)
covers every process the sandbox starts. With RLIMIT_NICE at 0 (soft and hard) the guest
cannot leave SCHED_IDLE: the kernel lets an unprivileged task switch back to SCHED_OTHER
only within RLIMIT_NICE, raising the hard limit needs CAP_SYS_RESOURCE and overriding the
check CAP_SYS_NICE, both in the initial user namespace, which a sandbox never has.

Example::

    set_class(pid, os.SCHED_IDLE, (0, 0))   # SCHED_IDLE + RLIMIT_NICE 0
    policy_of(pid)                 # "idle"
    core_scheduling()              # (False, "prctl(PR_SCHED_CORE): Invalid argument ...")
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import threading

from corral.errors import HostError
from corral.host._sys import errtext, libc

__all__ = ["set_class", "policy_of", "core_scheduling", "bulk_thread", "BULK_NICE"]

_PR_SCHED_CORE = 62
_PR_SCHED_CORE_GET = 0
_PIDTYPE_PID = 0
_NAMES = {
    os.SCHED_OTHER: "other",
    os.SCHED_BATCH: "batch",
    os.SCHED_IDLE: "idle",
    os.SCHED_FIFO: "fifo",
    os.SCHED_RR: "rr",
}


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _set_all(pid: int, policy: int) -> None:
    """Set ``policy`` on every thread of ``pid``, until no new thread shows up.

    The init may be creating its spawner thread while we set the policy: a thread created
    from a not-yet-changed thread inherits the old policy, so list again after each pass.
    """
    done: set[int] = set()
    for _ in range(100):
        new = [t for t in _tids(pid) if t not in done]
        if not new:
            return
        for tid in new:
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except ProcessLookupError:
                pass  # a thread that ended meanwhile
            done.add(tid)


def set_class(pid: int, policy: int, nice_limit: tuple[int, int] | None) -> None:
    """Put every thread of ``pid`` in ``policy`` (``os.SCHED_*``); with ``nice_limit``,
    first pin its RLIMIT_NICE (soft, hard) there (0, 0: it cannot switch back)."""
    try:
        if nice_limit is not None and _nice_limits(pid) != nice_limit:
            # Safe: the caller passes a sandbox's own init; lowering limits harms no one.
            # (Needs CAP_SYS_RESOURCE, which a host's default 0/0 makes unnecessary.)
            resource.prlimit(pid, resource.RLIMIT_NICE, nice_limit)
        _set_all(pid, policy)
    except OSError as e:
        name = _NAMES.get(policy, str(policy))
        raise HostError(f"sched: {name} policy for pid {pid}: {errtext(e.errno or 0)}") from None


def _nice_limits(pid: int) -> tuple[int, int]:
    """(soft, hard) RLIMIT_NICE of ``pid``, from /proc (readable without privileges)."""
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max nice priority"):
                soft, hard = line.split()[3:5]
                return (-1 if soft == "unlimited" else int(soft)), (
                    -1 if hard == "unlimited" else int(hard)
                )
    return -1, -1


def policy_of(pid: int) -> str:
    """``other``, ``batch``, ``idle``, ``fifo`` or ``rr``."""
    return _NAMES.get(os.sched_getscheduler(pid), "unknown")


BULK_NICE = 19
"""Nice of the node's threads that move a sandbox's bulk output (see :func:`bulk_thread`)."""


def bulk_thread() -> None:
    """Lower the calling thread to nice :data:`BULK_NICE` (a thread pool's initializer).

    For the node's threads that copy and encode a sandbox's big outputs: under a flood they
    yield the CPU to the event loop, the probes' and the other sandboxes' work, instead of
    taking an equal share of it. Linux's nice is per thread (``setpriority`` on a thread
    id), so the loop's own thread keeps its priority. Nice, not SCHED_IDLE: these threads
    take the GIL between their reads, and a thread that holds it while waiting for a CPU
    holds up the loop; a nice-19 thread still runs ahead of every SCHED_IDLE task (the
    best-effort sandboxes, the flooding one among them), so that wait stays short. Best
    effort: a host that refuses leaves the thread as it was."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BULK_NICE)


def core_scheduling() -> tuple[bool, str]:
    """Whether the kernel offers core scheduling (prctl PR_SCHED_CORE), and why not."""
    cookie = ctypes.c_ulong(0)
    r = libc.prctl(_PR_SCHED_CORE, _PR_SCHED_CORE_GET, 0, _PIDTYPE_PID, ctypes.byref(cookie))
    if r == 0:
        return True, "prctl(PR_SCHED_CORE) available"
    e = ctypes.get_errno()
    return False, f"prctl(PR_SCHED_CORE): {errtext(e)} (kernel without CONFIG_SCHED_CORE or SMT)"
