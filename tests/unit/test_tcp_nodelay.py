"""Calls over TCP are not held back by Nagle + delayed ACK (a ~40 ms stall per call).

A response written in parts (headers, then body) waits for the client's delayed ACK unless
the server's socket has TCP_NODELAY; asyncio sets it on accepted sockets only when the
listening socket names IPPROTO_TCP. Checked on the server's accepted socket, not by timing.
"""

from __future__ import annotations

import asyncio
import socket

from corral.api.server import NodeServer
from corral.testing import FakeNode


async def test_accepted_api_connections_have_tcp_nodelay() -> None:
    async with NodeServer(FakeNode(), host="127.0.0.1", port=0, token="t") as srv:
        host, port = srv.address.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"GET /v1/node HTTP/1.1\r\nhost: x\r\nauthorization: Bearer t\r\n\r\n")
            await writer.drain()
            assert (await reader.readline()).startswith(b"HTTP/1.1")
            assert srv._server is not None
            conns = list(srv._server.server_state.connections)
            assert conns
            for proto in conns:
                sock = proto.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            writer.close()
