"""Sandbox cgroups on cgroup v1, hybrid (v1 controllers + an empty cgroup2) and pure v2.

All of corral's cgroups live below one subtree (``corral`` by default) in every hierarchy;
nothing outside it is created, changed or removed. Usually the OCI runtime creates the
sandbox cgroup from ``linux.cgroupsPath`` (see :meth:`Cgroups.oci_path`); the rest of
this module reads its counters, freezes it, and cleans up after crashes.

Example::

    cg = Cgroups()                       # mode detected: "v1", "hybrid" or "v2"
    cg.create("sb-1", cpus=1.5, memory=512 << 20, pids=256)
    cg.add_pid("sb-1", pid)
    cg.oom_kills("sb-1"), cg.memory_current("sb-1")
    cg.remove("sb-1")
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from corral.errors import HostError
from corral.host._sys import errtext, read_small

__all__ = [
    "detect_mode",
    "latency_root_of",
    "Cgroups",
    "CgroupPool",
    "POOL_PREFIX",
    "V1_CONTROLLERS",
]

log = logging.getLogger(__name__)

V1_CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer", "blkio", "cpuset")
_V1_NO_SANDBOX_CGROUP = frozenset({"blkio", "cpuset"})
"""v1 controllers where :meth:`Cgroups.create` makes no cgroup per sandbox: corral sets
no limit in them, and each costs a cgroup per sandbox (~9 KiB of kernel memory) and work
that grows with the count: a v1 cpuset with ``sched_load_balance`` (the default) rebuilds
the scheduler domains, walking every cpuset on the host, when it goes away. The sandbox
stays in the node's cgroup of these (an OCI runtime still makes its own: crun/runc)."""
_V2_CONTROLLERS = ("cpu", "memory", "pids", "io", "cpuset")
_RECYCLED_V2 = (
    "cpu.max",
    "cpu.weight",
    "memory.max",
    "memory.high",
    "memory.low",
    "memory.min",
    "memory.swap.max",
    "pids.max",
)
_RECYCLED_V1 = (  # the limit before memsw: a new cgroup's memsw limit is unlimited
    "memory.limit_in_bytes",
    "memory.memsw.limit_in_bytes",
    "memory.soft_limit_in_bytes",
    "memory.swappiness",
)
"""Control files a recycled cgroup gets again (:meth:`Cgroups.recycle`): every one corral
sets on a sandbox's cgroup (v2) or memory cgroup (v1)."""
_RESET_V1 = (
    "memory.max_usage_in_bytes",
    "memory.failcnt",
    "memory.memsw.max_usage_in_bytes",
    "memory.memsw.failcnt",
)
"""Counters of a v1 memory cgroup that a write of 0 resets (:meth:`Cgroups.reuse_as`; the
memsw ones exist with swap accounting); cpuacct.usage is reset the same way."""
REUSE_SLACK = 1 << 20
"""Bytes of pages (page cache, anonymous, swap) a destroyed sandbox's memory cgroup may
still be charged and be reused; kernel objects included, four times that. Measured here
after a destroy (the writable layer deleted): 0-0.6 MiB of page cache (files of the image
this cgroup was the first to read), 0.3-0.6 MiB of kernel objects, most freed within
~100 ms; a cgroup reused a hundred times in a row held 1.2-1.6 MiB of them."""
_RECYCLING = ".recycle"  # the sibling a recycled cgroup's processes wait in
_CFS_PERIOD = 100_000  # µs; the kernel's default period (a new v1 cgroup starts with it)


def _quota_us(cpus: float) -> int:
    """The CFS quota per period for ``cpus`` (> 0) CPUs; the kernel's floor is 1 ms."""
    return max(1000, int(cpus * _CFS_PERIOD))


POOL_PREFIX = "_pool."
"""Name prefix of the node's pre-made cgroups (:class:`CgroupPool`): no sandbox id starts
with ``_`` (``sb-...``), :meth:`Cgroups.create` refuses it, and :meth:`Cgroups.list` (gc,
the leak checks) leaves these out: they are the node's, removed at its close and at the
next pool start after a crash."""


_ROOT = Path("/sys/fs/cgroup")
Mode = Literal["v1", "v2", "hybrid"]
_Mount = tuple[str, str, set[str]]  # (fstype, mount point, super options)


def _parse_mountinfo(text: str) -> list[_Mount]:
    """(fstype, mount point, super options) of every cgroup/cgroup2 line of a mountinfo."""
    out = []
    for line in text.splitlines():
        pre, _, post = line.partition(" - ")
        fstype, _source, opts = (post.split() + ["", "", ""])[:3]
        if fstype in ("cgroup", "cgroup2"):
            out.append((fstype, pre.split()[4], set(opts.split(","))))
    return out


def _cgroup_mounts(mountinfo_text: str | None = None) -> list[_Mount]:
    """The cgroup mounts of ``mountinfo_text``, by default of /proc/self/mountinfo."""
    if mountinfo_text is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo_text = f.read()
    return _parse_mountinfo(mountinfo_text)


def _layout_mounts(root: Path, v2: bool = False) -> list[_Mount]:
    """The mounts a cgroup tree at ``root`` implies, for a tree that is not in mountinfo
    (tests, another machine's layout): ``root`` itself if it is a cgroup2 (``v2``, or it has
    ``cgroup.controllers``), otherwise one hierarchy per directory, named by its controllers
    (``cpu,cpuacct``), with a directory holding ``cgroup.controllers`` as the cgroup2."""
    if v2 or (root / "cgroup.controllers").exists():
        return [("cgroup2", str(root), set())]
    out: list[_Mount] = []
    for d in sorted(root.iterdir()):
        if d.is_dir() and not d.is_symlink():
            if (d / "cgroup.controllers").exists():
                out.append(("cgroup2", str(d), set()))
            else:
                out.append(("cgroup", str(d), set(d.name.split(","))))
    return out


def _mode_of(mounts: list[_Mount], root: Path) -> Mode:
    if any(t == "cgroup2" and Path(p) == root for t, p, _ in mounts):
        return "v2"
    has_v1 = any(t == "cgroup" for t, _, _ in mounts)
    if not has_v1:
        if any(t == "cgroup2" for t, _, _ in mounts):
            return "v2"
        raise HostError("cgroups: neither cgroup v1 nor cgroup2 is mounted")
    return "hybrid" if any(t == "cgroup2" for t, _, _ in mounts) else "v1"


def detect_mode(mountinfo_text: str | None = None, *, root: Path = _ROOT) -> Mode:
    """``v2`` if ``root`` (/sys/fs/cgroup) is cgroup2; ``hybrid`` if v1 controllers sit
    beside a cgroup2 mount; ``v1`` otherwise.

    ``mountinfo_text`` (default: /proc/self/mountinfo is read) lets tests and tools
    classify another machine's mount table.
    """
    return _mode_of(_cgroup_mounts(mountinfo_text), root)


def latency_root_of(subtree: str) -> str:
    """The normal sibling of corral's (idle) subtree that latency sandboxes live under."""
    return f"{subtree}-latency"


def _check_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise HostError(f"cgroups: bad cgroup name {name!r}")
    return name


def _check_sandbox_name(name: str) -> None:
    if name.startswith(POOL_PREFIX):
        raise HostError(f"cgroups: {name!r}: the prefix {POOL_PREFIX!r} is the node's own")


class Cgroups:
    """corral's cgroups below ``subtree`` in every hierarchy."""

    def __init__(
        self,
        subtree: str = "corral",
        *,
        root: Path = _ROOT,
        mode: Mode | None = None,
        mountinfo_text: str | None = None,
    ) -> None:
        """Find the hierarchies from /proc/self/mountinfo and detect the mode.

        For tests and tools: ``mountinfo_text`` replaces /proc/self/mountinfo; ``root``
        replaces /sys/fs/cgroup (without ``mountinfo_text``, the hierarchies are then taken
        from the tree below ``root``, see :func:`_layout_mounts`, and the host's mount table
        is never read); ``mode`` skips detection.
        """
        self.subtree = _check_name(subtree)
        if mountinfo_text is None and root != _ROOT:
            mounts = _layout_mounts(root, v2=mode == "v2")
        else:
            mounts = _cgroup_mounts(mountinfo_text)
        if mode is not None and mode not in ("v1", "v2", "hybrid"):
            raise HostError(f"cgroups: unknown mode {mode!r} (v1, v2 or hybrid)")
        self.mode: str = mode or _mode_of(mounts, root)
        # Latency-class sandboxes live under this normal sibling of the (idle) subtree;
        # see prepare().
        self.latency_root = latency_root_of(self.subtree)
        self._prepared: set[str] = set()
        # Per-create costs kept off the hot path (a create and a destroy touch every
        # hierarchy; under churn these were ~15% of the node's CPU per sandbox):
        self._real: dict[Path, str] = {}
        """hierarchy root -> its realpath (a mount point: fixed for the node's life)."""
        self._latency: dict[str, bool] = {}
        """sandbox -> in the latency root, for cgroups made by :meth:`create` (saves a
        stat per control file access); others are looked up on disk."""
        self._root_s: dict[str, str] = {}
        """controller -> its hierarchy root as a string (:meth:`_file`)."""
        # controller -> hierarchy root used to create/read; all_roots: every hierarchy
        # (named ones, the hybrid cgroup2) a runtime may have created our path in.
        self._ctrl: dict[str, Path] = {}
        self.all_roots: list[Path] = []
        self.devices_root: Path | None = None
        """v1: the devices hierarchy (None on v2, or where it is not mounted)."""
        if self.mode == "v2":
            v2 = [Path(p) for t, p, _ in mounts if t == "cgroup2"]
            if not v2:
                raise HostError("cgroups v2: no cgroup2 mount found")
            # Prefer the one at /sys/fs/cgroup: other cgroup2 mounts (a container's bind
            # mount, a subtree mounted elsewhere) may come first in mountinfo.
            self.v2_root = root if root in v2 else v2[0]
            self.all_roots = [self.v2_root]
            # Like the v1 check below: fail here, not at the first sandbox's limits.
            available = self._read(self.v2_root / "cgroup.controllers").split()
            missing = [c for c in ("memory", "pids", "cpu") if c not in available]
            if missing:
                raise HostError(
                    f"cgroups v2: controllers not available in {self.v2_root}: "
                    f"{', '.join(missing)} (see its cgroup.controllers)"
                )
            return
        for fstype, point, opts in mounts:
            if fstype == "cgroup2":
                self.all_roots.append(Path(point))
                continue
            if Path(point) not in self.all_roots:
                self.all_roots.append(Path(point))
            for ctrl in V1_CONTROLLERS:
                if ctrl in opts and ctrl not in self._ctrl:
                    self._ctrl[ctrl] = Path(point)
            if "devices" in opts and self.devices_root is None:
                self.devices_root = Path(point)
        missing = [c for c in ("memory", "pids", "cpu", "freezer") if c not in self._ctrl]
        if missing:
            raise HostError(f"cgroups v1: controllers not mounted: {', '.join(missing)}")

    # -- paths ------------------------------------------------------------------------

    def oci_path(self, name: str, latency: bool = False) -> str:
        """Value for OCI ``linux.cgroupsPath`` (cgroupfs driver), e.g. ``/corral/<name>``;
        a latency-class sandbox's lies under :attr:`latency_root` (see :meth:`prepare`)."""
        return f"/{self.latency_root if latency else self.subtree}/{_check_name(name)}"

    def _dir(self, ctrl: str, name: str | None = None) -> Path:
        root = self.v2_root if self.mode == "v2" else self._ctrl[ctrl]
        if name is None:
            return root / self.subtree
        known = self._latency.get(name)
        if known is not None:
            return root / (self.latency_root if known else self.subtree) / name
        latency = root / self.latency_root / _check_name(name)
        return latency if latency.is_dir() else root / self.subtree / name

    def _file(self, ctrl: str, name: str, filename: str) -> str:
        """``str(self._dir(ctrl, name) / filename)``, as one string when ``name`` is a cgroup
        this object made or found: the reads the event loop makes per exec and destroy (the
        OOM count, cgroup.procs, the freezer state) skip two Path joins (~20 us here)."""
        known = self._latency.get(name)
        if known is None:
            return f"{self._dir(ctrl, name)}/{filename}"  # checks the name
        root = self._root_s.get(ctrl)
        if root is None:
            root = self._root_s[ctrl] = str(self.hierarchy(ctrl))
        return f"{root}/{self.latency_root if known else self.subtree}/{name}/{filename}"

    def hierarchy(self, ctrl: str) -> Path:
        """Mount point of the hierarchy of ``ctrl`` (v2: the one tree)."""
        return self.v2_root if self.mode == "v2" else self._ctrl[ctrl]

    def _tops(self) -> tuple[str, ...]:
        return (self.subtree, self.latency_root)

    def _dirs(self, name: str | None) -> list[Path]:
        """The distinct directories of ``name`` (or of the subtree and the latency root)
        in every hierarchy."""
        seen: dict[str, Path] = {}
        if name is not None:
            _check_name(name)
        for root in self.all_roots:
            real = self._real.get(root)
            if real is None:
                real = self._real[root] = os.path.realpath(root)
            for top in self._tops():
                # top and name are single plain components (no symlinks in a cgroupfs):
                # only the root, e.g. cpu -> cpu,cpuacct, needs resolving.
                d = root / top if name is None else root / top / name
                key = f"{real}/{top}" if name is None else f"{real}/{top}/{name}"
                seen.setdefault(key, d)
        return list(seen.values())

    # -- writing ----------------------------------------------------------------------

    @staticmethod
    def _write(path: Path, value: str, *more: str) -> None:
        """Write ``value`` to the control file ``path``, then each of ``more`` (one
        write(2) each, as the kernel takes one setting per write: e.g. device rules)
        through the same open file."""
        try:
            # Safe: every path written is a control file below corral's subtree.
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                for value in (value, *more):
                    os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as e:
            raise HostError(
                f"cgroups: writing {value!r} to {path}: {errtext(e.errno or 0)}"
            ) from None

    @staticmethod
    def _read(path: Path | str) -> str:
        try:
            return read_small(path).decode()
        except OSError as e:
            raise HostError(f"cgroups: reading {path}: {errtext(e.errno or 0)}") from None

    def prepare(self, latency: bool = False) -> None:
        """Make the top cgroup that a sandbox of this class is created under (the runtime
        creates the sandbox's own from :meth:`oci_path`).

        CPU classes are placed by path, so nothing moves between cgroups afterwards (a
        move would show the guest host paths in /proc/self/cgroup: its cgroup namespace
        is rooted where the runtime put it). corral's subtree is **idle** in the cpu
        controller (``cpu.idle=1``; the minimum weight where the kernel lacks cpu.idle):
        all best-effort work is one idle entity at the root, where it meets the node agent
        and every host process, and the kernel preempts an idle entity for a waking
        non-idle one at the level where they meet. Latency sandboxes live under the
        normal sibling :attr:`latency_root`, at the default weight. Best effort includes
        a sandbox's own start (the runtime's setup in its cgroup): under load from normal
        work, best-effort sandboxes also start on leftover CPU only.
        """
        top = self.latency_root if latency else self.subtree
        if top in self._prepared and (self.hierarchy("cpu") / top).is_dir():
            return
        if self.mode == "v2":
            self._ensure_v2_top(top)
            cpu = self.v2_root / top
        else:
            if self.devices_root is not None:
                (self.devices_root / top).mkdir(exist_ok=True)
            for ctrl, root in self._ctrl.items():
                d = root / top
                d.mkdir(exist_ok=True)
                if ctrl == "cpuset":
                    # The top must hold cpus and mems for an OCI runtime's sandbox cgroup
                    # below it (create makes none in cpuset: _V1_NO_SANDBOX_CGROUP).
                    self._copy_cpuset(root, d)
            cpu = self._ctrl["cpu"] / top
        if (cpu / "cpu.idle").exists():
            self._write(cpu / "cpu.idle", "0" if latency else "1")
        elif not latency:  # a kernel before 5.15: the minimum weight instead
            self._write(
                *((cpu / "cpu.weight", "1") if self.mode == "v2" else (cpu / "cpu.shares", "2"))
            )
        self._prepared.add(top)

    def _copy_cpuset(self, parent: Path, child: Path) -> None:
        # v1 cpuset: a new cgroup starts with no cpus and no mems, and refuses tasks.
        for f in ("cpuset.cpus", "cpuset.mems"):
            if not self._read(child / f).strip():
                self._write(child / f, self._read(parent / f).strip())

    def _ensure_v2_top(self, top: str) -> None:
        sub = self.v2_root / top
        available = set(self._read(self.v2_root / "cgroup.controllers").split())
        wanted = [c for c in _V2_CONTROLLERS if c in available]
        for d in (self.v2_root, sub):
            d.mkdir(exist_ok=True)
            enabled = set(self._read(d / "cgroup.subtree_control").split())
            todo = [c for c in wanted if c not in enabled]
            if todo:
                # Safe: only enables controllers for children; limits nobody by itself.
                try:
                    self._write(d / "cgroup.subtree_control", " ".join("+" + c for c in todo))
                except HostError as e:
                    if not self._read(d / "cgroup.procs").split():
                        raise
                    # EBUSY: v2 lets only a cgroup without processes of its own (or the
                    # real root) pass controllers down; typical inside a container.
                    raise HostError(
                        f"{e}; {d} has processes of its own, and cgroup v2 enables "
                        "controllers for children only in a cgroup without any (inside a "
                        "container: move its processes into a child cgroup first)"
                    ) from None

    def create(
        self,
        name: str,
        *,
        cpus: float,
        memory: int,
        pids: int,
        swap: int | None = 0,
        latency: bool = False,
        devices: Sequence[str] | None = None,
    ) -> None:
        """Create cgroup ``name`` (under the latency root with ``latency``) with limits:
        ``cpus`` (<=0: none), ``memory`` bytes, ``pids`` (max tasks), ``swap`` bytes beyond
        memory (None: unlimited); with ``devices`` (v1 only) a devices cgroup too, denying
        every device but these ``devices.allow`` rules."""
        _check_sandbox_name(name)
        self._make(name, cpus, memory, pids, swap, latency, devices)

    def create_pooled(
        self,
        name: str,
        *,
        cpus: float,
        memory: int,
        pids: int,
        swap: int | None = 0,
        latency: bool = False,
        devices: Sequence[str] | None = None,
    ) -> None:
        """Create the pre-made cgroup ``name`` (:class:`CgroupPool`'s, named with
        :data:`POOL_PREFIX`, which :meth:`create` refuses) with the limits :meth:`create`
        would write; :meth:`rename_pooled` later gives it a sandbox's name. Pooled cgroups
        are kept apart by name so that :meth:`list` (gc, the leak checks) never counts one
        as a sandbox, and a crashed node's are found by :meth:`pooled`."""
        if not name.startswith(POOL_PREFIX):
            raise HostError(
                f"cgroups: {name!r} is not a pool name (a pre-made cgroup's name starts "
                f"with {POOL_PREFIX!r}; a sandbox's cgroup is made by create)"
            )
        self._make(name, cpus, memory, pids, swap, latency, devices)

    def _make(
        self,
        name: str,
        cpus: float,
        memory: int,
        pids: int,
        swap: int | None,
        latency: bool,
        devices: Sequence[str] | None,
    ) -> None:
        if devices is not None and self.devices_root is None:
            raise HostError(f"cgroups {self.mode}: no devices hierarchy for a device list")
        self.prepare(latency)
        top = self.latency_root if latency else self.subtree
        self._latency[_check_name(name)] = latency
        try:
            if self.mode == "v2":
                self._create_v2(top, name, cpus, memory, pids, swap)
            else:
                self._create_v1(top, name, cpus, memory, pids, swap)
            if devices is not None:
                self._create_devices(top, name, devices)
        except BaseException:
            self.remove(name)
            raise

    def _create_devices(self, top: str, name: str, rules: Sequence[str]) -> None:
        assert self.devices_root is not None
        d = self.devices_root / top / name
        d.mkdir(exist_ok=True)
        # Safe: device rules of corral's own sandbox cgroup (a new one inherits its parent's).
        self._write(d / "devices.deny", "a")
        if rules:  # one open for all of them: a create's cgroup step is ~50 syscalls
            self._write(d / "devices.allow", *rules)

    def devices_dir(self, name: str, latency: bool = False) -> Path:
        """v1: the devices cgroup of sandbox ``name`` (made by :meth:`create` with devices)."""
        if self.devices_root is None:
            raise HostError(f"cgroups {self.mode}: no devices hierarchy")
        return self.devices_root / (self.latency_root if latency else self.subtree) / name

    def _hierarchies(self, devices: bool) -> list[Path]:
        """v1: the distinct hierarchy roots a sandbox made by :meth:`create` has a cgroup
        in (cpu and cpuacct share one), the devices one with ``devices``."""
        roots = list(dict.fromkeys(self._ctrl[c] for c in self._own()))
        if devices and self.devices_root is not None:
            roots.append(self.devices_root)
        return roots

    def rename_pooled(self, pooled: str, name: str, latency: bool, devices: bool) -> None:
        """v1: rename the pre-made cgroup ``pooled`` to ``name`` in every hierarchy it is
        in (rename(2) among siblings; cgroup2 refuses it, EPERM). On an error the
        hierarchies renamed so far are renamed back, and the error is raised."""
        self._rename(pooled, _check_name(name), latency, devices)

    def _rename(self, old: str, new: str, latency: bool, devices: bool) -> None:
        top = self.latency_root if latency else self.subtree
        done: list[Path] = []
        try:
            for root in self._hierarchies(devices):
                # Safe: two names below corral's own top cgroup; the target must not exist
                # (kernfs refuses to replace one: EEXIST).
                os.rename(root / top / old, root / top / new)
                done.append(root / top)
        except OSError as e:
            for d in reversed(done):
                with contextlib.suppress(OSError):
                    os.rename(d / new, d / old)
            raise HostError(f"cgroups: renaming {old} to {new}: {errtext(e.errno or 0)}") from None
        self._latency.pop(old, None)
        self._latency[new] = latency

    def reuse_as(
        self,
        name: str,
        pooled: str,
        *,
        cpus: float,
        memory: int,
        pids: int,
        swap: int | None,
        latency: bool,
        devices: Sequence[str] | None,
        slack: int = REUSE_SLACK,
    ) -> str | None:
        """v1: make the cgroup of the destroyed sandbox ``name`` the pre-made cgroup
        ``pooled`` (:class:`CgroupPool`), as :meth:`create_pooled` would have made it with
        these limits, instead of removing it. Returns None once it is renamed, else why it
        is not reusable: it then keeps its name for the caller to :meth:`remove`.

        Only a cgroup a new sandbox could not tell from a new one is reused: no task left
        in any hierarchy, thawed, no OOM kill and no refused fork (counters the kernel
        cannot reset), and at most ``slack`` bytes of pages still charged to it (page cache
        of the image it was the first to read would count against the next sandbox), four
        times that with kernel objects (most of them the sandbox's, freed a moment after
        its end; the rest dentries and inodes of shared filesystems, which the kernel's
        shrinkers reclaim from this cgroup as from any). The counters that can be reset are
        (memory peak and fail counts, CPU time), and the limits are written again, as a
        pause or an fncall call may have changed them. Removing a v1 memory cgroup
        costs the kernel a walk over every superblock on the host (its offline reparents
        one list per superblock), a walk that grows with the live count; reuse skips it
        and the next create's mkdir."""
        if self.mode == "v2":
            return "cgroup2 cannot rename a cgroup"
        if not pooled.startswith(POOL_PREFIX):
            raise HostError(f"cgroups: {pooled!r} is not a pool name")
        top = self.latency_root if latency else self.subtree
        leaf = f"{top}/{_check_name(name)}/cgroup.procs"
        for root in self._hierarchies(devices is not None):
            if self._read(f"{root}/{leaf}").strip():
                return "tasks left"
        if self.oom_kills(name) or self.pids_refused(name):
            return "an OOM kill or a refused fork counted"
        if self._read(self._file("freezer", name, "freezer.state")).strip() != "THAWED":
            return "not thawed"
        stat = self._read(self._file("memory", name, "memory.stat"))
        pages = sum(self._keyed(stat, k) for k in ("total_cache", "total_rss", "total_swap"))
        if pages > slack:
            return f"{pages} bytes of pages still charged"
        charged = int(self._read(self._file("memory", name, "memory.usage_in_bytes")))
        if charged > 4 * slack:
            return f"{charged} bytes still charged"
        mem = self._dir("memory", name)
        for f in _RESET_V1:
            if (mem / f).exists():
                self._write(mem / f, "0")
        self._write(self._dir("cpuacct", name) / "cpuacct.usage", "0")
        self._set_memory(name, memory, swap, fresh=False)
        self._write(self._dir("pids", name) / "pids.max", str(pids))
        quota = str(_quota_us(cpus)) if cpus > 0 else "-1"
        cpu = self._dir("cpu", name)
        if self._read(cpu / "cpu.cfs_quota_us").strip() != quota:  # a write walks the host
            self._write(cpu / "cpu.cfs_period_us", str(_CFS_PERIOD))
            self._write(cpu / "cpu.cfs_quota_us", quota)
        self._rename(name, pooled, latency, devices is not None)
        return None

    def _own(self) -> list[str]:
        """v1: the controllers a sandbox made by :meth:`create` has a cgroup of its own in
        (see ``_V1_NO_SANDBOX_CGROUP``)."""
        return [c for c in self._ctrl if c not in _V1_NO_SANDBOX_CGROUP]

    def _create_v1(
        self, top: str, name: str, cpus: float, memory: int, pids: int, swap: int | None
    ) -> None:
        made: set[Path] = set()
        for ctrl in self._own():
            d = self._ctrl[ctrl] / top / _check_name(name)
            try:
                d.mkdir()
                made.add(d)
            except FileExistsError:
                pass  # cpu and cpuacct share a hierarchy; or create again
        cpu = self._dir("cpu", name)
        fresh = cpu in made
        if cpus > 0:
            # A new cgroup has the default period already; each write of either file walks
            # every cpu cgroup on the host (tg_set_cfs_bandwidth -> __cfs_schedulable).
            if not fresh:
                self._write(cpu / "cpu.cfs_period_us", str(_CFS_PERIOD))
            self._write(cpu / "cpu.cfs_quota_us", str(_quota_us(cpus)))
        else:
            # The cgroup may exist already (create again): drop an old quota.
            self._write(cpu / "cpu.cfs_quota_us", "-1")
        # set_memory orders the writes so memsw >= limit holds, also on an existing cgroup.
        self._set_memory(name, memory, swap, fresh=self._dir("memory", name) in made)
        self._write(self._dir("pids", name) / "pids.max", str(pids))

    def _create_v2(
        self, top: str, name: str, cpus: float, memory: int, pids: int, swap: int | None
    ) -> None:
        d = self.v2_root / top / _check_name(name)
        try:
            d.mkdir()
        except FileExistsError:
            pass
        if cpus > 0:
            self._write(d / "cpu.max", f"{_quota_us(cpus)} {_CFS_PERIOD}")
        elif (d / "cpu.max").exists():
            # The cgroup may exist already (create again): drop an old quota.
            self._write(d / "cpu.max", f"max {_CFS_PERIOD}")
        self.set_memory(name, memory, swap)
        self._write(d / "pids.max", str(pids))

    def set_memory(self, name: str, memory: int, swap: int | None = 0) -> None:
        """Change the memory (and swap) limit, e.g. squeeze a paused sandbox into swap."""
        self._set_memory(name, memory, swap, fresh=False)

    def _set_memory(self, name: str, memory: int, swap: int | None, *, fresh: bool) -> None:
        """:meth:`set_memory`; ``fresh``: the v1 memory cgroup was just made, so its limits
        are unlimited and the current limit need not be read to order the writes."""
        if self.mode == "v2":
            d = self._dir("", name)
            self._write(d / "memory.max", str(memory))
            if (d / "memory.swap.max").exists():
                self._write(d / "memory.swap.max", "max" if swap is None else str(swap))
            return
        mem = self._dir("memory", name)
        limit, memsw = mem / "memory.limit_in_bytes", mem / "memory.memsw.limit_in_bytes"
        if not memsw.exists():
            self._write(limit, str(memory))
            return
        # The kernel keeps memsw >= limit at every step: raise memsw first when growing.
        new_memsw = "-1" if swap is None else str(memory + swap)
        if not fresh and memory > int(self._read(limit)):
            self._write(memsw, new_memsw)
            self._write(limit, str(memory))
        else:
            self._write(limit, str(memory))
            self._write(memsw, new_memsw)

    def add_pid(self, name: str, pid: int) -> None:
        """Move ``pid`` into cgroup ``name`` in every controller it has one in (v1: not
        blkio and cpuset, see ``_V1_NO_SANDBOX_CGROUP``)."""
        if self.mode == "v2":
            self._write(self._dir("", name) / "cgroup.procs", str(pid))
            return
        for ctrl in self._own():
            self._write(self._dir(ctrl, name) / "cgroup.procs", str(pid))

    def procs_files(self, name: str) -> list[Path]:
        """The ``cgroup.procs`` file of cgroup ``name`` in every hierarchy: what a process
        writes its own pid to before it execs, so that it starts inside (a microVM's VMM,
        whose memory would otherwise be charged where it was spawned)."""
        if self.mode == "v2":
            return [self._dir("", name) / "cgroup.procs"]
        return [self._dir(ctrl, name) / "cgroup.procs" for ctrl in self._own()]

    # -- reading ----------------------------------------------------------------------

    @staticmethod
    def _keyed(text: str, key: str) -> int:
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
        return 0

    def oom_kills(self, name: str) -> int:
        """How many processes the OOM killer killed in the cgroup."""
        if self.mode == "v2":
            return self._keyed(self._read(self._file("", name, "memory.events")), "oom_kill")
        return self._keyed(self._read(self._file("memory", name, "memory.oom_control")), "oom_kill")

    def pids_refused(self, name: str) -> int:
        """How many forks the pids limit refused in the cgroup (pids.events ``max``)."""
        return self._keyed(self._read(self._file("pids", name, "pids.events")), "max")

    def memory_current(self, name: str) -> int:
        """Bytes of memory charged to the cgroup now."""
        if self.mode == "v2":
            return int(self._read(self._dir("", name) / "memory.current"))
        return int(self._read(self._dir("memory", name) / "memory.usage_in_bytes"))

    def pids_current(self, name: str) -> int:
        """Tasks (threads included) in the cgroup and below."""
        return int(self._read(self._dir("pids", name) / "pids.current"))

    def procs(self, name: str) -> list[int]:
        """Pids of the processes directly in the cgroup."""
        text = self._read(self._file("pids" if self.mode != "v2" else "", name, "cgroup.procs"))
        return [int(x) for x in text.split()]

    def exists(self, name: str) -> bool:
        """True if the cgroup exists (in the memory hierarchy, or in the v2 tree)."""
        return self._dir("memory", name).is_dir()

    def control_file(self, ctrl: str, name: str, filename: str) -> Path:
        """Path of one control file of cgroup ``name`` (``ctrl`` ignored on v2), for
        callers that read it at a high rate (keep an fd, ``os.pread`` it)."""
        return self._dir(ctrl, name) / filename

    # -- freezing ---------------------------------------------------------------------

    def freeze(
        self, name: str, timeout: float = 5.0, abort: Callable[[], bool] | None = None
    ) -> None:
        """Freeze every task of the cgroup and wait until the kernel reports it frozen;
        stop waiting (without error) once ``abort()`` is true, e.g. a thaw is wanted."""
        self._set_frozen(name, True, timeout, abort)

    def thaw(self, name: str, timeout: float = 5.0) -> None:
        """Thaw the cgroup."""
        self._set_frozen(name, False, timeout)

    def is_frozen(self, name: str) -> bool:
        """True if the kernel reports the cgroup frozen."""
        if self.mode == "v2":
            return self._keyed(self._read(self._file("", name, "cgroup.events")), "frozen") == 1
        return self._read(self._file("freezer", name, "freezer.state")).strip() == "FROZEN"

    def _set_frozen(
        self, name: str, frozen: bool, timeout: float, abort: Callable[[], bool] | None = None
    ) -> None:
        if self.mode == "v2":
            d = self._dir("", name)
            self._write(d / "cgroup.freeze", "1" if frozen else "0")
            done = lambda: self._keyed(self._read(d / "cgroup.events"), "frozen") == int(frozen)  # noqa: E731
        else:
            d = self._dir("freezer", name)
            want = "FROZEN" if frozen else "THAWED"
            self._write(d / "freezer.state", want)
            done = lambda: self._read(d / "freezer.state").strip() == want  # noqa: E731
        deadline = time.monotonic() + timeout
        while not done():
            if abort is not None and abort():
                return
            if time.monotonic() > deadline:
                raise HostError(
                    f"cgroups: {name} not {'frozen' if frozen else 'thawed'} after {timeout:g}s"
                )
            time.sleep(0.001)

    # -- memory reclaim and cpu class (pause, QoS) -----------------------------------

    def cpu_seconds(self, name: str) -> float:
        """CPU time the cgroup's tasks have used so far (user + system), in seconds."""
        if self.mode == "v2":
            return self._keyed(self._read(self._dir("", name) / "cpu.stat"), "usage_usec") / 1e6
        return int(self._read(self._dir("cpuacct", name) / "cpuacct.usage")) / 1e9

    def memory_usage(self, name: str) -> tuple[int, int]:
        """(bytes resident in RAM, bytes in swap) charged to the cgroup."""
        if self.mode == "v2":
            d = self._dir("", name)
            swap = d / "memory.swap.current"
            return int(self._read(d / "memory.current")), (
                int(self._read(swap)) if swap.exists() else 0
            )
        d = self._dir("memory", name)
        stat = self._read(d / "memory.stat")
        return int(self._read(d / "memory.usage_in_bytes")), self._keyed(stat, "total_swap")

    def memory_breakdown(self, name: str) -> dict[str, int]:
        """Bytes charged to the cgroup by kind: ``anon``, ``file`` (page cache), ``kernel``
        (slab, page tables, ...: the rest of the charge), ``swap``."""
        resident, swapped = self.memory_usage(name)
        if self.mode == "v2":
            stat = self._read(self._dir("", name) / "memory.stat")
            anon, file = self._keyed(stat, "anon"), self._keyed(stat, "file")
        else:
            stat = self._read(self._dir("memory", name) / "memory.stat")
            anon, file = self._keyed(stat, "total_rss"), self._keyed(stat, "total_cache")
        return {
            "anon": anon,
            "file": file,
            "kernel": max(0, resident - anon - file),
            "swap": swapped,
        }

    def reclaim(self, name: str, stop: Callable[[], bool], step: int = 64 << 20) -> None:
        """Push the cgroup's memory out to swap (and drop its page cache) in ``step``-sized
        bites until the kernel can free no more or ``stop()`` is true. Meant for a frozen
        cgroup: its tasks do not touch their pages, so they stay out after the limits are
        restored. Blocks (call it from a thread).

        v2: ``memory.reclaim`` with swap allowed for the duration. v1 has no reclaim file:
        the memory limit is lowered below the usage (the kernel reclaims to meet it, or
        gives up with EBUSY), then restored; swappiness is raised meanwhile so anonymous
        memory goes, not only page cache."""
        if self.mode == "v2":
            self._reclaim_v2(name, stop, step)
        else:
            self._reclaim_v1(name, stop, step)

    def _reclaim_v1(self, name: str, stop: Callable[[], bool], step: int) -> None:
        d = self._dir("memory", name)
        limit_file, swappiness = d / "memory.limit_in_bytes", d / "memory.swappiness"
        old_limit, old_swappiness = self._read(limit_file).strip(), self._read(swappiness).strip()
        for v in ("200", "100"):  # 200 since Linux 5.8
            try:
                self._write(swappiness, v)
                break
            except HostError:
                continue
        try:
            while not stop():
                usage = int(self._read(d / "memory.usage_in_bytes"))
                target = max(0, usage - step)
                try:
                    self._write(limit_file, str(target))
                except HostError:
                    break  # EBUSY: the kernel found nothing more it could reclaim
                if target == 0:
                    break
        finally:
            self._write(limit_file, old_limit)
            self._write(swappiness, old_swappiness)

    def _reclaim_v2(self, name: str, stop: Callable[[], bool], step: int) -> None:
        d = self._dir("", name)
        swap_max = d / "memory.swap.max"
        old_swap = self._read(swap_max).strip() if swap_max.exists() else None
        if old_swap is not None:
            self._write(swap_max, "max")
        try:
            arg = f"{step} swappiness=200"
            while not stop():
                try:
                    self._write(d / "memory.reclaim", arg)
                except HostError as e:
                    if "Invalid argument" in e.message and "swappiness" in arg:
                        arg = str(step)  # a kernel before 6.7: no swappiness key
                        continue
                    break  # EAGAIN: nothing more to reclaim
        finally:
            if old_swap is not None:
                self._write(swap_max, old_swap)

    def cpu_class(self, name: str) -> dict[str, int]:
        """The cpu scheduling knobs of cgroup ``name``: ``weight`` (v2 cpu.weight, or v1
        cpu.shares), ``idle`` (if the kernel has cpu.idle) and ``group_idle`` (whether
        its parent group is idle: corral's subtree is, the latency root is not)."""
        d = self._dir("cpu", name) if self.mode != "v2" else self._dir("", name)
        out = {"weight": int(self._read(d / ("cpu.weight" if self.mode == "v2" else "cpu.shares")))}
        if (d / "cpu.idle").exists():
            out["idle"] = int(self._read(d / "cpu.idle"))
            out["group_idle"] = int(self._read(d.parent / "cpu.idle"))
        return out

    # -- recycling (a memory-snapshot paused VM) ----------------------------------------

    def _memory_root(self) -> Path:
        return self.v2_root if self.mode == "v2" else self._ctrl["memory"]

    def settings(self, name: str) -> dict[str, str]:
        """The values of the control files corral sets on a sandbox's memory cgroup (v2:
        its one cgroup, every controller), in the order :meth:`recycle` sets them again."""
        d = self._dir("memory", name)
        out = {}
        for f in _RECYCLED_V2 if self.mode == "v2" else _RECYCLED_V1:
            if (d / f).exists():
                out[f] = self._read(d / f).strip()
        return out

    def recycle(self, name: str, settings: dict[str, str], timeout: float = 1.0) -> int:
        """Make the memory cgroup of ``name`` anew, with no charge: its processes move to
        a sibling ``<name>.recycle``, the cgroup is removed and made again with
        ``settings`` (from :meth:`settings`), and the processes move back. What was still
        charged to it (page cache that other cgroups' tasks map, memory its processes
        allocated before) goes to the parent, as at a destroy: neither cgroup version
        moves page cache with a process, and nothing uncharges it while it is in use.
        Returns the bytes the old cgroup held when it was removed.

        v2: the sandbox's one cgroup, so every controller's counters (CPU time, OOM kills,
        refused forks) start again from 0; v1 and hybrid: the memory hierarchy only (its
        OOM kill count starts again; CPU, pids and freezer cgroups are kept). For a sandbox
        whose processes hold little (a microVM saved to a memory snapshot: the netns
        holder alone). Cut short (the node died), :meth:`recycling` finds the sibling and
        :meth:`finish_recycle` completes it. The removed cgroup lingers in the kernel (a
        dying memcg) while pages charged to it stay cached, as a destroyed sandbox's does."""
        d = self._dir("memory", name)
        tmp = d.with_name(name + _RECYCLING)
        # Safe: a new leaf cgroup beside the sandbox's, below corral's subtree.
        tmp.mkdir(exist_ok=True)
        for pid in self._read(d / "cgroup.procs").split():
            self._write(tmp / "cgroup.procs", pid)
        held = int(
            self._read(d / ("memory.current" if self.mode == "v2" else "memory.usage_in_bytes"))
        )
        self._rmdir(d, timeout)
        self.finish_recycle(name, settings, tmp)
        return held

    def recycling(self, name: str) -> Path | None:
        """The sibling a :meth:`recycle` that was cut short left (its processes in it)."""
        for top in self._tops():
            tmp = self._memory_root() / top / (_check_name(name) + _RECYCLING)
            if tmp.is_dir():
                return tmp
        return None

    def finish_recycle(self, name: str, settings: dict[str, str], tmp: Path) -> None:
        """The second half of :meth:`recycle`: the memory cgroup of ``name`` made (if it
        is not) with ``settings``, the processes of ``tmp`` moved into it, ``tmp`` removed."""
        d = tmp.with_name(_check_name(name))
        # Safe: the sandbox's own cgroup again, below corral's subtree.
        d.mkdir(exist_ok=True)
        self._latency[name] = d.parent.name == self.latency_root
        for f, value in settings.items():
            if f not in _RECYCLED_V2 + _RECYCLED_V1:  # the names come from a state file
                raise HostError(f"cgroups: {f!r} is not a control file a recycle sets")
            self._write(d / f, value)
        for pid in self._read(tmp / "cgroup.procs").split():
            self._write(d / "cgroup.procs", pid)
        self._rmdir(tmp, 1.0)

    # -- cleanup ----------------------------------------------------------------------

    def remove(self, name: str, timeout: float = 1.0) -> None:
        """Remove cgroup ``name`` (and any children) in every hierarchy; missing is fine.

        Kills nothing: the caller kills first. Tasks that were just killed may take a
        moment to leave, so EBUSY is retried until ``timeout``.
        """
        for d in self._dirs(name):
            # Usually a leaf: one rmdir, no walk. A cgroup with children (a runtime's
            # sub-cgroup) refuses with EBUSY/ENOTEMPTY: then children first.
            try:
                # Safe: a cgroup below corral's subtree; rmdir fails rather than kill.
                os.rmdir(d)
                continue
            except FileNotFoundError:
                continue
            except OSError:
                pass
            children = [Path(root) for root, _, _ in os.walk(d, topdown=False)]
            for c in children:
                self._rmdir(c, timeout)
        self._latency.pop(name, None)

    @staticmethod
    def _rmdir(d: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                # Safe: a cgroup below corral's subtree; rmdir fails rather than kill.
                os.rmdir(d)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise HostError(
                        f"cgroups: cannot remove {d}: {errtext(e.errno or 0)} (tasks still in it?)"
                    ) from None
                time.sleep(0.005)

    def list(self) -> list[str]:
        """Names of sandbox cgroups under the subtree in any hierarchy (for gc / leaks);
        not the node's pre-made ones (:data:`POOL_PREFIX`, see :meth:`pooled`)."""
        return [n for n in self._children() if not n.startswith(POOL_PREFIX)]

    def pooled(self) -> builtins.list[str]:
        """Names of the pre-made cgroups (:class:`CgroupPool`) under the subtree."""
        return [n for n in self._children() if n.startswith(POOL_PREFIX)]

    def _children(self) -> builtins.list[str]:
        names: set[str] = set()
        for d in self._dirs(None):
            try:
                with os.scandir(d) as it:
                    names.update(e.name for e in it if e.is_dir(follow_symlinks=False))
            except FileNotFoundError:
                continue
        return sorted(names)

    def remove_subtree_if_empty(self) -> None:
        """rmdir the subtree (and the latency root) in every hierarchy where it has no
        child cgroups."""
        self._prepared.clear()
        for d in self._dirs(None):
            try:
                os.rmdir(d)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.EBUSY, errno.ENOTEMPTY):
                    raise HostError(
                        f"cgroups: cannot remove {d}: {errtext(e.errno or 0)}"
                    ) from None


_PoolKey = tuple[bool, float, int, int | None, int, tuple[str, ...] | None]
"""(latency, cpus, memory, swap, pids, device rules): :meth:`Cgroups.create`'s arguments."""


class CgroupPool:
    """Sandbox cgroups made ahead, with their limits written, renamed to the sandbox's name
    at create (v1 and hybrid: cgroup2 refuses rename(2); there :meth:`create` is
    :meth:`Cgroups.create`).

    A create's cgroup work on v1 is a mkdir in four hierarchies (five with devices) and
    the limit writes, one of which (the CFS quota) walks every cpu cgroup on the host: it
    grows with the live count. With the pool a create is one rename per hierarchy. Pools
    are kept per limits (:data:`_PoolKey`) for the ``keys`` limits created most recently,
    ``size`` cgroups each; a create with other limits, or an empty pool, makes its cgroup
    as :meth:`Cgroups.create` does, and its limits get a pool. A filler thread at nice 19
    tops the pools up once no create has come for ``quiet`` seconds (so its mkdirs do not
    meet a burst's under the cgroup mutex), one cgroup at a time.

    A destroyed sandbox's cgroup comes back (:meth:`give_back`) when nothing in it tells
    it from a new one (:meth:`Cgroups.reuse_as`): the next create of its limits takes it,
    and neither pays the kernel's memory-cgroup removal, whose cost grows with the live
    count. Cgroups beyond ``size`` per limits are removed by the same thread once the
    node is quiet, one at a time; until then the node holds at most what its sandboxes
    held.

    Example::

        pool = CgroupPool(cg, size=16)
        pool.start()                     # removes a crashed node's pre-made cgroups
        pool.create("sb-1", cpus=1.0, memory=512 << 20, pids=256)   # False: made
        pool.wait_full(5.0)
        pool.create("sb-2", cpus=1.0, memory=512 << 20, pids=256)   # True: renamed
        pool.close()                     # the pre-made cgroups go
    """

    def __init__(
        self, cgroups: Cgroups, *, size: int = 16, keys: int = 2, quiet: float = 0.05
    ) -> None:
        if size < 1 or keys < 1:
            raise HostError(f"cgroup pool: size and keys must be >= 1 (got {size}, {keys})")
        self.cgroups = cgroups
        self.size, self.keys, self.quiet = size, keys, quiet
        self.enabled = cgroups.mode != "v2"
        self._cond = threading.Condition()
        self._ready: dict[_PoolKey, list[str]] = {}
        """limits -> the pre-made cgroups' names; in order of last use (the last is newest)."""
        self._evicted: list[tuple[_PoolKey, list[str]]] = []
        self._seq = itertools.count()
        self._last = 0.0  # monotonic time of the last create
        self._thread: threading.Thread | None = None
        self._stop = False
        self._failed = False
        self.taken = 0
        """Creates that got a pre-made cgroup (for tests and benches)."""
        self.made = 0
        """Cgroups the filler made."""
        self.returned = 0
        """Destroyed sandboxes' cgroups kept for a later create (:meth:`give_back`)."""
        self.last_refusal: str | None = None
        """Why the last cgroup :meth:`give_back` looked at was not kept (for tests)."""
        self._limits: dict[str, _PoolKey] = {}
        """sandbox -> the limits its cgroup was made with by :meth:`create`."""

    @staticmethod
    def key(
        cpus: float,
        memory: int,
        pids: int,
        swap: int | None,
        latency: bool,
        devices: Sequence[str] | None,
    ) -> _PoolKey:
        return (latency, cpus, memory, swap, pids, None if devices is None else tuple(devices))

    @staticmethod
    def _limits_of(key: _PoolKey) -> dict[str, Any]:
        """:meth:`key`'s tuple as the keyword arguments of :meth:`Cgroups.create`."""
        latency, cpus, memory, swap, pids, devices = key
        return dict(
            cpus=cpus, memory=memory, pids=pids, swap=swap, latency=latency, devices=devices
        )

    def start(self) -> None:
        """Remove pre-made cgroups a crashed node left, and start the filler."""
        if not self.enabled or self._thread is not None:
            return
        self._remove_all()
        self._stop = False
        self._thread = threading.Thread(target=self._fill, name="cgroup-pool", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the filler and remove every pre-made cgroup."""
        thread, self._thread = self._thread, None
        if thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            thread.join()
        with self._cond:
            self._ready.clear()
            self._evicted.clear()
        if self.enabled:
            self._remove_all()

    def _remove_all(self) -> None:
        for name in self.cgroups.pooled():
            try:
                self.cgroups.remove(name)
            except HostError as e:  # left for the next start; never a sandbox's
                log.warning("cgroup pool: %s", e.message)

    def create(
        self,
        name: str,
        *,
        cpus: float,
        memory: int,
        pids: int,
        swap: int | None = 0,
        latency: bool = False,
        devices: Sequence[str] | None = None,
    ) -> bool:
        """Cgroup ``name`` as :meth:`Cgroups.create` makes it; True if it was pre-made."""
        _check_sandbox_name(name)
        key = None
        if self.enabled and self._thread is not None:
            key = self.key(cpus, memory, pids, swap, latency, devices)
            pooled = self._take(key)
            if pooled is not None:
                try:
                    self.cgroups.rename_pooled(pooled, name, latency, devices is not None)
                except HostError as e:
                    log.warning("cgroup pool: %s; making %s instead", e.message, name)
                    with contextlib.suppress(HostError):
                        self.cgroups.remove(pooled)
                else:
                    with self._cond:
                        self.taken += 1
                        self._limits[name] = key
                    return True
        self.cgroups.create(
            name, cpus=cpus, memory=memory, pids=pids, swap=swap, latency=latency, devices=devices
        )
        if key is not None:
            self._want(key)
            with self._cond:
                self._limits[name] = key
        return False

    def give_back(self, name: str) -> bool:
        """After a destroy (every task gone): keep the cgroup of sandbox ``name`` for a
        later create of its limits, renamed to a pool name. False if it is not kept (not
        made by this pool's :meth:`create`, its limits no longer pooled, or not reusable:
        see :meth:`Cgroups.reuse_as`); the caller then removes it."""
        with self._cond:
            key = self._limits.pop(name, None)
            if key is None or self._thread is None or self._stop or key not in self._ready:
                return False
            pooled = f"{POOL_PREFIX}{os.getpid()}.{next(self._seq)}"
        try:
            why = self.cgroups.reuse_as(name, pooled, **self._limits_of(key))
        except HostError as e:
            why = e.message
        if why is not None:
            log.debug("cgroup pool: %s not kept: %s", name, why)
            self.last_refusal = f"{name}: {why}"
            return False
        with self._cond:
            self.returned += 1
            self._last = time.monotonic()
            closing = self._stop
            if not closing and key in self._ready:
                self._ready[key].append(pooled)
            elif not closing:  # its limits were evicted meanwhile: the filler removes it
                self._evicted.append((key, [pooled]))
            self._cond.notify_all()
        if closing:  # close() may have listed the pool before this rename: remove it here
            with contextlib.suppress(HostError):
                self.cgroups.remove(pooled)
        return True

    def forget(self, name: str) -> None:
        """Sandbox ``name``'s cgroup is being removed, not given back."""
        with self._cond:
            self._limits.pop(name, None)

    def _take(self, key: _PoolKey) -> str | None:
        with self._cond:
            self._last = time.monotonic()
            self._failed = False
            ready = self._ready.get(key)
            if ready is None:
                return None  # a pool for these limits once this create made its cgroup
            self._ready[key] = self._ready.pop(key)  # now the most recently used
            self._cond.notify_all()
            return ready.pop() if ready else None

    def _want(self, key: _PoolKey) -> None:
        """Keep a pool for ``key`` (after a create of these limits made its own cgroup)."""
        with self._cond:
            self._last = time.monotonic()
            if key in self._ready:
                return
            while len(self._ready) >= self.keys:  # the least recently used limits go
                old = next(iter(self._ready))
                self._evicted.append((old, self._ready.pop(old)))
            self._ready[key] = []
            self._cond.notify_all()

    def ready(self) -> dict[_PoolKey, int]:
        """Pre-made cgroups per limits."""
        with self._cond:
            return {k: len(v) for k, v in self._ready.items()}

    def wait_full(self, timeout: float) -> bool:
        """Wait until every pool holds ``size`` cgroups (and evicted or surplus ones are
        gone); False after ``timeout`` seconds. A readiness signal for tests and benches."""
        with self._cond:
            return self._cond.wait_for(self._full, timeout)

    def _full(self) -> bool:
        return not self._evicted and all(len(v) == self.size for v in self._ready.values())

    def _work(self) -> bool:
        """Something for the filler: cgroups to remove (evicted limits, a pool beyond
        ``size``), or, unless the last make failed, a pool to top up."""
        if self._evicted or any(len(v) > self.size for v in self._ready.values()):
            return True
        return not self._failed and not self._full()

    def _fill(self) -> None:
        # Below everything else on the host: this work is off any create's path.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._cond:
                while not self._stop and not self._work():
                    self._cond.wait()
                if self._stop:
                    return
                idle = time.monotonic() - self._last
                if idle < self.quiet:
                    self._cond.wait(self.quiet - idle)
                    continue
                over = next((k for k, v in self._ready.items() if len(v) > self.size), None)
                if self._evicted:
                    key, names = self._evicted.pop()
                    make = None
                elif over is not None:  # the oldest first: creates take the newest
                    key, names, make = over, [self._ready[over].pop(0)], None
                else:
                    key = next(k for k, v in self._ready.items() if len(v) < self.size)
                    names, make = [], f"{POOL_PREFIX}{os.getpid()}.{next(self._seq)}"
            try:
                if make is None:
                    for n in names:
                        self.cgroups.remove(n)
                    with self._cond:
                        self._cond.notify_all()  # wait_full: a pool may be at its size now
                    continue
                self.cgroups.create_pooled(make, **self._limits_of(key))
            except HostError as e:
                # Creates make their own meanwhile; the next try is after the next create.
                log.warning("cgroup pool: %s", e.message)
                with self._cond:
                    self._failed = True
                continue
            with self._cond:
                if self._stop or key not in self._ready:
                    self._evicted.append((key, [make]))
                else:
                    self._ready[key].append(make)
                    self.made += 1
                self._cond.notify_all()
