"""The SDK against FakeNode, through every transport: direct (``ops=``), HTTP over an
in-process ASGI transport, and HTTP over a real uvicorn on a unix socket."""

from __future__ import annotations

import contextlib
import io
import shutil
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

import corral
from corral.api import NodeServer, create_app
from corral.sdk._http import HTTPOps
from corral.sdk._sync import _Portal
from corral.spec import decode_cursor, encode_cursor, parse_sandbox_id
from corral.testing import FakeNode

TRANSPORTS = ["direct", "asgi", "uds"]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # unix socket paths are limited to 108 bytes: pytest's tmp_path can be longer
    d = Path(tempfile.mkdtemp(prefix="corral-t-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=TRANSPORTS)
async def client(
    request: pytest.FixtureRequest, short_dir: Path
) -> AsyncIterator[corral.AsyncClient]:
    node = FakeNode()
    if request.param == "direct":
        async with corral.AsyncClient(ops=node) as c:
            yield c
    elif request.param == "asgi":
        ops = HTTPOps("http://corral.test", transport=httpx.ASGITransport(create_app(node)))
        async with corral.AsyncClient(ops=ops) as c:
            yield c
        await ops.close()
    else:
        async with NodeServer(node, uds=short_dir / "api.sock") as srv:
            async with corral.AsyncClient(srv.address) as c:
                yield c


async def _sandbox(client: corral.AsyncClient, **kw: object) -> corral.Sandbox:
    return await client.sandboxes.create(image="demo/python", **kw)  # type: ignore[arg-type]


async def test_target_user_experience(client: corral.AsyncClient) -> None:
    image = await client.images.get("demo/python")
    sb = await client.sandboxes.create(
        image=image,
        limits=corral.Limits(cpus=1, memory="1GiB", pids=256, disk="2GiB"),
        ttl=3600,
        labels={"job": "rl-42"},
    )
    assert sb.info.spec.limits.memory == 1 << 30
    assert sb.info.image_digest == image.digest
    assert sb.info.expires_at is not None
    r = await sb.exec(["echo", "2"], timeout=30)
    assert isinstance(r, corral.ExecResult)
    assert (r.stdout, r.exit_code, r.reason, r.ok) == (b"2\n", 0, "exited", True)
    sh = await sb.shell()
    await sh.run("cd /work && export X=1")
    r = await sh.run("pwd; echo $X")
    assert r.stdout == b"/work\n1\n"
    await sb.files.write("/work/a.py", b"print(1)")
    assert await sb.files.read("/work/a.py") == b"print(1)"
    await sb.destroy()
    assert (await sb.refresh()).state == "destroyed"  # still known, as on a node
    with pytest.raises(corral.SandboxNotFound):
        await sb.exec(["true"])


async def test_exec_forms_and_results(client: corral.AsyncClient) -> None:
    sb = await _sandbox(client)
    r = await sb.exec("echo a && false")  # a str runs through /bin/sh -c
    assert (r.stdout, r.exit_code, r.ok) == (b"a\n", 1, False)
    r = await sb.exec(["cat"], stdin="from stdin \u00e9")
    assert r.stdout == "from stdin \u00e9".encode()
    r = await sb.exec(["cat"], stdin=b"\x00\xff\x01")  # binary survives base64 on the wire
    assert r.stdout == b"\x00\xff\x01"
    r = await sb.exec(["printenv", "A"], env={"A": "b"})
    assert r.text() == "b\n"
    r = await sb.exec(["no-such-tool"])
    assert r.exit_code == 127 and b"not found" in r.stderr
    r = await sb.exec("sleep 5", timeout=0.2)
    assert (r.reason, r.exit_code, r.signal) == ("timeout", None, 9)
    r = await sb.exec(["echo", "x" * 5000], output_limit="1KiB")
    assert len(r.stdout) == 1024 and r.stdout_truncated and r.truncated


async def test_exec_stream(client: corral.AsyncClient) -> None:
    sb = await _sandbox(client)
    async with sb.exec_stream("echo one; sleep 0.05; echo two >&2; exit 3") as stream:
        chunks = [c async for c in stream]
    assert [(c.stream, c.data) for c in chunks] == [("stdout", b"one\n"), ("stderr", b"two\n")]
    assert all(isinstance(c, corral.ExecChunk) for c in chunks)
    assert stream.result is not None and stream.result.exit_code == 3
    assert stream.result.stdout == b""  # streamed, not repeated


async def test_spawn_wait_kill_output(client: corral.AsyncClient) -> None:
    sb = await _sandbox(client)
    p = await sb.spawn("echo started; sleep 0.1; echo done")
    assert p.id and p.pid > 0
    r = await p.wait(timeout=5)
    assert r.exit_code == 0
    assert (await p.output())[0] == b"started\ndone\n"
    slow = await sb.spawn(["sleep", "30"])
    with pytest.raises(TimeoutError):
        await slow.wait(timeout=0.05)
    assert (await slow.refresh()).running
    await slow.kill(signal=15)
    r = await slow.wait(timeout=5)
    assert (r.reason, r.signal) == ("signaled", 15)
    assert {x.id for x in await sb.processes()} == {p.id, slow.id}
    assert all(isinstance(x, corral.Process) for x in await sb.processes())


async def test_shell_session(client: corral.AsyncClient) -> None:
    sb = await _sandbox(client, workdir="/tmp")
    async with await sb.shell(env={"GREETING": "hi"}) as sh:
        assert (await sh.run("pwd")).stdout == b"/tmp\n"
        await sh.run("cd /work")
        await sh.run("export N=7")
        r = await sh.run("echo $GREETING $N; pwd")
        assert r.stdout == b"hi 7\n/work\n"
        assert (await sh.run("cat", stdin="in")).stdout == b"in"
        assert (await sh.run("sleep 3", timeout=0.1)).reason == "timeout"
    with pytest.raises(corral.ProcessNotFound):
        await sh.run("true")  # closed on exit of the block


async def test_files(client: corral.AsyncClient, short_dir: Path) -> None:
    sb = await _sandbox(client)
    f = sb.files
    await f.write("/work/t.txt", "h\u00e9llo")
    await f.write("/work/t.txt", b" world", append=True)
    assert await f.read_text("/work/t.txt") == "h\u00e9llo world"
    assert await f.read("/work/t.txt", offset=1, length=2) == "\u00e9".encode()
    st = await f.stat("/work/t.txt")
    assert isinstance(st, corral.FileStat) and st.type == "file" and st.size == 12
    await f.write("/work/x.sh", b"#!/bin/sh\n", mode=0o755)
    assert (await f.stat("/work/x.sh")).mode & 0o777 == 0o755
    await f.mkdir("/work/d/e")
    assert [s.name for s in await f.list("/work")] == ["d", "t.txt", "x.sh"]
    assert await f.exists("/work/d/e") and not await f.exists("/work/nope")
    with pytest.raises(corral.NotFound):
        await f.read("/work/nope")
    with pytest.raises(corral.InvalidRequest, match="not empty"):
        await f.remove("/work/d")
    await f.remove("/work/d", recursive=True)
    assert not await f.exists("/work/d")
    with pytest.raises(corral.InvalidRequest, match="absolute"):
        await f.read("relative/path")
    with pytest.raises(corral.PathRefused):
        await f.read("/work/a\0b")

    # upload a local tree, download it back, compare
    src = short_dir / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "m.py").write_bytes(b"x = 1\n")
    (src / "README").write_text("read me")
    assert await f.upload(src, "/work") == "/work/proj"
    assert await f.read("/work/proj/pkg/m.py") == b"x = 1\n"
    out = await f.download("/work/proj", short_dir / "out")
    assert out == short_dir / "out" / "proj"
    assert (out / "pkg" / "m.py").read_bytes() == b"x = 1\n"
    assert (out / "README").read_text() == "read me"
    await f.upload(src / "README", "/tmp")
    assert await f.read_text("/tmp/README") == "read me"
    one = await f.download("/tmp/README", short_dir / "one")
    assert one == short_dir / "one" / "README" and one.read_text() == "read me"
    (short_dir / "link").symlink_to("proj/README")  # a symlink is copied as a symlink
    assert await f.upload(short_dir / "link", "/work") == "/work/link"
    assert (await f.stat("/work/link")).type == "symlink"
    with pytest.raises(corral.InvalidRequest):
        await f.upload(short_dir / "missing", "/work")


async def test_download_refuses_escaping_tar(short_dir: Path) -> None:
    class EvilNode(FakeNode):
        async def file_download_tar(self, sandbox_id: str, path: str) -> bytes:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                ti = tarfile.TarInfo("../escaped")
                ti.size = 1
                tar.addfile(ti, io.BytesIO(b"x"))
            return buf.getvalue()

    async with corral.AsyncClient(ops=EvilNode()) as client:
        sb = await _sandbox(client)
        with pytest.raises(corral.InvalidRequest, match="refused"):
            await sb.files.download("/work", short_dir / "out")
    assert not (short_dir / "escaped").exists()


async def test_lifecycle_list_events_node(client: corral.AsyncClient) -> None:
    a = await _sandbox(client, labels={"job": "a", "team": "x"})
    b = await _sandbox(client, labels={"job": "b", "team": "x"})
    assert {s.id for s in await client.sandboxes.list()} == {a.id, b.id}
    assert [s.id for s in await client.sandboxes.list(labels={"job": "a"})] == [a.id]
    assert len(await client.sandboxes.list(labels={"team": "x", "job": "b"})) == 1
    got = await client.sandboxes.get(a.id)
    assert isinstance(got, corral.Sandbox) and got.info == a.info
    assert (await a.refresh()).state == "running"
    async with b:
        pass  # destroyed on exit
    assert (await client.sandboxes.get(b.id)).info.state == "destroyed"  # still known
    with pytest.raises(corral.SandboxNotFound):
        await b.exec(["true"])
    kinds = [(e.sandbox_id, e.kind) for e in await client.events()]
    assert kinds == [(a.id, "created"), (b.id, "created"), (b.id, "destroyed")]
    assert [e.kind for e in await b.events()] == ["created", "destroyed"]
    last = (await client.events())[-1].cursor
    assert await client.events(after=last) == []
    assert [e.sandbox_id for e in await client.events(labels={"job": "a"})] == [a.id]
    assert [e.kind for e in await client.events(sandbox_id=a.id)] == ["created"]
    status = await client.node_status()
    assert isinstance(status, corral.NodeStatus) and status.sandboxes == 1
    assert status.default_backend == "container"
    assert [b.kind for b in status.backends] == ["container"]


async def test_ids_name_their_node_and_backend(client: corral.AsyncClient) -> None:
    sb = await _sandbox(client)
    node = (await client.node_status()).node_id
    assert parse_sandbox_id(sb.id)[1] == node == sb.info.node_id
    assert sb.info.backend == "container"
    same = await client.sandboxes.create(image="demo/base", backend="container")
    assert same.info.backend == "container"
    with pytest.raises(corral.InvalidRequest, match="backend"):
        await client.sandboxes.create(image="demo/base", backend="microvm")
    with pytest.raises(corral.InvalidRequest, match="backend"):
        await client.sandboxes.create(image="demo/base", backend="Not A Name")


async def test_events_page_with_a_cursor(client: corral.AsyncClient) -> None:
    sbs = [await _sandbox(client, labels={"job": "p"}) for _ in range(5)]
    everything = await client.events()
    assert [e.sandbox_id for e in everything] == [s.id for s in sbs]
    node = (await client.node_status()).node_id
    assert {e.node_id for e in everything} == {node}
    seen, cursor = [], None
    while page := await client.events(after=cursor, limit=2):
        assert len(page) <= 2
        seen += page
        cursor = page[-1].cursor
    assert seen == everything
    # a cursor is opaque and holds one position per node; other nodes' positions pass through
    pos = decode_cursor(everything[1].cursor)
    assert pos == {node: everything[1].id}
    merged = encode_cursor({**pos, "othernode": 42})
    rest = await client.events(after=merged)
    assert [e.id for e in rest] == [e.id for e in everything[2:]]
    assert decode_cursor(rest[-1].cursor) == {node: everything[-1].id, "othernode": 42}
    # the per-sandbox route pages the same way
    one = await sbs[0].events(after=everything[0].cursor)
    assert one == []
    for bad in ("12", "c1.not-json", "c2.e30", encode_cursor({})[:-1] + "!"):
        with pytest.raises(corral.InvalidRequest, match="after"):
            await client.events(after=bad)
    for limit in (0, 10001):
        with pytest.raises(corral.InvalidRequest, match="limit"):
            await client.events(limit=limit)


async def test_images(client: corral.AsyncClient) -> None:
    names = [i.name for i in await client.images.list()]
    assert names == ["demo/base", "demo/python"]
    layers = await client.images.layers()
    assert all(isinstance(x, corral.LayerInfo) for x in layers)
    base = await client.images.get("demo/base")
    img = await client.images.compose("task/42", [base, layers[1]], env={"K": "v"}, workdir="/work")
    assert img.layers == [*base.layers, layers[1].digest] and img.workdir == "/work"
    assert (await client.images.get("task/42")).digest == img.digest
    sb = await client.sandboxes.create(image="task/42")
    assert sb.info.image == "task/42"
    await client.images.remove("task/42")
    with pytest.raises(corral.ImageNotFound):
        await client.images.get("task/42")
    with pytest.raises(corral.LayerNotFound):
        await client.images.compose("bad", ["sha256:" + "f" * 64])


async def test_errors_map_to_the_tree(client: corral.AsyncClient) -> None:
    with pytest.raises(corral.SandboxNotFound, match="sb-000000000000"):
        await client.sandboxes.get("sb-000000000000")
    with pytest.raises(corral.ImageNotFound):
        await client.sandboxes.create(image="no/such")
    with pytest.raises(corral.InvalidRequest, match=r"limits\.memory"):
        await client.sandboxes.create(image="demo/python", limits={"memory": "lots"})
    with pytest.raises(corral.InvalidRequest, match=r"limits\.memory"):
        await client.sandboxes.create(image="demo/python", limits={"memory": 1})
    with pytest.raises(corral.InvalidRequest, match="hostname"):
        await client.sandboxes.create(image="demo/python", hostname="-bad")
    sb = await _sandbox(client)
    with pytest.raises(corral.InvalidRequest, match="cwd"):
        await sb.exec(["true"], cwd="relative")
    with pytest.raises(corral.InvalidRequest, match="cmd"):
        await sb.exec([])
    await sb.destroy()
    with pytest.raises(corral.SandboxNotFound):
        await sb.exec(["true"])
    with pytest.raises(corral.SandboxNotFound):
        async with sb.exec_stream(["true"]) as stream:
            async for _ in stream:
                pass
    with pytest.raises(corral.SandboxNotFound):
        await sb.destroy()
    async with sb:
        pass  # destroying an already destroyed sandbox on exit is not an error


async def test_direct_handle_construction_is_refused() -> None:
    node = FakeNode()
    info = await node.sandbox_create(corral.SandboxSpec(image="demo/python"))
    with pytest.raises(TypeError, match="client.sandboxes"):
        corral.Sandbox(node, info)


async def test_client_argument_checks() -> None:
    with pytest.raises(corral.InvalidRequest, match="not understood"):
        corral.AsyncClient("ftp://x")
    with pytest.raises(corral.InvalidRequest):
        corral.AsyncClient("unix:///x.sock", ops=FakeNode())
    with pytest.raises(corral.InvalidRequest, match="token"):
        corral.AsyncClient(token="t")
    c = corral.AsyncClient(ops=FakeNode())
    await c.close()
    with pytest.raises(corral.CorralError, match="closed"):
        await c.node_status()


async def test_unreachable_node_is_a_transport_error(short_dir: Path) -> None:
    target = f"unix://{short_dir}/nobody.sock"
    async with corral.AsyncClient(target) as client:
        with pytest.raises(corral.TransportError, match="nobody.sock"):
            await client.node_status()


async def test_stream_read_back_to_back_over_uds(short_dir: Path) -> None:
    # many requests reuse pooled connections; nothing leaks between them
    async with NodeServer(FakeNode(), uds=short_dir / "api.sock") as srv:
        async with corral.AsyncClient(srv.address) as client:
            sb = await _sandbox(client)
            t0 = time.monotonic()
            for i in range(50):
                assert (await sb.exec(["echo", str(i)])).stdout == f"{i}\n".encode()
            assert time.monotonic() - t0 < 60  # generous: a leaked connection would hang


# ------------------------------------------------------------------ sync client
@pytest.fixture(params=["direct", "uds"])
def sync_client(request: pytest.FixtureRequest, short_dir: Path) -> Iterator[corral.Client]:
    if request.param == "direct":
        with corral.Client(ops=FakeNode()) as c:
            yield c
        return
    # the server runs on its own loop in a thread, so the blocking client cannot deadlock it
    portal = _Portal()
    srv = NodeServer(FakeNode(), uds=short_dir / "api.sock")
    portal.call(srv.start())
    try:
        with corral.Client(srv.address) as c:
            yield c
    finally:
        portal.call(srv.stop())
        portal.stop()


def test_sync_client(sync_client: corral.Client) -> None:
    c = sync_client
    image = c.images.get("demo/python")
    assert isinstance(image, corral.ImageInfo)
    sb = c.sandboxes.create(image=image, limits=corral.Limits(memory="512MiB"), labels={"j": "1"})
    assert sb.id.startswith("sb-") and sb.info.spec.limits.memory == 512 << 20
    assert sb.exec(["echo", "hi"]).stdout == b"hi\n"
    with sb.shell() as sh:
        sh.run("cd /work && export X=1")
        assert sh.run("pwd; echo $X").stdout == b"/work\n1\n"
    sb.files.write("/work/a.py", b"...")
    assert sb.files.read("/work/a.py") == b"..."
    with sb.exec_stream("echo a; echo b >&2") as stream:
        assert [(ch.stream, ch.data) for ch in stream] == [("stdout", b"a\n"), ("stderr", b"b\n")]
    assert stream.result.exit_code == 0
    p = sb.spawn("sleep 0.05; echo ok")
    assert p.wait(timeout=5).ok and p.output()[0] == b"ok\n"
    assert [x.id for x in sb.processes()] == [p.id]
    assert [s.id for s in c.sandboxes.list(labels={"j": "1"})] == [sb.id]
    assert c.node_status().sandboxes == 1
    with pytest.raises(corral.SandboxNotFound):
        c.sandboxes.get("sb-000000000000")
    with sb:
        pass
    assert sb.refresh().state == "destroyed"
    with pytest.raises(corral.SandboxNotFound):
        sb.exec(["true"])
    assert [e.kind for e in c.events()] == ["created", "destroyed"]


def test_sync_client_close_is_idempotent() -> None:
    c = corral.Client(ops=FakeNode())
    c.close()
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.node_status()


async def test_embedded_node_opens_lazily_and_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    import corral.node

    opened: list[object] = []

    class Embedded(FakeNode):
        closed = False

        async def close(self) -> None:
            self.closed = True

    async def fake_open(config: object = None) -> FakeNode:
        opened.append(config)
        return node

    node = Embedded()
    monkeypatch.setattr(corral.node.Node, "open", staticmethod(fake_open))
    client = corral.AsyncClient()
    assert opened == []  # nothing happens before first use
    sb = await client.sandboxes.create(image="demo/python")
    await client.sandboxes.get(sb.id)
    assert opened == [None]  # opened once, with the default config
    await client.close()
    assert node.closed


async def test_injected_ops_are_closed_only_when_owned() -> None:
    class Counting(FakeNode):
        closes = 0

        async def close(self) -> None:
            self.closes += 1

    node = Counting()
    async with corral.AsyncClient(ops=node):
        pass
    assert node.closes == 0
    async with corral.AsyncClient(ops=node, own_ops=True):
        pass
    assert node.closes == 1


@pytest.mark.parametrize("via", ["direct", "uds"])  # a pty is a websocket: no ASGI transport
async def test_sandbox_pty(via: str, short_dir: Path) -> None:
    node = FakeNode()
    async with contextlib.AsyncExitStack() as stack:
        if via == "direct":
            client = await stack.enter_async_context(corral.AsyncClient(ops=node))
        else:
            srv = await stack.enter_async_context(NodeServer(node, uds=short_dir / "api.sock"))
            client = await stack.enter_async_context(corral.AsyncClient(srv.address))
        sb = await _sandbox(client, env={"WHO": "sdk"})
        async with await sb.pty(rows=30, cols=100, env={"X": "1"}) as t:
            assert t.cmd == ["/bin/sh"] and t.pid > 0 and t.result is None
            await t.write(b"stty size\recho $WHO $X\rexit 3\r")
            out = b"".join([d async for d in t])
        assert b"30 100" in out and b"sdk 1" in out
        assert t.result is not None and (t.result.reason, t.result.exit_code) == ("exited", 3)
        with pytest.raises(corral.InvalidRequest, match="rows"):
            await sb.pty(rows=0)


async def test_capacity_and_node_labels_in_status() -> None:
    node = FakeNode(node_id="n1", max_sandboxes=2, labels={"pool": "onprem"})
    async with corral.AsyncClient(ops=node) as client:
        sb = await _sandbox(client)
        with pytest.raises(corral.CapacityError, match="full"):
            await sb.fork(2)  # all or nothing: no child is left
        assert len(await client.sandboxes.list()) == 1
        await _sandbox(client)
        with pytest.raises(corral.CapacityError, match="n1 is full"):
            await _sandbox(client)
        st = await client.node_status()
        assert (st.max_sandboxes, st.sandboxes, st.labels) == (2, 2, {"pool": "onprem"})
    with pytest.raises(ValueError, match="node id"):
        FakeNode(node_id="Not-An-Id")


async def test_set_ttl_and_ttl_action(client: corral.AsyncClient) -> None:
    sb = await client.sandboxes.create("demo/python", ttl=60, ttl_action="pause")
    assert sb.info.spec.ttl_action == "pause"
    before = sb.info.expires_at
    info = await sb.set_ttl(3600)
    assert before is not None and info.expires_at is not None and info.expires_at > before
    assert (await sb.set_ttl(None)).expires_at is None
    await sb.destroy()
