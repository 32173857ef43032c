"""CPU classes: best-effort sandboxes run SCHED_IDLE in an idle cgroup and cannot leave it;
latency sandboxes get SCHED_OTHER, outside the idle group (v1: corral's subtree is idle in the
cpu hierarchy and a latency sandbox's processes move to a normal sibling root there). Checked in the kernel's own
figures (/proc/PID/sched policy, the cgroup's cpu files) and from inside the guest."""

from __future__ import annotations

import os

from corral.host import sched
from corral.node import Node
from corral.spec import ExecRequest, Limits, SandboxSpec

PROBE = (
    "import os\n"
    "print(os.sched_getscheduler(0))\n"
    "try:\n"
    "    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))\n"
    "    print('escaped')\n"
    "except PermissionError:\n"
    "    print('refused')\n"
    "print(open('/proc/self/limits').read().split('Max nice priority')[1].split()[:2])\n"
)


def _spec(qos: str) -> SandboxSpec:
    return SandboxSpec(
        image="test/debian",
        limits=Limits(memory="128MiB", disk="64MiB"),
        qos=qos,  # type: ignore[arg-type]
    )


def _cpu_cgroup(pid: int) -> str:
    """The cpu-controller cgroup path of ``pid`` (a v1 line ``N:cpu:/path``)."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if "cpu" in ctrls.split(","):
                return path
    raise AssertionError(f"no cpu cgroup line for {pid}")


def _guest_pids(node: Node, sid: str) -> list[int]:
    return node.cgroups.procs(sid)


async def test_best_effort_is_sched_idle_and_stays(node: Node):
    info = await node.sandbox_create(_spec("best_effort"))
    try:
        assert info.spec.qos == "best_effort"
        assert sched.policy_of(info.pid) == "idle"  # type: ignore[arg-type]
        knobs = node.cgroups.cpu_class(info.id)
        if node.cgroups.mode == "v2":
            assert knobs.get("idle") == 1 or knobs["weight"] <= 2, knobs
        else:  # the whole subtree is idle in the cpu hierarchy; the sandbox sits in it
            assert knobs.get("group_idle", 1) == 1, knobs
            assert _cpu_cgroup(info.pid) == f"/{node.cgroups.subtree}/{info.id}"  # type: ignore[arg-type]
        r = await node.exec(info.id, ExecRequest(cmd=["python3", "-c", PROBE]))
        assert r.ok, r.stderr
        lines = r.stdout.decode().splitlines()
        assert lines[0] == str(os.SCHED_IDLE)
        assert lines[1] == "refused"  # SCHED_IDLE -> SCHED_OTHER needs RLIMIT_NICE/CAP_SYS_NICE
        assert lines[2] == "['0', '0']"
        # every process of the sandbox, seen from the host
        assert {sched.policy_of(p) for p in _guest_pids(node, info.id)} == {"idle"}
    finally:
        await node.sandbox_destroy(info.id)


async def test_latency_class_is_normal(node: Node):
    info = await node.sandbox_create(_spec("latency"))
    try:
        assert sched.policy_of(info.pid) == "other"  # type: ignore[arg-type]
        knobs = node.cgroups.cpu_class(info.id)
        assert knobs.get("idle", 0) == 0 and knobs.get("group_idle", 0) == 0, knobs
        r = await node.exec(info.id, ExecRequest(cmd=["python3", "-c", PROBE]))
        assert r.stdout.decode().splitlines()[0] == str(os.SCHED_OTHER)
        if node.cgroups.mode == "v2":
            assert knobs["weight"] == 10000, knobs
        else:
            # every process, the init's threads too, in the latency root of the cpu
            # hierarchy only; memory and pids where the runtime made them
            moved = f"/{node.cgroups.latency_root}/{info.id}"
            await node.spawn(info.id, ExecRequest(cmd=["sleep", "30"]))
            pids = _guest_pids(node, info.id)
            assert len(pids) >= 2
            tids = [int(t) for p in pids for t in os.listdir(f"/proc/{p}/task")]
            assert {_cpu_cgroup(t) for t in tids} == {moved}
            assert node.cgroups.memory_current(info.id) > 0
    finally:
        await node.sandbox_destroy(info.id)
    if node.cgroups.mode != "v2":
        cpu_root = node.cgroups.control_file("cpu", info.id, "x").parent.parent.parent
        assert not (cpu_root / node.cgroups.latency_root / info.id).exists()
        assert not (cpu_root / node.cgroups.subtree / info.id).exists()


async def test_status_reports_core_scheduling(node: Node):
    ok, detail = sched.core_scheduling()
    st = await node.node_status()
    assert st.core_scheduling is ok
    assert "PR_SCHED_CORE" in st.qos_detail
    if not ok:  # this kernel: reported, not silently assumed
        assert "EINVAL" in st.qos_detail or "not" in st.qos_detail


async def test_failed_latency_create_leaves_no_cgroup(node: Node, monkeypatch):
    """A create that fails after the latency move undoes the moved cpu cgroup too (the
    runtime's delete knows only the cgroups it made)."""
    from corral.errors import HostError
    from corral.policy import qos as qos_mod

    def fail(pid: int) -> None:
        raise HostError("injected: SCHED_OTHER refused")

    monkeypatch.setattr(qos_mod.sched, "make_normal", fail)
    before = set(node.cgroups.list())
    try:
        await node.sandbox_create(_spec("latency"))
    except Exception as e:
        assert "injected" in str(e), e
    else:
        raise AssertionError("create did not fail")
    assert set(node.cgroups.list()) == before
    if node.cgroups.mode != "v2":
        cpu = node.cgroups.control_file("cpu", "x", "y").parent.parent.parent
        lat = cpu / node.cgroups.latency_root
        assert not lat.is_dir() or not [c for c in lat.iterdir() if c.is_dir()]
