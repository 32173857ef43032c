"""A microVM's files, through its agent: the host never walks a guest filesystem.

Each call is one exec of the static busybox corral puts at ``/.corral/busybox`` in every
guest (so it works whatever the image holds), run as root in the guest. Paths are passed
as arguments, never spliced into a shell line. The calls block (the node runs them in
worker threads) and post their exec to the node's event loop.

Limits, for now: names containing a tab or a newline do not list correctly; tar upload
keeps busybox tar's semantics (no member checks beyond busybox's own: the guest is a VM,
its root is its own).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from corral.backends.base import Agent
from corral.backends.files import MAX_PATH
from corral.errors import HostError, InvalidRequest, NotFound, PathRefused
from corral.spec import FileStat

__all__ = ["AgentFiles"]

BB = "/.corral/busybox"
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
_FMT = "%F\t%s\t%a\t%Y\t%u\t%g\t%n"
_TYPES = {"regular file": "file", "regular empty file": "file", "directory": "dir"}
_MAX = 256 << 20
T = TypeVar("T")


class AgentFiles:
    """:class:`corral.backends.base.Files` over a guest agent (see the module docstring)."""

    def __init__(self, agent: Agent, loop: asyncio.AbstractEventLoop, max_file: int = _MAX):
        self.agent = agent
        self.loop = loop
        self.max_file = max_file

    # ------------------------------------------------------------------ plumbing
    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.get_ident() == getattr(self.loop, "_thread_id", None):
            coro.close()
            raise HostError("microvm files: called on the event loop thread (use a thread)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _sh(self, script: str, *args: str, stdin: bytes | None = None, limit: int = 1 << 20):
        """Run ``script`` under the guest's busybox sh with ``args`` as $1...; returns the
        exit. Errors of the command come back as the exit's stderr."""
        argv = [BB, "sh", "-c", script, "corral-files", *args]
        return self._wait(
            self.agent.exec(argv, env=_ENV, stdin=stdin, output_limit=limit, timeout=300)
        )

    @staticmethod
    def _check(path: str) -> str:
        if not isinstance(path, str):
            raise InvalidRequest(f"a path must be a string, not {type(path).__name__}")
        if "\0" in path:
            raise PathRefused(f"path {path[:200]!r} contains a NUL byte")
        if len(path) > MAX_PATH:
            raise PathRefused(f"path {path[:100]!r}... is longer than {MAX_PATH} bytes")
        if not path.startswith("/"):
            raise InvalidRequest(
                f"path {path!r} must be absolute inside the sandbox (start with /)"
            )
        return path

    @staticmethod
    def _fail(path: str, r: Any) -> None:
        err = r.stderr.decode(errors="replace").strip()
        if r.code == 0 and not err.startswith("corral:"):
            return
        low = err.lower()
        if "no such file" in low or "corral: missing" in low:
            raise NotFound(f"{path}: no such file or directory")
        if "is a directory" in low:
            raise InvalidRequest(f"{path}: is a directory")
        if "not a directory" in low:
            raise InvalidRequest(f"{path}: is not a directory")
        raise InvalidRequest(f"{path}: {err.splitlines()[-1] if err else 'failed'}")

    # ------------------------------------------------------------------ Files
    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        p = self._check(path)
        if offset < 0 or (length is not None and length < 0):
            raise InvalidRequest(f"{p}: offset and length cannot be negative")
        n = self.max_file if length is None else length
        if n > self.max_file:
            raise InvalidRequest(f"{p}: length {length} is over the limit {self.max_file}")
        script = (
            f'[ -d "$1" ] && {{ echo "$1: Is a directory" >&2; exit 1; }}; '
            f'{BB} tail -c +$(($2 + 1)) "$1" | {BB} head -c "$3"; '
            f'[ -e "$1" ] || {{ echo "corral: missing" >&2; exit 1; }}'
        )
        r = self._sh(script, p, str(offset), str(n), limit=max(n, 1))
        self._fail(p, r)
        return bytes(r.stdout)

    def write(self, path: str, data: bytes, mode: int = 0o644, append: bool = False) -> None:
        p = self._check(path)
        if not isinstance(data, bytes | bytearray):
            raise InvalidRequest(f"{p}: data must be bytes")
        if len(data) > self.max_file:
            raise InvalidRequest(f"{p}: {len(data)} bytes is over the limit {self.max_file}")
        if p.endswith("/"):
            raise InvalidRequest(f"{path!r}: a file path cannot end with '/'")
        op = ">>" if append else ">"
        # missing parent dirs are made, as the container engine's files API does
        script = (
            f'{BB} mkdir -p "$({BB} dirname "$1")" || exit 1; '
            f'[ -e "$1" ] || new=1; {BB} cat {op} "$1" || exit 1; '
            f'[ -n "$new" ] && {BB} chmod "$2" "$1"; exit 0'
        )
        self._fail(p, self._sh(script, p, f"{mode & 0o7777:o}", stdin=bytes(data)))

    def _stats(self, out: bytes, base: str | None) -> list[FileStat]:
        res = []
        for line in out.decode(errors="surrogateescape").splitlines():
            parts = line.split("\t", 6)
            if len(parts) != 7:
                continue
            kind, size, mode, mtime, uid, gid, name = parts
            target = None
            typ = _TYPES.get(kind, "other")
            if kind == "symbolic link":
                typ = "symlink"
                name, _, target = name.partition("\t->\t")
            full = name if base is None else name
            res.append(
                FileStat(
                    path=full,
                    name=full.rstrip("/").rsplit("/", 1)[-1] or "/",
                    type=typ,  # type: ignore[arg-type]
                    size=int(size),
                    mode=int(mode, 8),
                    mtime=float(mtime),
                    uid=int(uid),
                    gid=int(gid),
                    target=target,
                )
            )
        return res

    # One line per entry; a link's target follows a tab-arrow-tab (readlink).
    _STAT = (
        f'st() {{ l=$({BB} stat -c "{_FMT}" "$1") || return 1; '
        f'if [ -L "$1" ]; then printf "%s\\t->\\t%s\\n" "$l" "$({BB} readlink "$1")"; '
        f'else printf "%s\\n" "$l"; fi; }}; '
    )

    def stat(self, path: str) -> FileStat:
        p = self._check(path)
        script = (
            self._STAT
            + '[ -e "$1" ] || [ -L "$1" ] || { echo "corral: missing" >&2; exit 1; }; st "$1"'
        )
        r = self._sh(script, p)
        self._fail(p, r)
        got = self._stats(r.stdout, None)
        if not got:
            raise NotFound(f"{p}: no such file or directory")
        return got[0]

    def list(self, path: str) -> list[FileStat]:
        p = self._check(path)
        script = self._STAT + (
            '[ -e "$1" ] || { echo "corral: missing" >&2; exit 1; }; '
            '[ -d "$1" ] || { echo "$1: Not a directory" >&2; exit 1; }; '
            'd=${1%/}; for f in "$d"/* "$d"/.[!.]* "$d"/..?*; do '
            '[ -e "$f" ] || [ -L "$f" ] || continue; st "$f"; done; exit 0'
        )
        r = self._sh(script, p, limit=64 << 20)
        self._fail(p, r)
        return sorted(self._stats(r.stdout, p), key=lambda s: s.name)

    def remove(self, path: str, recursive: bool = False) -> None:
        p = self._check(path)
        if p.rstrip("/") == "":
            raise PathRefused("/: the sandbox root cannot be removed")
        script = (
            '[ -e "$1" ] || [ -L "$1" ] || { echo "corral: missing" >&2; exit 1; }; '
            f'if [ -d "$1" ] && [ ! -L "$1" ]; then '
            f'if [ "$2" = 1 ]; then {BB} rm -rf "$1"; else {BB} rmdir "$1"; fi; '
            f'else {BB} rm -f "$1"; fi'
        )
        self._fail(p, self._sh(script, p, "1" if recursive else "0"))

    def mkdir(
        self,
        path: str,
        parents: bool = True,
        mode: int = 0o755,
        *,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        """``mkdir`` in the guest (as root); with an owner, the directories it made are
        handed to it by counting the missing ones first (``chown -h``: never through a
        symlink the guest put there, though inside a VM that is the guest's own view)."""
        p = self._check(path)
        for v, what in ((owner_uid, "owner_uid"), (owner_gid, "owner_gid")):
            if not isinstance(v, int) or not 0 <= v < 1 << 32:
                raise InvalidRequest(f"{p}: {what} {v!r} is not a uid/gid")
        flag = "-p" if parents else ""
        script = f'{BB} mkdir {flag} -m "$2" "$1"' if flag else f'{BB} mkdir -m "$2" "$1"'
        if owner_uid or owner_gid:
            script = (
                'd="$1"; n=0; while [ ! -e "$d" ] && [ ! -L "$d" ]; do '
                f'n=$((n + 1)); d="$({BB} dirname "$d")"; done; '
                f"{script} || exit 1; "
                'd="$1"; while [ "$n" -gt 0 ]; do '
                f'{BB} chown -h "$3" "$d" || exit 1; d="$({BB} dirname "$d")"; n=$((n - 1)); done'
            )
        r = self._sh(script, p, f"{mode & 0o7777:o}", f"{owner_uid}:{owner_gid}")
        if r.code != 0 and b"File exists" in r.stderr:
            from corral.errors import Conflict

            raise Conflict(f"{p}: exists")
        self._fail(p, r)

    def upload_tar(self, path: str, data: bytes) -> int:
        p = self._check(path)
        if len(data) > self.max_file:
            raise InvalidRequest(f"{p}: the archive exceeds the limit of {self.max_file} bytes")
        script = f'{BB} mkdir -p "$1" && {BB} tar -x -C "$1" -f - -v | {BB} wc -l'
        r = self._sh(script, p, stdin=bytes(data))
        if r.code != 0:
            raise InvalidRequest(
                f"{p}: not a valid tar archive or not extractable: "
                f"{r.stderr.decode(errors='replace').strip()[-300:]}"
            )
        try:
            return int(r.stdout.strip() or b"0")
        except ValueError:
            return 0

    def download_tar(self, path: str) -> bytes:
        p = self._check(path)
        script = (
            '[ -e "$1" ] || [ -L "$1" ] || { echo "corral: missing" >&2; exit 1; }; '
            f'if [ -d "$1" ] && [ ! -L "$1" ]; then {BB} tar -c -C "$1" -f - .; '
            f'else {BB} tar -c -C "$({BB} dirname "$1")" -f - "$({BB} basename "$1")"; fi'
        )
        r = self._sh(script, p, limit=self.max_file)
        self._fail(p, r)
        if r.out_trunc:
            raise InvalidRequest(f"{p}: the archive exceeds the limit of {self.max_file} bytes")
        return bytes(r.stdout)
