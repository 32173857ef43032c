"""The one exception tree of corral.

    CorralError                      base of everything corral raises
    ├── InvalidRequest               bad input: a field, a path, a size (HTTP 400/422)
    │   └── PathRefused              a file path escapes the sandbox root or names a device
    ├── NotFound                     (HTTP 404)
    │   ├── SandboxNotFound
    │   ├── ImageNotFound
    │   ├── LayerNotFound
    │   └── ProcessNotFound          a background process or shell id
    ├── Conflict                     wrong state for the operation (HTTP 409)
    ├── CursorExpired                an events cursor older than the node's retention (HTTP 410)
    ├── CapacityError                the node refuses: no room for another sandbox (HTTP 503)
    │   ├── ScratchFull              the node's scratch filesystem (all writable layers) is full
    │   └── JobQuotaExceeded         a job's own limit (live cap) is reached (HTTP 429)
    ├── QuotaExceeded                the sandbox's own disk quota is full (HTTP 507)
    ├── SandboxError                 the sandbox is broken or its init does not answer (HTTP 502)
    ├── BuildError                   a layer could not be built
    ├── LayerCorrupt                 a layer file does not match its digest
    ├── StoreUnavailable             the layer store's filesystem does not answer (HTTP 503)
    ├── HostError                    a kernel facility failed on the node (HTTP 500)
    ├── Unauthorized                 missing or wrong bearer token (HTTP 401)
    └── TransportError               the node could not be reached

Errors cross the wire as ``{"error": {"kind": "SandboxNotFound", "message": ...}}``; the
client rebuilds only kinds listed in ``KINDS`` and falls back to ``CorralError``.
"""

from __future__ import annotations

__all__ = [
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
    "KINDS",
    "error_from_wire",
]


class CorralError(Exception):
    """Base of every error corral raises."""

    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict[str, dict[str, str]]:
        return {"error": {"kind": type(self).__name__, "message": self.message}}


class InvalidRequest(CorralError):
    status = 400


class PathRefused(InvalidRequest):
    pass


class NotFound(CorralError):
    status = 404


class SandboxNotFound(NotFound):
    pass


class JobNotFound(NotFound):
    """No job of that name in the cluster's control plane."""


class ImageNotFound(NotFound):
    pass


class LayerNotFound(NotFound):
    pass


class ProcessNotFound(NotFound):
    pass


class Conflict(CorralError):
    status = 409


class CursorExpired(CorralError):
    """An ``events`` cursor points before the oldest event the node still keeps: the
    events between were trimmed by its retention (``event_retention``, ``event_max_age``)
    and can no longer be read, so continuing from it would skip them silently.

    HTTP 410 (Gone), like a watch whose resource version is too old. Reading again
    without a cursor starts at the oldest kept event, all of them newer than the cursor."""

    status = 410


class CapacityError(CorralError):
    status = 503


class ScratchFull(CapacityError):
    """The node's scratch filesystem, which holds every sandbox's writable layer, is full.

    Not the sandbox's fault and not fixed by it: the node needs space (destroy sandboxes,
    or give the node a larger ``scratch_size``). A 503 so that a client may retry later
    or elsewhere."""


class QuotaExceeded(CorralError):
    """The sandbox's disk quota (``Limits.disk``) is full: EDQUOT from a file operation.

    HTTP 507 (Insufficient Storage): the request was fine, the sandbox has no room for it.
    Free space inside the sandbox (delete files) or create it with a larger
    ``Limits.disk``. Never a security event: a full disk is not an attack."""

    status = 507


class JobQuotaExceeded(CapacityError):
    """A job's (or project's) own limit refuses the request, not the fleet's room.

    ``retry_after``: seconds after which the same request may pass (None: only once the
    job's sandboxes are destroyed). The HTTP layer sends it as ``Retry-After``."""

    status = 429

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SandboxError(CorralError):
    status = 502


class BuildError(CorralError):
    status = 500


class LayerCorrupt(CorralError):
    status = 500


class StoreUnavailable(CorralError):
    """The layer store's directory (often a network filesystem) did not answer in time
    or reports its transport gone; sandboxes already running keep their mounted layers."""

    status = 503


class HostError(CorralError):
    status = 500


class Unauthorized(CorralError):
    status = 401


class TransportError(CorralError):
    status = 503


KINDS: dict[str, type[CorralError]] = {
    c.__name__: c
    for c in (
        CorralError,
        InvalidRequest,
        PathRefused,
        NotFound,
        SandboxNotFound,
        JobNotFound,
        ImageNotFound,
        LayerNotFound,
        ProcessNotFound,
        Conflict,
        CursorExpired,
        CapacityError,
        ScratchFull,
        QuotaExceeded,
        JobQuotaExceeded,
        SandboxError,
        BuildError,
        LayerCorrupt,
        StoreUnavailable,
        HostError,
        Unauthorized,
        TransportError,
    )
}


def error_from_wire(body: object, status: int = 500) -> CorralError:
    """Rebuild an error sent by a node; unknown kinds become plain CorralError."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        cls = KINDS.get(str(err.get("kind")), CorralError)
        return cls(str(err.get("message", "")))
    return CorralError(f"node answered HTTP {status}: {str(body)[:500]}")
