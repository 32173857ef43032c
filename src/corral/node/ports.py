"""A TCP connection from the node into one sandbox's loopback (the port proxy's way in).

The guest needs no network of its own: the node creates the socket inside the sandbox's
network namespace (:func:`corral.host.netlink.tcp_socket_in`) and connects it to
``127.0.0.1:port`` there. Only that address is dialled, so nothing but a port the guest
itself listens on (on its loopback or any address) is reachable, and never the host's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from corral.errors import InvalidRequest, SandboxError
from corral.host.netlink import tcp_socket_in
from corral.node.table import SandboxTable
from corral.spec import SandboxInfo

__all__ = ["connect_port", "CONNECT_TIMEOUT"]

CONNECT_TIMEOUT = 10.0
"""Seconds a connect may take (a paused sandbox's kernel still completes the handshake,
so this bounds only a namespace under pressure)."""


async def connect_port(
    table: SandboxTable, info: SandboxInfo, sandbox_id: str, port: int
) -> socket.socket:
    """See :meth:`corral.ops.PortOps.port_connect`; ``info`` is the sandbox as
    ``Lifecycle.active`` gave it (a paused one was woken)."""
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"port {port}: not 1-65535")
    if info.backend != "container":
        raise InvalidRequest(
            f"sandbox {sandbox_id} runs on the {info.backend!r} backend, whose network the "
            "node cannot enter; its ports are relayed per request (HTTP only)"
        )
    if not info.pid:
        raise SandboxError(f"sandbox {sandbox_id} is {info.state}, not running")
    pid = info.pid
    sock = await asyncio.to_thread(tcp_socket_in, pid)
    try:
        # The pid was read before the namespace was opened: if the sandbox ended in
        # between, the pid may name another process. Still the same live sandbox now?
        now = table.get(sandbox_id)
        if now is None or now.pid != pid or now.state in ("destroying", "destroyed"):
            raise SandboxError(f"sandbox {sandbox_id} stopped while connecting to port {port}")
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), CONNECT_TIMEOUT)
    except ConnectionRefusedError:
        sock.close()
        raise SandboxError(f"nothing listens on port {port} in sandbox {sandbox_id}") from None
    except (OSError, TimeoutError) as exc:
        sock.close()
        raise SandboxError(f"cannot connect to port {port} in sandbox {sandbox_id}: {exc}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    table.touch(sandbox_id)
    return sock
