"""NodePty: the embedded node's terminal over an agent stream, with a fake stream."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from types import TracebackType

import pytest

from corral.node.pty import NodePty
from corral.ops import PtyStream
from corral.spec import ExecResult


@dataclass
class _Exit:
    """A backend's own exit record (the init's InitExit has these and more)."""

    reason: str
    code: int | None
    signal: int | None = None


@dataclass
class _FakeStream:
    """An agent stream that replays ``frames`` and records what it was sent."""

    frames: list[tuple[str, bytes]]
    end: _Exit
    fail_enter: bool = False
    pid: int = 0
    sent: list[object] = field(default_factory=list)
    entered: bool = False
    exited: bool = False
    _result: _Exit | None = None

    async def __aenter__(self) -> _FakeStream:
        if self.fail_enter:
            raise ConnectionError("the init is gone")
        self.entered, self.pid = True, 42
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.exited = True

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[tuple[str, bytes]]:
        for f in self.frames:
            yield f
        self._result = self.end

    @property
    def result(self) -> _Exit:
        assert self._result is not None, "read before the end"
        return self._result

    async def write(self, data: bytes) -> None:
        self.sent.append(data)

    async def close_stdin(self) -> None:
        self.sent.append("eof")

    async def signal(self, sig: int) -> None:
        self.sent.append(("signal", sig))

    async def resize(self, rows: int, cols: int) -> None:
        self.sent.append(("resize", rows, cols))


class _Busy:
    """Counts how often the busy mark is held, as the node's table would."""

    def __init__(self) -> None:
        self.held = 0
        self.log: list[str] = []

    @contextlib.contextmanager
    def mark(self) -> Iterator[None]:
        self.held += 1
        self.log.append("enter")
        try:
            yield
        finally:
            self.held -= 1
            self.log.append("exit")


def _to_result(x: _Exit) -> ExecResult:
    return ExecResult(exit_code=x.code, signal=x.signal, reason=x.reason)  # type: ignore[arg-type]


async def test_bytes_out_exit_converted_busy_held() -> None:
    stream = _FakeStream(
        [("stdout", b"$ "), ("stderr", b"oops"), ("stdout", b"bye")], _Exit("exited", 3)
    )
    busy = _Busy()
    pty: PtyStream = NodePty(stream, busy.mark(), _to_result, cmd=["/bin/sh"])
    assert pty.pid == 0 and pty.cmd == ["/bin/sh"] and pty.result is None
    async with pty as s:
        assert busy.held == 1 and s.pid == 42
        await s.write(b"exit 3\r")
        await s.resize(50, 132)
        await s.signal(2)
        await s.close_stdin()
        got = [data async for data in s]
        assert s.result == ExecResult(exit_code=3, reason="exited")
    assert got == [b"$ ", b"oops", b"bye"]  # a tty merges the streams: bytes only
    assert stream.sent == [b"exit 3\r", ("resize", 50, 132), ("signal", 2), "eof"]
    assert busy.held == 0 and stream.exited
    assert [d async for d in pty] == []  # iterating again after the end yields nothing


async def test_leaving_early_releases_the_mark_and_leaves_no_result() -> None:
    stream = _FakeStream([("stdout", b"a"), ("stdout", b"b")], _Exit("signaled", None, 9))
    busy = _Busy()
    async with NodePty(stream, busy.mark(), _to_result) as s:
        async for _ in s:
            break
    assert busy.log == ["enter", "exit"] and stream.exited and s.result is None


async def test_a_failed_start_releases_the_mark() -> None:
    stream = _FakeStream([], _Exit("exited", 0), fail_enter=True)
    busy = _Busy()
    with pytest.raises(ConnectionError):
        async with NodePty(stream, busy.mark(), _to_result):
            pass
    assert busy.log == ["enter", "exit"] and not stream.exited
