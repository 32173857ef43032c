"""Directory watches in sandboxes: inotify on the sandbox's root, one instance per node.

A watch is added on the directory's inode, found inside the sandbox's root with the same
confined resolution as the files API (:meth:`corral.backends.files.SandboxFS.add_watch`),
so a guest path can never name a host directory or another sandbox's, and every event is
the kernel's account of a real change: the guest can cause events, not forge them. The
files API's own temporary names (``.corral-tmp-*``, renamed over the target by a write)
are left out, so a write through the API reads as one ``create`` of the target.

Bounds, so that a guest churning files cannot hurt the node: one inotify instance for
all watches (root's instance limit is host-wide), at most ``MAX_DIRS`` directories per
recursive watch, at most ``MAX_QUEUED`` undelivered events per watch (later ones are
dropped and counted), and repeats of the event just queued are merged. A subdirectory
renamed inside a recursive watch keeps reporting under its old name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from corral.errors import InvalidRequest
from corral.host import inotify as ino
from corral.ops import FileEvent

__all__ = ["WatchHub", "DirWatch", "MAX_DIRS", "MAX_QUEUED"]

log = logging.getLogger("corral.node.watch")

MAX_DIRS = 1024
MAX_QUEUED = 4096
_TMP_PREFIX = ".corral-tmp-"
_MASK = (
    ino.IN_CREATE | ino.IN_MOVED_TO | ino.IN_MODIFY | ino.IN_DELETE | ino.IN_MOVED_FROM
    | ino.IN_ATTRIB | ino.IN_DELETE_SELF | ino.IN_MOVE_SELF | ino.IN_ONLYDIR
)  # fmt: skip


def kind_of(mask: int) -> str | None:
    """E2B's (Go fsnotify's) names: a move in is a create, a move out a rename."""
    if mask & (ino.IN_CREATE | ino.IN_MOVED_TO):
        return "create"
    if mask & ino.IN_MODIFY:
        return "write"
    if mask & ino.IN_DELETE:
        return "remove"
    if mask & ino.IN_MOVED_FROM:
        return "rename"
    if mask & ino.IN_ATTRIB:
        return "chmod"
    return None


class DirWatch:
    """Events of one watched directory, as an async iterator until the directory (or the
    sandbox) goes or ``close`` is called."""

    def __init__(self, hub: WatchHub, fs: Any, path: str, recursive: bool) -> None:
        self._hub, self._fs, self.path, self.recursive = hub, fs, path.rstrip("/") or "/", recursive
        self._queue: asyncio.Queue[FileEvent | None] = asyncio.Queue()
        self._last: FileEvent | None = None
        self.wds: dict[int, str] = {}  # watch descriptor -> directory relative to ``path``
        self.dropped = 0
        self.closed = False

    def put(self, ev: FileEvent | None) -> None:
        if self.closed:
            return
        if ev is None:
            self.closed = True
        elif ev == self._last and not self._queue.empty():
            return  # the same event again before the reader caught up: merged
        elif self._queue.qsize() >= MAX_QUEUED:
            self.dropped += 1
            return
        self._last = ev
        self._queue.put_nowait(ev)

    def __aiter__(self) -> AsyncIterator[FileEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[FileEvent]:
        while True:
            ev = await self._queue.get()
            if ev is None:
                return
            yield ev

    def close(self) -> None:
        """Stop watching (idempotent); the iterator ends."""
        self._hub.remove(self)
        self.put(None)

    def guest_path(self, rel: str) -> str:
        return self.path if not rel else f"{self.path.rstrip('/')}/{rel}"


class WatchHub:
    """The node's inotify instance and who listens to which watch descriptor."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._subs: dict[int, list[tuple[DirWatch, str]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _instance(self) -> int:
        if self._fd is None:
            self._fd = ino.init()
            asyncio.get_running_loop().add_reader(self._fd, self._readable)
        return self._fd

    async def watch(self, fs: Any, path: str, recursive: bool) -> DirWatch:
        """Start watching ``path`` of the sandbox whose files are ``fs``."""
        if not hasattr(fs, "add_watch"):
            raise InvalidRequest("this backend's files cannot be watched with inotify")
        fd = self._instance()
        w = DirWatch(self, fs, path, recursive)
        await self._add(w, "", fd)
        if recursive:
            await self._add_tree(w, "", fd)
        return w

    async def _add(self, w: DirWatch, rel: str, fd: int) -> None:
        wd = await asyncio.to_thread(w._fs.add_watch, fd, w.guest_path(rel), _MASK)
        if w.closed:
            self._drop(wd, w)
            return
        w.wds[wd] = rel
        self._subs.setdefault(wd, []).append((w, rel))

    async def _add_tree(self, w: DirWatch, rel: str, fd: int) -> None:
        """Watch the subdirectories below ``rel`` (breadth first, up to MAX_DIRS)."""
        todo = [rel]
        while todo and not w.closed:
            here = todo.pop(0)
            try:
                entries = await asyncio.to_thread(w._fs.list, w.guest_path(here))
            except Exception:
                continue  # gone meanwhile
            for st in entries:
                if st.type != "dir" or len(w.wds) >= MAX_DIRS:
                    continue
                sub = f"{here}/{st.name}" if here else st.name
                with contextlib.suppress(Exception):
                    await self._add(w, sub, fd)
                    todo.append(sub)

    def _drop(self, wd: int, w: DirWatch) -> None:
        subs = [s for s in self._subs.get(wd, []) if s[0] is not w]
        if subs:
            self._subs[wd] = subs
            return
        self._subs.pop(wd, None)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                ino.rm_watch(self._fd, wd)

    def remove(self, w: DirWatch) -> None:
        for wd in list(w.wds):
            self._drop(wd, w)
        w.wds.clear()

    def _readable(self) -> None:
        assert self._fd is not None
        try:
            buf = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return
        for ev in ino.parse(buf):
            if ev.mask & ino.IN_Q_OVERFLOW:
                log.warning("inotify queue overflowed: some watch events were lost")
                continue
            if ev.mask & ino.IN_IGNORED:
                for w, rel in self._subs.pop(ev.wd, []):
                    w.wds.pop(ev.wd, None)
                    if rel == "":
                        w.close()  # the watched directory itself is gone
                continue
            kind = kind_of(ev.mask)
            if kind is None or not ev.name or ev.name.startswith(_TMP_PREFIX):
                continue
            for w, rel in list(self._subs.get(ev.wd, [])):
                w.put(FileEvent(f"{rel}/{ev.name}" if rel else ev.name, kind))
                new_dir = ev.mask & ino.IN_ISDIR and ev.mask & (ino.IN_CREATE | ino.IN_MOVED_TO)
                if w.recursive and new_dir and len(w.wds) < MAX_DIRS:
                    sub = f"{rel}/{ev.name}" if rel else ev.name
                    task = asyncio.get_running_loop().create_task(self._add_new(w, sub))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    async def _add_new(self, w: DirWatch, sub: str) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(Exception):
            await self._add(w, sub, self._fd)
            await self._add_tree(w, sub, self._fd)

    def close(self) -> None:
        """End every watch and close the instance (the node is closing)."""
        for subs in list(self._subs.values()):
            for w, _ in subs:
                w.put(None)
        self._subs.clear()
        if self._fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
