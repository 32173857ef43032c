"""Snapshot and fork through the SDK, against FakeNode, over every transport."""

from __future__ import annotations

import pytest

import corral
from corral.errors import InvalidRequest
from corral.testing import FakeNode
from tests.unit.test_sdk import client, short_dir  # noqa: F401 - fixtures


async def test_snapshot_then_create_restores_files(client: corral.AsyncClient) -> None:  # noqa: F811
    sb = await client.sandboxes.create(image="demo/python", workdir="/work")
    await sb.files.write("/work/a.txt", b"state\n")
    snap = await sb.snapshot()
    assert isinstance(snap, corral.ImageInfo)
    assert snap.name.startswith(f"snapshot/{sb.id}:")
    assert snap.layers[:-1] == (await client.images.get("demo/python")).layers
    named = await sb.snapshot(name="task/7:after-step-3")
    assert named.name == "task/7:after-step-3"
    await sb.files.write("/work/a.txt", b"changed\n")  # after the snapshot: not in it
    copy = await client.sandboxes.create(image=snap)
    assert await copy.files.read("/work/a.txt") == b"state\n"
    assert (await client.sandboxes.get(copy.id)).info.spec.image == snap.digest


async def test_fork_inherits_overrides_and_is_independent(client: corral.AsyncClient) -> None:  # noqa: F811
    sb = await client.sandboxes.create(
        image="demo/python", labels={"job": "j"}, limits={"memory": "256MiB"}
    )
    await sb.files.write("/work/f", b"parent")
    kids = await sb.fork(3, labels={"job": "j-kids"}, ttl=600)
    assert len(kids) == 3 and all(isinstance(k, corral.Sandbox) for k in kids)
    for k in kids:
        assert k.info.spec.labels == {"job": "j-kids"}
        assert k.info.spec.limits.memory == 256 << 20
        assert k.info.spec.ttl == 600
        assert await k.files.read("/work/f") == b"parent"
    await kids[0].files.write("/work/f", b"kid0")
    assert await sb.files.read("/work/f") == b"parent"
    assert await kids[1].files.read("/work/f") == b"parent"
    assert {s.id for s in await client.sandboxes.list(labels={"job": "j-kids"})} == {
        k.id for k in kids
    }


async def test_fork_rejects_bad_input(client: corral.AsyncClient) -> None:  # noqa: F811
    sb = await client.sandboxes.create(image="demo/python")
    with pytest.raises(InvalidRequest, match="count"):
        await sb.fork(0)
    with pytest.raises(InvalidRequest, match="count"):
        await sb.fork(100000)
    with pytest.raises(InvalidRequest, match="label"):
        await sb.fork(1, labels={"bad key!": "x"})
    with pytest.raises(InvalidRequest, match="image name"):
        await sb.snapshot(name="Not A Name")


def test_sync_client_fork_returns_blocking_handles() -> None:
    with corral.Client(ops=FakeNode(), own_ops=True) as c:
        sb = c.sandboxes.create(image="demo/base")
        sb.files.write("/tmp/x", b"1")
        kids = sb.fork(2)
        assert [k.files.read("/tmp/x") for k in kids] == [b"1", b"1"]
        img = sb.snapshot()
        assert c.sandboxes.create(image=img).files.read("/tmp/x") == b"1"


def test_cli_snapshot_and_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    import corral.cli.app as cli_app
    from corral.sdk import AsyncClient

    node = FakeNode()
    monkeypatch.setattr(cli_app, "_client_factory", lambda g: AsyncClient(ops=node))

    def cli(*args: str):  # type: ignore[no-untyped-def]
        return CliRunner().invoke(cli_app.app, list(args))

    sid = cli("sandbox", "create", "demo/python", "--label", "job=a").stdout.strip()
    r = cli("sandbox", "snapshot", sid, "--name", "task/1:s")
    assert r.exit_code == 0 and r.stdout.strip() == "task/1:s", r.stderr
    r = cli("sandbox", "fork", sid, "-n", "3", "--memory", "300MiB", "--json")
    assert r.exit_code == 0, r.stderr
    kids = json.loads(r.stdout)
    assert len(kids) == 3
    assert all(k["spec"]["limits"]["memory"] == 300 << 20 for k in kids)
    assert all(k["spec"]["labels"] == {"job": "a"} for k in kids)
    r = cli("sandbox", "fork", sid, "-n", "2", "-l", "job=b")
    assert r.exit_code == 0 and len(r.stdout.split()) == 2
    r = cli("sandbox", "fork", sid, "--memory", "lots")
    assert r.exit_code == 2 and "memory" in r.stderr, (r.exit_code, r.stderr)
    r = cli("sandbox", "snapshot", sid, "--name", "Bad Name")
    assert r.exit_code == 2 and "image name" in r.stderr
