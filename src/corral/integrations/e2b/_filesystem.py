"""envd's ``filesystem.Filesystem`` Connect service over corral's files API.

Stat, list and remove go through the files API (the node reads the sandbox's tree with
the path confined to it). ``MakeDir`` and ``Move`` run ``mkdir``/``mv`` as the calling
user, so ownership and permissions are what E2B gives.

``WatchDir`` and the polled watchers use the node's inotify watches where the operations
object has them (:class:`corral.ops.WatchOps`, see :mod:`corral.node.watch`): the kernel's
events of the sandbox's own directory, which the guest can cause but never forge. Over
anything else they poll the files API (every ``poll`` seconds) and report differences,
missing changes undone within one poll.
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
from corral.ops import DirWatch, FileEvent, NodeOps, WatchOps
from corral.spec import ExecRequest, FileStat

_TYPES = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY}
_EVENTS = {
    "create": pb.EventType.CREATE,
    "write": pb.EventType.WRITE,
    "remove": pb.EventType.REMOVE,
    "rename": pb.EventType.RENAME,
    "chmod": pb.EventType.CHMOD,
}
_KEEPALIVE = 30.0
_MAX_PENDING = 4096  # events a polled watcher holds between two GetWatcherEvents
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
        self._kernel: dict[str, tuple[str, DirWatch, list[FileEvent], asyncio.Task[None]]] = {}
        self._kernel_paths: dict[str, str] = {}
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
        if isinstance(self.ops, WatchOps):
            async for item in self._watch_kernel(sid, path, request):
                yield item
            return
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

    async def _start_watch(self, sid: str, path: str, recursive: bool) -> DirWatch:
        assert isinstance(self.ops, WatchOps)
        try:
            return await self.ops.file_watch(sid, path, recursive)
        except CorralError as exc:
            raise connect_error(exc) from None

    async def _event(self, sid: str, path: str, ev: FileEvent, entry: bool) -> pb.FilesystemEvent:
        info = None
        if entry and ev.kind not in ("remove", "rename"):
            try:
                info = entry_of(await self.ops.file_stat(sid, f"{path.rstrip('/')}/{ev.name}"))
            except CorralError:
                pass  # gone again already
        return pb.FilesystemEvent(name=ev.name, type=_EVENTS[ev.kind], entry=info)

    async def _watch_kernel(
        self, sid: str, path: str, request: pb.WatchDirRequest
    ) -> AsyncIterator[pb.WatchDirResponse]:
        """The stream over a node's inotify watch; a pump task moves events to a queue so
        that waiting for the next one can time out (for keepalives) without harm."""
        w = await self._start_watch(sid, path, request.recursive)
        queue: asyncio.Queue[FileEvent | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for ev in w:
                    queue.put_nowait(ev)
            finally:
                queue.put_nowait(None)

        task = asyncio.create_task(pump())
        try:
            yield pb.WatchDirResponse(event=oneof("start", pb.WatchDirResponse.StartEvent()))
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), _KEEPALIVE)
                except TimeoutError:
                    keep = pb.WatchDirResponse.KeepAlive()
                    yield pb.WatchDirResponse(event=oneof("keepalive", keep))
                    continue
                if ev is None:
                    return
                fe = await self._event(sid, path, ev, request.include_entry)
                yield pb.WatchDirResponse(event=oneof("filesystem", fe))
        finally:
            w.close()
            task.cancel()

    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> pb.CreateWatcherResponse:
        sid, _, path = self._where(request.path, ctx)
        if isinstance(self.ops, WatchOps):
            w = await self._start_watch(sid, path, request.recursive)
            pending: list[FileEvent] = []

            async def collect() -> None:
                async for ev in w:
                    if len(pending) < _MAX_PENDING:
                        pending.append(ev)

            kid = f"w{next(self._ids)}"
            self._kernel[kid] = (sid, w, pending, asyncio.create_task(collect()))
            self._kernel_paths[kid] = path
            return pb.CreateWatcherResponse(watcher_id=kid)
        snap = await self._snapshot(sid, path, request.recursive)
        wid = f"w{next(self._ids)}"
        self._watchers[wid] = (sid, path, request.recursive, snap, [])
        return pb.CreateWatcherResponse(watcher_id=wid)

    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any]
    ) -> pb.GetWatcherEventsResponse:
        k = self._kernel.get(request.watcher_id)
        if k is not None and k[0] == sandbox_of(ctx):
            got = list(k[2])
            k[2].clear()
            path = self._kernel_paths[request.watcher_id]
            return pb.GetWatcherEventsResponse(
                events=[await self._event(k[0], path, ev, True) for ev in got]
            )
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
        k = self._kernel.get(request.watcher_id)
        if k is not None and k[0] == sandbox_of(ctx):
            del self._kernel[request.watcher_id]
            self._kernel_paths.pop(request.watcher_id, None)
            k[1].close()
            k[3].cancel()
            return pb.RemoveWatcherResponse()
        w = self._watchers.get(request.watcher_id)
        if w is None or w[0] != sandbox_of(ctx):
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found")
        del self._watchers[request.watcher_id]
        return pb.RemoveWatcherResponse()
