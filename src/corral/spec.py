"""Typed models every room of corral speaks.

These are shared by the SDK, the REST API and the node, so a request built by the SDK is
validated by the same code on the node. Bytes travel as base64 in JSON.

Example:
    >>> Limits(memory="512MiB").memory
    536870912
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import secrets
import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

__all__ = [
    "ByteSize",
    "Limits",
    "NetworkPolicy",
    "Desktop",
    "DesktopInput",
    "SandboxSpec",
    "SandboxState",
    "SandboxInfo",
    "ExecRequest",
    "ExecResult",
    "ExecChunk",
    "ExitReason",
    "ProcessInfo",
    "ShellInfo",
    "FileStat",
    "LayerInfo",
    "ImageInfo",
    "Event",
    "EventSummary",
    "NodeStatus",
    "parse_bytes",
    "SANDBOX_ID_RE",
    "NODE_ID_RE",
    "new_sandbox_id",
    "parse_sandbox_id",
    "sandbox_local",
    "encode_cursor",
    "decode_cursor",
    "BackendStatus",
    "PtyRequest",
    "validation_message",
    "ForkRequest",
    "CallStatus",
    "Verdict",
    "CallLimits",
    "CallRequest",
    "CallResult",
    "Case",
    "CustomChecker",
    "JudgeRequest",
    "CaseResult",
    "JudgeResult",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

SANDBOX_ID_RE = re.compile(r"^sb-(?P<local>[0-9a-z]{12})-(?P<node>[0-9a-z]{1,16})$")
"""``sb-<local>-<node>``: the id names the node that runs the sandbox, so a cluster client
routes per-sandbox operations by the id alone. Kernel names (veth, nft key, cgroup,
subvolume) derive from the local part, which is unique on its host. Match it with
``fullmatch`` (or call :func:`parse_sandbox_id`): ``$`` also matches before a final newline."""
NODE_ID_RE = re.compile(r"^[0-9a-z]{1,16}$")
_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def new_sandbox_id(node_id: str) -> str:
    """A fresh id for a sandbox of node ``node_id``: ``sb-<12 random of [0-9a-z]>-<node_id>``.

    Example:
        >>> parse_sandbox_id(new_sandbox_id("a1b2c3"))[1]
        'a1b2c3'
    """
    if not isinstance(node_id, str) or not NODE_ID_RE.fullmatch(node_id):
        raise ValueError(f"node id {str(node_id)[:40]!r} must be 1-16 of [0-9a-z]")
    local = "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))
    return f"sb-{local}-{node_id}"


def parse_sandbox_id(sandbox_id: str) -> tuple[str, str]:
    """``(local, node)`` of a sandbox id; ValueError for anything that is not one."""
    m = SANDBOX_ID_RE.fullmatch(sandbox_id) if isinstance(sandbox_id, str) else None
    if m is None:
        shown = (
            repr(sandbox_id) if len(str(sandbox_id)) <= 80 else repr(str(sandbox_id)[:80]) + "..."
        )
        raise ValueError(
            f"{shown} is not a sandbox id: ids look like sb-<12 of [0-9a-z]>-<node id>"
        )
    return m.group("local"), m.group("node")


def sandbox_local(sandbox_id: str) -> str:
    """The local part of a sandbox id (unique per host): what kernel names derive from."""
    return parse_sandbox_id(sandbox_id)[0]


# --------------------------------------------------------------------------- event cursors
_CURSOR_PREFIX = "c1."
_CURSOR_MAX_NODES = 4096


def encode_cursor(positions: dict[str, int]) -> str:
    """An opaque events cursor: for each node, the id of the last event already seen.

    Format: ``"c1."`` + unpadded urlsafe base64 of compact JSON ``{node_id: last_id}``.
    One node's cursor has one entry; a cluster client merges the nodes' positions into one.

    Example:
        >>> decode_cursor(encode_cursor({"n1": 7}))
        {'n1': 7}
    """
    _check_positions(positions)
    raw = json.dumps(dict(sorted(positions.items())), separators=(",", ":")).encode()
    return _CURSOR_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> dict[str, int]:
    """The positions in a cursor made by :func:`encode_cursor`; ValueError on anything else."""
    if not isinstance(cursor, str) or not cursor.startswith(_CURSOR_PREFIX):
        raise ValueError(
            f"{str(cursor)[:40]!r} is not an events cursor of this version (they start with "
            f"{_CURSOR_PREFIX!r}); pass the cursor of the last event you received"
        )
    body = cursor[len(_CURSOR_PREFIX) :]
    if len(body) > 200 * _CURSOR_MAX_NODES:
        raise ValueError("the events cursor is too long")
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
        positions = json.loads(raw)
    except (binascii.Error, ValueError, RecursionError) as exc:
        raise ValueError(f"the events cursor {cursor[:40]!r} is damaged: {exc}") from None
    if not isinstance(positions, dict):
        raise ValueError(f"the events cursor {cursor[:40]!r} is damaged: not a node map")
    _check_positions(positions)
    return positions


def _check_positions(positions: dict[str, int]) -> None:
    if len(positions) > _CURSOR_MAX_NODES:
        raise ValueError(f"an events cursor holds at most {_CURSOR_MAX_NODES} nodes")
    for node, last in positions.items():
        if not isinstance(node, str) or not NODE_ID_RE.fullmatch(node):
            raise ValueError(f"events cursor: node id {str(node)[:40]!r} is not 1-16 of [0-9a-z]")
        if not isinstance(last, int) or isinstance(last, bool) or last < 0:
            raise ValueError(
                f"events cursor: position {str(last)[:40]!r} of node {node} is not an event id"
            )


def parse_bytes(value: int | str) -> int:
    """Turn ``"1GiB"``, ``"512M"`` or ``1048576`` into a byte count."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '1GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):  # JSON 1e400 is inf: int() would raise OverflowError
            raise ValueError(f"{value!r} is not a size")
        return parse_bytes(int(value))
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size; use bytes or a unit such as 512MiB, 2GiB")
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(size):
        raise ValueError(f"{str(value)[:40]!r}... is too large to be a size")
    return int(size)


def validation_message(err: Exception) -> str:
    """One line naming each bad field of a pydantic ValidationError: ``limits.memory: ...``."""
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return str(err)
    parts = []
    for e in errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",)) or "request"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


ByteSize = Annotated[int, BeforeValidator(parse_bytes)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")


class Limits(_Model):
    """Resource limits of one sandbox, enforced by the kernel."""

    cpus: float = Field(1.0, gt=0, le=256)
    """CPU bandwidth in cores (cgroup cpu quota)."""
    memory: ByteSize = Field(1 << 30, ge=16 << 20)
    """Memory limit; exceeding it kills the offender and exec reports reason ``oom``."""
    pids: int = Field(256, ge=8, le=1 << 20)
    """Maximum number of processes and threads."""
    disk: ByteSize = Field(2 << 30, ge=1 << 20)
    """Quota of the writable layer: the room the sandbox is sure to have. The kernel stops
    writes (EDQUOT inside, ``QuotaExceeded`` from the files API) at this plus a metadata
    allowance of a quarter of it, 64 MiB to 1 GiB (``corral.host.btrfs.qgroup_limit``)."""
    output: ByteSize = Field(1 << 20, ge=1024, le=1 << 30)
    """Default cap per exec output stream (stdout, stderr each)."""
    output_rate: ByteSize = Field(32 << 20, ge=1 << 20, le=1 << 40)
    """Bytes a second of output the node relays for this sandbox, over all its execs and
    streams together (after a burst of a quarter of a second's worth). A sandbox printing
    faster is slowed, not cut: its processes wait in ``write``. The node's relay is shared
    by every sandbox on it; this is one sandbox's share (corral.backends.outpace)."""


class NetworkPolicy(_Model):
    """Egress of a sandbox, by the names of the node's permissions (operator config).

    Default: nothing (loopback only, no DNS). ``deny`` wins over ``allow`` for a name
    both cover. Example: ``NetworkPolicy(allow=["pypi"], deny=["npm"])``."""

    allow: list[str] = Field(default_factory=list, max_length=64)
    deny: list[str] = Field(default_factory=list, max_length=64)

    @field_validator("allow", "deny")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for n in v:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", n):
                raise ValueError(f"permission name {n[:70]!r} must be 1-64 of [A-Za-z0-9_.-]")
        return list(dict.fromkeys(v))


class Desktop(_Model):
    """A display for a ``vm`` sandbox: an X session of this size (corral.backends.vm).

    Example: ``Desktop(width=1280, height=800)``."""

    width: int = Field(1280, ge=320, le=3840)
    height: int = Field(800, ge=200, le=2160)


class DesktopInput(_Model):
    """One input action on a sandbox's desktop (``sandbox.desktop.click`` etc.).

    ``move``: the pointer to (x, y). ``click``: move, then ``count`` clicks of ``button``.
    ``drag``: press ``button`` at (x, y), move to (to_x, to_y), release. ``scroll``: move
    to (x, y) if given, then ``dy`` wheel clicks (> 0 down) and ``dx`` (> 0 right).
    ``type``: ``text`` as key presses (US layout). ``key``: one combo like ``ctrl+l``."""

    action: Literal["move", "click", "drag", "scroll", "type", "key"]
    x: int | None = Field(None, ge=0)
    y: int | None = Field(None, ge=0)
    to_x: int | None = Field(None, ge=0)
    to_y: int | None = Field(None, ge=0)
    button: Literal["left", "right", "middle"] = "left"
    count: int = Field(1, ge=1, le=3)
    dx: int = Field(0, ge=-100, le=100)
    dy: int = Field(0, ge=-100, le=100)
    text: str = Field("", max_length=10000)
    keys: str = Field("", max_length=100)


class SandboxSpec(_Model):
    """What to create."""

    image: str = Field(min_length=1, max_length=300)
    """Image name (``demo/python``) or ``sha256:`` digest of an image manifest."""
    limits: Limits = Field(default_factory=Limits)
    ttl: float | None = Field(None, gt=0)
    """Seconds after creation at which the sandbox is destroyed (see ``ttl_action``)."""
    ttl_action: Literal["destroy", "pause"] = "destroy"
    """What the TTL does: ``destroy``; or ``pause``: the sandbox is paused at its TTL and
    then has none (kept until destroyed; ``set_ttl`` gives it a new one). E2B's
    ``autoPause``."""
    idle_timeout: float | None = Field(None, gt=0)
    """Seconds without a request after which the sandbox is destroyed (a paused sandbox
    is not: pausing is how an idle sandbox is kept; ``ttl`` still applies)."""
    idle_pause: float | None = Field(None, gt=0)
    """Seconds without a request after which the sandbox is paused (state kept; the next
    request resumes it)."""
    qos: Literal["best_effort", "latency"] = "best_effort"
    """CPU class: ``best_effort`` runs on CPU time nobody else wants (SCHED_IDLE, idle
    cgroup); ``latency`` gets the normal weight and SCHED_OTHER."""
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    """Environment added to every exec."""
    workdir: str = "/"
    """Default cwd of execs and shells."""
    hostname: str = Field("sandbox", pattern=r"^[a-zA-Z0-9][a-zA-Z0-9.-]{0,62}$")
    network: NetworkPolicy = Field(default_factory=NetworkPolicy)
    """Egress allowlist by permission name; in SandboxInfo, the current policy (it changes
    with ``sandbox.network.update``)."""
    readonly_rootfs: bool = False
    """Mount the root filesystem read-only (fncall pools: nothing a call does can persist
    outside the ``tmpfs`` mounts)."""
    tmpfs: dict[str, ByteSize] = Field(default_factory=dict)
    """Private tmpfs mounts (path -> size, mode 1777), charged to the sandbox's memory.
    The file API does not see into them (it works on the overlay)."""
    backend: str | None = Field(None, pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    """Isolation engine by the name of one of the node's backends (``container``; later
    ``microvm``, ``vm``); None: the node's default backend."""
    desktop: Desktop | None = None
    """A display with an X session (only the ``vm`` backend has one; elsewhere the
    create is an InvalidRequest)."""

    @field_validator("tmpfs")
    @classmethod
    def _tmpfs(cls, v: dict[str, int]) -> dict[str, int]:
        for path, size in v.items():
            _check_abs_path(path, "tmpfs path")
            parts = path.strip("/").split("/")
            if ".." in parts or parts[0] in ("", "proc", "sys", "dev", ".corral"):
                raise ValueError(f"tmpfs path {path!r} must be below / outside /proc, /sys, /dev")
            if not (1 << 20) <= size <= (64 << 30):
                raise ValueError(f"tmpfs {path!r}: size must be between 1MiB and 64GiB")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not re.match(r"^[A-Za-z0-9_.\-/]{1,63}$", k):
                raise ValueError(f"label key {k!r} must be 1-63 of [A-Za-z0-9_.-/]")
            if len(val) > 256:
                raise ValueError(f"label {k!r} value is longer than 256 characters")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        return _check_abs_path(v, "workdir")


def _check_env(v: dict[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if not k or "=" in k or "\0" in k or "\0" in val:
            raise ValueError(f"environment variable name {k!r} is invalid (empty, '=' or NUL)")
    return v


def _check_cmd(v: list[str]) -> list[str]:
    if any("\0" in a for a in v):
        raise ValueError("cmd arguments cannot contain NUL bytes")
    if not v[0]:
        raise ValueError("cmd[0] cannot be empty")
    return v


def _check_abs_path(v: str, what: str) -> str:
    if not v.startswith("/") or "\0" in v or len(v) > 4096:
        raise ValueError(f"{what} must be an absolute path without NUL bytes")
    return v


SandboxState = Literal[
    "creating",
    "running",
    "pausing",
    "paused",
    "resuming",
    "destroying",
    "destroyed",
    "lost",
]
"""``lost`` is never a node's own state: a cluster client reports it for the sandboxes of a
node that stopped answering (their last known info, with this state)."""


class SandboxInfo(_Model):
    id: str
    state: SandboxState
    image: str
    """The image name as asked."""
    image_digest: str
    """Digest of the image manifest the sandbox was created from."""
    layers: list[str] = Field(default_factory=list)
    """The image's layer digests at creation (the image may change or go later)."""
    image_env: dict[str, str] = Field(default_factory=dict)
    """The image's environment at creation, under ``spec.env`` in every exec."""
    spec: SandboxSpec
    created_at: float
    expires_at: float | None = None
    last_active_at: float
    backend: str = "container"
    """The node's backend that runs it (its OCI runtime, if any, is in ``NodeStatus``)."""
    accel: str | None = None
    """The VM accelerator its backend uses (``kvm`` or ``tcg``); None for containers."""
    layer_access: str | None = None
    """How a microVM's guest reads the image layers: ``dax`` (mapped from the node's layer
    files, one page cache for all) or ``virtio-blk`` (the fallback); None for containers."""
    node_id: str = ""
    """The node that runs it (also the last part of ``id``)."""
    pid: int | None = None
    """Host pid of the sandbox's init."""
    detail: str = ""
    address: str | None = None
    """The sandbox's IPv4 address on the node's network (None: no interface)."""
    memory_resident: int | None = None
    """Bytes of the sandbox's memory in RAM now (cgroup figure; set by ``get``)."""
    memory_swapped: int | None = None
    """Bytes of the sandbox's memory in swap now (cgroup figure; set by ``get``)."""
    cpu_seconds: float | None = None
    """CPU time its processes have used since it started, in seconds (cgroup figure; set
    by ``get``; a VM's is its VMM's)."""
    disk_used: int | None = None
    """Bytes its writable layer takes now (the scratch subvolume's usage; set by ``get``)."""

    def image_info(self) -> ImageInfo:
        """The image this sandbox was created from, as it was then: its own layers and env
        (the image name may have been re-pointed or removed since)."""
        return ImageInfo(
            name=self.image,
            digest=self.image_digest,
            layers=list(self.layers),
            env=dict(self.image_env),
        )


ExitReason = Literal["exited", "signaled", "timeout", "oom", "output_limit"]


class ExecRequest(_Model):
    """One command to run inside a sandbox."""

    cmd: list[str] = Field(min_length=1)
    stdin: bytes | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    """``uid``, ``uid:gid`` or a user name from the sandbox's /etc/passwd."""
    timeout: float | None = Field(None, gt=0, le=7 * 86400)
    """Wall-clock seconds; past it the process group is killed and reason is ``timeout``."""
    output_limit: ByteSize | None = Field(None, ge=0, le=1 << 30)
    """Cap per stream; None means the sandbox's default (Limits.output)."""
    tty: bool = False

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: list[str]) -> list[str]:
        return _check_cmd(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str | None) -> str | None:
        return None if v is None else _check_abs_path(v, "cwd")


class ExecResult(_Model):
    """How a command ended. ``reason`` always says why."""

    exit_code: int | None
    """Exit status when reason is ``exited``; else None."""
    signal: int | None = None
    """Terminating signal when the process was killed."""
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration: float = 0.0
    reason: ExitReason

    @property
    def ok(self) -> bool:
        return self.reason == "exited" and self.exit_code == 0

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    def text(self) -> str:
        return self.stdout.decode(errors="replace")


class PtyRequest(_Model):
    """An interactive terminal in a sandbox (``corral sandbox shell``).

    Its output is streamed (a tty merges stdout and stderr) and its end is an
    :class:`ExecResult` with empty stdout/stderr, as for ``exec_stream``."""

    cmd: list[str] | None = Field(None, min_length=1)
    """Program and arguments; None: ``bash -l`` where the image has bash, else ``/bin/sh``."""
    rows: int = Field(24, ge=1, le=65535)
    """Window height (the kernel's struct winsize holds two u16)."""
    cols: int = Field(80, ge=1, le=65535)
    env: dict[str, str] = Field(default_factory=dict)
    """Added to the sandbox's environment (``TERM`` defaults to ``xterm-256color``)."""
    cwd: str | None = None
    user: str | None = None
    """``uid``, ``uid:gid`` or a user name from the sandbox's /etc/passwd."""

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else _check_cmd(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str | None) -> str | None:
        return None if v is None else _check_abs_path(v, "cwd")


class ExecChunk(_Model):
    """A piece of output of a streaming exec."""

    stream: Literal["stdout", "stderr"]
    data: bytes


class ProcessInfo(_Model):
    """A background process started with ``Sandbox.spawn``."""

    id: str
    pid: int
    cmd: list[str]
    running: bool
    stdout: bytes = b""
    """Output buffered so far (capped at the exec's output limit)."""
    stderr: bytes = b""
    result: ExecResult | None = None
    """Set once the process has ended; its stdout/stderr are the full buffered output."""


class ShellInfo(_Model):
    id: str
    cwd: str
    created_at: float


class FileStat(_Model):
    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    uid: int
    gid: int
    target: str | None = None
    """Link target when type is ``symlink``."""


class LayerInfo(_Model):
    digest: str
    """``sha256:<hex>`` of the EROFS layer file."""
    size: int
    kind: str
    """How it was built: dir, tar, debian, pip, docker, oci, snapshot."""
    source: str = ""
    created_at: float = Field(default_factory=time.time)
    meta: dict[str, str] = Field(default_factory=dict)


class ImageInfo(_Model):
    name: str
    """e.g. ``demo/python``."""
    digest: str
    """``sha256:`` of the canonical manifest JSON."""
    layers: list[str]
    """Layer digests, bottom first (base, toolkits, workspace)."""
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    created_at: float = Field(default_factory=time.time)


class Event(_Model):
    id: int = 0
    """Position in its node's event log (per node: compare only with ``node_id`` equal)."""
    sandbox_id: str | None
    time: float
    kind: str
    """e.g. ``created``, ``destroyed``, ``oom``, ``output_truncated``, ``file_refused``,
    ``seccomp`` (the security kinds: ``corral.node.security.SECURITY_KINDS``)."""
    detail: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    """Coalesced repeats carry ``count`` (and ``first``/``last`` times)."""
    node_id: str = ""
    """The node whose log holds it."""
    cursor: str = ""
    """Opaque position just after this event: pass it as ``after`` to get what follows."""


class EventSummary(_Model):
    """How often each kind of event happened, per sandbox and in total (e.g. for one job:
    ``await client.events_summary(labels={"job": "rl-42"})``)."""

    labels: dict[str, str] = Field(default_factory=dict)
    """The label filter the summary was made for."""
    sandboxes: dict[str, dict[str, int]] = Field(default_factory=dict)
    """Sandbox id -> kind -> occurrences (a coalesced event counts ``detail.count`` times)."""
    totals: dict[str, int] = Field(default_factory=dict)
    """Kind -> occurrences over all those sandboxes."""


class BackendStatus(_Model):
    """One isolation engine of a node, as ``NodeStatus.backends`` lists it."""

    kind: str
    """``container`` (later ``microvm``, ``vm``): the name ``SandboxSpec.backend`` takes."""
    ok: bool = True
    """Whether it can create sandboxes now."""
    accel: str | None = None
    """Hardware acceleration it uses (``kvm`` for VMs); None when not applicable."""
    detail: dict[str, str] = Field(default_factory=dict)
    """Backend-specific facts, e.g. ``{"runtime": "crun"}`` for containers, or why not ok."""


class NodeStatus(_Model):
    """What a node is and has room for: a placer picks nodes by these figures."""

    node_id: str
    version: str
    cgroup_mode: Literal["v1", "v2", "hybrid"]
    sandboxes: int
    running: int
    state_dir: str
    store: str
    mounted_layers: int
    mem_total: int
    mem_available: int
    paused: int = 0
    swap: list[str] = Field(default_factory=list)
    """Swap areas this node added for paused sandboxes (``/dev/zramN`` or a file)."""
    core_scheduling: bool = False
    """Whether the kernel offers core scheduling (prctl PR_SCHED_CORE)."""
    qos_detail: str = ""
    checkpoint: bool = False
    """Whether process checkpointing (CRIU) works here; corral never depends on it."""
    checkpoint_detail: str = ""
    """Why not, when it does not (``criu check``'s complaint, or CRIU is not installed)."""
    landlock: int = 0
    """The kernel's landlock ABI (0: none). From 6 on, guest commands run landlock-scoped
    (no signals to or ptrace of PID 1, no abstract sockets made outside the sandbox)."""
    landlock_detail: str = ""
    max_sandboxes: int = 0
    """Most live sandboxes it admits (0: no limit of its own)."""
    idle_capacity: int = 0
    """About how many idle sandboxes this host holds: what its memory holds at the measured
    cost of one (which grows with the count: corral.node.limits.idle_bytes), or less if a
    sysctl or the open-files limit binds first. 0: not known (a fake node)."""
    idle_capacity_bound: str = ""
    """What binds ``idle_capacity``: ``memory``, a sysctl's name, or ``RLIMIT_NOFILE``."""
    cpus: int = 0
    """CPUs of the host."""
    load1: float = 0.0
    """One-minute load average of the host."""
    scratch_total: int = 0
    """Bytes of the node's scratch filesystem (writable layers)."""
    scratch_free: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    """The node's labels from its config (e.g. ``pool=onprem``), for placement."""
    default_backend: str = "container"
    """The backend a spec without ``backend`` gets."""
    backends: list[BackendStatus] = Field(default_factory=list)


class ForkRequest(_Model):
    """``Sandbox.fork``: how many children, and what differs from the parent's spec.

    Every field left None is inherited from the parent (limits, labels, env, ttl and
    idle timeout; a child's ttl counts from its own creation)."""

    count: int = Field(1, ge=1, le=1000)
    limits: Limits | None = None
    labels: dict[str, str] | None = None
    env: dict[str, str] | None = None
    ttl: float | None = Field(None, gt=0)
    idle_timeout: float | None = Field(None, gt=0)


# --------------------------------------------------------------------------- fncall
# Short function calls served from warm pools (corral.backends.fncall, node/fncall.py).

CallStatus = Literal[
    "ok", "runtime_error", "timeout", "memory_limit", "output_limit", "compile_error"
]
Verdict = Literal["AC", "WA", "TLE", "MLE", "RE", "OLE", "CE"]


class CallLimits(_Model):
    """Limits of one function call, enforced by the kernel (rlimits, the pool sandbox's
    cgroup) and measured from the host."""

    cpu_time: float = Field(2.0, gt=0, le=600)
    """CPU seconds (RLIMIT_CPU in the call's process; cgroup CPU usage measured)."""
    wall_time: float = Field(5.0, gt=0, le=3600)
    """Wall-clock seconds; past it every process of the call is killed."""
    memory: ByteSize = Field(256 << 20, ge=8 << 20, le=64 << 30)
    """Memory of the call (cgroup limit); exceeding it is ``memory_limit``."""
    output: ByteSize = Field(64 << 10, ge=0, le=64 << 20)
    """Cap per stream (stdout, stderr each); exceeding it is ``output_limit``."""
    processes: int = Field(32, ge=1, le=4096)
    """Processes and threads of the call (RLIMIT_NPROC; the pool cgroup's pids limit)."""
    file_size: ByteSize = Field(16 << 20, ge=0, le=1 << 30)
    """Largest file the call may write (RLIMIT_FSIZE)."""


class CallRequest(_Model):
    """One short program to run in a warm pool sandbox."""

    language: str = Field(min_length=1, max_length=32)
    """A language of the image's pool: python, bash, c, cpp by default."""
    code: str = Field(max_length=16 << 20)
    stdin: str = Field("", max_length=64 << 20)
    limits: CallLimits = Field(default_factory=CallLimits)
    image: str | None = Field(None, min_length=1, max_length=300)
    """Image of the pool; None: the node's ``fncall.default_image``."""


class CallResult(_Model):
    """How one call ended. Times and memory are kernel figures read from the host."""

    status: CallStatus
    stdout: str = ""
    stderr: str = ""
    """For ``compile_error``: the compiler's messages."""
    exit_code: int | None = None
    signal: int | None = None
    cpu_time: float = 0.0
    """CPU seconds charged to the pool sandbox's cgroup during the call."""
    wall_time: float = 0.0
    peak_memory: int = 0
    """Peak bytes charged during the call, above the idle worker's own."""
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Case(_Model):
    """One test of a judge: input and expected output."""

    stdin: str = ""
    expected: str = ""


class CustomChecker(_Model):
    """A checker program, run as its own call in a separate pool sandbox (the submission
    cannot reach it). Its stdin is JSON ``{"input", "expected", "output"}``; exit code 0
    accepts, anything else is WA; its stdout becomes the case's message."""

    language: str = "python"
    code: str = Field(min_length=1, max_length=1 << 20)
    limits: CallLimits = Field(default_factory=CallLimits)


class JudgeRequest(_Model):
    language: str = Field(min_length=1, max_length=32)
    code: str = Field(max_length=16 << 20)
    tests: list[Case] = Field(min_length=1, max_length=10000)
    checker: Literal["exact", "tokens", "lines", "float"] | CustomChecker = "exact"
    """exact: byte-identical; lines: trailing whitespace of lines and trailing empty lines
    ignored; tokens: whitespace-insensitive; float: tokens, numbers within ``tolerance``."""
    tolerance: float = Field(1e-6, ge=0)
    """Absolute or relative tolerance of the ``float`` checker."""
    limits: CallLimits = Field(default_factory=CallLimits)
    image: str | None = Field(None, min_length=1, max_length=300)
    stop_on_failure: bool = False
    """Skip the remaining cases after the first that is not AC (they are not reported)."""


class CaseResult(_Model):
    verdict: Verdict
    result: CallResult
    message: str = ""


class JudgeResult(_Model):
    verdict: Verdict
    """AC when every case is; else the first case's verdict that is not."""
    cases: list[CaseResult] = Field(default_factory=list)
    compile: CallResult | None = None
    """The compile step of a compiled language (its stderr holds the compiler's messages)."""

    @property
    def passed(self) -> int:
        return sum(1 for c in self.cases if c.verdict == "AC")


# ---------------------------------------------------------------- stats (issue 14)
class Percentiles(_Model):
    """Nearest-rank percentiles of ``count`` durations, in seconds (each figure is one of
    the measured durations, never an interpolation)."""

    count: int
    p50: float
    p90: float
    p99: float
    mean: float
    max: float


class OpStats(Percentiles):
    """One operation's end-to-end durations, and each of its phases'."""

    phases: dict[str, Percentiles] = Field(default_factory=dict)
    """Phase -> its durations, e.g. create: admission, layer_mounts, rootfs,
    runtime_start, network_attach, init_ready; exec: queue, agent_round_trip,
    process_run."""


class Stats(_Model):
    """Latency and event figures of the sandboxes matching ``labels`` on one node, e.g.
    ``(await client.stats(labels={"job": "rl-42"})).ops["create"].phases["rootfs"].p99``."""

    labels: dict[str, str] = Field(default_factory=dict)
    """The label filter (empty: every sandbox, and node-level operations)."""
    since: float = 0.0
    until: float = Field(default_factory=time.time)
    """The time range (unix seconds) the figures cover."""
    sandboxes: int = 0
    """Sandboxes (live or destroyed) that match the filter."""
    ops: dict[str, OpStats] = Field(default_factory=dict)
    """Operation (create, exec, destroy, pause, resume, fork, snapshot) -> durations."""
    events: dict[str, int] = Field(default_factory=dict)
    """Event kind -> occurrences over the matching sandboxes in the range."""
    truncated: bool = False
    """True when the range held more timings than one answer reads (the newest were used)."""


class TimelineEntry(_Model):
    """One line of a sandbox's timeline: an operation it went through (with its phases)
    or an event recorded for it."""

    time: float
    """Unix time: when the operation ended, or when the event was recorded."""
    kind: Literal["op", "event"]
    name: str
    """The operation (``create``, ``exec``...) or the event kind (``seccomp``...)."""
    seconds: float | None = None
    phases: dict[str, float] = Field(default_factory=dict)
    detail: dict[str, str | int | float | bool | None] = Field(default_factory=dict)


__all__ += ["Percentiles", "OpStats", "Stats", "TimelineEntry"]
