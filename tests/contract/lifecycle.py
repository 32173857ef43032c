"""The contract of lifecycle, pause/resume, events and errors of unknown things."""

from __future__ import annotations

import time

import pytest

from corral.errors import ImageNotFound, InvalidRequest, ProcessNotFound, SandboxNotFound
from corral.ops import NodeOps
from corral.spec import ExecRequest, ForkRequest, NetworkPolicy, SandboxInfo, SandboxSpec
from tests.contract.api import (
    UNKNOWN_ID,
    backend_of,
    cursor_now,
    cursor_of,
    events_after,
    is_sandbox_id,
)
from tests.contract.base import ContractBase, raises_exactly, run


class LifecycleContract(ContractBase):
    async def test_create_get_list_destroy(self, ops: NodeOps, run_label: str) -> None:
        info = await self.new_sandbox(ops, run_label, "life")
        assert is_sandbox_id(info.id), info.id
        assert info.state == "running" and backend_of(info)
        assert (info.image, info.spec.labels["role"]) == (self.image, "life")
        got = await ops.sandbox_get(info.id)
        assert (got.id, got.state, got.spec) == (info.id, "running", info.spec)
        mine = {"contract": run_label, "role": "life"}
        assert [i.id for i in await ops.sandbox_list(mine)] == [info.id]
        assert info.id in {i.id for i in await ops.sandbox_list()}
        assert await ops.sandbox_list({"contract": run_label, "role": "nobody-has-it"}) == []
        assert (await ops.node_status()).sandboxes == len(await ops.sandbox_list())

        await ops.sandbox_destroy(info.id)
        # A destroyed sandbox is still known (its state, its events) but takes no requests.
        assert (await ops.sandbox_get(info.id)).state == "destroyed"
        assert await ops.sandbox_list(mine) == []
        assert info.id not in {i.id for i in await ops.sandbox_list()}
        for call in (
            lambda: ops.sandbox_destroy(info.id),
            lambda: ops.exec(info.id, ExecRequest(cmd=["true"])),
            lambda: ops.file_read(info.id, "/etc/hostname"),
            lambda: ops.sandbox_pause(info.id),
            lambda: ops.shell_open(info.id),
        ):
            with raises_exactly(SandboxNotFound, match=info.id):
                await call()
        kinds = [e.kind for e in await events_after(ops, sandbox_id=info.id)]
        assert kinds[0] == "created" and kinds[-1] == "destroyed", kinds

    async def test_unknown_ids_are_not_found(self, ops: NodeOps, sb: SandboxInfo) -> None:
        for sid in (UNKNOWN_ID, "nonsense"):
            for call in (
                lambda: ops.sandbox_get(sid),
                lambda: ops.sandbox_destroy(sid),
                lambda: ops.sandbox_pause(sid),
                lambda: ops.sandbox_resume(sid),
                lambda: ops.exec(sid, ExecRequest(cmd=["true"])),
                lambda: ops.spawn(sid, ExecRequest(cmd=["true"])),
                lambda: ops.file_read(sid, "/etc/hostname"),
                lambda: ops.file_write(sid, "/tmp/x", b""),
                lambda: ops.shell_open(sid),
                lambda: ops.process_list(sid),
                lambda: events_after(ops, sandbox_id=sid),
                lambda: ops.sandbox_fork(sid, ForkRequest()),
                lambda: ops.sandbox_set_ttl(sid, 10),
            ):
                with raises_exactly(SandboxNotFound, match=sid):
                    await call()
        for call in (
            lambda: ops.process_get(sb.id, "p-nosuchproc"),
            lambda: ops.process_kill(sb.id, "p-nosuchproc"),
            lambda: ops.shell_run(sb.id, "sh-nosuchshell", "true"),
            lambda: ops.shell_close(sb.id, "sh-nosuchshell"),
        ):
            with raises_exactly(ProcessNotFound, match="nosuch"):
                await call()

    async def test_bad_creates_are_refused(self, ops: NodeOps, run_label: str) -> None:
        with raises_exactly(ImageNotFound, match="no/such-image"):
            await ops.sandbox_create(SandboxSpec(image="no/such-image"))
        spec = SandboxSpec(image=self.image, labels={"contract": run_label, "role": "bad"})
        with raises_exactly(InvalidRequest, match="no-such-permission"):
            await ops.sandbox_create(
                spec.model_copy(update={"network": NetworkPolicy(allow=["no-such-permission"])})
            )
        assert await ops.sandbox_list({"contract": run_label, "role": "bad"}) == []

    async def test_pause_resume_and_transparent_resume(
        self, ops: NodeOps, run_label: str, sb: SandboxInfo
    ) -> None:
        info = await self.new_sandbox(ops, run_label, "pause")
        try:
            paused_before = (await ops.node_status()).paused
            assert (await ops.sandbox_pause(info.id)).state == "paused"
            assert (await ops.node_status()).paused == paused_before + 1
            assert (await ops.sandbox_get(info.id)).state == "paused"
            assert (await ops.sandbox_pause(info.id)).state == "paused"  # already: no-op
            assert (await ops.sandbox_resume(info.id)).state == "running"
            assert (await ops.sandbox_resume(info.id)).state == "running"  # already: no-op
            await ops.sandbox_pause(info.id)
            r = await run(ops, info.id, "echo", "awake")  # resumes it first
            assert (r.stdout, r.exit_code) == (b"awake\n", 0)
            assert (await ops.sandbox_get(info.id)).state == "running"
            evs = await events_after(ops, sandbox_id=info.id, kinds=["paused", "resumed"])
            assert [e.kind for e in evs] == ["paused", "resumed", "paused", "resumed"]
            assert [e.detail.get("transparent") for e in evs[1::2]] == [False, True]
            await ops.sandbox_pause(info.id)
            assert (await ops.sandbox_resume(info.id, prefetch=True)).state == "running"
            last = (await events_after(ops, sandbox_id=info.id, kinds=["resumed"]))[-1]
            assert (last.detail.get("transparent"), last.detail.get("prefetch")) == (False, True)

            # By labels: only the job's sandboxes, the shared one stays running.
            job = {"contract": run_label, "role": "pause"}
            assert [i.id for i in await ops.sandboxes_pause(job)] == [info.id]
            assert (await ops.sandbox_get(info.id)).state == "paused"
            assert (await ops.sandbox_get(sb.id)).state == "running"
            resumed = await ops.sandboxes_resume(job)
            assert [(i.id, i.state) for i in resumed] == [(info.id, "running")]
            assert await ops.sandboxes_resume(job) == []  # none paused any more
            for call in (lambda: ops.sandboxes_pause({}), lambda: ops.sandboxes_resume({})):
                with raises_exactly(InvalidRequest, match="label"):
                    await call()
        finally:
            await ops.sandbox_destroy(info.id)

    async def test_events(self, ops: NodeOps, run_label: str, sb: SandboxInfo) -> None:
        mine = await events_after(ops, sandbox_id=sb.id)
        assert mine and mine[0].kind == "created"
        assert {e.sandbox_id for e in mine} == {sb.id}
        assert [e.id for e in mine] == sorted(e.id for e in mine)  # oldest first

        start = await cursor_now(ops)
        other = await self.new_sandbox(ops, run_label, "events")
        await ops.sandbox_destroy(other.id)
        after = await events_after(ops, start)
        # (other sandboxes' events may come between: a node's pools, its reaper)
        theirs = [e.kind for e in after if e.sandbox_id == other.id]
        assert [k for k in theirs if k in ("created", "destroyed")] == ["created", "destroyed"]
        assert all(e.sandbox_id != sb.id or e.kind != "created" for e in after)
        by_label = await events_after(ops, start, labels={"contract": run_label, "role": "events"})
        assert {e.sandbox_id for e in by_label} == {other.id}
        only = await events_after(ops, start, kinds=["destroyed"])
        assert [e.sandbox_id for e in only if e.sandbox_id == other.id] == [other.id]
        assert {e.kind for e in only} == {"destroyed"}
        assert await events_after(ops, cursor_of(after, start), sandbox_id=other.id) == []

    @pytest.mark.parametrize("reason", ["timeout", "output_limit"])
    async def test_exec_limits_are_events(self, ops: NodeOps, sb: SandboxInfo, reason: str) -> None:
        start = cursor_of(await events_after(ops, sandbox_id=sb.id))
        if reason == "timeout":
            r = await run(ops, sb.id, "sleep", "30", timeout=0.3)
        else:
            r = await run(ops, sb.id, "echo", "x" * 4096, output_limit=1024)
        assert r.reason == reason
        kinds = [e.kind for e in await events_after(ops, start, sandbox_id=sb.id)]
        assert kinds.count(reason) == 1, kinds

    async def test_set_ttl(self, ops: NodeOps, sb: SandboxInfo) -> None:
        before = time.time()
        info = await ops.sandbox_set_ttl(sb.id, 3600)
        assert info.expires_at is not None and before + 3600 <= info.expires_at
        assert (await ops.sandbox_get(sb.id)).expires_at == info.expires_at
        assert (await ops.sandbox_set_ttl(sb.id, None)).expires_at is None
        with raises_exactly(InvalidRequest, match="ttl"):
            await ops.sandbox_set_ttl(sb.id, 0)

    async def test_network_update(self, ops: NodeOps, sb: SandboxInfo) -> None:
        start = cursor_of(await events_after(ops, sandbox_id=sb.id))
        info = await ops.network_update(sb.id, allow=[], deny=[])
        assert info.id == sb.id and info.spec.network == NetworkPolicy()
        assert (await ops.sandbox_get(sb.id)).spec.network == NetworkPolicy()
        evs = await events_after(ops, start, sandbox_id=sb.id, kinds=["network_updated"])
        assert [(e.detail.get("allow"), e.detail.get("deny")) for e in evs] == [("", "")]
        with raises_exactly(InvalidRequest, match="no-such-permission"):
            await ops.network_update(sb.id, allow=["no-such-permission"])
        assert (await ops.sandbox_get(sb.id)).spec.network == NetworkPolicy()  # unchanged
