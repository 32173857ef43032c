"""Handles on one sandbox: ``Sandbox`` and what hangs off it (processes, shells, files).

Every handle holds the ``NodeOps`` it came from and the ids it needs, nothing else: all
state lives on the node, so a handle is cheap and can be rebuilt from an id.
"""

from __future__ import annotations

import asyncio
import builtins
import io
import os
import posixpath
import tarfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from pydantic import ValidationError

from corral.errors import InvalidRequest, NotFound, SandboxError
from corral.ops import NodeOps, PtyStream
from corral.sdk._desktop import Display
from corral.sdk._network import Network
from corral.sdk._ports import Ports
from corral.spec import (
    Event,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileStat,
    ForkRequest,
    ImageInfo,
    Limits,
    ProcessInfo,
    PtyRequest,
    SandboxInfo,
    ShellInfo,
    validation_message,
)

__all__ = ["Sandbox", "ExecStream", "Process", "Shell", "Files"]

# Handles are made by the client (named constructors); a bare ``Sandbox(...)`` would be a
# handle on nothing, so __init__ refuses callers that do not hold this key.
_KEY = object()

# Process.wait(None) polls in slices so that no single request outlives HTTP idle timeouts.
_WAIT_SLICE = 60.0


def invalid_request(exc: ValidationError) -> InvalidRequest:
    """Turn a pydantic error into InvalidRequest naming each field (``limits.memory: ...``)."""
    return InvalidRequest(validation_message(exc))


def _check_key(key: object, what: str) -> None:
    if key is not _KEY:
        raise TypeError(f"{what} handles are not built directly; {_HOW[what]}")


_HOW = {
    "Sandbox": "use client.sandboxes.create(), .get() or .list()",
    "ExecStream": "use sandbox.exec_stream()",
    "Process": "use sandbox.spawn() or sandbox.processes()",
    "Shell": "use sandbox.shell()",
    "Files": "use sandbox.files",
}


def _to_bytes(data: bytes | str | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data


def exec_request(
    cmd: Sequence[str] | str,
    *,
    stdin: bytes | str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | int | None = None,
    timeout: float | None = None,
    output_limit: int | str | None = None,
) -> ExecRequest:
    """Build and validate an ExecRequest; a str ``cmd`` runs through ``/bin/sh -c``."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    try:
        return ExecRequest.model_validate(
            {
                "cmd": argv,
                "stdin": _to_bytes(stdin),
                "env": dict(env or {}),
                "cwd": cwd,
                "user": None if user is None else str(user),
                "timeout": timeout,
                "output_limit": output_limit,
            }
        )
    except ValidationError as exc:
        raise invalid_request(exc) from None


class Sandbox:
    """A handle on one sandbox.

    Example:
        >>> sb = await client.sandboxes.create(image="demo/python", ttl=600)  # doctest: +SKIP
        >>> (await sb.exec("echo hi")).stdout                                 # doctest: +SKIP
        b'hi\\n'
        >>> await sb.destroy()                                                # doctest: +SKIP

    ``async with sb:`` destroys the sandbox when the block ends.
    """

    __slots__ = ("_ops", "_info", "_files", "_network", "_ports", "_desktop")

    def __init__(self, ops: NodeOps, info: SandboxInfo, _key: object = None) -> None:
        _check_key(_key, "Sandbox")
        self._ops = ops
        self._info = info
        self._files = Files(ops, info.id, _KEY)
        self._network = Network(ops, info.id, self._set_info)
        self._ports = Ports(ops, info.id)
        self._desktop = Display(ops, info.id)

    def _set_info(self, info: SandboxInfo) -> None:
        self._info = info

    @classmethod
    def _wrap(cls, ops: NodeOps, info: SandboxInfo) -> Sandbox:
        return cls(ops, info, _KEY)

    @classmethod
    async def _from_id(cls, ops: NodeOps, sandbox_id: str) -> Sandbox:
        return cls(ops, await ops.sandbox_get(sandbox_id), _KEY)

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> SandboxInfo:
        """What the node said about this sandbox last time (see ``refresh``)."""
        return self._info

    @property
    def files(self) -> Files:
        return self._files

    @property
    def network(self) -> Network:
        """Egress policy, changeable while the sandbox runs (``await sb.network.update(...)``)."""
        return self._network

    @property
    def ports(self) -> Ports:
        """Servers the guest runs, reached through the node (``await sb.ports.expose(8000)``)."""
        return self._ports

    @property
    def desktop(self) -> Display:
        """Screen and input of a ``vm`` sandbox created with a desktop
        (``png = await sb.desktop.screenshot(); await sb.desktop.click(10, 10)``)."""
        return self._desktop

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, image={self._info.image!r}, state={self._info.state!r})"

    async def refresh(self) -> SandboxInfo:
        self._info = await self._ops.sandbox_get(self.id)
        return self._info

    async def exec(
        self,
        cmd: Sequence[str] | str,
        *,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        output_limit: int | str | None = None,
    ) -> ExecResult:
        """Run ``cmd`` to completion and return how it ended (never raises on exit status)."""
        req = exec_request(
            cmd,
            stdin=stdin,
            env=env,
            cwd=cwd,
            user=user,
            timeout=timeout,
            output_limit=output_limit,
        )
        return await self._ops.exec(self.id, req)

    def exec_stream(
        self,
        cmd: Sequence[str] | str,
        *,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        output_limit: int | str | None = None,
    ) -> ExecStream:
        """Run ``cmd`` and iterate its output as it comes.

        Example:
            >>> async with sb.exec_stream(["make", "test"]) as stream:  # doctest: +SKIP
            ...     async for chunk in stream:
            ...         print(chunk.stream, chunk.data)
            >>> stream.result.exit_code                               # doctest: +SKIP
        """
        req = exec_request(
            cmd,
            stdin=stdin,
            env=env,
            cwd=cwd,
            user=user,
            timeout=timeout,
            output_limit=output_limit,
        )
        return ExecStream(self._ops, self.id, req, _KEY)

    async def spawn(
        self,
        cmd: Sequence[str] | str,
        *,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        output_limit: int | str | None = None,
    ) -> Process:
        """Start ``cmd`` in the background and return at once."""
        req = exec_request(
            cmd,
            stdin=stdin,
            env=env,
            cwd=cwd,
            user=user,
            timeout=timeout,
            output_limit=output_limit,
        )
        return Process(self._ops, self.id, await self._ops.spawn(self.id, req), _KEY)

    async def processes(self) -> builtins.list[Process]:
        """Background processes started with ``spawn`` (running or ended)."""
        return [Process(self._ops, self.id, p, _KEY) for p in await self._ops.process_list(self.id)]

    async def pty(
        self,
        cmd: Sequence[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
    ) -> PtyStream:
        """An interactive terminal (async only), not yet started: ``async with`` it, write
        keystrokes, iterate its output bytes; ``result`` says how it ended. No ``cmd``:
        ``bash -l`` where the image has bash, else ``/bin/sh``.

        Example:
            >>> async with await sb.pty(["/bin/sh"]) as t:               # doctest: +SKIP
            ...     await t.write(b"echo hi; exit 3\\n")
            ...     out = b"".join([d async for d in t])
            >>> t.result.exit_code                                       # doctest: +SKIP
            3
        """
        fields = {
            "cmd": None
            if cmd is None
            else ["/bin/sh", "-c", cmd]
            if isinstance(cmd, str)
            else list(cmd),
            "rows": rows,
            "cols": cols,
            "env": dict(env or {}),
            "cwd": cwd,
            "user": None if user is None else str(user),
        }
        try:
            req = PtyRequest.model_validate(fields)
        except ValidationError as exc:
            raise invalid_request(exc) from None
        return await self._ops.pty(self.id, req)

    async def shell(self, cwd: str | None = None, env: Mapping[str, str] | None = None) -> Shell:
        """Open a shell session whose cwd and environment persist between ``run`` calls."""
        info = await self._ops.shell_open(self.id, cwd=cwd, env=dict(env) if env else None)
        return Shell(self._ops, self.id, info, _KEY)

    async def events(
        self, kinds: Sequence[str] | None = None, after: str | None = None, limit: int = 1000
    ) -> builtins.list[Event]:
        """This sandbox's lifecycle and security events, oldest first (only ``kinds``),
        after the cursor ``after``, at most ``limit``; page on with the last one's cursor."""
        if isinstance(kinds, str):
            raise InvalidRequest("kinds: give a list of event kinds, not one string")
        return await self._ops.events(
            sandbox_id=self.id, after=after, kinds=list(kinds) if kinds else None, limit=limit
        )

    async def destroy(self) -> None:
        await self._ops.sandbox_destroy(self.id)

    async def set_ttl(self, seconds: float | None) -> SandboxInfo:
        """Destroy the sandbox ``seconds`` from now (None: no TTL), replacing the TTL it
        was created with, earlier or later; the node records it, so it holds over a
        restart of the node."""
        self._info = await self._ops.sandbox_set_ttl(self.id, seconds)
        return self._info

    async def pause(self, memory_snapshot: bool = False) -> SandboxInfo:
        """Freeze every process and move the sandbox's memory to swap; all state stays.
        Any later request (exec, files, shell) resumes it first, or call ``resume``.
        ``memory_snapshot`` (microVMs): the machine is saved to a file and its VMM ends,
        so none of its memory stays on the host; a request or ``resume`` restores it."""
        self._info = await self._ops.sandbox_pause(self.id, memory_snapshot)
        return self._info

    async def resume(self, prefetch: bool = False) -> SandboxInfo:
        """Thaw a paused sandbox. Its memory comes back from swap as it is touched, or, with
        ``prefetch``, is all read back at once (worth it when the agent is about to work on
        it; returns once the reads are started, its ``resumed`` event has the figures).

        Example:
            >>> await sb.resume(prefetch=True)                            # doctest: +SKIP
        """
        self._info = await self._ops.sandbox_resume(self.id, prefetch)
        return self._info

    async def snapshot(self, name: str | None = None) -> ImageInfo:
        """Pack this sandbox's filesystem changes into a new layer of the store and return
        the image (this sandbox's image layers + that layer), named ``name`` or
        ``snapshot/<id>:<UTC time>`` (an image of that name is replaced). The sandbox is
        frozen for a few ms only; a paused one stays paused. Processes and shell sessions
        are not part of it.

        Example:
            >>> snap = await sb.snapshot()                               # doctest: +SKIP
            >>> copy = await client.sandboxes.create(image=snap)         # doctest: +SKIP
        """
        return await self._ops.sandbox_snapshot(self.id, name)

    async def fork(
        self,
        n: int = 1,
        *,
        limits: Limits | Mapping[str, Any] | None = None,
        labels: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        ttl: float | None = None,
        idle_timeout: float | None = None,
    ) -> builtins.list[Sandbox]:
        """``n`` new sandboxes that start from this sandbox's current files (copy-on-write,
        cheap whatever their size). Processes are not cloned: each child boots a fresh
        init. Children inherit this sandbox's spec except what is given here, and are
        independent sandboxes afterwards. All or nothing: on failure none is left.

        Example:
            >>> kids = await sb.fork(8, labels={"branch": "try"})        # doctest: +SKIP
        """
        fields: dict[str, Any] = {
            "count": n,
            "limits": limits,
            "labels": dict(labels) if labels is not None else None,
            "env": dict(env) if env is not None else None,
            "ttl": ttl,
            "idle_timeout": idle_timeout,
        }
        try:
            req = ForkRequest.model_validate(fields)
        except ValidationError as exc:
            raise invalid_request(exc) from None
        return [Sandbox._wrap(self._ops, i) for i in await self._ops.sandbox_fork(self.id, req)]

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.destroy()
        except NotFound:
            pass  # already gone (destroyed in the block, or reaped by its TTL)


class ExecStream:
    """Output of a streaming exec: an async iterator of ExecChunk; ``result`` at the end.

    Leaving the ``async with`` block early stops reading; the node then ends the command.
    """

    __slots__ = ("_ops", "_sandbox_id", "_req", "_it", "result")

    def __init__(self, ops: NodeOps, sandbox_id: str, req: ExecRequest, _key: object = None):
        _check_key(_key, "ExecStream")
        self._ops, self._sandbox_id, self._req = ops, sandbox_id, req
        self._it: AsyncIterator[ExecChunk | ExecResult] | None = None
        self.result: ExecResult | None = None
        """How the command ended; set once the iterator is exhausted."""

    def __aiter__(self) -> ExecStream:
        return self

    async def __anext__(self) -> ExecChunk:
        if self.result is not None:
            raise StopAsyncIteration
        if self._it is None:
            self._it = aiter(self._ops.exec_stream(self._sandbox_id, self._req))
        try:
            item = await anext(self._it)
        except StopAsyncIteration:
            raise SandboxError(
                f"exec stream of {self._req.cmd[0]!r} in {self._sandbox_id} ended without a result"
            ) from None
        if isinstance(item, ExecResult):
            self.result = item
            await self.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        aclose = getattr(self._it, "aclose", None)
        if aclose is not None:
            await aclose()

    async def __aenter__(self) -> ExecStream:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class Process:
    """A background process started with ``Sandbox.spawn``."""

    __slots__ = ("_ops", "_sandbox_id", "_info")

    def __init__(self, ops: NodeOps, sandbox_id: str, info: ProcessInfo, _key: object = None):
        _check_key(_key, "Process")
        self._ops, self._sandbox_id, self._info = ops, sandbox_id, info

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def pid(self) -> int:
        """Pid inside the sandbox."""
        return self._info.pid

    @property
    def info(self) -> ProcessInfo:
        return self._info

    def __repr__(self) -> str:
        return f"Process(id={self.id!r}, pid={self.pid}, cmd={self._info.cmd!r})"

    async def refresh(self) -> ProcessInfo:
        self._info = await self._ops.process_get(self._sandbox_id, self.id)
        return self._info

    async def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait until the process ends; raises ``TimeoutError`` if it still runs after
        ``timeout`` seconds (the process keeps running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _WAIT_SLICE if deadline is None else max(deadline - time.monotonic(), 0.0)
            self._info = await self._ops.process_get(
                self._sandbox_id, self.id, wait=min(left, _WAIT_SLICE)
            )
            if self._info.result is not None:
                return self._info.result
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"process {self.id} ({self._info.cmd[0]}) still runs after {timeout} s"
                )

    async def kill(self, signal: int = 9) -> None:
        await self._ops.process_kill(self._sandbox_id, self.id, signal=signal)

    async def output(self) -> tuple[bytes, bytes]:
        """(stdout, stderr) buffered so far, or the whole output once it has ended."""
        info = await self.refresh()
        if info.result is not None and (info.result.stdout or info.result.stderr):
            return info.result.stdout, info.result.stderr
        return info.stdout, info.stderr


class Shell:
    """A persistent shell session: one shell process in the sandbox runs every ``run``, so
    variables, options, traps, jobs, cwd, functions and aliases carry over."""

    __slots__ = ("_ops", "_sandbox_id", "_info")

    def __init__(self, ops: NodeOps, sandbox_id: str, info: ShellInfo, _key: object = None):
        _check_key(_key, "Shell")
        self._ops, self._sandbox_id, self._info = ops, sandbox_id, info

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> ShellInfo:
        return self._info

    def __repr__(self) -> str:
        return f"Shell(id={self.id!r}, sandbox={self._sandbox_id!r})"

    async def run(
        self, command: str, timeout: float | None = None, stdin: bytes | str | None = None
    ) -> ExecResult:
        return await self._ops.shell_run(
            self._sandbox_id, self.id, command, timeout=timeout, stdin=_to_bytes(stdin)
        )

    async def interrupt(self) -> None:
        """Stop the running command with SIGINT, as Ctrl-C would: its ``run`` returns
        (exit code 130 for a command SIGINT killed) and the session keeps its state."""
        await self._ops.shell_interrupt(self._sandbox_id, self.id)

    async def close(self) -> None:
        await self._ops.shell_close(self._sandbox_id, self.id)

    async def __aenter__(self) -> Shell:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.close()
        except NotFound:
            pass  # the sandbox (and with it the shell) is already gone


class Files:
    """Files of one sandbox. Paths are absolute paths inside the sandbox.

    ``upload`` and ``download`` put the named entry itself into the target directory, like
    ``docker cp``: ``upload("proj", "/work")`` creates ``/work/proj``;
    ``download("/work/proj", "out")`` creates ``out/proj``.
    """

    __slots__ = ("_ops", "_sandbox_id")

    def __init__(self, ops: NodeOps, sandbox_id: str, _key: object = None) -> None:
        _check_key(_key, "Files")
        self._ops, self._sandbox_id = ops, sandbox_id

    def __repr__(self) -> str:
        return f"Files(sandbox={self._sandbox_id!r})"

    async def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return await self._ops.file_read(self._sandbox_id, path, offset=offset, length=length)

    async def read_text(self, path: str, encoding: str = "utf-8", errors: str = "strict") -> str:
        return (await self.read(path)).decode(encoding, errors)

    async def write(
        self, path: str, data: bytes | str, mode: int = 0o644, append: bool = False
    ) -> None:
        await self._ops.file_write(
            self._sandbox_id,
            path,
            data.encode() if isinstance(data, str) else data,
            mode=mode,
            append=append,
        )

    async def list(self, path: str) -> builtins.list[FileStat]:
        return await self._ops.file_list(self._sandbox_id, path)

    async def stat(self, path: str) -> FileStat:
        return await self._ops.file_stat(self._sandbox_id, path)

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._ops.file_remove(self._sandbox_id, path, recursive=recursive)

    async def mkdir(self, path: str, parents: bool = True, mode: int = 0o755) -> None:
        await self._ops.file_mkdir(self._sandbox_id, path, parents=parents, mode=mode)

    async def upload(self, local_path: str | os.PathLike[str], remote_dir: str) -> str:
        """Copy a local file, symlink or directory into ``remote_dir`` (created if
        missing); returns the remote path of the copy."""
        src = Path(local_path)
        if not src.exists() and not src.is_symlink():
            raise InvalidRequest(f"upload: local path {str(src)!r} does not exist")
        data = await asyncio.to_thread(_tar_local, src)
        await self._ops.file_upload_tar(self._sandbox_id, remote_dir, data)
        return posixpath.join(remote_dir, _local_name(src))

    async def download(self, remote_path: str, local_dir: str | os.PathLike[str]) -> Path:
        """Copy a remote file, symlink or directory into ``local_dir``; returns the local
        path of the copy.

        Extraction refuses absolute names, ``..``, links out of ``local_dir`` and device
        files (tarfile's ``data`` filter): the sandbox's content is untrusted.
        """
        name = posixpath.basename(posixpath.normpath(remote_path)) or "root"
        # the node names a directory's members relative to it and a file's after the file
        is_dir = (await self.stat(remote_path)).type == "dir"
        data = await self._ops.file_download_tar(self._sandbox_id, remote_path)
        dest = Path(local_dir)
        await asyncio.to_thread(_untar_local, data, dest / name if is_dir else dest)
        return dest / name


def _local_name(src: Path) -> str:
    # abspath folds "." and ".." without following a symlink (resolve() would name the target)
    return os.path.basename(os.path.abspath(src))


def _tar_local(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=_local_name(src), recursive=True)
    return buf.getvalue()


def _untar_local(data: bytes, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise InvalidRequest(f"download: refused or failed to extract into {dest}: {exc}") from exc
