"""What the async SDK declares, read from its source for ``_gen_sync``.

Annotations are taken from the ``ast`` of each module, as written (``from __future__
import annotations`` keeps them unevaluated, and ``TYPE_CHECKING`` imports count), and
every name is resolved through the module's own imports. Objects are looked at only to
tell a method from a property or a coroutine function from a plain one, and whether a
class is a handle: one of the package's classes with async methods or async dunders.
"""

from __future__ import annotations

import ast
import builtins
import enum
import importlib
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel

__all__ = [
    "DUNDERS",
    "GenError",
    "LITERALS",
    "Member",
    "Module",
    "SELF",
    "Source",
    "is_handle",
    "lookup",
    "returns_self",
]

SELF = {"typing.Self", "typing_extensions.Self"}
LITERALS = {"typing.Literal", "typing_extensions.Literal"}
# async dunders and their blocking twins
DUNDERS = {"__aenter__": "__enter__", "__aexit__": "__exit__"}
DUNDERS |= {"__aiter__": "__iter__", "__anext__": "__next__"}


class GenError(Exception):
    """The async API has a shape the generator cannot mirror; the message names it."""


class Module:
    """One module's source: its top-level classes and what each name in it refers to."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = inspect.getsource(importlib.import_module(name))
        self.tree = ast.parse(self.source)
        # local name -> (module, attribute or None for ``import module``)
        self.names: dict[str, tuple[str, str | None]] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        for node in _top_level(self.tree.body):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    self.names[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.names[a.asname] = (a.name, None)
                    else:  # ``import a.b`` binds ``a``; ``a.b.X`` is then spelled in full
                        root = a.name.partition(".")[0]
                        self.names[root] = (root, None)
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
                self.names[node.name] = (name, node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.names[node.name] = (name, node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        self.names[t.id] = (name, t.id)

    def source_of(self, local: str) -> tuple[str, str | None]:
        if local in self.names:
            return self.names[local]
        if hasattr(builtins, local):
            return ("builtins", local)
        raise GenError(f"{self.name}: cannot tell what the name {local!r} refers to")

    def fullname(self, node: ast.expr) -> str | None:
        """Dotted name of a Name/Attribute chain (``builtins.list``), None for other nodes."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        module, attr = self.source_of(node.id)
        head = module if attr is None else f"{module}.{attr}"
        return ".".join([head, *reversed(parts)])


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module statements, including those under ``if TYPE_CHECKING:`` and ``try:``."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
        else:
            yield node


@dataclass
class Member:
    """One public member of an async handle, as the source declares it."""

    name: str
    kind: str  # "method", "property" or "attribute"
    module: Module  # where its annotations are resolved
    returns: ast.expr
    func: ast.FunctionDef | ast.AsyncFunctionDef | None = None
    doc: str | None = None
    is_coroutine: bool = False
    is_acm: bool = False  # @asynccontextmanager: returns an async context manager


def is_handle(obj: object, package: str) -> bool:
    if not inspect.isclass(obj) or not obj.__module__.startswith(package):
        return False
    if issubclass(obj, (BaseModel, BaseException, enum.Enum)):
        return False
    for klass in obj.__mro__:
        for name, value in vars(klass).items():
            if name in DUNDERS:
                return True
            if inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value):
                return True
    return False


def lookup(fullname: str, package: str, load: bool = True) -> object:
    """The object a dotted name refers to, for the package's own names only (else None).

    ``load=False`` looks only into modules already imported: enough to tell whether a
    parameter's type is a handle (handles were imported while discovering them), without
    importing, say, the whole embedded node for ``NodeConfig``."""
    if not fullname.startswith(package):
        return None
    module, _, attr = fullname.rpartition(".")
    if not load:
        return getattr(sys.modules.get(module), attr, None)
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None


class Source:
    """The async API as its source declares it: modules read once, handles found from
    the root through return annotations, properties and public attributes."""

    def __init__(self, root: type) -> None:
        self.root = root
        # handles are the root package's own classes (``corral.``), never a library's
        self.package = root.__module__.partition(".")[0] + "."
        self.modules: dict[str, Module] = {}

    def module(self, name: str) -> Module:
        if name not in self.modules:
            self.modules[name] = Module(name)
        return self.modules[name]

    def handles(self) -> list[type]:
        """Every handle reachable from the root, the root first, in the order met."""
        found = [self.root]
        i = 0
        while i < len(found):
            for m in self.members(found[i]):
                for node in _names(m.returns, m.module):
                    full = m.module.fullname(node)
                    obj = lookup(full, self.package) if full else None
                    if is_handle(obj, self.package) and obj not in found:
                        assert isinstance(obj, type)
                        found.append(obj)
            i += 1
        return found

    def members(self, cls: type) -> list[Member]:
        """Public members in source order; a subclass's definition wins over its base's."""
        found: dict[str, Member] = {}
        for klass in reversed(cls.__mro__):
            if not klass.__module__.startswith(self.package):
                continue  # object, Protocol, Generic: not part of the API
            mod = self.module(klass.__module__)
            cdef = mod.classes.get(klass.__qualname__)
            if cdef is None:
                raise GenError(f"{klass.__qualname__}: not a top-level class of {mod.name}")
            for m in self._class_members(klass, cdef, mod):
                found[m.name] = m
        return list(found.values())

    def _class_members(self, klass: type, cdef: ast.ClassDef, mod: Module) -> Iterator[Member]:
        where = f"{klass.__module__}.{klass.__qualname__}"
        defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for stmt in cdef.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(stmt.name, []).append(stmt)
        for stmt in cdef.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if _public(stmt.target.id):
                    yield Member(stmt.target.id, "attribute", mod, stmt.annotation)
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if stmt is not defs[stmt.name][-1]:
                continue  # an earlier definition of a name redefined below
            name = stmt.name
            if name == "__init__":
                if klass is self.root:
                    yield Member(name, "method", mod, ast.Constant(None), func=stmt)
                yield from self._init_attributes(klass, stmt, mod)
                continue
            if not (_public(name) or name in DUNDERS):
                continue
            if len(defs[name]) > 1:
                raise GenError(f"{where}.{name}: overloads are not mirrored; use one signature")
            value = vars(klass)[name]
            if isinstance(value, (staticmethod, classmethod)):
                raise GenError(
                    f"{where}.{name}: a public {type(value).__name__} has no blocking twin "
                    "(it has no portal); make it a method of a handle or teach _gen_sync"
                )
            if stmt.returns is None:
                raise GenError(f"{where}.{name}: annotate its return type")
            doc = ast.get_docstring(stmt)
            if isinstance(value, property):
                yield Member(name, "property", mod, stmt.returns, func=stmt, doc=doc)
                continue
            if not callable(value):
                raise GenError(f"{where}.{name}: {type(value).__name__} members are not mirrored")
            acm = any(
                (mod.fullname(d) or "").endswith("asynccontextmanager") for d in stmt.decorator_list
            )
            returns = stmt.returns
            if acm:
                if not (isinstance(returns, ast.Subscript) and mod.fullname(returns.value)):
                    raise GenError(f"{where}.{name}: annotate it as AsyncIterator[T]")
                returns = returns.slice
            yield Member(
                name,
                "method",
                mod,
                returns,
                func=stmt,
                doc=doc,
                is_coroutine=inspect.iscoroutinefunction(value),
                is_acm=acm,
            )

    def _init_attributes(
        self, klass: type, init: ast.FunctionDef | ast.AsyncFunctionDef, mod: Module
    ) -> Iterator[Member]:
        """Public attributes set in ``__init__`` (``self.images = Images(self)``)."""
        body = init.body
        for i, stmt in enumerate(body):
            target: ast.expr | None = None
            ann: ast.expr | None = None
            if isinstance(stmt, ast.AnnAssign):
                target, ann = stmt.target, stmt.annotation
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target = stmt.targets[0]
                if isinstance(stmt.value, ast.Call) and isinstance(
                    stmt.value.func, (ast.Name, ast.Attribute)
                ):
                    ann = stmt.value.func
            if not (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and _public(target.attr)
            ):
                continue
            if ann is None:
                raise GenError(
                    f"{klass.__qualname__}.{target.attr}: annotate this public attribute "
                    "(self.x: T = ...) so its blocking property has a type"
                )
            doc = None
            nxt = body[i + 1] if i + 1 < len(body) else None
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                doc = inspect.cleandoc(nxt.value.value)
            yield Member(target.attr, "attribute", mod, ann, doc=doc)


def _public(name: str) -> bool:
    return not name.startswith("_")


def _names(node: ast.expr, mod: Module) -> Iterator[ast.expr]:
    """The names (Name/Attribute nodes) of an annotation, quoted parts included, the
    strings of a ``Literal[...]`` excluded (the same reading as ``_Generator.ann``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield from _names(ast.parse(node.value, mode="eval").body, mod)
    elif isinstance(node, (ast.Name, ast.Attribute)):
        yield node
    elif isinstance(node, ast.Subscript):
        yield from _names(node.value, mod)
        if mod.fullname(node.value) not in LITERALS:
            yield from _names(node.slice, mod)
    else:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                yield from _names(child, mod)


def returns_self(m: Member, cls: type) -> bool:
    full = m.module.fullname(m.returns) if isinstance(m.returns, ast.Name) else None
    return full in SELF or full == f"{cls.__module__}.{cls.__name__}"
