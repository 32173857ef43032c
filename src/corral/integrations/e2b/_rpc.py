"""Helpers of the Connect services: which sandbox and user a call is for, and errors."""

from __future__ import annotations

import base64
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from corral.errors import (
    CapacityError,
    Conflict,
    CorralError,
    InvalidRequest,
    NotFound,
    SandboxNotFound,
    Unauthorized,
)
from corral.integrations.e2b._common import E2BConfig

_CODES: list[tuple[type[CorralError], Code]] = [
    (NotFound, Code.NOT_FOUND),
    (InvalidRequest, Code.INVALID_ARGUMENT),
    (Conflict, Code.ALREADY_EXISTS),
    (Unauthorized, Code.UNAUTHENTICATED),
    (CapacityError, Code.RESOURCE_EXHAUSTED),
]


def connect_error(exc: CorralError) -> ConnectError:
    """A corral error as the Connect code envd would answer (a sandbox gone: unavailable,
    which the SDK reports as a sandbox that is not running)."""
    if isinstance(exc, SandboxNotFound):
        return ConnectError(Code.UNAVAILABLE, f"The sandbox was not found: {exc}")
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return ConnectError(code, str(exc))
    return ConnectError(Code.INTERNAL, str(exc))


def sandbox_of(ctx: RequestContext[Any, Any]) -> str:
    """The sandbox a call is for: the ``E2b-Sandbox-Id`` header (checked by the envd app
    against the access token before the call got here)."""
    sid = ctx.request_headers.get("e2b-sandbox-id")
    if not sid:
        raise ConnectError(Code.INVALID_ARGUMENT, "missing E2b-Sandbox-Id header")
    return sid


def user_from_header(auth: str | None, config: E2BConfig) -> str:
    """``Authorization: Basic base64(user:)`` selects the account; none: the default."""
    if auth and auth.lower().startswith("basic "):
        try:
            name = base64.b64decode(auth[6:].strip()).decode().partition(":")[0]
        except ValueError:
            raise InvalidRequest("Authorization: not Basic base64(user:)") from None
        if name:
            if not name.replace("-", "").replace("_", "").isalnum() or len(name) > 32:
                raise InvalidRequest(f"user {name!r}: not an account name")
            return name
    return config.default_user


def request_user(ctx: RequestContext[Any, Any], config: E2BConfig) -> str:
    try:
        return user_from_header(ctx.request_headers.get("authorization"), config)
    except InvalidRequest as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from None


def oneof(field: str, value: Any) -> Any:
    """A protobuf oneof value (typed Any: the generated stubs want a literal per field)."""
    return Oneof(field, value)
