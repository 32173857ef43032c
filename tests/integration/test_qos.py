"""CPU classes: best-effort sandboxes run SCHED_IDLE in an idle cgroup and cannot leave it;
latency sandboxes get SCHED_OTHER and the normal weight. Checked in the kernel's own
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


def _guest_pids(node: Node, sid: str) -> list[int]:
    return node.cgroups.procs(sid)


async def test_best_effort_is_sched_idle_and_stays(node: Node):
    info = await node.sandbox_create(_spec("best_effort"))
    try:
        assert info.spec.qos == "best_effort"
        assert sched.policy_of(info.pid) == "idle"  # type: ignore[arg-type]
        knobs = node.cgroups.cpu_class(info.id)
        assert knobs.get("idle") == 1 or knobs["weight"] <= 2, knobs
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
        assert knobs.get("idle", 0) == 0 and knobs["weight"] in (10000, 262144), knobs
        r = await node.exec(info.id, ExecRequest(cmd=["python3", "-c", PROBE]))
        assert r.stdout.decode().splitlines()[0] == str(os.SCHED_OTHER)
    finally:
        await node.sandbox_destroy(info.id)


async def test_status_reports_core_scheduling(node: Node):
    ok, detail = sched.core_scheduling()
    st = await node.node_status()
    assert st.core_scheduling is ok
    assert "PR_SCHED_CORE" in st.qos_detail
    if not ok:  # this kernel: reported, not silently assumed
        assert "EINVAL" in st.qos_detail or "not" in st.qos_detail
