"""CPU classes of sandboxes: best effort by default, ``latency`` for those that need it.

Most agent sandboxes wait for a model and use a few percent of a core; when they do burn
CPU it must not cost the node agent (whose API every sandbox depends on) or a
latency-sensitive sandbox anything. So a ``best_effort`` sandbox gets:

- its cgroup marked idle (``cpu.idle=1``: the whole group is SCHED_IDLE towards its
  siblings; a kernel without cpu.idle gets the minimum weight, v1 cpu.shares=2 / v2
  cpu.weight=1),
- SCHED_IDLE on its init before any guest process exists (inherited by everything it
  starts) with RLIMIT_NICE 0, so the guest cannot switch back (see :mod:`corral.host.sched`).

A ``latency`` sandbox keeps the normal weight and SCHED_OTHER. The node agent runs outside
corral's cgroups with the normal weight; corral's subtree competes with it as one entity of
the default weight, whose best-effort children count for almost nothing inside it. A
waking agent preempts a best-effort process at once (the kernel preempts a running
SCHED_IDLE task for any waking non-idle one, whatever their cgroups), CPUs running only
best-effort work count as idle when the kernel places a waking task, and under sustained
load the agent gets at least half a CPU.
(Marking the whole subtree idle would protect the agent strictly, but would also make
latency sandboxes yield to every host process: measured here, with other work on the
host, that cost the latency class a 200 ms p99; a separate idle parent for best-effort
sandboxes only would give both, at the price of a second cgroup path per sandbox.)
Core scheduling (prctl PR_SCHED_CORE) would also keep sandboxes off sibling
hyperthreads of each other; :func:`corral.host.sched.core_scheduling` says whether the
kernel has it, and the node reports that in its status.

Example::

    apply(cgroups, "sb-...", init_pid, "best_effort")
"""

from __future__ import annotations

from corral.host import sched
from corral.host.cgroups import Cgroups

__all__ = ["apply"]


def apply(cgroups: Cgroups, sandbox_id: str, init_pid: int, qos: str) -> None:
    """Give the sandbox's cgroup and init the scheduling of class ``qos``."""
    best_effort = qos != "latency"
    cgroups.set_cpu_class(sandbox_id, best_effort)
    if best_effort:
        sched.make_idle(init_pid)
    else:
        sched.make_normal(init_pid)
