"""The sandbox-operations interface: per-sandbox operations and fleet operations.

The embedded node, the HTTP client transport, the FakeNode and (later) the cluster client
all implement :class:`NodeOps`, so the SDK is written once against it. Methods are async
and take and return the models of :mod:`corral.spec`; errors are those of
:mod:`corral.errors`.

The interface is split so that a fleet of nodes can implement it by routing and fan-out:

- :class:`SandboxOps`: everything keyed by a sandbox id (first argument). Ids encode their
  node (``sb-<local>-<node>``, :func:`corral.spec.parse_sandbox_id`), so a cluster client
  sends each call straight to the node that owns the sandbox.
- :class:`FleetOps`: create, list, pause/resume by labels, events, status, images, fncall.
  A cluster client places creates, and fans the rest out and merges the answers. Events
  with a ``sandbox_id`` are answered by that sandbox's node alone (routed like SandboxOps);
  over the fleet they page with an opaque cursor that holds one position per node
  (:func:`corral.spec.encode_cursor`), so merging pages of many nodes loses nothing.

Terminals (``pty``) follow one stream protocol, :class:`PtyStream`, and end with one exit
model, :class:`corral.spec.ExecResult`, in every implementation::

    async with await ops.pty(sandbox_id, PtyRequest(cmd=["/bin/sh"])) as s:
        await s.write(b"echo hi; exit 3\\n")
        async for data in s:          # bytes of terminal output
            ...
    assert s.result is not None and s.result.exit_code == 3

``pty`` is a coroutine (it may resume a paused sandbox and pick the default shell) that
returns the stream not yet opened; entering it starts the command, leaving it early ends
the command (the init kills its process group).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import NamedTuple, Protocol, runtime_checkable

from corral.errors import InvalidRequest, NotFound, SandboxNotFound
from corral.spec import (
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
    NodeStatus,
    ProcessInfo,
    PtyRequest,
    SandboxInfo,
    SandboxSpec,
    ShellInfo,
    decode_cursor,
    encode_cursor,
)

__all__ = [
    "NodeOps",
    "PortOps",
    "WatchOps",
    "DirWatch",
    "FileEvent",
    "SandboxOps",
    "FleetOps",
    "PtyStream",
    "EVENTS_LIMIT_MAX",
    "cursor_positions",
    "check_events_limit",
    "stamp_events",
    "DEFAULT_SHELLS",
    "default_shell",
]

EVENTS_LIMIT_MAX = 10000
"""Most events one ``events`` call returns."""

DEFAULT_SHELLS = (["/bin/bash", "-l"], ["/usr/bin/bash", "-l"], ["/bin/sh"])
"""A pty without ``cmd`` runs the first of these whose program the sandbox has."""


class PtyStream(Protocol):
    """One terminal, as every implementation of ``pty`` returns it (not yet entered).

    Enter it (``async with``) to start the command; iterate it for output bytes until the
    command ends; then ``result`` holds how it ended (stdout/stderr empty: they were
    streamed). Writes after the end are dropped silently: the iteration says how it ended.
    """

    @property
    def pid(self) -> int:
        """The command's pid inside the sandbox, once entered (0 where unknown)."""
        ...

    @property
    def cmd(self) -> list[str]:
        """The command started (the default shell when the request had none)."""
        ...

    @property
    def result(self) -> ExecResult | None:
        """How the command ended; None until the iteration has reached the end."""
        ...

    async def __aenter__(self) -> PtyStream: ...
    async def __aexit__(
        self,
        et: type[BaseException] | None,
        e: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
    def __aiter__(self) -> AsyncIterator[bytes]: ...
    async def write(self, data: bytes) -> None:
        """Bytes to the terminal's input (keystrokes)."""
        ...

    async def resize(self, rows: int, cols: int) -> None:
        """Set the window size (the command gets SIGWINCH)."""
        ...

    async def close_stdin(self) -> None:
        """End of input (the EOF character, in canonical mode)."""
        ...

    async def signal(self, sig: int) -> None:
        """Send ``sig`` to the command's process group."""
        ...


class SandboxOps(Protocol):
    """Operations on one sandbox, keyed by its id (routable by the id's node)."""

    # lifecycle
    async def sandbox_get(self, sandbox_id: str) -> SandboxInfo: ...
    async def sandbox_destroy(self, sandbox_id: str) -> None: ...

    # pause / resume (state kept; any request to a paused sandbox resumes it)
    async def sandbox_pause(self, sandbox_id: str, memory_snapshot: bool = False) -> SandboxInfo:
        """Freeze and reclaim; ``memory_snapshot`` (microVMs): save the whole machine to a
        file and end its VMM instead (all its memory released)."""
        ...

    async def sandbox_resume(self, sandbox_id: str, prefetch: bool = False) -> SandboxInfo:
        """Thaw a paused sandbox; ``prefetch`` also starts reading all its memory back from
        swap (returns once the reads are started)."""
        ...

    async def sandbox_set_ttl(self, sandbox_id: str, ttl: float | None) -> SandboxInfo:
        """The sandbox now expires ``ttl`` seconds from now (None: never), recorded so the
        new deadline holds over a restart of the node; a paused sandbox keeps pausing.
        Returns the sandbox with its new ``expires_at``."""
        ...

    # network policy
    async def network_update(
        self, sandbox_id: str, allow: list[str] | None = None, deny: list[str] | None = None
    ) -> SandboxInfo:
        """Replace the sandbox's egress allow/deny lists (None keeps one); effective on
        return, its processes untouched. Returns the sandbox with its new policy."""
        ...

    # desktop (the vm backend's display)
    async def desktop_screenshot(self, sandbox_id: str) -> bytes:
        """The sandbox's screen as PNG bytes (InvalidRequest if it has no display)."""
        ...

    async def desktop_input(self, sandbox_id: str, req: DesktopInput) -> None:
        """One pointer or keyboard action on the sandbox's display; returns once the
        events were delivered to the VM's input devices."""
        ...

    # snapshots and forks (filesystem state; processes are not cloned)
    async def sandbox_snapshot(self, sandbox_id: str, name: str | None = None) -> ImageInfo:
        """Pack the sandbox's filesystem changes into a new layer; returns the new image
        (the source image's layers + that layer)."""
        ...

    async def sandbox_fork(self, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        """``req.count`` new sandboxes from the sandbox's current files (all or nothing),
        on the parent's node."""
        ...

    # exec
    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult: ...
    def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[ExecChunk | ExecResult]:
        """Yields output chunks as they come, then exactly one ExecResult (with empty
        stdout/stderr, since they were streamed) as the last item."""
        ...

    async def pty(self, sandbox_id: str, req: PtyRequest) -> PtyStream:
        """An interactive terminal, not yet entered (see :class:`PtyStream`). The sandbox
        counts as busy while it is open, so the idle reaper never takes it from a user."""
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
    async def shell_interrupt(self, sandbox_id: str, shell_id: str) -> None:
        """SIGINT to the session's running command (like Ctrl-C); the shell stays."""
        ...

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
        self,
        sandbox_id: str,
        path: str,
        parents: bool = True,
        mode: int = 0o755,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        """Create a directory (``mkdir -p`` with ``parents``); the directories it creates
        belong to ``owner_uid``/``owner_gid``, ids inside the sandbox (root by default),
        so a guest account's home needs no ``chown`` in the guest."""
        ...

    async def file_upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None: ...
    async def file_download_tar(self, sandbox_id: str, path: str) -> bytes: ...


class FleetOps(Protocol):
    """Operations over all sandboxes of a node (or a fleet: placed, or fanned out)."""

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
    async def sandbox_list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]: ...

    async def sandboxes_pause(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Pause every sandbox carrying all of ``labels``; returns those now paused."""
        ...

    async def sandboxes_resume(
        self, labels: dict[str, str], prefetch: bool = False
    ) -> list[SandboxInfo]:
        """Resume every paused sandbox carrying all of ``labels`` (``prefetch``: as in
        ``sandbox_resume``); returns those resumed."""
        ...

    # events and node
    async def events(
        self,
        sandbox_id: str | None = None,
        after: str | None = None,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        limit: int = 1000,
    ) -> list[Event]:
        """Events strictly after the cursor ``after`` (None: from the start), oldest first,
        at most ``limit`` (1 to 10000). Pass the last event's ``cursor`` to get the next
        page. A cursor that is not one is :class:`~corral.errors.InvalidRequest`."""
        ...

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


class NodeOps(SandboxOps, FleetOps, Protocol):
    """Both surfaces: what the embedded node, the HTTP client and the FakeNode implement."""


@runtime_checkable
class PortOps(Protocol):
    """A TCP connection into a sandbox's own loopback, for the port proxy.

    Node-local on purpose (it hands out a socket): the embedded node implements it; a
    client over the network does not, and a cluster front forwards a port request to the
    node's own HTTP proxy instead. Where it is missing the proxy falls back to relaying
    one HTTP request per exec (no websockets).
    """

    async def port_connect(self, sandbox_id: str, port: int) -> socket.socket:
        """A non-blocking socket connected to ``127.0.0.1:port`` inside the sandbox's
        network namespace. SandboxNotFound, SandboxError (not running, nothing listening),
        InvalidRequest (bad port, a backend without a namespace the node can enter)."""
        ...

    def port_hold(self, sandbox_id: str) -> AbstractContextManager[None]:
        """Counts the sandbox as busy while entered (a live WebSocket or a streaming
        response is use: the idle reaper and idle pause leave it alone)."""
        ...


class FileEvent(NamedTuple):
    """One change in a watched directory."""

    name: str
    """Path relative to the watched directory (``sub/file.txt`` in a recursive watch)."""
    kind: str
    """``create`` (also a move in), ``write``, ``remove``, ``rename`` (a move out),
    ``chmod``."""


class DirWatch(Protocol):
    """A running watch: iterate for events (ends when the directory goes); ``close``."""

    def __aiter__(self) -> AsyncIterator[FileEvent]: ...
    def close(self) -> None: ...


@runtime_checkable
class WatchOps(Protocol):
    """Directory watches with the kernel's inotify (events the guest cannot forge).

    Node-local like :class:`PortOps`; where it is missing (a network client, a backend
    whose files the node cannot watch) a caller polls the files API instead.
    """

    async def file_watch(self, sandbox_id: str, path: str, recursive: bool = False) -> DirWatch:
        """Start watching directory ``path``; InvalidRequest where it is not a directory
        or the backend's files cannot be watched, NotFound where it does not exist."""
        ...


# --------------------------------------------------------------------------- helpers
# Shared by the implementations, so a bad cursor or limit reads the same everywhere.


def cursor_positions(after: str | None) -> dict[str, int]:
    """The per-node positions of an ``events`` cursor ({} for None); InvalidRequest naming
    the ``after`` parameter when it is not a cursor."""
    if after is None or after == "":
        return {}
    try:
        return decode_cursor(after)
    except ValueError as exc:
        raise InvalidRequest(f"after: {exc}") from None


def check_events_limit(limit: int) -> int:
    """``limit`` of an ``events`` call, or InvalidRequest when it is not 1 to 10000."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= EVENTS_LIMIT_MAX:
        raise InvalidRequest(f"limit: {limit!r} is not a whole number from 1 to {EVENTS_LIMIT_MAX}")
    return limit


def stamp_events(events: Iterable[Event], node_id: str, positions: dict[str, int]) -> list[Event]:
    """``events`` of node ``node_id`` (its log's order) with ``node_id`` and ``cursor`` set.

    Each cursor keeps the other nodes' positions of the request's cursor, so a cursor that
    went through one node still holds the whole fleet's place."""
    out: list[Event] = []
    pos = dict(positions)
    for e in events:
        pos[node_id] = e.id
        out.append(e.model_copy(update={"node_id": node_id, "cursor": encode_cursor(pos)}))
    return out


async def default_shell(ops: SandboxOps, sandbox_id: str) -> list[str]:
    """The command of a pty without one: the first of :data:`DEFAULT_SHELLS` the sandbox
    has (``bash -l`` where the image has bash, else ``/bin/sh``)."""
    for candidate in DEFAULT_SHELLS[:-1]:
        try:
            await ops.file_stat(sandbox_id, candidate[0])
        except SandboxNotFound:
            raise
        except NotFound:
            continue
        return list(candidate)
    return list(DEFAULT_SHELLS[-1])
