"""The node's isolation engines, by kind, and the one place that builds them.

Engines are imported lazily by kind (a microVM engine pulls in QEMU helpers that a
container-only node never loads).
"""

from __future__ import annotations

import importlib

from corral.backends.base import Backend, HostContext
from corral.backends.config import BackendConfig
from corral.errors import InvalidRequest
from corral.node.config import NodeConfig
from corral.spec import SandboxInfo, SandboxSpec

__all__ = ["Backends", "make_backend"]

_ENGINES: dict[str, str] = {
    "container": "corral.backends.container:ContainerBackend",
    "microvm": "corral.backends.microvm.backend:MicroVMBackend",
    "vm": "corral.backends.vm.backend:VMBackend",
}
"""kind -> "module:class" (imported on first use)."""


def make_backend(cfg: BackendConfig, ctx: HostContext, node: NodeConfig) -> Backend:
    """A complete backend of ``cfg.kind`` (not started yet)."""
    module, _, name = _ENGINES[cfg.kind].partition(":")
    cls = getattr(importlib.import_module(module), name)
    if cfg.kind == "container":
        backend: Backend = cls(cfg, ctx, owner_first=node.owner_first(cfg))
    else:
        backend = cls(cfg, ctx)
    return backend


class Backends:
    """The engines of one node, by kind."""

    def __init__(self, backends: list[Backend], default: str) -> None:
        self._by_kind = {b.kind: b for b in backends}
        self.default = default

    def all(self) -> list[Backend]:
        return list(self._by_kind.values())

    def get(self, kind: str) -> Backend | None:
        return self._by_kind.get(kind)

    def for_spec(self, spec: SandboxSpec) -> Backend:
        """The engine a new sandbox asks for (InvalidRequest naming what the node has)."""
        kind = spec.backend or self.default
        backend = self._by_kind.get(kind)
        if backend is None:
            raise InvalidRequest(
                f"backend: this node has no {kind!r} backend (it has: {', '.join(self._by_kind)})"
            )
        if spec.desktop is not None and kind != "vm":
            raise InvalidRequest(
                f"desktop: only the 'vm' backend has a display; this sandbox's backend is "
                f"{kind!r} (ask for backend='vm' with a desktop image)"
            )
        return backend

    def of(self, info: SandboxInfo) -> Backend:
        """The engine running a live sandbox."""
        return self._by_kind[info.backend]
