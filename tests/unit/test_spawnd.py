"""corral-spawnd (host/spawnd.py): what a launcher started through it gets, exit statuses,
a server that dies, and that it goes with the node. A stand-in launcher (a Python script)
reports its fds, environment and signal mask; no sandbox is made."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from corral.errors import HostError
from corral.host import spawnd

FAKE = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys
    if len(sys.argv) > 1 and sys.argv[1] == "exit":
        os._exit(int(sys.argv[2]))
    if len(sys.argv) > 1 and sys.argv[1] == "kill":
        os.kill(os.getpid(), 9)
    if len(sys.argv) > 1 and sys.argv[1] == "block":
        os.read(3, 1)
    fds = []
    for f in range(64):
        try:
            os.fstat(f)
            fds.append(f)
        except OSError:
            pass
    blk = [l.split()[1] for l in open("/proc/self/status") if l.startswith("SigBlk")][0]
    kinds = {{f: os.readlink(f"/proc/self/fd/{{f}}") for f in fds if f != 4 and 2 < f <= 7}}
    os.write(4, json.dumps({{"argv": sys.argv, "env": dict(os.environ), "fds": fds,
                            "blocked": blk, "kinds": kinds}}).encode())
    """
)


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return spawnd.ensure_built(tmp_path_factory.mktemp("bin"))


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    p = tmp_path / "launcher"
    p.write_text(FAKE.format(python=sys.executable))
    p.chmod(0o755)
    return p


async def _launch(
    srv: spawnd.SpawnServer, args: list[str], fds: dict[int, int]
) -> tuple[int, bytes]:
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        launch = await srv.submit(args, {**fds, 4: w})
        os.close(w)
        w = -1
        code = await srv.wait(launch)
        out = b""
        while chunk := os.read(r, 65536):
            out += chunk
        return code, out
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_launcher_gets_exactly_its_fds_no_env_no_blocked_signal(helper: Path, fake: Path) -> None:
    srv = spawnd.SpawnServer(helper, str(fake))
    # Fds the node holds without CLOEXEC must not reach the launcher either.
    stray = os.open("/dev/null", os.O_RDONLY)
    os.set_inheritable(stray, True)
    a, b = os.pipe2(os.O_CLOEXEC)
    try:
        code, out = asyncio.run(_launch(srv, ["x", "-t", "a b"], {3: a, 7: b}))
    finally:
        for f in (stray, a, b):
            os.close(f)
        srv.close()
    assert code == 0
    got = json.loads(out)
    # argv[0] is always the server's launcher: a request names only the arguments.
    assert got["argv"] == [str(fake), "x", "-t", "a b"]
    assert got["env"] == {} or set(got["env"]) <= {"LC_CTYPE"}  # Python may set LC_CTYPE
    # 0-2 stdio, 3 and 7 as sent, 4 the report pipe; nothing else.
    assert got["fds"] == [0, 1, 2, 3, 4, 7]
    assert got["kinds"]["3"].startswith("pipe:") and got["kinds"]["7"].startswith("pipe:")
    assert int(got["blocked"], 16) == 0


def test_exit_status_and_signal(helper: Path, fake: Path) -> None:
    async def go() -> list[int]:
        srv = spawnd.SpawnServer(helper, str(fake))
        try:
            return [
                (await _launch(srv, ["exit", "3"], {}))[0],
                (await _launch(srv, ["kill"], {}))[0],
                (await _launch(srv, [], {}))[0],
            ]
        finally:
            srv.close()

    assert asyncio.run(go()) == [3, -signal.SIGKILL, 0]


def test_launchers_cpu_is_counted(helper: Path, fake: Path) -> None:
    """Launchers reaped by the server are not in the node's children times: the benches'
    CPU per create takes them from the replies."""

    async def go() -> tuple[float, spawnd.SpawnServer]:
        srv = spawnd.SpawnServer(helper, str(fake))
        try:
            before = spawnd.cpu_seconds()
            for _ in range(3):
                await _launch(srv, [], {})  # a Python start-up each: some ms of CPU
            return spawnd.cpu_seconds() - before, srv
        finally:
            srv.close()

    used, srv = asyncio.run(go())
    assert used > 0
    # closed, it no longer counts: its CPU is in our children times once it is reaped (the
    # servers of nodes other tests of this process still have open do count)
    assert srv not in spawnd._LIVE


def test_many_at_once(helper: Path, fake: Path) -> None:
    async def go() -> list[int]:
        srv = spawnd.SpawnServer(helper, str(fake))
        try:
            got = await asyncio.gather(*(_launch(srv, ["exit", str(i)], {}) for i in range(24)))
            return [c for c, _ in got]
        finally:
            srv.close()

    assert asyncio.run(go()) == list(range(24))


def test_a_burst_beyond_the_servers_queue(helper: Path, fake: Path) -> None:
    """More requests at once than the server's socket buffer holds (~25 of a launcher's
    size): the senders wait for room on the event loop instead of blocking it, and all
    are served."""

    async def go() -> list[int]:
        srv = spawnd.SpawnServer(helper, str(fake))
        os.kill(srv.pid, signal.SIGSTOP)  # nothing is read until it goes on
        try:
            jobs = [
                asyncio.ensure_future(_launch(srv, ["exit", str(i % 7), "p" * 8000], {}))
                for i in range(40)
            ]
            # The loop still runs while the queue is full (a blocking send would hang here).
            for _ in range(100):
                await asyncio.sleep(0)
            assert not any(j.done() for j in jobs)
            os.kill(srv.pid, signal.SIGCONT)
            return [c for c, _ in await asyncio.gather(*jobs)]
        finally:
            os.kill(srv.pid, signal.SIGCONT)
            srv.close()

    assert asyncio.run(go()) == [i % 7 for i in range(40)]


def test_server_death_fails_the_pending_launch_and_the_next_restarts_it(
    helper: Path, fake: Path
) -> None:
    async def go() -> None:
        srv = spawnd.SpawnServer(helper, str(fake))
        hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
        try:
            launch = await srv.submit(["block"], {3: hold_r})
            first = srv.pid
            assert launch.server_pid == first
            os.kill(first, signal.SIGKILL)
            # The wait ends once the orphaned launcher has (its pidfd): let it go.
            waiting = asyncio.ensure_future(srv.wait(launch))
            os.close(hold_w)
            hold_w = -1
            with pytest.raises(HostError, match="died before the launcher finished"):
                await waiting
            code, _ = await _launch(srv, ["exit", "5"], {})
            assert code == 5
            assert srv.restarts == 1 and srv.pid != first
        finally:
            if hold_w >= 0:
                os.close(hold_w)
            os.close(hold_r)
            srv.close()

    asyncio.run(go())


def test_a_launch_names_the_server_that_took_it(helper: Path, fake: Path) -> None:
    """A request taken by a server that has since died and been replaced is waited on
    after the replacement took its own: each ends by its own server, the old one's death
    fails only its own request, and the new server is left running. A launch dropped
    unwaited leaves nothing behind (its launcher ends, the server reaps it)."""

    async def go() -> None:
        srv = spawnd.SpawnServer(helper, str(fake))
        hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
        try:
            old = await srv.submit(["block"], {3: hold_r})
            first = srv.pid
            pidfd = os.pidfd_open(first)
            os.kill(first, signal.SIGKILL)
            select.select([pidfd], [], [])  # it has exited (its socket end is closed)
            os.close(pidfd)
            r, w = os.pipe2(os.O_CLOEXEC)
            new = await srv.submit(["exit", "4"], {4: w})  # restarts the server
            os.close(w)
            second = srv.pid
            assert (old.server_pid, new.server_pid) == (first, second) and first != second
            os.close(hold_w)
            hold_w = -1
            with pytest.raises(HostError, match="died before the launcher finished"):
                await srv.wait(old)
            assert await srv.wait(new) == 4
            os.close(r)
            assert old.reply.fileno() == -1 and new.reply.fileno() == -1  # closed by wait
            assert (srv.pid, srv.restarts, srv.hangs) == (second, 1, 0)
            dropped = await srv.submit(["exit", "0"], {})
            dropped.close()
            assert dropped.reply.fileno() == -1
            assert (await _launch(srv, ["exit", "6"], {}))[0] == 6
            assert srv.pid == second
        finally:
            if hold_w >= 0:
                os.close(hold_w)
            os.close(hold_r)
            srv.close()

    asyncio.run(go())


def test_bad_requests_are_refused(helper: Path, fake: Path) -> None:
    srv = spawnd.SpawnServer(helper, str(fake))
    try:
        with pytest.raises(HostError, match="3..7"):
            asyncio.run(srv.submit([], {8: 0}))
    finally:
        srv.close()

    async def go() -> str:
        srv = spawnd.SpawnServer(helper, str(fake))
        try:
            # A mask that claims two fds while one is sent.
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            await srv._send(b"\x03\0\0\0", [theirs.fileno(), 0])
            theirs.close()
            try:
                return (await spawnd._recv(mine))[0].decode()
            finally:
                mine.close()
        finally:
            srv.close()

    assert asyncio.run(go()) == "E fd mask does not match the fds sent"


def test_close_stops_the_server(helper: Path, fake: Path) -> None:
    srv = spawnd.SpawnServer(helper, str(fake))
    pid = srv.pid
    srv.close()
    assert not os.path.exists(f"/proc/{pid}")


def test_server_dies_with_the_node(helper: Path, fake: Path) -> None:
    """A node killed with SIGKILL: the server goes too (PDEATHSIG and EOF)."""
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from corral.host import spawnd\n"
        f"s = spawnd.SpawnServer(Path({str(helper)!r}), {str(fake)!r})\n"
        "os.write(1, f'{s.pid}\\n'.encode())\n"
        "os.read(0, 1)\n"
    )
    node = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert node.stdout is not None and node.stdin is not None
    pid = int(node.stdout.readline())
    pidfd = os.pidfd_open(pid)
    try:
        node.kill()
        node.wait()
        # The server is not our child (reparented): its pidfd turns readable when it exits.
        assert select.select([pidfd], [], [], 30)[0] == [pidfd]
    finally:
        os.close(pidfd)
        node.stdin.close()
        node.stdout.close()
