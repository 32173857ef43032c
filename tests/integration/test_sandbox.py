"""Container sandboxes end to end through the SDK on a real node."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import corral
from corral.spec import SandboxSpec

SMALL = corral.Limits(cpus=1, memory="256MiB", pids=128, disk="256MiB")


async def test_lifecycle(client, node):
    sb = await client.sandboxes.create(image="test/debian", limits=SMALL, labels={"job": "t1"})
    try:
        r = await sb.exec(["echo", "hello"])
        assert r.reason == "exited" and r.exit_code == 0 and r.stdout == b"hello\n"
        r = await sb.exec(["sh", "-c", "echo err >&2; exit 3"])
        assert (r.exit_code, r.stderr) == (3, b"err\n")
        ids = [s.id for s in await client.sandboxes.list(labels={"job": "t1"})]
        assert sb.id in ids
        assert sb.id not in [s.id for s in await client.sandboxes.list(labels={"job": "other"})]
        info = await sb.refresh()
        assert info.state == "running" and info.pid
        r = await sb.exec(["python3", "-c", "print(1+1)"], timeout=30)
        assert r.stdout == b"2\n"
    finally:
        await sb.destroy()
    with pytest.raises(corral.SandboxNotFound):
        await sb.exec(["true"])
    assert sb.id not in [s.id for s in await client.sandboxes.list()]


async def test_root_inside_is_unprivileged_outside(client):
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        r = await sb.exec(["sh", "-c", "id -u; cat /proc/self/uid_map; touch /etc/x && echo ok"])
        lines = r.stdout.decode().split()
        assert lines[0] == "0"
        assert lines[1:4] == ["0", "100000", "65536"]
        assert lines[-1] == "ok", r.stderr
        st = await sb.files.stat("/etc/x")
        assert st.uid == 0
        r = await sb.exec(["sh", "-c", "cat /proc/kpagecgroup | head -c 10 | wc -c"])
        assert r.stdout.strip() in (b"0", b"")
        r = await sb.exec(["cat", "/proc/self/status"])
        status = dict(ln.split(":\t", 1) for ln in r.stdout.decode().splitlines() if ":\t" in ln)
        assert status["NoNewPrivs"].strip() == "1"
        assert status["Seccomp"].strip() == "2"


async def test_exec_options(client):
    async with await client.sandboxes.create(
        image="test/debian", limits=SMALL, env={"FROM_SPEC": "1"}
    ) as sb:
        r = await sb.exec(
            ["sh", "-c", "cat; echo $FOO $FROM_SPEC; pwd"],
            stdin=b"in\n",
            env={"FOO": "bar"},
            cwd="/tmp",
        )
        assert r.stdout == b"in\nbar 1\n/tmp\n"
        r = await sb.exec(["id", "-u"], user="65534")
        assert r.stdout == b"65534\n"
        r = await sb.exec(["id", "-un"], user="nobody")
        assert r.stdout == b"nobody\n"
        r = await sb.exec(["/no/such/binary"])
        assert r.reason == "exited" and r.exit_code == 127
        with pytest.raises(corral.InvalidRequest):
            await sb.exec(["true"], user="no-such-user")


async def test_limits_reported(client, node):
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        r = await sb.exec(["sleep", "10"], timeout=0.5)
        assert r.reason == "timeout" and r.duration < 5
        r = await sb.exec(["yes"], output_limit=4096)
        assert r.reason == "output_limit" and r.stdout_truncated and len(r.stdout) == 4096
        r = await sb.exec(
            ["python3", "-c", "b = bytearray(1 << 30); print('survived')"], timeout=60
        )
        assert r.reason == "oom", r
        r = await sb.exec(
            ["sh", "-c", "dd if=/dev/zero of=/big bs=1M count=400 2>&1; sync"], timeout=60
        )
        assert b"No space left" in r.stdout or b"quota" in r.stdout.lower(), r.stdout
        r = await sb.exec(["sh", "-c", "rm -f /big; echo fine"])
        assert r.stdout == b"fine\n"
        kinds = {e.kind for e in await sb.events()}
        assert {"timeout", "output_limit", "oom"} <= kinds


async def test_output_rate_slows_a_flood_and_loses_nothing(client):
    """``limits.output_rate``: a sandbox printing faster than its rate is slowed (its
    processes wait in ``write``), every byte arrives, and its execs share one rate."""
    lim = corral.Limits(
        cpus=1, memory="256MiB", pids=128, disk="256MiB", output="4MiB", output_rate="2MiB"
    )
    async with await client.sandboxes.create(image="test/debian", limits=lim) as sb:
        assert (await sb.refresh()).spec.limits.output_rate == 2 << 20
        t0 = time.monotonic()
        a, b = await asyncio.gather(
            *(sb.exec(["head", "-c", "3M", "/dev/zero"], output_limit="4MiB") for _ in range(2))
        )
        took = time.monotonic() - t0
        assert a.stdout == b.stdout == bytes(3 << 20)
        assert (a.reason, b.reason) == ("exited", "exited")
        # 6 MiB at 2 MiB/s, less the burst (a quarter of a second's worth): the least it
        # can take
        assert took >= (6 - 0.5) / 2 - 0.01
        # a shell session's commands print through its attached stream: paced as well
        shell = await sb.shell()
        t0 = time.monotonic()
        r = await shell.run("head -c 3M /dev/zero")
        took = time.monotonic() - t0
        assert (r.exit_code, len(r.stdout)) == (0, 3 << 20)
        assert took >= (3 - 0.5) / 2 - 0.01


async def test_fork_bomb_contained_and_neighbour_answers(client, node):
    victim = await client.sandboxes.create(image="test/debian", limits=SMALL)
    neighbour = await client.sandboxes.create(image="test/debian", limits=SMALL)
    try:
        bomb = await victim.spawn(["bash", "-c", ":(){ :|:& };:"])
        deadline = time.monotonic() + 30  # the bomb reaches its pids limit (generous)
        while node.cgroups.pids_current(victim.id) < SMALL.pids and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        lat = []
        for _ in range(20):
            t = time.perf_counter()
            r = await neighbour.exec(["true"])
            lat.append(time.perf_counter() - t)
            assert r.ok
        # generous: a starved neighbour would wait for the whole bomb (how fast it answers
        # under load is a bench figure: `corral bench qos`)
        assert max(lat) < 10.0, lat
        # contained: the victim sits at its pids limit (from the kernel's own count) ...
        assert 0 < node.cgroups.pids_current(victim.id) <= SMALL.pids
        # ... where an exec may find no pid free, and says so clearly
        try:
            await victim.exec(["true"])
        except corral.SandboxError as e:
            assert "fork" in str(e)
        # once the bomb's process group is killed the sandbox recovers
        await bomb.kill()
        deadline = time.time() + 20
        while True:
            try:
                r = await victim.exec(["true"])
                if r.ok:
                    break
            except corral.SandboxError:
                pass
            assert time.time() < deadline, "victim did not recover after killing the bomb"
            await asyncio.sleep(0.2)
    finally:
        await victim.destroy()
        await neighbour.destroy()


async def test_streaming_and_background(client):
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        chunks = []
        async with sb.exec_stream(["sh", "-c", "echo a; sleep 0.2; echo b >&2; echo c"]) as st:
            async for ch in st:
                chunks.append((ch.stream, ch.data))
        assert b"".join(d for s, d in chunks if s == "stdout") == b"a\nc\n"
        assert st.result.exit_code == 0
        p = await sb.spawn(["sh", "-c", "echo started; sleep 30"])
        assert p.pid > 0
        deadline = time.monotonic() + 30
        while (out := (await p.output())[0]) == b"" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # until the first output arrives
        assert out == b"started\n"
        await p.kill()
        res = await p.wait(timeout=10)
        assert res.reason == "signaled"


async def test_shell_session(client):
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        sh = await sb.shell()
        await sh.run("mkdir -p /work && cd /work && export X=1 && f() { echo fn$1; }")
        r = await sh.run("pwd; echo $X; f 2")
        assert r.stdout == b"/work\n1\nfn2\n"
        r = await sh.run("exit 4")
        assert r.exit_code == 4
        r = await sh.run("unset X; cd /tmp")
        r = await sh.run('echo "[$X]"; pwd')
        assert r.stdout == b"[]\n/tmp\n"
        other = await sb.shell()
        r = await other.run("pwd; echo [$X]")
        assert r.stdout == b"/\n[]\n"


async def test_files(client, tmp_path):
    async with await client.sandboxes.create(image="test/debian", limits=SMALL) as sb:
        await sb.files.mkdir("/work/sub")
        await sb.files.write("/work/a.py", b"print('hi')\n")
        r = await sb.exec(["python3", "/work/a.py"])
        assert r.stdout == b"hi\n"
        assert await sb.files.read("/work/a.py") == b"print('hi')\n"
        names = {e.name for e in await sb.files.list("/work")}
        assert names == {"a.py", "sub"}
        r = await sb.exec(["stat", "-c", "%u", "/work/a.py"])
        assert r.stdout == b"0\n"
        # escapes stay inside
        await sb.exec(["ln", "-s", "/", "/work/root"])
        await sb.exec(["ln", "-s", "../../../../../../etc", "/work/up"])
        assert b"root:" in await sb.files.read("/work/root/etc/passwd")
        await sb.files.write("/work/root/../../../../tmp/escape-canary", b"x")
        assert not os.path.exists("/tmp/escape-canary")  # landed in the sandbox's /tmp
        assert await sb.files.read("/tmp/escape-canary") == b"x"
        with pytest.raises(corral.InvalidRequest):
            await sb.files.read("relative/path")
        # tree upload / download round trip
        src = tmp_path / "src"
        (src / "d").mkdir(parents=True)
        (src / "d" / "f.txt").write_bytes(b"tree file\n")
        await sb.files.upload(src, "/up")
        r = await sb.exec(["sh", "-c", "cat /up/d/f.txt || cat /up/src/d/f.txt"])
        assert r.stdout == b"tree file\n"
        await sb.files.download("/up", tmp_path / "back")
        assert [p.read_bytes() for p in (tmp_path / "back").rglob("f.txt")] == [b"tree file\n"]
        await sb.files.remove("/up", recursive=True)
        with pytest.raises(corral.NotFound):
            await sb.files.stat("/up")


async def test_bad_input(client, node):
    with pytest.raises(corral.ImageNotFound):
        await client.sandboxes.create(image="no/such-image")
    with pytest.raises(corral.SandboxNotFound):
        await client.sandboxes.get("sb-doesnotexist")
    with pytest.raises(corral.InvalidRequest):
        await client.sandboxes.create(image="test/debian", limits={"memory": "lots"})
    before = len(await node.sandbox_list())
    with pytest.raises(Exception):
        SandboxSpec(image="test/debian", labels={"bad key!": "x"})
    assert len(await node.sandbox_list()) == before


async def test_ttl_and_idle(client, node):
    a = await client.sandboxes.create(image="test/busybox", limits=SMALL, ttl=1)
    b = await client.sandboxes.create(image="test/busybox", limits=SMALL, idle_timeout=1)
    deadline = time.time() + 15
    live = {a.id, b.id}
    while live and time.time() < deadline:
        await asyncio.sleep(0.5)
        live &= {s.id for s in await node.sandbox_list()}
    assert not live
    kinds = {e.kind for e in await node.events(a.id)} | {e.kind for e in await node.events(b.id)}
    assert {"ttl_expired", "idle_timeout"} <= kinds


async def test_busybox_image(client):
    async with await client.sandboxes.create(image="test/busybox", limits=SMALL) as sb:
        r = await sb.exec(["sh", "-c", "echo $((6*7)); id -un"], user="alice")
        assert r.stdout == b"42\nalice\n"


async def test_control_sockets_have_distinct_inodes(client, node):
    """The kernel finds a unix socket by its file's inode number (one global table of 256
    buckets): sockets sharing one number, as each in its own fresh btrfs subvolume did,
    made every connect walk all live sandboxes'. They are distinct, and go at destroy."""
    backend = node.backends.get("container")
    sbs = [await client.sandboxes.create(image="test/debian", limits=SMALL) for _ in range(3)]
    try:
        paths = [backend.socket_path(sb.id) for sb in sbs]
        assert len({os.stat(p).st_ino for p in paths}) == 3
        assert (await sbs[0].exec(["true"])).exit_code == 0
    finally:
        for sb in sbs:
            await sb.destroy()
    assert not any(p.exists() for p in paths)
