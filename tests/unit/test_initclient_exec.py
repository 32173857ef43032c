"""``InitClient.exec`` reads its answer straight off the socket (no StreamReader), and the
rest of a big output in a worker thread: against a scripted fake init on a unix socket,
frames cut at any byte arrive whole, a big output arrives exactly and in order (through
the thread, and only a big one goes there), a big stdin is sent beside the reads, a
broken or refusing init is still a clear SandboxError (in the thread too), and an exec
abandoned while the thread reads ends it and closes the connection."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from corral.backends import initclient
from corral.backends.initclient import InitClient, _field, _frame
from corral.errors import SandboxError

ENV = {"PATH": "/usr/bin:/bin"}
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _request(r: asyncio.StreamReader) -> bytes:
    """The Q frame's payload."""
    n = int.from_bytes(await r.readexactly(4), "big")
    assert (await r.readexactly(1)) == b"Q"
    return await r.readexactly(n - 1)


def _exit(code: int, **more: bytes) -> bytes:
    tags = {"out_trunc": initclient.OUT_TRUNC, "out_len": initclient.OUT_LEN}
    body = _field(initclient.REASON, "exited") + _field(initclient.CODE, code)
    body += b"".join(_field(tags[k], v) for k, v in more.items())
    return _frame(b"X"[0], body)


@pytest.fixture
async def fake(tmp_path: Path) -> AsyncIterator[Callable[[Script], Awaitable[InitClient]]]:
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> InitClient:
        path = tmp_path / f"ctl{len(servers)}.sock"

        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                await script(r, w)
            finally:
                w.close()

        servers.append(await asyncio.start_unix_server(serve, path))
        return InitClient(path)

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


async def _dribble(w: asyncio.StreamWriter, data: bytes, step: int) -> None:
    """Write ``data`` in pieces of ``step`` bytes, each flushed: frames cut anywhere."""
    for i in range(0, len(data), step):
        w.write(data[i : i + step])
        await w.drain()


async def test_frames_cut_anywhere_arrive_whole(fake) -> None:  # type: ignore[no-untyped-def]
    answer = _frame(b"S"[0], _field(initclient.PID, 42))
    answer += _frame(b"O"[0], b"hello ") + _frame(b"E"[0], b"oops\n") + _frame(b"O"[0], b"world\n")
    answer += _exit(3)

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        await _dribble(w, answer, 3)

    init = await fake(script)
    res = await init.exec(["x"], env=ENV)
    assert (res.reason, res.code, res.pid) == ("exited", 3, 42)
    assert (res.stdout, res.stderr) == (b"hello world\n", b"oops\n")


@pytest.mark.parametrize("blocking", [False, True], ids=["loop", "thread"])
async def test_short_reads_are_gathered_the_same_on_the_loop_and_in_a_thread(
    blocking: bool,
) -> None:
    """_exactly (loop) and _exactly_blocking (reader thread) share the gathering: a read
    cut into pieces (a SEQPACKET pair: one recv, one piece) comes back whole, and the
    stream's end half-way is an IncompleteReadError (the callers' "closed the connection
    before answering")."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        for piece in (b"ab", b"c", b"de", b"fg", b"ij"):
            b.send(piece)
        b.close()
        conn = initclient._SockConn(a, "test.sock", "exec")
        if blocking:
            a.settimeout(5.0)

            async def exactly(n: int) -> bytes:
                return conn._exactly_blocking(n)  # every piece is queued: no wait
        else:
            a.setblocking(False)
            exactly = conn._exactly
        assert await exactly(5) == b"abcde"
        assert await exactly(2) == b"fg"  # whole at once
        with pytest.raises(asyncio.IncompleteReadError):
            await exactly(5)  # "ij", then the end


async def test_big_output_is_joined_exactly(fake) -> None:  # type: ignore[no-untyped-def]
    pieces = [os.urandom(65536) for _ in range(40)]  # 2.5 MiB: past the threaded join's bar
    assert sum(map(len, pieces)) >= initclient._THREAD_JOIN

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 7)))
        for p in pieces:
            w.write(_frame(b"O"[0], p))
            await w.drain()
        w.write(_exit(0, out_trunc=b"1", out_len=b"9999999"))

    init = await fake(script)
    res = await init.exec(["yes"], env=ENV, output_limit=len(pieces) * 65536)
    assert res.stdout == b"".join(pieces)
    assert (res.stderr, res.out_trunc, res.out_len) == (b"", True, 9999999)


async def test_big_stdin_is_sent_beside_the_reads(fake) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(5 << 20)  # more than a unix socket takes in one send

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 1)))
        got = bytearray()
        while True:
            n = int.from_bytes(await r.readexactly(4), "big")
            assert (await r.readexactly(1)) == b"I"
            chunk = await r.readexactly(n - 1)
            if not chunk:
                break
            got += chunk
        w.write(_frame(b"O"[0], str(len(got)).encode()) + _exit(0))
        assert bytes(got) == data

    init = await fake(script)
    res = await init.exec(["cat"], env=ENV, stdin=data)
    assert res.stdout == str(len(data)).encode()


async def test_a_closed_or_refusing_init_is_a_clear_error(fake) -> None:  # type: ignore[no-untyped-def]
    async def closes(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 1)) + b"\0\0")  # then a cut header

    async def refuses(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"R"[0], _field(initclient.MESSAGE, "no such user")))

    async def bad_length(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write((1 << 30).to_bytes(4, "big") + b"O")

    init = await fake(closes)
    with pytest.raises(SandboxError, match="closed the connection before answering exec"):
        await init.exec(["x"], env=ENV)
    init = await fake(refuses)
    with pytest.raises(SandboxError, match="refused exec: no such user"):
        await init.exec(["x"], env=ENV)
    init = await fake(bad_length)
    with pytest.raises(SandboxError, match="bad frame length"):
        await init.exec(["x"], env=ENV)


async def test_no_socket_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="does not exist"):
        await InitClient(tmp_path / "none.sock").exec(["x"], env=ENV)


@pytest.fixture
def threaded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads that read an exec's rest (one per exec that went there)."""
    import threading

    seen: list[str] = []
    real = initclient._SockConn._read_rest

    def spy(self, out, err, pace):  # type: ignore[no-untyped-def]
        seen.append(threading.current_thread().name)
        return real(self, out, err, pace)

    monkeypatch.setattr(initclient._SockConn, "_read_rest", spy)
    return seen


async def test_a_flood_is_read_by_a_worker_thread_in_order(fake, threaded) -> None:  # type: ignore[no-untyped-def]
    out = [os.urandom(65536) for _ in range(48)]  # 3 MiB, past the threaded read's bar
    err = [os.urandom(1000) for _ in range(48)]

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 7)))
        for o, e in zip(out, err, strict=True):  # both streams, interleaved
            w.write(_frame(b"O"[0], o) + _frame(b"E"[0], e))
            await w.drain()
        w.write(_exit(0, out_trunc=b"1", out_len=b"9999999"))

    init = await fake(script)
    res = await init.exec(["yes"], env=ENV, output_limit=len(out) * 65536)
    assert len(threaded) == 1 and threaded[0].startswith("corral-exec-read")
    assert (res.stdout, res.stderr) == (b"".join(out), b"".join(err))
    assert (res.code, res.pid, res.out_trunc, res.out_len) == (0, 7, True, 9999999)


async def test_a_small_output_stays_on_the_loop(fake, threaded) -> None:  # type: ignore[no-untyped-def]
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 7)) + _frame(b"O"[0], b"x" * 1000))
        w.write(_exit(0))

    res = await (await fake(script)).exec(["x"], env=ENV)
    assert (res.stdout, threaded) == (b"x" * 1000, [])


async def test_a_broken_init_during_a_threaded_read_is_a_clear_error(fake, threaded) -> None:  # type: ignore[no-untyped-def]
    big = _frame(b"O"[0], b"y" * 65536) * 20  # 1.25 MiB: the rest goes to the thread

    async def closes(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 1)) + big + _frame(b"O"[0], b"z")[:3])

    async def refuses(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 1)) + big)
        w.write(_frame(b"R"[0], _field(initclient.MESSAGE, "out of buffers")))

    with pytest.raises(SandboxError, match="closed the connection before answering exec"):
        await (await fake(closes)).exec(["x"], env=ENV)
    with pytest.raises(SandboxError, match="refused exec: out of buffers"):
        await (await fake(refuses)).exec(["x"], env=ENV)
    assert len(threaded) == 2


async def test_abandoning_a_threaded_read_ends_it_and_tells_the_init(fake, threaded) -> None:  # type: ignore[no-untyped-def]
    sent = asyncio.Event()
    peer_gone = asyncio.Event()

    async def stalls(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 1)))
        w.write(_frame(b"O"[0], b"y" * 65536) * 20)  # past the bar, then nothing more
        await w.drain()
        sent.set()
        await r.read()  # EOF: the client shut the connection (an init kills the process)
        peer_gone.set()

    init = await fake(stalls)
    task = asyncio.create_task(init.exec(["x"], env=ENV))
    await sent.wait()
    while not threaded:  # the thread has the socket
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(peer_gone.wait(), 30)
    async with asyncio.timeout(30):  # and the thread ended: its slot in the pool is free
        while initclient._readers_busy:
            await asyncio.sleep(0.01)


async def test_with_every_reader_busy_a_flood_is_read_on_the_loop(  # type: ignore[no-untyped-def]
    fake, threaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(initclient, "_READERS", 0)
    out = [os.urandom(65536) for _ in range(24)]

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 7)))
        for o in out:
            w.write(_frame(b"O"[0], o))
            await w.drain()
        w.write(_exit(0))

    res = await (await fake(script)).exec(["yes"], env=ENV, output_limit=32 << 20)
    assert (res.stdout, threaded) == (b"".join(out), [])
    assert initclient._readers_busy == 0


async def test_a_quiet_spell_in_a_threaded_read_is_not_an_end(  # type: ignore[no-untyped-def]
    fake, threaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(initclient, "_READER_WAKE", 0.01)  # the reader wakes many times
    big = [os.urandom(65536) for _ in range(20)]

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(_frame(b"S"[0], _field(initclient.PID, 7)))
        w.write(b"".join(_frame(b"O"[0], o) for o in big))
        await w.drain()
        while not threaded:  # the thread has the socket
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # silence: ~20 of the reader's wake-ups
        w.write(_frame(b"O"[0], b"late\n") + _exit(0))

    res = await (await fake(script)).exec(["x"], env=ENV, output_limit=32 << 20)
    assert res.stdout == b"".join(big) + b"late\n"
    assert len(threaded) == 1 and initclient._readers_busy == 0
