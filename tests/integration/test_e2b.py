"""The real ``e2b`` SDK (2.63.0), unmodified, against a real node over HTTP.

The SDK finds the node through E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY, as a user's
harness would. AsyncSandbox is used because the server runs on the test's event loop.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.api.server import NodeServer
from corral.host import leaks
from corral.node import Node
from tests.conftest import TAG
from tests.integration.conftest import open_node

e2b = pytest.importorskip("e2b", reason="needs the e2b extra: pip install 'corral[e2b]'")
from e2b import (  # noqa: E402
    AsyncSandbox,
    CommandExitException,
)
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    NotFoundException,
    SandboxException,
    SandboxNotFoundException,
    TimeoutException,
)

STATE = Path(f"/var/lib/corral-test{TAG}-e2b")
RUN = Path(f"/run/corral-test{TAG}-e2b")
SUBTREE = f"corral-test{TAG}-e2b"
TOKEN = "e2b-test-token"


@pytest.fixture(scope="module")
async def served(images_ready: None) -> AsyncIterator[tuple[Node, str]]:
    async with open_node(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, gc=True) as node:
        async with NodeServer(node, host="127.0.0.1", port=0, token=TOKEN) as srv:
            yield node, srv.address
    found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    assert leaks.total(found) == 0, found


@pytest.fixture
def e2b_env(served: tuple[Node, str], monkeypatch: pytest.MonkeyPatch) -> Node:
    node, address = served
    monkeypatch.setenv("E2B_API_URL", address)
    monkeypatch.setenv("E2B_SANDBOX_URL", address)
    monkeypatch.setenv("E2B_API_KEY", TOKEN)
    monkeypatch.setenv("E2B_DOMAIN", "e2b.local")  # get_host(port): {port}-{id}.e2b.local
    return node


@pytest.fixture
async def sbx(e2b_env: Node) -> AsyncIterator[AsyncSandbox]:
    sb = await AsyncSandbox.create("test/debian", timeout=120)
    try:
        yield sb
    finally:
        await sb.kill()


async def test_create_run_and_kill(e2b_env: Node) -> None:
    sb = await AsyncSandbox.create("test/debian", metadata={"job": "smoke"})
    try:
        info = await sb.get_info()
        assert info.sandbox_id == sb.sandbox_id
        assert info.metadata == {"job": "smoke"}
        assert info.state.value == "running"
        assert await sb.is_running()
        r = await sb.commands.run("echo hi; echo err >&2; id -un; pwd")
        assert r.exit_code == 0
        assert r.stdout == "hi\nuser\n/home/user\n"
        assert r.stderr == "err\n"
    finally:
        assert await sb.kill()
    assert (await e2b_env.sandbox_list(labels={"e2b": "test/debian"})) == []


async def test_foreground_exit_code_env_and_cwd(sbx: AsyncSandbox) -> None:
    r = await sbx.commands.run("echo $FOO; pwd", envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == "bar\n/tmp\n"
    with pytest.raises(CommandExitException) as ei:
        await sbx.commands.run("echo out; exit 3")
    assert ei.value.exit_code == 3
    assert ei.value.stdout == "out\n"
    r = await sbx.commands.run("id -u", user="root")
    assert r.stdout == "0\n"


async def test_streaming_callbacks_and_background(sbx: AsyncSandbox) -> None:
    seen: list[str] = []
    r = await sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n" == r.stdout
    # a background process: listed while it runs, killed by pid, ends exactly once
    h = await sbx.commands.run("sleep 600", background=True)
    pids = [p.pid for p in await sbx.commands.list()]
    assert h.pid in pids
    assert await sbx.commands.kill(h.pid)
    with pytest.raises(CommandExitException):
        await h.wait()
    assert h.pid not in [p.pid for p in await sbx.commands.list()]
    assert not await sbx.commands.kill(h.pid)


async def test_stdin_and_a_second_client(sbx: AsyncSandbox) -> None:
    h = await sbx.commands.run(
        "read a; echo got:$a; read b; echo got:$b", background=True, stdin=True
    )
    # a second client attaches to the running process and sees what follows
    other: list[str] = []
    h2 = await sbx.commands.connect(h.pid, on_stdout=other.append)
    await sbx.commands.send_stdin(h.pid, "one\n")
    await sbx.commands.send_stdin(h.pid, "two\n")
    r = await h.wait()
    assert r.exit_code == 0
    assert r.stdout == "got:one\ngot:two\n"
    r2 = await h2.wait()
    assert r2.exit_code == 0
    assert "got:two" in "".join(other)


async def test_disconnect_does_not_kill(sbx: AsyncSandbox) -> None:
    h = await sbx.commands.run("sleep 1; echo done > /tmp/flag", background=True)
    await h.disconnect()
    again = await sbx.commands.connect(h.pid)
    r = await again.wait()
    assert r.exit_code == 0
    assert await sbx.files.read("/tmp/flag") == "done\n"


async def test_files_round_trip(sbx: AsyncSandbox) -> None:
    blob = bytes(range(256)) * 4096 + b"\x00\xff"  # 1 MiB + 2, every byte value
    await sbx.files.write("data/blob.bin", blob)
    assert await sbx.files.read("data/blob.bin", format="bytes") == blob
    assert await sbx.files.read("/home/user/data/blob.bin", format="bytes") == blob
    r = await sbx.commands.run("stat -c '%U %s' data/blob.bin")
    assert r.stdout == f"user {len(blob)}\n"
    await sbx.files.write_files(
        [{"path": "/tmp/a.txt", "data": "A"}, {"path": "/tmp/b.txt", "data": b"B"}]
    )
    names = {e.name for e in await sbx.files.list("/tmp")}
    assert {"a.txt", "b.txt"} <= names
    assert await sbx.files.exists("/tmp/a.txt")
    assert not await sbx.files.exists("/tmp/nope")
    assert await sbx.files.make_dir("newdir")
    assert not await sbx.files.make_dir("newdir")
    info = await sbx.files.rename("/tmp/a.txt", "newdir/a.txt")
    assert info.path == "/home/user/newdir/a.txt"
    assert (await sbx.files.get_info("newdir/a.txt")).size == 1
    await sbx.files.remove("newdir")
    assert not await sbx.files.exists("newdir")
    with pytest.raises(NotFoundException):
        await sbx.files.read("/nope/at/all")


async def test_watch_dir(sbx: AsyncSandbox) -> None:
    await sbx.files.make_dir("/tmp/w")
    events: list[object] = []
    got = asyncio.Event()

    def on_event(ev: object) -> None:
        events.append(ev)
        got.set()

    handle = await sbx.files.watch_dir("/tmp/w", on_event=on_event)
    try:
        await sbx.files.write("/tmp/w/new.txt", "x")
        await asyncio.wait_for(got.wait(), 30)
    finally:
        await handle.stop()
    assert any(getattr(e, "name", "") == "new.txt" for e in events)


async def _events_until(
    sbx: AsyncSandbox, path: str, script: str, last: tuple[str, str], recursive: bool = False
) -> list[tuple[str, str]]:
    """(type, name) of the events a watch on ``path`` sees while ``script`` runs in the
    guest, up to and including ``last`` (the readiness signal: no sleeps)."""
    events: list[tuple[str, str]] = []
    done = asyncio.Event()

    def on_event(ev: object) -> None:
        item = (ev.type.value, ev.name)  # type: ignore[attr-defined]
        events.append(item)
        if item == last:
            done.set()

    handle = await sbx.files.watch_dir(path, on_event=on_event, recursive=recursive)
    try:
        await sbx.commands.run(script)
        await asyncio.wait_for(done.wait(), 30)
    finally:
        await handle.stop()
    return events


async def test_watch_events_from_the_kernel(sbx: AsyncSandbox) -> None:
    """create, write, rename, remove and chmod, made by the guest itself, in order, each
    once (inotify: no change is missed, however quick)."""
    await sbx.files.make_dir("/tmp/wk")
    script = "cd /tmp/wk && echo a > f1 && chmod 600 f1 && mv f1 f2 && rm f2 && touch last"
    events = await _events_until(sbx, "/tmp/wk", script, ("create", "last"))
    assert events[0] == ("create", "f1")
    assert ("write", "f1") in events
    assert ("chmod", "f1") in events
    i = events.index(("rename", "f1"))
    assert events[i + 1] == ("create", "f2")
    assert events.index(("remove", "f2")) > i
    # a write through the files API reads as one create of the target (no temp names)
    seen: list[tuple[str, str]] = []
    ready = asyncio.Event()

    def on_event(ev: object) -> None:
        seen.append((ev.type.value, ev.name))  # type: ignore[attr-defined]
        ready.set()

    handle = await sbx.files.watch_dir("/tmp/wk", on_event=on_event)
    try:
        await sbx.files.write("/tmp/wk/api.txt", "x")
        await asyncio.wait_for(ready.wait(), 30)
    finally:
        await handle.stop()
    assert seen and all(".corral-tmp-" not in name for _, name in seen)
    assert ("create", "api.txt") in seen


async def test_watch_recursive(sbx: AsyncSandbox) -> None:
    """A recursive watch follows directories made after it started."""
    await sbx.files.make_dir("/tmp/wr/old")
    script = "echo x > /tmp/wr/new/inner && echo y > /tmp/wr/old/o"
    events: list[tuple[str, str]] = []
    done, made = asyncio.Event(), asyncio.Event()

    def on_event(ev: object) -> None:
        events.append((ev.type.value, ev.name))  # type: ignore[attr-defined]
        if ("create", "new") in events:
            made.set()
        if {("create", "new/inner"), ("create", "old/o")} <= set(events):
            done.set()

    handle = await sbx.files.watch_dir("/tmp/wr", on_event=on_event, recursive=True)
    try:
        # the new directory's watch is added as its create event arrives: wait for it
        # before writing inside it (a file made in between is not reported)
        await sbx.commands.run("mkdir /tmp/wr/new")
        await asyncio.wait_for(made.wait(), 30)
        await sbx.commands.run(script)
        await asyncio.wait_for(done.wait(), 30)
    finally:
        await handle.stop()
    assert ("create", "new") in events


async def test_watch_sees_only_its_own_sandbox(sbx: AsyncSandbox) -> None:
    """The same path changed in another sandbox, and a symlink out of the root, give no
    events: the watch is on this sandbox's inode."""
    other = await AsyncSandbox.create("test/debian")
    try:
        await other.commands.run("mkdir -p /tmp/ws")
        await sbx.files.make_dir("/tmp/ws")
        await sbx.commands.run("ln -s / /tmp/ws/up")
        events: list[tuple[str, str]] = []
        done = asyncio.Event()

        def on_event(ev: object) -> None:
            events.append((ev.type.value, ev.name))  # type: ignore[attr-defined]
            if ev.name == "mine":  # type: ignore[attr-defined]
                done.set()

        # /tmp/ws/up/tmp/ws resolves inside this sandbox to /tmp/ws itself
        handle = await sbx.files.watch_dir("/tmp/ws/up/tmp/ws", on_event=on_event)
        try:
            await other.commands.run("echo x > /tmp/ws/theirs")
            await sbx.commands.run("echo y > /tmp/ws/mine")
            await asyncio.wait_for(done.wait(), 30)
        finally:
            await handle.stop()
        assert all(name != "theirs" for _, name in events)
        assert ("create", "mine") in events
    finally:
        await other.kill()


async def test_watch_polled_by_the_blocking_sdk(e2b_env: Node) -> None:
    """The blocking SDK's watcher (CreateWatcher / GetWatcherEvents): events are kept on
    the node between two polls."""
    from e2b import Sandbox

    def harness() -> list[tuple[str, str]]:
        sb = Sandbox.create("test/debian")
        try:
            sb.files.make_dir("/tmp/wp")
            h = sb.files.watch_dir("/tmp/wp")
            sb.commands.run("echo 1 > /tmp/wp/a && rm /tmp/wp/a")
            got = [(e.type.value, e.name) for e in h.get_new_events()]
            h.stop()
            return got
        finally:
            sb.kill()

    got = await asyncio.to_thread(harness)
    assert ("create", "a") in got and ("remove", "a") in got


async def test_list_paging_with_metadata(e2b_env: Node) -> None:
    made = [
        await AsyncSandbox.create("test/debian", metadata={"suite": "paging", "i": str(i)})
        for i in range(3)
    ]
    try:
        from e2b import SandboxQuery

        pager = AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "paging"}), limit=2)
        first = await pager.next_items()
        assert len(first) == 2 and pager.has_next
        second = await pager.next_items()
        assert len(second) == 1 and not pager.has_next
        ids = {s.sandbox_id for s in first + second}
        assert ids == {s.sandbox_id for s in made}
        one = await AsyncSandbox.list(query=SandboxQuery(metadata={"i": "1"})).next_items()
        assert [s.sandbox_id for s in one] == [made[1].sandbox_id]
    finally:
        for s in made:
            await s.kill()


async def test_pause_then_connect_resumes(sbx: AsyncSandbox) -> None:
    await sbx.commands.run("echo kept > /tmp/state")
    assert await sbx.pause()
    assert not await sbx.pause()  # already paused: 409, which the SDK reports as False
    info = await AsyncSandbox.get_info(sbx.sandbox_id)
    assert info.state.value == "paused"
    # paused, it does not time out (kept for the gateway's max_timeout, 24 h)
    assert (info.end_at - info.started_at).total_seconds() > 23 * 3600
    again = await AsyncSandbox.connect(sbx.sandbox_id)
    resumed = await again.get_info()
    assert resumed.state.value == "running"
    assert (resumed.end_at - resumed.started_at).total_seconds() < 23 * 3600
    assert (await again.commands.run("cat /tmp/state")).stdout == "kept\n"


async def test_timeout_and_metrics(sbx: AsyncSandbox) -> None:
    await sbx.set_timeout(600)
    info = await sbx.get_info()
    assert (info.end_at - info.started_at).total_seconds() > 500
    metrics = await sbx.get_metrics()
    assert metrics and metrics[0].mem_total > 0
    # a second of busy CPU and 8 MiB on its disk show in the next sample
    burn = "end=$((SECONDS+2)); while [ $SECONDS -lt $end ]; do :; done"
    await sbx.commands.run(f"head -c 8388608 /dev/urandom > ~/big && sync && {burn}")
    m = (await sbx.get_metrics())[0]
    assert m.cpu_used_pct > 0 and m.mem_used > 0, m
    assert m.disk_used >= 8 << 20, m


async def test_timeout_destroys(e2b_env: Node) -> None:
    sb = await AsyncSandbox.create("test/debian", timeout=1)
    while await sb.is_running():
        await asyncio.sleep(0.2)
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info(sb.sandbox_id)


async def test_errors(e2b_env: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = "sb-000000000000-" + "0" * 12
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info(missing)
    assert not await AsyncSandbox.kill(missing)
    with pytest.raises(SandboxException, match="template 'no/such' not found"):
        await AsyncSandbox.create("no/such")
    monkeypatch.setenv("E2B_API_KEY", "wrong")
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create("test/debian")


async def test_envd_token_is_per_sandbox(e2b_env: Node) -> None:
    a = await AsyncSandbox.create("test/debian")
    b = await AsyncSandbox.create("test/debian")
    try:
        import httpx

        address = await _address()
        tok_a = a._envd_access_token  # type: ignore[attr-defined]
        async with httpx.AsyncClient(base_url=address) as c:
            ok = await c.get(
                "/health", headers={"E2b-Sandbox-Id": a.sandbox_id, "X-Access-Token": tok_a}
            )
            assert ok.status_code == 204
            bad = await c.get(
                "/files",
                params={"path": "/etc/hostname"},
                headers={"E2b-Sandbox-Id": b.sandbox_id, "X-Access-Token": tok_a},
            )
            assert bad.status_code == 401
            assert set(bad.json()) == {"code", "message"}
    finally:
        await a.kill()
        await b.kill()


async def _address() -> str:
    import os

    return os.environ["E2B_SANDBOX_URL"]


def test_bench_e2b_json_shape(images_ready: None) -> None:
    """``corral bench e2b`` at a tiny count: the JSON line the issue names."""
    import shutil

    from tests.conftest import TEST_STORE
    from tests.integration.conftest import run_bench

    state = Path(f"/var/lib/corral-test{TAG}-e2bbench")
    run = Path(f"/run/corral-test{TAG}-e2bbench")
    try:
        out = run_bench(
            "e2b",
            "--count",
            "3",
            state=state,
            run=run,
            subtree=f"corral-test{TAG}-e2bbench",
            store=TEST_STORE,
            image="test/debian",
            timeout=180,
        )
    finally:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    assert out["scenario"] == "e2b" and out["count"] == 3
    assert out["errors"] == 0 and out["native"]["errors"] == 0
    for d, keys in (
        (out, ("create_p50_ms", "run_p50_ms")),
        (out["native"], ("create_p50_ms", "exec_p50_ms")),
    ):
        for k in keys:
            assert isinstance(d[k], int | float) and d[k] > 0, (k, d)


async def test_blocking_sdk(e2b_env: Node) -> None:
    """The blocking ``Sandbox`` (what most harnesses use), in a thread: the node's server
    runs on this test's event loop."""
    from e2b import Sandbox

    def harness() -> tuple[str, bytes, list[str]]:
        sb = Sandbox.create("test/debian")
        try:
            out = sb.commands.run("echo sync").stdout
            sb.files.write("/tmp/b.bin", b"\x00\x01\xfe")
            data = sb.files.read("/tmp/b.bin", format="bytes")
            seen = [s.sandbox_id for s in Sandbox.list().next_items()]
            return out, bytes(data), seen if sb.sandbox_id in seen else []
        finally:
            sb.kill()

    out, data, seen = await asyncio.to_thread(harness)
    assert out == "sync\n" and data == b"\x00\x01\xfe" and seen


async def test_pty(sbx: AsyncSandbox) -> None:
    from e2b import PtySize

    got = bytearray()
    done = asyncio.Event()

    def on_data(b: bytes) -> None:
        got.extend(b)
        if b"pty-ok" in got:
            done.set()

    h = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=on_data)
    await sbx.pty.resize(h.pid, PtySize(rows=33, cols=77))
    await sbx.pty.send_stdin(h.pid, b"echo pty-$((1+0))ok | tr -d 1; stty size\n")
    await asyncio.wait_for(done.wait(), 30)
    await sbx.pty.send_stdin(h.pid, b"exit 0\n")
    r = await h.wait()
    assert r.exit_code == 0
    assert b"33 77" in got


async def test_port_proxy(sbx: AsyncSandbox, e2b_env: Node) -> None:
    """An HTTP server in the sandbox, on its loopback only, reached through the node by
    path and by E2B's host form; refused without a token or with another sandbox's."""
    import httpx

    await sbx.files.write("/tmp/www/hello.txt", b"hello \x00 port")
    await sbx.commands.run(
        "cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1", background=True
    )
    address = await _address()
    own = {"X-Access-Token": sbx._envd_access_token}  # type: ignore[attr-defined]
    path = f"/sandboxes/{sbx.sandbox_id}/ports/8000/hello.txt"
    async with httpx.AsyncClient(base_url=address, timeout=60) as c:
        # readiness: the server answers once it listens (502 until then)
        for _ in range(300):
            r = await c.get(path, headers=own)
            if r.status_code != 502:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 200 and r.content == b"hello \x00 port"
        assert sbx.get_host(8000) == f"8000-{sbx.sandbox_id}.e2b.local"
        host = {"Host": sbx.get_host(8000), **own}
        r = await c.get("/hello.txt", headers=host)
        assert r.status_code == 200 and r.content == b"hello \x00 port"
        r = await c.get("/nope", headers=host)
        assert r.status_code == 404
        assert (await c.get(path)).status_code == 401
        other = await AsyncSandbox.create("test/debian")
        try:
            theirs = {"X-Access-Token": other._envd_access_token}  # type: ignore[attr-defined]
            assert (await c.get(path, headers=theirs)).status_code == 401
        finally:
            await other.kill()
        assert (await c.get(path, headers={"X-API-KEY": TOKEN})).status_code == 200


async def test_snapshot_and_fork(sbx: AsyncSandbox) -> None:
    await sbx.files.write("/tmp/kept.txt", "from the parent")
    snap = await sbx.create_snapshot()
    child = await AsyncSandbox.create(snap.snapshot_id)
    try:
        assert await child.files.read("/tmp/kept.txt") == "from the parent"
    finally:
        await child.kill()
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id)
        _drop_snapshot_layers(sbx.sandbox_id)
    assert not await AsyncSandbox.delete_snapshot(snap.snapshot_id)
    forks = await sbx.fork(count=2)
    try:
        for f in forks:
            assert await f.files.read("/tmp/kept.txt") == "from the parent"
            assert (await f.commands.run("id -un")).stdout == "user\n"
    finally:
        for f in forks:
            await f.kill()


def _drop_snapshot_layers(sandbox_id: str) -> None:
    """The shared test store keeps no layer of this test's snapshot (removing the image
    leaves its layer for a node's gc)."""
    from corral.images.store import LayerStore
    from tests.conftest import TEST_STORE

    store = LayerStore(TEST_STORE)
    used = {d for i in store.images() for d in i.layers}
    for layer in store.layers():
        if layer.source == sandbox_id and layer.digest not in used:
            store.remove_layer(layer.digest)


async def test_command_in_a_killed_sandbox(e2b_env: Node) -> None:
    from e2b.exceptions import SandboxNotRunningException

    sb = await AsyncSandbox.create("test/debian")
    await sb.kill()
    with pytest.raises(SandboxNotRunningException):
        await sb.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        await sb.files.read("/etc/hostname")


async def test_written_files_belong_to_the_user(sbx: AsyncSandbox) -> None:
    await sbx.files.write("/tmp/new/deeper/f.txt", "x")
    await sbx.files.write("/etc/hostname", "still-roots\n")
    r = await sbx.commands.run(
        "stat -c '%U %n' /tmp /tmp/new /tmp/new/deeper /tmp/new/deeper/f.txt /etc/hostname"
    )
    assert r.stdout.splitlines() == [
        "root /tmp",
        "user /tmp/new",
        "user /tmp/new/deeper",
        "user /tmp/new/deeper/f.txt",
        "root /etc/hostname",
    ]


async def test_large_streamed_output(sbx: AsyncSandbox) -> None:
    """More than the sandbox's buffered-exec output limit (1 MiB): streamed, not cut."""
    r = await sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' x; echo")
    assert len(r.stdout) == 3000001 and r.exit_code == 0


async def test_command_timeout_then_the_sandbox_goes_on(sbx: AsyncSandbox) -> None:
    """``commands.run(timeout=)`` bounds the command's stream: the SDK raises its
    TimeoutException, the process runs on (as under envd) until killed, and the sandbox
    answers the next command."""
    with pytest.raises(TimeoutException):
        await sbx.commands.run("sleep 600", timeout=1)
    running = [p for p in await sbx.commands.list() if "sleep 600" in " ".join(p.args)]
    assert len(running) == 1
    assert await sbx.commands.kill(running[0].pid)
    assert (await sbx.commands.run("echo next")).stdout == "next\n"


async def test_paths_stay_in_the_sandbox(sbx: AsyncSandbox) -> None:
    """``..`` and a guest symlink to ``/`` resolve inside the sandbox's root: the files
    read are the guest's, never the host's."""
    await sbx.commands.run("echo guest-only > /tmp/mark && ln -s / /tmp/up")
    for path in ("../../../../../tmp/mark", "/tmp/up/tmp/mark", "/tmp/up/../../tmp/mark"):
        assert await sbx.files.read(path) == "guest-only\n", path
    assert not Path("/tmp/mark").exists() or Path("/tmp/mark").read_text() != "guest-only\n"
    await sbx.files.write("/tmp/up/tmp/written", "in")
    assert (await sbx.commands.run("cat /tmp/written")).stdout == "in"


async def test_create_with_network_options(e2b_env: Node) -> None:
    """``allow_internet_access=False`` is corral's empty egress list (the sandbox runs);
    ``True`` cannot be expressed: a clear error, and no sandbox is left."""
    sb = await AsyncSandbox.create("test/debian", allow_internet_access=False)
    try:
        info = await e2b_env.sandbox_get(sb.sandbox_id)
        assert info.spec.network.allow == []
        assert (await sb.commands.run("echo up")).stdout == "up\n"
    finally:
        await sb.kill()
    before = {i.id for i in await e2b_env.sandbox_list()}
    with pytest.raises(SandboxException, match="allow_internet_access"):
        await AsyncSandbox.create("test/debian", allow_internet_access=True)
    assert {i.id for i in await e2b_env.sandbox_list()} <= before


async def test_auto_pause_at_the_deadline(e2b_env: Node) -> None:
    """``lifecycle={"on_timeout": "pause"}``: the deadline pauses the sandbox (state
    kept), ``connect`` resumes it."""
    sb = await AsyncSandbox.create("test/debian", timeout=120, lifecycle={"on_timeout": "pause"})
    try:
        await sb.commands.run("echo kept > /tmp/state")
        await sb.set_timeout(1)
        for _ in range(600):  # the gateway's deadline task; readiness by state, bounded
            if (await AsyncSandbox.get_info(sb.sandbox_id)).state.value == "paused":
                break
            await asyncio.sleep(0.1)
        assert (await AsyncSandbox.get_info(sb.sandbox_id)).state.value == "paused"
        again = await AsyncSandbox.connect(sb.sandbox_id, timeout=60)
        assert (await again.commands.run("cat /tmp/state")).stdout == "kept\n"
    finally:
        await sb.kill()


async def test_timeout_survives_a_node_restart(
    images_ready: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The E2B timeout is the corral TTL the node records: ``set_timeout`` (longer or
    shorter than the create's) holds after the node agent restarts, and the restarted
    node's reaper destroys the sandbox at it, or pauses an ``autoPause`` one."""
    from tests.integration.conftest import node_config

    state, run, subtree = Path(f"{STATE}-rs"), Path(f"{RUN}-rs"), f"{SUBTREE}-rs"
    cfg = node_config(state_dir=state, run_dir=run, cgroup_subtree=subtree)
    monkeypatch.setenv("E2B_API_KEY", TOKEN)
    first = await Node.open(cfg)
    try:
        await first.gc(everything=True)
        async with NodeServer(first, host="127.0.0.1", port=0, token=TOKEN) as srv:
            monkeypatch.setenv("E2B_API_URL", srv.address)
            monkeypatch.setenv("E2B_SANDBOX_URL", srv.address)
            longer = await AsyncSandbox.create("test/debian", timeout=60)
            await longer.set_timeout(900)
            shorter = await AsyncSandbox.create("test/debian", timeout=600)
            await shorter.set_timeout(2)
            auto = await AsyncSandbox.create(
                "test/debian", timeout=600, lifecycle={"on_timeout": "pause"}
            )
            await auto.commands.run("echo kept > /tmp/state")
            await auto.set_timeout(2)
        kept = (await first.sandbox_get(longer.sandbox_id)).expires_at
        assert kept is not None
    finally:
        await first.close()  # the agent goes; its sandboxes stay
    second = await Node.open(cfg)
    try:
        info = await second.sandbox_get(longer.sandbox_id)
        assert info.state == "running" and info.expires_at == kept
        assert kept > info.created_at + 800  # the new deadline, not the create's 60 s
        for _ in range(1200):  # the restarted node's reaper; readiness by state, bounded
            if (await second.sandbox_get(shorter.sandbox_id)).state == "destroyed":
                break
            await asyncio.sleep(0.1)
        assert (await second.sandbox_get(shorter.sandbox_id)).state == "destroyed"
        kinds = [e.kind for e in await second.events(sandbox_id=shorter.sandbox_id)]
        assert "ttl_expired" in kinds, kinds
        for _ in range(1200):  # paused by the reaper, then its TTL cleared: kept
            got = await second.sandbox_get(auto.sandbox_id)
            if got.state == "paused" and got.expires_at is None:
                break
            await asyncio.sleep(0.1)
        assert (got.state, got.expires_at) == ("paused", None)
        async with NodeServer(second, host="127.0.0.1", port=0, token=TOKEN) as srv:
            monkeypatch.setenv("E2B_API_URL", srv.address)
            monkeypatch.setenv("E2B_SANDBOX_URL", srv.address)
            again = await AsyncSandbox.connect(auto.sandbox_id, timeout=60)
            assert (await again.commands.run("cat /tmp/state")).stdout == "kept\n"
            info = await second.sandbox_get(auto.sandbox_id)
            assert info.state == "running" and info.expires_at is not None
    finally:
        for i in await second.sandbox_list():
            await second.sandbox_destroy(i.id)
        await second.close()
        shutil.rmtree(run, ignore_errors=True)
    found = leaks.scan(state, run, subtree, netns_prefix=subtree)
    assert leaks.total(found) == 0, found
