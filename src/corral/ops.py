"""The sandbox-operations interface.

One Protocol that the embedded node, the HTTP client transport and (later) the cluster
client all implement, so the SDK is written once against it. Methods are async and take
and return the models of :mod:`corral.spec`; errors are those of :mod:`corral.errors`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from corral.spec import (
    CallRequest,
    CallResult,
    JudgeRequest,
    JudgeResult,
    Event,
    EventSummary,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileStat,
    ForkRequest,
    ImageInfo,
    LayerInfo,
    NodeStatus,
    ProcessInfo,
    SandboxInfo,
    SandboxSpec,
    ShellInfo,
)

__all__ = ["NodeOps"]


class NodeOps(Protocol):
    # images (read side; building happens through corral.images on the node's host)
    async def image_get(self, name: str) -> ImageInfo: ...
    async def image_list(self) -> list[ImageInfo]: ...
    async def image_compose(
        self, name: str, layers: list[str], env: dict[str, str] | None = None, workdir: str = "/"
    ) -> ImageInfo: ...
    async def image_remove(self, name: str) -> None: ...
    async def layer_list(self) -> list[LayerInfo]: ...

    # lifecycle
    async def sandbox_create(self, spec: SandboxSpec) -> SandboxInfo: ...
    async def sandbox_get(self, sandbox_id: str) -> SandboxInfo: ...
    async def sandbox_list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]: ...
    async def sandbox_destroy(self, sandbox_id: str) -> None: ...

    # pause / resume (state kept; any request to a paused sandbox resumes it)
    async def sandbox_pause(self, sandbox_id: str) -> SandboxInfo: ...
    async def sandbox_resume(self, sandbox_id: str, prefetch: bool = False) -> SandboxInfo:
        """Thaw a paused sandbox; ``prefetch`` also starts reading all its memory back from
        swap (returns once the reads are started)."""
        ...

    async def sandboxes_pause(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Pause every sandbox carrying all of ``labels``; returns those now paused."""
        ...

    async def sandboxes_resume(
        self, labels: dict[str, str], prefetch: bool = False
    ) -> list[SandboxInfo]:
        """Resume every paused sandbox carrying all of ``labels`` (``prefetch``: as in
        :meth:`sandbox_resume`); returns those resumed."""
        ...

    # network policy
    async def network_update(
        self, sandbox_id: str, allow: list[str] | None = None, deny: list[str] | None = None
    ) -> SandboxInfo:
        """Replace the sandbox's egress allow/deny lists (None keeps one); effective on
        return, its processes untouched. Returns the sandbox with its new policy."""
        ...

    # snapshots and forks (filesystem state; processes are not cloned)
    async def sandbox_snapshot(self, sandbox_id: str, name: str | None = None) -> ImageInfo:
        """Pack the sandbox's filesystem changes into a new layer; returns the new image
        (the source image's layers + that layer)."""
        ...

    async def sandbox_fork(self, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        """``req.count`` new sandboxes from the sandbox's current files (all or nothing)."""
        ...

    # exec
    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult: ...
    def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[ExecChunk | ExecResult]:
        """Yields output chunks as they come, then exactly one ExecResult (with empty
        stdout/stderr, since they were streamed) as the last item."""
        ...

    async def spawn(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo: ...
    async def process_get(
        self, sandbox_id: str, process_id: str, wait: float | None = None
    ) -> ProcessInfo:
        """``wait``: seconds to wait for the process to end (None: do not wait)."""
        ...

    async def process_kill(self, sandbox_id: str, process_id: str, signal: int = 9) -> None: ...
    async def process_list(self, sandbox_id: str) -> list[ProcessInfo]: ...

    # shell sessions
    async def shell_open(
        self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ShellInfo: ...
    async def shell_run(
        self,
        sandbox_id: str,
        shell_id: str,
        command: str,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult: ...
    async def shell_close(self, sandbox_id: str, shell_id: str) -> None: ...

    # files
    async def file_read(
        self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None
    ) -> bytes: ...
    async def file_write(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, append: bool = False
    ) -> None: ...
    async def file_list(self, sandbox_id: str, path: str) -> list[FileStat]: ...
    async def file_stat(self, sandbox_id: str, path: str) -> FileStat: ...
    async def file_remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None: ...
    async def file_mkdir(
        self, sandbox_id: str, path: str, parents: bool = True, mode: int = 0o755
    ) -> None: ...
    async def file_upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None: ...
    async def file_download_tar(self, sandbox_id: str, path: str) -> bytes: ...

    # events and node
    async def events(
        self,
        sandbox_id: str | None = None,
        since_id: int = 0,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
    ) -> list[Event]: ...
    async def events_summary(
        self,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        sandbox_id: str | None = None,
    ) -> EventSummary: ...
    async def node_status(self) -> NodeStatus: ...

    # fncall: short calls in warm pool sandboxes
    async def fncall_run(self, req: CallRequest) -> CallResult: ...
    async def fncall_judge(self, req: JudgeRequest) -> JudgeResult: ...
    async def close(self) -> None: ...
