"""corral-init as PID 1 of a fresh pid + mount namespace, driven through InitClient.

The init runs under ``unshare --pid --fork --mount-proc`` with a listening socket as fd 3
(as runc --preserve-fds 1 gives it), so its peer check sees the test as a process from
outside its pid namespace, exactly like the node. Killing PID 1 ends the namespace and
everything in it, which is how every test's leftovers are cleaned up.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.backends.initclient import InitClient
from corral.errors import HostError, ProcessNotFound, SandboxError
from corral.init import ensure_built

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "gcc", "bash", "ps")),
    reason="needs root, unshare, gcc, bash and ps",
)

ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}


class NsInit:
    """corral-init as PID 1 of a new pid + mount namespace, fd 3 = a listening socket."""

    def __init__(self, binary: Path, sock_path: Path) -> None:
        self.sock_path = sock_path
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(str(sock_path))
        lsock.listen(128)
        # bash, not sh: dash cannot redirect fds above 9
        fd = fcntl.fcntl(lsock.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
        try:
            self.unshare = subprocess.Popen(
                [
                    "bash",
                    "-c",
                    f'exec unshare --pid --fork --mount-proc --kill-child "$0" 3<&{fd} {fd}<&-',
                    str(binary),
                ],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        finally:
            os.close(fd)
            lsock.close()  # the init holds the only copy now
        self.pid = self._find_init()

    def _find_init(self) -> int:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                kids = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children")
                pids = kids.read_text().split()
                if pids and Path(f"/proc/{pids[0]}/exe").resolve().name.startswith("corral-init"):
                    return int(pids[0])
            except OSError:
                pass
            if self.unshare.poll() is not None:
                break
            time.sleep(0.005)
        err = b""
        if self.unshare.poll() is not None and self.unshare.stderr is not None:
            err = self.unshare.stderr.read()
        self.stop()
        raise RuntimeError(f"corral-init did not start: {err!r}")

    def stop(self) -> None:
        """SIGKILL PID 1: the kernel then kills every process of the namespace, and
        unshare (its parent) reaps it and exits."""
        if self.unshare.poll() is None:
            if getattr(self, "pid", 0):
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.unshare.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.unshare.kill()  # --kill-child: SIGKILL reaches the init too
        self.unshare.wait(timeout=10)
        if self.unshare.stderr:
            self.unshare.stderr.close()


@pytest.fixture(scope="session")
def init_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_built(tmp_path_factory.mktemp("init-bin"))


@pytest.fixture(scope="module")
def ns(init_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NsInit]:
    n = NsInit(init_binary, tmp_path_factory.mktemp("init-ns") / "ctl.sock")
    try:
        yield n
    finally:
        n.stop()
        assert not Path(f"/proc/{n.pid}").exists()


@pytest.fixture
def init(ns: NsInit) -> InitClient:
    return InitClient(ns.sock_path)


async def ns_procs(init: InitClient) -> list[tuple[int, str, str]]:
    """(pid, state, args) of every process of the namespace, ps itself excluded."""
    r = await init.exec(["ps", "-eo", "pid=,stat=,args="], env=ENV)
    out = []
    for line in r.stdout.decode().splitlines():
        pid, st, args = (line.split(None, 2) + ["", ""])[:3]
        if not args.startswith("ps -eo"):
            out.append((int(pid), st, args))
    return out


async def eventually_gone(init: InitClient, pattern: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while True:
        left = [p for p in await ns_procs(init) if re.search(pattern, p[2])]
        if not left:
            return
        assert time.monotonic() < deadline, f"still running: {left}"
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- startup


def test_ensure_built_reuses_and_reports_compiler_errors(
    init_binary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import corral.init

    assert re.fullmatch(r"corral-init-[0-9a-f]{12}", init_binary.name)
    mtime = init_binary.stat().st_mtime_ns
    assert ensure_built(init_binary.parent) == init_binary  # same source: no rebuild
    assert init_binary.stat().st_mtime_ns == mtime
    broken = tmp_path / "broken.c"
    broken.write_text("int main(void) { return nope; }\n")
    monkeypatch.setattr(corral.init, "SOURCE", broken)
    with pytest.raises(HostError, match="nope"):
        ensure_built(tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []  # no temporary left behind


def test_version(init_binary: Path) -> None:
    r = subprocess.run([init_binary, "--version"], capture_output=True, text=True, timeout=5)
    assert r.returncode == 0 and r.stdout.startswith("corral-init ")


@pytest.mark.parametrize("fd3", ["none", "file", "unlistened"])
def test_refuses_fd3_that_is_not_a_listening_socket(init_binary: Path, fd3: str) -> None:
    redirect = {"none": "3<&-", "file": "3</dev/null", "unlistened": ""}[fd3]
    pass_fds: tuple[int, ...] = ()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if fd3 == "unlistened":
            fd = fcntl.fcntl(s.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
            redirect, pass_fds = f"3<&{fd} {fd}<&-", (fd,)
        r = subprocess.run(
            ["bash", "-c", f'exec "$0" {redirect}', init_binary],
            capture_output=True,
            text=True,
            timeout=5,
            pass_fds=pass_fds,
        )
    finally:
        s.close()
        for fd in pass_fds:
            os.close(fd)
    assert r.returncode == 1
    assert "fd 3 is not a listening unix stream socket" in r.stderr


async def test_client_errors_name_the_socket(tmp_path: Path) -> None:
    missing = tmp_path / "missing.sock"
    with pytest.raises(SandboxError, match="does not exist"):
        await InitClient(missing).ping()
    dead = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(dead))
    s.close()  # bound, never listening: connection refused
    with pytest.raises(SandboxError, match="refused the connection"):
        await InitClient(dead).exec(["true"], env=ENV)


# ---------------------------------------------------------------- exec basics


async def test_ping_and_exit_codes(init: InitClient) -> None:
    await init.ping()
    r = await init.exec(["echo", "hello", "world"], env=ENV)
    assert (r.reason, r.code, r.signal, r.stdout, r.stderr) == (
        "exited",
        0,
        None,
        b"hello world\n",
        b"",
    )
    assert (r.out_len, r.err_len, r.out_trunc, r.err_trunc) == (12, 0, False, False)
    assert r.pid > 1 and r.duration > 0
    assert (await init.exec(["true"], env=ENV)).code == 0
    assert (await init.exec(["false"], env=ENV)).code == 1
    r = await init.exec(["sh", "-c", "echo oops >&2; exit 42"], env=ENV)
    assert (r.reason, r.code, r.stderr) == ("exited", 42, b"oops\n")


async def test_stdin(init: InitClient) -> None:
    assert (await init.exec(["cat"], env=ENV, stdin=b"abc\n")).stdout == b"abc\n"
    assert (await init.exec(["cat"], env=ENV, stdin=b"")).stdout == b""
    big = os.urandom(3 << 20)  # more than any pipe or socket buffer: flow control
    r = await init.exec(["sha256sum"], env=ENV, stdin=big)
    import hashlib

    assert r.stdout.split()[0].decode() == hashlib.sha256(big).hexdigest()
    # without stdin the process reads /dev/null
    assert (await init.exec(["cat"], env=ENV, timeout=5)).stdout == b""


async def test_env_is_exactly_what_was_sent(init: InitClient) -> None:
    env = {**ENV, "FOO": "bar baz", "EMPTY": "", "UNI": "é"}
    r = await init.exec(["env"], env=env)
    got = dict(line.split("=", 1) for line in r.stdout.decode().splitlines())
    assert got == env
    # PATH is searched in the given env, not in the init's
    r = await init.exec(["true"], env={"PATH": "/nonexistent"})
    assert r.code == 127


async def test_cwd(init: InitClient, tmp_path: Path) -> None:
    assert (await init.exec(["pwd"], env=ENV, cwd=str(tmp_path))).stdout == f"{tmp_path}\n".encode()
    r = await init.exec(["pwd"], env=ENV, cwd="/no/such/dir")
    assert r.code == 126
    assert b"corral-init: chdir /no/such/dir: No such file or directory" in r.stderr


async def test_uid_gid_groups(init: InitClient) -> None:
    r = await init.exec(
        ["sh", "-c", "id -u; id -g; id -G"], env=ENV, uid=65534, gid=65533, groups=(100, 200)
    )
    assert r.stdout.decode().split("\n")[:3] == ["65534", "65533", "65533 100 200"]
    r = await init.exec(["id", "-G"], env=ENV)  # root gets no supplementary groups of ours
    assert r.stdout == b"0\n"


async def test_exec_failures(init: InitClient, tmp_path: Path) -> None:
    r = await init.exec(["no-such-binary-xyz"], env=ENV)
    assert (r.reason, r.code) == ("exited", 127)
    assert r.stderr == b"corral-init: exec no-such-binary-xyz: No such file or directory\n"
    plain = tmp_path / "not-executable"
    plain.write_text("data")
    r = await init.exec([str(plain)], env=ENV)
    assert r.code == 126 and b"Permission denied" in r.stderr


async def test_signaled(init: InitClient) -> None:
    r = await init.exec(["sh", "-c", "kill -TERM $$"], env=ENV)
    assert (r.reason, r.code, r.signal) == ("signaled", None, 15)


async def test_timeout_kills_the_process_group(init: InitClient) -> None:
    t0 = time.monotonic()
    r = await init.exec(["sh", "-c", "sleep 1001 & sleep 1002; echo never"], env=ENV, timeout=0.3)
    assert (r.reason, r.signal) == ("timeout", 9)
    # generous upper bound: without the timeout the command would run for 1002 s
    assert 0.25 < time.monotonic() - t0 < 30 and b"never" not in r.stdout
    await eventually_gone(init, r"sleep 100[12]")  # the grandchild too


async def test_output_limit(init: InitClient) -> None:
    r = await init.exec(["yes"], env=ENV, output_limit=1000, timeout=20)
    assert (r.reason, r.signal, r.out_trunc, r.err_trunc) == ("output_limit", 9, True, False)
    assert r.stdout == b"y\n" * 500
    assert r.out_len > 1000
    r = await init.exec(["sh", "-c", "yes >&2"], env=ENV, output_limit=10, timeout=20)
    assert (r.reason, r.err_trunc, r.stderr) == ("output_limit", True, b"y\n" * 5)
    # exactly the limit is not over it
    r = await init.exec(["head", "-c", "1000", "/dev/zero"], env=ENV, output_limit=1000)
    assert (r.reason, r.code, r.out_trunc, len(r.stdout)) == ("exited", 0, False, 1000)


async def test_large_output_arrives_whole(init: InitClient) -> None:
    n = 20_000_000
    r = await init.exec(["head", "-c", str(n), "/dev/urandom"], env=ENV, output_limit=32 << 20)
    assert (r.reason, r.code, len(r.stdout), r.out_len) == ("exited", 0, n, n)


async def test_background_child_does_not_hold_the_exec(init: InitClient) -> None:
    t0 = time.monotonic()
    r = await init.exec(["sh", "-c", "sleep 1003 & echo started"], env=ENV, timeout=30)
    assert (r.reason, r.code, r.stdout) == ("exited", 0, b"started\n")
    assert time.monotonic() - t0 < 20  # generous: held, it would end at the 30 s timeout
    procs = [p for p in await ns_procs(init) if p[2] == "sleep 1003"]
    assert procs, "the background child keeps running after the exec"
    await init.exec(["kill", "-9", str(procs[0][0])], env=ENV)


async def test_concurrent_execs(init: InitClient) -> None:
    rs = await asyncio.gather(*(init.exec(["echo", str(i)], env=ENV) for i in range(64)))
    assert [r.stdout for r in rs] == [f"{i}\n".encode() for i in range(64)]


# ---------------------------------------------------------------- streaming


async def test_stream_order(init: InitClient) -> None:
    script = "echo a; sleep 0.1; echo b >&2; sleep 0.1; echo c"
    got = []
    t0 = time.monotonic()
    async with init.stream(["sh", "-c", script], env=ENV) as s:
        assert s.pid > 1
        async for name, data in s:
            got.append((name, data, time.monotonic() - t0))
    assert [(n, d) for n, d, _ in got] == [
        ("stdout", b"a\n"),
        ("stderr", b"b\n"),
        ("stdout", b"c\n"),
    ]
    assert got[0][2] < got[2][2] - 0.1  # "a" came while the process was still running
    assert (s.result.code, s.result.stdout, s.result.stderr) == (0, b"a\nc\n", b"b\n")


async def test_stream_stdin_pipe_and_signal(init: InitClient) -> None:
    async with init.stream(["cat"], env=ENV, stdin_pipe=True) as s:
        await s.write(b"one ")
        await s.write(b"two")
        await s.close_stdin()
        assert (await s.wait()).stdout == b"one two"
    # K right behind S may reach the child before its setsid(): still delivered
    for _ in range(30):
        async with init.stream(["sleep", "1004"], env=ENV, timeout=20) as s:
            await s.signal(15)
            r = await s.wait()
        assert (r.reason, r.signal) == ("signaled", 15)


async def test_client_disconnect_kills_the_group(init: InitClient) -> None:
    async with init.stream(["sh", "-c", "sleep 1005 & sleep 1006"], env=ENV) as s:
        pid = s.pid
    with pytest.raises(SandboxError):
        s.result
    await eventually_gone(init, r"sleep 100[56]")
    assert pid not in [p[0] for p in await ns_procs(init)]
    # leaving at once, maybe before the child reached setsid(), must kill it just the same
    for _ in range(50):
        async with init.stream(["sleep", "1009"], env=ENV):
            pass
    await eventually_gone(init, r"sleep 1009")


async def test_tty(init: InitClient) -> None:
    async with init.stream(
        ["sh", "-c", "tty; test -t 0 && test -t 2 && echo all-tty"], env=ENV, tty=True
    ) as s:
        r = await s.wait()
    assert re.fullmatch(rb"/dev/pts/\d+\r\nall-tty\r\n", r.stdout), r.stdout
    assert r.stderr == b""
    async with init.stream(
        ["sh", "-c", "stty size; read x; stty size; echo got=$x"],
        env=ENV,
        tty=True,
        rows=24,
        cols=80,
        stdin_pipe=True,
    ) as s:
        out = b""
        async for _, data in s:
            out += data
            if b"24 80" in out and b"resized" not in out:
                await s.resize(30, 100)
                await s.write(b"resized\n")
    assert b"24 80" in out and b"30 100" in out and b"got=resized" in out, out
    assert s.result.code == 0


async def test_tty_eof_and_no_early_hangup(init: InitClient) -> None:
    # cat closes its tty fds before it exits; the init must not hang up the tty (SIGHUP)
    # in that window, so the exit is clean every time
    for _ in range(20):
        async with init.stream(["cat"], env=ENV, tty=True, stdin=b"hi\n", timeout=10) as s:
            r = await s.wait()
        assert (r.reason, r.code) == ("exited", 0), r
        assert r.stdout == b"hi\r\nhi\r\n"  # the echo, then cat's copy


# ---------------------------------------------------------------- background processes


async def test_spawn_wait_list_forget(init: InitClient) -> None:
    pid_id, pid = await init.spawn(
        ["sh", "-c", "echo out; echo err >&2; sleep 0.3; echo done"],
        env=ENV,
        cwd="/",
        uid=0,
        gid=0,
        output_limit=1 << 20,
    )
    assert re.fullmatch(r"p\d+", pid_id) and pid > 1
    p = await init.wait(pid_id, timeout=0)
    assert p.running and p.exit is None and p.pid == pid
    p = await init.wait(pid_id, timeout=None)
    assert not p.running and p.exit is not None
    assert (p.exit.reason, p.exit.code) == ("exited", 0)
    assert (p.stdout, p.stderr) == (b"out\ndone\n", b"err\n")
    assert p.argv[0] == "sh"
    # output stays buffered: a second wait sees the same
    assert (await init.wait(pid_id)).stdout == b"out\ndone\n"
    listed = {q.id: q for q in await init.list()}
    assert not listed[pid_id].running and listed[pid_id].exit.code == 0  # type: ignore[union-attr]
    assert listed[pid_id].argv == ["sh", "-c", "echo out; echo err >&2; sleep 0.3; echo done"]
    await init.forget(pid_id)
    assert pid_id not in {q.id for q in await init.list()}
    for call in (init.wait(pid_id), init.kill(pid_id), init.forget(pid_id)):
        with pytest.raises(ProcessNotFound):
            await call


async def test_spawn_kill_and_wait_timeout(init: InitClient) -> None:
    pid_id, _ = await init.spawn(["sleep", "1007"], env=ENV, output_limit=100)
    t0 = time.monotonic()
    p = await init.wait(pid_id, timeout=0.2)
    assert p.running and time.monotonic() - t0 >= 0.19
    assert [q.running for q in await init.list() if q.id == pid_id] == [True]
    await init.kill(pid_id, 15)
    p = await init.wait(pid_id, timeout=5)
    assert p.exit is not None and (p.exit.reason, p.exit.signal) == ("signaled", 15)
    await init.forget(pid_id)


async def test_spawn_output_is_capped_not_killed(init: InitClient) -> None:
    pid_id, _ = await init.spawn(
        ["sh", "-c", "yes | head -c 100000; sleep 1008"], env=ENV, output_limit=1000
    )
    deadline = time.monotonic() + 5
    while len((p := await init.wait(pid_id)).stdout) < 1000:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert p.running and p.stdout == b"y\n" * 500
    await init.forget(pid_id)  # kills the still running group
    await eventually_gone(init, r"sleep 1008")


async def test_spawn_missing_binary(init: InitClient) -> None:
    pid_id, _ = await init.spawn(["no-such-binary-xyz"], env=ENV)
    p = await init.wait(pid_id, timeout=5)
    assert p.exit is not None and p.exit.code == 127
    assert b"exec no-such-binary-xyz: No such file or directory" in p.stderr
    await init.forget(pid_id)


# ---------------------------------------------------------------- PID 1 duties & security


async def test_zombies_are_reaped(init: InitClient) -> None:
    # orphans (their parent exits first) are reparented to PID 1 and must be reaped there
    for _ in range(5):
        await init.exec(["sh", "-c", "(sleep 0.05 &) ; (true &) ; exit 0"], env=ENV)
    pid_id, _ = await init.spawn(["sh", "-c", "(sleep 0.05 &); exit 0"], env=ENV)
    # The orphans end after 50 ms: wait until they are gone and reaped (a generous 30 s);
    # a zombie left by then is one PID 1 does not reap.
    deadline = time.monotonic() + 30
    while True:
        procs = await ns_procs(init)
        zombies = [p for p in procs if p[1].startswith("Z")]
        running = [p for p in procs if "sleep 0.05" in p[2]]
        if not (zombies or running) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert zombies == [] and running == [], (zombies, running)
    await init.forget(pid_id)


async def test_peer_inside_the_namespace_is_refused(init: InitClient, ns: NsInit) -> None:
    # the socket path happens to be visible inside this test namespace (a real sandbox
    # cannot see it); a guest process that connects must still be turned away
    probe = (
        "import socket,struct,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "p=struct.pack('>BI',1,4)+b'ping'\n"
        "try: s.sendall(struct.pack('>IB',len(p)+1,81)+p)\n"
        "except OSError: pass\n"  # the init may have hung up already
        "d=b''\n"
        "try:\n"
        "    while (c:=s.recv(4096)): d+=c\n"
        "except ConnectionResetError: pass\n"
        "sys.stdout.write(repr(d))\n"
    )
    r = await init.exec([sys.executable, "-c", probe, str(ns.sock_path)], env=ENV, timeout=10)
    assert r.code == 0, r.stderr
    assert "peer refused" in r.stdout.decode() and "A" not in r.stdout.decode()[:8]
    await init.ping()  # the node, outside, is still served


async def test_no_fds_leak_to_children(init: InitClient) -> None:
    def fds(listing: bytes) -> dict[str, str]:
        return dict(re.findall(r" (\d+) -> (\S+)", listing.decode()))

    got = fds((await init.exec(["ls", "-l", "/proc/self/fd"], env=ENV)).stdout)
    assert set(got) == {"0", "1", "2", "3"}, got  # 3 is ls's own directory handle
    assert got["0"] == "/dev/null" and got["3"].endswith("/fd")
    assert not any("socket" in v for v in got.values())
    got = fds((await init.exec(["ls", "-l", "/proc/self/fd"], env=ENV, stdin=b"")).stdout)
    assert set(got) == {"0", "1", "2", "3"} and got["0"].startswith("pipe:")
    async with init.stream(["ls", "-l", "/proc/self/fd"], env=ENV, tty=True) as s:
        got = fds((await s.wait()).stdout.replace(b"\r", b""))
    assert set(got) == {"0", "1", "2", "3"} and got["0"].startswith("/dev/pts/"), got
    pid_id, _ = await init.spawn(["ls", "-l", "/proc/self/fd"], env=ENV)
    got = fds((await init.wait(pid_id, timeout=5)).stdout)
    assert set(got) == {"0", "1", "2", "3"}, got
    await init.forget(pid_id)


async def test_init_is_not_dumpable(init: InitClient) -> None:
    # root without CAP_SYS_PTRACE (what a sandbox's guest gets) may list the names in
    # /proc/1/fd but cannot follow them to the control socket
    drop = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--"]
    r = await init.exec([*drop, "readlink", "-v", "/proc/1/fd/3"], env=ENV)
    assert r.code != 0 and b"Permission denied" in r.stderr, r
    r = await init.exec([*drop, "readlink", "/proc/self/fd/0"], env=ENV)
    assert r.code == 0 and r.stdout == b"/dev/null\n"  # the same program reads its own


async def test_idle_memory(init: InitClient, ns: NsInit) -> None:
    await init.ping()
    # The init returns freed heap to the kernel after 1 s idle: wait for that (up to a
    # generous 30 s) rather than for a fixed time.
    deadline = time.monotonic() + 30
    while True:
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{ns.pid}/status").read_text().splitlines()
        )
        rss_kib = int(status["VmRSS"].split()[0])
        anon_kib = int(status["RssAnon"].split()[0])
        if (rss_kib < 1024 and anon_kib < 512) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    print(
        f"\ncorral-init idle: VmRSS {rss_kib} KiB, of which anonymous {anon_kib} KiB "
        f"(the rest is the binary's page cache, shared by every init)"
    )
    assert rss_kib < 1024 and anon_kib < 512


async def test_exec_round_trip(init: InitClient) -> None:
    for _ in range(20):  # warm up
        await init.exec(["true"], env=ENV)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        r = await init.exec(["true"], env=ENV)
        times.append(time.perf_counter() - t0)
        assert r.code == 0
    times.sort()
    print(
        f"\nexec `true` round trip over {len(times)} runs: p50 "
        f"{statistics.median(times) * 1e3:.2f} ms, p99 {times[197] * 1e3:.2f} ms"
    )
