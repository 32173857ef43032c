"""CPU classes of sandboxes: best effort by default, ``latency`` for those that need it.

Most agent sandboxes wait for a model and use a few percent of a core; when they do burn
CPU it must not cost the node agent (whose API every sandbox depends on) or a
latency-sensitive sandbox anything.

- The cgroup does most of it, by path (:meth:`corral.host.cgroups.Cgroups.prepare`):
  best-effort sandboxes live in corral's subtree, which is idle in the cpu controller, so
  all of them are one idle entity at the root, where they meet the agent and every host
  process; latency sandboxes live under the normal ``<subtree>-latency`` root.
- ``best_effort`` also gets SCHED_IDLE on its init before any guest process exists
  (inherited by everything it starts) with RLIMIT_NICE 0, so the guest cannot switch back
  (see :mod:`corral.host.sched`); ``latency`` gets SCHED_OTHER.

Why not a heavier weight for latency sandboxes: EEVDF picks by eligibility and an idle
group still weighs 3, so a latency sandbox that has just run, waking again within
microseconds, can find itself ineligible and wait for the next tick behind a burner (a few
per 1000 execs). A weight far above the agent's would avoid that, but then a burning
latency sandbox starves the agent. Measured in docs/design-notes.md (CPU classes).

Core scheduling (prctl PR_SCHED_CORE) would also keep sandboxes off sibling
hyperthreads of each other; :func:`corral.host.sched.core_scheduling` says whether the
kernel has it, and the node reports that in its status.

Example::

    apply(init_pid, "best_effort")
"""

from __future__ import annotations

import os

from corral.host import sched

__all__ = ["apply", "settings"]

_LATENCY = (os.SCHED_OTHER, None)
_BEST_EFFORT = (os.SCHED_IDLE, (0, 0))


def settings(qos: str) -> tuple[int, tuple[int, int] | None]:
    """Class ``qos``'s scheduling policy for the init (``os.SCHED_*``) and its RLIMIT_NICE
    (soft, hard; None: left as it is). :func:`apply` sets them on a running init;
    corral-launch sets them itself (:func:`corral.host.launch.plan`: the policy just before
    the init's exec, the limit before the clone), sparing the node's event loop a /proc
    read and a call per thread for every create."""
    return _LATENCY if qos == "latency" else _BEST_EFFORT


def apply(init_pid: int, qos: str) -> None:
    """Give the sandbox's init the scheduling policy of class ``qos`` (its cgroup has the
    class by path already)."""
    sched.set_class(init_pid, *settings(qos))
