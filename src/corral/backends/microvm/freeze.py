"""Freezing a microVM guest's processes while its upper dir streams out (a snapshot).

A container's snapshot freezes its cgroup on the host. A microVM cannot be stopped that
way: QMP ``stop`` (or the host freezer on QEMU) would stop the guest's agent too, and it
is the agent that streams the files out. So the guest freezes itself: the snapshot runs
:data:`SCRIPT` in the guest (busybox sh, root, a private mount namespace so the cgroup2
mount it makes is seen by no one else), which

  1. thaws what an earlier, interrupted snapshot left frozen;
  2. moves every user process of the guest's root cgroup into ``/corral-snapshot`` (not
     corral-init, PID 1; not the script itself nor its parent, corral-init's spawner; not
     kernel threads), twice, to catch children forked during the first pass;
  3. freezes that cgroup (cgroup v2: the processes see no signal, unlike SIGSTOP) and
     waits until the kernel says it is frozen (at most ~10 s, then it streams anyway and
     says so on stderr);
  4. runs corral-tar (its argv), and on exit, normal or by signal, moves the processes
     back to the root cgroup while the cgroup is still frozen (so none forks a child into
     it meanwhile: first seen, an rmdir that failed on a child forked just after a thaw),
     each thawed as it moves, and removes the cgroup.

A process frozen between two write() calls is caught between them: the snapshot is one
instant of the whole upper dir (crash-consistent), not a point the program chose.
Processes the guest put in cgroups of its own (e.g. Docker in the VM) stay where they are
and are not frozen (moving them would break their placement). If the stream is killed
(SIGKILL: no trap runs) the node runs :data:`THAW` through the agent.
"""

from __future__ import annotations

__all__ = ["BUSYBOX", "SCRIPT", "THAW", "snapshot_argv", "thaw_argv"]

BUSYBOX = "/.corral/busybox"

_COMMON = r"""
B=/.corral/busybox; G=/sys/fs/cgroup; F=$G/corral-snapshot
$B mount -t cgroup2 none $G 2>/dev/null || { echo "corral-freeze: no cgroup2, not frozen" >&2; G=; }
thaw() {  # move them out while still frozen (none can fork meanwhile); each thaws as it goes
  [ -n "$G" ] && [ -d $F ] || return 0
  for t in 1 2 3 4 5 6 7 8 9 10; do
    ps=$($B cat $F/cgroup.procs 2>/dev/null); [ -n "$ps" ] || break
    for p in $ps; do echo $p > $G/cgroup.procs 2>/dev/null; done
  done
  echo 0 > $F/cgroup.freeze 2>/dev/null
  $B rmdir $F 2>/dev/null
}
thaw
"""

SCRIPT = (
    _COMMON
    + r"""
[ -n "$G" ] || exec "$@"
$B mkdir $F || { echo "corral-freeze: cannot make $F, not frozen" >&2; exec "$@"; }
trap thaw EXIT
trap 'exit 143' INT TERM HUP
for pass in 1 2; do
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case $p in 1|$$|$PPID) continue;; esac
    cg=; read -r cg < $d/cgroup 2>/dev/null; [ "$cg" = "0::/" ] || continue
    cmd=; read -r cmd < $d/cmdline 2>/dev/null; [ -n "$cmd" ] || continue  # kernel thread
    echo $p > $F/cgroup.procs 2>/dev/null
  done
done
echo 1 > $F/cgroup.freeze
i=0
until $B grep -q "^frozen 1" $F/cgroup.events; do
  i=$((i + 1))
  [ $i -gt 1000 ] && { echo "corral-freeze: not frozen after 10 s, streaming anyway" >&2; break; }
  $B usleep 10000
done
"$@"
rc=$?
thaw
trap - EXIT
exit $rc
"""
)
"""Freeze, run ``"$@"`` (corral-tar), thaw; see the module docstring."""

THAW = _COMMON
"""Thaw and dissolve what :data:`SCRIPT` froze (after a stream that was killed)."""


def _in_private_mntns(script: str, *args: str) -> list[str]:
    unshare = [BUSYBOX, "unshare", "-m", "--propagation", "private"]
    return [*unshare, BUSYBOX, "sh", "-c", script, "corral-snapshot", *args]


def snapshot_argv(tar: str, upper: str) -> list[str]:
    """The guest command that streams ``upper`` with ``tar`` while the guest is frozen."""
    return _in_private_mntns(SCRIPT, tar, upper)


def thaw_argv() -> list[str]:
    """The guest command that undoes a snapshot's freeze."""
    return _in_private_mntns(THAW)
