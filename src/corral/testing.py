"""An in-memory NodeOps for SDK and API unit tests.

``FakeNode`` keeps sandboxes, files and events in dicts and fakes a handful of commands
(``echo``, ``true``, ``false``, ``cat``, ``sleep``, ``pwd``, ``printenv``, ``id -u``/``-g``,
``kill -SIG $$``, ``exit``, ``cd``, ``export``, ``K=V`` and ``sh -c`` scripts joined with ``;``, ``&&``,
``||``, with ``$VAR`` and ``>&2``), enough to exercise every code path of a transport. The
contract suite in tests/contract holds it to the real node's observable behaviour. It runs nothing and isolates nothing: never use it outside tests.

Example:
    >>> import asyncio, corral
    >>> from corral.testing import FakeNode
    >>> async def demo() -> bytes:
    ...     async with corral.AsyncClient(ops=FakeNode()) as client:
    ...         sb = await client.sandboxes.create(image="demo/python")
    ...         return (await sb.exec(["echo", "hi"])).stdout
    >>> asyncio.run(demo())
    b'hi\\n'
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import posixpath
import re
import secrets
import shlex
import signal
import string
import tarfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from corral.errors import (
    CapacityError,
    Conflict,
    ImageNotFound,
    InvalidRequest,
    LayerNotFound,
    NotFound,
    PathRefused,
    ProcessNotFound,
    SandboxNotFound,
)
from corral.ops import (
    NodeOps,
    check_events_limit,
    cursor_positions,
    default_shell,
    stamp_events,
)
from corral.spec import (
    NODE_ID_RE,
    BackendStatus,
    CallRequest,
    CallResult,
    DesktopInput,
    Event,
    EventSummary,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileStat,
    ForkRequest,
    ImageInfo,
    JudgeRequest,
    JudgeResult,
    LayerInfo,
    NetworkPolicy,
    NodeStatus,
    ProcessInfo,
    PtyRequest,
    SandboxInfo,
    SandboxSpec,
    ShellInfo,
    new_sandbox_id,
    validation_message,
)

__all__ = [
    "FakeNode",
    "FakePty",
    "FakeBackend",
    "FakeCgroups",
    "FakeScratch",
    "open_fake_node",
]

# The real Node on a fake engine (no root): corral.testing_backend.
from corral.testing_backend import (  # noqa: E402
    FakeBackend,
    FakeCgroups,
    FakeScratch,
    open_fake_node,
)

_BASE_LAYER = "sha256:" + "0" * 64
_PY_LAYER = "sha256:" + "1" * 64
_ID_ALPHABET = string.digits + string.ascii_lowercase
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_TO_STDERR = "\0stderr"  # stands for ">&2" while a script is split into words
_VAR_RE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")

Emit = Callable[[str, bytes], None]


def _new_id(prefix: str, n: int = 12) -> str:
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(n))


def _digest(name: str) -> str:
    return "sha256:" + name.encode().hex().ljust(64, "0")[:64]


@dataclass
class _Proc:
    info: ProcessInfo
    task: asyncio.Task[ExecResult]
    out: dict[str, bytearray] = field(
        default_factory=lambda: {"stdout": bytearray(), "stderr": bytearray()}
    )
    """Output so far, capped at the output limit (a node's init buffers it so)."""


@dataclass
class _Shell:
    info: ShellInfo
    env: dict[str, str]


_ETC = {
    "/etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
    "/etc/group": b"root:x:0:\nnogroup:x:65534:\n",
}


@dataclass
class _Sandbox:
    info: SandboxInfo
    files: dict[str, bytes] = field(default_factory=lambda: dict(_ETC))
    modes: dict[str, int] = field(default_factory=dict)
    owners: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Owner (uid, gid inside) of entries made with one; root otherwise."""
    links: dict[str, str] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/tmp", "/work", "/etc"})
    procs: dict[str, _Proc] = field(default_factory=dict)
    shells: dict[str, _Shell] = field(default_factory=dict)


def _copy_fs(src: _Sandbox, dst: _Sandbox) -> _Sandbox:
    """Copy the files of ``src`` into ``dst`` (snapshot and fork: files, not processes)."""
    dst.files, dst.modes, dst.links = dict(src.files), dict(src.modes), dict(src.links)
    dst.owners = dict(src.owners)
    dst.dirs = set(src.dirs)
    return dst


class _Run:
    """State of one fake command run: its output, cwd and env (shells keep the last two)."""

    def __init__(
        self,
        sb: _Sandbox,
        env: dict[str, str],
        cwd: str,
        stdin: bytes | None,
        deadline: float | None,
        emit: Emit,
        ids: tuple[int, int] = (0, 0),
    ) -> None:
        self.sb, self.env, self.cwd, self.stdin = sb, env, cwd, stdin
        self.deadline, self.emit = deadline, emit
        self.uid, self.gid = ids
        self.timed_out = False
        self.signal: int | None = None  # set by ``kill -SIG $$``: the script killed itself


class FakeNode(NodeOps):
    """In-memory stand-in for the node; seeded with images ``demo/base`` and ``demo/python``.

    ``node_id`` names it in sandbox ids and event cursors (default: 12 random characters,
    like a real node's), so several FakeNodes can stand for a fleet. Its one backend is
    called ``container``, as a real node's default is."""

    BACKENDS = ("container",)

    def __init__(
        self,
        node_id: str | None = None,
        *,
        max_sandboxes: int = 0,
        labels: dict[str, str] | None = None,
    ) -> None:
        if node_id is None:
            node_id = secrets.token_hex(6)
        if not NODE_ID_RE.fullmatch(node_id):
            raise ValueError(f"node id {node_id[:40]!r} must be 1-16 of [0-9a-z]")
        self.node_id = node_id
        now = time.time()
        self._layers = {
            _BASE_LAYER: LayerInfo(digest=_BASE_LAYER, size=1 << 20, kind="dir", created_at=now),
            _PY_LAYER: LayerInfo(digest=_PY_LAYER, size=4 << 20, kind="pip", created_at=now),
        }
        self._images: dict[str, ImageInfo] = {}
        self._snapshots: dict[str, _Sandbox] = {}  # image digest -> files it restores
        for name, layers in (
            ("demo/base", [_BASE_LAYER]),
            ("demo/python", [_BASE_LAYER, _PY_LAYER]),
        ):
            self._images[name] = ImageInfo(
                name=name, digest=_digest(name), layers=layers, created_at=now
            )
        self._sandboxes: dict[str, _Sandbox] = {}
        self._destroyed: dict[str, SandboxInfo] = {}  # as a node's state db keeps them
        self._events: list[Event] = []
        self.network_permissions: set[str] = {"pkgs", "npm"}
        """Permission names this fake node knows (a real node: its config)."""
        self._next_pid = 100
        self.max_sandboxes = max_sandboxes
        """Most live sandboxes (0: no limit), as a node's config says."""
        self.labels: dict[str, str] = dict(labels or {})
        """The node's labels, as in its config."""

    # ---------------------------------------------------------------- images
    async def image_get(self, name: str) -> ImageInfo:
        for img in self._images.values():
            if name in (img.name, img.digest):
                return img
        raise ImageNotFound(f"image {name!r} is not in the store")

    async def image_list(self) -> list[ImageInfo]:
        return sorted(self._images.values(), key=lambda i: i.name)

    async def image_compose(
        self, name: str, layers: list[str], env: dict[str, str] | None = None, workdir: str = "/"
    ) -> ImageInfo:
        from corral.images.store import check_image_name

        check_image_name(name)
        if not layers:
            raise InvalidRequest(f"image {name!r} needs at least one layer")
        for digest in layers:
            if digest not in self._layers:
                raise LayerNotFound(f"layer {digest} is not in the store")
        img = ImageInfo(
            name=name,
            digest=_digest(name + "|" + ",".join(layers)),
            layers=layers,
            env=env or {},
            workdir=workdir,
        )
        self._images[name] = img
        return img

    async def image_remove(self, name: str) -> None:
        if name not in self._images:
            raise ImageNotFound(f"image {name!r} is not in the store")
        del self._images[name]

    async def layer_list(self) -> list[LayerInfo]:
        return list(self._layers.values())

    # ------------------------------------------------------------- lifecycle
    def _check_permissions(self, names: list[str]) -> None:
        unknown = [n for n in names if n not in self.network_permissions]
        if unknown:
            raise InvalidRequest(f"network: unknown permission {', '.join(map(repr, unknown))}")

    async def sandbox_set_ttl(self, sandbox_id: str, ttl: float | None) -> SandboxInfo:
        if ttl is not None and not ttl > 0:
            raise InvalidRequest(f"ttl: {ttl!r} is not a positive number of seconds")
        sb = self._sb(sandbox_id, wake=False)
        expires_at = None if ttl is None else time.time() + ttl
        sb.info = sb.info.model_copy(update={"expires_at": expires_at})
        self._event(sandbox_id, "ttl_set", expires_at=str(expires_at or ""))
        return sb.info

    async def network_update(
        self, sandbox_id: str, allow: list[str] | None = None, deny: list[str] | None = None
    ) -> SandboxInfo:
        sb = self._sb(sandbox_id)
        cur = sb.info.spec.network
        try:
            policy = NetworkPolicy(
                allow=cur.allow if allow is None else allow, deny=cur.deny if deny is None else deny
            )
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
        self._check_permissions([*policy.allow, *policy.deny])
        sb.info = sb.info.model_copy(
            update={"spec": sb.info.spec.model_copy(update={"network": policy})}
        )
        detail = {"allow": ",".join(policy.allow), "deny": ",".join(policy.deny)}
        self._event(sandbox_id, "network_updated", **detail)
        return sb.info

    async def desktop_screenshot(self, sandbox_id: str) -> bytes:
        sb = self._sb(sandbox_id)
        raise InvalidRequest(
            f"sandbox {sandbox_id} has no display (backend {sb.info.backend!r}); "
            "desktops run on the 'vm' backend"
        )

    async def desktop_input(self, sandbox_id: str, req: DesktopInput) -> None:
        await self.desktop_screenshot(sandbox_id)

    async def sandbox_create(self, spec: SandboxSpec) -> SandboxInfo:
        backend = spec.backend or self.BACKENDS[0]
        if backend not in self.BACKENDS:
            raise InvalidRequest(
                f"backend: node {self.node_id} has no backend {backend!r} "
                f"(it has: {', '.join(self.BACKENDS)})"
            )
        if spec.desktop is not None and backend != "vm":
            raise InvalidRequest(
                f"desktop: only the 'vm' backend has a display; this sandbox's backend is "
                f"{backend!r}"
            )
        img = await self.image_get(spec.image)
        self._check_permissions([*spec.network.allow, *spec.network.deny])
        if self.max_sandboxes and len(self._sandboxes) >= self.max_sandboxes:
            raise CapacityError(
                f"node {self.node_id} is full: {len(self._sandboxes)} sandboxes "
                f"(max_sandboxes {self.max_sandboxes})"
            )
        now = time.time()
        info = SandboxInfo(
            id=new_sandbox_id(self.node_id),
            state="running",
            image=spec.image,
            image_digest=img.digest,
            layers=list(img.layers),
            image_env=dict(img.env),
            # as on a node: the image's workdir unless the spec names one
            spec=spec if spec.workdir != "/" else spec.model_copy(update={"workdir": img.workdir}),
            created_at=now,
            last_active_at=now,
            backend=backend,
            node_id=self.node_id,
            expires_at=None if spec.ttl is None else now + spec.ttl,
        )
        self._sandboxes[info.id] = _Sandbox(info=info)
        if img.digest in self._snapshots:
            _copy_fs(self._snapshots[img.digest], self._sandboxes[info.id])
        self._event(info.id, "created", image=spec.image)
        return info

    async def sandbox_get(self, sandbox_id: str) -> SandboxInfo:
        if sandbox_id in self._destroyed:
            return self._destroyed[sandbox_id]
        return self._sb(sandbox_id, wake=False).info

    async def sandbox_list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        want = labels or {}
        return [
            s.info
            for s in self._sandboxes.values()
            if all(s.info.spec.labels.get(k) == v for k, v in want.items())
        ]

    async def sandbox_pause(self, sandbox_id: str, memory_snapshot: bool = False) -> SandboxInfo:
        sb = self._sb(sandbox_id, wake=False)
        kind = sb.info.spec.backend or "container"
        if memory_snapshot and kind != "microvm":
            raise InvalidRequest(f"pause(memory_snapshot=True): not for {kind} sandboxes")
        if sb.info.state != "paused":
            sb.info = sb.info.model_copy(update={"state": "paused"})
            self._event(sandbox_id, "paused")
        return sb.info

    async def sandbox_resume(self, sandbox_id: str, prefetch: bool = False) -> SandboxInfo:
        sb = self._sb(sandbox_id, wake=False)
        if sb.info.state == "paused":
            sb.info = sb.info.model_copy(update={"state": "running"})
            more = {"prefetch": True} if prefetch else {}
            self._event(sandbox_id, "resumed", transparent=False, **more)
        return sb.info

    async def sandboxes_pause(self, labels: dict[str, str]) -> list[SandboxInfo]:
        if not labels:
            raise InvalidRequest("labels: name at least one label (e.g. job=...) to pause by")
        return [await self.sandbox_pause(i.id) for i in await self.sandbox_list(labels)]

    async def sandboxes_resume(
        self, labels: dict[str, str], prefetch: bool = False
    ) -> list[SandboxInfo]:
        if not labels:
            raise InvalidRequest("labels: name at least one label (e.g. job=...) to resume by")
        paused = [i for i in await self.sandbox_list(labels) if i.state == "paused"]
        return [await self.sandbox_resume(i.id, prefetch) for i in paused]

    async def sandbox_snapshot(self, sandbox_id: str, name: str | None = None) -> ImageInfo:
        sb = self._sb(sandbox_id, wake=False)
        content = repr(sorted(sb.files.items())) + repr(sorted(sb.links.items()))
        layer = "sha256:" + hashlib.sha256(content.encode()).hexdigest()
        self._layers[layer] = LayerInfo(digest=layer, size=len(content), kind="snapshot")
        base = self._images_by_digest(sb.info.image_digest)
        from corral.images.store import check_image_name

        img = await self.image_compose(
            check_image_name(name) if name else f"snapshot/{sandbox_id}:{len(self._snapshots)}",
            [*(base.layers if base else []), layer],
            env=dict(base.env) if base else {},
            workdir=sb.info.spec.workdir,
        )
        self._snapshots[img.digest] = _copy_fs(sb, _Sandbox(info=sb.info))
        self._event(sandbox_id, "snapshot", image=img.name)
        return img

    async def sandbox_fork(self, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        sb = self._sb(sandbox_id, wake=False)
        over = {k: v for k, v in req.model_dump(exclude={"count"}).items() if v is not None}
        try:
            spec = SandboxSpec.model_validate({**sb.info.spec.model_dump(), **over})
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
        if self.max_sandboxes and len(self._sandboxes) + req.count > self.max_sandboxes:
            raise CapacityError(  # all or nothing: refuse before creating any child
                f"node {self.node_id} is full: {len(self._sandboxes)} sandboxes + "
                f"{req.count} children > max_sandboxes {self.max_sandboxes}"
            )
        out = []
        for _ in range(req.count):
            info = await self.sandbox_create(spec)
            _copy_fs(sb, self._sandboxes[info.id])
            out.append(info)
        self._event(sandbox_id, "forked", count=str(req.count))
        return out

    def _images_by_digest(self, digest: str) -> ImageInfo | None:
        return next((i for i in self._images.values() if i.digest == digest), None)

    async def sandbox_destroy(self, sandbox_id: str) -> None:
        sb = self._sb(sandbox_id, wake=False)
        for p in sb.procs.values():
            p.task.cancel()
        del self._sandboxes[sandbox_id]
        self._destroyed[sandbox_id] = sb.info.model_copy(update={"state": "destroyed"})
        self._event(sandbox_id, "destroyed")

    # ------------------------------------------------------------------ exec
    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        sb = self._sb(sandbox_id)
        out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        result = await self._execute(sb, req, lambda s, d: out[s].extend(d))
        limit = self._limit(sb, req)
        result = result.model_copy(
            update={
                "stdout": bytes(out["stdout"][:limit]),
                "stderr": bytes(out["stderr"][:limit]),
                "stdout_truncated": len(out["stdout"]) > limit,
                "stderr_truncated": len(out["stderr"]) > limit,
            }
        )
        return self._ended(sandbox_id, result)

    async def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[ExecChunk | ExecResult]:
        sb = self._sb(sandbox_id)
        queue: asyncio.Queue[ExecChunk | None] = asyncio.Queue()
        limit = self._limit(sb, req)
        sent = {"stdout": 0, "stderr": 0}
        truncated = {"stdout": False, "stderr": False}

        def emit(stream: str, data: bytes) -> None:
            room = limit - sent[stream]
            if len(data) > room:
                truncated[stream] = True
                data = data[: max(room, 0)]
            if data:
                sent[stream] += len(data)
                queue.put_nowait(ExecChunk(stream=stream, data=data))  # type: ignore[arg-type]

        task = asyncio.ensure_future(self._execute(sb, req, emit))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (chunk := await queue.get()) is not None:
                yield chunk
            result = task.result()
        finally:
            task.cancel()
        result = result.model_copy(
            update={
                "stdout_truncated": truncated["stdout"],
                "stderr_truncated": truncated["stderr"],
            }
        )
        yield self._ended(sandbox_id, result)

    async def spawn(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        sb = self._sb(sandbox_id)
        if req.stdin is not None or req.tty:
            raise InvalidRequest("stdin/tty: background processes get no stdin; use exec_stream")
        _user_ids(sb, req.user)  # an unknown user is refused here, not in the background
        self._next_pid += 1
        info = ProcessInfo(id=_new_id("p-", 8), pid=self._next_pid, cmd=req.cmd, running=True)
        out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        limit = self._limit(sb, req)

        def keep(stream: str, data: bytes) -> None:  # past the cap it runs on, unrecorded
            out[stream].extend(data[: max(limit - len(out[stream]), 0)])

        # A background process has no timeout (as on a node).
        task = asyncio.ensure_future(
            self._execute(sb, req.model_copy(update={"timeout": None}), keep)
        )
        sb.procs[info.id] = _Proc(info=info, task=task, out=out)
        return info

    async def process_get(
        self, sandbox_id: str, process_id: str, wait: float | None = None
    ) -> ProcessInfo:
        proc = self._proc(sandbox_id, process_id)
        if wait is not None and not proc.task.done():
            await asyncio.wait([proc.task], timeout=wait)
        return self._proc_info(proc)

    async def process_kill(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        proc = self._proc(sandbox_id, process_id)
        if not 1 <= signal <= 64:
            raise InvalidRequest(f"signal: {signal} is not a signal number (1-64)")
        if not proc.task.done():
            proc.task.cancel()
            proc.info = proc.info.model_copy(
                update={
                    "result": ExecResult(
                        exit_code=None,
                        signal=signal,
                        reason="signaled",
                    )
                }
            )

    async def process_list(self, sandbox_id: str) -> list[ProcessInfo]:
        """Every process started (ended ones too), without output or result (as a node)."""
        return [
            self._proc_info(p).model_copy(update={"stdout": b"", "stderr": b"", "result": None})
            for p in self._sb(sandbox_id).procs.values()
        ]

    def _proc_info(self, proc: _Proc) -> ProcessInfo:
        if proc.info.result is None and proc.task.done() and not proc.task.cancelled():
            proc.info = proc.info.model_copy(update={"result": proc.task.result()})
        out = {k: bytes(v) for k, v in proc.out.items()}
        r = proc.info.result
        if r is None:
            return proc.info.model_copy(update=out)
        return proc.info.model_copy(
            update={"running": False, "result": r.model_copy(update=out), **out}
        )

    # ---------------------------------------------------------------- shells
    async def shell_open(
        self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ShellInfo:
        sb = self._sb(sandbox_id)
        info = ShellInfo(
            id=_new_id("sh-", 8), cwd=cwd or sb.info.spec.workdir, created_at=time.time()
        )
        sb.shells[info.id] = _Shell(info=info, env=_env(sb, env or {}))
        return info

    async def shell_run(
        self,
        sandbox_id: str,
        shell_id: str,
        command: str,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        sb = self._sb(sandbox_id)
        shell = sb.shells.get(shell_id)
        if shell is None:
            raise ProcessNotFound(f"shell {shell_id!r} is not open in sandbox {sandbox_id}")
        if "\0" in command:
            raise InvalidRequest("command: cannot contain NUL bytes")
        out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        run = _Run(
            sb, shell.env, shell.info.cwd, stdin, _deadline(timeout), lambda s, d: out[s].extend(d)
        )
        start = time.monotonic()
        code = await self._script(run, command)
        shell.info = shell.info.model_copy(update={"cwd": run.cwd})
        limit = sb.info.spec.limits.output  # a shell command is an exec with the defaults
        result = self._result(run, code, start).model_copy(
            update={
                "stdout": bytes(out["stdout"][:limit]),
                "stderr": bytes(out["stderr"][:limit]),
                "stdout_truncated": len(out["stdout"]) > limit,
                "stderr_truncated": len(out["stderr"]) > limit,
            }
        )
        return self._ended(sandbox_id, result)

    async def shell_interrupt(self, sandbox_id: str, shell_id: str) -> None:
        if shell_id not in self._sb(sandbox_id).shells:
            raise ProcessNotFound(f"shell {shell_id!r} is not open in sandbox {sandbox_id}")

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        if self._sb(sandbox_id).shells.pop(shell_id, None) is None:
            raise ProcessNotFound(f"shell {shell_id!r} is not open in sandbox {sandbox_id}")

    # ----------------------------------------------------------------- files
    async def file_read(
        self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None
    ) -> bytes:
        sb, p = self._sb(sandbox_id), _path(path)
        if offset < 0 or (length is not None and length < 0):
            raise InvalidRequest(f"{p}: offset and length cannot be negative")
        q = _resolve(sb, p)
        if q in sb.dirs:
            raise InvalidRequest(f"{p} is a directory")
        if q not in sb.files:
            raise NotFound(f"{p}: no such file in sandbox {sandbox_id}")
        data = sb.files[q][offset:]
        return data if length is None else data[:length]

    async def file_write(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, append: bool = False
    ) -> None:
        sb, p = self._sb(sandbox_id), _path(path)
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"{p}: mode {mode!r} is not a permission mode (0..0o7777)")
        if path.endswith("/"):
            raise InvalidRequest(f"{path!r}: a file path cannot end with '/'")
        p = _resolve(sb, p, follow=False)
        if p in sb.dirs:
            raise InvalidRequest(f"{p} is a directory")
        if append and p in sb.links:
            raise PathRefused(f"{p}: is a symlink (not followed here)")
        self._mkdirs(sb, posixpath.dirname(p))
        sb.links.pop(p, None)  # a write replaces a symlink, never writes through it
        sb.files[p] = (sb.files.get(p, b"") if append else b"") + data
        sb.modes[p] = mode

    async def file_list(self, sandbox_id: str, path: str) -> list[FileStat]:
        sb, p = self._sb(sandbox_id), _path(path)
        q = _resolve(sb, p)
        if q in sb.files:
            raise InvalidRequest(f"{p}: is not a directory")
        if q not in sb.dirs:
            raise NotFound(f"{p}: no such directory in sandbox {sandbox_id}")
        names = {
            x for x in (*sb.dirs, *sb.files, *sb.links) if x != q and posixpath.dirname(x) == q
        }
        return [
            self._stat(sb, n).model_copy(update={"path": posixpath.join(p, posixpath.basename(n))})
            for n in sorted(names)
        ]

    async def file_stat(self, sandbox_id: str, path: str) -> FileStat:
        sb, p = self._sb(sandbox_id), _path(path)
        q = _resolve(sb, p, follow=False)
        if q not in sb.dirs and q not in sb.files and q not in sb.links:
            raise NotFound(f"{p}: no such file or directory in sandbox {sandbox_id}")
        return self._stat(sb, q).model_copy(
            update={"path": p, "name": posixpath.basename(p) or "/"}
        )

    async def file_remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        sb, p = self._sb(sandbox_id), _path(path)
        if p == "/":
            raise InvalidRequest("cannot remove the sandbox root '/'")
        if p in sb.files or p in sb.links:
            sb.files.pop(p, None)
            sb.links.pop(p, None)
            return
        if p not in sb.dirs:
            raise NotFound(f"{p}: no such file or directory in sandbox {sandbox_id}")
        inside = [x for x in (*sb.dirs, *sb.files, *sb.links) if x.startswith(p.rstrip("/") + "/")]
        if inside and not recursive:
            raise InvalidRequest(f"{p}: directory is not empty (use recursive=True)")
        for x in inside:
            sb.files.pop(x, None)
            sb.links.pop(x, None)
            sb.dirs.discard(x)
        sb.dirs.discard(p)

    async def file_mkdir(
        self,
        sandbox_id: str,
        path: str,
        parents: bool = True,
        mode: int = 0o755,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        sb, p = self._sb(sandbox_id), _path(path)
        for v, what in ((owner_uid, "owner_uid"), (owner_gid, "owner_gid")):
            if not 0 <= v < 65536:
                raise InvalidRequest(f"{what} {v!r} is outside the sandbox's ids 0..65535")
        new = []
        d = p
        while d not in sb.dirs and d not in sb.files:  # what _mkdirs will create
            new.append(d)
            d = posixpath.dirname(d)
        if not parents and posixpath.dirname(p) not in sb.dirs:
            raise NotFound(f"{posixpath.dirname(p)}: no such directory in sandbox {sandbox_id}")
        if not parents and (p in sb.dirs or p in sb.files or p in sb.links):
            raise Conflict(f"{p}: already exists")
        self._mkdirs(sb, p, mode)
        for d in new:
            sb.owners[d] = (owner_uid, owner_gid)

    async def file_upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        sb, root = self._sb(sandbox_id), _path(path)
        self._mkdirs(sb, root)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for m in tar.getmembers():
                name = posixpath.normpath(m.name)
                if name.startswith(("/", "..")):
                    raise PathRefused(f"tar member {m.name!r} escapes {root}")
                dest = posixpath.join(root, name)
                if m.isdir():
                    self._mkdirs(sb, dest, m.mode)
                elif m.isfile():
                    f = tar.extractfile(m)
                    self._mkdirs(sb, posixpath.dirname(dest))
                    sb.files[dest] = f.read() if f else b""
                    sb.modes[dest] = m.mode
                elif m.issym():
                    sb.links[dest] = m.linkname
                else:
                    raise PathRefused(f"tar member {m.name!r} is a device or hard link")

    async def file_download_tar(self, sandbox_id: str, path: str) -> bytes:
        # like the real node: a directory's members are named relative to it; a file or
        # symlink gives one member named after it
        sb, root = self._sb(sandbox_id), _path(path)
        if root not in sb.dirs and root not in sb.files and root not in sb.links:
            raise NotFound(f"{root}: no such file or directory in sandbox {sandbox_id}")
        base = root if root in sb.dirs else posixpath.dirname(root)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for p in sorted({*sb.dirs, *sb.files, *sb.links}):
                if p == base or not (p == root or p.startswith(root.rstrip("/") + "/")):
                    continue
                ti = tarfile.TarInfo(posixpath.relpath(p, base))
                if p in sb.dirs:
                    ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(ti)
                elif p in sb.links:
                    ti.type, ti.linkname = tarfile.SYMTYPE, sb.links[p]
                    tar.addfile(ti)
                else:
                    ti.size, ti.mode = len(sb.files[p]), sb.modes.get(p, 0o644)
                    tar.addfile(ti, io.BytesIO(sb.files[p]))
        return buf.getvalue()

    # -------------------------------------------------------------- terminal
    async def pty(self, sandbox_id: str, req: PtyRequest) -> FakePty:
        """A toy terminal (see :class:`FakePty`); no ``cmd``: the default shell, picked
        as a node does (``/bin/sh`` unless a test wrote ``/bin/bash``)."""
        sb = self._sb(sandbox_id)
        cmd = req.cmd or await default_shell(self, sandbox_id)
        self._next_pid += 1
        return FakePty(
            self,
            sb,
            cmd,
            req.rows,
            req.cols,
            {**sb.info.spec.env, "TERM": "xterm-256color", **req.env},
            self._next_pid,
            cwd=req.cwd or sb.info.spec.workdir,
        )

    # ------------------------------------------------------- events and node
    async def events(
        self,
        sandbox_id: str | None = None,
        after: str | None = None,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        limit: int = 1000,
    ) -> list[Event]:
        positions = cursor_positions(after)
        check_events_limit(limit)
        since = positions.get(self.node_id, 0)
        if sandbox_id is not None:
            await self.sandbox_get(sandbox_id)  # unknown: SandboxNotFound, as on a node
        ids = None
        if labels is not None:
            infos = [*(s.info for s in self._sandboxes.values()), *self._destroyed.values()]
            ids = {i.id for i in infos if labels.items() <= i.spec.labels.items()}
        found = [
            e
            for e in self._events
            if e.id > since
            and (sandbox_id is None or e.sandbox_id == sandbox_id)
            and (ids is None or e.sandbox_id in ids)
            and (not kinds or e.kind in kinds)
        ]
        return stamp_events(found[:limit], self.node_id, positions)

    async def events_summary(
        self,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        sandbox_id: str | None = None,
    ) -> EventSummary:
        out = EventSummary(labels=dict(labels or {}))
        for e in self._events_of(sandbox_id, labels, kinds):
            if e.sandbox_id is None:
                continue
            n = e.detail.get("count")
            n = n if isinstance(n, int) else 1
            per = out.sandboxes.setdefault(e.sandbox_id, {})
            per[e.kind] = per.get(e.kind, 0) + n
            out.totals[e.kind] = out.totals.get(e.kind, 0) + n
        return out

    def _events_of(
        self, sandbox_id: str | None, labels: dict[str, str] | None, kinds: list[str] | None
    ) -> list[Event]:
        ids = None
        if labels is not None:
            ids = {
                sid
                for sid, sb in self._sandboxes.items()
                if all(sb.info.spec.labels.get(k) == v for k, v in labels.items())
            }
        return [
            e
            for e in self._events
            if (sandbox_id is None or e.sandbox_id == sandbox_id)
            and (ids is None or e.sandbox_id in ids)
            and (not kinds or e.kind in kinds)
        ]

    def record_event(self, sandbox_id: str | None, kind: str, **detail: str | int) -> None:
        """Add an event as the node would (tests of event consumers: summaries, the CLI)."""
        self._event(sandbox_id, kind, **detail)  # type: ignore[arg-type]

    # fncall: only bash, run by the fake shell in a throwaway fake sandbox per call
    async def fncall_run(self, req: CallRequest) -> CallResult:
        if req.language != "bash":
            raise InvalidRequest(
                f"language: FakeNode runs only 'bash' calls (its fake shell), not {req.language!r}"
            )
        now = time.time()
        spec = SandboxSpec(image=req.image or "fake/fncall")
        sb = _Sandbox(
            info=SandboxInfo(
                id=new_sandbox_id(self.node_id),
                state="running",
                image=spec.image,
                image_digest="",
                spec=spec,
                created_at=now,
                last_active_at=now,
                node_id=self.node_id,
            )
        )
        out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        r = await self._execute(
            sb,
            ExecRequest(
                cmd=["sh", "-c", req.code], stdin=req.stdin.encode(), timeout=req.limits.wall_time
            ),
            lambda s, d: out[s].extend(d),
        )
        cap = req.limits.output
        if len(out["stdout"]) > cap or len(out["stderr"]) > cap:
            status = "output_limit"
        elif r.reason == "timeout":
            status = "timeout"
        else:
            status = "ok" if r.exit_code == 0 else "runtime_error"
        return CallResult(
            status=status,  # type: ignore[arg-type]
            stdout=bytes(out["stdout"][:cap]).decode(errors="replace"),
            stderr=bytes(out["stderr"][:cap]).decode(errors="replace"),
            exit_code=r.exit_code,
            wall_time=r.duration,
            stdout_truncated=len(out["stdout"]) > cap,
            stderr_truncated=len(out["stderr"]) > cap,
        )

    async def fncall_judge(self, req: JudgeRequest) -> JudgeResult:
        from corral.backends.fncall.checkers import judged

        results = []
        for case in req.tests:
            r = await self.fncall_run(
                CallRequest(
                    language=req.language, code=req.code, stdin=case.stdin, limits=req.limits
                )
            )
            results.append(r)
            if req.stop_on_failure and r.status != "ok":
                break
        return await judged(req, results, self.fncall_run)

    async def node_status(self) -> NodeStatus:
        n = len(self._sandboxes)
        return NodeStatus(
            node_id=self.node_id,
            version="0",
            cgroup_mode="v2",
            sandboxes=n,
            running=sum(1 for s in self._sandboxes.values() if s.info.state == "running"),
            paused=sum(1 for s in self._sandboxes.values() if s.info.state == "paused"),
            state_dir="",
            store="",
            mounted_layers=0,
            mem_total=0,
            mem_available=0,
            max_sandboxes=self.max_sandboxes,
            default_backend=self.BACKENDS[0],
            backends=[BackendStatus(kind=k, detail={"runtime": "fake"}) for k in self.BACKENDS],
            labels=dict(self.labels),
        )

    async def close(self) -> None:
        for sb in self._sandboxes.values():
            for p in sb.procs.values():
                p.task.cancel()

    # --------------------------------------------------------------- helpers
    def _sb(self, sandbox_id: str, wake: bool = True) -> _Sandbox:
        """The sandbox; a request (``wake``) to a paused one resumes it, as a node does."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None and sandbox_id in self._destroyed:
            raise SandboxNotFound(f"sandbox {sandbox_id} is destroyed")
        if sb is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id[:80]!r} on node {self.node_id}")
        if wake and sb.info.state == "paused":
            sb.info = sb.info.model_copy(update={"state": "running"})
            self._event(sandbox_id, "resumed", transparent=True)
        return sb

    def _proc(self, sandbox_id: str, process_id: str) -> _Proc:
        proc = self._sb(sandbox_id).procs.get(process_id)
        if proc is None:
            raise ProcessNotFound(f"no process {process_id!r} in sandbox {sandbox_id}")
        return proc

    def _event(self, sandbox_id: str | None, kind: str, **detail: str | bool) -> None:
        self._events.append(
            Event(
                id=len(self._events) + 1,
                sandbox_id=sandbox_id,
                time=time.time(),
                kind=kind,
                detail=dict(detail),
            )
        )

    @staticmethod
    def _limit(sb: _Sandbox, req: ExecRequest) -> int:
        return sb.info.spec.limits.output if req.output_limit is None else req.output_limit

    def _ended(self, sandbox_id: str, r: ExecResult) -> ExecResult:
        """A foreground command's end as a node reports it: output past the cap stops it
        (reason ``output_limit``), and the limits it ran into are events."""
        if r.truncated and r.reason == "exited":
            r = r.model_copy(update={"reason": "output_limit", "exit_code": None, "signal": 9})
        if r.reason in ("timeout", "output_limit"):
            self._event(sandbox_id, r.reason)
        return r

    @staticmethod
    def _mkdirs(sb: _Sandbox, p: str, mode: int = 0o755) -> None:
        while p not in sb.dirs:
            if p in sb.files:
                raise Conflict(f"{p} is a file, not a directory")
            sb.dirs.add(p)
            sb.modes[p] = mode
            p = posixpath.dirname(p)

    @staticmethod
    def _stat(sb: _Sandbox, p: str) -> FileStat:
        kind = "dir" if p in sb.dirs else "symlink" if p in sb.links else "file"
        return FileStat(
            path=p,
            name=posixpath.basename(p) or "/",
            type=kind,  # type: ignore[arg-type]
            size=len(sb.files.get(p, b"")),
            mode=sb.modes.get(p, 0o755 if kind == "dir" else 0o644),
            mtime=0.0,
            uid=sb.owners.get(p, (0, 0))[0],
            gid=sb.owners.get(p, (0, 0))[1],
            target=sb.links.get(p),
        )

    async def _execute(self, sb: _Sandbox, req: ExecRequest, emit: Emit) -> ExecResult:
        ids = _user_ids(sb, req.user)
        env = _env(sb, req.env, root=ids[0] == 0)
        cwd = req.cwd or sb.info.spec.workdir
        run = _Run(sb, env, cwd, req.stdin, _deadline(req.timeout), emit, ids)
        start = time.monotonic()
        name = posixpath.basename(req.cmd[0])
        if cwd not in sb.dirs:  # the init's chdir fails before the command starts
            emit("stderr", f"corral-init: chdir {cwd}: No such file or directory\n".encode())
            code = 126
        elif name in ("sh", "bash") and len(req.cmd) >= 3 and req.cmd[1] == "-c":
            code = await self._script(run, req.cmd[2])
        else:
            code = await self._command(run, req.cmd)
        return self._result(run, code, start)

    @staticmethod
    def _result(run: _Run, code: int, start: float) -> ExecResult:
        if run.timed_out:
            return ExecResult(
                exit_code=None, signal=9, reason="timeout", duration=time.monotonic() - start
            )
        if run.signal is not None:
            return ExecResult(
                exit_code=None,
                signal=run.signal,
                reason="signaled",
                duration=time.monotonic() - start,
            )
        return ExecResult(exit_code=code, reason="exited", duration=time.monotonic() - start)

    async def _script(self, run: _Run, script: str) -> int:
        """Run ``a; b && c || d``: variables are expanded first, quotes are honoured."""
        script = _VAR_RE.sub(lambda m: run.env.get(m.group(1) or m.group(2), ""), script)
        script = script.replace(">&2", f" {_TO_STDERR} ")
        lex = shlex.shlex(script, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        code, op, words = 0, ";", []
        for tok in [*lex, ";"]:
            if tok not in (";", "&&", "||"):
                words.append(tok)
                continue
            if words and (op == ";" or (op == "&&") == (code == 0)):
                if words[0] == "exit":
                    return int(words[1]) if len(words) > 1 else code
                if _TO_STDERR in words:
                    words.remove(_TO_STDERR)
                    emit = run.emit
                    run.emit = lambda _, d: emit("stderr", d)
                    code = await self._command(run, words)
                    run.emit = emit
                else:
                    code = await self._command(run, words)
                if run.timed_out or run.signal is not None:
                    return code
            op, words = tok, []
        return code

    async def _command(self, run: _Run, argv: list[str]) -> int:
        name, args = posixpath.basename(argv[0]), argv[1:]
        if "=" in name and not args:
            k, _, v = name.partition("=")
            run.env[k] = v
            return 0
        if name == "echo":
            run.emit("stdout", (" ".join(args) + "\n").encode())
        elif name in ("true", "false"):
            return int(name == "false")
        elif name == "pwd":
            run.emit("stdout", (run.cwd + "\n").encode())
        elif name == "cd":
            target = posixpath.normpath(posixpath.join(run.cwd, args[0] if args else "/"))
            if target not in run.sb.dirs:
                run.emit("stderr", f"sh: cd: {target}: No such file or directory\n".encode())
                return 2
            run.cwd = target
        elif name == "export":
            for a in args:
                k, _, v = a.partition("=")
                run.env[k] = v
        elif name == "printenv":
            for k in args or sorted(run.env):
                if k in run.env:
                    run.emit(
                        "stdout", (run.env[k] + "\n" if args else f"{k}={run.env[k]}\n").encode()
                    )
        elif name == "cat":
            if not args:
                run.emit("stdout", run.stdin or b"")
            for a in args:
                p = posixpath.normpath(posixpath.join(run.cwd, a))
                if p not in run.sb.files:
                    run.emit("stderr", f"cat: {a}: No such file or directory\n".encode())
                    return 1
                run.emit("stdout", run.sb.files[p])
        elif name == "kill" and len(args) == 2 and args[1] == "$$":
            sig = args[0].lstrip("-").upper().removeprefix("SIG")
            run.signal = int(sig) if sig.isdigit() else int(signal.Signals["SIG" + sig])
            return -1
        elif name == "id" and args in (["-u"], ["-g"]):
            run.emit("stdout", f"{run.uid if args == ['-u'] else run.gid}\n".encode())
        elif name == "sleep":
            return await self._sleep(run, float(args[0]) if args else 0.0)
        else:
            run.emit("stderr", f"sh: {argv[0]}: not found\n".encode())
            return 127
        return 0

    @staticmethod
    async def _sleep(run: _Run, seconds: float) -> int:
        if run.deadline is not None and time.monotonic() + seconds > run.deadline:
            await asyncio.sleep(max(run.deadline - time.monotonic(), 0))
            run.timed_out = True
            return -1
        await asyncio.sleep(seconds)
        return 0


def _env(sb: _Sandbox, extra: dict[str, str], root: bool = True) -> dict[str, str]:
    """A command's environment as a node builds it: its defaults, then the image's, the
    spec's and the request's (each over the one before)."""
    env = {"PATH": _DEFAULT_PATH, "HOME": "/root", "HOSTNAME": sb.info.spec.hostname}
    env.update(sb.info.image_env)
    env.update(sb.info.spec.env)
    if not root and "HOME" not in extra:
        env["HOME"] = "/"
    return {**env, **extra}


def _user_ids(sb: _Sandbox, user: str | None) -> tuple[int, int]:
    """``uid``, ``uid:gid`` or names, looked up in the sandbox's /etc files as a node does."""
    if not user:
        return 0, 0

    def lookup(path: str, name: str, what: str) -> tuple[int, int]:
        for line in sb.files.get(path, b"").decode(errors="replace").splitlines():
            f = line.split(":")
            if len(f) >= 3 and f[0] == name:
                return int(f[2]), int(f[3]) if len(f) >= 4 and f[3].isdigit() else int(f[2])
        raise InvalidRequest(f"user: no {what} {name!r} in the sandbox's {path}")

    name, _, group = user.partition(":")
    uid, gid = (int(name), int(name)) if name.isdigit() else lookup("/etc/passwd", name, "user")
    if group:
        gid = int(group) if group.isdigit() else lookup("/etc/group", group, "group")[0]
    return uid, gid


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _resolve(sb: _Sandbox, path: str, follow: bool = True) -> str:
    """Where ``path`` leads as the node's openat2(RESOLVE_IN_ROOT) sees it: symlinks on the
    way (the last one too with ``follow``) resolved, absolute ones from the sandbox's root."""
    parts, at, hops = [x for x in path.split("/") if x], "/", 0
    while parts:
        nxt = posixpath.normpath(posixpath.join(at, parts.pop(0)))  # ".." stops at "/"
        if nxt in sb.links and (parts or follow):
            hops += 1
            if hops > 40:
                raise PathRefused(f"{path}: too many symlinks on the way")
            target = sb.links[nxt]
            at = "/" if target.startswith("/") else at
            parts = [x for x in target.split("/") if x] + parts
        else:
            at = nxt
    return at


def _path(path: str) -> str:
    if "\0" in path:
        raise PathRefused(f"path {path[:200]!r} contains a NUL byte")
    if not path.startswith("/"):
        raise InvalidRequest(f"path {path!r} must be absolute inside the sandbox (start with /)")
    # normpath keeps a leading "//" (POSIX allows it to mean something else): fold it
    return posixpath.normpath("/" + path.lstrip("/"))


class FakePty:
    """A terminal of FakeNode (a :class:`corral.ops.PtyStream`): echoes input as a tty in
    canonical mode does, runs each line as a fake ``sh -c`` script, and knows ``tty`` and
    ``stty size``. A line with ``exit`` ends it with that status; EOF on an empty line ends
    it with the last status; a signal ends it as ``signaled``; leaving the block early
    hangs it up (SIGHUP).
    """

    def __init__(
        self,
        node: FakeNode,
        sb: _Sandbox,
        cmd: list[str],
        rows: int,
        cols: int,
        env: dict[str, str],
        pid: int,
        *,
        cwd: str,
    ) -> None:
        self._node, self._sb, self.cmd = node, sb, cmd
        self.rows, self.cols = rows, cols
        self._pid = pid
        self.pid = 0
        """The command's pid, once entered."""
        self._run = _Run(sb, env, cwd, None, None, self._emit)
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._line = bytearray()
        self._code = 0
        self._started = 0.0
        self._result: ExecResult | None = None

    async def __aenter__(self) -> FakePty:
        self.pid, self._started = self._pid, time.monotonic()
        self._out.put_nowait(b"$ ")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._end(None, 1)  # leaving early hangs up the terminal

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[bytes]:
        while (data := await self._out.get()) is not None:
            yield data

    @property
    def result(self) -> ExecResult | None:
        return self._result

    async def write(self, data: bytes) -> None:
        for byte in data:
            if self._result is not None:
                return
            ch = bytes([byte])
            if ch in (b"\r", b"\n"):
                self._emit("stdout", b"\n")
                line, self._line = self._line.decode(errors="replace"), bytearray()
                await self._execute(line)
            else:
                self._line += ch
                self._emit("stdout", ch)

    async def close_stdin(self) -> None:
        if self._line:  # EOF on a non-empty line submits it, like the tty's VEOF
            line, self._line = self._line.decode(errors="replace"), bytearray()
            await self._execute(line)
        else:
            self._end(self._code, None)

    async def signal(self, sig: int) -> None:
        self._end(None, sig)

    async def resize(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols

    async def _execute(self, line: str) -> None:
        words = line.split()
        if words == ["tty"]:
            self._emit("stdout", b"/dev/pts/0\n")
            self._code = 0
        elif words == ["stty", "size"]:
            self._emit("stdout", f"{self.rows} {self.cols}\n".encode())
            self._code = 0
        elif words:
            self._code = await self._node._script(self._run, line)
            if re.search(r"(^|[;&|]\s*)exit\b", line):
                self._end(self._code, None)
                return
        self._emit("stdout", b"$ ")

    def _emit(self, _stream: str, data: bytes) -> None:
        if self._result is None and data:
            self._out.put_nowait(data.replace(b"\n", b"\r\n"))

    def _end(self, code: int | None, sig: int | None) -> None:
        if self._result is None:
            self._result = ExecResult(
                exit_code=code,
                signal=sig,
                reason="exited" if sig is None else "signaled",
                duration=time.monotonic() - self._started if self._started else 0.0,
            )
            self._out.put_nowait(None)
