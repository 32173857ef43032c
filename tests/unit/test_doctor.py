"""The checks of ``corral doctor`` on fake /proc and /sys trees and fake probes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import corral.cli.app as cli_app
from corral.errors import HostError
from corral.node import NodeConfig, doctor, doctor_probes
from corral.node.doctor import Check, Probes, fatal_failures, run_checks

GIB = 1 << 30
V2_MOUNTINFO = "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTINFO = "".join(
    f"{30 + i} 1 0:{40 + i} / /sys/fs/cgroup/{c} rw - cgroup cgroup rw,{c}\n"
    for i, c in enumerate(["cpu,cpuacct", "memory", "pids", "freezer", "blkio"])
)
SYSCTLS = {
    "kernel/pid_max": 4194304,
    "kernel/threads-max": 1000000,
    "user/max_user_namespaces": 100000,
    "user/max_mnt_namespaces": 100000,
    "user/max_pid_namespaces": 100000,
    "user/max_net_namespaces": 100000,
    "fs/file-max": 10000000,
    "fs/nr_open": 1048576,
    "fs/inotify/max_user_instances": 1024,
    "fs/inotify/max_user_watches": 1000000,
    "vm/max_map_count": 262144,
    "kernel/keys/maxkeys": 2000,
    "kernel/pty/max": 8192,
}


def fake_host(root: Path, *, mountinfo: str = V2_MOUNTINFO, **overrides: object) -> Path:
    """A healthy pure-v2 host below ``root``; ``overrides``: file (relative) -> content,
    None removes the file."""
    files: dict[str, object] = {
        "proc/self/mountinfo": mountinfo,
        "proc/self/ns/user": "",
        "proc/filesystems": "nodev\toverlay\n\terofs\n\tbtrfs\n\text4\n",
        "proc/sys/kernel/osrelease": "6.8.0-test\n",
        "proc/sys/kernel/seccomp/actions_avail": "kill_process kill_thread trap errno "
        "user_notif trace log allow\n",
        "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids\n",
        "dev/loop-control": "",
        **{f"proc/sys/{k}": f"{v}\n" for k, v in SYSCTLS.items()},
    }
    files.update({k.replace("__", "/"): v for k, v in overrides.items()})
    for rel, text in files.items():
        if text is None:
            continue
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(str(text))
    return root


def probes(**kw: object) -> Probes:
    """Probes of a healthy host: nothing here touches the real one."""
    base: dict[str, object] = dict(
        which=lambda name: f"/usr/bin/{name}",
        euid=lambda: 0,
        landlock=lambda: (7, "scoped"),
        core_scheduling=lambda: (True, "available"),
        criu=lambda: (True, ""),
        runtime=lambda mode, prefer: ("crun", "/usr/bin/crun", False),
        launch=lambda: "kernel 5.10 is older than 5.12 (mount_setattr)",
        version=lambda binary: "crun version 1.19",
        nft=lambda: None,
        gcc=lambda: None,
        free_bytes=lambda path: 500 * GIB,
        nofile=lambda: 1 << 20,
        node_running=lambda state_dir: False,
        live_ids=lambda state_dir: set(),
        leftovers=lambda cfg: {},
        holder_pid=lambda run_dir: None,
        libnftables=lambda: "libnftables.so.1",
    )
    base.update(kw)
    return Probes(**base)  # type: ignore[arg-type]


def config(tmp_path: Path, **kw: object) -> NodeConfig:
    return NodeConfig(state_dir=tmp_path / "state", run_dir=tmp_path / "run", **kw)  # type: ignore[arg-type]


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_healthy_host_passes_every_check(tmp_path: Path) -> None:
    checks = run_checks(config(tmp_path), root=fake_host(tmp_path / "root"), probes=probes())
    bad = [c for c in checks if not c.ok]
    assert bad == []
    names = set(by_name(checks))
    for want in (
        "root", "oci runtime", "user namespaces", "cgroups", "erofs", "overlayfs", "btrfs quotas",
        "seccomp user notify", "landlock", "nftables", "helper programs", "seccomp fd holder",
        "free disk", "leftovers", "sysctl kernel.pid_max", "sysctl fs.inotify.max_user_watches",
        "sysctl user.max_user_namespaces", "sysctl kernel.keys.maxkeys", "open files limit",
    ):  # fmt: skip
        assert want in names
    assert "v2" in by_name(checks)["cgroups"].detail
    assert "simple quotas" in by_name(checks)["btrfs quotas"].detail  # 6.8 >= 6.7
    assert fatal_failures(checks) == []


@pytest.mark.parametrize(
    ("overrides", "name", "words"),
    [
        ({"proc__self__ns__user": None}, "user namespaces", "no user namespaces"),
        ({"proc__sys__user__max_user_namespaces": "0\n"}, "user namespaces", "is 0"),
        ({"proc__filesystems": "nodev\toverlay\n\tbtrfs\n"}, "erofs", "erofs is neither"),
        ({"proc__filesystems": "\terofs\n\tbtrfs\n"}, "overlayfs", "overlay is neither"),
        ({"proc__filesystems": "\terofs\nnodev\toverlay\n"}, "btrfs quotas", "btrfs"),
        ({"dev__loop-control": None}, "btrfs quotas", "loop-control"),
        (
            {"proc__sys__kernel__seccomp__actions_avail": "kill_process errno allow\n"},
            "seccomp user notify",
            "errno",
        ),
        ({"sys__fs__cgroup__cgroup.controllers": "cpu memory\n"}, "cgroups", "pids"),
    ],
)
def test_missing_kernel_feature_is_fatal(
    tmp_path: Path, overrides: dict[str, object], name: str, words: str
) -> None:
    root = fake_host(tmp_path / "root", **overrides)
    checks = run_checks(config(tmp_path), root=root, probes=probes())
    c = by_name(checks)[name]
    assert not c.ok and c.fatal and c.fix
    assert words in c.detail
    assert fatal_failures(checks) == [c]


def test_v1_hierarchies_need_the_freezer(tmp_path: Path) -> None:
    ok = run_checks(
        config(tmp_path), root=fake_host(tmp_path / "a", mountinfo=V1_MOUNTINFO), probes=probes()
    )
    assert by_name(ok)["cgroups"].ok and "v1" in by_name(ok)["cgroups"].detail
    no_freezer = V1_MOUNTINFO.replace("freezer", "net_cls")
    bad = by_name(
        run_checks(
            config(tmp_path), root=fake_host(tmp_path / "b", mountinfo=no_freezer), probes=probes()
        )
    )["cgroups"]
    assert not bad.ok and bad.fatal and "freezer" in bad.detail


def test_filesystem_as_a_loadable_module_counts(tmp_path: Path) -> None:
    root = fake_host(
        tmp_path / "root",
        proc__filesystems="nodev\toverlay\n\tbtrfs\n",
        **{"lib__modules__6.8.0-test__modules.dep": "kernel/fs/erofs/erofs.ko.zst: \n"},
    )
    c = by_name(run_checks(config(tmp_path), root=root, probes=probes()))["erofs"]
    assert c.ok and "module" in c.detail


def test_low_sysctl_is_a_warning_that_names_the_value_to_set(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "root", proc__sys__kernel__pid_max="32768\n")
    checks = run_checks(config(tmp_path, max_sandboxes=4096), root=root, probes=probes())
    c = by_name(checks)["sysctl kernel.pid_max"]
    assert not c.ok and not c.fatal
    assert "32768" in c.detail and "kernel.pid_max=65536" in c.fix
    assert fatal_failures(checks) == []
    # The want scales with the node's configured density: 1024 sandboxes fit.
    small = run_checks(config(tmp_path, max_sandboxes=1024), root=root, probes=probes())
    assert by_name(small)["sysctl kernel.pid_max"].ok


def test_open_files_limit_scales_with_max_sandboxes(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "root")
    checks = run_checks(config(tmp_path), root=root, probes=probes(nofile=lambda: 1024))
    c = by_name(checks)["open files limit"]
    assert not c.ok and not c.fatal and "ulimit -n 10240" in c.fix  # 2 per sandbox + 2048


def test_no_runtime_is_fatal(tmp_path: Path) -> None:
    def none(mode: str, prefer: str | None) -> tuple[str, str, bool]:
        raise HostError("no usable OCI runtime: looked for crun, runc on PATH")

    checks = run_checks(
        config(tmp_path), root=fake_host(tmp_path / "root"), probes=probes(runtime=none)
    )
    c = by_name(checks)["oci runtime"]
    assert not c.ok and c.fatal and "crun" in c.fix


def test_runtime_that_does_not_run_is_fatal(tmp_path: Path) -> None:
    p = probes(version=lambda binary: None)
    c = by_name(run_checks(config(tmp_path), root=fake_host(tmp_path / "root"), probes=p))
    assert not c["oci runtime"].ok and c["oci runtime"].fatal


def test_nftables_is_fatal_only_when_permissions_need_it(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "root")
    p = probes(libnftables=lambda: None)
    plain = by_name(run_checks(config(tmp_path), root=root, probes=p))["nftables"]
    assert not plain.ok and not plain.fatal and "not installed" in plain.detail
    net = config(tmp_path, network={"permissions": {"mirror": {"cidrs": ["10.20.0.0/24"]}}})
    needed = by_name(run_checks(net, root=root, probes=p))["nftables"]
    assert not needed.ok and needed.fatal


def test_landlock_without_scoping_is_a_warning(tmp_path: Path) -> None:
    p = probes(landlock=lambda: (4, "landlock ABI 4 has no scoping"))
    c = by_name(run_checks(config(tmp_path), root=fake_host(tmp_path / "root"), probes=p))
    assert not c["landlock"].ok and not c["landlock"].fatal and "6.12" in c["landlock"].fix


def test_helpers_need_gcc_only_until_built(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "root")
    p = probes(gcc=lambda: "gcc is not installed")
    c = by_name(run_checks(config(tmp_path), root=root, probes=p))["helper programs"]
    assert not c.ok and c.fatal and "gcc" in c.fix
    # Once the node has built them (named by their source hash), gcc is no longer needed.
    from corral import init
    from corral.host import fdstore, spawn
    from corral.host.cbuild import built_path

    out = tmp_path / "state" / "bin"
    for name, src in (
        ("corral-init", init.SOURCE.read_bytes()),
        ("corral-spawn", spawn.SOURCE.encode()),
        (fdstore.PROGRAM, fdstore.SOURCE.encode()),
    ):
        built = built_path(name, src, out)
        built.parent.mkdir(parents=True, exist_ok=True)
        built.write_bytes(b"")
    c = by_name(run_checks(config(tmp_path), root=root, probes=p))["helper programs"]
    assert c.ok and "built in" in c.detail


def test_disk_nearly_full_is_fatal_and_short_of_scratch_a_warning(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "root")
    full = run_checks(config(tmp_path), root=root, probes=probes(free_bytes=lambda p: GIB // 2))
    assert not by_name(full)["free disk"].ok and by_name(full)["free disk"].fatal
    short = run_checks(
        config(tmp_path, scratch_size="64GiB"),
        root=root,
        probes=probes(free_bytes=lambda p: 8 * GIB),
    )
    c = by_name(short)["free disk"]
    assert not c.ok and not c.fatal and "scratch_size" in c.fix


def test_leftovers_of_a_stopped_node_skip_live_sandboxes(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "root")
    found = {
        "cgroups": [
            "/sys/fs/cgroup/memory/corral/sb-aaaaaaaaaaaa-n1",
            "/sys/fs/cgroup/memory/corral/sb-bbbbbbbbbbbb-n1",
        ],
        "mounts": ["/var/lib/corral/mnt/layer1"],  # shared: serves the live sandbox
        "containers": ["crun:sb-bbbbbbbbbbbb-n1"],
    }
    p = probes(leftovers=lambda cfg: found, live_ids=lambda d: {"sb-aaaaaaaaaaaa-n1"})
    c = by_name(run_checks(config(tmp_path), root=root, probes=p))["leftovers"]
    assert not c.ok and not c.fatal
    assert "1 cgroups" in c.detail and "1 containers" in c.detail and "mounts" not in c.detail
    assert "node gc" in c.fix and "1 sandboxes recorded live" in c.detail
    # Nothing live: the shared mount is a leftover too.
    p = probes(leftovers=lambda cfg: found)
    c = by_name(run_checks(config(tmp_path), root=root, probes=p))["leftovers"]
    assert "2 cgroups" in c.detail and "1 mounts" in c.detail
    # A running node's resources are not leftovers.
    p = probes(leftovers=lambda cfg: found, node_running=lambda d: True)
    c = by_name(run_checks(config(tmp_path), root=root, probes=p))["leftovers"]
    assert c.ok and "running" in c.detail


def test_node_running_is_seen_through_its_lock(tmp_path: Path) -> None:
    import fcntl
    import os

    tmp_path.joinpath("node.lock").touch()
    assert not doctor_probes.node_running(tmp_path)
    fd = os.open(tmp_path / "node.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert doctor_probes.node_running(tmp_path)
    finally:
        os.close(fd)
    assert not doctor_probes.node_running(tmp_path / "missing")


def test_cli_json_is_the_last_line_and_fatal_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = [
        Check(name="erofs", ok=False, detail="erofs is neither...", fix="use a kernel", fatal=True),
        Check(name="criu", ok=False, detail="criu check failed", fix="optional"),
    ]
    monkeypatch.setattr(doctor, "run_checks", lambda cfg: checks)
    r = CliRunner().invoke(cli_app.app, ["doctor", "--json"])
    assert r.exit_code == 1
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] is False
    assert [set(c) for c in out["checks"]] == [{"name", "ok", "detail", "fix", "fatal"}] * 2
    monkeypatch.setattr(doctor, "run_checks", lambda cfg: checks[1:])
    r = CliRunner().invoke(cli_app.app, ["doctor"])
    assert r.exit_code == 0
    assert "criu" in r.stdout and "optional" in r.stdout and "1 warning" in r.stderr


def test_fatal_only_covers_every_check_that_can_stop_a_node(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "root")
    net = config(tmp_path, network={"permissions": {"mirror": {"cidrs": ["10.20.0.0/24"]}}})
    full = run_checks(net, root=root, probes=probes())
    start = run_checks(net, root=root, probes=probes(leftovers=_never), fatal_only=True)
    assert {c.name for c in full if c.fatal} == {c.name for c in start}
    assert all(c.fatal for c in start)


def _never(cfg: NodeConfig) -> dict[str, list[str]]:
    raise AssertionError("a node's start does not scan for leftovers (its recovery does)")


def test_not_root_is_fatal(tmp_path: Path) -> None:
    p = probes(euid=lambda: 1000)
    c = by_name(run_checks(config(tmp_path), root=fake_host(tmp_path / "root"), probes=p))["root"]
    assert not c.ok and c.fatal and "uid 1000" in c.detail


def test_leftover_mounts_held_by_another_mount_namespace_are_named(tmp_path: Path) -> None:
    """A tool that unshared its mount namespace while the node ran keeps copies of the
    node's mounts (and their loop devices) busy: doctor names it, gc alone cannot help."""
    root = fake_host(tmp_path / "root")
    state = tmp_path / "state"
    procs = {
        "self": ("mnt:[1]", "x", ""),
        "10": ("mnt:[1]", "corral", f"1 0 0:1 / {state}/scratch rw - btrfs /dev/loop3 rw"),
        "20": ("mnt:[2]", "mfsmaster", f"84 49 0:43 / {state}/scratch rw - btrfs /dev/loop3 rw"),
        "21": ("mnt:[2]", "mfsmaster", f"84 49 0:43 / {state}/scratch rw - btrfs /dev/loop3 rw"),
        "30": ("mnt:[3]", "sh", "1 0 0:1 / / rw - ext4 /dev/vda rw"),
    }
    for pid, (ns, comm, mountinfo) in procs.items():
        d = root / "proc" / pid
        (d / "ns").mkdir(parents=True, exist_ok=True)
        (d / "ns" / "mnt").symlink_to(ns)
        (d / "comm").write_text(comm + "\n")
        (d / "mountinfo").write_text(mountinfo + "\n")
    found = {"loop_devices": [f"/dev/loop3 -> {state}/scratch.img"]}
    p = probes(leftovers=lambda cfg: found)
    c = by_name(run_checks(config(tmp_path), root=root, probes=p))["leftovers"]
    assert not c.ok and "pid 20 (mfsmaster)" in c.detail
    assert "pid 21" not in c.detail and "pid 10" not in c.detail and "pid 30" not in c.detail
    assert c.fix.startswith("end those processes") and "node gc" in c.fix


def test_launcher_needs_no_oci_runtime(tmp_path: Path) -> None:
    def none(mode: str, prefer: str | None) -> tuple[str, str, bool]:
        raise HostError("no usable OCI runtime: looked for crun, runc on PATH")

    p = probes(runtime=none, launch=lambda: None)
    c = by_name(run_checks(config(tmp_path), root=fake_host(tmp_path / "root"), probes=p))
    assert c["oci runtime"].ok and "corral-launch" in c["oci runtime"].detail
