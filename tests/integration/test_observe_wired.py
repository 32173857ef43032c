"""Acceptance test of the node's own timing (issue 14 wiring): the node times its phases at
the source and its stats agree with what a caller measures around the calls.

Skipped while the node has no ``observer`` (the wiring is the lead's, see
docs/observability.md); it then becomes the check that the wiring is right.
"""

from __future__ import annotations

import time
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral.sdk._stats import fetch_stats, fetch_timeline
from corral.spec import ExecRequest, SandboxSpec

CREATE_PHASES = {"admission", "layer_mounts", "rootfs", "runtime_start", "init_ready"}
EXEC_PHASES = {"agent_round_trip"}
# perf_counter's resolution is far below this; the slack covers the float round trip
EPS = 1e-6


async def test_node_times_its_own_phases(node) -> None:  # type: ignore[no-untyped-def]
    observer = getattr(node, "observer", None)
    if observer is None:
        pytest.skip("the node has no Observer yet (issue 14 wiring)")
    job = f"wired-{uuid.uuid4().hex[:8]}"
    spec = SandboxSpec(image="test/busybox", labels={"job": job})
    t0 = time.perf_counter()
    info = await node.sandbox_create(spec)
    create_outer = time.perf_counter() - t0
    t0 = time.perf_counter()
    await node.exec(info.id, ExecRequest(cmd=["true"]))
    exec_outer = time.perf_counter() - t0
    t0 = time.perf_counter()
    await node.sandbox_destroy(info.id)
    destroy_outer = time.perf_counter() - t0

    s = await fetch_stats(node, {"job": job})
    create, ex = s.ops["create"], s.ops["exec"]
    assert create.count == 1 and ex.count == 1
    assert CREATE_PHASES <= set(create.phases), create.phases
    assert EXEC_PHASES <= set(ex.phases), ex.phases
    # the node's figures lie inside what the caller measured around each call
    assert create.max <= create_outer + EPS
    assert ex.max <= exec_outer + EPS
    assert s.ops["destroy"].max <= destroy_outer + EPS
    # phases are parts of the whole, never more than it
    assert sum(p.max for p in create.phases.values()) <= create.max + EPS
    assert sum(p.max for p in ex.phases.values()) <= ex.max + EPS
    assert s.events.get("created") == 1

    timeline = await fetch_timeline(node, info.id)
    assert [e.name for e in timeline if e.kind == "op"] == ["create", "exec", "destroy"]

    seen = {}
    for fam in text_string_to_metric_families(observer.render().decode()):
        for sm in fam.samples:
            if sm.labels.get("label_job") == job and sm.name.endswith("_count"):
                seen[(sm.name, sm.labels["op"], sm.labels.get("phase"))] = sm.value
    assert seen[("corral_op_duration_seconds_count", "create", None)] == 1
    for phase in CREATE_PHASES:
        assert seen[("corral_op_phase_seconds_count", "create", phase)] == 1
