"""The protocol every isolation engine implements.

Where a sandbox runs (lifecycle) is the backend's; what is done in it (exec, files) goes
through the sandbox's init and file view, which the backend hands out.
"""

from __future__ import annotations

from typing import Protocol

from corral.spec import ImageInfo, SandboxSpec

__all__ = ["Backend"]


class Backend(Protocol):
    kind: str

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: ImageInfo) -> int:
        """Start the sandbox; returns the host pid of its init. Leaves nothing on failure."""
        ...

    async def destroy(self, sandbox_id: str, image: ImageInfo | None) -> None:
        """Remove every trace: processes, mounts, cgroups, writable layer, runtime state."""
        ...

    def alive(self, sandbox_id: str) -> bool: ...

    async def adopt(self, sandbox_id: str, image: ImageInfo) -> bool:
        """After an agent restart: take over a running sandbox; False if it is gone."""
        ...
