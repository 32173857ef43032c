"""Write ``_sync_gen.py``, the blocking SDK, from the async handles.

Run ``python -m corral.sdk._gen_sync`` (or ``make gen``) after changing a public method of
an async handle; ``tests/unit/test_sync_gen.py`` fails while the checked-in file is stale
(``--check`` does the same comparison from the shell).

What counts as a handle: starting at ``AsyncClient``, every class of corral named in a
return annotation, a property or a public attribute that has async methods (or
``__aenter__``/``__aiter__``/``__anext__``). Each gets one blocking class (``AsyncClient``
-> ``Client``, ``Sandbox`` -> ``BlockingSandbox``) with, for every public member:

- the same parameters, defaults and docstring (``await`` and ``async`` dropped), read from
  the source with ``ast`` so annotations stay as written;
- the return annotation mapped: a handle becomes its blocking class (also inside
  ``list[...]`` and ``... | None``), ``AsyncIterator[T]`` becomes ``Iterator[T]``,
  ``AbstractAsyncContextManager[T]`` (and ``@asynccontextmanager``) becomes
  ``AbstractContextManager[T]``; ``__aenter__``/``__aexit__``/``__aiter__``/``__anext__``
  become their blocking dunders;
- a body that only forwards: call the async method, run a coroutine on the portal, wrap
  the result. Logic lives once, in the async code.

A shape it cannot mirror faithfully (an unannotated method, a public classmethod, a tuple
of handles) raises ``GenError`` naming the member, so the blocking API never silently
degrades to ``Any``. The output goes through ``ruff`` (import sort, format) so it passes
``make lint`` as written. Reading the async source is ``_gen_sync_source.py``.

At run time the generated module imports only ``AsyncClient`` and ``_sync``'s helpers
(every other name is for mypy, under ``TYPE_CHECKING``), so a stale file never breaks
``import corral``, and with it this generator, after an async handle is renamed.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from corral.sdk._gen_sync_source import (
    DUNDERS,
    LITERALS,
    SELF,
    GenError,
    Member,
    Module,
    Source,
    lookup,
    returns_self,
)

__all__ = ["GenError", "OUTPUT", "render", "main"]

OUTPUT = Path(__file__).with_name("_sync_gen.py")
ROOT = ("corral.sdk._client", "AsyncClient")
ROOT_SYNC_NAME = "Client"

ASYNC_ITER = {
    f"{m}.{n}"
    for m in ("typing", "collections.abc")
    for n in ("AsyncIterator", "AsyncIterable", "AsyncGenerator")
}
ASYNC_CM = {"typing.AsyncContextManager", "contextlib.AbstractAsyncContextManager"}
AWAITABLE = {f"{m}.{n}" for m in ("typing", "collections.abc") for n in ("Awaitable", "Coroutine")}
LISTS = {"builtins.list", "typing.List", "typing.Sequence", "collections.abc.Sequence"}
# On the root, these end the client: the portal's loop stops once they return.
CLOSERS = ("close", "__aexit__")

# A conversion turns an expression of the async value into one of the blocking value;
# ``depth`` keeps the names of nested comprehension/lambda variables apart. None: as is.
Conv = Callable[[str, int], str] | None


def _sync_name(cls: type) -> str:
    name = cls.__name__
    return name.removeprefix("Async") if name.startswith("Async") else f"Blocking{name}"


def _doc(text: str | None, indent: str, head: str = "") -> str:
    """A docstring, read as blocking code: ``await`` and ``async`` dropped."""
    if not text and not head:
        return ""
    text = re.sub(r"\basync (with|for)\b", r"\1", re.sub(r"\bawait ", "", text or ""))
    text = text.replace("corral.AsyncClient(", "corral.Client(")
    if head:
        text = f"{head}\n\n{text}" if text else head
    text = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    lines = [(indent + line) if line.strip() else "" for line in text.splitlines()]
    lines[0] = lines[0].lstrip()
    end = f"\n{indent}" if len(lines) > 1 else ""
    return f'{indent}"""{chr(10).join(lines)}{end}"""\n'


class _Generator:
    """Renders one blocking class for each handle that ``Source`` finds."""

    def __init__(self, root: tuple[str, str] = ROOT, root_name: str = ROOT_SYNC_NAME) -> None:
        self.root: type = getattr(importlib.import_module(root[0]), root[1])
        self.root_name = root_name
        self.source = Source(self.root)
        self.package = self.source.package
        self.handles: dict[type, str] = {}  # async class -> blocking class name
        self.typing_imports: dict[str, tuple[str, str | None]] = {}
        self.runtime_imports: dict[str, tuple[str, str | None]] = {}
        self.helpers: set[str] = {"_Handle"}

    def discover(self) -> None:
        """Name the blocking class of every handle (``AsyncX`` -> ``X``, else ``BlockingX``)."""
        for cls in self.source.handles():
            name = self.root_name if cls is self.root else _sync_name(cls)
            if name in self.handles.values():
                raise GenError(f"two handles map to the blocking name {name}: rename one")
            self.handles[cls] = name

    # ------------------------------------------------------------------ names
    def use(self, node: ast.expr, mod: Module, runtime: bool = False) -> str:
        """Source text of a name of ``mod``, imported into the generated module."""
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name):
            raise GenError(f"cannot import {ast.unparse(node)!r}")
        self.import_name(root.id, mod.source_of(root.id), runtime)
        return ast.unparse(node)

    def import_name(self, local: str, source: tuple[str, str | None], runtime: bool) -> None:
        if source == ("builtins", local):
            return
        if local in self.handles.values() or local in self.helpers:
            raise GenError(f"the name {local!r} of {source[0]} clashes with a generated name")
        for table in (self.typing_imports, self.runtime_imports):
            if table.get(local, source) != source:
                raise GenError(
                    f"the name {local!r} means both {table[local]} and {source}: "
                    "import one of them under another name in the async module"
                )
        (self.runtime_imports if runtime else self.typing_imports)[local] = source

    def names_in(self, node: ast.expr, mod: Module) -> str:
        """Source text of a default value, as written (``0o644``, not ``420``); the names
        it uses are imported at run time."""
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                self.import_name(sub.id, mod.source_of(sub.id), runtime=True)
        return ast.get_source_segment(mod.source, node) or ast.unparse(node)

    # ------------------------------------------------------------------ annotations
    def ann(self, node: ast.expr, mod: Module, own: type, param: bool = False) -> tuple[str, Conv]:
        """The blocking annotation of an async one, and how to convert a value of it.

        ``param``: a parameter's annotation, whose handles are unwrapped (``x._obj``)
        rather than wrapped; async iterators and context managers given as arguments
        pass as they are.
        """
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):  # a quoted annotation
                return self.ann(ast.parse(node.value, mode="eval").body, mod, own, param)
            return ast.unparse(node), None
        if isinstance(node, (ast.Name, ast.Attribute)):
            full = mod.fullname(node)
            obj = own if full in SELF else lookup(full or "", self.package, load=False)
            if isinstance(obj, type) and obj in self.handles:
                name = self.handles[obj]
                if obj is self.root and not param:
                    raise GenError(
                        f"returns a {name} other than itself: its blocking class owns the "
                        "portal and cannot wrap another"
                    )
                if param:
                    return name, lambda v, d: f"{v}._obj"
                return name, lambda v, d: f"{name}({v}, self._portal)"
            if full in SELF:
                raise GenError("Self outside a handle class")
            return self.use(node, mod), None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.union(_flatten_union(node), mod, own, param)
        if isinstance(node, ast.List):  # Callable[[A, B], R]
            parts = [self.ann(e, mod, own, param) for e in node.elts]
            if any(c for _, c in parts):
                raise GenError(f"handles inside {ast.unparse(node)} are not mapped")
            return "[" + ", ".join(t for t, _ in parts) + "]", None
        if isinstance(node, ast.Subscript):
            return self.subscript(node, mod, own, param)
        raise GenError(f"cannot map the annotation {ast.unparse(node)!r}")

    def subscript(
        self, node: ast.Subscript, mod: Module, own: type, param: bool
    ) -> tuple[str, Conv]:
        base = mod.fullname(node.value) or ""
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base == "typing.Optional":
            return self.union([args[0], ast.Constant(None)], mod, own, param)
        if base == "typing.Union":
            return self.union(args, mod, own, param)
        if base in LITERALS:
            return f"{self.use(node.value, mod)}[{', '.join(map(ast.unparse, args))}]", None
        if not param and base in ASYNC_ITER:
            item, conv = self.ann(args[0], mod, own)
            self.import_name("Iterator", ("collections.abc", "Iterator"), runtime=False)
            return f"Iterator[{item}]", _adapter("iterate", conv, self.helpers)
        if not param and base in ASYNC_CM:
            item, conv = self.ann(args[0], mod, own)
            self.import_name(
                "AbstractContextManager", ("contextlib", "AbstractContextManager"), False
            )
            return f"AbstractContextManager[{item}]", _adapter("context", conv, self.helpers)
        if not param and base in AWAITABLE:
            raise GenError(f"a plain method returning {ast.unparse(node)}; make it async")
        parts = [self.ann(a, mod, own, param) for a in args]
        text = f"{self.use(node.value, mod)}[{', '.join(t for t, _ in parts)}]"
        convs = [c for _, c in parts if c is not None]
        if not convs:
            return text, None
        if base in LISTS and len(parts) == 1 and not param:
            inner = convs[0]
            return text, lambda v, d: f"[{inner(f'v{d}', d + 1)} for v{d} in {v}]"
        raise GenError(f"handles inside {ast.unparse(node)} are not mapped")

    def union(
        self, members: list[ast.expr], mod: Module, own: type, param: bool
    ) -> tuple[str, Conv]:
        parts = [self.ann(m, mod, own, param) for m in members]
        text = " | ".join(t for t, _ in parts)
        convs = [c for _, c in parts if c is not None]
        if not convs:
            return text, None
        if len(convs) == 1 and all(t == "None" for t, c in parts if c is None):
            one = convs[0]
            return text, lambda v, d: f"None if {v} is None else {one(v, d)}"
        raise GenError(f"a union of handles and values is not mapped: {text}")

    # ------------------------------------------------------------------ rendering
    def render_class(self, cls: type) -> str:
        name = self.handles[cls]
        # only the root's class is needed at run time (to build it); the others only type
        # ``_obj``, so a renamed async class cannot break ``import corral`` before regenerating
        self.import_name(cls.__name__, (cls.__module__, cls.__name__), runtime=cls is self.root)
        out = [f"class {name}(_Handle):\n"]
        head = f"Blocking ``{cls.__module__}.{cls.__qualname__}``: the same API, no ``await``."
        out.append(_doc(inspect.getdoc(cls), "    ", head=head))
        out.append(f"\n    __slots__ = ()\n    _obj: {cls.__name__}\n")
        for m in self.source.members(cls):
            out.append("\n")
            out.append(self.render_member(cls, m))
        return "".join(out)

    def render_member(self, cls: type, m: Member) -> str:
        try:
            return self._render_member(cls, m)
        except GenError as exc:
            raise GenError(f"{cls.__module__}.{cls.__qualname__}.{m.name}: {exc}") from None

    def _render_member(self, cls: type, m: Member) -> str:
        is_self = returns_self(m, cls)
        is_root = cls is self.root
        if is_root and is_self and m.name in ("__aiter__", "__aenter__"):
            # the root's blocking class owns the portal: it can only ever return itself
            value = f"self._obj.{m.name}()"
            if m.is_coroutine:
                value = f"self._portal.call({value})"
            name = DUNDERS[m.name]
            return (
                f"    def {name}(self) -> {self.root_name}:\n        {value}\n        return self\n"
            )
        ret, conv = self.ann(m.returns, m.module, cls)
        if m.kind in ("property", "attribute"):
            body = _returning(f"self._obj.{m.name}", conv)
            return f"    @property\n    def {m.name}(self) -> {ret}:\n{_doc(m.doc, ' ' * 8)}{body}"
        assert m.func is not None
        args, forward = self.signature(m.func, m.module, cls)
        call = f"self._obj.{m.name}({forward})"
        value = f"self._portal.call({call})" if m.is_coroutine else call
        if m.is_acm:
            ret = f"AbstractContextManager[{ret}]"
            self.import_name(
                "AbstractContextManager", ("contextlib", "AbstractContextManager"), False
            )
            conv = _adapter("context", conv, self.helpers)
        if m.name == "__init__":
            self.helpers.add("_Portal")
            body = f"        super().__init__({cls.__name__}({forward}), _Portal())\n"
            return f"    def __init__({args}) -> None:\n{body}"
        name = DUNDERS.get(m.name, m.name)
        if is_root and m.name in CLOSERS:
            if ret != "None":
                raise GenError("a closer must return None")
            body = (
                "        if self._portal.closed:\n            return\n"
                f"        try:\n            {value}\n"
                "        finally:\n            self._portal.stop()\n"
            )
        elif m.name in ("__aiter__", "__aenter__") and is_self and conv is not None:
            # ``async with x as y``: y is usually x itself; keep that identity (and the
            # blocking wrapper's) unless the async side entered into another object
            body = (
                f"        value = {value}\n"
                f"        return self if value is self._obj else {conv('value', 0)}\n"
            )
        elif m.name == "__anext__":
            body = (
                f"        try:\n            value = {value}\n"
                "        except StopAsyncIteration:\n            raise StopIteration from None\n"
                f"        return {conv('value', 0) if conv else 'value'}\n"
            )
        elif ret == "None":
            body = f"        {value}\n"
        else:
            body = _returning(value, conv)
        return f"    def {name}({args}) -> {ret}:\n{_doc(m.doc, ' ' * 8)}{body}"

    def signature(
        self, func: ast.FunctionDef | ast.AsyncFunctionDef, mod: Module, own: type
    ) -> tuple[str, str]:
        """The blocking parameter list and the arguments that forward it."""
        a = func.args
        positional = [*a.posonlyargs, *a.args]
        if not positional or positional[0].arg != "self":
            raise GenError("a method's first parameter must be self")
        defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
        defaults += a.defaults
        params: list[str] = ["self"]
        forward: list[str] = []

        def one(arg: ast.arg, default: ast.expr | None, star: str = "") -> str:
            if arg.annotation is None:
                raise GenError(f"annotate the parameter {arg.arg!r}")
            text, conv = self.ann(arg.annotation, mod, own, param=True)
            if conv is not None and star:
                raise GenError(f"handles in *{arg.arg} are not mapped")
            value = conv(arg.arg, 0) if conv else arg.arg
            piece = f"{star}{arg.arg}: {text}"
            if default is not None:
                piece += f" = {self.names_in(default, mod)}"
            params.append(piece)
            return value

        for i, (arg, default) in enumerate(zip(positional[1:], defaults[1:], strict=True)):
            forward.append(one(arg, default))
            if i + 1 == len(a.posonlyargs) - 1:
                params.append("/")
        if a.vararg is not None:
            forward.append("*" + one(a.vararg, None, "*"))
        elif a.kwonlyargs:
            params.append("*")
        for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
            forward.append(f"{arg.arg}={one(arg, kw_default)}")
        if a.kwarg is not None:
            forward.append("**" + one(a.kwarg, None, "**"))
        return ", ".join(params), ", ".join(forward)

    def render(self) -> str:
        self.discover()
        classes = [self.render_class(cls) for cls in self.handles]
        imports = ["from __future__ import annotations", "from typing import TYPE_CHECKING"]
        imports.append(f"from corral.sdk._sync import {', '.join(sorted(self.helpers))}")
        imports += [_import(local, src) for local, src in sorted(self.runtime_imports.items())]
        typing_only = sorted(self.typing_imports.items() - self.runtime_imports.items())
        lines = [
            f'"""The blocking SDK: ``{self.root_name}`` and a blocking class per async handle.\n\n'
            "Generated by ``python -m corral.sdk._gen_sync`` (``make gen``) from the async\n"
            "handles; do not edit. Each method forwards to its async twin on the client's\n"
            'portal (see ``_sync.py``).\n"""\n',
            "\n".join(imports),
            "\nif TYPE_CHECKING:\n",
            "\n".join("    " + _import(local, src) for local, src in typing_only) or "    pass",
            "\n\n__all__ = [" + ", ".join(f'"{name}"' for name in self.handles.values()) + "]\n",
        ]
        return "\n".join(lines) + "\n\n" + "\n\n".join(classes)


def _flatten_union(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _flatten_union(node.left) + _flatten_union(node.right)
    return [node]


def _adapter(method: str, item: Conv, helpers: set[str]) -> Conv:
    """Conversion through ``_Portal.iterate``/``_Portal.context``, items converted by ``item``."""
    if item is None:
        helpers.add("_same")
    return lambda v, d: (
        f"self._portal.{method}({v}, "
        + (f"lambda v{d}: {item(f'v{d}', d + 1)}" if item else "_same")
        + ")"
    )


def _returning(value: str, conv: Conv) -> str:
    if conv is None:
        return f"        return {value}\n"
    return f"        value = {value}\n        return {conv('value', 0)}\n"


def _import(local: str, source: tuple[str, str | None]) -> str:
    module, attr = source
    if attr is None:
        return f"import {module}" if local == module else f"import {module} as {local}"
    return f"from {module} import {attr}" + ("" if attr == local else f" as {local}")


def _ruff(*args: str, source: str) -> str:
    # the repository's pyproject (line length, first-party packages) applies: same as lint
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(OUTPUT), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=OUTPUT.parents[3] if len(OUTPUT.parents) > 3 else None,
    )
    if done.returncode != 0:
        raise GenError(f"ruff {' '.join(args)} failed on the generated code:\n{done.stderr}")
    return done.stdout


def render(root: tuple[str, str] = ROOT, root_name: str = ROOT_SYNC_NAME) -> str:
    """The text ``_sync_gen.py`` should have now (imports sorted, formatted).

    ``root``/``root_name``: another async root class (module, name) and its blocking
    name; tests generate from small async classes of their own with it."""
    raw = _Generator(root, root_name).render()
    return _ruff("format", source=_ruff("check", "--select", "I", "--fix", "-q", source=raw))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corral.sdk._gen_sync", description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="only say whether the file is up to date"
    )
    opts = parser.parse_args(argv)
    text = render()
    old = OUTPUT.read_text() if OUTPUT.exists() else ""
    if opts.check:
        if text == old:
            return 0
        diff = difflib.unified_diff(
            old.splitlines(keepends=True), text.splitlines(keepends=True), str(OUTPUT), "generated"
        )
        sys.stdout.writelines(diff)
        print(f"{OUTPUT} is stale: run `make gen`", file=sys.stderr)
        return 1
    if text != old:
        OUTPUT.write_text(text)
        print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
