"""The blocking client's jobs, and the jobs API's bad input, over an in-process control plane.

``LocalControl`` stands in for the Ray transport only: the real :class:`ControlPlane`
(the body of the control-plane actor) runs in-process over fake nodes, and the client's
``RemoteJobs``/``RemoteJob`` talk to it through the same JSON calls as over Ray.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest

import corral
from corral.cluster import FleetClient
from corral.cluster.ray_actors import ControlPlane
from corral.cluster.ray_client import RemoteJobs
from corral.errors import CapacityError, Conflict, InvalidRequest, JobQuotaExceeded, NotFound
from corral.sdk._sync_gen import BlockingRemoteJob, BlockingRemoteJobs, BlockingSandbox
from corral.spec import SandboxInfo
from corral.testing import FakeNode


class LocalControl(FleetClient):
    """A cluster client whose control plane is an in-process ControlPlane (no Ray)."""

    def __init__(self, n: int = 2, cap: int = 4) -> None:
        nodes = {f"n{i}": FakeNode(f"n{i}", max_sandboxes=cap) for i in range(n)}
        super().__init__(nodes, seed=1)
        self.cp = ControlPlane()
        for nid, node in nodes.items():
            self.cp._fleet.add_node(nid, node)
        self.jobs = RemoteJobs(self)  # type: ignore[arg-type]

    async def call(self, method: str, *args: Any) -> Any:
        got = getattr(self.cp, method)(*args)
        return await got if inspect.isawaitable(got) else got

    async def learn(self, infos: list[SandboxInfo]) -> list[SandboxInfo]:
        return self._remember(infos)

    async def start(self) -> None:
        await self.refresh()
        await self.cp._fleet.refresh()


def _client(**kw: Any) -> tuple[corral.Client, LocalControl]:
    ops = LocalControl(**kw)
    client = corral.Client(ops=ops)
    client.__enter__()
    client._portal.call(ops.start())  # type: ignore[attr-defined]
    return client, ops


def test_blocking_client_jobs_are_blocking_objects() -> None:
    client, ops = _client()
    try:
        assert isinstance(client.jobs, BlockingRemoteJobs)
        job = client.jobs.open("rl-sync", max_sandboxes=4, max_creates_per_s=100)
        assert isinstance(job, BlockingRemoteJob)
        with job:
            group = job.create_group(3, "demo/base")
            assert len(group) == 3 and all(isinstance(sb, BlockingSandbox) for sb in group)
            assert group[0].exec(["echo", "hi"]).stdout == b"hi\n"
            one = job.create("demo/base")
            with pytest.raises(JobQuotaExceeded, match="over by 1"):
                job.create("demo/base")
            assert {i.state for i in job.pause()} == {"paused"}
            assert {i.state for i in job.resume()} == {"running"}
            assert len(job.sandboxes()) == 4
            assert client.jobs.state("rl-sync")["live"] == 4
            one.destroy()
        assert client.sandboxes.list(labels={"corral.job": "rl-sync"}) == []
    finally:
        client.close()


def test_jobs_bad_input_is_refused_clearly() -> None:
    client, ops = _client(n=2, cap=3)
    try:
        with pytest.raises(NotFound, match="no job 'nope'"):
            client.jobs.state("nope")
        with pytest.raises(NotFound, match="no job 'nope'"), client.jobs.attach("nope"):
            pass
        with pytest.raises(InvalidRequest, match="quota of zero"):
            with client.jobs.open("z", max_sandboxes=0):
                pass
        with pytest.raises(InvalidRequest, match="job name"):
            with client.jobs.open("bad name!"):
                pass
        with client.jobs.open("g", max_sandboxes=100) as job:
            # 2 nodes of 3: a group of 7 fails at once, naming the shortfall, making nothing
            with pytest.raises(CapacityError, match="room for 6 more .*short by 1"):
                job.create_group(7, "demo/base")
            assert job.sandboxes() == []
            with pytest.raises(InvalidRequest, match="group size"):
                job.create_group(0, "demo/base")
        # a lease that lapsed: renewing is refused (attach instead), creating too
        with client.jobs.open("late", lease_ttl=30) as job:
            cp_job = ops.cp._jobs.get("late")
            cp_job.lease_until = 0.0
            client._portal.call(ops.cp._jobs.tick())  # type: ignore[attr-defined]
            with pytest.raises(Conflict, match="expired"):
                json_err = client._portal.call(ops.call("job_renew", "late"))  # type: ignore[attr-defined]
                from corral.cluster.ray_client import _unwire

                _unwire(json_err)
            with pytest.raises(Conflict, match="attach"):
                job.create("demo/base")
            assert client.jobs.state("late")["state"] == "expired"
        # closing an expired job ends it; then it is unknown
        with pytest.raises(NotFound, match="no job 'late'"):
            client.jobs.state("late")
    finally:
        client.close()


def test_control_plane_answers_garbage_limits_with_a_clear_error() -> None:
    from corral.cluster.ray_client import _unwire

    client, ops = _client()
    try:
        for bad, why in (
            (json.dumps({"nope": 1}), "unknown .'nope'."),
            ("{", "not JSON"),
            ("[1]", "an object"),
            (json.dumps({"max_sandboxes": "many"}), "positive number"),
        ):
            raw = client._portal.call(ops.call("job_open", "x", bad))  # type: ignore[attr-defined]
            with pytest.raises(InvalidRequest, match=why):
                _unwire(raw)
        # and it still serves
        with client.jobs.open("after", max_sandboxes=1) as job:
            job.create("demo/base")
    finally:
        client.close()


def test_garbage_agent_info_is_skipped_not_added() -> None:
    from corral.cluster.ray_actors import _agent_info_ok

    good = {"node_id": "abc123", "address": "http://10.0.0.1:4000", "token": "t"}
    assert _agent_info_ok(good)
    for bad in (
        None,
        "nope",
        [],
        {},
        {**good, "node_id": "Not An Id"},
        {**good, "node_id": "cluster"},
        {**good, "address": "file:///etc/passwd"},
        {**good, "token": 5},
    ):
        assert not _agent_info_ok(bad), bad
