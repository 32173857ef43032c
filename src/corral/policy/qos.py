"""CPU classes of sandboxes: best effort by default, ``latency`` for those that need it.

Most agent sandboxes wait for a model and use a few percent of a core; when they do burn
CPU it must not cost the node agent (whose API every sandbox depends on) or a
latency-sensitive sandbox anything. So a ``best_effort`` sandbox gets:

- its cgroup marked idle (``cpu.idle=1``: the whole group is SCHED_IDLE towards its
  siblings; a kernel without cpu.idle gets the minimum weight, v1 cpu.shares=2 / v2
  cpu.weight=1),
- SCHED_IDLE on its init before any guest process exists (inherited by everything it
  starts) with RLIMIT_NICE 0, so the guest cannot switch back (see :mod:`corral.host.sched`).

A ``latency`` sandbox gets SCHED_OTHER and the maximum cgroup weight (v1 cpu.shares 262144,
v2 cpu.weight 10000). An idle group still weighs 3 and EEVDF picks by eligibility, not by
class: when a latency sandbox has just run, an eligible best-effort sibling wins the next
pick and keeps the CPU until the next tick (4 ms at HZ=250), so N best-effort siblings took
turns N*3/1024 as often as the latency sandbox at the normal weight; at the maximum weight
N*3/262144. (Traced with ``perf sched`` on a shared host: waits > 1 ms of the latency
sandbox's init behind 4 best-effort burner sandboxes, per 1000 execs, 14-39 (mean 28) at
1024 vs 3-29 (mean 18) at the maximum; the gain grows with the number of best-effort
sandboxes.) The node agent runs outside
corral's cgroups with the normal weight; corral's subtree competes with it as one entity of
the default weight, whose best-effort children count for almost nothing inside it. Under
sustained load the agent gets at least half a CPU, but a waking agent does NOT always
preempt a best-effort process at once: since 6.6 the kernel decides wakeup preemption
between the entities of the common parent (here the agent's autogroup and corral's subtree,
which is not idle), so the agent waits behind a burner until the burner's slice ends when
the subtree entity is ahead in EEVDF order (traced: 30-120 waits > 1 ms per 1000 execs,
up to one 4 ms tick each). Moving the agent into an agent cgroup inside the subtree
(sibling of the sandboxes, so the idle-vs-non-idle rule applies) removed most of them in
an experiment, but means moving the embedding process between cgroups; not done.
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
