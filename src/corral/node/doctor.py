"""``corral doctor``: is this host fit to serve sandboxes, and what to do where it is not.

Every check reads; none changes the host (no sysctl written, no module loaded, nothing
mounted or built). A check is *fatal* when a node could not work without it (no OCI
runtime, no EROFS, no seccomp user notification...): :meth:`Node.open` refuses to start on
a fatal failure. The others are warnings: limits that bound density (``kernel.pid_max``,
``user.max_*_namespaces``...), optional kernel features (landlock scoping, core
scheduling, CRIU), and what a crashed node left behind (the next open recovers it, or
``corral node gc`` removes it). A check names what it saw (``detail``) and, when it fails,
what to do (``fix``).

The kernel is read through a root directory (``/`` on a real host) and the few probes that
are system calls or commands go through :class:`Probes`, so tests run the logic on fake
``/proc`` and ``/sys`` trees.

Example::

    checks = run_checks(NodeConfig())
    for c in fatal_failures(checks):
        print(c.name, c.detail, c.fix)
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from corral.backends.config import ContainerConfig
from corral.errors import HostError
from corral.host import fdstore, landlock, leaks, spawn
from corral.host.cbuild import built_path
from corral.host.cgroups import detect_mode
from corral.node import limits
from corral.node.config import NodeConfig
from corral.node.doctor_probes import Ctx as _Ctx
from corral.node.doctor_probes import Host as _Host
from corral.node.doctor_probes import Probes

__all__ = ["Check", "Probes", "run_checks", "fatal_failures", "check_host"]

_GIB = 1 << 30
_MIN_FREE = _GIB
"""Below this the scratch filesystem, the database and the layer mounts' bookkeeping fail
in ways a sandbox's user sees as random errors: fatal."""
_SANDBOX_ID = re.compile(r"sb-[0-9a-z]{12}-[0-9a-z]{1,16}")


class Check(BaseModel):
    """The outcome of one check (the JSON of ``corral doctor --json`` lists these)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    ok: bool
    detail: str
    """What was found, e.g. ``hybrid: cpu, memory, pids, freezer mounted``."""
    fix: str = ""
    """What to do when not ok; empty when ok."""
    fatal: bool = False
    """Whether a node can serve without this check passing (False: a warning). Said of
    passing checks too, so automation sees which checks are required."""


def fatal_failures(checks: list[Check]) -> list[Check]:
    """The checks that stop a node from starting."""
    return [c for c in checks if c.fatal and not c.ok]


def _c(name: str, ok: bool, detail: str, fix: str = "", *, fatal: bool = False) -> Check:
    return Check(name=name, ok=ok, detail=detail, fix="" if ok else fix, fatal=fatal)


# ------------------------------------------------------------------ kernel features


def _root(x: _Ctx) -> Check:
    euid = x.probes.euid()
    return _c(
        "root",
        euid == 0,
        "running as root" if euid == 0 else f"running as uid {euid}",
        "run the node (and this check) as root: it mounts layers, makes cgroups and user "
        "namespaces for other uids",
        fatal=True,
    )


def _userns(x: _Ctx) -> Check:
    limit = x.host.sysctl("user.max_user_namespaces")
    if not x.host.exists("proc/self/ns/user"):
        return _c(
            "user namespaces",
            False,
            "the kernel has no user namespaces",
            "use a kernel built with CONFIG_USER_NS=y: every sandbox's root maps to an "
            "unprivileged host uid through one",
            fatal=True,
        )
    if limit == 0:
        return _c(
            "user namespaces",
            False,
            "user.max_user_namespaces is 0: none can be created",
            "sysctl -w user.max_user_namespaces=65536 (and in /etc/sysctl.d/)",
            fatal=True,
        )
    return _c("user namespaces", True, f"available (max {limit})", fatal=True)


_CGROUP_NEEDS = ("cpu", "memory", "pids")


def _cgroup_controllers(mountinfo: str) -> set[str]:
    """Controllers of the v1 hierarchies in a mountinfo (their super options)."""
    found: set[str] = set()
    for line in mountinfo.splitlines():
        _pre, _, post = line.partition(" - ")
        parts = post.split()
        if len(parts) >= 3 and parts[0] == "cgroup":
            found.update(parts[2].split(","))
    return found


def _cgroups(x: _Ctx) -> Check:
    name = "cgroups"
    mountinfo = x.host.read("proc/self/mountinfo") or ""
    try:
        mode = detect_mode(mountinfo)
    except HostError as e:
        return _c(name, False, e.message, "mount cgroup2 at /sys/fs/cgroup", fatal=True)
    if mode == "v2":
        have = set((x.host.read("sys/fs/cgroup/cgroup.controllers") or "").split())
        needs: tuple[str, ...] = _CGROUP_NEEDS
    else:
        have = _cgroup_controllers(mountinfo)
        needs = (*_CGROUP_NEEDS, "freezer")
    missing = [c for c in needs if c not in have]
    shown = ", ".join(c for c in (*needs, "cpuset", "io", "blkio") if c in have)
    if missing:
        return _c(
            name,
            False,
            f"{mode}: controllers missing: {', '.join(missing)} (have {shown or 'none'})",
            "enable them (cgroup_enable=... on the kernel command line, or mount the v1 "
            "hierarchies); sandboxes' limits and pause depend on them",
            fatal=True,
        )
    note = " (v1 controllers beside a cgroup2; crun runs in a v1 view)" if mode == "hybrid" else ""
    return _c(name, True, f"{mode}{note}: {shown}", fatal=True)


def _fs_check(x: _Ctx, name: str, fstype: str, module: str, why: str) -> Check:
    how = x.host.filesystem(fstype, module)
    if how is None:
        return _c(
            name,
            False,
            f"{fstype} is neither registered nor a loadable module",
            f"use a kernel with {fstype} ({why})",
            fatal=True,
        )
    loaded = " (loaded on first mount)" if how == "module" else ""
    return _c(name, True, f"{fstype} {how}{loaded}", fatal=True)


def _erofs(x: _Ctx) -> Check:
    c = _fs_check(x, "erofs", "erofs", "erofs", "image layers are EROFS files")
    if c.ok and x.probes.which("mkfs.erofs") is None:
        return _c(
            "erofs",
            False,
            c.detail + "; mkfs.erofs is not installed: snapshots and image builds fail",
            "apt-get install erofs-utils",
        )
    return c


def _overlay(x: _Ctx) -> Check:
    return _fs_check(x, "overlayfs", "overlay", "overlay", "a sandbox's root is an overlay")


def _btrfs(x: _Ctx) -> Check:
    name = "btrfs quotas"
    c = _fs_check(x, name, "btrfs", "btrfs", "writable layers live in a btrfs with qgroups")
    if not c.ok:
        return c
    missing = [t for t in ("mkfs.btrfs",) if x.probes.which(t) is None]
    if missing or not x.host.exists("dev/loop-control"):
        what = "mkfs.btrfs is not installed" if missing else "no /dev/loop-control"
        return _c(
            name,
            False,
            f"{c.detail}; {what}: the scratch filesystem cannot be made",
            "apt-get install btrfs-progs" if missing else "load the loop module (modprobe loop)",
            fatal=True,
        )
    release = (x.host.read("proc/sys/kernel/osrelease") or "").strip()
    m = re.match(r"(\d+)\.(\d+)", release)
    simple = bool(m) and (int(m.group(1)), int(m.group(2))) >= (6, 7)  # type: ignore[union-attr]
    quotas = "simple quotas (squota)" if simple else "full qgroups (squota needs Linux 6.7)"
    return _c(name, True, f"{c.detail}, mkfs.btrfs and loop devices present; {quotas}", fatal=True)


def _landlock(x: _Ctx) -> Check:
    abi, detail = x.probes.landlock()
    ok = abi >= landlock.SCOPED_ABI
    return _c(
        "landlock",
        ok,
        f"ABI {abi}: {detail}" if abi else detail,
        f"Linux 6.12+ with landlock enabled (lsm=...,landlock) gives ABI {landlock.SCOPED_ABI}",
    )


def _seccomp_notify(x: _Ctx) -> Check:
    actions = (x.host.read("proc/sys/kernel/seccomp/actions_avail") or "").split()
    ok = "user_notif" in actions
    return _c(
        "seccomp user notify",
        ok,
        "SCMP_ACT_NOTIFY available" if ok else f"seccomp actions: {' '.join(actions) or 'none'}",
        "use a kernel with CONFIG_SECCOMP_FILTER (Linux 5.0+): every sandbox's profile "
        "reports refused calls through a notification fd",
        fatal=True,
    )


def _nftables(x: _Ctx) -> Check:
    needed = bool(x.config.network.permissions)
    why = x.probes.nft() if x.probes.libnftables() else "libnftables is not installed"
    use = (
        "sandbox egress permissions are configured"
        if needed
        else "no egress permissions configured"
    )
    if why is None:
        return _c("nftables", True, f"libnftables works ({use})", fatal=needed)
    return _c(
        "nftables",
        False,
        f"{why} ({use}{'' if needed else ': only needed once some are'})",
        "apt-get install nftables (and a kernel with nf_tables)",
        fatal=needed,
    )


def _core_sched(x: _Ctx) -> Check:
    ok, detail = x.probes.core_scheduling()
    return _c(
        "core scheduling",
        ok,
        detail,
        "optional: a kernel with CONFIG_SCHED_CORE on SMT hardware keeps sandboxes of "
        "different tenants off sibling hyperthreads",
    )


def _criu(x: _Ctx) -> Check:
    ok, detail = x.probes.criu()
    return _c(
        "criu",
        ok,
        "criu check passes" if ok else detail,
        "optional: corral does not use it; forks and snapshots copy files, not processes",
    )


# ------------------------------------------------------------------ what the node needs


def _runtime(x: _Ctx) -> Check:
    mountinfo = x.host.read("proc/self/mountinfo") or ""
    try:
        mode = detect_mode(mountinfo)
        container = x.config.backend_config("container")
        runtime = container.runtime if isinstance(container, ContainerConfig) else "auto"
        if runtime in ("auto", "launch"):
            why = x.probes.launch()
            if why is None:
                return _c(
                    "oci runtime", True, "none needed: corral-launch starts sandboxes", fatal=True
                )
            if runtime == "launch":
                return _c(
                    "oci runtime", False, f"corral-launch: {why}", "runtime = auto", fatal=True
                )
        prefer = None if runtime in ("auto", "launch") else runtime
        name, binary, legacy = x.probes.runtime(mode, prefer)
    except HostError as e:
        return _c("oci runtime", False, e.message, "apt-get install crun (or runc)", fatal=True)
    version = x.probes.version(binary)
    if version is None:
        return _c(
            "oci runtime",
            False,
            f"{binary} --version fails",
            f"reinstall {name}",
            fatal=True,
        )
    view = " in a v1 view of the hybrid cgroups" if legacy else ""
    return _c("oci runtime", True, f"{name} ({version}) at {binary}{view}", fatal=True)


def _helpers(x: _Ctx) -> Check:
    """corral-init, corral-spawn and corral-fdstore are compiled at node start."""
    from corral import init

    out = x.config.state_dir / "bin"
    progs = {
        "corral-init": init.SOURCE.read_bytes(),
        "corral-spawn": spawn.SOURCE.encode(),
        fdstore.PROGRAM: fdstore.SOURCE.encode(),
    }
    missing = [n for n, src in progs.items() if not built_path(n, src, out).is_file()]
    if not missing:
        return _c("helper programs", True, f"built in {out}", fatal=True)
    why = x.probes.gcc()
    if why is None:
        return _c(
            "helper programs", True, f"gcc builds {', '.join(missing)} at node start", fatal=True
        )
    return _c(
        "helper programs",
        False,
        f"{', '.join(missing)} not built in {out} and {why}",
        "apt-get install gcc libc6-dev",
        fatal=True,
    )


def _fd_holder(x: _Ctx) -> Check:
    pid = x.probes.holder_pid(x.config.run_dir)
    if pid is None:
        detail = "not running; the node starts it (it keeps seccomp fds across agent restarts)"
    else:
        detail = f"pid {pid} serves {x.config.run_dir / fdstore.SOCK_NAME}"
    return _c("seccomp fd holder", True, detail)


def _disk(x: _Ctx) -> Check:
    cfg = x.config
    dirs = {cfg.state_dir: x.probes.free_bytes(cfg.state_dir)}
    if cfg.store_dir != cfg.state_dir / "store":
        dirs[cfg.store_dir] = x.probes.free_bytes(cfg.store_dir)
    low = {d: n for d, n in dirs.items() if n < _MIN_FREE}
    shown = ", ".join(f"{d}: {n / _GIB:.1f} GiB free" for d, n in dirs.items())
    if low:
        return _c(
            "free disk",
            False,
            shown,
            f"free at least {_MIN_FREE // _GIB} GiB there (corral image rm, corral node gc)",
            fatal=True,
        )
    need = cfg.scratch_size + (cfg.swap.size if cfg.swap.kind == "file" else 0)
    if dirs[cfg.state_dir] < need:
        return _c(
            "free disk",
            False,
            f"{shown}; the sparse scratch image may grow to {cfg.scratch_size / _GIB:.0f} GiB"
            + (" plus the swap file" if cfg.swap.kind == "file" else ""),
            "free more disk, or lower scratch_size in node.toml to what the disk holds",
        )
    return _c("free disk", True, shown, fatal=True)


_SYSCTLS = limits.SYSCTLS


def _sysctls(x: _Ctx) -> list[Check]:
    n = x.config.max_sandboxes
    out = []
    for name, need, why in _SYSCTLS:
        value, want = x.host.sysctl(name), need(n)
        if value is None:
            out.append(_c(f"sysctl {name}", True, f"not present in this kernel ({why})"))
            continue
        ok = value >= want
        out.append(
            _c(
                f"sysctl {name}",
                ok,
                f"{value} (>= {want} for max_sandboxes {n}: {why})",
                f"sysctl -w {name}={want} (persist in /etc/sysctl.d/), or lower max_sandboxes",
            )
        )
    nofile, want = x.probes.nofile(), limits.nofile_wanted(n)
    out.append(
        _c(
            "open files limit",
            nofile >= want,
            f"RLIMIT_NOFILE {nofile} (>= {want} for max_sandboxes {n}: the node keeps "
            f"{limits.FDS_PER_SANDBOX} fds per sandbox, its seccomp listener and a pidfd; "
            "short of fds it gives up pidfds and finds deaths more slowly)",
            f"ulimit -n {want} before starting the node (LimitNOFILE= in a systemd unit)",
        )
    )
    cap = limits.capacity(_mem_available(x), 0, x.host.sysctl, nofile)
    out.append(
        _c(
            "density",
            True,
            f"this node can hold {cap.describe()}, at "
            f"{limits.idle_bytes(cap.sandboxes) / limits.MIB:.2f} MiB of host memory each "
            "(the kernel's part grows with the count: corral.node.limits); "
            f"max_sandboxes is {n}",
        )
    )
    return out


def _mem_available(x: _Ctx) -> int:
    for line in (x.host.read("proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _pinned_by(x: _Ctx, prefixes: list[Path]) -> list[str]:
    """Processes in other mount namespaces holding a copy of a mount below ``prefixes``.

    A mount namespace made while the node's mounts were up (``unshare -m`` by any tool)
    keeps copies of them, and so their loop devices, busy until its last process ends;
    no unmount in the host's namespace, ``corral node gc``'s included, frees them.
    """
    proc = x.host.root / "proc"

    def ns(pid: str) -> str | None:
        try:
            return os.readlink(proc / pid / "ns" / "mnt")
        except OSError:
            return None

    own, seen, out = ns("self"), set(), []
    wanted = [str(p) for p in prefixes]
    try:
        pids = sorted((d for d in os.listdir(proc) if d.isdigit()), key=int)
    except OSError:
        return []
    for pid in pids:
        mnt = ns(pid)
        if mnt is None or mnt == own or mnt in seen:
            continue
        seen.add(mnt)
        for line in (x.host.read(f"proc/{pid}/mountinfo") or "").splitlines():
            fields = line.split()
            point = fields[4].replace("\\040", " ") if len(fields) > 4 else ""
            if any(point == w or point.startswith(w + "/") for w in wanted):
                comm = (x.host.read(f"proc/{pid}/comm") or "?").strip()
                out.append(f"pid {pid} ({comm})")
                break
    return out


def _leftovers(x: _Ctx) -> Check:
    cfg = x.config
    found = {k: v for k, v in x.probes.leftovers(cfg).items() if v}
    if x.probes.node_running(cfg.state_dir):
        return _c(
            "leftovers",
            True,
            f"a node is running on {cfg.state_dir}: its {leaks.total(found)} mounts, cgroups, "
            "containers... are in use",
        )
    live = x.probes.live_ids(cfg.state_dir)
    orphans: dict[str, list[str]] = {}
    for kind, items in found.items():
        for item in items:
            ids = set(_SANDBOX_ID.findall(item))
            if kind == "processes":
                ids = set(_SANDBOX_ID.findall(x.host.read(f"proc/{item}/cgroup") or ""))
            # Shared parts (layer mounts, the scratch fs, the fd holder) serve live sandboxes.
            if (ids and not ids & live) or (not ids and not live):
                orphans.setdefault(kind, []).append(item)
    kept = f"; {len(live)} sandboxes recorded live (the next node adopts them)" if live else ""
    if not orphans:
        return _c("leftovers", True, f"none on {cfg.state_dir} and {cfg.run_dir}{kept}")
    shown = ", ".join(f"{len(v)} {k}" for k, v in orphans.items())
    items = [i for v in orphans.values() for i in v]
    sample = next((i for i in items if _SANDBOX_ID.search(i)), items[0])
    where = "" if cfg.state_dir == NodeConfig().state_dir else f" --state-dir {cfg.state_dir}"
    fix = f"corral{where} node gc (or start the node: it recovers them)"
    held = ""
    if orphans.keys() & {"mounts", "loop_devices"}:
        pinned = _pinned_by(x, [cfg.state_dir, cfg.run_dir])
        if pinned:
            held = f"; copies of its mounts are held in the mount namespaces of {', '.join(pinned[:3])}"
            fix = (
                "end those processes (their mount namespace was made while the node's mounts "
                f"were up, and keeps them busy), then {fix}"
            )
    return _c("leftovers", False, f"a stopped node left {shown} (e.g. {sample}){held}{kept}", fix)


_REQUIRED = (
    _root,
    _runtime,
    _userns,
    _cgroups,
    _erofs,
    _overlay,
    _btrfs,
    _seccomp_notify,
    _nftables,
    _helpers,
    _disk,
)
"""The checks that can fail fatally (what :meth:`Node.open` needs to run)."""


def run_checks(
    config: NodeConfig,
    *,
    root: Path = Path("/"),
    probes: Probes | None = None,
    fatal_only: bool = False,
) -> list[Check]:
    """Every check of ``corral doctor`` for a node with ``config``, in display order.

    ``fatal_only``: only the checks that can stop a node (a node's start: ~20 ms here,
    skipping the leftover scan of every process's cgroup, which its recovery redoes).
    ``root``: where the kernel's /proc, /sys, /dev and /lib/modules are read (tests use a
    fake tree); ``probes``: the system calls and commands (see :class:`Probes`).
    """
    x = _Ctx(config, _Host(Path(root)), probes or Probes())
    if fatal_only:
        return [check(x) for check in _REQUIRED]
    return [
        _root(x),
        _runtime(x),
        _userns(x),
        _cgroups(x),
        _erofs(x),
        _overlay(x),
        _btrfs(x),
        _seccomp_notify(x),
        _landlock(x),
        _nftables(x),
        _helpers(x),
        _fd_holder(x),
        _disk(x),
        _leftovers(x),
        *_sysctls(x),
        _core_sched(x),
        _criu(x),
    ]


async def check_host(cfg: NodeConfig) -> None:
    """The fatal checks of ``corral doctor`` (~30 ms): a clear refusal at start instead of
    a failure at the first create."""
    bad = fatal_failures(await asyncio.to_thread(run_checks, cfg, fatal_only=True))
    if bad:
        raise HostError(
            "this host cannot serve sandboxes: "
            + "; ".join(f"{c.name}: {c.detail} ({c.fix})" for c in bad)
            + "; `corral doctor` lists every check"
        )
