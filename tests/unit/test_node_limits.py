"""The node limits that bound density (corral.node.limits) and where they are reported:
the capacity estimate, the start-up warnings, ``corral doctor`` and NodeStatus."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from corral.node import limits
from corral.node.doctor import run_checks
from corral.spec import NodeStatus

from .test_doctor import SYSCTLS, by_name, config, fake_host, probes

GIB = 1 << 30
MIB = 1 << 20
ROOMY = {k.replace("/", "."): v for k, v in SYSCTLS.items()}
"""A host whose sysctls bind nothing below a million sandboxes' worth of memory."""


def reader(**low: int) -> Callable[[str], int | None]:
    values = {**ROOMY, **{k.replace("__", "."): v for k, v in low.items()}}
    return values.get


def test_a_sandbox_costs_more_the_more_there_are() -> None:
    # The shrinker slots: 16 B per superblock on the host, in every memory cgroup.
    assert limits.idle_bytes(0) == limits.BASE_BYTES
    slots = limits.SHRINKER_SLOT_BYTES * limits.SUPERBLOCKS_PER_SANDBOX
    assert limits.idle_bytes(10000) - limits.idle_bytes(3200) == slots * 6800
    # bench density on a fresh boot: 1.305 MiB each at 10,000 (5 superblocks: 0.76 MiB of slots)
    assert 1.28 * MIB < limits.idle_bytes(10000) < 1.33 * MIB


@pytest.mark.parametrize("budget", [0, 1, MIB, 8 * GIB, 22 * GIB, 100 * GIB])
def test_fits_is_the_largest_count_the_budget_holds(budget: int) -> None:
    n = limits.fits(budget)
    assert n * limits.idle_bytes(n) <= budget < (n + 1) * limits.idle_bytes(n + 1)


def test_memory_binds_on_a_roomy_host() -> None:
    cap = limits.capacity(22 * GIB, 0, reader(), nofile=1 << 20)
    assert cap == limits.Capacity(limits.fits(22 * GIB), "memory")
    assert 10000 < cap.sandboxes < 14000  # this host: 10,000 fit, not 2x
    assert str(cap.sandboxes) in cap.describe() and "memory" in cap.describe()


def test_live_sandboxes_count_towards_the_memory_bound() -> None:
    # Available memory already excludes what the live ones use: it is added back.
    live = 3000
    cap = limits.capacity(1 * GIB, live, reader(), nofile=1 << 20)
    assert cap.bound_by == "memory"
    assert cap.sandboxes == limits.fits(1 * GIB + live * limits.idle_bytes(live)) > live
    # and a full node never reports fewer than it holds
    assert limits.capacity(0, live, reader(), nofile=1 << 20).sandboxes == live


def test_a_low_sysctl_binds_and_is_named() -> None:
    read = reader(user__max_net_namespaces=500)
    cap = limits.capacity(64 * GIB, 0, read, nofile=1 << 20)
    assert cap == limits.Capacity(500, "user.max_net_namespaces")


def test_pid_max_binds_at_four_tasks_an_idle_sandbox() -> None:
    cap = limits.capacity(64 * GIB, 0, reader(kernel__pid_max=32768), nofile=1 << 20)
    assert cap == limits.Capacity(32768 // 4, "kernel.pid_max")


def test_the_open_files_limit_binds() -> None:
    cap = limits.capacity(64 * GIB, 0, reader(), nofile=1024)
    assert cap == limits.Capacity(1024 // limits.FDS_PER_SANDBOX, "RLIMIT_NOFILE")


def test_a_sysctl_this_kernel_lacks_binds_nothing() -> None:
    # e.g. an older kernel without user.max_*_namespaces
    cap = limits.capacity(1 * GIB, 0, {}.get, nofile=1 << 20)
    assert cap.bound_by == "memory"


def test_short_of_names_each_low_sysctl_with_the_value_it_needs() -> None:
    assert limits.short_of(4096, reader()) == []
    lines = limits.short_of(4096, reader(kernel__pid_max=32768, fs__file_max=1000))
    assert len(lines) == 1  # fs.file_max is no sysctl of the table: ignored
    assert "kernel.pid_max = 32768 < 65536 for max_sandboxes 4096" in lines[0]
    lines = limits.short_of(4096, reader(**{"fs__file-max": 1000}))
    assert lines == [
        "fs.file-max = 1000 < 262144 for max_sandboxes 4096 (open files of all sandboxes and the node)"
    ]


def test_sysctl_reads_the_first_field(tmp_path: Path) -> None:
    (tmp_path / "proc/sys/fs").mkdir(parents=True)
    (tmp_path / "proc/sys/fs/file-nr").write_text("1216\t0\t9223372036854775807\n")
    assert limits.sysctl("fs.file-nr", tmp_path) == 1216
    assert limits.sysctl("fs.nope", tmp_path) is None


def test_doctor_reports_the_capacity_and_what_binds_it(tmp_path: Path) -> None:
    meminfo = "MemTotal: 25165824 kB\nMemAvailable: 16777216 kB\n"
    root = fake_host(
        tmp_path / "root", proc__meminfo=meminfo, proc__sys__user__max_net_namespaces="500\n"
    )
    c = by_name(run_checks(config(tmp_path), root=root, probes=probes()))["density"]
    assert c.ok
    assert "about 500 idle sandboxes (bounded by user.max_net_namespaces)" in c.detail
    roomy = fake_host(tmp_path / "roomy", proc__meminfo=meminfo)
    c = by_name(run_checks(config(tmp_path), root=roomy, probes=probes()))["density"]
    want = limits.fits(16 * GIB)
    assert f"about {want} idle sandboxes (bounded by memory)" in c.detail


def test_open_files_check_uses_the_per_sandbox_figure(tmp_path: Path) -> None:
    root = fake_host(tmp_path / "root")
    checks = run_checks(config(tmp_path, max_sandboxes=100), root=root, probes=probes())
    assert (
        f">= {100 * limits.FDS_PER_SANDBOX + 2048} " in by_name(checks)["open files limit"].detail
    )


def test_node_status_carries_the_estimate() -> None:
    st = NodeStatus(
        node_id="n",
        version="0",
        cgroup_mode="v2",
        sandboxes=0,
        running=0,
        paused=0,
        state_dir="",
        store="",
        mounted_layers=0,
        mem_total=0,
        mem_available=0,
        idle_capacity=9000,
        idle_capacity_bound="memory",
    )
    back = NodeStatus.model_validate_json(st.model_dump_json())
    assert (back.idle_capacity, back.idle_capacity_bound) == (9000, "memory")


def test_node_start_logs_each_short_limit(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="corral.node")
    limits.warn_short(4096, reader(kernel__pid_max=32768))
    assert [r.getMessage() for r in caplog.records] == [
        "density limit: kernel.pid_max = 32768 < 65536 for max_sandboxes 4096 (every task of "
        "every sandbox takes a pid); `corral doctor` lists them all"
    ]


def test_status_table_shows_the_estimate() -> None:
    from corral.cli.node import status_table

    st = NodeStatus(
        node_id="n",
        version="0",
        cgroup_mode="v2",
        sandboxes=0,
        running=0,
        paused=0,
        state_dir="",
        store="",
        mounted_layers=0,
        mem_total=0,
        mem_available=0,
        idle_capacity=9000,
        idle_capacity_bound="memory",
    )
    rows = dict(zip(*(c._cells for c in status_table(st).columns), strict=True))
    assert rows["idle capacity"] == "about 9000 idle sandboxes (bounded by memory)"
    assert (
        dict(
            zip(
                *(
                    c._cells
                    for c in status_table(st.model_copy(update={"idle_capacity": 0})).columns
                ),
                strict=True,
            )
        )["idle capacity"]
        == "unknown"
    )


class FakeRlimit:
    """RLIMIT_NOFILE of a pretend process: what setrlimit would allow, recorded."""

    def __init__(self, soft: int, hard: int) -> None:
        self.soft, self.hard = soft, hard

    def get(self, which: int) -> tuple[int, int]:
        return self.soft, self.hard

    def set(self, which: int, value: tuple[int, int]) -> None:
        assert value[0] <= value[1]
        self.soft, self.hard = value


@pytest.mark.parametrize(
    ("euid", "soft", "hard", "want"),
    [
        (0, 1024, 20000, (22048, 22048)),  # root: the hard limit too, to what 10,000 need
        (0, 1024, 1 << 20, (22048, 1 << 20)),  # never lowers the hard limit
        (0, 50000, 60000, (50000, 60000)),  # nor the soft one
        (1000, 1024, 20000, (20000, 20000)),  # not root: up to the hard limit, then a warning
    ],
)
def test_raise_nofile(
    monkeypatch: pytest.MonkeyPatch, euid: int, soft: int, hard: int, want: tuple[int, int]
) -> None:
    lim = FakeRlimit(soft, hard)
    monkeypatch.setattr(limits.resource, "getrlimit", lim.get)
    monkeypatch.setattr(limits.resource, "setrlimit", lim.set)
    monkeypatch.setattr(limits.os, "geteuid", lambda: euid)
    assert limits.raise_nofile(10000, reader()) == want[0]
    assert (lim.soft, lim.hard) == want


def test_raise_nofile_stops_at_nr_open(monkeypatch: pytest.MonkeyPatch) -> None:
    lim = FakeRlimit(1024, 4096)
    monkeypatch.setattr(limits.resource, "getrlimit", lim.get)
    monkeypatch.setattr(limits.resource, "setrlimit", lim.set)
    monkeypatch.setattr(limits.os, "geteuid", lambda: 0)
    assert limits.raise_nofile(20000, reader(fs__nr_open=30000)) == 30000
