"""OCI runtime configuration (config.json) of a container sandbox.

One function builds the whole security posture of a sandbox from corral's policy room:
user namespace (guest root = an unprivileged host uid), fresh pid/mount/ipc/uts/cgroup
namespaces, a network namespace (new and empty, or one the node prepared), minimal
capabilities, no_new_privs, corral's seccomp profile, masked /proc and /sys, cgroup limits.
PID 1 is corral-init, bind-mounted read-only from the host at ``/.corral/init``.

The config is written for runc 1.1 (hybrid cgroup v1 hosts) and crun (pure v2); both read
the same fields.

Example:
    >>> from corral.spec import Limits
    >>> cfg = build_config(rootfs=Path("/srv/sb/rootfs"), init_host_path=Path("/opt/init"),
    ...                    hostname="sandbox", cgroups_path="/corral/sb-x", limits=Limits())
    >>> cfg["process"]["args"], cfg["linux"]["uidMappings"][0]["hostID"]
    (['/.corral/init'], 100000)
"""

from __future__ import annotations

import functools
import json
import os
import resource
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from corral.errors import HostError, InvalidRequest
from corral.policy.caps import oci_capabilities
from corral.policy.masks import MASKED_PATHS, READONLY_PATHS
from corral.policy.seccomp import default_profile, shared_profile  # noqa: F401
from corral.spec import Limits

__all__ = [
    "INIT_PATH",
    "GUEST_PATH_ENV",
    "CPU_PERIOD_US",
    "SHM_SIZE",
    "build_config",
    "write_bundle",
]

INIT_PATH = "/.corral/init"
"""Where corral-init appears inside every sandbox."""
GUEST_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CPU_PERIOD_US = 100_000
SHM_SIZE = 64 << 20
"""/dev/shm size; tmpfs pages are charged to the sandbox's memory cgroup anyway."""
NOFILE_SOFT = 1024
"""select()-safe soft limit; programs that need more raise it up to the hard limit."""
NOFILE_HARD = 65536
"""Open files are kernel memory charged to the sandbox's memory cgroup, so a high hard
limit costs the node nothing it would not charge; without CAP_SYS_RESOURCE it is final."""

_NS_TYPES = ("pid", "mount", "ipc", "uts", "cgroup", "user")
_BASE_FLAGS = ["nosuid", "noexec", "nodev"]


def _mounts(init_host_path: Path) -> list[dict[str, Any]]:
    """The guest's kernel filesystems and the init binary. No tmpfs /tmp: the node's file
    API works on the host view of the overlay, so /tmp must live in the overlay."""
    return [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": _BASE_FLAGS},
        # runc/crun populate /dev with the default nodes (null zero full random urandom tty,
        # ptmx -> pts/ptmx) by bind-mounting the host's in a user namespace.
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=64k"],
        },
        # gid=5 is "tty" in Debian images; it is inside the mapped range.
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": [*_BASE_FLAGS, "mode=1777", f"size={SHM_SIZE}"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": _BASE_FLAGS,
        },
        # A fresh sysfs is only allowed when the network namespace belongs to the sandbox's
        # user namespace; see build_config for the joined-netns case.
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": [*_BASE_FLAGS, "ro"],
        },
        # With a cgroup namespace the guest sees only its own cgroup, read-only.
        {
            "destination": "/sys/fs/cgroup",
            "type": "cgroup",
            "source": "cgroup",
            "options": [*_BASE_FLAGS, "relatime", "ro"],
        },
        # Executable (no noexec), but nothing on it may be a device or gain privileges.
        {
            "destination": INIT_PATH,
            "type": "bind",
            "source": str(init_host_path),
            "options": ["bind", "ro", "nosuid", "nodev"],
        },
    ]


def masks_as_binds(mask_dir: Path) -> list[dict[str, Any]]:
    """The masked paths that are directories here, as read-only binds of ``mask_dir``.

    The runtime hides a masked directory under a fresh read-only tmpfs: ~10 tmpfs
    superblocks per sandbox. Every superblock registers a memcg-aware shrinker, and every
    memory cgroup keeps a slot per shrinker id (``shrinker_info``, ~0.5 KiB per 64 ids in
    kmalloc-1k), so each sandbox's superblocks make every other sandbox's memory cgroup
    bigger: ~270 KiB per cgroup at 1,600 sandboxes, growing with the count. A bind mount
    of one shared empty directory creates no superblock and hides the same: the guest
    sees an empty read-only directory either way, and cannot unmount or remount it
    (seccomp refuses mount and umount, as it did for the tmpfs). Only paths that are
    directories on this host's kernel are converted (the guest's /proc and /sys are of the
    same kernel); the others stay masked by the runtime (a missing destination is skipped
    there, while a bind to a missing one would fail the create).
    """
    return [
        {
            "destination": p,
            "type": "bind",
            "source": str(mask_dir),
            "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
        }
        for p in _dirs_among(tuple(MASKED_PATHS))
    ]


@functools.cache
def _dirs_among(paths: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``paths`` that are directories (not symlinks) on this host's kernel: the
    same for the node's whole life, so asked once, not ~50 stats per create."""
    return tuple(p for p in paths if os.path.isdir(p) and not os.path.islink(p))


def tmpfs_mounts(tmpfs: dict[str, int]) -> list[dict[str, Any]]:
    """Private tmpfs mounts (``SandboxSpec.tmpfs``): mode 1777, no devices or setuid."""
    return [
        {
            "destination": path,
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777", f"size={size}"],
        }
        for path, size in sorted(tmpfs.items())
    ]


def _resources(limits: Limits) -> dict[str, Any]:
    return {
        # Deny every device; the runtime then adds its default set (null, zero, full, tty,
        # random, urandom, pts, ptmx) and nothing else.
        "devices": [{"allow": False, "access": "rwm"}],
        # swap = memory: memory+swap limit equal to the memory limit, i.e. no swap. Pausing
        # raises it explicitly when it reclaims a frozen sandbox to swap.
        "memory": {"limit": limits.memory, "swap": limits.memory},
        "cpu": {"quota": max(1000, round(limits.cpus * CPU_PERIOD_US)), "period": CPU_PERIOD_US},
        "pids": {"limit": limits.pids},
    }


def build_config(
    *,
    rootfs: Path,
    init_host_path: Path,
    hostname: str,
    cgroups_path: str,
    limits: Limits,
    host_uid: int = 100000,
    id_count: int = 65536,
    net_ns: str | None = None,
    extra_mounts: Sequence[dict[str, Any]] = (),
    annotations: dict[str, str] | None = None,
    seccomp: dict[str, Any] | None = None,
    log_denials: bool = False,
    notify: str | None = None,
    readonly_root: bool = False,
    userns_path: Path | None = None,
    userns_mappings: bool = False,
    mask_dir: Path | None = None,
) -> dict[str, Any]:
    """The OCI config.json of one sandbox, as a dict.

    ``rootfs`` is the already-mounted overlay (host path), writable; ``init_host_path`` the
    host path of the static corral-init binary (its directories must be traversable by
    ``host_uid``). ``cgroups_path`` is absolute below each controller's root, e.g.
    ``/corral/<id>``. ``net_ns`` names an existing network namespace to join (bind-mounted
    file, e.g. ``/run/netns/<id>``); None creates a new one that has only loopback.
    ``seccomp`` overrides the profile (tests, other architectures); default
    :func:`corral.policy.seccomp.default_profile` for this machine, with
    ``SECCOMP_FILTER_FLAG_LOG`` when ``log_denials`` (kernel audit record of every refused
    call, for the event log): crun supports it, runc 1.1 refuses to start with it.
    ``notify``: the node's seccomp listener socket (``listenerPath``), which records the
    interesting refused calls as events (:mod:`corral.host.seccomp_notify`).

    ``userns_path``: join this user namespace (made by the node, owned by the sandbox's
    own host uid, see :mod:`corral.host.owners`) instead of having the runtime create
    one; crun then wants no id mappings in the config, runc 1.1 still reads them
    (``userns_mappings``).

    ``mask_dir``: an empty, read-only-bound host directory that hides the masked paths
    that are directories (see :func:`masks_as_binds`) instead of the runtime's tmpfs.

    PID 1's stdio is whatever the caller gives ``runc run`` (it must be /dev/null or
    pipes: /proc/1/fd shows paths); ``--preserve-fds 1`` passes the control socket as fd 3.
    """
    if not rootfs.is_absolute() or not init_host_path.is_absolute():
        raise InvalidRequest("rootfs and init_host_path must be absolute host paths")
    if not cgroups_path.startswith("/") or ".." in cgroups_path.split("/"):
        raise InvalidRequest(f"cgroups_path {cgroups_path!r} must be absolute without '..'")
    if host_uid <= 0 or id_count <= 0 or host_uid + id_count > 2**32 - 1:
        raise InvalidRequest(
            f"id mapping 0 -> {host_uid} (count {id_count}) must map guest root to a "
            "non-root host uid within the 32-bit id space"
        )

    # The runtime sets rlimits from inside the user namespace, where it cannot raise a hard
    # limit above the one it inherited from us (EPERM at start): clamp to ours. The node
    # raises its own hard RLIMIT_NOFILE at start-up to get the full value.
    nofile_hard = min(NOFILE_HARD, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    if net_ns and userns_path is not None and userns_mappings:
        # runc 1.1 joins the user namespace before the others, and from inside it may not
        # join a network namespace of the initial one (EPERM): runc creates this sandbox's
        # user namespace itself, owned by root (see joins_userns).
        userns_path = None
    namespaces: list[dict[str, str]] = [
        {"type": t, "path": str(userns_path)} if t == "user" and userns_path else {"type": t}
        for t in _NS_TYPES
    ]
    mapping = [{"containerID": 0, "hostID": host_uid, "size": id_count}]
    with_mappings = userns_path is None or userns_mappings
    namespaces.append({"type": "network", "path": net_ns} if net_ns else {"type": "network"})
    mounts = _mounts(init_host_path)
    if net_ns:
        # sysfs may only be mounted by the owner of the network namespace; a netns the node
        # made belongs to the initial user namespace, so bind the host's /sys read-only
        # instead (it shows the host's net devices, not the sandbox's: masked paths apply).
        for m in mounts:
            if m["destination"] == "/sys":
                m.update(
                    type="bind",
                    source="/sys",
                    options=["rbind", "rro", "nosuid", "noexec", "nodev"],
                )
    mounts.extend(dict(m) for m in extra_mounts)
    masked = list(MASKED_PATHS)
    if mask_dir is not None:
        binds = masks_as_binds(mask_dir)
        mounts.extend(binds)
        bound = {m["destination"] for m in binds}
        masked = [p for p in masked if p not in bound]

    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [INIT_PATH],
            "env": [GUEST_PATH_ENV],
            "cwd": "/",
            "capabilities": oci_capabilities(),
            "rlimits": [
                {
                    "type": "RLIMIT_NOFILE",
                    "hard": nofile_hard,
                    "soft": min(NOFILE_SOFT, nofile_hard),
                },
                # No core files in the upper layer (they can be huge and hold secrets
                # of the process). A pipe core_pattern on the host ignores this: the node
                # should keep core_pattern a plain file name.
                {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
            ],
            "noNewPrivileges": True,
            # The guest is the first thing the kernel's OOM killer takes, never the node.
            "oomScoreAdj": 1000,
        },
        "root": {"path": str(rootfs), "readonly": readonly_root},
        "hostname": hostname,
        "mounts": mounts,
        "annotations": dict(annotations or {}),
        "linux": {
            **({"uidMappings": mapping, "gidMappings": mapping} if with_mappings else {}),
            "namespaces": namespaces,
            "resources": _resources(limits),
            "cgroupsPath": cgroups_path,
            "rootfsPropagation": "private",
            "maskedPaths": masked,
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": (
                seccomp
                if seccomp is not None
                else shared_profile(_machine(), log_denials=log_denials, notify=notify)
            ),
        },
    }


def joins_userns(config: dict[str, Any]) -> bool:
    """Whether ``config`` has the runtime join an existing user namespace."""
    return any(n["type"] == "user" and "path" in n for n in config["linux"]["namespaces"])


def take_rlimits(config: dict[str, Any]) -> list[tuple[int, int, int]]:
    """Remove the process rlimits from ``config`` and return them as (resource, soft, hard)
    for the runtime's process to start with (inherited by the container).

    runc sets them with prlimit from outside the container's user namespace, which needs
    CAP_SYS_RESOURCE over that namespace: host root has it for a namespace it owns, or
    with CAP_SYS_RESOURCE in its bounding set, which some hosts (this VM) do not grant.
    """
    out = []
    for r in config["process"].pop("rlimits", []):
        res = getattr(resource, r["type"])
        out.append((int(res), int(r["soft"]), int(r["hard"])))
    return out


def _machine() -> str:
    return os.uname().machine


def write_bundle(bundle_dir: Path, config: dict[str, Any]) -> Path:
    """Write ``bundle_dir/config.json`` atomically (temp file + rename); return its path.

    The bundle directory is created (mode 0700: the config names host paths) if missing.
    """
    try:
        bundle_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        target = bundle_dir / "config.json"
        fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".json", dir=bundle_dir)
        try:
            with os.fdopen(fd, "w") as f:
                # No fsync: a bundle never outlives a host crash (its container dies with
                # the host), and fsync would cost milliseconds per create.
                # dumps, not dump: dump always takes the pure-Python encoder (~7 ms here).
                f.write(json.dumps(config, separators=(",", ":")))
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise HostError(f"cannot write OCI bundle config in {bundle_dir}: {e}") from e
    return target
