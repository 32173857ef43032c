"""Speak E2B: the ``e2b`` SDK (``pip install e2b==2.63.0``) runs unchanged against corral.

::

    corral node serve --tcp 127.0.0.1:8700 --token-file tok
    export E2B_API_URL=http://127.0.0.1:8700 E2B_SANDBOX_URL=http://127.0.0.1:8700
    export E2B_API_KEY=$(cat tok)
    python my_e2b_harness.py

:class:`E2BGateway` sits in front of the node's API app (one HTTP server) and takes the
requests that are E2B's:

- a request with an ``E2b-Sandbox-Id`` header goes to envd (:mod:`._envd`), which the
  node serves itself: no daemon runs in the guest;
- ``Host: {port}-{sandboxID}.{domain}`` and ``/sandboxes/{id}/ports/{port}/...`` go to
  the port relay (:mod:`._ports`), which needs nothing of the e2b package;
- ``/sandboxes...`` and ``/v2/sandboxes...`` go to the control plane (:mod:`._control`);
- everything else (corral's ``/v1``, ``/metrics``, ``/ui``) goes to the node's app.

It is written against :class:`corral.ops.NodeOps` only, so a cluster front can mount it
over a cluster client. The ``e2b`` package is needed for the Connect stubs and messages;
without it E2B requests answer 501 naming the extra to install.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

from corral.integrations.e2b._common import ENVD_VERSION, E2BConfig, e2b_config, envd_token
from corral.integrations.e2b._ports import HOST_RE, PATH_RE, PortProxy
from corral.ops import NodeOps

__all__ = ["E2BGateway", "E2BConfig", "ENVD_VERSION", "e2b_config", "envd_token"]

log = logging.getLogger("corral.e2b")


async def _guarded(app: Any, scope: Any, receive: Any, send: Any) -> None:
    """An unexpected exception is a logged 500 in E2B's error shape, never a dropped
    connection (the gateway sits outside the API app's own catch-all)."""
    started = False

    async def tracking(msg: Any) -> None:
        nonlocal started
        started = started or msg["type"] == "http.response.start"
        await send(msg)

    try:
        await app(scope, receive, tracking)
    except Exception:
        log.exception("e2b: internal error serving %s %s", scope.get("method"), scope["path"])
        if started or scope["type"] != "http":
            raise
        body = {"code": 500, "message": "internal error (logged on the node)"}
        await JSONResponse(body, 500)(scope, receive, send)


class E2BGateway:
    """ASGI middleware routing E2B's requests away from the node's own API (see above)."""

    def __init__(
        self,
        app: Any,
        ops: NodeOps,
        token: str | None = None,
        config: E2BConfig | None = None,
        max_upload: int = 1 << 30,
    ) -> None:
        self.app = app
        self.ops = ops
        self.token = token
        self.config = config or E2BConfig()
        self.max_upload = max_upload
        self._control: Any = None
        self._envd: Any = None
        self._ports = PortProxy(ops, token)
        self._missing: str | None = None

    def _load(self) -> bool:
        """Build the E2B apps on first use (imports the e2b package only then)."""
        if self._control is not None or self._missing is not None:
            return self._missing is None
        try:
            from corral.integrations.e2b._control import ControlPlane
            from corral.integrations.e2b._envd import Envd
        except ImportError as exc:
            self._missing = f"the E2B API needs the e2b package ({exc}): pip install 'corral[e2b]'"
            return False
        self._control = ControlPlane(self.ops, self.token, self.config)
        self._envd = Envd(self.ops, self.token, self.config, self.max_upload)
        return True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
        is_port = HOST_RE.match(host) is not None or PATH_RE.match(path) is not None
        is_envd = any(k == b"e2b-sandbox-id" for k, _ in scope["headers"])
        is_control = path.startswith(("/sandboxes", "/v2/sandboxes", "/templates/"))
        if is_port:
            await _guarded(self._ports, scope, receive, send)
            return
        if not (is_envd or is_control):
            await self.app(scope, receive, send)
            return
        if not self._load():
            body = {"code": 501, "message": self._missing}
            await JSONResponse(body, 501)(scope, receive, send)
            return
        target = self._envd if is_envd else self._control
        await _guarded(target, scope, receive, send)
