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
    ├── CapacityError                the node refuses: no room for another sandbox (HTTP 503)
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
    "ImageNotFound",
    "LayerNotFound",
    "ProcessNotFound",
    "Conflict",
    "CapacityError",
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


class ImageNotFound(NotFound):
    pass


class LayerNotFound(NotFound):
    pass


class ProcessNotFound(NotFound):
    pass


class Conflict(CorralError):
    status = 409


class CapacityError(CorralError):
    status = 503


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
        ImageNotFound,
        LayerNotFound,
        ProcessNotFound,
        Conflict,
        CapacityError,
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
