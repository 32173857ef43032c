"""``sandbox.ports``: the URLs at which a server the guest runs on a port is reached.

Nothing is opened or forwarded on the node by ``expose``: every port of a running
sandbox is reachable through the node's HTTP server (the port proxy, HTTP and WebSocket)
by whoever holds the node's token or the sandbox's own access token. ``expose`` checks
the sandbox and spells out the URLs and the header to send, so that the token handed to
a browser or a tool opens this sandbox's ports and nothing else of the node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from corral.errors import InvalidRequest
from corral.ops import NodeOps

__all__ = ["Ports", "PortEndpoint"]


@dataclass(frozen=True)
class PortEndpoint:
    """Where port ``port`` of a sandbox is reached, and with what.

    ``url`` is the path form (``http://node:8700/sandboxes/{id}/ports/{port}/``);
    ``host_url`` the host form (``http://{port}-{id}.node:8700/``, needs a wildcard DNS
    name for the node, or ``localhost``: ``*.localhost`` resolves to loopback for most
    clients); ``headers`` authenticate a request (the sandbox's access token: it opens
    this sandbox's ports only); ``unix_socket`` is set when the node is reached over a
    unix socket (then ``url`` names the path to ask for over it).
    """

    sandbox_id: str
    port: int
    url: str
    host_url: str | None
    headers: dict[str, str] = field(default_factory=dict)
    unix_socket: str | None = None

    @property
    def browser_url(self) -> str:
        """``url`` with the sandbox's token as ``?corral_token=``, for a browser: the node
        answers with a cookie (HttpOnly, this port only) and a redirect to ``url``. The
        link is a credential for this sandbox's ports: share it as such."""
        token = self.headers.get("X-Access-Token")
        return f"{self.url}?corral_token={token}" if token else self.url

    @property
    def ws_url(self) -> str:
        """``url`` as a WebSocket URL (``ws://`` or ``wss://``)."""
        return "ws" + self.url[4:] if self.url.startswith("http") else self.url


class Ports:
    """Ports of one sandbox (see the module doc).

    Example:
        >>> await sb.spawn("python3 -m http.server 8000 --bind 127.0.0.1")  # doctest: +SKIP
        >>> ep = await sb.ports.expose(8000)                                 # doctest: +SKIP
        >>> httpx.get(ep.url, headers=ep.headers).status_code                # doctest: +SKIP
        200
    """

    __slots__ = ("_ops", "_sandbox_id")

    def __init__(self, ops: NodeOps, sandbox_id: str) -> None:
        self._ops, self._sandbox_id = ops, sandbox_id

    def __repr__(self) -> str:
        return f"Ports(sandbox={self._sandbox_id!r})"

    async def expose(self, port: int) -> PortEndpoint:
        """The URLs and headers that reach ``port`` of this sandbox through the node's
        HTTP server. InvalidRequest for a port outside 1-65535 or a client that does not
        talk to a node over HTTP (an embedded node has no address to name)."""
        from corral.sdk._http import HTTPOps

        if not 1 <= port <= 65535:
            raise InvalidRequest(f"port {port}: not 1-65535")
        if not isinstance(self._ops, HTTPOps):
            raise InvalidRequest(
                "ports are reached through a node's HTTP server: connect the client to it "
                "(AsyncClient('http://host:8700', token=...)); an embedded node has none"
            )
        await self._ops.sandbox_get(self._sandbox_id)  # exists, and ours to see
        return self._ops.port_endpoint(self._sandbox_id, port)
