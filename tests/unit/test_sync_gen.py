"""The blocking SDK is generated, current, and typed.

- ``_sync_gen.py`` is what ``_gen_sync`` writes now: adding an async method without
  ``make gen`` fails here.
- Every public member of every async handle has its blocking twin, and no blocking class
  falls back to a ``__getattr__`` proxy (which would make it ``Any`` to mypy).
- mypy sees real types through ``corral.Client``.
- The generator's mappings that today's SDK does not use (async iterators, async context
  managers, ``@asynccontextmanager``, ``Self``, handles as parameters, ``X | None``) work,
  run against small async classes of a throwaway package; shapes it cannot mirror fail
  with a message naming the member.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
import corral.sdk._sync_gen as sync_gen
from corral.sdk._gen_sync import DUNDERS, OUTPUT, GenError, _Generator, render
from corral.testing import FakeNode


def test_checked_in_file_is_what_the_generator_writes() -> None:
    assert OUTPUT.read_text() == render(), (
        "src/corral/sdk/_sync_gen.py is stale: an async handle changed; run `make gen`"
    )


def test_every_async_member_has_a_blocking_twin() -> None:
    gen = _Generator()
    gen.discover()
    assert gen.handles[corral.AsyncClient] == "Client"
    assert gen.handles[corral.Sandbox] == "BlockingSandbox"
    assert set(gen.handles.values()) == set(sync_gen.__all__)
    for async_cls, name in gen.handles.items():
        blocking = getattr(sync_gen, name)
        for member in gen.source.members(async_cls):
            twin = DUNDERS.get(member.name, member.name)
            assert twin in vars(blocking), f"{name} lacks {twin} ({async_cls.__name__})"
        # a proxy would hide every type from mypy and IDEs
        for klass in blocking.__mro__:
            assert "__getattr__" not in vars(klass), klass


def test_client_is_the_generated_class_and_handles_share_its_portal() -> None:
    assert corral.Client is sync_gen.Client
    with corral.Client(ops=FakeNode()) as c:
        sb = c.sandboxes.create(image="demo/python")
        assert isinstance(sb, sync_gen.BlockingSandbox)
        assert isinstance(sb.files, sync_gen.BlockingFiles)
        assert sb._portal is c._portal and sb.files._portal is c._portal
        assert repr(sb).startswith("<blocking Sandbox(id=")
        with sb as same:
            assert same is sb
    assert c._portal.closed


def test_mypy_sees_real_types(tmp_path: Path) -> None:
    src = Path(corral.__file__).parents[1]
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        textwrap.dedent(
            """
            import corral

            with corral.Client() as c:
                sb = c.sandboxes.create(image="demo/python")
                reveal_type(sb)
                reveal_type(sb.exec("true").stdout)
                with sb.exec_stream("true") as stream:
                    for chunk in stream:
                        reveal_type(chunk)
                wrong: int = sb.files.read("/etc/hostname")
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", str(snippet)],
        capture_output=True,
        text=True,
        cwd=src.parent,  # the repository's mypy cache, warm after `make lint`
        env={"MYPYPATH": str(src), "PATH": "/usr/bin:/bin"},
    )
    out = done.stdout
    assert 'Revealed type is "corral.sdk._sync_gen.BlockingSandbox"' in out, out
    assert 'Revealed type is "builtins.bytes"' in out, out
    assert 'Revealed type is "corral.spec.ExecChunk"' in out, out
    # an Any-typed client would let this through
    assert 'expression has type "bytes", variable has type "int"' in out, out


# ------------------------------------------------------------------ the generator itself
DEMO = '''
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Literal, Self


class Root:
    """A root handle."""

    def __init__(self, prefix: str = "it") -> None:
        self.prefix: str = prefix
        self.log: list[str] = []

    async def item(self, name: str) -> Item:
        """One item; ``await root.item("a")``."""
        return Item(self, name)

    async def maybe(self, name: str | None = None) -> Item | None:
        return None if name is None else Item(self, name)

    async def kind(self) -> Literal["a", "b"]:
        return "a"

    async def quoted(self, name: str) -> "list[Item]":
        return [Item(self, name)]

    async def items(self, *names: str) -> list[Item]:
        return [Item(self, n) for n in names]

    async def count(self, n: int) -> AsyncIterator[int]:
        try:
            for i in range(n):
                yield i
        finally:
            self.log.append(f"count closed")

    def stream(self, n: int) -> AsyncIterator[Item]:
        return self._gen(n)

    async def _gen(self, n: int) -> AsyncIterator[Item]:
        for i in range(n):
            yield Item(self, f"{self.prefix}{i}")

    @contextlib.asynccontextmanager
    async def opened(self, name: str) -> AsyncIterator[Item]:
        self.log.append("open")
        yield Item(self, name)
        self.log.append("close")

    async def name_of(self, item: Item, other: Item | None = None) -> str:
        return item.name + (other.name if other else "")

    async def close(self) -> None:
        self.log.append("closed")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Item:
    """An item: iterating it gives its letters."""

    def __init__(self, root: Root, name: str) -> None:
        self._root = root
        self.name: str = name
        self._left = list(name)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> str:
        if not self._left:
            raise StopAsyncIteration
        return self._left.pop(0)
'''


@pytest.fixture
def demo_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    pkg = tmp_path / "syncgen_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "api.py").write_text(DEMO)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m.startswith("syncgen_demo")]:
        del sys.modules[name]


def test_generated_iterators_context_managers_and_parameters(demo_package: Path) -> None:
    (demo_package / "blocking.py").write_text(render(("syncgen_demo.api", "Root"), "Blocking"))
    blocking = importlib.import_module("syncgen_demo.blocking")
    assert "__getattr__" not in vars(blocking.BlockingItem)
    doc = inspect.getdoc(blocking.Blocking.item) or ""
    assert "await" not in doc and 'root.item("a")' in doc  # docstrings read as blocking code

    with blocking.Blocking("x") as root:
        async_root = root._obj
        item = root.item("ab")
        assert isinstance(item, blocking.BlockingItem) and item.name == "ab"
        assert list(item) == ["a", "b"]  # __aiter__/__anext__ -> __iter__/__next__
        assert root.maybe() is None and root.maybe("c").name == "c"
        assert [i.name for i in root.items("d", "e")] == ["d", "e"]
        assert root.kind() == "a"
        assert isinstance(root.quoted("q")[0], blocking.BlockingItem)
        assert list(root.count(3)) == [0, 1, 2]
        assert [i.name for i in root.stream(2)] == ["x0", "x1"]
        for i in root.count(5):
            break  # leaving early closes the async generator at once
        assert async_root.log[-1] == "count closed"
        with root.opened("f") as f:
            assert isinstance(f, blocking.BlockingItem) and f.name == "f"
            assert async_root.log[-1] == "open"
        assert async_root.log[-1] == "close"
        assert root.name_of(item) == "ab" and root.name_of(item, f) == "abf"
        assert root.prefix == "x"
    assert async_root.log[-1] == "closed"
    with pytest.raises(RuntimeError, match="closed"):
        root.item("g")
    root.close()  # closing twice is a no-op


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "class Root:\n    @classmethod\n    async def make(cls) -> Root: ...\n",
            "Root.make: a public classmethod has no blocking twin",
        ),
        ("class Root:\n    async def get(self):\n        ...\n", "Root.get: annotate its return"),
        (
            "class Root:\n    async def get(self, x) -> int: ...\n",
            "syncgen_demo.bad.Root.get: annotate the parameter 'x'",
        ),
        (
            "class Item:\n    async def touch(self) -> None: ...\n\n"
            "class Root:\n    async def pair(self) -> tuple[Item, Item]: ...\n",
            "syncgen_demo.bad.Root.pair: handles inside tuple[Item, Item] are not mapped",
        ),
        (
            "class Root:\n    async def clone(self) -> Root: ...\n",
            "Root.clone: returns a Blocking other than itself",
        ),
        (
            "class Root:\n    def __init__(self) -> None:\n        self.x = 1 + 1\n"
            "    async def close(self) -> None: ...\n",
            "Root.x: annotate this public attribute",
        ),
    ],
)
def test_shapes_it_cannot_mirror_are_refused(demo_package: Path, source: str, message: str) -> None:
    (demo_package / "bad.py").write_text("from __future__ import annotations\n\n" + source)
    with pytest.raises(GenError, match=re.escape(message)):
        _Generator(("syncgen_demo.bad", "Root"), "Blocking").render()
