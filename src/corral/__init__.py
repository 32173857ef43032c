"""corral: elastic, isolated Linux sandboxes for training and evaluating AI agents.

Example:
    >>> import corral
    >>> async with corral.AsyncClient() as client:                            # doctest: +SKIP
    ...     image = await client.images.get("demo/python")
    ...     sb = await client.sandboxes.create(image=image, limits=corral.Limits(memory="1GiB"))
    ...     r = await sb.exec(["python", "-c", "print(1+1)"], timeout=30)
    ...     await sb.destroy()

``corral.Client`` is the same API, blocking. Importing corral stays light: the embedded
node, the HTTP transport and the API server are imported when first used.
"""

import importlib.metadata as _metadata

from corral.errors import (
    BuildError,
    CapacityError,
    Conflict,
    CorralError,
    CursorExpired,
    HostError,
    ImageNotFound,
    InvalidRequest,
    JobNotFound,
    JobQuotaExceeded,
    LayerCorrupt,
    LayerNotFound,
    NotFound,
    PathRefused,
    ProcessNotFound,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    ScratchFull,
    StoreUnavailable,
    TransportError,
    Unauthorized,
)
from corral.sdk import AsyncClient, Client, Process, Sandbox, Shell
from corral.spec import (
    CallLimits,
    CallRequest,
    CallResult,
    Case,
    CaseResult,
    CustomChecker,
    Desktop,
    Event,
    ExecChunk,
    ExecResult,
    FileStat,
    ImageInfo,
    JudgeResult,
    LayerInfo,
    Limits,
    NetworkPolicy,
    NodeStatus,
    ProcessInfo,
    SandboxInfo,
    SandboxSpec,
)

try:
    __version__ = _metadata.version("corral")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    # clients and handles
    "AsyncClient",
    "Client",
    "Sandbox",
    "Shell",
    "Process",
    # models
    "Limits",
    "NetworkPolicy",
    "Desktop",
    "SandboxSpec",
    "SandboxInfo",
    "ExecResult",
    "ExecChunk",
    "ProcessInfo",
    "ImageInfo",
    "LayerInfo",
    "FileStat",
    "Event",
    "NodeStatus",
    # fncall models
    "CallLimits",
    "CallRequest",
    "CallResult",
    "Case",
    "CaseResult",
    "CustomChecker",
    "JudgeResult",
    # errors
    "CorralError",
    "InvalidRequest",
    "PathRefused",
    "NotFound",
    "SandboxNotFound",
    "JobNotFound",
    "ImageNotFound",
    "LayerNotFound",
    "ProcessNotFound",
    "Conflict",
    "CursorExpired",
    "CapacityError",
    "ScratchFull",
    "QuotaExceeded",
    "JobQuotaExceeded",
    "SandboxError",
    "BuildError",
    "LayerCorrupt",
    "StoreUnavailable",
    "HostError",
    "Unauthorized",
    "TransportError",
]
