"""corral.host.cgroups against fake cgroup trees: the v2 / v1 / hybrid logic without the kernel.

The host this project is developed on is hybrid and cannot boot pure v2, so the v2 path is
checked here against :class:`FakeKernel`: a directory tree in ``tmp_path`` laid out like
cgroupfs, plus hooks for mkdir / rmdir / write that answer the way the kernel does where
corral's logic depends on it (new cgroups get their control files from the parent's
``cgroup.subtree_control``, writes are validated, ``cgroup.procs`` moves a pid, rmdir of a
cgroup with tasks or children is EBUSY, freezing updates ``cgroup.events`` /
``freezer.state``). Reads are plain file reads. Nothing on the real host is touched.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import corral.host.cgroups as cgmod
from corral.errors import HostError
from corral.host.cgroups import Cgroups, detect_mode

# -- real-looking /proc/self/mountinfo samples -------------------------------------------

_COMMON = """\
21 28 0:20 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
22 28 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw
28 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro
"""

# Debian 12 / Fedora: systemd in unified mode.
MOUNTINFO_V2 = _COMMON + (
    "26 22 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)

# Inside a container with a cgroup namespace: the source is "cgroup", the fs is cgroup2.
MOUNTINFO_V2_CONTAINER = (
    "1012 1011 0:120 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w\n"
    "1021 1012 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw\n"
)

# A v2 host where another cgroup2 mount (a bind mount into a container's rootfs) is listed
# before /sys/fs/cgroup.
MOUNTINFO_V2_EXTRA_FIRST = _COMMON + (
    "24 28 0:23 /system.slice/box.service /var/lib/box/rootfs/sys/fs/cgroup rw,nosuid,nodev,noexec,relatime "
    "shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
    "26 22 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)

_V1_LINES = """\
25 22 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
27 25 0:24 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
30 25 0:27 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,memory
31 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,cpu,cpuacct
32 25 0:29 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,pids
33 25 0:30 / /sys/fs/cgroup/freezer rw,nosuid,nodev,noexec,relatime shared:17 - cgroup cgroup rw,freezer
34 25 0:31 / /sys/fs/cgroup/cpuset rw,nosuid,nodev,noexec,relatime shared:18 - cgroup cgroup rw,cpuset
35 25 0:32 / /sys/fs/cgroup/net_cls,net_prio rw,nosuid,nodev,noexec,relatime shared:19 - cgroup cgroup rw,net_cls,net_prio
36 25 0:33 / /sys/fs/cgroup/blkio rw,nosuid,nodev,noexec,relatime shared:20 - cgroup cgroup rw,blkio
"""  # noqa: E501

# CentOS 7 / systemd "legacy": v1 only.
MOUNTINFO_V1 = _COMMON + _V1_LINES

# Ubuntu 20.04 / systemd "hybrid": v1 controllers plus an empty cgroup2 for systemd.
MOUNTINFO_HYBRID = (
    _COMMON
    + _V1_LINES
    + (
        "26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - "
        "cgroup2 cgroup2 rw,nsdelegate\n"
    )
)

# This development machine (no name=systemd hierarchy, no optional fields).
MOUNTINFO_THIS_HOST = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        (MOUNTINFO_V2, "v2"),
        (MOUNTINFO_V2_CONTAINER, "v2"),
        (MOUNTINFO_V2_EXTRA_FIRST, "v2"),
        (MOUNTINFO_V1, "v1"),
        (MOUNTINFO_HYBRID, "hybrid"),
        (MOUNTINFO_THIS_HOST, "hybrid"),
        # cgroup2 mounted somewhere else and no v1 at all: still v2
        (_COMMON + "40 22 0:40 / /mnt/cg2 rw,relatime - cgroup2 none rw\n", "v2"),
    ],
)
def test_detect_mode_samples(text: str, mode: str) -> None:
    assert detect_mode(mountinfo_text=text) == mode


def test_detect_mode_without_cgroups() -> None:
    with pytest.raises(HostError, match="neither cgroup v1 nor cgroup2"):
        detect_mode(mountinfo_text=_COMMON)


def test_detect_mode_other_root() -> None:
    text = MOUNTINFO_V2.replace("/sys/fs/cgroup", "/x/cg")
    assert detect_mode(mountinfo_text=text, root=Path("/x/cg")) == "v2"
    # hybrid with the cgroup2 at the given root: that root decides
    assert detect_mode(mountinfo_text=MOUNTINFO_HYBRID, root=Path("/sys/fs/cgroup/unified")) == "v2"


def test_default_arguments_read_this_host() -> None:
    """No arguments: /proc/self/mountinfo and /sys/fs/cgroup, as the node calls it (reads only)."""
    with open("/proc/self/mountinfo") as f:
        text = f.read()
    try:
        expected = detect_mode(mountinfo_text=text)
    except HostError:
        pytest.skip("no cgroups mounted here")
    assert detect_mode() == expected
    a, b = Cgroups(), Cgroups(mountinfo_text=text)
    assert (a.mode, a.all_roots, a._ctrl) == (b.mode, b.all_roots, b._ctrl)
    assert a.subtree == "corral" and a.oci_path("sb-1") == "/corral/sb-1"


def test_hierarchies_from_mountinfo() -> None:
    cg = Cgroups(mountinfo_text=MOUNTINFO_HYBRID)
    base = Path("/sys/fs/cgroup")
    assert cg.mode == "hybrid"
    assert cg._ctrl["cpu"] == cg._ctrl["cpuacct"] == base / "cpu,cpuacct"
    assert cg._ctrl["memory"] == base / "memory" and cg._ctrl["freezer"] == base / "freezer"
    # every hierarchy a runtime may have created the path in, the named and cgroup2 ones too
    assert base / "systemd" in cg.all_roots and base / "unified" in cg.all_roots
    assert base / "net_cls,net_prio" in cg.all_roots


def test_v2_root_is_the_one_at_sys_fs_cgroup(make_kernel: KernelFactory) -> None:
    """Another cgroup2 mount listed first (a container's, of a subtree) is not the root."""
    k = make_kernel("v2")
    text = MOUNTINFO_V2_EXTRA_FIRST.replace("/sys/fs/cgroup", str(k.root))
    v2 = Cgroups(root=k.root, mountinfo_text=text)
    assert v2.mode == "v2" and v2.v2_root == k.root and v2.all_roots == [k.root]


def test_v1_missing_controllers() -> None:
    text = "\n".join(ln for ln in MOUNTINFO_V1.splitlines() if "freezer" not in ln)
    with pytest.raises(HostError, match="not mounted: freezer"):
        Cgroups(mountinfo_text=text)


def test_bad_names_and_mode() -> None:
    cg = Cgroups(mountinfo_text=MOUNTINFO_HYBRID)
    for bad in ("", ".", "..", "a/b", "a\0b"):
        with pytest.raises(HostError, match="bad cgroup name"):
            cg.oci_path(bad)
    with pytest.raises(HostError, match="bad cgroup name"):
        Cgroups("../etc", mountinfo_text=MOUNTINFO_V1)
    with pytest.raises(HostError, match="unknown mode"):
        Cgroups(mode="v3", mountinfo_text=MOUNTINFO_V1)  # type: ignore[arg-type]


def test_oci_path() -> None:
    assert Cgroups(mountinfo_text=MOUNTINFO_HYBRID).oci_path("sb-1") == "/corral/sb-1"
    assert Cgroups("corral-x", mountinfo_text=MOUNTINFO_V1).oci_path("a") == "/corral-x/a"


# -- the fake kernel -----------------------------------------------------------------------

_UNLIMITED = str(0x7FFFFFFFFFFFF000)  # v1 "no limit" as the kernel prints it
_V2_ORDER = ("cpuset", "cpu", "io", "memory", "hugetlb", "pids", "rdma", "misc")
_V2_FILES: dict[str, dict[str, str]] = {
    "memory": {
        "memory.max": "max\n",
        "memory.high": "max\n",
        "memory.current": "0\n",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "memory.swap.max": "max\n",
        "memory.swap.current": "0\n",
    },
    "pids": {"pids.max": "max\n", "pids.current": "0\n"},
    "cpu": {"cpu.max": "max 100000\n", "cpu.weight": "100\n"},
    "io": {"io.max": ""},
    "cpuset": {"cpuset.cpus": "\n", "cpuset.mems": "\n"},
    "hugetlb": {"hugetlb.2MB.max": "max\n"},
}
_V1_FILES: dict[str, dict[str, str]] = {
    "memory": {
        "memory.limit_in_bytes": _UNLIMITED + "\n",
        "memory.memsw.limit_in_bytes": _UNLIMITED + "\n",
        "memory.usage_in_bytes": "0\n",
        "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
    },
    "cpu": {
        "cpu.cfs_period_us": "100000\n",
        "cpu.cfs_quota_us": "-1\n",
        "cpu.shares": "1024\n",
        "cpu.idle": "0\n",
    },
    "cpuacct": {"cpuacct.usage": "0\n"},
    "pids": {"pids.max": "max\n", "pids.current": "0\n"},
    "freezer": {"freezer.state": "THAWED\n"},
    "cpuset": {"cpuset.cpus": "\n", "cpuset.mems": "\n"},
    "blkio": {"blkio.throttle.read_bps_device": ""},
    "net_cls": {"net_cls.classid": "0\n"},
    "net_prio": {"net_prio.ifpriomap": ""},
}
# v1 layout as on hybrid systemd hosts: co-mounted hierarchies, a named one.
_V1_HIERARCHIES = (
    "memory",
    "cpu,cpuacct",
    "pids",
    "freezer",
    "cpuset",
    "blkio",
    "net_cls,net_prio",
    "systemd",
)


def _err(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _limit(value: str, path: Path) -> str:
    v = value.strip()
    if v != "max" and not (v.isdigit()):
        raise _err(errno.EINVAL, path)
    return v


class FakeKernel:
    """A cgroupfs look-alike below ``root`` for ``mode`` "v2", "v1" or "hybrid"."""

    os_proxy: _OsForCgroups  # set by the make_kernel fixture

    def __init__(
        self,
        root: Path,
        mode: str,
        *,
        v2_available: str = "cpuset cpu io memory hugetlb pids rdma misc",
        v2_enabled: str = "",
        swap: bool = True,
        cgroupns: bool = False,
    ) -> None:
        # cgroupns: the v2 root is a cgroup namespace's root, not the real one, so the
        # "no internal processes" rule applies to it too.
        self.root, self.mode, self.swap, self.cgroupns = root, mode, swap, cgroupns
        self.respond_freeze = True
        self.writes: list[tuple[Path, str]] = []
        self.mkdirs: list[Path] = []  # every os.mkdir while the fake is installed
        # mount point -> (fstype, controllers)
        self.hier: dict[Path, tuple[str, tuple[str, ...]]] = {}
        root.mkdir(exist_ok=True)
        if mode == "v2":
            self.hier[root] = ("cgroup2", ())
            self._files(
                root,
                {
                    "cgroup.controllers": v2_available + "\n",
                    "cgroup.subtree_control": v2_enabled + "\n",
                    "cgroup.procs": "1\n",
                    "cgroup.max.depth": "max\n",
                },
            )
            return
        for name in _V1_HIERARCHIES:
            ctrls = () if name == "systemd" else tuple(name.split(","))
            d = root / name
            d.mkdir()
            self.hier[d] = ("cgroup", ctrls)
            self._populate_v1(d, ctrls)
            self._files(d, {"cgroup.procs": "1\n", "tasks": "1\n"})
            (d / "freezer.state").unlink(missing_ok=True)  # the root cgroup cannot freeze
            (d / "pids.max").unlink(missing_ok=True)
            if "cpuset" in ctrls:
                self._files(d, {"cpuset.cpus": "0-1\n", "cpuset.mems": "0\n"})
        if mode == "hybrid":
            u = root / "unified"
            u.mkdir()
            self.hier[u] = ("cgroup2", ())
            self._files(
                u,
                {
                    "cgroup.controllers": "hugetlb\n",
                    "cgroup.subtree_control": "\n",
                    "cgroup.procs": "1\n",
                },
            )

    # -- layout ---------------------------------------------------------------------------

    def mountinfo(self) -> str:
        """This tree as /proc/self/mountinfo would show it."""
        lines = [_COMMON.rstrip("\n")]
        if self.mode != "v2":
            lines.append(
                f"25 22 0:22 / {self.root} ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755"
            )
        for i, (point, (fstype, ctrls)) in enumerate(self.hier.items()):
            if fstype == "cgroup2":
                opts = "rw,nsdelegate,memory_recursiveprot"
            else:
                opts = "rw," + (",".join(ctrls) if ctrls else "xattr,name=systemd")
            lines.append(
                f"{30 + i} 25 0:{30 + i} / {point} rw,nosuid,nodev,noexec,relatime "
                f"shared:{10 + i} - {fstype} cgroup {opts}"
            )
        return "\n".join(lines) + "\n"

    def path(self, ctrl: str) -> Path:
        """The mount point that holds ``ctrl`` ("" for the cgroup2)."""
        for point, (fstype, ctrls) in self.hier.items():
            if (ctrl in ctrls) or (not ctrl and fstype == "cgroup2"):
                return point
        raise KeyError(ctrl)

    def _mount_of(self, p: Path) -> Path | None:
        p = Path(os.path.abspath(p))
        best = None
        for point in self.hier:
            if p == point or point in p.parents:
                if best is None or len(point.parts) > len(best.parts):
                    best = point
        return best

    @staticmethod
    def _files(d: Path, files: dict[str, str]) -> None:
        for name, text in files.items():
            (d / name).write_text(text)

    def _populate_v1(self, d: Path, ctrls: tuple[str, ...]) -> None:
        self._files(d, {"cgroup.procs": "", "tasks": "", "notify_on_release": "0\n"})
        for c in ctrls:
            files = dict(_V1_FILES.get(c, {}))
            if c == "memory" and not self.swap:
                files.pop("memory.memsw.limit_in_bytes")
            self._files(d, files)

    def _v2_ctrl_files(self, c: str) -> dict[str, str]:
        files = dict(_V2_FILES.get(c, {}))
        if c == "memory" and not self.swap:
            files = {k: v for k, v in files.items() if not k.startswith("memory.swap.")}
        return files

    # -- syscalls ---------------------------------------------------------------------------

    def mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: Any = None) -> None:
        p = Path(os.fsdecode(path))
        self.mkdirs.append(p)
        point = self._mount_of(p)
        if point is None or dir_fd is not None:
            _real_mkdir(path, mode, dir_fd=dir_fd)
            return
        _real_mkdir(p, mode)  # FileExistsError / FileNotFoundError as the kernel
        if self.hier[point][0] == "cgroup":
            self._populate_v1(p, self.hier[point][1])
            return
        enabled = (p.parent / "cgroup.subtree_control").read_text().split()
        self._files(
            p,
            {
                "cgroup.procs": "",
                "cgroup.controllers": " ".join(enabled) + "\n",
                "cgroup.subtree_control": "\n",
                "cgroup.events": "populated 0\nfrozen 0\n",
                "cgroup.freeze": "0\n",
                "cgroup.type": "domain\n",
            },
        )
        for c in enabled:
            self._files(p, self._v2_ctrl_files(c))

    def rmdir(self, path: Any) -> None:
        p = Path(os.fsdecode(path))
        point = self._mount_of(p)
        if point is None:
            _real_rmdir(path)
            return
        if not p.is_dir():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(p))
        if p == point or any(c.is_dir() for c in p.iterdir()) or self._procs(p):
            raise _err(errno.EBUSY, p)
        for f in p.iterdir():
            f.unlink()
        _real_rmdir(p)

    def write(self, path: Path, text: str) -> None:
        point = self._mount_of(path)
        assert point is not None
        self.writes.append((path, text))
        if self.hier[point][0] == "cgroup2":
            self._write_v2(point, path, text)
        else:
            self._write_v1(point, path, text)

    # -- kernel behaviour ---------------------------------------------------------------------

    @staticmethod
    def _procs(d: Path) -> list[int]:
        f = d / "cgroup.procs"
        return [int(x) for x in f.read_text().split()] if f.exists() else []

    def _move_pid(self, point: Path, d: Path, text: str) -> None:
        if not text.strip().isdigit():
            raise _err(errno.EINVAL, d / "cgroup.procs")
        pid = int(text)
        for procs in point.rglob("cgroup.procs"):
            pids = self._procs(procs.parent)
            if pid in pids:
                pids.remove(pid)
                procs.write_text("".join(f"{x}\n" for x in pids))
        with open(d / "cgroup.procs", "a") as f:
            f.write(f"{pid}\n")

    def _write_v2(self, point: Path, path: Path, text: str) -> None:
        d, name = path.parent, path.name
        if name == "cgroup.subtree_control":
            self._subtree_control(point, d, text)
        elif name == "cgroup.procs":
            if (d != point or self.cgroupns) and (d / "cgroup.subtree_control").read_text().split():
                raise _err(errno.EBUSY, path)  # no internal processes
            self._move_pid(point, d, text)
        elif name == "cgroup.freeze":
            if text.strip() not in ("0", "1"):
                raise _err(errno.EINVAL, path)
            path.write_text(text.strip() + "\n")
            if self.respond_freeze:
                self.set_frozen_event(d, text.strip() == "1")
        elif name in ("memory.max", "memory.high", "memory.swap.max", "pids.max"):
            path.write_text(_limit(text, path) + "\n")
        elif name == "cpu.weight":
            if not text.strip().isdigit() or not 1 <= int(text) <= 10000:
                raise _err(errno.EINVAL, path)
            path.write_text(f"{int(text)}\n")
        elif name == "cpu.max":
            parts = text.split()
            if not 1 <= len(parts) <= 2 or (parts[0] != "max" and not parts[0].isdigit()):
                raise _err(errno.EINVAL, path)
            period = int(parts[1]) if len(parts) == 2 else 100_000
            if not 1000 <= period <= 1_000_000 or (parts[0] != "max" and int(parts[0]) < 1000):
                raise _err(errno.EINVAL, path)
            path.write_text(f"{parts[0]} {period}\n")
        else:
            raise _err(errno.EINVAL, path)  # read-only or not modelled

    def set_frozen_event(self, d: Path, frozen: bool) -> None:
        ev = d / "cgroup.events"
        lines = [ln for ln in ev.read_text().splitlines() if not ln.startswith("frozen ")]
        ev.write_text("\n".join([*lines, f"frozen {int(frozen)}"]) + "\n")

    def _subtree_control(self, point: Path, d: Path, text: str) -> None:
        path = d / "cgroup.subtree_control"
        enable: set[str] = set()
        disable: set[str] = set()
        for tok in text.split():
            if tok[0] not in "+-" or tok[1:] not in _V2_ORDER:
                raise _err(errno.EINVAL, path)
            (enable if tok[0] == "+" else disable).add(tok[1:])
        available = set((d / "cgroup.controllers").read_text().split())
        if enable - available:
            raise _err(errno.ENOENT, path)
        if enable and (d != point or self.cgroupns) and self._procs(d):
            raise _err(errno.EBUSY, path)  # no internal processes
        children = [c for c in d.iterdir() if c.is_dir()]
        for c in children:
            if disable & set((c / "cgroup.subtree_control").read_text().split()):
                raise _err(errno.EBUSY, path)
        now = (set(path.read_text().split()) | enable) - disable
        path.write_text(" ".join(c for c in _V2_ORDER if c in now) + "\n")
        for c in children:
            (c / "cgroup.controllers").write_text(" ".join(x for x in _V2_ORDER if x in now) + "\n")
            for ctrl in enable:
                for f, v in self._v2_ctrl_files(ctrl).items():
                    if not (c / f).exists():
                        (c / f).write_text(v)
            for ctrl in disable:
                for f in self._v2_ctrl_files(ctrl):
                    (c / f).unlink(missing_ok=True)

    def _write_v1(self, point: Path, path: Path, text: str) -> None:
        d, name = path.parent, path.name
        ctrls = self.hier[point][1]
        if name in ("cgroup.procs", "tasks"):
            if "cpuset" in ctrls and not all(
                (d / f).read_text().strip() for f in ("cpuset.cpus", "cpuset.mems")
            ):
                raise _err(errno.ENOSPC, path)  # a cpuset without cpus/mems takes no task
            self._move_pid(point, d, text)
        elif name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            v = text.strip()
            if v != "-1" and not v.isdigit():
                raise _err(errno.EINVAL, path)
            val = int(_UNLIMITED) if v == "-1" else int(v)
            limit, memsw = d / "memory.limit_in_bytes", d / "memory.memsw.limit_in_bytes"
            # the kernel keeps memsw >= limit at every step
            if name == "memory.limit_in_bytes" and memsw.exists():
                if val > int(memsw.read_text()):
                    raise _err(errno.EINVAL, path)
            if name == "memory.memsw.limit_in_bytes" and val < int(limit.read_text()):
                raise _err(errno.EINVAL, path)
            path.write_text(f"{val}\n")
        elif name == "cpu.cfs_quota_us":
            quota = int(text)
            if quota != -1 and quota < 1000:
                raise _err(errno.EINVAL, path)
            path.write_text(f"{quota}\n")
        elif name == "cpu.cfs_period_us":
            if not 1000 <= int(text) <= 1_000_000:
                raise _err(errno.EINVAL, path)
            path.write_text(f"{int(text)}\n")
        elif name == "pids.max":
            path.write_text(_limit(text, path) + "\n")
        elif name == "cpu.idle":
            if text.strip() not in ("0", "1"):
                raise _err(errno.EINVAL, path)
            path.write_text(text.strip() + "\n")
        elif name == "cpu.shares":
            if not text.strip().isdigit():
                raise _err(errno.EINVAL, path)
            path.write_text(f"{min(max(int(text), 2), 262144)}\n")
        elif name == "freezer.state":
            want = text.strip()
            if want not in ("FROZEN", "THAWED"):
                raise _err(errno.EINVAL, path)
            if want == "FROZEN" and not self.respond_freeze:
                want = "FREEZING"
            path.write_text(want + "\n")
        elif name in ("cpuset.cpus", "cpuset.mems"):
            path.write_text(text.strip() + "\n")
        else:
            raise _err(errno.EINVAL, path)


_real_mkdir, _real_rmdir = os.mkdir, os.rmdir


class _OsForCgroups:
    """``os`` as corral.host.cgroups sees it: open/write/close/rmdir go to the fake kernel
    for paths below its root, everything else is the real module."""

    def __init__(self, kernel: FakeKernel) -> None:
        self._k = kernel
        self._fds: dict[int, Path] = {}
        self.touched: list[Path] = []  # every path the module opened or removed

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: Any, flags: int, mode: int = 0o777) -> int:
        p = Path(os.fsdecode(path))
        self.touched.append(p)
        fd = os.open(path, flags, mode)  # ENOENT for a missing control file, as the kernel
        if self._k._mount_of(p) is not None:
            self._fds[fd] = p
        return fd

    def write(self, fd: int, data: bytes) -> int:
        if fd in self._fds:
            self._k.write(self._fds[fd], data.decode())
            return len(data)
        return os.write(fd, data)

    def close(self, fd: int) -> None:
        self._fds.pop(fd, None)
        os.close(fd)

    def rmdir(self, path: Any) -> None:
        self.touched.append(Path(os.fsdecode(path)))
        self._k.rmdir(path)


KernelFactory = Callable[..., FakeKernel]


@pytest.fixture
def make_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> KernelFactory:
    def make(mode: str, **kw: Any) -> FakeKernel:
        k = FakeKernel(tmp_path / "cgroup", mode, **kw)
        # Path.mkdir calls os.mkdir; the hook passes paths outside the fake tree through.
        monkeypatch.setattr(os, "mkdir", k.mkdir)
        k.os_proxy = _OsForCgroups(k)
        monkeypatch.setattr(cgmod, "os", k.os_proxy)
        return k

    return make


@pytest.fixture(params=["mountinfo", "layout"])
def how(request: pytest.FixtureRequest) -> str:
    """Point Cgroups at the fake by a mountinfo text, or by the root and its layout alone."""
    return str(request.param)


def open_cg(k: FakeKernel, how: str, subtree: str = "corral") -> Cgroups:
    if how == "mountinfo":
        cg = Cgroups(subtree, root=k.root, mountinfo_text=k.mountinfo())
    else:
        cg = Cgroups(subtree, root=k.root)
    assert cg.mode == k.mode
    return cg


def snapshot(root: Path, skip: str) -> dict[str, str | None]:
    """Every path below ``root`` (file contents too) except the ``skip`` subtrees."""
    out: dict[str, str | None] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if skip in rel.parts:
            continue
        out[str(rel)] = p.read_text() if p.is_file() else None
    return out


def read(p: Path) -> str:
    return p.read_text().strip()


# -- v2 -------------------------------------------------------------------------------------


def test_v2_layout_with_mode_override(make_kernel: KernelFactory) -> None:
    k = make_kernel("v2")
    cg = Cgroups(root=k.root, mode="v2")
    assert cg.mode == "v2" and cg.v2_root == k.root and cg.all_roots == [k.root]


def test_v2_create_writes_limits_and_enables_controllers(
    make_kernel: KernelFactory, how: str
) -> None:
    k = make_kernel("v2")  # a fresh root: nothing enabled yet
    cg = open_cg(k, how)
    cg.create("sb-1", cpus=1.5, memory=512 << 20, pids=256, swap=0)
    sub, d = k.root / "corral", k.root / "corral" / "sb-1"
    # controllers go on in the root and in the subtree, so the sandbox gets its files
    assert read(k.root / "cgroup.subtree_control") == "cpuset cpu io memory pids"
    assert read(sub / "cgroup.subtree_control") == "cpuset cpu io memory pids"
    assert read(d / "memory.max") == str(512 << 20)
    assert read(d / "memory.swap.max") == "0"
    assert read(d / "pids.max") == "256"
    assert read(d / "cpu.max") == "150000 100000"
    assert cg.exists("sb-1") and cg.list() == ["sb-1"]
    assert cg.oci_path("sb-1") == "/corral/sb-1"

    cg.create("sb-2", cpus=0, memory=64 << 20, pids=8, swap=None)
    d2 = sub / "sb-2"
    assert read(d2 / "cpu.max") == "max 100000"
    assert read(d2 / "memory.swap.max") == "max"
    assert cg.list() == ["sb-1", "sb-2"]

    cg.create("sb-3", cpus=0.001, memory=1 << 20, pids=1, swap=1 << 20)
    assert read(sub / "sb-3" / "cpu.max") == "1000 100000"  # the kernel's minimum quota
    assert read(sub / "sb-3" / "memory.swap.max") == str(1 << 20)


def test_v2_create_systemd_host_and_missing_controllers(make_kernel: KernelFactory) -> None:
    # systemd already enabled what it uses; io is not available on this kernel
    k = make_kernel("v2", v2_available="cpuset cpu memory pids", v2_enabled="cpu memory pids")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    assert read(k.root / "cgroup.subtree_control") == "cpuset cpu memory pids"
    assert read(k.root / "corral" / "cgroup.subtree_control") == "cpuset cpu memory pids"
    # only the one missing controller was written to the root
    root_writes = [t for p, t in k.writes if p == k.root / "cgroup.subtree_control"]
    assert root_writes == ["+cpuset"]
    # a second sandbox: nothing to enable any more
    n = len(k.writes)
    cg.create("sb-2", cpus=1, memory=1 << 30, pids=10)
    assert not any(p.name == "cgroup.subtree_control" for p, _ in k.writes[n:])


def test_v2_create_is_idempotent(make_kernel: KernelFactory) -> None:
    k = make_kernel("v2")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=2, memory=1 << 30, pids=10, swap=None)
    cg.create("sb-1", cpus=0, memory=1 << 29, pids=20, swap=0)  # existing cgroup: new limits
    d = k.root / "corral" / "sb-1"
    assert read(d / "cpu.max") == "max 100000"
    assert read(d / "memory.max") == str(1 << 29)
    assert read(d / "memory.swap.max") == "0"
    assert read(d / "pids.max") == "20"


def test_v2_without_swap_accounting(make_kernel: KernelFactory) -> None:
    k = make_kernel("v2", swap=False)
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10, swap=0)
    cg.set_memory("sb-1", 1 << 20, swap=None)
    d = k.root / "corral" / "sb-1"
    assert read(d / "memory.max") == str(1 << 20)
    assert not (d / "memory.swap.max").exists()


def test_v2_missing_controllers(make_kernel: KernelFactory) -> None:
    # e.g. booted with cgroup_disable=memory: memory.max would never appear
    k = make_kernel("v2", v2_available="cpu io pids")
    with pytest.raises(HostError, match=r"controllers not available in .*: memory \(see"):
        Cgroups(root=k.root, mountinfo_text=k.mountinfo())


def test_v2_create_fails_cleanly(make_kernel: KernelFactory) -> None:
    k = make_kernel("v2")
    cg = open_cg(k, "mountinfo")
    with pytest.raises(HostError, match=r"writing '-5' to .*sb-1/pids\.max: EINVAL"):
        cg.create("sb-1", cpus=1, memory=1 << 30, pids=-5)
    assert not (k.root / "corral" / "sb-1").exists() and cg.list() == []


def test_v2_subtree_with_processes_is_refused(make_kernel: KernelFactory) -> None:
    """No internal processes: the kernel refuses controllers for a cgroup with tasks."""
    k = make_kernel("v2")
    sub = k.root / "corral"
    sub.mkdir()
    (sub / "cgroup.procs").write_text("4242\n")
    cg = open_cg(k, "mountinfo")
    with pytest.raises(HostError, match=r"corral/cgroup\.subtree_control.*processes of its"):
        cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)


def test_v2_in_a_container_namespace_root_with_processes(make_kernel: KernelFactory) -> None:
    """Inside a container (cgroup namespace) /sys/fs/cgroup is not the real root: its own
    processes keep it from passing controllers down, and the error says what to do."""
    k = make_kernel("v2", v2_available="cpu memory pids", cgroupns=True)  # cgroup.procs: 1
    cg = open_cg(k, "mountinfo")
    with pytest.raises(HostError, match=r"EBUSY.*move its processes into a child cgroup"):
        cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    # after the container's init moved into a child cgroup, it works
    (k.root / "init").mkdir()
    (k.root / "init" / "cgroup.procs").write_text("1\n")
    (k.root / "cgroup.procs").write_text("")
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    assert read(k.root / "corral" / "sb-1" / "memory.max") == str(1 << 30)


def test_v2_counters(make_kernel: KernelFactory, how: str) -> None:
    k = make_kernel("v2")
    cg = open_cg(k, how)
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    d = k.root / "corral" / "sb-1"
    assert cg.oom_kills("sb-1") == 0
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 17\noom 4\noom_kill 3\noom_group_kill 0\n")
    (d / "memory.current").write_text("123456789\n")
    (d / "pids.current").write_text("7\n")
    assert cg.oom_kills("sb-1") == 3
    assert cg.memory_current("sb-1") == 123456789
    assert cg.pids_current("sb-1") == 7
    assert cg.procs("sb-1") == []
    cg.add_pid("sb-1", 1)  # the fake moves it out of the root, as the kernel
    cg.add_pid("sb-1", 4321)
    assert cg.procs("sb-1") == [1, 4321]
    assert read(k.root / "cgroup.procs") == ""
    with pytest.raises(HostError, match=r"reading .*sb-nope/memory\.events"):
        cg.oom_kills("sb-nope")


def test_v2_set_memory(make_kernel: KernelFactory) -> None:
    k = make_kernel("v2")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    d = k.root / "corral" / "sb-1"
    cg.set_memory("sb-1", 8 << 20, swap=None)  # squeeze into swap
    assert (read(d / "memory.max"), read(d / "memory.swap.max")) == (str(8 << 20), "max")
    cg.set_memory("sb-1", 1 << 30)
    assert (read(d / "memory.max"), read(d / "memory.swap.max")) == (str(1 << 30), "0")


def test_v2_freeze_thaw(make_kernel: KernelFactory, how: str) -> None:
    k = make_kernel("v2")
    cg = open_cg(k, how)
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    d = k.root / "corral" / "sb-1"
    cg.freeze("sb-1")
    assert read(d / "cgroup.freeze") == "1" and "frozen 1" in (d / "cgroup.events").read_text()
    cg.thaw("sb-1")
    assert read(d / "cgroup.freeze") == "0" and "frozen 0" in (d / "cgroup.events").read_text()


def test_v2_freeze_waits_for_the_kernel(make_kernel: KernelFactory) -> None:
    k = make_kernel("v2")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    d = k.root / "corral" / "sb-1"
    k.respond_freeze = False
    t = threading.Timer(0.05, k.set_frozen_event, (d, True))  # tasks stop a moment later
    t.start()
    try:
        cg.freeze("sb-1", timeout=5)
        assert "frozen 1" in (d / "cgroup.events").read_text()
    finally:
        t.cancel()
        t.join()
    with pytest.raises(HostError, match="sb-1 not thawed after 0.05s"):
        cg.thaw("sb-1", timeout=0.05)


def test_v2_list_and_remove_touch_only_the_subtree(make_kernel: KernelFactory, how: str) -> None:
    k = make_kernel("v2")
    # the host's own cgroups, and another corral's subtree with the same sandbox name
    for rel in ("system.slice", "system.slice/ssh.service", "corral-other", "corral-other/sb-1"):
        (k.root / rel).mkdir()
    (k.root / "system.slice" / "ssh.service" / "cgroup.procs").write_text("1\n")
    (k.root / "cgroup.procs").write_text("")
    cg = open_cg(k, how)
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    cg.create("sb-2", cpus=1, memory=1 << 30, pids=10)
    (k.root / "corral" / "sb-1" / "inner").mkdir()  # a runtime's sub-cgroup
    before = snapshot(k.root, skip="corral")
    assert cg.list() == ["sb-1", "sb-2"]

    cg.remove("sb-1")
    assert not (k.root / "corral" / "sb-1").exists() and cg.list() == ["sb-2"]
    cg.remove("sb-1")  # missing: fine
    cg.remove_subtree_if_empty()  # sb-2 is still there: the subtree stays
    assert (k.root / "corral").is_dir()

    cg.add_pid("sb-2", 999)
    with pytest.raises(HostError, match=r"cannot remove .*sb-2: .*tasks still in it"):
        cg.remove("sb-2", timeout=0.02)
    (k.root / "corral" / "sb-2" / "cgroup.procs").write_text("")  # the task exited
    cg.remove("sb-2")
    cg.remove_subtree_if_empty()
    assert not (k.root / "corral").exists() and cg.list() == []
    assert snapshot(k.root, skip="corral") == before


def test_v2_remove_waits_for_exiting_tasks(make_kernel: KernelFactory) -> None:
    k = make_kernel("v2")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    procs = k.root / "corral" / "sb-1" / "cgroup.procs"
    procs.write_text("77\n")  # killed, not reaped yet
    t = threading.Timer(0.05, procs.write_text, ("",))
    t.start()
    try:
        cg.remove("sb-1", timeout=5)
    finally:
        t.cancel()
        t.join()
    assert not cg.exists("sb-1")


# -- v1 and hybrid ----------------------------------------------------------------------------


@pytest.fixture(params=["v1", "hybrid"])
def v1mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_v1_hierarchies(make_kernel: KernelFactory, v1mode: str, how: str) -> None:
    k = make_kernel(v1mode)
    cg = open_cg(k, how)
    assert cg._ctrl["cpu"] == cg._ctrl["cpuacct"] == k.root / "cpu,cpuacct"
    assert cg._ctrl["memory"] == k.root / "memory"
    assert k.root / "systemd" in cg.all_roots
    assert (k.root / "unified" in cg.all_roots) == (v1mode == "hybrid")


def test_v1_create_writes_limits(make_kernel: KernelFactory, v1mode: str, how: str) -> None:
    k = make_kernel(v1mode)
    cg = open_cg(k, how)
    cg.create("sb-1", cpus=1.5, memory=512 << 20, pids=256, swap=64 << 20)
    mem = k.path("memory") / "corral" / "sb-1"
    cpu = k.path("cpu") / "corral" / "sb-1"
    assert read(mem / "memory.limit_in_bytes") == str(512 << 20)
    assert read(mem / "memory.memsw.limit_in_bytes") == str((512 + 64) << 20)
    assert read(k.path("pids") / "corral" / "sb-1" / "pids.max") == "256"
    assert read(cpu / "cpu.cfs_quota_us") == "150000"
    assert read(cpu / "cpu.cfs_period_us") == "100000"
    assert (k.path("freezer") / "corral" / "sb-1").is_dir()
    # cpuset and blkio: no limit, so no cgroup per sandbox (the top is prepared, with cpus
    # and mems copied down, for an OCI runtime's sandbox cgroup)
    cs = k.path("cpuset") / "corral"
    assert read(cs / "cpuset.cpus") == "0-1" and read(cs / "cpuset.mems") == "0"
    assert not (cs / "sb-1").exists()
    assert not (k.path("blkio") / "corral" / "sb-1").exists()
    assert not any("cpuset" in str(p) or "blkio" in str(p) for p in cg.procs_files("sb-1"))
    assert cg.list() == ["sb-1"] and cg.exists("sb-1")

    cg.create("sb-2", cpus=0, memory=64 << 20, pids=8, swap=None)
    mem2 = k.path("memory") / "corral" / "sb-2"
    assert read(k.path("cpu") / "corral" / "sb-2" / "cpu.cfs_quota_us") == "-1"
    assert read(mem2 / "memory.memsw.limit_in_bytes") == _UNLIMITED


def test_v1_new_cgroup_keeps_the_default_period(make_kernel: KernelFactory) -> None:
    """Each CFS write walks every cpu cgroup on the host: a new cgroup gets the quota only
    (its period is the default); an existing one gets both, as it may have another."""
    k = make_kernel("v1")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=0.5, memory=32 << 20, pids=10, swap=0)
    cpu = k.path("cpu") / "corral" / "sb-1"
    names = [p.name for p, _ in k.writes if p.parent == cpu]
    assert "cpu.cfs_quota_us" in names and "cpu.cfs_period_us" not in names
    (cpu / "cpu.cfs_period_us").write_text("50000\n")
    n = len(k.writes)
    cg.create("sb-1", cpus=0.5, memory=32 << 20, pids=10, swap=0)
    assert read(cpu / "cpu.cfs_period_us") == "100000"
    assert [p.name for p, _ in k.writes[n:] if p.parent == cpu] == [
        "cpu.cfs_period_us",
        "cpu.cfs_quota_us",
    ]


def test_v1_create_is_idempotent(make_kernel: KernelFactory) -> None:
    k = make_kernel("v1")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=2, memory=32 << 20, pids=10, swap=0)
    cg.create("sb-1", cpus=0, memory=64 << 20, pids=20, swap=0)  # grows past the old memsw
    mem = k.path("memory") / "corral" / "sb-1"
    assert read(mem / "memory.limit_in_bytes") == str(64 << 20)
    assert read(mem / "memory.memsw.limit_in_bytes") == str(64 << 20)
    assert read(k.path("cpu") / "corral" / "sb-1" / "cpu.cfs_quota_us") == "-1"


def test_v1_set_memory_keeps_memsw_above_limit(make_kernel: KernelFactory) -> None:
    k = make_kernel("v1")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=100 << 20, pids=10, swap=0)
    mem = k.path("memory") / "corral" / "sb-1"
    limit, memsw = mem / "memory.limit_in_bytes", mem / "memory.memsw.limit_in_bytes"
    cg.set_memory("sb-1", 200 << 20, swap=0)  # grow: memsw first
    assert (read(limit), read(memsw)) == (str(200 << 20), str(200 << 20))
    cg.set_memory("sb-1", 8 << 20, swap=None)  # shrink into swap: limit first
    assert (read(limit), read(memsw)) == (str(8 << 20), _UNLIMITED)
    cg.set_memory("sb-1", 50 << 20, swap=10 << 20)
    assert (read(limit), read(memsw)) == (str(50 << 20), str(60 << 20))


def test_v1_without_swap_accounting(make_kernel: KernelFactory) -> None:
    k = make_kernel("v1", swap=False)
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=100 << 20, pids=10, swap=0)
    cg.set_memory("sb-1", 200 << 20)
    mem = k.path("memory") / "corral" / "sb-1"
    assert read(mem / "memory.limit_in_bytes") == str(200 << 20)
    assert not (mem / "memory.memsw.limit_in_bytes").exists()


def test_v1_counters(make_kernel: KernelFactory, v1mode: str, how: str) -> None:
    k = make_kernel(v1mode)
    cg = open_cg(k, how)
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    mem = k.path("memory") / "corral" / "sb-1"
    assert cg.oom_kills("sb-1") == 0
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 1\noom_kill 5\n")
    (mem / "memory.usage_in_bytes").write_text("4096\n")
    (k.path("pids") / "corral" / "sb-1" / "pids.current").write_text("3\n")
    assert cg.oom_kills("sb-1") == 5
    assert cg.memory_current("sb-1") == 4096
    assert cg.pids_current("sb-1") == 3
    cg.add_pid("sb-1", 1)
    assert cg.procs("sb-1") == [1]
    for ctrl in ("memory", "cpu", "pids", "freezer"):
        assert read(k.path(ctrl) / "corral" / "sb-1" / "cgroup.procs") == "1", ctrl
        assert read(k.path(ctrl) / "cgroup.procs") == "", ctrl
    for ctrl in ("cpuset", "blkio"):  # no cgroup of its own there: stays in the node's
        assert not (k.path(ctrl) / "corral" / "sb-1").exists(), ctrl


def test_v1_freeze_thaw(make_kernel: KernelFactory, v1mode: str) -> None:
    k = make_kernel(v1mode)
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    state = k.path("freezer") / "corral" / "sb-1" / "freezer.state"
    cg.freeze("sb-1")
    assert read(state) == "FROZEN"
    cg.thaw("sb-1")
    assert read(state) == "THAWED"
    k.respond_freeze = False  # stuck in FREEZING (a task in uninterruptible sleep)
    with pytest.raises(HostError, match="sb-1 not frozen after 0.05s"):
        cg.freeze("sb-1", timeout=0.05)
    assert read(state) == "FREEZING"
    t = threading.Timer(0.05, state.write_text, ("FROZEN\n",))
    t.start()
    try:
        cg.freeze("sb-1", timeout=5)
    finally:
        t.cancel()
        t.join()


def test_v1_list_and_remove_touch_only_the_subtree(
    make_kernel: KernelFactory, v1mode: str, how: str
) -> None:
    k = make_kernel(v1mode)
    for point in k.hier:
        for rel in ("user.slice", "corral-other", "corral-other/sb-1"):
            (point / rel).mkdir()
    cg = open_cg(k, how)
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    # runc also creates the path in the named systemd hierarchy (and the hybrid cgroup2)
    (k.root / "systemd" / "corral" / "sb-1").mkdir(parents=True)
    (k.root / "systemd" / "corral" / "sb-stale").mkdir()
    if v1mode == "hybrid":
        (k.root / "unified" / "corral" / "sb-1").mkdir(parents=True)
    before = snapshot(k.root, skip="corral")
    assert cg.list() == ["sb-1", "sb-stale"]
    cg.remove("sb-1")
    for point in k.hier:
        assert not (point / "corral" / "sb-1").exists(), point
    assert cg.list() == ["sb-stale"]
    cg.remove("sb-stale")
    cg.remove_subtree_if_empty()
    assert not any((r / "corral").exists() for r in cg.all_roots) and cg.list() == []
    assert snapshot(k.root, skip="corral") == before


def test_v1_cpu_classes_by_path(make_kernel: KernelFactory, v1mode: str) -> None:
    """The subtree is idle in the cpu hierarchy; latency sandboxes live under the normal
    ``<subtree>-latency`` root in every hierarchy, and are found there by name."""
    k = make_kernel(v1mode)
    cg = open_cg(k, "mountinfo")
    cpu = k.path("cpu")
    assert cg.oci_path("sb-be") == "/corral/sb-be"
    assert cg.oci_path("sb-lat", latency=True) == "/corral-latency/sb-lat"
    cg.create("sb-be", cpus=1.5, memory=1 << 30, pids=10)
    cg.create("sb-lat", cpus=1, memory=1 << 30, pids=10, latency=True)
    assert read(cpu / "corral" / "cpu.idle") == "1"
    assert read(cpu / "corral-latency" / "cpu.idle") == "0"
    assert cg.cpu_class("sb-be") == {"weight": 1024, "idle": 0, "group_idle": 1}
    assert cg.cpu_class("sb-lat") == {"weight": 1024, "idle": 0, "group_idle": 0}
    for ctrl in ("memory", "pids", "freezer", "cpu"):
        assert (k.path(ctrl) / "corral-latency" / "sb-lat").is_dir(), ctrl
        assert not (k.path(ctrl) / "corral" / "sb-lat").exists(), ctrl
    cg.add_pid("sb-lat", 8)
    assert cg.procs("sb-lat") == [8]
    # The event loop's reads build their paths as strings: the same files as _dir's.
    fresh = open_cg(k, "mountinfo")  # knows neither: looks each up on disk
    for c in (cg, fresh):
        for ctrl, name in (("memory", "sb-be"), ("pids", "sb-lat"), ("freezer", "sb-lat")):
            assert c._file(ctrl, name, "cgroup.procs") == str(c._dir(ctrl, name) / "cgroup.procs")
        assert c.procs("sb-lat") == [8]
    with pytest.raises(HostError):
        fresh._file("memory", "../sb-be", "cgroup.procs")  # an unknown name is checked
    assert read(cpu / "corral-latency" / "sb-lat" / "cpu.cfs_quota_us") == "100000"
    cs = k.path("cpuset") / "corral-latency"
    assert read(cs / "cpuset.cpus") == "0-1" and not (cs / "sb-lat").exists()
    assert cg.list() == ["sb-be", "sb-lat"]
    for procs in k.root.rglob("cgroup.procs"):  # the init exited
        procs.write_text("")
    cg.remove("sb-lat")
    assert not any((k.path(c) / "corral-latency" / "sb-lat").exists() for c in ("cpu", "memory"))
    assert cg.list() == ["sb-be"]
    cg.remove("sb-be")
    cg.remove_subtree_if_empty()
    assert not (cpu / "corral").exists() and not (cpu / "corral-latency").exists()
    cg.prepare()  # made again after removal: idle again
    assert read(cpu / "corral" / "cpu.idle") == "1"


def test_v2_cpu_classes_by_path(make_kernel: KernelFactory) -> None:
    """v2: the same two tops, with controllers enabled for both."""
    k = make_kernel("v2")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-be", cpus=1, memory=1 << 30, pids=10)
    cg.create("sb-lat", cpus=1, memory=1 << 30, pids=10, latency=True)
    assert (k.root / "corral-latency" / "sb-lat" / "memory.max").exists()
    assert read(k.root / "corral-latency" / "sb-lat" / "cpu.max") == "100000 100000"
    # the fake v2 kernel has no cpu.idle: the minimum weight for the best-effort top
    assert read(k.root / "corral" / "cpu.weight") == "1"
    assert read(k.root / "corral-latency" / "cpu.weight") == "100"
    assert cg.list() == ["sb-be", "sb-lat"]
    cg.remove("sb-lat")
    assert not (k.root / "corral-latency" / "sb-lat").exists()


def test_v1_create_fails_cleanly(make_kernel: KernelFactory) -> None:
    k = make_kernel("v1")
    cg = open_cg(k, "mountinfo")
    # a quota below the kernel's 1 ms is clamped, not refused
    cg.create("sb-ok", cpus=0.0001, memory=1 << 20, pids=1)
    assert read(k.path("cpu") / "corral" / "sb-ok" / "cpu.cfs_quota_us") == "1000"
    with pytest.raises(HostError, match=r"writing '-5' to .*pids\.max: "):
        cg.create("sb-1", cpus=1, memory=1 << 20, pids=-5)
    assert cg.list() == ["sb-ok"]
    for point in k.hier:
        assert not (point / "corral" / "sb-1").exists()


@pytest.mark.parametrize("mode", ["v2", "v1", "hybrid"])
def test_fake_tree_only(make_kernel: KernelFactory, tmp_path: Path, how: str, mode: str) -> None:
    """Every path the code opened, created or removed lies inside the fake tree."""
    k = make_kernel(mode)
    cg = open_cg(k, how)
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    cg.add_pid("sb-1", 1)
    cg.freeze("sb-1")
    cg.thaw("sb-1")
    cg.set_memory("sb-1", 1 << 20)
    for p in cg._dirs("sb-1"):
        if (p / "cgroup.procs").exists():
            (p / "cgroup.procs").write_text("")  # the task exited
    cg.remove("sb-1")
    cg.remove_subtree_if_empty()
    paths = [p for p, _ in k.writes] + k.mkdirs + k.os_proxy.touched
    assert k.writes and k.mkdirs and k.os_proxy.touched
    outside = [p for p in paths if p != k.root and k.root not in p.parents]
    assert outside == []


# -- recycling (a microVM saved to a memory snapshot) ------------------------------------------


def test_v2_recycle_makes_the_cgroup_anew(make_kernel: KernelFactory) -> None:
    k = make_kernel("v2")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1.5, memory=512 << 20, pids=256, swap=0, latency=True)
    cg.add_pid("sb-1", 4321)
    d = k.root / cg.latency_root / "sb-1"
    (d / "memory.current").write_text("5000\n")  # the shared page cache it read first
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 3\n")
    settings = cg.settings("sb-1")
    assert settings["memory.max"] == str(512 << 20) and settings["cpu.max"] == "150000 100000"
    assert settings["pids.max"] == "256" and settings["memory.swap.max"] == "0"
    assert cg.recycle("sb-1", settings) == 5000
    assert cg.procs("sb-1") == [4321] and cg.settings("sb-1") == settings
    assert cg.memory_current("sb-1") == 0 and cg.oom_kills("sb-1") == 0  # a new cgroup
    assert cg.recycling("sb-1") is None and cg.list() == ["sb-1"]


def test_v1_recycle_makes_only_the_memory_cgroup_anew(
    make_kernel: KernelFactory, v1mode: str
) -> None:
    k = make_kernel(v1mode)
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=256 << 20, pids=8, swap=0)
    cg.add_pid("sb-1", 77)
    mem, cpu = k.path("memory") / "corral" / "sb-1", k.path("cpu") / "corral" / "sb-1"
    (mem / "memory.usage_in_bytes").write_text("9000\n")
    (cpu / "cpuacct.usage").write_text("5000000000\n")
    settings = cg.settings("sb-1")
    assert list(settings) == ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
    assert cg.recycle("sb-1", settings) == 9000
    assert cg.memory_current("sb-1") == 0 and cg.settings("sb-1") == settings
    assert read(mem / "cgroup.procs") == "77" and read(cpu / "cgroup.procs") == "77"
    assert cg.cpu_seconds("sb-1") == 5.0  # the cpu hierarchy's cgroup is kept
    assert cg.list() == ["sb-1"]


def test_recycle_cut_short_is_finished(make_kernel: KernelFactory) -> None:
    """A node that died between moving the processes out and making the cgroup again:
    :meth:`Cgroups.recycling` finds the sibling, finish_recycle completes it; settings
    naming anything but the control files a recycle sets are refused."""
    k = make_kernel("v2")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", cpus=1, memory=1 << 30, pids=10)
    cg.add_pid("sb-1", 99)
    settings = cg.settings("sb-1")
    d = k.root / "corral" / "sb-1"
    tmp = d.with_name("sb-1.recycle")
    tmp.mkdir()
    (tmp / "cgroup.procs").write_text("99\n")  # as the kernel moves it
    (d / "cgroup.procs").write_text("")
    k.rmdir(d)
    fresh = open_cg(k, "mountinfo")  # the next node
    assert fresh.recycling("sb-1") == tmp and not fresh.exists("sb-1")
    with pytest.raises(HostError, match="not a control file a recycle sets"):
        fresh.finish_recycle("sb-1", {"../../cgroup.procs": "1"}, tmp)
    fresh.finish_recycle("sb-1", settings, tmp)
    assert fresh.procs("sb-1") == [99] and fresh.settings("sb-1") == settings
    assert fresh.recycling("sb-1") is None and fresh.list() == ["sb-1"]


# -- the pool of pre-made cgroups (CgroupPool) ----------------------------------------------

_POOL_LIMITS: dict[str, Any] = dict(cpus=0.5, memory=96 << 20, pids=40, swap=0)


def _pool(cg: Cgroups, size: int = 3, keys: int = 2) -> cgmod.CgroupPool:
    pool = cgmod.CgroupPool(cg, size=size, keys=keys, quiet=0)
    pool.start()
    return pool


def _assert_limits(k: FakeKernel, name: str, cpus: float, memory: int, pids: int) -> None:
    assert read(k.path("memory") / "corral" / name / "memory.limit_in_bytes") == str(memory)
    assert read(k.path("memory") / "corral" / name / "memory.memsw.limit_in_bytes") == str(memory)
    assert read(k.path("pids") / "corral" / name / "pids.max") == str(pids)
    quota = read(k.path("cpu") / "corral" / name / "cpu.cfs_quota_us")
    assert quota == str(int(cpus * 100_000))
    assert (k.path("freezer") / "corral" / name).is_dir()


def test_pool_hands_out_premade_cgroups(make_kernel: KernelFactory, v1mode: str) -> None:
    k = make_kernel(v1mode)
    cg = open_cg(k, "mountinfo")
    pool = _pool(cg)
    try:
        # The first create of these limits makes its own and gives them a pool.
        assert pool.create("sb-1", **_POOL_LIMITS) is False
        assert pool.wait_full(10)
        premade = cg.pooled()
        assert len(premade) == 3 and all(n.startswith(cgmod.POOL_PREFIX) for n in premade)
        assert cg.list() == ["sb-1"]  # gc and the leak checks never see the pool's
        for n in premade:
            _assert_limits(k, n, 0.5, 96 << 20, 40)
        # The next is one of them, renamed in every hierarchy, with the same limits.
        mkdirs = len(k.mkdirs)
        assert pool.create("sb-2", **_POOL_LIMITS) is True
        assert pool.taken == 1
        _assert_limits(k, "sb-2", 0.5, 96 << 20, 40)
        assert cg.list() == ["sb-1", "sb-2"] and cg.exists("sb-2")
        assert pool.wait_full(10) and len(cg.pooled()) == 3  # topped up again
        assert len(k.mkdirs) > mkdirs  # by the filler
        # Other limits: made as before, and a pool of their own.
        other = dict(_POOL_LIMITS, pids=41)
        assert pool.create("sb-3", **other) is False
        _assert_limits(k, "sb-3", 0.5, 96 << 20, 41)
        assert pool.wait_full(10) and len(cg.pooled()) == 6
        # A third limits: the least recently used pool (pids 40) goes.
        assert pool.create("sb-4", **dict(_POOL_LIMITS, memory=64 << 20)) is False
        assert pool.wait_full(10) and len(cg.pooled()) == 6
        assert pool.create("sb-5", **_POOL_LIMITS) is False  # and pids 41's goes
        assert pool.wait_full(10) and len(cg.pooled()) == 6
        assert pool.create("sb-6", **other) is False
        assert pool.create("sb-7", **dict(_POOL_LIMITS, memory=64 << 20)) is False
        assert pool.wait_full(10)
        assert pool.create("sb-8", **other) is True
        cg.remove("sb-8")
        assert pool.create("sb-8", **other) is True  # a removed name can be taken again
    finally:
        pool.close()
    assert cg.pooled() == []
    assert cg.list() == [f"sb-{i}" for i in range(1, 9)]


def test_pool_latency_class_and_refusals(make_kernel: KernelFactory) -> None:
    k = make_kernel("v1")
    cg = open_cg(k, "mountinfo")
    pool = _pool(cg, size=1)
    try:
        assert pool.create("sb-1", latency=True, **_POOL_LIMITS) is False
        assert pool.wait_full(10)
        assert pool.create("sb-2", latency=True, **_POOL_LIMITS) is True
        assert (k.path("memory") / cg.latency_root / "sb-2").is_dir()
        assert cg.control_file("memory", "sb-2", "x").parent.parent.name == cg.latency_root
        # A best-effort create of the same limits is another pool.
        assert pool.create("sb-3", **_POOL_LIMITS) is False
        with pytest.raises(HostError, match="the node's own"):
            pool.create(cgmod.POOL_PREFIX + "1.1", **_POOL_LIMITS)
        with pytest.raises(HostError, match="the node's own"):
            cg.create(cgmod.POOL_PREFIX + "1.1", **_POOL_LIMITS)
    finally:
        pool.close()


def test_create_pooled_makes_only_pool_names_with_the_limits(make_kernel: KernelFactory) -> None:
    """The pool's own way to make a cgroup: a pool name only (the counterpart of create's
    refusal), the limits written as create writes them, seen by pooled() and never by
    list(); rename_pooled then gives it a sandbox's name."""
    k = make_kernel("v1")
    cg = open_cg(k, "mountinfo")
    with pytest.raises(HostError, match="'sb-1' is not a pool name"):
        cg.create_pooled("sb-1", **_POOL_LIMITS)
    assert not (k.path("memory") / "corral" / "sb-1").exists()
    with pytest.raises(HostError, match="bad cgroup name"):
        cg.create_pooled(cgmod.POOL_PREFIX + "1/2", **_POOL_LIMITS)
    pooled = cgmod.POOL_PREFIX + "7.0"
    cg.create_pooled(pooled, **_POOL_LIMITS)
    _assert_limits(k, pooled, 0.5, 96 << 20, 40)
    assert cg.pooled() == [pooled] and cg.list() == []
    cg.rename_pooled(pooled, "sb-1", latency=False, devices=False)
    _assert_limits(k, "sb-1", 0.5, 96 << 20, 40)
    assert cg.pooled() == [] and cg.list() == ["sb-1"]
    cg.remove("sb-1")


def test_pool_rename_failure_makes_the_cgroup_instead(make_kernel: KernelFactory) -> None:
    """A rename refused half way (here: the name exists in one hierarchy) is undone, the
    pre-made cgroup goes, and the create makes the cgroup as without a pool."""
    k = make_kernel("v1")
    cg = open_cg(k, "mountinfo")
    pool = _pool(cg, size=1)
    try:
        pool.create("sb-1", **_POOL_LIMITS)
        assert pool.wait_full(10)
        [premade] = cg.pooled()
        (k.path("pids") / "corral" / "sb-2").mkdir()  # rename(2) onto it: refused
        assert pool.create("sb-2", **_POOL_LIMITS) is False
        assert premade not in cg.pooled()
        _assert_limits(k, "sb-2", 0.5, 96 << 20, 40)
        assert cg.list() == ["sb-1", "sb-2"]
    finally:
        pool.close()
    assert cg.pooled() == []


def test_pool_start_removes_a_crashed_nodes_cgroups(make_kernel: KernelFactory) -> None:
    k = make_kernel("hybrid")
    cg = open_cg(k, "mountinfo")
    cg.create("sb-1", **_POOL_LIMITS)
    cg.create_pooled(cgmod.POOL_PREFIX + "999.0", **_POOL_LIMITS)
    assert cg.pooled() == [cgmod.POOL_PREFIX + "999.0"]
    pool = _pool(cg)
    assert cg.pooled() == [] and cg.list() == ["sb-1"]
    pool.close()


def test_pool_is_off_on_v2(make_kernel: KernelFactory) -> None:
    """cgroup2 refuses rename(2): the pool makes every cgroup as Cgroups.create does."""
    k = make_kernel("v2")
    cg = open_cg(k, "mountinfo")
    pool = _pool(cg)
    try:
        assert not pool.enabled
        assert pool.create("sb-1", **_POOL_LIMITS) is False
        assert pool.create("sb-2", **_POOL_LIMITS) is False
        assert cg.pooled() == [] and cg.list() == ["sb-1", "sb-2"]
    finally:
        pool.close()


def test_pool_bad_sizes(make_kernel: KernelFactory) -> None:
    cg = open_cg(make_kernel("v1"), "mountinfo")
    with pytest.raises(HostError, match="size and keys"):
        cgmod.CgroupPool(cg, size=0)


# -- CgroupPool.give_back: the pool's bookkeeping, against a stand-in for Cgroups ----------


class _PoolHost:
    """What CgroupPool calls on Cgroups, recorded; ``reuse_as`` can be held at a gate."""

    mode = "v1"

    def __init__(self) -> None:
        self.on_disk: set[str] = set()
        self.removed: list[str] = []
        self.reusable: str | None = None
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def pooled(self) -> list[str]:
        return sorted(n for n in self.on_disk if n.startswith(cgmod.POOL_PREFIX))

    def remove(self, name: str, timeout: float = 1.0) -> None:
        self.on_disk.discard(name)
        self.removed.append(name)

    def create(self, name: str, **limits: Any) -> None:
        self.on_disk.add(name)

    create_pooled = create

    def rename_pooled(self, pooled: str, name: str, latency: bool, devices: bool) -> None:
        self.on_disk.discard(pooled)
        self.on_disk.add(name)

    def reuse_as(self, name: str, pooled: str, **limits: Any) -> str | None:
        self.entered.set()
        self.gate.wait(10)
        if self.reusable is not None:
            return self.reusable
        self.on_disk.discard(name)
        self.on_disk.add(pooled)
        return None


_LIMITS: dict[str, Any] = dict(cpus=1.0, memory=64 << 20, pids=16)


def test_a_given_back_cgroup_is_taken_next_and_the_surplus_trimmed() -> None:
    """give_back keeps a destroyed sandbox's cgroup for its limits' pool; the pool trims
    back to its size; a cgroup the pool did not make, or one reuse_as refuses, is not
    kept (the caller removes it)."""
    host = _PoolHost()
    pool = cgmod.CgroupPool(host, size=1, quiet=0.0)  # type: ignore[arg-type]
    pool.start()
    try:
        assert pool.create("sb-a", **_LIMITS) is False  # made: these limits get a pool
        assert pool.wait_full(10)
        assert pool.create("sb-b", **_LIMITS) is True  # the pre-made one
        assert pool.wait_full(10)  # refilled
        assert pool.give_back("sb-a") is True and pool.returned == 1
        assert pool.wait_full(10)  # two for a size of one: the older one goes
        assert len(host.pooled()) == 1 and len(host.removed) == 1
        assert pool.create("sb-c", **_LIMITS) is True
        assert pool.give_back("sb-unknown") is False  # not made by this pool: not kept
        host.reusable = "an OOM kill or a refused fork counted"
        assert pool.give_back("sb-c") is False and pool.returned == 1
        assert pool.give_back("sb-c") is False  # asked once only: its limits are forgotten
    finally:
        pool.close()
    assert host.pooled() == []


def test_a_give_back_that_meets_close_removes_its_cgroup() -> None:
    """close() lists the pool and removes it; a give_back renaming meanwhile must not leave
    its cgroup behind under a pool name."""
    host = _PoolHost()
    pool = cgmod.CgroupPool(host, size=1, quiet=0.0)  # type: ignore[arg-type]
    pool.start()
    pool.create("sb-a", **_LIMITS)
    assert pool.wait_full(10)
    host.gate.clear()
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(pool.give_back("sb-a")))
    t.start()
    assert host.entered.wait(10)
    pool.close()  # while the give_back is inside reuse_as
    host.gate.set()
    t.join(10)
    assert result == [True]
    assert host.pooled() == [] and "sb-a" not in host.on_disk
