"""Pause / resume through every transport, the sync client and the CLI (FakeNode)."""

from __future__ import annotations

import json

import pytest

import corral
from corral.testing import FakeNode
from tests.unit.test_cli import cli, fake  # noqa: F401 - fixtures
from tests.unit.test_sdk import client, short_dir, sync_client  # noqa: F401 - fixtures


async def test_pause_resume_and_transparent_resume(client: corral.AsyncClient) -> None:  # noqa: F811
    sb = await client.sandboxes.create(image="demo/python", idle_pause=30, qos="latency")
    assert sb.info.spec.idle_pause == 30 and sb.info.spec.qos == "latency"
    assert (await sb.pause()).state == "paused"
    assert (await sb.refresh()).state == "paused"
    assert (await client.node_status()).paused == 1
    assert (await sb.resume()).state == "running"
    await sb.pause()
    assert (await sb.exec("echo hi")).stdout == b"hi\n"  # resumes first
    assert (await sb.refresh()).state == "running"
    kinds = [e.kind for e in await sb.events()]
    assert kinds.count("paused") == 2 and kinds.count("resumed") == 2


async def test_job_pause_by_labels(client: corral.AsyncClient) -> None:  # noqa: F811
    job = [
        await client.sandboxes.create(image="demo/python", labels={"job": "rl-42"})
        for _ in range(3)
    ]
    other = await client.sandboxes.create(image="demo/python", labels={"job": "x"})
    paused = await client.sandboxes.pause(labels={"job": "rl-42"})
    assert sorted(s.id for s in paused) == sorted(s.id for s in job)
    assert (await other.refresh()).state == "running"
    resumed = await client.sandboxes.resume(labels={"job": "rl-42"})
    assert {s.info.state for s in resumed} == {"running"} and len(resumed) == 3
    with pytest.raises(corral.errors.InvalidRequest, match="label"):
        await client.sandboxes.pause(labels={})


async def test_bad_qos_is_refused(client: corral.AsyncClient) -> None:  # noqa: F811
    with pytest.raises(corral.errors.InvalidRequest, match="qos"):
        await client.sandboxes.create(image="demo/python", qos="fast")


def test_sync_client_pause(sync_client: corral.Client) -> None:  # noqa: F811
    sb = sync_client.sandboxes.create(image="demo/python", labels={"job": "j"})
    assert sb.pause().state == "paused"
    assert [s.id for s in sync_client.sandboxes.resume(labels={"job": "j"})] == [sb.id]


def test_cli_pause_resume(fake: FakeNode) -> None:  # noqa: F811
    r = cli("sandbox", "create", "demo/python", "-l", "job=a", "--qos", "latency")
    assert r.exit_code == 0, r.stderr
    sid = r.stdout.strip()
    r = cli("sandbox", "pause", sid)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split()[:2] == [sid, "paused"]
    r = cli("--json", "sandbox", "resume", "--label", "job=a")
    assert r.exit_code == 0, r.stderr
    assert [i["id"] for i in json.loads(r.stdout)] == [sid]
    r = cli("sandbox", "pause")
    assert r.exit_code == 2 and "--label" in r.stderr


async def test_memory_snapshot_pause_is_refused_for_containers(
    client: corral.AsyncClient,  # noqa: F811
) -> None:
    """pause(memory_snapshot=True) crosses every transport; a container cannot do it."""
    sb = await client.sandboxes.create(image="demo/python")
    with pytest.raises(corral.errors.InvalidRequest, match="memory_snapshot.*container"):
        await sb.pause(memory_snapshot=True)
    assert (await sb.refresh()).state == "running"


def test_cli_memory_snapshot_flag(fake: FakeNode) -> None:  # noqa: F811
    r = cli("sandbox", "create", "demo/python")
    sid = r.stdout.split()[0]
    r = cli("sandbox", "pause", "--memory-snapshot", sid)
    assert r.exit_code != 0 and "not for container sandboxes" in r.output, r.output
    r = cli("sandbox", "pause", "--memory-snapshot", "--label", "a=b")
    assert r.exit_code != 0 and "name sandbox ids" in r.output, r.output
