"""corral's own container launcher: a sandbox from its OCI config without an OCI runtime.

``crun run`` costs ~30 ms of CPU per sandbox (a 300 KB dynamically linked program that
parses, validates and generalises the config, forks twice, compiles seccomp); the kernel
work a corral sandbox needs (namespaces, mounts, the root switch, exec) costs a few ms.
:func:`plan` translates the config that :func:`corral.backends.oci.build_config` built,
the one statement of a sandbox's security posture, into a flat list of steps; the small
static program ``corral-launch`` (``corral/init/corral-launch.c``) executes them and execs
corral-init as PID 1. Anything in the config that the translation does not know is an
error, never silently dropped.

The node does not start the launcher itself: its spawn server does (corral-spawnd,
:mod:`corral.host.spawnd`), so a launch copies the server's few fds, not the node's ~2 per
live sandbox.

The node makes the sandbox's cgroups with their limits (:meth:`Cgroups.create`) before the
launch; the launcher joins them before it clones, so the sandbox never runs outside them.
The init's host pid is recorded as ``<root>/<id>`` (pid and start time, on tmpfs) so a
restarted node finds it and never mistakes a reused pid for it.

Example::

    ln = Launcher.detect(cgroups, root=Path("/run/corral/launch"), helper_dir=bin_dir)
    pid = await ln.start("sb-1", config, ctl_fd=sock.fileno(), owner=165536)
    ln.init_pid("sb-1") == pid
    await ln.delete("sb-1")            # kills what the cgroup holds, forgets the record
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import resource
import signal
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import HostError
from corral.host import _sys, cbuild, mounts, spawnd
from corral.host._aio import reap
from corral.host._sys import read_small
from corral.host.cgroups import CgroupPool, Cgroups
from corral.host.runtime import _TMPFS_MAGIC
from corral.host.seccomp_bpf import compile_profile, filter_flags
from corral.policy.caps import cap_mask

__all__ = ["SOURCE", "Launcher", "ensure_built", "plan", "supported"]

log = logging.getLogger("corral.launch")

SOURCE = Path(__file__).parent.parent / "init" / "corral-launch.c"
CFLAGS = ("-static", "-O2", "-Wall", "-s")

# mount(2) flags of the OCI mount options corral's configs use.
_MS = {
    "ro": 0x1,
    "nosuid": 0x2,
    "nodev": 0x4,
    "noexec": 0x8,
    "noatime": 0x400,
    "nodiratime": 0x800,
    "relatime": 0x200000,
    "strictatime": 0x1000000,
}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_RELATIME = 0x1, 0x2, 0x4, 0x8, 0x200000
_NAMESPACES = {"pid", "mount", "ipc", "uts", "cgroup", "user", "network"}
# What runc and crun put in /dev of every container (the config's device list is empty).
_DEVICES = ("null", "zero", "full", "tty", "random", "urandom")
_DEV_LINKS = (
    ("/proc/self/fd", "/dev/fd"),
    ("/proc/self/fd/0", "/dev/stdin"),
    ("/proc/self/fd/1", "/dev/stdout"),
    ("/proc/self/fd/2", "/dev/stderr"),
    ("pts/ptmx", "/dev/ptmx"),
    ("/proc/kcore", "/dev/core"),
)
# The devices cgroup (v1) of those: crun's default allow list.
_DEVICES_ALLOW = (
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 5:0 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
)
POOL_SIZE = 16
"""Pre-made cgroups per limits (:class:`CgroupPool`); the node keeps two limits' pools."""
FAULT_ENV = "CORRAL_LAUNCH_FAULT"
"""Test hook: the name of a launcher step (see corral-launch.c) before which it crashes."""
POOL_ENV = "CORRAL_CGROUP_POOL"
"""Bench hook: ``SIZE[,QUIET_MS]`` sets the pool's size per limits (0: no pool) and how
long after the last create its filler waits (default ``16,50``)."""
SPAWN_ENV = "CORRAL_LAUNCH_SPAWN"
"""Bench/test hook: ``direct`` makes the node posix_spawn each launcher itself (the path
before the spawn server, kept for A/B measurements and as the fallback)."""


def ensure_built(out_dir: Path) -> Path:
    """Compile corral-launch into ``out_dir`` unless this source version is there."""
    return cbuild.build_static("corral-launch", SOURCE.read_bytes(), CFLAGS, out_dir)


def supported() -> str | None:
    """Why this host cannot use the launcher (None: it can): it needs openat2 (5.6),
    mount_setattr (5.12) and libseccomp."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return f"cannot read the kernel version {os.uname().release!r}"
    if (major, minor) < (5, 12):
        return f"kernel {os.uname().release} is older than 5.12 (mount_setattr)"
    try:
        from corral.host.seccomp_bpf import _libseccomp

        _libseccomp()
    except HostError as e:
        return e.message
    return None


def _sep(*parts: str) -> str:
    for p in parts:
        if "\t" in p or "\0" in p:
            raise HostError(f"launch: a tab or NUL in {p!r} (mount paths and options)")
    return "\t".join(parts)


def _flags(options: Sequence[str]) -> tuple[int, list[str], bool, bool]:
    """(MS_* flags, data options, recursive bind, recursively read-only) of OCI options."""
    flags, data, rec, rro = 0, [], False, False
    for o in options:
        if o in _MS:
            flags |= _MS[o]
        elif o == "bind":
            pass
        elif o == "rbind":
            rec = True
        elif o == "rro":
            rro = True
        elif o in ("rw", "private", "rprivate"):
            pass
        else:
            data.append(o)
    return flags, data, rec, rro


@dataclass
class Plan:
    """What the launcher is told: its argv (after the binary) and the BPF to hand it."""

    args: list[str]
    bpf: bytes | None = None
    seccomp_flags: int = 0
    cgroups: list[Path] = field(default_factory=list)


def plan(
    config: dict[str, Any],
    *,
    sandbox_id: str,
    owner: int,
    cgroup_procs: Sequence[Path],
    cgroup_mounts: Sequence[tuple[str, str]],
    cgroup_v2: bool,
    cpu_procs: Sequence[Path] = (),
    bpf: bytes | None = None,
    rootfs_fd: bool = False,
    cgroup_tree: str | None = None,
    policy: int | None = None,
    nice_limit: tuple[int, int] | None = None,
) -> Plan:
    """The launcher's instructions for ``config`` (see the module docstring).

    ``cgroup_procs``: the sandbox's cgroup.procs files joined before the clone;
    ``cpu_procs``: those joined once the mounts are made, just before the sandbox's cgroup
    namespace is made (the cpu ones: the launcher's work is the node's, not done on a
    best-effort sandbox's idle CPU; crun's work is not either).
    ``cgroup_mounts``: (name under /sys/fs/cgroup, mount options) of each v1 hierarchy the
    sandbox has a cgroup of its own in: only those are mounted in the guest (a hierarchy
    where it has none would show the node's cgroup). ``bpf``: the compiled seccomp filter
    if the caller has it cached (else it is compiled here). ``rootfs_fd``: the rootfs is a
    detached mount the launcher gets on fd 6 and the mount namespace to start from the
    node's template on fd 7 (option ``-t``; see :meth:`Launcher.start`); the config's root
    path is then not used. ``cgroup_tree``: (v1) a host directory holding an empty
    directory per name of ``cgroup_mounts``, bound read-only as /sys/fs/cgroup instead of
    a tmpfs per sandbox (one superblock less each; see :meth:`Launcher.cgroup_tree`).
    ``policy``: the init's scheduling policy (``os.SCHED_*``), set by the launcher just
    before the init's exec; ``nice_limit``: its RLIMIT_NICE (soft, hard), set before the
    clone (:func:`corral.policy.qos.settings`: what ``qos.apply`` would do after).

    With ``rootfs_fd`` and no network namespace to join (a loopback-only one of its own),
    /sys is a read-only bind of the template's sysfs, made in a network namespace of its
    own (step ``tbind``): one sysfs superblock for all such sandboxes of the node, which
    shows no host interface and no other sandbox's.

    A tmpfs at /dev/shm beside the /dev tmpfs becomes a directory of /dev (one superblock
    less per sandbox): /dev takes both sizes and both mounts' flags (the stricter union,
    so /dev/shm stays nosuid, nodev, noexec; /dev holds only binds and links).
    """
    proc, linux = config["process"], config["linux"]
    if proc.get("terminal") or proc.get("user", {}) != {"uid": 0, "gid": 0}:
        raise HostError("launch: only a non-terminal process as uid 0 is supported")
    if not proc.get("noNewPrivileges"):
        raise HostError("launch: configs without noNewPrivileges are not supported")
    if len(proc["args"]) != 1 or proc.get("cwd", "/") != "/":
        raise HostError(f"launch: the process must be one program in / ({proc['args']})")
    args: list[str] = ["-x", proc["args"][0]]
    for e in proc.get("env", []):
        args += ["-e", e]
    for r in proc.get("rlimits", []):
        res = getattr(resource, r["type"])
        args += ["-r", f"{int(res)}:{int(r['soft'])}:{int(r['hard'])}"]
    caps = proc.get("capabilities")
    if caps is not None:
        masks = [
            cap_mask(caps.get(k, []))
            for k in ("bounding", "effective", "permitted", "inheritable", "ambient")
        ]
        args += ["-C", ":".join(f"{m:x}" for m in masks)]
    if "oomScoreAdj" in proc:
        args += ["-o", str(int(proc["oomScoreAdj"]))]
    if nice_limit is not None:
        args += ["-r", f"{resource.RLIMIT_NICE}:{nice_limit[0]}:{nice_limit[1]}"]
    if policy is not None:
        args += ["-P", str(policy)]
    args += ["-h", config["hostname"]]

    nss = {n["type"]: n.get("path") for n in linux["namespaces"]}
    if set(nss) != _NAMESPACES:
        raise HostError(f"launch: namespaces {sorted(nss)} are not {sorted(_NAMESPACES)}")
    if any(nss[t] for t in _NAMESPACES - {"network", "user"}):
        raise HostError("launch: only the network and user namespaces may be joined")
    if nss["network"]:
        args += ["-n", nss["network"]]
    else:
        args.append("-N")
    maps = linux.get("uidMappings")
    if not maps or maps != linux.get("gidMappings") or len(maps) != 1:
        raise HostError("launch: needs one uid mapping, the same for gids")
    (m,) = maps
    if m["containerID"] != 0:
        raise HostError("launch: the mapping must start at id 0")
    args += ["-m", f"{m['hostID']}:{m['size']}", "-u", str(owner)]
    for p in cgroup_procs:
        args += ["-c", str(p)]
    for p in cpu_procs:
        args += ["-k", str(p)]

    out = Plan(args=args, cgroups=list(cgroup_procs))
    seccomp = linux.get("seccomp")
    if seccomp:
        out.bpf = bpf if bpf is not None else compile_profile(seccomp)
        out.seccomp_flags = filter_flags(seccomp)
        args += ["-s", f"{out.seccomp_flags:x}"]
        if seccomp.get("listenerPath"):
            args += ["-l", _sep(seccomp["listenerPath"], sandbox_id)]

    if rootfs_fd:
        args.append("-t")
    steps = [_sep("root", "-" if rootfs_fd else config["root"]["path"])]
    cg_steps = ["cgns"]
    has_dev = False
    shm = _shm_in_dev(config["mounts"])
    for mnt in config["mounts"]:
        dst, typ, src = mnt["destination"], mnt["type"], mnt.get("source", "")
        flags, data, rec, rro = _flags(mnt.get("options", []))
        if shm is not None and dst == "/dev":
            flags |= shm[0]
            data = [d for d in data if not d.startswith("size=")]
            data.append(f"size={_size(mnt['options']) + shm[2]}")
        if shm is not None and dst == "/dev/shm":
            steps.append(_sep("dir", dst, f"{shm[1]:o}"))
        elif typ == "bind":
            steps.append(_sep("bind", src, dst, f"{flags:x}", "1" if rec else "0"))
            if rro:
                steps.append(_sep("rro", dst))
        elif typ == "sysfs" and rootfs_fd and not nss["network"]:
            # The template's sysfs (of a loopback-only netns of its own): one superblock
            # for all no-network sandboxes; a sysfs each cost a superblock (shrinker
            # slots in every memory cgroup) and every sysfs mount walks all of them (sget).
            if data:
                raise HostError(f"launch: sysfs options {data} are not supported")
            steps.append(_sep("tbind", "/sys", dst, f"{flags:x}"))
        elif typ == "cgroup":
            # After the cgroup namespace exists (see corral-launch.c, step cgns).
            cg_steps += _cgroup_steps(dst, flags, cgroup_mounts, cgroup_v2, cgroup_tree)
        else:
            steps.append(_sep("fs", typ, src, dst, f"{flags:x}", ",".join(data)))
        has_dev = has_dev or dst == "/dev"
    if has_dev:
        for d in _DEVICES:
            # As crun does it in a user namespace: the host's node, bound (no mknod here).
            steps.append(
                _sep("bind", f"/dev/{d}", f"/dev/{d}", f"{_MS_NOSUID | _MS_NOEXEC:x}", "0")
            )
        for target, link in _DEV_LINKS:
            steps.append(_sep("ln", target, link))
    steps += [_sep("mask", p) for p in linux.get("maskedPaths", [])]
    steps += [_sep("ro", p) for p in linux.get("readonlyPaths", [])]
    steps += cg_steps
    # The template's copy: move + chroot (no pivot_root walk of every host task); a host
    # path rootfs comes with the host's whole mount table, which pivot_root detaches.
    steps.append("enter" if rootfs_fd else "pivot")
    if config["root"].get("readonly"):
        steps.append("roroot")
    if linux.get("rootfsPropagation", "private") != "private":
        raise HostError("launch: only private rootfs propagation is supported")
    args += ["--", *steps]
    return out


def _size(options: Sequence[str]) -> int:
    """A tmpfs ``size=`` option in bytes (k, m, g suffixes; no %)."""
    for o in options:
        if o.startswith("size="):
            v = o[5:].lower()
            mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(v[-1:], 1)
            try:
                return int(v.rstrip("kmg")) * mult
            except ValueError:
                break
    raise HostError(f"launch: a tmpfs needs a size=N[kmg] option ({list(options)})")


def _shm_in_dev(mnts: Sequence[dict[str, Any]]) -> tuple[int, int, int] | None:
    """(MS_* flags, mode, size) of a /dev/shm tmpfs that can be a directory of the /dev
    tmpfs (both tmpfs, /dev/shm with nothing but flags, mode and size), else None."""
    by_dst = {m["destination"]: m for m in mnts}
    dev, shm = by_dst.get("/dev"), by_dst.get("/dev/shm")
    if not dev or not shm or dev["type"] != "tmpfs" or shm["type"] != "tmpfs":
        return None
    flags, data, _, _ = _flags(shm.get("options", []))
    mode = 0o1777
    for d in data:
        if d.startswith("mode="):
            mode = int(d[5:], 8)
        elif not d.startswith("size="):
            raise HostError(f"launch: /dev/shm option {d!r} is not supported")
    return flags, mode, _size(shm.get("options", []))


def _cgroup_steps(
    dst: str,
    flags: int,
    hierarchies: Sequence[tuple[str, str]],
    v2: bool,
    tree: str | None = None,
) -> list[str]:
    """The guest's /sys/fs/cgroup, as crun mounts it: v2 one read-only cgroup2; v1 a
    tmpfs with each hierarchy the sandbox has a cgroup in, read-only, then the tmpfs too.
    With ``tree`` (v1) the tmpfs is a read-only bind of that node-wide directory instead."""
    ro = flags | _MS_RDONLY
    if v2:
        return [_sep("fs", "cgroup2", "cgroup", dst, f"{ro:x}", "")]
    base = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RELATIME
    if tree is not None:
        steps = [_sep("bind", tree, dst, f"{base | _MS_RDONLY:x}", "0")]
        for name, opts in hierarchies:
            steps.append(_sep("fs", "cgroup", "cgroup", f"{dst}/{name}", f"{ro:x}", opts))
        return steps
    steps = [_sep("fs", "tmpfs", "cgroup", dst, f"{base:x}", "mode=755,size=1024k")]
    for name, opts in hierarchies:
        steps.append(_sep("fs", "cgroup", "cgroup", f"{dst}/{name}", f"{ro:x}", opts))
    steps.append(_sep("remount", dst, f"{_MS_RDONLY | base:x}"))
    return steps


_RECORDS_TMPFS_SIZE = 1 << 30
"""A cap, not an allocation: a record takes a page (4 KiB), so the 16 MiB this once was
held 4,096 sandboxes and the 4,097th create failed with ENOSPC (`bench density --count
10000`); 1 GiB holds 262,144."""


class Launcher:
    """Starts sandboxes with corral-launch; keeps a record per sandbox under ``root``.

    Duck-compatible with the parts of :class:`corral.host.runtime.OCIRuntime` the container
    backend uses for cleanup (``root``, ``list``, ``delete``, ``forget_stopped``)."""

    name = "launch"

    def __init__(
        self,
        binary: Path,
        root: Path,
        cgroups: Cgroups,
        *,
        root_tmpfs: bool = False,
        spawn_server: Path | None = None,
    ) -> None:
        self.binary = str(binary)
        self._spawnd_bin = spawn_server
        self._spawnd: spawnd.SpawnServer | None = None
        self.root = root
        self.cgroups = cgroups
        self._bpf: dict[str, tuple[bytes, int]] = {}
        self._bpf_by_id: dict[int, tuple[dict[str, Any], tuple[bytes, int]]] = {}
        self._template = -1
        self._template_net = -1
        self._tree: Path | None = None
        self._tree_names: set[str] = set()
        self.pool: CgroupPool | None = None
        self._cgroup_thread: ThreadPoolExecutor | None = None
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # The records on a tmpfs of their own where root is on a disk filesystem (this VM's
        # /run: ext4, ~0.3-0.6 ms per new file under churn), as OCIRuntime does for --root.
        if root_tmpfs and _sys.fs_type(root) != _TMPFS_MAGIC and not any(root.iterdir()):
            try:
                mounts.mount_tmpfs(root, size=_RECORDS_TMPFS_SIZE, mode=0o700)
            except HostError as e:  # only slower without it
                log.warning("launch records stay on disk: %s", e.message)

    @classmethod
    def detect(cls, cgroups: Cgroups, *, root: Path, helper_dir: Path) -> Launcher:
        """A launcher, or HostError naming what this host lacks for one."""
        why = supported()
        if why is not None:
            raise HostError(f"corral-launch cannot run here: {why}")
        server = None
        if os.environ.get(SPAWN_ENV) != "direct":
            server = spawnd.ensure_built(helper_dir)
        ln = cls(ensure_built(helper_dir), root, cgroups, root_tmpfs=True, spawn_server=server)
        ln.template()  # at start: a host where it cannot be made fails here, not per create
        ln.spawn_server()  # at start, while the node holds few fds (see corral/host/spawnd.py)
        return ln

    def spawn_server(self) -> spawnd.SpawnServer | None:
        """The node's spawn server (started on first use; None: launch directly). Start
        it from the event loop's thread (see :class:`corral.host.spawnd.SpawnServer`)."""
        if self._spawnd is None and self._spawnd_bin is not None:
            self._spawnd = spawnd.SpawnServer(self._spawnd_bin, self.binary)
        return self._spawnd

    def template(self) -> int:
        """An fd of the node's template mount namespace, made on first use (see
        corral-launch.c, ``-T``): a sandbox's mount namespace is a copy of it (3 mounts)
        instead of the node's (every mount on the host, so a create got slower with every
        sandbox alive while rootfs overlays were mounted there). It lives while the fd is
        open; a restarted node makes a new one (sandboxes keep their own copies)."""
        if self._template >= 0:
            return self._template
        # A directory that exists: the tmpfs is mounted over it in the template's namespace
        # only (private from its first call), never in the node's.
        cmd = [self.binary, "-T", str(self.root)]
        # Safe: corral's own launcher, making a private mount namespace of its own.
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            pass_fds=(),
            close_fds=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            ready = proc.stdout.readline()
            if ready != b"READY\n":
                why = (ready + proc.stdout.read()).decode(errors="replace").strip()
                raise HostError(f"corral-launch: the template mount namespace: {why}")
            self._template = os.open(f"/proc/{proc.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            # The template's sysfs (bound by no-network sandboxes) holds its network
            # namespace only passively: kept alive here, so /sys/class/net shows its `lo`
            # (up; never the host's interfaces) as a sysfs of the sandbox's own did.
            self._template_net = os.open(f"/proc/{proc.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            proc.stdin.close()
            proc.stdout.close()
            proc.wait()
        return self._template

    def close(self) -> None:
        if self._cgroup_thread is not None:  # a create in flight finishes its cgroups first
            self._cgroup_thread.shutdown(wait=True)
            self._cgroup_thread = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._spawnd is not None:
            self._spawnd.close()
            self._spawnd = None
        if self._template >= 0:
            os.close(self._template)
            self._template = -1
        if self._template_net >= 0:
            os.close(self._template_net)
            self._template_net = -1
        for _, fd in self._bpf.values():
            os.close(fd)
        self._bpf.clear()
        self._bpf_by_id.clear()

    def teardown(self) -> None:
        """Unmount the records' tmpfs (if it made one) once no sandbox is left."""
        with contextlib.suppress(OSError, HostError):
            if (
                mounts.is_mountpoint(self.root)
                and _sys.fs_type(self.root) == _TMPFS_MAGIC
                and not any(self.root.iterdir())
            ):
                mounts.umount(self.root)

    # -- cgroups ----------------------------------------------------------------------

    def start_pool(self) -> None:
        """Hand out pre-made sandbox cgroups at create (see :class:`CgroupPool`); v1 and
        hybrid only (cgroup2 cannot rename a cgroup). Stopped by :meth:`close`."""
        size, quiet = POOL_SIZE, 0.05
        spec = os.environ.get(POOL_ENV)
        if spec:
            try:
                parts = [int(x) for x in spec.split(",")]
                size, quiet = parts[0], (parts[1] / 1000 if len(parts) > 1 else quiet)
            except (ValueError, IndexError):
                raise HostError(f"{POOL_ENV}={spec!r}: want SIZE[,QUIET_MS]") from None
        if self.pool is None and self.cgroups.mode != "v2" and size > 0:
            self.pool = CgroupPool(self.cgroups, size=size, quiet=quiet)
            self.pool.start()

    def make_cgroup(
        self, sandbox_id: str, resources: dict[str, Any], latency: bool
    ) -> tuple[list[Path], list[Path]]:
        """The sandbox's cgroups with the config's limits; returns their cgroup.procs files.

        The same values the OCI runtime writes from ``linux.resources``: memory and
        memory+swap, CFS quota/period, pids.max, and (v1) the devices allow list. Returns
        the cgroup.procs files to join before the clone and those (cpu) to join late.
        With :meth:`start_pool`, a pre-made cgroup of the same limits is renamed instead."""
        mem = resources["memory"]
        cpu = resources["cpu"]
        devices = None
        if self.cgroups.devices_root is not None:
            if resources.get("devices") != [{"allow": False, "access": "rwm"}]:
                raise HostError("launch: only the deny-all device list is supported")
            devices = _DEVICES_ALLOW
        limits: dict[str, Any] = {
            "cpus": cpu["quota"] / cpu["period"],
            "memory": int(mem["limit"]),
            "pids": int(resources["pids"]["limit"]),
            "swap": int(mem["swap"]) - int(mem["limit"]),
            "latency": latency,
            "devices": devices,
        }
        if self.pool is not None:
            self.pool.create(sandbox_id, **limits)
        else:
            self.cgroups.create(sandbox_id, **limits)
        procs = self.cgroups.procs_files(sandbox_id)
        cpu_roots = {self.cgroups.hierarchy("cpu")}
        with contextlib.suppress(KeyError):
            cpu_roots.add(self.cgroups.hierarchy("cpuacct"))
        late = [p for p in procs if p.parents[2] in cpu_roots]
        procs = [p for p in procs if p not in late]
        if devices is not None:
            procs.append(self.cgroups.devices_dir(sandbox_id, latency) / "cgroup.procs")
        return procs, late

    async def make_cgroup_async(
        self, sandbox_id: str, resources: dict[str, Any], latency: bool
    ) -> tuple[list[Path], list[Path]]:
        """:meth:`make_cgroup` in the launcher's cgroup thread, off the event loop.

        Every cgroup mkdir, rename and rmdir on the host, and every write to a v1
        cgroup.procs, takes the kernel's one cgroup mutex; a cgroup.procs write also takes
        the threadgroup rwsem for writing while holding it, which waits for an RCU grace
        period (several ms, tens under load on 2 cores). The launchers write cgroup.procs
        of five hierarchies each, so at 8 creates in flight the node's mkdir or rename
        waited behind them, on the loop: each wait (8-30 ms, seen in the loop thread's
        kernel stack: ``cgroup_kn_lock_live``, ``cgroup1_rename``) stalled every other
        create and exec, and made the c8 bench's tail. One thread for all creates (the
        mutex lets one through at a time anyway), at the node's priority (a nice thread
        that held the GIL would make the loop wait for it). If the caller is cancelled the
        thread's work still completes before the cancel goes on, so the create's undo
        finds the cgroups it removes."""
        if self._cgroup_thread is None:
            self._cgroup_thread = ThreadPoolExecutor(1, thread_name_prefix="corral-cgroup")
        job = asyncio.get_running_loop().run_in_executor(
            self._cgroup_thread, self.make_cgroup, sandbox_id, resources, latency
        )
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            await asyncio.wait([job])
            raise

    def use_cgroup_tree(self, tree: Path) -> None:
        """Bind ``tree`` (a directory on a node-wide tmpfs, so its root in the guest's
        mountinfo names no host path) read-only as every v1 sandbox's /sys/fs/cgroup,
        instead of a tmpfs each; its subdirectories are made as hierarchies are used."""
        tree.mkdir(mode=0o755, exist_ok=True)
        self._tree, self._tree_names = tree, set()

    def _tree_for(self, names: Sequence[tuple[str, str]]) -> str | None:
        if self._tree is None or self.cgroups.mode == "v2":
            return None
        for name, _ in names:
            if name not in self._tree_names:
                (self._tree / name).mkdir(mode=0o555, exist_ok=True)
                self._tree_names.add(name)
        return str(self._tree)

    def cgroup_mounts(self, procs: Sequence[Path]) -> list[tuple[str, str]]:
        """(name under /sys/fs/cgroup, options) of each v1 hierarchy that ``procs`` (the
        sandbox's cgroup.procs files, ``<hierarchy>/<top>/<id>/cgroup.procs``) lie in."""
        if self.cgroups.mode == "v2":
            return []
        roots = {p.parents[2] for p in procs}
        return sorted((r.name, r.name) for r in roots)

    # -- start ------------------------------------------------------------------------

    def _bpf_fd(self, profile: dict[str, Any]) -> tuple[bytes, int]:
        """The compiled filter of ``profile`` and a sealed memfd holding it (one per
        distinct profile, compiled once: ~20 ms).

        Every sandbox's config holds the same read-only profile object
        (:func:`corral.policy.seccomp.shared_profile`), so it is looked up by identity
        first: hashing its JSON cost ~1-2 ms per create. The object is kept referenced
        while cached, so its id cannot be reused by another profile."""
        by_id = self._bpf_by_id.get(id(profile))
        if by_id is not None and by_id[0] is profile:
            return by_id[1]
        key = hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()
        got = self._bpf.get(key)
        if got is None:
            bpf = compile_profile(profile)
            fd = os.memfd_create("corral-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.write(fd, bpf)
            fcntl.fcntl(
                fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE,
            )
            got = self._bpf[key] = (bpf, fd)
        if len(self._bpf_by_id) < 64:  # distinct profile objects: a handful per node
            self._bpf_by_id[id(profile)] = (profile, got)
        return got

    async def start(
        self,
        sandbox_id: str,
        config: dict[str, Any],
        *,
        ctl_fd: int,
        owner: int,
        cgroup_procs: Sequence[Path],
        cpu_procs: Sequence[Path] = (),
        rootfs_fd: int = -1,
        policy: int | None = None,
        nice_limit: tuple[int, int] | None = None,
    ) -> int:
        """Start the sandbox; returns its init's host pid once the init runs (exec'd).

        ``rootfs_fd``: the sandbox's rootfs as a detached mount (:func:`mounts.overlay_fd`):
        the launcher attaches it in the sandbox's own mount namespace, made from the
        template (:meth:`template`), so it never appears in the host's; the caller closes
        its fd afterwards. Else the config's root path (a host mount) is bound.

        HostError with the launcher's one-line report (which step, which errno) on
        failure; the caller's undo removes the cgroup (and with it anything the launcher
        started)."""
        bpf_fd = -1
        bpf = None
        seccomp = config["linux"].get("seccomp")
        if seccomp:
            bpf, bpf_fd = self._bpf_fd(seccomp)
        cg_mounts = self.cgroup_mounts([*cgroup_procs, *cpu_procs])
        p = plan(
            config,
            sandbox_id=sandbox_id,
            owner=owner,
            cgroup_procs=cgroup_procs,
            cgroup_mounts=cg_mounts,
            cgroup_tree=self._tree_for(cg_mounts),
            cpu_procs=cpu_procs,
            cgroup_v2=self.cgroups.mode == "v2",
            bpf=bpf,
            rootfs_fd=rootfs_fd >= 0,
            policy=policy,
            nice_limit=nice_limit,
        )
        template = self.template() if rootfs_fd >= 0 else -1
        argv = [self.binary]
        fault = os.environ.get(FAULT_ENV)
        if fault:
            argv += ["-F", fault]
        argv += p.args
        rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
        server = self.spawn_server()
        try:
            if server is not None:
                fds = {3: ctl_fd, 4: rep_w, 5: bpf_fd, 6: rootfs_fd, 7: template}
                sent = {t: fd for t, fd in fds.items() if fd >= 0}
                job = asyncio.ensure_future(server.wait(await server.submit(argv[1:], sent)))
            else:
                pid = _spawn(argv, ctl_fd, rep_w, bpf_fd, rootfs_fd, template)
                job = asyncio.ensure_future(reap(pid))
        except BaseException:
            os.close(rep_r)
            os.close(rep_w)
            raise
        os.close(rep_w)
        try:
            # Like the runtime's: a cancelled create still lets the launcher finish, so
            # the undo finds (and kills) what it started.
            try:
                code = await _outlive_cancel(job)
            except HostError as e:  # the spawn server's (it died, or refused the request)
                raise HostError(f"corral-launch {sandbox_id}: {e.message}") from None
            report = _read_all(rep_r).decode(errors="replace").strip()
        finally:
            os.close(rep_r)
        if code != 0 or not report.startswith("PID "):
            why = report.removeprefix("ERR ") or f"exit status {code}, no report"
            raise HostError(f"corral-launch {sandbox_id}: {why}")
        init = int(report.split()[1])
        self._record(sandbox_id, init)
        return init

    # -- records ----------------------------------------------------------------------

    def _path(self, sandbox_id: str) -> Path:
        if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise HostError(f"launch: bad sandbox id {sandbox_id!r}")
        return self.root / sandbox_id

    def _record(self, sandbox_id: str, pid: int) -> None:
        start = _start_time(pid)
        if start is None:
            raise HostError(f"corral-launch {sandbox_id}: its init (pid {pid}) is gone")
        tmp = self.root / f".{sandbox_id}.tmp"
        # No fsync: a record never outlives a host crash (its sandbox dies with the host).
        tmp.write_text(f"{pid} {start}\n")
        os.replace(tmp, self._path(sandbox_id))

    def init_pid(self, sandbox_id: str) -> int | None:
        """The init's host pid, if the recorded process still exists (same start time)."""
        try:
            pid_s, start = read_small(self._path(sandbox_id)).decode().split()
        except (OSError, ValueError):
            return None
        pid = int(pid_s)
        return pid if _start_time(pid) == start else None

    def open_root(self, sandbox_id: str) -> int:
        """A directory fd of the sandbox's root as its init sees it (``/proc/<pid>/root``):
        its rootfs is mounted in its own mount namespace only. Works after a node restart
        (nothing is held). The pid is checked against the record before and after the
        open, so the fd is never another process's root (a reused pid has another start
        time). HostError once the sandbox is gone."""
        pid = self.init_pid(sandbox_id)
        if pid is None:
            raise HostError("the sandbox's root filesystem is not available (no init)")
        try:
            # Safe: host root opening the root of corral's own sandbox init, to resolve
            # guest paths in it with openat2(RESOLVE_IN_ROOT) (backends/files.py).
            fd = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            raise HostError("the sandbox's root filesystem is not available") from None
        if self.init_pid(sandbox_id) != pid:
            os.close(fd)
            raise HostError("the sandbox's root filesystem is not available (init gone)")
        return fd

    async def list(self) -> list[dict[str, Any]]:
        """Every sandbox with a record (what gc compares with the live ones)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [{"id": n} for n in names if not n.startswith(".")]

    async def delete(self, sandbox_id: str, force: bool = True) -> None:
        """Kill every process of the sandbox's cgroup (``force``) and forget it."""
        if force:
            for _ in range(500):
                try:
                    left = self.cgroups.procs(sandbox_id)
                except HostError:
                    break  # no cgroup
                if not left:
                    break
                for p in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(p, signal.SIGKILL)  # Safe: a pid read from its cgroup
                await asyncio.sleep(0.002)
        self.forget_stopped(sandbox_id)

    def forget_stopped(self, sandbox_id: str) -> None:
        self._path(sandbox_id).unlink(missing_ok=True)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in ticks since boot): with the pid, an
    identity no later process can have."""
    try:
        return read_small(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _spawn(
    argv: list[str],
    ctl_fd: int,
    report_fd: int,
    bpf_fd: int,
    rootfs_fd: int = -1,
    template_fd: int = -1,
) -> int:
    """(``CORRAL_LAUNCH_SPAWN=direct``; else the spawn server starts it)
    posix_spawn (vfork-style: no copy of the agent) with fds 3 (control socket),
    4 (report pipe), 5 (BPF program), 6 (the rootfs mount), 7 (the template mount
    namespace) and stdio on /dev/null."""
    dups: list[int] = []
    srcs = (ctl_fd, report_fd, bpf_fd, rootfs_fd, template_fd)
    try:
        # Above 9, so the dup2s below never have source == target (which would keep CLOEXEC).
        for fd in srcs:
            dups.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) if fd >= 0 else -1)
        actions: list[tuple[Any, ...]] = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
        ]
        for target, src in zip((3, 4, 5, 6, 7), dups, strict=True):
            if src >= 0:
                actions.append((os.POSIX_SPAWN_DUP2, src, target))
        # Safe: runs corral's own launcher with the sandbox's plan; only fds 0-7 cross.
        return os.posix_spawn(argv[0], argv, {}, file_actions=actions)
    finally:
        for d in dups:
            if d >= 0:
                os.close(d)


async def _outlive_cancel(job: asyncio.Future[int]) -> int:
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job], timeout=30)
        raise


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 4096):
            out += chunk
    return out
