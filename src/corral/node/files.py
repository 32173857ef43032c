"""The node's file API on a sandbox's filesystem, through its backend's :class:`Files`.

The blocking file calls run in worker threads (a large upload must not stall other
sandboxes' requests). A refused path (an escape, a bad name: status 400) is recorded as a
``file_refused`` security event; a sandbox destroyed under a call is reported as gone.
"""

from __future__ import annotations

import asyncio
from typing import Any

from corral.errors import CorralError, SandboxNotFound
from corral.node.lifecycle import Lifecycle
from corral.node.state import StateStore
from corral.node.table import SandboxTable
from corral.spec import FileStat

__all__ = ["FileOps"]


class FileOps:
    """File operations on the sandboxes of one node."""

    def __init__(self, life: Lifecycle, table: SandboxTable, state: StateStore) -> None:
        self.life = life
        self.table = table
        self.state = state

    async def _call(self, sandbox_id: str, method: str, *args: object, **kw: object) -> Any:
        info = self.life.active(sandbox_id)
        with self.table.working(sandbox_id):
            fs = self.life.backend_of(info).files(sandbox_id)
            try:
                return await asyncio.to_thread(getattr(fs, method), *args, **kw)
            except CorralError as e:
                cur = self.table.get(sandbox_id)
                if (cur is None or cur.state == "destroying") and e.status != 400:
                    raise SandboxNotFound(
                        f"sandbox {sandbox_id} was destroyed during file {method}"
                    ) from e
                if e.status == 400:
                    self.state.add_event(
                        sandbox_id, "file_refused", {"op": method, "error": e.message[:500]}
                    )
                raise

    async def read(
        self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None
    ) -> bytes:
        data: bytes = await self._call(sandbox_id, "read", path, offset, length)
        return data

    async def write(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, append: bool = False
    ) -> None:
        await self._call(sandbox_id, "write", path, data, mode=mode, append=append)

    async def list(self, sandbox_id: str, path: str) -> list[FileStat]:
        out: list[FileStat] = await self._call(sandbox_id, "list", path)
        return out

    async def stat(self, sandbox_id: str, path: str) -> FileStat:
        out: FileStat = await self._call(sandbox_id, "stat", path)
        return out

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self._call(sandbox_id, "remove", path, recursive=recursive)

    async def mkdir(
        self,
        sandbox_id: str,
        path: str,
        parents: bool = True,
        mode: int = 0o755,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        owner = {"owner_uid": owner_uid, "owner_gid": owner_gid} if owner_uid or owner_gid else {}
        await self._call(sandbox_id, "mkdir", path, parents=parents, mode=mode, **owner)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._call(sandbox_id, "upload_tar", path, data)

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        out: bytes = await self._call(sandbox_id, "download_tar", path)
        return out
