"""CPU classes: best-effort sandboxes run SCHED_IDLE in an idle cgroup and cannot leave it;
latency sandboxes get SCHED_OTHER under the normal ``<subtree>-latency`` root (the class is
the cgroup's place, so the guest's cgroup namespace still shows only ``/``). Checked in the
kernel's own figures (/proc/PID/sched policy, /proc/PID/cgroup, the cgroup's cpu files) and
from inside the guest."""

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


def _cgroups_of(pid: int) -> dict[str, str]:
    """controller -> cgroup path of ``pid`` from the host's view (/proc/PID/cgroup)."""
    out = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(","):
                out[c] = path
    return out


def _placed_under(node: Node, sid: str, top: str) -> None:
    """Every thread of every process of the sandbox is in ``/<top>/<sid>`` for each of
    the controllers corral limits, and the guest sees its own cgroups as ``/``."""
    tids = [int(t) for p in _guest_pids(node, sid) for t in os.listdir(f"/proc/{p}/task")]
    assert len(tids) >= 3, tids  # the init's two threads and a guest process
    for t in tids:
        got = _cgroups_of(t)
        for c in ("cpu", "memory", "pids", "freezer"):
            assert got.get(c) == f"/{top}/{sid}", (t, c, got)


def _guest_pids(node: Node, sid: str) -> list[int]:
    return node.cgroups.procs(sid)


async def test_best_effort_is_sched_idle_and_stays(node: Node):
    info = await node.sandbox_create(_spec("best_effort"))
    try:
        assert info.spec.qos == "best_effort"
        assert sched.policy_of(info.pid) == "idle"  # type: ignore[arg-type]
        # the class is the cgroup's place: under corral's subtree, idle at the root
        knobs = node.cgroups.cpu_class(info.id)
        assert knobs.get("group_idle", 1) == 1 or knobs["weight"] <= 2, knobs
        await node.spawn(info.id, ExecRequest(cmd=["sleep", "30"]))
        _placed_under(node, info.id, node.cgroups.subtree)
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
    assert info.id not in node.cgroups.list()


async def test_latency_class_is_normal(node: Node):
    info = await node.sandbox_create(_spec("latency"))
    try:
        assert sched.policy_of(info.pid) == "other"  # type: ignore[arg-type]
        knobs = node.cgroups.cpu_class(info.id)
        assert knobs.get("idle", 0) == 0 and knobs.get("group_idle", 0) == 0, knobs
        r = await node.exec(info.id, ExecRequest(cmd=["python3", "-c", PROBE]))
        assert r.stdout.decode().splitlines()[0] == str(os.SCHED_OTHER)
        await node.spawn(info.id, ExecRequest(cmd=["sleep", "30"]))
        _placed_under(node, info.id, node.cgroups.latency_root)
        # the guest's own view: its cgroup namespace is rooted at its cgroup
        r = await node.exec(info.id, ExecRequest(cmd=["cat", "/proc/self/cgroup"]))
        lines = [ln.split(":", 2) for ln in r.stdout.decode().splitlines()]
        assert lines and {path for _, _, path in lines} == {"/"}, r.stdout
    finally:
        await node.sandbox_destroy(info.id)
    assert info.id not in node.cgroups.list()
    hier = node.cgroups.hierarchy("memory")
    assert not (hier / node.cgroups.latency_root / info.id).exists()


async def test_status_reports_core_scheduling(node: Node):
    ok, detail = sched.core_scheduling()
    st = await node.node_status()
    assert st.core_scheduling is ok
    assert "PR_SCHED_CORE" in st.qos_detail
    if not ok:  # this kernel: reported, not silently assumed
        assert "EINVAL" in st.qos_detail or "not" in st.qos_detail


async def test_failed_latency_create_leaves_no_cgroup(node: Node, monkeypatch):
    """A latency create that fails after the runtime started (its init never answers)
    leaves nothing under either root."""
    from corral.backends.initclient import InitClient
    from corral.errors import SandboxError

    async def fail(self: InitClient, *a: object, **kw: object) -> None:
        raise SandboxError("injected: no answer")

    monkeypatch.setattr(InitClient, "ping", fail)
    before = set(node.cgroups.list())
    try:
        await node.sandbox_create(_spec("latency"))
    except Exception as e:
        assert "injected" in str(e), e
    else:
        raise AssertionError("create did not fail")
    assert set(node.cgroups.list()) == before


async def test_create_returns_once_the_init_runs_even_under_load(node: Node):
    """A best-effort sandbox's setup (the runtime's last steps inside its cgroup) runs on
    idle CPU only. With normal-priority work on every CPU the runtime may return long
    before that setup ends; create must still return only once the init answers (a node
    killed in between would otherwise leave a sandbox whose setup then fails)."""
    import subprocess

    burners = [
        subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(os.cpu_count() or 1)
    ]
    try:
        info = await node.sandbox_create(_spec("best_effort"))
        try:
            with open(f"/proc/{info.pid}/comm") as f:
                assert f.read().strip() == "init"  # not the runtime's "memfd:crun" any more
        finally:
            for b in burners:
                b.kill()
            await node.sandbox_destroy(info.id)
    finally:
        for b in burners:
            b.kill()
            b.wait()
