"""``corral doctor`` on this host, and its leftover check against a real stopped node."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

from corral.node import Node
from corral.node.doctor import fatal_failures, run_checks
from corral.spec import SandboxSpec
from tests.conftest import TAG, TEST_RUN, TEST_STATE, TEST_STORE, TEST_SUBTREE
from tests.integration.conftest import assert_no_leaks, node_config

STATE = Path(f"/var/lib/corral-test{TAG}-doctor")
RUN = Path(f"/run/corral-test{TAG}-doctor")
SUBTREE = f"corral-test{TAG}-doctor"

EXPECTED = [
    "root",
    "oci runtime",
    "user namespaces",
    "cgroups",
    "erofs",
    "overlayfs",
    "btrfs quotas",
    "seccomp user notify",
    "landlock",
    "nftables",
    "helper programs",
    "seccomp fd holder",
    "free disk",
    "leftovers",
    "sysctl kernel.pid_max",
    "sysctl kernel.threads-max",
    "sysctl user.max_user_namespaces",
    "sysctl fs.inotify.max_user_instances",
    "sysctl fs.inotify.max_user_watches",
    "sysctl fs.file-max",
    "sysctl vm.max_map_count",
    "sysctl kernel.keys.maxkeys",
    "open files limit",
    "core scheduling",
    "criu",
]


def test_doctor_json_on_this_host(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text(
        f'[node]\nstate_dir = "{TEST_STATE}"\nrun_dir = "{TEST_RUN}"\nstore = "{TEST_STORE}"\n'
        f'cgroup_subtree = "{TEST_SUBTREE}"\nscratch_size = "16GiB"\n'
    )
    code = "from corral.cli.app import main; main()"
    r = subprocess.run(
        [sys.executable, "-c", code, "--config", str(toml), "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = json.loads(r.stdout.strip().splitlines()[-1])
    fatal = [c for c in out["checks"] if c["fatal"] and not c["ok"]]
    assert out["ok"] is True, fatal
    assert r.returncode == 0, r.stderr
    names = [c["name"] for c in out["checks"]]
    for name in EXPECTED:
        assert name in names
    for c in out["checks"]:
        assert set(c) == {"name", "ok", "detail", "fix", "fatal"}
        assert c["detail"]
        assert bool(c["fix"]) == (not c["ok"]), c  # a failure always says what to do
    # What this host is known to have (DESIGN.md section 2).
    by = {c["name"]: c for c in out["checks"]}
    assert "hybrid" in by["cgroups"]["detail"] or "v2" in by["cgroups"]["detail"]
    assert by["landlock"]["ok"] and by["seccomp user notify"]["ok"]


async def test_leftovers_of_a_stopped_node(images_ready: None) -> None:
    """A node closed with a live sandbox leaves nothing doctor calls a leftover; once the
    database no longer knows that sandbox (a state lost in a crash), its cgroups and
    container are leftovers, and the next node start removes them."""
    cfg = node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE)
    node = await Node.open(cfg)
    try:
        await node.gc(everything=True)  # a crashed earlier run of this test
        info = await node.sandbox_create(SandboxSpec(image="test/busybox"))
    finally:
        await node.close()  # the sandbox keeps running
    try:
        checks = {c.name: c for c in run_checks(cfg)}
        assert checks["leftovers"].ok, checks["leftovers"]
        assert "1 sandboxes recorded live" in checks["leftovers"].detail
        assert fatal_failures(list(checks.values())) == []

        con = sqlite3.connect(STATE / "state.db")
        with con:
            con.execute("UPDATE sandboxes SET state = 'destroyed' WHERE id = ?", (info.id,))
        con.close()
        left = {c.name: c for c in run_checks(cfg)}["leftovers"]
        assert not left.ok and not left.fatal, left
        assert "cgroups" in left.detail and "containers" in left.detail, left.detail
        assert info.id in left.detail or "mounts" in left.detail
        assert "node gc" in left.fix
    finally:
        node = await Node.open(cfg)
        try:
            await node.gc(everything=True)
        finally:
            await node.close()
    assert {c.name: c for c in run_checks(cfg)}["leftovers"].ok
    assert_no_leaks(STATE, RUN, SUBTREE)
    shutil.rmtree(STATE, ignore_errors=True)
    shutil.rmtree(RUN, ignore_errors=True)


async def test_node_start_raises_its_open_files_and_reports_its_capacity() -> None:
    """A node for 10,000 sandboxes keeps ~2 fds each: it raises its own RLIMIT_NOFILE (as
    root, up to fs.nr_open) instead of failing with EMFILE near the shell's 20,000; its
    status says how many idle sandboxes the host holds and what binds that."""
    import resource

    from corral.node import deadlines, limits

    cfg = node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, max_sandboxes=10000)
    node = await Node.open(cfg)
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert soft == hard  # raised to the hard limit at least
        if _may_raise_hard():  # without CAP_SYS_RESOURCE (this host) the hard one stays
            want = limits.FDS_PER_SANDBOX * 10000 + deadlines.RESERVED_FDS
            assert soft >= min(want, limits.sysctl("fs.nr_open") or 0)
        # What it cannot raise, it lives within: pidfds stop at the budget.
        assert node.reaper.deaths.max_fds == deadlines.pidfd_budget(soft)
        st = await node.node_status()
        assert st.idle_capacity > 0 and st.idle_capacity_bound, st
    finally:
        await node.close()
    assert_no_leaks(STATE, RUN, SUBTREE)
    shutil.rmtree(STATE, ignore_errors=True)
    shutil.rmtree(RUN, ignore_errors=True)


def _may_raise_hard() -> bool:
    """CAP_SYS_RESOURCE in the effective set (bit 24)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False
