"""The node resolver: answers a sandbox only for names its policy allows.

It listens on the node's gateway address (UDP 53), the only address and port a sandbox's
packets may reach on the node. A query is attributed to a sandbox by its source address
(nftables drops anything arriving on a sandbox's veth with another source, so the address
cannot be forged). An allowed name is forwarded to the upstream resolver; the IPv4
addresses in the answer are opened for that sandbox *before* the answer is sent, so the
connection that follows is admitted. Anything else gets NXDOMAIN and is reported as a
denial. DNS messages are parsed and built with dnslib, never by hand.

AAAA queries for allowed names get an empty answer: sandboxes have IPv4 only, and a
client that got an IPv6 address would try it first and fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol

from dnslib import QTYPE, RCODE, DNSRecord  # type: ignore[import-untyped]

__all__ = ["Resolver", "ResolverPolicy"]

log = logging.getLogger("corral.resolver")

_UPSTREAM_TIMEOUT = 2.0
_MAX_INFLIGHT = 512


class ResolverPolicy(Protocol):
    """What the resolver asks the node network for each query."""

    def allowed(self, source: str, name: str) -> bool:
        """May the sandbox with address ``source`` resolve ``name``?"""
        ...

    async def admit(self, source: str, name: str, addrs: list[tuple[str, int]]) -> None:
        """Open (address, ttl) pairs from an allowed answer for that sandbox."""
        ...

    def denied(self, source: str, name: str, qtype: str) -> None:
        """Record a refused lookup."""
        ...


class _Proto(asyncio.DatagramProtocol):
    def __init__(self, handle: Callable[[bytes, tuple[str, int]], Awaitable[None]]) -> None:
        self._handle = handle
        self._tasks: set[asyncio.Task[None]] = set()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:  # type: ignore[override]
        if len(self._tasks) >= _MAX_INFLIGHT:
            return  # bounded: a flood costs the flooder its own answers
        t = asyncio.ensure_future(self._handle(data, addr))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)


class Resolver:
    """A UDP DNS server on ``bind`` (address, port) for the node's sandboxes."""

    def __init__(
        self,
        bind: tuple[str, int],
        upstream: list[tuple[str, int]],
        policy: ResolverPolicy,
    ) -> None:
        self.bind = bind
        self.upstream = upstream
        self.policy = policy
        self._transport: asyncio.DatagramTransport | None = None
        self._proto: _Proto | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            # IP_FREEBIND: the gateway address may still be settling on its dummy device.
            sock.setsockopt(socket.IPPROTO_IP, 15, 1)
            sock.bind(self.bind)
        except OSError:
            sock.close()
            raise
        proto = self._proto = _Proto(self._handle)
        transport, _ = await loop.create_datagram_endpoint(lambda: proto, sock=sock)
        self._transport = transport

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the port is known once started, if 0 was asked for)."""
        if self._transport is None:
            return self.bind
        return self._transport.get_extra_info("sockname")[:2]  # type: ignore[no-any-return]

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._proto is not None:
            for t in list(self._proto._tasks):
                t.cancel()
            self._proto = None

    def _send(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._transport is not None:
            self._transport.sendto(data, addr)

    async def _handle(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            query = DNSRecord.parse(data)
        except Exception:
            return  # not DNS: no answer (the sender learns nothing)
        source = addr[0]
        if not query.questions:
            return
        q = query.questions[0]
        name = str(q.qname).rstrip(".").lower()
        qtype = QTYPE.get(q.qtype, str(q.qtype))
        if len(query.questions) != 1 or not self.policy.allowed(source, name):
            self.policy.denied(source, name, str(qtype))
            reply = query.reply()
            reply.header.rcode = RCODE.NXDOMAIN
            self._send(reply.pack(), addr)
            return
        if q.qtype == QTYPE.AAAA:
            self._send(query.reply().pack(), addr)  # NOERROR, no records: IPv4 only
            return
        answer = await self._forward(data)
        if answer is None:
            reply = query.reply()
            reply.header.rcode = RCODE.SERVFAIL
            self._send(reply.pack(), addr)
            return
        try:
            parsed = DNSRecord.parse(answer)
        except Exception:
            return
        limit = _udp_limit(query)
        if len(answer) > limit:
            # Too big for the client's UDP buffer, and its TCP retry would be dropped (a
            # sandbox may only send UDP to the resolver): answer with as many records as fit.
            parsed = _trimmed(query, parsed, limit)
            answer = parsed.pack()
        addrs = [(str(rr.rdata), int(rr.ttl)) for rr in parsed.rr if rr.rtype == QTYPE.A]
        if addrs:
            try:
                await self.policy.admit(source, name, addrs)
            except Exception:
                log.exception("could not open addresses of %s for %s", name, source)
                reply = query.reply()
                reply.header.rcode = RCODE.SERVFAIL
                self._send(reply.pack(), addr)
                return
        self._send(answer, addr)

    async def _forward(self, data: bytes) -> bytes | None:
        loop = asyncio.get_running_loop()
        qid = data[:2]
        for server in self.upstream:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, server)
                await loop.sock_sendall(sock, data)
                async with asyncio.timeout(_UPSTREAM_TIMEOUT):
                    while True:
                        resp = await loop.sock_recv(sock, 65535)
                        if resp[:2] == qid:
                            return resp
            except (OSError, TimeoutError):
                continue
            finally:
                with contextlib.suppress(OSError):
                    sock.close()
        return None


def _udp_limit(query: DNSRecord) -> int:
    """The reply size the client accepts over UDP: 512, or its EDNS0 buffer size."""
    for rr in query.ar:
        if rr.rtype == QTYPE.OPT:
            return int(max(512, min(int(rr.rclass), 4096)))
    return 512


def _trimmed(query: DNSRecord, answer: DNSRecord, limit: int) -> DNSRecord:
    reply = query.reply()
    reply.header.rcode = answer.header.rcode
    for rr in answer.rr:
        reply.add_answer(rr)
    while reply.rr and len(reply.pack()) > limit:
        reply.rr.pop()
    return reply
