"""host/launch.py's translation of an OCI config into corral-launch's argv (no kernel)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from corral.backends.oci import build_config
from corral.errors import HostError
from corral.host.launch import plan
from corral.policy.caps import GUEST_CAPS, cap_mask
from corral.policy.masks import MASKED_PATHS, READONLY_PATHS
from corral.spec import Limits

PROFILE = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}


def _config(**kw: Any) -> dict[str, Any]:
    return build_config(
        rootfs=Path("/srv/sb/rootfs"),
        init_host_path=Path("/run/initfs/corral-init"),
        hostname="box",
        cgroups_path="/corral/sb-1",
        limits=Limits(),
        seccomp=PROFILE,
        **kw,
    )


def _plan(config: dict[str, Any], **kw: Any) -> list[str]:
    base: dict[str, Any] = dict(
        sandbox_id="sb-1",
        owner=165536,
        cgroup_procs=[Path("/sys/fs/cgroup/memory/corral/sb-1/cgroup.procs")],
        cpu_procs=[Path("/sys/fs/cgroup/cpu/corral/sb-1/cgroup.procs")],
        cgroup_mounts=[("cpu", "cpu"), ("memory", "memory")],
        cgroup_v2=False,
        bpf=b"\0" * 8,
    )
    base.update(kw)
    return plan(config, **base).args


def _opts(args: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    it = iter(args[: args.index("--")])
    for a in it:
        out.setdefault(a, []).append("" if a in ("-N", "-t") else next(it))
    return out


def test_process_and_namespaces() -> None:
    args = _plan(_config())
    o = _opts(args)
    assert o["-x"] == ["/.corral/init"] and o["-h"] == ["box"] and o["-o"] == ["1000"]
    assert o["-m"] == ["100000:65536"] and o["-u"] == ["165536"]
    assert "-N" in o and "-n" not in o  # a new, empty network namespace
    m = cap_mask(GUEST_CAPS)
    assert o["-C"] == [f"{m:x}:{m:x}:{m:x}:0:0"]
    assert any(r.startswith("4:0:0") for r in o["-r"])  # RLIMIT_CORE 0
    assert o["-c"] == ["/sys/fs/cgroup/memory/corral/sb-1/cgroup.procs"]
    assert o["-k"] == ["/sys/fs/cgroup/cpu/corral/sb-1/cgroup.procs"]
    assert o["-s"] == ["0"] and "-l" not in o


@pytest.mark.parametrize("klass", ["best_effort", "latency"])
def test_the_class_policy_is_the_launchers_to_set(klass: str) -> None:
    """What qos.apply would do after the start, as launcher options: the policy (set just
    before the init's exec) and, for best effort, RLIMIT_NICE 0/0 (set before the clone)."""
    import os
    import resource

    from corral.policy import qos

    policy, nice = qos.settings(klass)
    o = _opts(_plan(_config(), policy=policy, nice_limit=nice))
    if klass == "latency":
        assert o["-P"] == [str(os.SCHED_OTHER)]
        assert not any(r.startswith(f"{resource.RLIMIT_NICE}:") for r in o["-r"])
    else:
        assert o["-P"] == [str(os.SCHED_IDLE)]
        assert f"{resource.RLIMIT_NICE}:0:0" in o["-r"]
    assert "-P" not in _opts(_plan(_config()))  # not asked: left as it is


def test_steps_follow_the_config() -> None:
    args = _plan(_config(readonly_root=True))
    steps = [s.split("\t") for s in args[args.index("--") + 1 :]]
    kinds = [s[0] for s in steps]
    assert steps[0] == ["root", "/srv/sb/rootfs"]
    assert kinds[-2:] == ["pivot", "roroot"]
    assert {s[1] for s in steps if s[0] == "mask"} == set(MASKED_PATHS)
    assert {s[1] for s in steps if s[0] == "ro"} == set(READONLY_PATHS)
    init = next(s for s in steps if s[0] == "bind" and s[2] == "/.corral/init")
    assert int(init[3], 16) & 0x7 == 0x7  # ro, nosuid, nodev
    # cgroup mounts come after the cgroup namespace, before the pivot.
    i = kinds.index("cgns")
    assert kinds[i + 1 : kinds.index("pivot")] == ["fs", "fs", "fs", "remount"]
    assert ["ln", "pts/ptmx", "/dev/ptmx"] in steps


def test_rootfs_by_fd_starts_from_the_template() -> None:
    """The rootfs as a detached mount (fd 6) goes with the template namespace (-t); the
    config's host path is not used."""
    args = _plan(_config(), rootfs_fd=True)
    assert "-t" in _opts(args)
    assert args[args.index("--") + 1] == "root\t-"
    assert "/srv/sb/rootfs" not in args
    # Entered by move + chroot over the template's root, not pivot_root (whose walk of
    # every host task grows with the live count); a host-path rootfs still pivots.
    kinds = [s.split("\t")[0] for s in args[args.index("--") + 1 :]]
    assert "enter" in kinds and "pivot" not in kinds
    assert kinds[-1] == "enter"


def test_no_network_sandbox_binds_the_templates_sysfs() -> None:
    """With the template (-t) and a network namespace of its own, /sys is a bind of the
    template's sysfs with the config's flags (read-only), not a sysfs of its own."""
    args = _plan(_config(), rootfs_fd=True)
    steps = [s.split("\t") for s in args[args.index("--") + 1 :]]
    (sys_step,) = [s for s in steps if "/sys" in s[1:3] and s[0] != "mask"]
    assert sys_step[:3] == ["tbind", "/sys", "/sys"], sys_step
    assert int(sys_step[3], 16) & 0xF == 0xF  # ro, nosuid, nodev, noexec
    assert not any(s[0] == "fs" and s[1] == "sysfs" for s in steps)
    # Without the template (a host-path rootfs): a sysfs of its own, as before.
    steps = [s.split("\t") for s in _plan(_config())]
    assert any(s[0] == "fs" and s[1] == "sysfs" for s in steps)
    assert not any(s[0] == "tbind" for s in steps)


def test_dev_shm_is_a_directory_of_dev() -> None:
    """One tmpfs for /dev and /dev/shm: both sizes, the union of both flag sets (nosuid,
    nodev, noexec), and /dev/shm a sticky world-writable directory on it."""
    steps = [s.split("\t") for s in _plan(_config())]
    dev = next(s for s in steps if s[0] == "fs" and s[3] == "/dev")
    assert int(dev[4], 16) & 0xE == 0xE  # nosuid nodev noexec
    assert "size=67174400" in dev[5].split(",")  # 64 KiB + 64 MiB
    assert ["dir", "/dev/shm", "1777"] in steps
    assert not any(s[0] == "fs" and s[3] == "/dev/shm" for s in steps)


def test_cgroup_tree_is_bound_read_only() -> None:
    """v1 with a node-wide tree: a read-only bind instead of a tmpfs (and no remount)."""
    args = _plan(_config(), cgroup_tree="/run/initfs/cgroup")
    steps = [s.split("\t") for s in args[args.index("--") + 1 :]]
    kinds = [s[0] for s in steps]
    i = kinds.index("cgns")
    assert kinds[i + 1 : kinds.index("pivot")] == ["bind", "fs", "fs"]
    bind = steps[i + 1]
    assert bind[1:3] == ["/run/initfs/cgroup", "/sys/fs/cgroup"] and int(bind[3], 16) & 0xF == 0xF
    assert [s[3] for s in steps[i + 2 : i + 4]] == ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/memory"]
    assert not any(s[0] == "fs" and s[1] == "tmpfs" and s[3] == "/sys/fs/cgroup" for s in steps)


def test_joined_network_binds_sys_read_only() -> None:
    args = _plan(_config(net_ns="/run/netns/x"))
    assert _opts(args)["-n"] == ["/run/netns/x"]
    steps = [s.split("\t") for s in args[args.index("--") + 1 :]]
    assert ["rro", "/sys"] in steps


def test_listener_path_goes_to_the_launcher() -> None:
    cfg = _config()
    cfg["linux"]["seccomp"] = dict(PROFILE, listenerPath="/run/corral/seccomp.sock")
    o = _opts(_plan(cfg))
    assert o["-s"] == ["8"] and o["-l"] == ["/run/corral/seccomp.sock\tsb-1"]


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c["process"].update(user={"uid": 1000, "gid": 1000}),
        lambda c: c["process"].update(noNewPrivileges=False),
        lambda c: c["linux"]["namespaces"].pop(0),
        lambda c: c["linux"]["namespaces"][0].update(path="/proc/1/ns/pid"),
        lambda c: c["linux"].update(rootfsPropagation="shared"),
        lambda c: c["linux"].update(gidMappings=[]),
        lambda c: c["mounts"].append({"destination": "/x\ty", "type": "tmpfs", "source": "t"}),
    ],
)
def test_unknown_configs_are_refused(change: Any) -> None:
    cfg = copy.deepcopy(_config())
    change(cfg)
    with pytest.raises(HostError):
        _plan(cfg)
