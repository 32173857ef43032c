"""The embedded node's terminal: an init exec stream seen as a :class:`corral.ops.PtyStream`.

The init's stream yields ``(stream_name, data)`` pairs and ends with the backend's own exit
record; the operations interface promises bytes and an :class:`~corral.spec.ExecResult`.
:class:`NodePty` converts both, and holds the sandbox's busy mark while the terminal is
open, so the idle reaper never takes a sandbox from under a user typing in it.

The conversion of the exit is passed in (``to_result``) because only the node knows how to
read it (e.g. whether the sandbox's OOM counter rose while the command ran).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from corral.spec import ExecResult

__all__ = ["NodePty", "AgentStream"]

X = TypeVar("X")
X_co = TypeVar("X_co", covariant=True)


class AgentStream(Protocol[X_co]):
    """What NodePty needs of the agent's stream (the init's ``ExecStream`` has it)."""

    pid: int

    async def __aenter__(self) -> object: ...
    async def __aexit__(
        self,
        et: type[BaseException] | None,
        e: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]: ...
    @property
    def result(self) -> X_co: ...
    async def write(self, data: bytes) -> None: ...
    async def close_stdin(self) -> None: ...
    async def signal(self, sig: int) -> None: ...
    async def resize(self, rows: int, cols: int) -> None: ...


class NodePty(Generic[X]):
    """A :class:`corral.ops.PtyStream` over an agent stream, holding a busy mark.

    Example (the node)::

        stream = backend.agent(sid).stream(cmd, tty=True, ...)
        return NodePty(stream, table.busy(sid), lambda r: self._to_result(sid, r, oom0), cmd=cmd)
    """

    def __init__(
        self,
        stream: AgentStream[X],
        busy: contextlib.AbstractContextManager[None],
        to_result: Callable[[X], ExecResult],
        *,
        cmd: Sequence[str] = (),
    ) -> None:
        self._stream = stream
        self._busy = busy
        self._to_result = to_result
        self._cmd = list(cmd)
        self._result: ExecResult | None = None
        self._entered = False

    @property
    def pid(self) -> int:
        return self._stream.pid if self._entered else 0

    @property
    def cmd(self) -> list[str]:
        return list(self._cmd)

    @property
    def result(self) -> ExecResult | None:
        return self._result

    async def __aenter__(self) -> NodePty[X]:
        self._busy.__enter__()
        try:
            await self._stream.__aenter__()
        except BaseException:
            self._busy.__exit__(None, None, None)
            raise
        self._entered = True
        return self

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        e: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._stream.__aexit__(et, e, tb)
        finally:
            self._busy.__exit__(None, None, None)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[bytes]:
        if self._result is not None:
            return
        async for _name, data in self._stream:  # a tty merges stderr into stdout
            yield data
        self._result = self._to_result(self._stream.result)

    async def write(self, data: bytes) -> None:
        await self._stream.write(data)

    async def resize(self, rows: int, cols: int) -> None:
        await self._stream.resize(rows, cols)

    async def close_stdin(self) -> None:
        await self._stream.close_stdin()

    async def signal(self, sig: int) -> None:
        await self._stream.signal(sig)


if TYPE_CHECKING:  # mypy checks that the init's stream and NodePty fit the protocols
    from corral.backends.initclient import ExecStream, InitExit
    from corral.ops import PtyStream

    def _agent_stream(s: ExecStream) -> AgentStream[InitExit]:
        return s

    def _pty_stream(p: NodePty[InitExit]) -> PtyStream:
        return p
