"""Typed models every room of corral speaks.

These are shared by the SDK, the REST API and the node, so a request built by the SDK is
validated by the same code on the node. Bytes travel as base64 in JSON.

Example:
    >>> Limits(memory="512MiB").memory
    536870912
"""

from __future__ import annotations

import math
import re
import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

__all__ = [
    "ByteSize",
    "Limits",
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
    "NodeStatus",
    "parse_bytes",
    "SANDBOX_ID_RE",
    "validation_message",
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

SANDBOX_ID_RE = re.compile(r"^sb-[0-9a-z]{12}$")


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
    """Quota of the writable layer; writes past it fail with ENOSPC/EDQUOT inside."""
    output: ByteSize = Field(1 << 20, ge=1024, le=1 << 30)
    """Default cap per exec output stream (stdout, stderr each)."""


class SandboxSpec(_Model):
    """What to create."""

    image: str = Field(min_length=1, max_length=300)
    """Image name (``demo/python``) or ``sha256:`` digest of an image manifest."""
    limits: Limits = Field(default_factory=Limits)
    ttl: float | None = Field(None, gt=0)
    """Seconds after creation at which the sandbox is destroyed."""
    idle_timeout: float | None = Field(None, gt=0)
    """Seconds without a request after which the sandbox is destroyed."""
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    """Environment added to every exec."""
    workdir: str = "/"
    """Default cwd of execs and shells."""
    hostname: str = Field("sandbox", pattern=r"^[a-zA-Z0-9][a-zA-Z0-9.-]{0,62}$")

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


def _check_abs_path(v: str, what: str) -> str:
    if not v.startswith("/") or "\0" in v or len(v) > 4096:
        raise ValueError(f"{what} must be an absolute path without NUL bytes")
    return v


SandboxState = Literal[
    "creating", "running", "paused", "stopped", "destroying", "destroyed", "failed"
]


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
    runtime: str = ""
    """OCI runtime that runs it (runc or crun)."""
    pid: int | None = None
    """Host pid of the sandbox's init."""
    detail: str = ""


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
        if any("\0" in a for a in v):
            raise ValueError("cmd arguments cannot contain NUL bytes")
        if not v[0]:
            raise ValueError("cmd[0] cannot be empty")
        return v

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
    sandbox_id: str | None
    time: float
    kind: str
    """e.g. ``created``, ``destroyed``, ``oom``, ``output_truncated``, ``file_refused``."""
    detail: dict[str, str | int | float | bool | None] = Field(default_factory=dict)


class NodeStatus(_Model):
    node_id: str
    version: str
    runtime: str
    cgroup_mode: Literal["v1", "v2", "hybrid"]
    sandboxes: int
    running: int
    state_dir: str
    store: str
    mounted_layers: int
    mem_total: int
    mem_available: int
