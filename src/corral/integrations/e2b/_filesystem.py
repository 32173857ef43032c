"""envd's ``filesystem.Filesystem`` Connect service over corral's files API.

Stat, list and remove go through the files API (the node reads the sandbox's tree with
the path confined to it). ``MakeDir`` and ``Move`` run ``mkdir``/``mv`` as the calling
user, so ownership and permissions are what E2B gives. ``WatchDir`` polls the files API
(every ``poll`` seconds) and reports the differences: the guest can only make events by
changing files, never forge them, at the price of missing changes undone within one poll
and of reporting a change of a file's size or mtime as one ``write``.
"""

from __future__ import annotations

import asyncio
import itertools
import stat as statmod
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import Filesystem
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from corral.errors import CorralError, NotFound, SandboxNotFound
from corral.integrations.e2b._common import E2BConfig, guest_path
from corral.integrations.e2b._rpc import connect_error, oneof, request_user, sandbox_of
from corral.ops import NodeOps
from corral.spec import ExecRequest, FileStat

_TYPES = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY}
_KINDS = {"file": statmod.S_IFREG, "dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}


def _owner(uid: int) -> str:
    return {0: "root", 1000: "user"}.get(uid, str(uid))


def entry_of(st: FileStat) -> pb.EntryInfo:
    mode = st.mode & 0o7777
    return pb.EntryInfo(
        name=st.name,
        type=_TYPES.get(st.type, pb.FileType.FILE),
        is_symlink=st.type == "symlink",
        path=st.path,
        size=st.size,
        mode=mode,
        permissions=statmod.filemode(_KINDS.get(st.type, 0) | mode),
        owner=_owner(st.uid),
        group=_owner(st.gid),
        modified_time=Timestamp(seconds=int(st.mtime), nanos=int(st.mtime % 1 * 1e9)),
        symlink_target=st.target,
    )


class FilesystemService(Filesystem):
    """``filesystem.Filesystem`` over ``ops`` (see the module docstring)."""

    def __init__(self, ops: NodeOps, config: E2BConfig, poll: float = 0.2) -> None:
        self.ops = ops
        self.config = config
        self.poll = poll
        self._watchers: dict[str, tuple[str, str, bool, dict[str, FileStat], list[Any]]] = {}
        self._ids = itertools.count(1)

    def _where(self, path: str, ctx: RequestContext[Any, Any]) -> tuple[str, str, str]:
        sid = sandbox_of(ctx)
        user = request_user(ctx, self.config)
        try:
            return sid, user, guest_path(path, user)
        except CorralError as exc:
            raise connect_error(exc) from None

    async def _stat(self, sid: str, path: str) -> FileStat:
        try:
            return await self.ops.file_stat(sid, path)
        except SandboxNotFound as exc:
            raise connect_error(exc) from None
        except NotFound:
            raise ConnectError(Code.NOT_FOUND, f"path {path!r} does not exist") from None
        except CorralError as exc:
            raise connect_error(exc) from None

    async def _as_user(self, sid: str, user: str, cmd: list[str]) -> None:
        try:
            res = await self.ops.exec(sid, ExecRequest(cmd=cmd, user=user))
        except CorralError as exc:
            raise connect_error(exc) from None
        if res.exit_code != 0:
            msg = res.stderr.decode(errors="replace").strip() or f"{cmd[0]} failed"
            code = Code.PERMISSION_DENIED if "ermission" in msg else Code.INVALID_ARGUMENT
            if "No such file" in msg:
                code = Code.NOT_FOUND
            raise ConnectError(code, msg)

    async def stat(self, request: pb.StatRequest, ctx: RequestContext[Any, Any]) -> pb.StatResponse:
        sid, _, path = self._where(request.path, ctx)
        return pb.StatResponse(entry=entry_of(await self._stat(sid, path)))

    async def _walk(self, sid: str, path: str, depth: int) -> list[FileStat]:
        try:
            items = await self.ops.file_list(sid, path)
        except SandboxNotFound as exc:
            raise connect_error(exc) from None
        except NotFound:
            raise ConnectError(Code.NOT_FOUND, f"directory {path!r} does not exist") from None
        except CorralError as exc:
            raise connect_error(exc) from None
        out = list(items)
        if depth > 1:
            for st in items:
                if st.type == "dir":
                    out.extend(await self._walk(sid, st.path, depth - 1))
        return out

    async def list_dir(
        self, request: pb.ListDirRequest, ctx: RequestContext[Any, Any]
    ) -> pb.ListDirResponse:
        sid, _, path = self._where(request.path, ctx)
        st = await self._stat(sid, path)
        if st.type != "dir":
            raise ConnectError(Code.INVALID_ARGUMENT, f"path {path!r} is not a directory")
        items = await self._walk(sid, path, max(1, request.depth or 1))
        return pb.ListDirResponse(entries=[entry_of(s) for s in items])

    async def make_dir(
        self, request: pb.MakeDirRequest, ctx: RequestContext[Any, Any]
    ) -> pb.MakeDirResponse:
        sid, user, path = self._where(request.path, ctx)
        try:
            await self.ops.file_stat(sid, path)
        except SandboxNotFound as exc:
            raise connect_error(exc) from None
        except NotFound:
            pass
        except CorralError as exc:
            raise connect_error(exc) from None
        else:
            raise ConnectError(Code.ALREADY_EXISTS, f"path {path!r} already exists")
        await self._as_user(sid, user, ["mkdir", "-p", "--", path])
        return pb.MakeDirResponse(entry=entry_of(await self._stat(sid, path)))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext[Any, Any]) -> pb.MoveResponse:
        sid, user, src = self._where(request.source, ctx)
        _, _, dst = self._where(request.destination, ctx)
        await self._stat(sid, src)
        await self._as_user(sid, user, ["mv", "-T", "--", src, dst])
        return pb.MoveResponse(entry=entry_of(await self._stat(sid, dst)))

    async def remove(
        self, request: pb.RemoveRequest, ctx: RequestContext[Any, Any]
    ) -> pb.RemoveResponse:
        sid, _, path = self._where(request.path, ctx)
        try:
            await self.ops.file_remove(sid, path, recursive=True)
        except SandboxNotFound as exc:
            raise connect_error(exc) from None
        except NotFound:
            raise ConnectError(Code.NOT_FOUND, f"path {path!r} does not exist") from None
        except CorralError as exc:
            raise connect_error(exc) from None
        return pb.RemoveResponse()

    # ------------------------------------------------------------------ watching
    async def _snapshot(self, sid: str, path: str, recursive: bool) -> dict[str, FileStat]:
        items = await self._walk(sid, path, 64 if recursive else 1)
        return {s.path: s for s in items}

    @staticmethod
    def _diff(
        root: str, old: dict[str, FileStat], new: dict[str, FileStat], entries: bool
    ) -> list[pb.FilesystemEvent]:
        out = []

        def ev(p: str, kind: Any, st: FileStat | None) -> pb.FilesystemEvent:
            name = p[len(root) :].lstrip("/")
            entry = entry_of(st) if (entries and st is not None) else None
            return pb.FilesystemEvent(name=name, type=kind, entry=entry)

        for p, st in new.items():
            was = old.get(p)
            if was is None:
                out.append(ev(p, pb.EventType.CREATE, st))
            elif (was.size, was.mtime) != (st.size, st.mtime):
                out.append(ev(p, pb.EventType.WRITE, st))
            elif was.mode != st.mode:
                out.append(ev(p, pb.EventType.CHMOD, st))
        for p in old:
            if p not in new:
                out.append(ev(p, pb.EventType.REMOVE, None))
        return out

    async def watch_dir(
        self, request: pb.WatchDirRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[pb.WatchDirResponse]:
        sid, _, path = self._where(request.path, ctx)
        st = await self._stat(sid, path)
        if st.type != "dir":
            raise ConnectError(Code.INVALID_ARGUMENT, f"path {path!r} is not a directory")
        seen = await self._snapshot(sid, path, request.recursive)
        yield pb.WatchDirResponse(event=oneof("start", pb.WatchDirResponse.StartEvent()))
        ticks = 0
        while True:
            await asyncio.sleep(self.poll)
            try:
                now = await self._snapshot(sid, path, request.recursive)
            except ConnectError:
                return  # the directory (or the sandbox) went away: the watch ends
            for fe in self._diff(path, seen, now, request.include_entry):
                yield pb.WatchDirResponse(event=oneof("filesystem", fe))
            seen = now
            ticks += 1
            if ticks * self.poll >= 30:
                ticks = 0
                yield pb.WatchDirResponse(event=oneof("keepalive", pb.WatchDirResponse.KeepAlive()))

    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> pb.CreateWatcherResponse:
        sid, _, path = self._where(request.path, ctx)
        snap = await self._snapshot(sid, path, request.recursive)
        wid = f"w{next(self._ids)}"
        self._watchers[wid] = (sid, path, request.recursive, snap, [])
        return pb.CreateWatcherResponse(watcher_id=wid)

    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any]
    ) -> pb.GetWatcherEventsResponse:
        w = self._watchers.get(request.watcher_id)
        if w is None or w[0] != sandbox_of(ctx):
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found")
        sid, path, rec, snap, _ = w
        now = await self._snapshot(sid, path, rec)
        events = self._diff(path, snap, now, True)
        self._watchers[request.watcher_id] = (sid, path, rec, now, [])
        return pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self, request: pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> pb.RemoveWatcherResponse:
        w = self._watchers.get(request.watcher_id)
        if w is None or w[0] != sandbox_of(ctx):
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found")
        del self._watchers[request.watcher_id]
        return pb.RemoveWatcherResponse()
