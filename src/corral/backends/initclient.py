"""Client of corral-init's control socket (the protocol: docs/init-protocol.md).

One unix connection per request: the init answers and closes, and closing early is the
way to abandon a running exec (the init then kills its process group)::

    init = InitClient("/var/lib/corral/sandboxes/sb-1/ctl.sock")
    r = await init.exec(["echo", "hi"], env={"PATH": "/usr/bin:/bin"})
    assert (r.reason, r.code, r.stdout) == ("exited", 0, b"hi\\n")

    async with init.stream(["sh", "-c", "echo a; echo b >&2"], env=env) as s:
        async for name, data in s:       # ("stdout", b"a\\n"), ("stderr", b"b\\n")
            ...
    s.result.code                        # 0

Errors: an unreachable init or a broken exchange raise SandboxError; an init answer of
"no such background process" raises ProcessNotFound; a field the init refuses raises
SandboxError with its message.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from corral.backends.outpace import OutputPace
from corral.errors import InvalidRequest, ProcessNotFound, SandboxError
from corral.host.sched import bulk_thread

__all__ = ["InitClient", "InitExit", "InitProc", "ExecStream"]

# field tags
OP, ARG, ENV, CWD, UID, GID, TIMEOUT_MS, OUTPUT_LIMIT, STDIN, TTY = range(1, 11)
ROWS, COLS, ID, SIGNAL, WAIT_MS, PID, REASON, CODE, OUT_TRUNC, ERR_TRUNC = range(11, 21)
DURATION_US, RUNNING, MESSAGE, GROUPS, OUT_LEN, ERR_LEN = range(21, 27)

# frame types (as the int a bytes index gives)
_Q, _I, _K, _W = b"Q"[0], b"I"[0], b"K"[0], b"W"[0]
_S, _O, _E, _X, _P, _A, _N, _R = (c for c in b"SOEXPANR")

MAX_FRAME = 16 << 20
_STDIN_CHUNK = 1 << 20
_GUARD = 30.0
"""Seconds past an exec's own timeout before we stop trusting the init to answer."""
_STEP_BYTES = 128 << 10
"""Bytes an exec's reader takes off its socket in one step of the event loop at most."""
_THREAD_JOIN = 1 << 20
"""Output (one stream) from which its pieces are joined in a worker thread."""
_THREAD_READ = 1 << 20
"""Output of one exec past which the rest of its answer is read by a worker thread."""
_READERS = 32
"""Threads reading execs' answers at most (node-wide); past that, reads stay on the loop.

A pool of their own, not asyncio's default executor (6 threads on 2 CPUs): a reader holds
its thread until the exec ends, which for a command that prints 1 MiB and then a line
an hour is an hour; a few of those would otherwise stop every ``to_thread`` of the node
(the answers' base64 among them)."""
_READER_WAKE = 5.0
"""Seconds a reader thread waits in ``recv`` before it looks whether the loop is gone."""
_reader_pool = ThreadPoolExecutor(
    _READERS, thread_name_prefix="corral-exec-read", initializer=bulk_thread
)
"""Nice 19 (host/sched.py, ``bulk_thread``): a flood's reads and joins yield the CPU to the
event loop and to other sandboxes' work."""
_readers_busy = 0
"""Readers handed to the pool and not yet done (touched on the loop's thread only)."""

_HDR = struct.Struct(">IB")
_FLD = struct.Struct(">BI")


@dataclass
class InitExit:
    """How a process ended, as the init reported it."""

    reason: str
    """exited | signaled | timeout | output_limit"""
    code: int | None
    """Exit status when the process exited by itself."""
    signal: int | None
    """Terminating signal when it was killed (9 after timeout / output_limit)."""
    stdout: bytes
    stderr: bytes
    out_trunc: bool
    err_trunc: bool
    duration: float
    """Seconds from fork to the direct child's exit."""
    pid: int
    out_len: int
    """Bytes the process wrote to stdout, counted also past the limit."""
    err_len: int


@dataclass
class InitProc:
    """A background process (spawn) as wait/list see it."""

    id: str
    pid: int
    running: bool
    argv: list[str]
    stdout: bytes
    """The buffered output (the first output_limit bytes); empty in list()."""
    stderr: bytes
    exit: InitExit | None


# ---------------------------------------------------------------- encoding


def _b(v: str | bytes | int) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, int):
        return str(v).encode()
    return os.fsencode(v)


def _field(tag: int, v: str | bytes | int) -> bytes:
    b = _b(v)
    return _FLD.pack(tag, len(b)) + b


def _frame(type_: int, payload: bytes = b"") -> bytes:
    if len(payload) + 1 > MAX_FRAME:
        raise InvalidRequest(f"request of {len(payload)} bytes exceeds the 16 MiB frame limit")
    return _HDR.pack(len(payload) + 1, type_) + payload


def _stdin_frames(data: bytes) -> bytes:
    return b"".join(
        _frame(_I, data[i : i + _STDIN_CHUNK]) for i in range(0, len(data), _STDIN_CHUNK)
    )


def _ms(seconds: float, what: str) -> int:
    if not seconds > 0 or math.isinf(seconds):
        raise InvalidRequest(f"{what}: {seconds!r} is not a positive number of seconds")
    return max(1, math.ceil(seconds * 1000))


def _start_payload(
    op: str,
    argv: Iterable[str],
    env: Mapping[str, str],
    cwd: str,
    uid: int,
    gid: int,
    groups: Iterable[int],
    timeout: float | None,
    output_limit: int,
    stdin: bool,
    tty: bool = False,
    rows: int = 24,
    cols: int = 80,
) -> bytes:
    args = [_b(a) for a in argv]
    if not args or not args[0]:
        raise InvalidRequest("argv: a command needs at least a non-empty program name")
    if any(b"\0" in a for a in args):
        raise InvalidRequest("argv: arguments cannot contain NUL bytes")
    if output_limit < 0:
        raise InvalidRequest(f"output_limit: {output_limit} is negative")
    parts = [_field(OP, op)]
    parts += [_FLD.pack(ARG, len(a)) + a for a in args]
    for k, v in env.items():
        kv = _b(k) + b"=" + _b(v)
        if not k or "=" in k or b"\0" in kv:
            raise InvalidRequest(f"env: {k!r} is not a valid variable (name or NUL byte)")
        parts.append(_FLD.pack(ENV, len(kv)) + kv)
    parts += [
        _field(CWD, cwd),
        _field(UID, uid),
        _field(GID, gid),
        _field(GROUPS, ",".join(str(int(g)) for g in groups)),
        _field(OUTPUT_LIMIT, output_limit),
    ]
    if timeout is not None:
        parts.append(_field(TIMEOUT_MS, _ms(timeout, "timeout")))
    if stdin:
        parts.append(_field(STDIN, "1"))
    if tty:
        parts += [_field(TTY, "1"), _field(ROWS, rows), _field(COLS, cols)]
    return b"".join(parts)


# ---------------------------------------------------------------- decoding


def _decode(payload: bytes) -> tuple[dict[int, bytes], list[bytes]]:
    """Scalar fields by tag (the last one wins) and the repeated ARG fields in order."""
    fields: dict[int, bytes] = {}
    args: list[bytes] = []
    i, n = 0, len(payload)
    while i < n:
        if n - i < 5:
            raise SandboxError("init sent a malformed field (truncated header)")
        tag, ln = _FLD.unpack_from(payload, i)
        i += 5
        if ln > n - i:
            raise SandboxError("init sent a malformed field (length past the frame)")
        v = payload[i : i + ln]
        i += ln
        if tag == ARG:
            args.append(v)
        else:
            fields[tag] = v
    return fields, args


def _int(f: dict[int, bytes], tag: int) -> int | None:
    v = f.get(tag)
    if v is None or v == b"":
        return None
    try:
        return int(v)
    except ValueError:
        raise SandboxError(f"init sent a non-numeric field {tag}: {v[:40]!r}") from None


def _exit_from(f: dict[int, bytes], stdout: bytes, stderr: bytes, pid: int) -> InitExit:
    return InitExit(
        reason=f.get(REASON, b"").decode(errors="replace"),
        code=_int(f, CODE),
        signal=_int(f, SIGNAL),
        stdout=stdout,
        stderr=stderr,
        out_trunc=f.get(OUT_TRUNC) == b"1",
        err_trunc=f.get(ERR_TRUNC) == b"1",
        duration=(_int(f, DURATION_US) or 0) / 1e6,
        pid=_int(f, PID) or pid,
        out_len=_int(f, OUT_LEN) or 0,
        err_len=_int(f, ERR_LEN) or 0,
    )


def _error(body: bytes, op: str, path: str) -> Exception:
    f, _ = _decode(body)
    msg = f.get(MESSAGE, b"").decode(errors="replace") or "no message"
    if _int(f, CODE) == errno.ESRCH and op in ("wait", "kill", "forget", "attach"):
        return ProcessNotFound(msg)
    return SandboxError(f"init at {path} refused {op}: {msg}")


def _proc_from(
    entry: dict[int, bytes],
    args: list[bytes],
    stdout: bytes,
    stderr: bytes,
    exit_fields: dict[int, bytes] | None,
) -> InitProc:
    pid = _int(entry, PID) or 0
    ended = entry.get(RUNNING) == b"0"
    exit_: InitExit | None = None
    if exit_fields is not None:
        exit_ = _exit_from(exit_fields, stdout, stderr, pid)
    elif ended:
        exit_ = _exit_from(entry, b"", b"", pid)
    return InitProc(
        id=entry.get(ID, b"").decode(errors="replace"),
        pid=pid,
        running=not ended,
        argv=[os.fsdecode(a) for a in args],
        stdout=stdout,
        stderr=stderr,
        exit=exit_,
    )


# ---------------------------------------------------------------- connection


class _Framed:
    """What both connections say about their answers (``frame`` is theirs)."""

    path: str
    op: str

    async def frame(self) -> tuple[int, bytes]:
        raise NotImplementedError

    async def first_frame(self, timeout: float) -> tuple[int, bytes]:
        """The answer's first frame, which a working init sends at once."""
        try:
            async with asyncio.timeout(timeout):
                return await self.frame()
        except TimeoutError:
            raise SandboxError(
                f"init at {self.path} did not start {self.op} within {timeout:g} s "
                "(init stuck or frozen?)"
            ) from None

    def unexpected(self, t: int) -> SandboxError:
        return SandboxError(
            f"init at {self.path} broke the protocol: frame {chr(t)!r} during {self.op}"
        )


class _Conn(_Framed):
    """One connection: frame reads over a StreamReader, with clear errors."""

    __slots__ = ("reader", "writer", "path", "op")

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, op: str
    ) -> None:
        self.reader, self.writer, self.path, self.op = reader, writer, path, op

    async def frame(self) -> tuple[int, bytes]:
        try:
            hdr = await self.reader.readexactly(5)
            n, t = _HDR.unpack(hdr)
            if not 1 <= n <= MAX_FRAME:
                raise SandboxError(f"init at {self.path} sent a bad frame length {n} ({self.op})")
            body = await self.reader.readexactly(n - 1) if n > 1 else b""
        except asyncio.IncompleteReadError:
            raise SandboxError(
                f"init at {self.path} closed the connection before answering {self.op} "
                "(did the sandbox stop?)"
            ) from None
        except ConnectionError as e:
            raise SandboxError(
                f"init at {self.path} dropped the connection ({self.op}): {e}"
            ) from None
        if t == _R:
            raise _error(body, self.op, self.path)
        return t, body

    def send(self, data: bytes) -> None:
        try:
            self.writer.write(data)
        except ConnectionError:
            pass  # the init already answered and closed; its answer is still to be read

    def close(self) -> None:
        self.writer.close()


class _ShortRead:
    """A read of exactly ``n`` bytes whose first ``recv`` came back short: the pieces
    gathered until there are ``n``, whatever does the reads (:meth:`_SockConn._exactly` on
    the loop, :meth:`_SockConn._exactly_blocking` in a reader thread). Only a short read
    gets here; a ``recv`` that returns all ``n`` at once (most frames) costs nothing more.
    An empty piece is the end of the stream: IncompleteReadError, as a StreamReader's
    ``readexactly`` raises."""

    __slots__ = ("n", "parts", "missing")

    def __init__(self, n: int, first: bytes) -> None:
        self.n = n
        self.parts: list[bytes] = []
        self.missing = n
        """Bytes still to read (0: done)."""
        self.add(first)

    def add(self, data: bytes) -> None:
        if not data:
            raise asyncio.IncompleteReadError(b"", self.n)
        self.parts.append(data)
        self.missing -= len(data)

    def joined(self) -> bytes:
        return b"".join(self.parts)


class _SockConn(_Framed):
    """One exec's connection read straight off its non-blocking socket.

    Why not :class:`_Conn`: a StreamReader copies every byte four times on the event loop
    (recv into a bytes, appended to its buffer, sliced out, copied to bytes), ~95 ms of
    loop CPU for a 64 MiB output. Here each payload is ``recv``'d into a bytes object of
    its own size (one copy, by the kernel), and a step of the loop drains at most
    :data:`_STEP_BYTES` before yielding, so a flood of output is many short steps.
    The same frames and the same errors as :class:`_Conn`.

    An exec whose output passes :data:`_THREAD_READ` has the rest of its answer read by a
    worker thread (:meth:`rest_in_thread`, a pool of :data:`_READERS` of its own): blocking
    ``recv`` calls, which let go of the GIL while the kernel copies, and the join there
    too. Even in short steps, reading a
    64 MiB flood on the loop was ~95 ms of its CPU, each step landing between other
    requests' steps; from the thread, the loop's share is one hop. While the thread
    reads, it owns the socket: :meth:`close` only shuts it down (which ends the thread's
    ``recv`` and tells the init the exec is abandoned) and the thread closes it, so no
    ``recv`` can land on a file descriptor number that was closed and reused.
    """

    __slots__ = (
        "sock",
        "path",
        "op",
        "loop",
        "sending",
        "since_yield",
        "lock",
        "in_thread",
        "close_asked",
    )

    def __init__(self, sock: socket.socket, path: str, op: str) -> None:
        self.sock, self.path, self.op = sock, path, op
        self.loop = asyncio.get_running_loop()
        self.sending: asyncio.Task[None] | None = None
        self.since_yield = 0
        self.lock = threading.Lock()
        self.in_thread = False
        self.close_asked = False

    async def _exactly(self, n: int) -> bytes:
        data = await self.loop.sock_recv(self.sock, n)
        if len(data) == n:
            return data
        short = _ShortRead(n, data)
        while short.missing:
            short.add(await self.loop.sock_recv(self.sock, short.missing))
        return short.joined()

    def _length(self, n: int) -> None:
        if not 1 <= n <= MAX_FRAME:
            raise SandboxError(f"init at {self.path} sent a bad frame length {n} ({self.op})")

    def _closed(self) -> SandboxError:
        return SandboxError(
            f"init at {self.path} closed the connection before answering {self.op} "
            "(did the sandbox stop?)"
        )

    def _dropped(self, e: OSError) -> SandboxError:
        return SandboxError(f"init at {self.path} dropped the connection ({self.op}): {e}")

    async def frame(self) -> tuple[int, bytes]:
        try:
            n, t = _HDR.unpack(await self._exactly(5))
            self._length(n)
            body = await self._exactly(n - 1) if n > 1 else b""
        except asyncio.IncompleteReadError:
            raise self._closed() from None
        except ConnectionError as e:
            raise self._dropped(e) from None
        if t == _R:
            raise _error(body, self.op, self.path)
        # sock_recv returns without suspending while data is queued: yield now and then
        self.since_yield += n + 4
        if self.since_yield >= _STEP_BYTES:
            self.since_yield = 0
            await asyncio.sleep(0)
        return t, body

    def send(self, data: bytes) -> None:
        """Send ``data`` without waiting: what the socket does not take at once (big
        stdin) goes in a task beside the reads, as a StreamWriter would buffer it."""
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except ConnectionError:
            return  # the init already answered and closed; its answer is still to be read
        if sent < len(data):
            self.sending = asyncio.create_task(self._send_rest(memoryview(data)[sent:]))

    async def _send_rest(self, rest: memoryview) -> None:
        with contextlib.suppress(ConnectionError):
            await self.loop.sock_sendall(self.sock, rest)

    def can_read_in_thread(self) -> bool:
        """Whether the loop is done with the socket (no stdin still being sent on it) and
        a reader thread is free."""
        return (self.sending is None or self.sending.done()) and _readers_busy < _READERS

    async def rest_in_thread(
        self, out: list[bytes], err: list[bytes], pace: tuple[OutputPace, int] | None
    ) -> tuple[bytes, bytes, bytes]:
        """Read the frames up to the exit in a worker thread, after ``out``/``err`` (what
        came so far), at ``pace`` (the sandbox's budget and rate; None: unpaced); returns
        the exit frame's payload, stdout and stderr, joined."""
        global _readers_busy
        with self.lock:
            self.in_thread = True
        _readers_busy += 1
        fut = self.loop.run_in_executor(_reader_pool, self._read_rest, out, err, pace)
        fut.add_done_callback(_reader_done)  # counted until the thread ends, not the await
        return await fut

    def _read_rest(
        self, out: list[bytes], err: list[bytes], pace: tuple[OutputPace, int] | None
    ) -> tuple[bytes, bytes, bytes]:
        try:
            self.sock.settimeout(_READER_WAKE)
            while True:
                t, body = self._frame_blocking()
                if t == _O or t == _E:
                    (out if t == _O else err).append(body)
                    wait = pace[0].take(len(body), pace[1]) if pace else 0.0
                    if wait:
                        time.sleep(wait)  # the init holds the rest back meanwhile
                elif t == _X:
                    return body, _join_and_free(out), _join_and_free(err)
                elif t != _S:
                    raise self.unexpected(t)
        finally:
            with self.lock:
                self.in_thread = False
                if self.close_asked:
                    self.sock.close()

    def _frame_blocking(self) -> tuple[int, bytes]:
        """:meth:`frame` with blocking reads, in the worker thread."""
        try:
            n, t = _HDR.unpack(self._exactly_blocking(5))
            self._length(n)
            body = self._exactly_blocking(n - 1) if n > 1 else b""
        except asyncio.IncompleteReadError:
            raise self._closed() from None
        except OSError as e:  # reset, or shut down by close() (the exec abandoned)
            raise self._dropped(e) from None
        if t == _R:
            raise _error(body, self.op, self.path)
        return t, body

    def _recv(self, n: int) -> bytes:
        """A blocking ``recv`` that gives up once the loop is gone: a thread blocked for
        good would hold the interpreter's exit (the pool's threads are joined there)."""
        while True:
            try:
                return self.sock.recv(n)
            except TimeoutError:
                if self.close_asked or self.loop.is_closed():
                    raise ConnectionAbortedError("the exec was abandoned") from None

    def _exactly_blocking(self, n: int) -> bytes:
        """:meth:`_exactly` with blocking reads, in the worker thread."""
        data = self._recv(n)
        if len(data) == n:
            return data
        short = _ShortRead(n, data)
        while short.missing:
            short.add(self._recv(short.missing))
        return short.joined()

    def close(self) -> None:
        if self.sending is not None:
            self.sending.cancel()
        with self.lock:
            if self.in_thread:  # the thread closes it; ending its recv is enough here
                self.close_asked = True
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
                return
        self.sock.close()


def _reader_done(_: object) -> None:
    global _readers_busy
    _readers_busy -= 1


async def _joined(parts: list[bytes]) -> bytes:
    """``b"".join(parts)``; for a big output in a worker thread, where the join drops the
    GIL (CPython does for exact bytes past 1 MiB): a 64 MiB join is 30-60 ms of copying
    and page faults that would otherwise be one step of the event loop."""
    if len(parts) == 1:
        return parts[0]
    if sum(map(len, parts)) < _THREAD_JOIN:
        return b"".join(parts)
    return await asyncio.to_thread(_join_and_free, parts)


def _join_and_free(parts: list[bytes]) -> bytes:
    out = b"".join(parts)
    parts.clear()  # the pieces are freed here, not by the loop's thread
    return out


class InitClient:
    """Talks to one sandbox's init over its host-side control socket."""

    def __init__(self, sock_path: str | Path, connect_timeout: float = 5.0) -> None:
        self.path = str(sock_path)
        self.connect_timeout = connect_timeout
        self.pace = OutputPace()
        """How fast this sandbox's output is taken, over all its paced execs and streams
        (those given an ``output_rate``; the node's own, a snapshot's stream, are not)."""
        self.start_timeout = _GUARD
        """Seconds to wait for an exec's `S` frame: the init sends it right after fork, so
        none coming means a stuck or frozen init (the kernel accepts connections on its
        listening socket even then), not a slow command."""

    async def _paced(self, n: int, rate: int | None) -> None:
        """Account ``n`` bytes of output read on the loop at ``rate`` (None: unpaced);
        wait if the sandbox is ahead of it (its init meanwhile stops reading the
        process's pipes)."""
        wait = self.pace.take(n, rate) if rate else 0.0
        if wait:
            await asyncio.sleep(wait)

    async def _connect(self, op: str) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                r, w = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        except (OSError, TimeoutError) as e:
            raise self._connect_error(e) from None
        return _Conn(r, w, self.path, op)

    async def _connect_sock(self, op: str) -> _SockConn:
        """A connection read without a StreamReader (see :class:`_SockConn`)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.setblocking(False)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await asyncio.get_running_loop().sock_connect(s, self.path)
        except (OSError, TimeoutError) as e:
            s.close()
            raise self._connect_error(e) from None
        except BaseException:
            s.close()
            raise
        return _SockConn(s, self.path, op)

    def _connect_error(self, e: OSError | TimeoutError) -> SandboxError:
        """Why connecting to the init's control socket failed, in words."""
        if isinstance(e, FileNotFoundError):
            why = "does not exist (sandbox not running?)"
        elif isinstance(e, ConnectionRefusedError):
            why = "refused the connection (init not running)"
        elif isinstance(e, TimeoutError):
            return SandboxError(
                f"init control socket {self.path}: no connection within "
                f"{self.connect_timeout} s (init stuck?)"
            )
        else:
            return SandboxError(f"init control socket {self.path}: {e}")
        return SandboxError(f"init control socket {self.path} {why}")

    async def _call(
        self, op: str, payload: bytes, guard: float | None = None
    ) -> list[tuple[int, bytes]]:
        """Send one Q and collect frames up to the one that ends the answer."""
        c = await self._connect(op)
        try:
            c.send(_frame(_Q, payload))
            frames: list[tuple[int, bytes]] = []
            async with asyncio.timeout(guard):
                while True:
                    t, body = await c.frame()
                    frames.append((t, body))
                    if t in (_A, _X, _N) or (t == _S and op == "spawn"):
                        return frames
        except TimeoutError:
            raise SandboxError(f"init at {self.path} did not answer {op} in {guard} s") from None
        finally:
            c.close()

    async def ping(self) -> None:
        """Round trip to the init; raises SandboxError when it does not answer.

        Every create waits for one, so it goes over a bare non-blocking socket: no stream
        reader, writer and transport to build for a 10-byte answer (the same frames and
        errors as :meth:`_call`)."""
        loop = asyncio.get_running_loop()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.setblocking(False)
        try:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await loop.sock_connect(s, self.path)
            except (OSError, TimeoutError) as e:
                raise self._connect_error(e) from None
            guard = self.connect_timeout + _GUARD
            try:
                async with asyncio.timeout(guard):
                    await loop.sock_sendall(s, _frame(_Q, _field(OP, "ping")))
                    buf = b""
                    while True:
                        while len(buf) >= 5:
                            n, t = _HDR.unpack_from(buf)
                            if not 1 <= n <= MAX_FRAME:
                                raise SandboxError(
                                    f"init at {self.path} sent a bad frame length {n} (ping)"
                                )
                            if len(buf) < 4 + n:
                                break
                            if t == _R:
                                raise _error(buf[5 : 4 + n], "ping", self.path)
                            if t in (_A, _X, _N):
                                return
                            buf = buf[4 + n :]
                        data = await loop.sock_recv(s, 4096)
                        if not data:
                            raise SandboxError(
                                f"init at {self.path} closed the connection before answering "
                                "ping (did the sandbox stop?)"
                            )
                        buf += data
            except TimeoutError:
                raise SandboxError(
                    f"init at {self.path} did not answer ping in {guard} s"
                ) from None
            except ConnectionError as e:
                raise SandboxError(
                    f"init at {self.path}: connection lost during ping ({e})"
                ) from None
        finally:
            s.close()

    async def exec(
        self,
        argv: Iterable[str],
        *,
        env: Mapping[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        groups: Iterable[int] = (),
        timeout: float | None = None,
        output_limit: int = 1 << 20,
        output_rate: int | None = None,
        stdin: bytes | None = None,
    ) -> InitExit:
        """Run a command to its end and return its exit and (capped) output.

        ``env`` is the complete environment (PATH is searched in it). Without ``stdin``
        the process reads /dev/null.
        """
        payload = _start_payload(
            "exec", argv, env, cwd, uid, gid, groups, timeout, output_limit, stdin is not None
        )
        data = _frame(_Q, payload)
        if stdin is not None:
            # pipelined behind the request: no round trip waiting for S
            data += _stdin_frames(stdin) + _frame(_I)
        c = await self._connect_sock("exec")
        try:
            c.send(data)
            out: list[bytes] = []
            err: list[bytes] = []
            size = pid = 0
            joined: tuple[bytes, bytes] | None = None
            first: tuple[int, bytes] | None = await c.first_frame(self.start_timeout)
            async with asyncio.timeout(None if timeout is None else timeout + _GUARD):
                while True:
                    t, body = first or await c.frame()
                    first = None
                    if t == _O:
                        out.append(body)
                        size += len(body)
                        await self._paced(len(body), output_rate)
                        if size >= _THREAD_READ and c.can_read_in_thread():
                            # a flood of output: the rest is read off the loop
                            pace = (self.pace, output_rate) if output_rate else None
                            body, stdout, stderr = await c.rest_in_thread(out, err, pace)
                            joined = (stdout, stderr)
                            f, _ = _decode(body)
                            break
                    elif t == _E:
                        err.append(body)
                        await self._paced(len(body), output_rate)
                    elif t == _X:
                        f, _ = _decode(body)
                        break
                    elif t == _S:
                        pid = _int(_decode(body)[0], PID) or 0
                    else:
                        raise c.unexpected(t)
        except TimeoutError:
            raise SandboxError(
                f"init at {self.path} reported no exit {_GUARD:.0f} s past the timeout"
            ) from None
        finally:
            c.close()
        if joined is not None:
            return _exit_from(f, joined[0], joined[1], pid)
        return _exit_from(f, await _joined(out), await _joined(err), pid)

    def stream(
        self,
        argv: Iterable[str],
        *,
        env: Mapping[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        groups: Iterable[int] = (),
        timeout: float | None = None,
        output_limit: int = 1 << 20,
        output_rate: int | None = None,
        stdin: bytes | None = None,
        stdin_pipe: bool = False,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
        keep_output: bool = True,
    ) -> ExecStream:
        """An exec whose output arrives as it is written; see :class:`ExecStream`.

        ``keep_output=False``: do not also collect what was yielded (long-lived terminals and
        relayed streams would otherwise grow without bound); ``result`` then has no output.

        ``stdin`` bytes are sent (and stdin closed) right away; with ``stdin_pipe`` the
        caller writes with ``write`` and ends with ``close_stdin``. With ``tty`` the
        process runs on a new pty of ``rows`` x ``cols`` and everything comes as stdout.
        """
        payload = _start_payload(
            "exec",
            argv,
            env,
            cwd,
            uid,
            gid,
            groups,
            timeout,
            output_limit,
            stdin is not None or stdin_pipe,
            tty,
            rows,
            cols,
        )
        data = _frame(_Q, payload)
        if stdin is not None:
            data += _stdin_frames(stdin) + (b"" if stdin_pipe else _frame(_I))
        return ExecStream(self, data, keep_output, output_rate=output_rate)

    async def spawn(
        self,
        argv: Iterable[str],
        *,
        env: Mapping[str, str],
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        groups: Iterable[int] = (),
        output_limit: int = 1 << 20,
        stdin_pipe: bool = False,
    ) -> tuple[str, int]:
        """Start a background process; returns its (id, pid).

        The init keeps the first ``output_limit`` bytes of each stream for ``wait``. With
        ``stdin_pipe`` it is a *session*: its stdin is a pipe that :meth:`attach` writes
        to, and its output goes to the attached client (buffered up to ``output_limit``
        per stream while none is attached).
        """
        payload = _start_payload(
            "spawn", argv, env, cwd, uid, gid, groups, None, output_limit, stdin_pipe
        )
        frames = await self._call("spawn", payload, guard=_GUARD)
        f, _ = _decode(frames[-1][1])
        return f.get(ID, b"").decode(), _int(f, PID) or 0

    def attach(self, proc_id: str, output_rate: int | None = None) -> ExecStream:
        """Attach to a session (a spawn with ``stdin_pipe``): an :class:`ExecStream` that
        yields first what the session wrote while no client was attached, then its live
        output; ``write`` feeds its stdin and ``signal`` its process group. Leaving the
        block only detaches (the session keeps running); a later attach (after a node
        restart, say) takes over, and the earlier client's iteration ends with an error.
        Raises ProcessNotFound (on entering) for an unknown id. ``output_rate``: as for
        :meth:`exec` (a shell session's commands print through it)."""
        request = _frame(_Q, _field(OP, "attach") + _field(ID, proc_id))
        return ExecStream(self, request, keep_output=False, op="attach", output_rate=output_rate)

    async def wait(self, proc_id: str, timeout: float | None = 0) -> InitProc:
        """State and buffered output of a background process.

        Waits up to ``timeout`` seconds for it to end (0: do not wait, None: forever).
        Raises ProcessNotFound for an unknown id.
        """
        payload = _field(OP, "wait") + _field(ID, proc_id)
        guard = None
        if timeout is not None:
            ms = 0 if timeout <= 0 else _ms(timeout, "timeout")
            payload += _field(WAIT_MS, ms)
            guard = timeout + _GUARD
        frames = await self._call("wait", payload, guard=guard)
        if not frames or frames[0][0] != _P:
            raise SandboxError(f"init at {self.path} answered wait without a process entry")
        entry, args = _decode(frames[0][1])
        out = b"".join(b for t, b in frames if t == _O)
        err = b"".join(b for t, b in frames if t == _E)
        t, body = frames[-1]
        return _proc_from(entry, args, out, err, _decode(body)[0] if t == _X else None)

    async def kill(self, proc_id: str, sig: int = 9) -> None:
        """Send ``sig`` to the process group of a background process."""
        payload = _field(OP, "kill") + _field(ID, proc_id) + _field(SIGNAL, sig)
        await self._call("kill", payload, guard=_GUARD)

    async def list(self) -> list[InitProc]:
        """Every background process the init knows (without their output)."""
        frames = await self._call("list", _field(OP, "list"), guard=_GUARD)
        procs = []
        for t, body in frames:
            if t == _P:
                entry, args = _decode(body)
                procs.append(_proc_from(entry, args, b"", b"", None))
        return procs

    async def forget(self, proc_id: str) -> None:
        """Drop a background process and its buffers (killing it if it still runs)."""
        await self._call("forget", _field(OP, "forget") + _field(ID, proc_id), guard=_GUARD)


class ExecStream:
    """A running exec: ``async with`` it, iterate its output, then read ``result``.

    ::

        async with client.stream(["cat"], env=env, stdin_pipe=True) as s:
            await s.write(b"hi")
            await s.close_stdin()
            async for name, data in s:   # name is "stdout" or "stderr"
                ...
        s.result.code

    Leaving the block before the end closes the connection, and the init kills the
    process group. ``result.stdout``/``stderr`` hold everything that was yielded.
    """

    def __init__(
        self,
        client: InitClient,
        request: bytes,
        keep_output: bool = True,
        op: str = "exec",
        output_rate: int | None = None,
    ) -> None:
        self._client = client
        self._rate = output_rate
        self._op = op
        self._request = request
        self._keep = keep_output
        self._conn: _Conn | None = None
        self._out: list[bytes] = []
        self._err: list[bytes] = []
        self._result: InitExit | None = None
        self.pid = 0
        """The pid of the process inside the sandbox, known once the block is entered."""

    async def __aenter__(self) -> ExecStream:
        c = await self._client._connect(self._op)
        self._conn = c
        try:
            c.send(self._request)
            t, body = await c.first_frame(self._client.start_timeout)
            # attach to a session that already ended: its entry, output and exit follow
            if t != _S and not (t == _P and self._op == "attach"):
                raise c.unexpected(t)
            self.pid = _int(_decode(body)[0], PID) or 0
        except BaseException:
            c.close()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._conn is not None:
            self._conn.close()

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[tuple[str, bytes]]:
        c = self._live()
        while self._result is None:
            t, body = await c.frame()
            if t == _O or t == _E:
                await self._client._paced(len(body), self._rate)
                if self._keep:
                    (self._out if t == _O else self._err).append(body)
                yield "stdout" if t == _O else "stderr", body
            elif t == _X:
                f, _ = _decode(body)
                self._result = _exit_from(f, b"".join(self._out), b"".join(self._err), self.pid)
            else:
                raise c.unexpected(t)

    async def wait(self) -> InitExit:
        """Read (and keep) the rest of the output; return the exit."""
        async for _ in self:
            pass
        return self.result

    @property
    def result(self) -> InitExit:
        """How the process ended; available once the iteration has finished."""
        if self._result is None:
            raise SandboxError("the exec has not ended yet: iterate the stream to its end")
        return self._result

    def _live(self) -> _Conn:
        if self._conn is None:
            raise SandboxError("use the exec stream inside `async with`")
        return self._conn

    async def _send(self, data: bytes) -> None:
        c = self._live()
        c.send(data)
        try:
            await c.writer.drain()
        except ConnectionError:
            pass  # the process ended and the init closed; the iteration reports how

    async def write(self, data: bytes) -> None:
        """Send bytes to the process's stdin (needs stdin_pipe=True)."""
        if data:
            await self._send(_stdin_frames(data))

    async def close_stdin(self) -> None:
        """End of input (with a tty: the EOF character, in canonical mode)."""
        await self._send(_frame(_I))

    async def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group."""
        await self._send(_frame(_K, _field(SIGNAL, sig)))

    async def resize(self, rows: int, cols: int) -> None:
        """Set the tty's window size (the process gets SIGWINCH)."""
        await self._send(_frame(_W, _field(ROWS, rows) + _field(COLS, cols)))
