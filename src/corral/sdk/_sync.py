"""``Client``: the blocking SDK, generated from the async one at run time.

A ``_Portal`` runs a private event loop in a background thread. ``_Blocking`` wraps any
async handle: coroutine methods become blocking calls, ``async with`` becomes ``with``,
``async for`` becomes ``for``, and handles returned by a call are wrapped in turn. There
is no second implementation to keep in step; the async code is the only code.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from corral.ops import NodeOps
from corral.sdk._client import AsyncClient, Images, Sandboxes
from corral.sdk._fncall import FnCall
from corral.sdk._network import Network
from corral.sdk._sandbox import ExecStream, Files, Process, Sandbox, Shell

if TYPE_CHECKING:
    from corral.node import NodeConfig

__all__ = ["Client"]

T = TypeVar("T")

# Types whose instances are wrapped rather than returned as they are (models, bytes and
# other plain values pass through unchanged).
_HANDLES = (
    AsyncClient,
    Images,
    Sandboxes,
    Sandbox,
    ExecStream,
    Process,
    Shell,
    Files,
    Network,
    FnCall,
)


class _Portal:
    """An event loop on a daemon thread, and a way to run coroutines on it and wait."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="corral-sync-client", daemon=True
        )
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking corral call was made from inside its own event loop")
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this corral Client is closed")
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            # e.g. KeyboardInterrupt while blocked: do not leave the call running behind
            fut.cancel()
            raise

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._loop.shutdown_asyncgens(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class _Blocking:
    """Blocking view of one async handle."""

    __slots__ = ("_obj", "_portal")

    def __init__(self, obj: Any, portal: _Portal) -> None:
        self._obj = obj
        self._portal = portal

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, _HANDLES):
            return _Blocking(value, self._portal)
        if isinstance(value, list) and any(isinstance(v, _HANDLES) for v in value):
            return [self._wrap(v) for v in value]
        return value

    def __getattr__(self, name: str) -> Any:
        if name in _Blocking.__slots__:
            raise AttributeError(name)  # half-built proxy: do not recurse
        attr = getattr(self._obj, name)
        if inspect.iscoroutinefunction(attr):

            @functools.wraps(attr)
            def blocking(*args: Any, **kwargs: Any) -> Any:
                return self._wrap(self._portal.call(attr(*args, **kwargs)))

            return blocking
        if inspect.ismethod(attr):

            @functools.wraps(attr)
            def plain(*args: Any, **kwargs: Any) -> Any:
                return self._wrap(attr(*args, **kwargs))

            return plain
        return self._wrap(attr)

    def __dir__(self) -> list[str]:
        return dir(self._obj)

    def __repr__(self) -> str:
        return f"<blocking {self._obj!r}>"

    def __enter__(self) -> Any:
        enter = getattr(self._obj, "__aenter__", None)
        if enter is None:
            raise TypeError(f"{type(self._obj).__name__} is not a context manager")
        value = self._portal.call(enter())
        return self if value is self._obj else self._wrap(value)

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return self._portal.call(self._obj.__aexit__(et, ev, tb))  # type: ignore[no-any-return]

    def __iter__(self) -> _Blocking:
        if not hasattr(self._obj, "__anext__"):
            raise TypeError(f"{type(self._obj).__name__} is not iterable")
        return self

    def __next__(self) -> Any:
        try:
            return self._wrap(self._portal.call(self._obj.__anext__()))
        except StopAsyncIteration:
            raise StopIteration from None


class Client(_Blocking):
    """Blocking client; the same API as ``AsyncClient`` without ``await``.

    Example:
        >>> with corral.Client() as client:                                    # doctest: +SKIP
        ...     sb = client.sandboxes.create(image="demo/python")
        ...     print(sb.exec("echo hi").stdout)
        ...     with sb.shell() as sh:
        ...         sh.run("cd /work && export X=1")
        ...     sb.destroy()
    """

    __slots__ = ()

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        config: NodeConfig | None = None,
        ops: NodeOps | None = None,
        own_ops: bool = False,
    ) -> None:
        client = AsyncClient(target, token=token, config=config, ops=ops, own_ops=own_ops)
        super().__init__(client, _Portal())

    def close(self) -> None:
        """Close the underlying client, then stop the background loop."""
        if self._portal.closed:
            return
        try:
            self._portal.call(self._obj.close())
        finally:
            self._portal.stop()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
