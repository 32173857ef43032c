"""CPU classes of sandboxes: best effort by default, ``latency`` for those that need it.

Most agent sandboxes wait for a model and use a few percent of a core; when they do burn
CPU it must not cost the node agent (whose API every sandbox depends on) or a
latency-sensitive sandbox anything.

- ``best_effort``: on cgroup v1 the sandbox sits in corral's subtree, which is idle in the
  cpu hierarchy (``cpu.idle=1``): all best-effort work is one idle entity at the root,
  where it meets the agent and every host process, and the kernel preempts an idle entity
  for a waking non-idle one at the level where they meet. On v2 the sandbox cgroup itself
  is idle. Its init also gets SCHED_IDLE before any guest process exists (inherited by
  everything it starts) with RLIMIT_NICE 0, so the guest cannot switch back (see
  :mod:`corral.host.sched`).
- ``latency``: SCHED_OTHER, and on v1 its init moves to the normal ``<subtree>-latency``
  root of the cpu hierarchy (only there) before any guest process exists; on v2 the
  maximum weight among its idle siblings.

Why not a heavier latency root: EEVDF picks by eligibility and an idle group still weighs
3, so a latency sandbox that has just run, waking again within microseconds, can find
itself ineligible and wait for the next tick behind a burner (a few per 1000 execs). A
root weighing far more than the agent would avoid that, but then a burning latency
sandbox starves the agent. Measured in docs/design-notes.md (CPU classes).

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
    cgroups.set_cpu_class(sandbox_id, best_effort, init_pid)
    if best_effort:
        sched.make_idle(init_pid)
    else:
        sched.make_normal(init_pid)
