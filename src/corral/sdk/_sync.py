"""Run-time pieces of the blocking SDK; the classes themselves are generated.

``corral.Client`` and its handles live in ``_sync_gen.py``, written by ``_gen_sync.py``
from the async handles (``make gen``). Each generated method only forwards: it calls the
async method, runs the coroutine on a ``_Portal`` and wraps any async handle it returns in
its blocking class. This module holds what those methods share:

- ``_Portal``: one private event loop on a daemon thread per ``Client``; every blocking
  call of the client and of the handles it returned runs there, so async state (HTTP
  connection pools, the embedded node, locks) stays on the one loop it was made on.
- ``_Handle``: the base of every blocking class (the async object and the portal).
- ``_Portal.iterate`` / ``_Portal.context``: ``async for`` and ``async with`` turned into
  ``for`` and ``with``.

There is no second implementation to keep in step: logic lives once, in the async code.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterable, Callable, Coroutine, Iterator
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Generic, TypeVar

__all__ = ["_Handle", "_Portal", "_same"]

T = TypeVar("T")
U = TypeVar("U")


def _same(value: T) -> T:
    """The identity conversion, for items that need no blocking wrapper."""
    return value


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

    def iterate(self, items: AsyncIterable[T], convert: Callable[[T], U]) -> Iterator[U]:
        """``for`` over an async iterable; each item passes through ``convert``. Leaving
        the loop (early or at the end) closes the async iterator on the portal at once, so
        its cleanup does not wait for the loop's garbage collection of it."""
        it = aiter(items)

        async def step() -> T:
            return await anext(it)

        try:
            while True:
                try:
                    item = self.call(step())
                except StopAsyncIteration:
                    return
                yield convert(item)
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None and not self.closed:
                self.call(aclose())

    def context(
        self, manager: AbstractAsyncContextManager[T], convert: Callable[[T], U]
    ) -> _Context[T, U]:
        """``with`` over an async context manager; what it yields passes through ``convert``."""
        return _Context(self, manager, convert)

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._loop.shutdown_asyncgens(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class _Context(Generic[T, U]):
    """A blocking context manager over an async one (see ``_Portal.context``)."""

    __slots__ = ("_portal", "_manager", "_convert")

    def __init__(
        self, portal: _Portal, manager: AbstractAsyncContextManager[T], convert: Callable[[T], U]
    ) -> None:
        self._portal, self._manager, self._convert = portal, manager, convert

    def __enter__(self) -> U:
        async def enter() -> T:
            return await self._manager.__aenter__()

        return self._convert(self._portal.call(enter()))

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        async def exit_() -> bool | None:
            return await self._manager.__aexit__(et, ev, tb)

        return self._portal.call(exit_())


class _Handle:
    """Base of the generated blocking classes: the async object and the portal it runs on.

    Built by the client and the handles it returns, never by hand: a blocking handle
    must share its client's portal, or its calls would run on a loop its connections do
    not belong to. Each generated class narrows ``_obj`` to its async class, so mypy
    checks every forwarding call against the async signature.
    """

    __slots__ = ("_obj", "_portal")

    _obj: Any

    def __init__(self, obj: Any, portal: _Portal) -> None:
        self._obj = obj
        self._portal = portal

    def __repr__(self) -> str:
        return f"<blocking {self._obj!r}>"
