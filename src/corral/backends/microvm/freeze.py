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
  3. freezes that cgroup (cgroup v2: the processes see no signal, unlike SIGSTOP), and
     every top-level cgroup the guest made itself (Docker in the VM: ``system.slice``,
     ``docker/<id>``...; freezing a cgroup freezes all below it) where they are, except
     one holding PID 1, the script or its parent, and one the guest had frozen itself
     (``docker pause``: it stays frozen after); the names it froze go to :data:`FROZEN`
     first, so a thaw after a kill finds them;
  4. waits until the kernel says all of them are frozen (at most ~10 s, then it streams
     anyway and says so on stderr);
  5. runs corral-tar (its argv), and on exit, normal or by signal, moves the processes
     back to the root cgroup while the cgroup is still frozen (so none forks a child into
     it meanwhile: first seen, an rmdir that failed on a child forked just after a thaw),
     each thawed as it moves, removes the cgroup, and thaws the guest's own cgroups it
     froze (left in place: moving them would break their placement).

A process frozen between two write() calls is caught between them: the snapshot is one
instant of the whole upper dir (crash-consistent), not a point the program chose. If the
stream is killed (SIGKILL: no trap runs) the node runs :data:`THAW` through the agent.
"""

from __future__ import annotations

__all__ = ["BUSYBOX", "FROZEN", "SCRIPT", "THAW", "snapshot_argv", "thaw_argv"]

BUSYBOX = "/.corral/busybox"

FROZEN = "/.corral/shells/.snapshot-frozen"
"""The guest's own cgroups a snapshot froze, one name a line (on the guest's writable disk,
beside the upper dir: never in a snapshot, root's only)."""

_COMMON = (
    r"""
B=/.corral/busybox; G=/sys/fs/cgroup; F=$G/corral-snapshot; K="""
    + FROZEN
    + r"""
$B mount -t cgroup2 none $G 2>/dev/null || { echo "corral-freeze: no cgroup2, not frozen" >&2; G=; }
thaw() {  # move them out while still frozen (none can fork meanwhile); each thaws as it goes
  [ -n "$G" ] || return 0
  if [ -d $F ]; then
    for t in 1 2 3 4 5 6 7 8 9 10; do
      ps=$($B cat $F/cgroup.procs 2>/dev/null); [ -n "$ps" ] || break
      for p in $ps; do echo $p > $G/cgroup.procs 2>/dev/null; done
    done
    echo 0 > $F/cgroup.freeze 2>/dev/null
    $B rmdir $F 2>/dev/null
  fi
  if [ -f $K ]; then  # the guest's own cgroups, thawed where they are
    while read -r d; do echo 0 > "$G/$d/cgroup.freeze" 2>/dev/null; done < $K
    $B rm -f $K
  fi
}
thaw
"""
)

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
mine=" corral-snapshot "  # top-level cgroups of PID 1, this script and its parent
for p in 1 $$ $PPID; do
  cg=; read -r cg < /proc/$p/cgroup 2>/dev/null; cg=${cg#0::/}; mine="$mine${cg%%/*} "
done
if : > $K 2>/dev/null; then
  for d in $G/*/; do
    n=${d%/}; n=${n##*/}
    case "$mine" in *" $n "*) continue;; esac
    [ "$($B cat "$G/$n/cgroup.freeze" 2>/dev/null)" = 0 ] || continue  # the guest's freeze
    echo "$n" >> $K
    echo 1 > "$G/$n/cgroup.freeze"
  done
else
  echo "corral-freeze: cannot write $K, the guest's own cgroups not frozen" >&2
fi
frozen() {
  $B grep -q "^frozen 1" $F/cgroup.events || return 1
  [ -s $K ] || return 0
  while read -r d; do $B grep -q "^frozen 1" "$G/$d/cgroup.events" || return 1; done < $K
}
i=0
until frozen; do
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
