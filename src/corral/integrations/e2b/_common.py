"""What the E2B control plane and envd share: config, tokens, users, error bodies.

The envd access token of a sandbox is an HMAC of its id under the node's token, so any
node (or a cluster front) holding the token can check it without a table, and a token
for one sandbox opens no other.
"""

from __future__ import annotations

import hashlib
import hmac
import posixpath
from dataclasses import dataclass, field

from corral.errors import CorralError, InvalidRequest, PathRefused

ENVD_VERSION = "0.6.4"
"""The envd version reported: 0.6.4 unlocks every feature of e2b 2.63 the SDK gates."""

LABEL_E2B = "e2b"
"""Label set on every sandbox the E2B API created (value: the template asked)."""
LABEL_META = "e2b.m."
"""Prefix of the labels that hold an E2B sandbox's metadata."""


@dataclass(frozen=True)
class E2BConfig:
    """How the E2B API maps onto this node.

    ``templates`` maps E2B template ids/aliases to corral image names; a template not in
    the table is used as the image name itself (``Sandbox.create("py/pytest")``).
    """

    templates: dict[str, str] = field(default_factory=lambda: {"base": "base/debian"})
    """Template id or alias -> corral image."""
    default_timeout: int = 300
    """Seconds an E2B sandbox lives when the create request names no timeout (E2B's)."""
    max_timeout: int = 24 * 3600
    """Longest timeout accepted (the timeout is the sandbox's corral TTL)."""
    default_user: str = "user"
    """The account commands and file operations use when the request names none."""
    cpus: float = 2.0
    memory: str = "1GiB"
    retry_after: int = 1
    """Seconds a client is told to wait when the node is at capacity (429)."""


def e2b_config(ops: object) -> E2BConfig:
    """The E2B config of a node: the built-in template table with the node config's
    ``e2b_templates`` over it (``ops`` without a NodeConfig, e.g. a cluster client or
    the FakeNode: the built-in table alone)."""
    extra = getattr(getattr(ops, "config", None), "e2b_templates", None)
    if not isinstance(extra, dict) or not extra:
        return E2BConfig()
    return E2BConfig(templates={**E2BConfig().templates, **extra})


def envd_token(node_token: str | None, sandbox_id: str) -> str | None:
    """The envd access token of ``sandbox_id`` (None where the node has no token)."""
    if not node_token:
        return None
    return hmac.new(node_token.encode(), sandbox_id.encode(), hashlib.sha256).hexdigest()


def token_ok(expected: str | None, got: str | None) -> bool:
    """Constant-time check; a node without a token accepts every caller."""
    if expected is None:
        return True
    return got is not None and hmac.compare_digest(expected.encode(), got.encode())


def home_of(user: str) -> str:
    return "/root" if user == "root" else f"/home/{user}"


def guest_path(path: str, user: str) -> str:
    """An E2B path as a corral absolute path: relative paths start at the user's home,
    ``~`` is the home. Paths are normalised; escaping ``/`` is impossible after it."""
    if not path:
        raise InvalidRequest("path: empty")
    if "\x00" in path:
        raise PathRefused("path: contains a NUL byte")
    if path == "~" or path.startswith("~/"):
        path = home_of(user) + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(home_of(user), path)
    return posixpath.normpath(path).replace("//", "/")


def error_status(exc: CorralError) -> int:
    """The HTTP status E2B uses for a corral error (capacity: 429, as E2B rate limits)."""
    from corral.errors import CapacityError

    if isinstance(exc, CapacityError):
        return 429
    return exc.status


def e2b_error(code: int, message: str) -> dict[str, object]:
    """The body of every E2B error answer: ``{"code", "message"}``."""
    return {"code": code, "message": message}
