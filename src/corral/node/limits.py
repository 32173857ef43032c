"""The host limits that bound how many sandboxes a node holds, and the estimate they give.

The node checks these at start and reports them (a log line per limit below what
``max_sandboxes`` needs; ``corral doctor`` shows each one), and never changes them: a
sysctl is the operator's decision. :func:`capacity` turns them and the memory figure into
"this node can hold about N idle sandboxes", in NodeStatus (``idle_capacity``, with the
limit that binds) and in the doctor's output.

One limit the node does change is its own: RLIMIT_NOFILE (:func:`raise_nofile`). It keeps
a pidfd and a seccomp listener fd per sandbox, so 10,000 sandboxes want ~22,000 open
files, above the soft limit most shells hand down; raising a process's own limit up to
``fs.nr_open`` is what ``LimitNOFILE=`` in a unit would do, and touches nothing host-wide.

The memory a sandbox costs is not a constant: it grows with the number of sandboxes on
the host. Every superblock (a sandbox of corral's launcher mounts 5 of its own: overlay
root, proc, the /dev tmpfs, devpts, mqueue) registers a memcg-aware shrinker, and every
memory cgroup (one per sandbox) holds a slot per shrinker id up to the host's high-water
mark, in 1 KiB units of 64 ids (mm/shrinker.c, ``shrinker_info``: 16 bytes per id per
memory cgroup). So n sandboxes cost ``n * (BASE + 16 * 5 * n)`` bytes: 0.24 MiB each of
shrinker slots at 3,200, 0.76 MiB at 10,000. :func:`idle_bytes` is that model, fitted to
``corral bench density`` on a freshly booted host (docs/design-notes.md, "Density");
``NodeConfig`` does not override it because a wrong guess is worse than a measured one.
The high-water mark never falls until a reboot: a host that once held 10,000 sandboxes
pays the 10,000 figure for every new memory cgroup.
"""

from __future__ import annotations

import logging
import math
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from corral.node.deadlines import RESERVED_FDS

__all__ = [
    "SYSCTLS",
    "BASE_BYTES",
    "idle_bytes",
    "fits",
    "FDS_PER_SANDBOX",
    "Capacity",
    "capacity",
    "sysctl",
    "short_of",
    "warn_short",
    "raise_nofile",
    "nofile_wanted",
]

MIB = 1 << 20
log = logging.getLogger("corral.node")

BASE_BYTES = int(0.55 * MIB)
"""Host memory per idle sandbox apart from the shrinker slots: its memory cgroup's own
charge (page tables, init's pages, kernel objects charged to it) and the unreclaimable
kernel objects of its namespaces, cgroups and mounts. ``bench density`` on a freshly
booted host (session 11, debian image, launcher runtime): 0.793 MiB per sandbox at 3,200,
1.305 MiB at 10,000; less the model's shrinker slots (0.244 and 0.763 MiB) that is 0.549
and 0.542 MiB."""

SUPERBLOCKS_PER_SANDBOX = 5
"""Superblocks each sandbox adds to the host (see the module docstring): 5 with corral's
launcher, the default runtime (overlay root, proc, the /dev tmpfs that also holds
/dev/shm, devpts, mqueue; /sys is a bind of the node's template sysfs, or of the host's
with a network); an OCI runtime's sandboxes have 8, so the estimate is optimistic for
them."""

SHRINKER_SLOT_BYTES = 16
"""Bytes per shrinker id per memory cgroup (a 1 KiB kmalloc unit holds 64 ids)."""


def idle_bytes(n: int) -> int:
    """Host memory per idle sandbox when ``n`` are alive (see the module docstring)."""
    return BASE_BYTES + SHRINKER_SLOT_BYTES * SUPERBLOCKS_PER_SANDBOX * max(0, n)


def fits(budget: int) -> int:
    """The most idle sandboxes ``budget`` bytes hold: the largest n with
    ``n * idle_bytes(n) <= budget`` (the positive root of b*n^2 + a*n - budget)."""
    a, b = BASE_BYTES, SHRINKER_SLOT_BYTES * SUPERBLOCKS_PER_SANDBOX
    if budget <= 0:
        return 0
    n = int((-a + math.sqrt(a * a + 4 * b * budget)) / (2 * b))
    while n > 0 and n * idle_bytes(n) > budget:  # float rounding at the edge
        n -= 1
    return n


Need = Callable[[int], int]

SYSCTLS: tuple[tuple[str, Need, str], ...] = (
    ("kernel.pid_max", lambda n: max(32768, 16 * n), "every task of every sandbox takes a pid"),
    ("kernel.threads-max", lambda n: 16 * n, "host-wide task limit"),
    ("user.max_user_namespaces", lambda n: 2 * n, "one per sandbox and image build"),
    ("user.max_mnt_namespaces", lambda n: 2 * n, "one per sandbox"),
    ("user.max_pid_namespaces", lambda n: n, "one per sandbox"),
    ("user.max_net_namespaces", lambda n: n, "one per sandbox"),
    ("fs.file-max", lambda n: 64 * n, "open files of all sandboxes and the node"),
    ("fs.nr_open", lambda n: 4 * n, "caps the node agent's own open files"),
    ("fs.inotify.max_user_instances", lambda n: 128, "per sandbox, each has its own owner uid"),
    ("fs.inotify.max_user_watches", lambda n: 65536, "per user; file watchers in sandboxes"),
    ("vm.max_map_count", lambda n: 65530, "per process; JVMs and databases want 262144"),
    ("kernel.keys.maxkeys", lambda n: 200, "per user; sandboxes get no session keyrings"),
    ("kernel.pty.max", lambda n: n, "one per interactive shell"),
    ("net.core.somaxconn", lambda n: 128, "per socket; the node's API listens with a backlog"),
)
"""(sysctl, what ``n`` sandboxes need of it, why)."""

_PER_SANDBOX: dict[str, int] = {
    # the limits that scale with the count: how many of each one IDLE sandbox takes (the
    # estimate is of idle ones; SYSCTLS asks headroom for work). Tasks: 2 measured (init
    # and its child), 4 with room for an exec.
    "kernel.pid_max": 4,
    "kernel.threads-max": 4,
    "user.max_user_namespaces": 1,
    "user.max_mnt_namespaces": 1,
    "user.max_pid_namespaces": 1,
    "user.max_net_namespaces": 1,
    "fs.file-max": 64,
}
FDS_PER_SANDBOX = 2
"""The node's own open files per sandbox: its seccomp listener and a pidfd (the pidfd is
given up when short: corral.node.deadlines.pidfd_budget)."""
_NODE_FDS = RESERVED_FDS


def sysctl(name: str, root: Path = Path("/")) -> int | None:
    """An integer sysctl (its first field), None if this kernel has no such one."""
    try:
        text = (root / "proc/sys" / name.replace(".", "/")).read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Capacity:
    """About how many idle sandboxes this node holds, and what stops it there."""

    sandboxes: int
    bound_by: str

    def describe(self) -> str:
        return f"about {self.sandboxes} idle sandboxes (bounded by {self.bound_by})"


def capacity(
    mem_available: int,
    live: int,
    read: Callable[[str], int | None] = sysctl,
    nofile: int | None = None,
) -> Capacity:
    """The smallest of: what the memory holds (the available memory plus what the
    ``live`` sandboxes use now, shared out by :func:`fits`), each count-bound sysctl
    divided by what a sandbox takes of it, and the node's open-files limit (``nofile``,
    default: its RLIMIT_NOFILE)."""
    live = max(0, live)
    bounds = {"memory": max(live, fits(max(0, mem_available) + live * idle_bytes(live)))}
    for name, each in _PER_SANDBOX.items():
        value = read(name)
        if value is not None:
            bounds[name] = value // each
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    bounds["RLIMIT_NOFILE"] = nofile // FDS_PER_SANDBOX
    name = min(bounds, key=lambda k: bounds[k])
    return Capacity(bounds[name], name)


def short_of(n: int, read: Callable[[str], int | None] = sysctl) -> list[str]:
    """One line per sysctl below what ``n`` sandboxes need (for the node's start-up log)."""
    out = []
    for name, need, why in SYSCTLS:
        value = read(name)
        if value is not None and value < need(n):
            out.append(f"{name} = {value} < {need(n)} for max_sandboxes {n} ({why})")
    return out


def warn_short(n: int, read: Callable[[str], int | None] = sysctl) -> None:
    """Log each sysctl below what ``n`` sandboxes need, at node start. Reported, never
    changed: a sysctl is the operator's decision, and the doctor lists them all."""
    for short in short_of(n, read):
        log.warning("density limit: %s; `corral doctor` lists them all", short)


def nofile_wanted(n: int) -> int:
    """The RLIMIT_NOFILE ``n`` sandboxes want: their fds in the node and its own."""
    return FDS_PER_SANDBOX * n + _NODE_FDS


def raise_nofile(n: int, read: Callable[[str], int | None] = sysctl) -> int:
    """Raise the node's own RLIMIT_NOFILE to what ``n`` sandboxes need (plus headroom for
    the node itself): the soft limit up to the hard one, and as root the hard one too, up to
    ``fs.nr_open``. Never lowers either. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = nofile_wanted(n)
    if want > hard and os.geteuid() == 0:
        top = read("fs.nr_open") or hard
        new_hard = max(hard, min(want, top))
        try:
            # Safe: the node's own limit (inherited by the helpers it starts, whose
            # sandboxes get the config's rlimits explicitly), bounded by fs.nr_open.
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(want, new_hard)), new_hard))
        except (OSError, ValueError) as e:
            log.warning("could not raise RLIMIT_NOFILE to %d: %s", want, e)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < min(want, hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
        soft = min(want, hard)
    if soft < want:
        log.warning(
            "RLIMIT_NOFILE %d is below the %d that max_sandboxes %d needs; start the node "
            "with a higher limit (ulimit -n, LimitNOFILE= in a systemd unit)",
            soft,
            want,
            n,
        )
    return soft
