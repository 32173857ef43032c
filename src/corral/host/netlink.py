"""Links, addresses and routes over rtnetlink (pyroute2), without a process per operation.

A sandbox's network namespace is created by the OCI runtime (owned by the sandbox's user
namespace, so the guest's sysfs is its own). To wire it, the node creates a veth pair whose
peer is born inside that namespace (``IFLA_NET_NS_FD``), and configures the peer through
a netlink socket opened *in* the namespace: the calling thread ``setns``-es into it just
long enough to create the socket (sockets keep the namespace they were created in), then
returns. pyroute2's own netns support forks a child per socket; this does not. The attach
path packs its few messages itself (``_Rtnl``, batched: one ``send`` per side) instead of
going through pyroute2, whose Python costs more per message than the kernel's work.

Routed, not bridged: every host-side veth is a point-to-point link with a /32 route to its
sandbox, and the sandbox's default route points at the node's gateway address, which lives
on a port-less bridge device (the host answers ARP for it on any link). There is no L2 segment between
sandboxes, and the host sees on which veth each packet arrived (anti-spoofing in nftables).

Example::

    links = await Links.open()
    await links.ensure_gateway("cn1a2b3c", "10.213.0.1")
    await links.attach_veth("cvabc", pid, "10.213.0.5", gateway="10.213.0.1")
    await links.delete("cvabc")
    await links.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct
from collections.abc import Awaitable, Iterator
from pathlib import Path

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from corral.errors import HostError

__all__ = ["Links", "netlink_socket_in", "tcp_socket_in", "write_sysctl"]

_CLONE_NEWNET = 0x40000000
_RT_SCOPE_LINK = 253
_RTNH_F_ONLINK = 4
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def netlink_socket_in(pid: int, *, disable_ipv6: bool = True) -> tuple[socket.socket, int]:
    """An rtnetlink socket in the network namespace of ``pid``, and an fd of that namespace.

    Only the calling thread switches namespace, and only for the few syscalls in between;
    it always switches back (if it could not, the thread would keep serving the node from
    the sandbox's namespace: abort rather than run on like that). With ``disable_ipv6``
    new links in the namespace get no IPv6 (the node routes IPv4 only; nothing should
    answer on link-local v6 either), set through that namespace's /proc/sys.
    """
    try:
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise HostError(f"cannot open the network namespace of pid {pid}: {e.strerror}") from e
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(target)
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, 0)
            if disable_ipv6:
                # /proc/sys/net shows the namespace of the opening thread.
                for conf in ("default", "all"):
                    with contextlib.suppress(OSError):
                        write_sysctl(f"net/ipv6/conf/{conf}/disable_ipv6", "1")
        finally:
            try:
                _setns(own)
            except OSError:
                os.abort()
    except OSError as e:
        os.close(target)
        raise HostError(f"cannot enter the network namespace of pid {pid}: {e.strerror}") from e
    finally:
        os.close(own)
    return sock, target


def write_sysctl(name: str, value: str) -> None:
    """Write ``/proc/sys/<name>`` (e.g. ``net/ipv4/conf/cv1/forwarding``)."""
    Path("/proc/sys", name).write_text(value)


def read_sysctl(name: str) -> str:
    return Path("/proc/sys", name).read_text().strip()


class Links:
    """rtnetlink in the node's (host) network namespace; one socket for the node's life."""

    def __init__(self, ipr: AsyncIPRoute) -> None:
        self._ipr = ipr
        # A plain rtnetlink socket for the attach path (no pyroute2 per message).
        self._rt = _Rtnl(
            socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, 0)
        )

    @classmethod
    async def open(cls) -> Links:
        ipr = AsyncIPRoute()
        await ipr.setup_endpoint()
        return cls(ipr)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ipr.close()
        self._rt.sock.close()

    async def index(self, name: str) -> int | None:
        try:
            found = await self._ipr.link_lookup(ifname=name)
        except NetlinkError:
            return None
        return found[0] if found else None

    async def names(self, prefix: str) -> list[str]:
        """Names of host links starting with ``prefix``."""
        out = []
        async for link in await self._ipr.link("dump"):
            name = link.get("ifname") or ""
            if name.startswith(prefix):
                out.append(name)
        return out

    async def ensure_gateway(self, name: str, address: str) -> None:
        """A port-less bridge holding ``address``/32, up: the gateway every sandbox routes
        to. (A dummy device would do, but not every kernel has one; bridges are common.
        Sandbox veths are not enslaved to it: traffic is routed.)"""
        try:
            if await self.index(name) is None:
                await self._ipr.link("add", ifname=name, kind="bridge")
            idx = await self.index(name)
            assert idx is not None
            with contextlib.suppress(NetlinkError):  # EEXIST: kept from a previous run
                await self._ipr.addr("add", index=idx, address=address, prefixlen=32)
            await self._ipr.link("set", index=idx, state="up")
        except NetlinkError as e:
            raise HostError(f"cannot set up the node's network device {name}: {e}") from e

    async def delete(self, name: str) -> bool:
        """Remove a link (its peer and routes go with it). False if it did not exist."""
        idx = await self.index(name)
        if idx is None:
            return False
        try:
            await self._ipr.link("del", index=idx)
        except NetlinkError as e:
            if e.code == 19:  # ENODEV: gone meanwhile (its namespace died)
                return False
            raise HostError(f"cannot remove network link {name}: {e}") from e
        return True

    async def attach_veth(
        self,
        host_name: str,
        pid: int,
        address: str,
        gateway: str,
        ready: Awaitable[None] | None = None,
    ) -> None:
        """Wire the network namespace of ``pid``: a veth pair, ``eth0`` inside with
        ``address``/32 and a default route via ``gateway``; ``host_name`` outside,
        forwarding, with a /32 route to ``address``. Undone on failure.

        ``ready`` (e.g. the nft transaction that admits this veth, running meanwhile in
        another thread) is awaited before the host end goes up: until then the pair is
        down and passes nothing. Raw rtnetlink, four round trips in all: create the pair
        (the kernel echoes the host index), find ``eth0`` inside, then one batch inside
        (address, up, default route) and one outside (up, route).
        """
        sock, nsfd = netlink_socket_in(pid)
        idx = 0
        try:
            rt = self._rt
            idx = rt.create_veth(host_name, "eth0", nsfd)
            # Only for packets arriving from this sandbox: the host's global setting stays.
            write_sysctl(f"net/ipv4/conf/{host_name}/forwarding", "1")
            with contextlib.suppress(OSError):
                write_sysctl(f"net/ipv6/conf/{host_name}/disable_ipv6", "1")
            guest = _Rtnl(sock)
            gidx = guest.index("eth0")
            if gidx is None:
                raise HostError("the sandbox's eth0 did not appear in its namespace")
            gw = socket.inet_aton(gateway)
            guest.batch(
                [
                    _newaddr(gidx, socket.inet_aton(address)),
                    _setlink_up(gidx),
                    _newroute(b"", 0, gidx, gateway=gw, onlink=True),
                ]
            )
            if ready is not None:
                await ready
            rt.batch(
                [
                    _setlink_up(idx),
                    _newroute(socket.inet_aton(address), 32, idx, prefsrc=gw),
                ]
            )
        except OSError as e:
            if idx:
                with contextlib.suppress(OSError):
                    self._rt.delete(idx)
            raise HostError(f"cannot attach network to pid {pid} ({host_name}): {e}") from e
        except BaseException:
            if idx:
                with contextlib.suppress(OSError):
                    self._rt.delete(idx)
            raise
        finally:
            os.close(nsfd)
            sock.close()


# ---------------------------------------------------------------- raw rtnetlink
# The attach path speaks rtnetlink directly: pyroute2 costs ~0.3 ms of Python per
# message, more than the kernel's work; these few fixed messages are cheap to pack.
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_ECHO = 0x1, 0x4, 0x8
_NLM_F_EXCL, _NLM_F_CREATE = 0x200, 0x400
_NLMSG_ERROR = 2
_RTM_NEWLINK, _RTM_DELLINK, _RTM_GETLINK, _RTM_NEWADDR, _RTM_NEWROUTE = 16, 17, 18, 20, 24
_IFLA_IFNAME, _IFLA_LINKINFO, _IFLA_NET_NS_FD = 3, 18, 28
_IFLA_INFO_KIND, _IFLA_INFO_DATA, _VETH_INFO_PEER = 1, 2, 1
_IFA_LOCAL, _IFA_ADDRESS = 2, 1
_RTA_DST, _RTA_OIF, _RTA_GATEWAY, _RTA_PREFSRC = 1, 4, 5, 7
_IFF_UP = 0x1
_RT_TABLE_MAIN, _RTPROT_BOOT, _RT_SCOPE_UNIVERSE, _RTN_UNICAST = 254, 3, 0, 1
_SOL_NETLINK, _NETLINK_CAP_ACK, _NETLINK_EXT_ACK = 270, 10, 11
_NLMSGERR_ATTR_MSG = 1


def _attr(kind: int, data: bytes) -> bytes:
    n = 4 + len(data)
    return struct.pack("HH", n, kind) + data + b"\0" * (-n % 4)


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return struct.pack("BxHiII", socket.AF_UNSPEC, 0, index, flags, change)


def _setlink_up(index: int) -> tuple[int, int, bytes]:
    return _RTM_NEWLINK, 0, _ifinfo(index, _IFF_UP, _IFF_UP)


def _newaddr(index: int, addr: bytes) -> tuple[int, int, bytes]:
    body = struct.pack("BBBBI", socket.AF_INET, 32, 0, _RT_SCOPE_UNIVERSE, index)
    body += _attr(_IFA_LOCAL, addr) + _attr(_IFA_ADDRESS, addr)
    return _RTM_NEWADDR, _NLM_F_CREATE | _NLM_F_EXCL, body


def _newroute(
    dst: bytes,
    plen: int,
    oif: int,
    gateway: bytes | None = None,
    prefsrc: bytes | None = None,
    onlink: bool = False,
) -> tuple[int, int, bytes]:
    scope = _RT_SCOPE_UNIVERSE if gateway else _RT_SCOPE_LINK
    body = struct.pack(
        "BBBBBBBBI",
        socket.AF_INET, plen, 0, 0, _RT_TABLE_MAIN, _RTPROT_BOOT, scope, _RTN_UNICAST,
        _RTNH_F_ONLINK if onlink else 0,
    )  # fmt: skip
    if dst:
        body += _attr(_RTA_DST, dst)
    body += _attr(_RTA_OIF, struct.pack("I", oif))
    if gateway:
        body += _attr(_RTA_GATEWAY, gateway)
    if prefsrc:
        body += _attr(_RTA_PREFSRC, prefsrc)
    return _RTM_NEWROUTE, _NLM_F_CREATE | _NLM_F_EXCL, body


class _Rtnl:
    """Requests on one rtnetlink socket, acknowledged; a batch is one ``send``."""

    _seq = 0

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        with contextlib.suppress(OSError):
            sock.setsockopt(_SOL_NETLINK, _NETLINK_CAP_ACK, 1)  # acks without the request
            sock.setsockopt(_SOL_NETLINK, _NETLINK_EXT_ACK, 1)  # with the kernel's reason

    def batch(
        self, msgs: list[tuple[int, int, bytes]], echo: bool = False
    ) -> list[tuple[int, bytes]]:
        """Send all of ``msgs`` at once, wait for each one's ack; the first refusal is
        raised (OSError) after every ack is read. Returns echoed (type, payload)s."""
        buf, seqs = b"", {}
        for i, (kind, flags, body) in enumerate(msgs):
            _Rtnl._seq = (_Rtnl._seq + 1) & 0x7FFFFFFF or 1
            seqs[_Rtnl._seq] = i
            flags |= _NLM_F_REQUEST | _NLM_F_ACK | (_NLM_F_ECHO if echo else 0)
            buf += struct.pack("IHHII", 16 + len(body), kind, flags, _Rtnl._seq, 0) + body
        self.sock.send(buf)
        echoed: list[tuple[int, bytes]] = []
        error: OSError | None = None
        while seqs:
            data = self.sock.recv(65536)
            off = 0
            while off + 16 <= len(data):
                n, kind, _flags, seq, _pid = struct.unpack_from("IHHII", data, off)
                if n < 16:
                    break
                payload = data[off + 16 : off + n]
                off += (n + 3) & ~3
                if seq not in seqs:
                    continue  # not an answer to this batch
                if kind != _NLMSG_ERROR:
                    echoed.append((kind, payload))
                    continue
                del seqs[seq]
                code = -struct.unpack_from("i", payload)[0]
                if code and error is None:
                    error = OSError(code, _ext_msg(payload) or os.strerror(code))
        if error is not None:
            raise error
        return echoed

    def create_veth(self, name: str, peer: str, netns_fd: int) -> int:
        """A veth pair, both ends down, ``peer`` born in the namespace of ``netns_fd``;
        returns the host end's index (the kernel echoes the new link)."""
        peer_msg = (
            _ifinfo()
            + _attr(_IFLA_IFNAME, peer.encode() + b"\0")
            + _attr(_IFLA_NET_NS_FD, struct.pack("I", netns_fd))
        )
        info = _attr(_IFLA_INFO_KIND, b"veth\0") + _attr(
            _IFLA_INFO_DATA, _attr(_VETH_INFO_PEER, peer_msg)
        )
        body = _ifinfo() + _attr(_IFLA_IFNAME, name.encode() + b"\0")
        body += _attr(_IFLA_LINKINFO, info)
        msg = (_RTM_NEWLINK, _NLM_F_CREATE | _NLM_F_EXCL, body)
        for kind, payload in self.batch([msg], echo=True):
            if kind == _RTM_NEWLINK and _ifname(payload) == name:
                return int(struct.unpack_from("BxHiII", payload)[2])
        idx = self.index(name)  # a kernel that does not echo new links
        if idx is None:
            raise OSError(errno.ENODEV, f"veth {name} vanished right after creation")
        return idx

    def index(self, name: str) -> int | None:
        """Index of the link called ``name`` (None: no such link)."""
        body = _ifinfo() + _attr(_IFLA_IFNAME, name.encode() + b"\0")
        try:
            found = self.batch([(_RTM_GETLINK, 0, body)])
        except OSError as e:
            if e.errno == errno.ENODEV:
                return None
            raise
        for kind, payload in found:
            if kind == _RTM_NEWLINK:
                return int(struct.unpack_from("BxHiII", payload)[2])
        return None

    def delete(self, index: int) -> None:
        self.batch([(_RTM_DELLINK, 0, _ifinfo(index))])


def _attrs(data: bytes, off: int) -> Iterator[tuple[int, bytes]]:
    while off + 4 <= len(data):
        n, kind = struct.unpack_from("HH", data, off)
        if n < 4:
            return
        yield kind & 0x3FFF, data[off + 4 : off + n]
        off += (n + 3) & ~3


def _ifname(payload: bytes) -> str | None:
    for kind, value in _attrs(payload, 16):
        if kind == _IFLA_IFNAME:
            return value.rstrip(b"\0").decode(errors="replace")
    return None


def _ext_msg(payload: bytes) -> str:
    """The kernel's extended-ack text of an error message (after the capped header)."""
    for kind, value in _attrs(payload, 20):
        if kind == _NLMSGERR_ATTR_MSG:
            return value.rstrip(b"\0").decode(errors="replace")
    return ""


def tcp_socket_in(pid: int) -> socket.socket:
    """An unconnected TCP/IPv4 socket in the network namespace of ``pid`` (the node's way
    into a sandbox's loopback: ports, see :meth:`corral.node.Node.port_connect`).

    Same dance as :func:`netlink_socket_in`: only the calling thread switches, for one
    ``socket()`` call, and always switches back (abort otherwise). The socket keeps that
    namespace for its life: ``connect(("127.0.0.1", port))`` reaches the sandbox's own
    loopback and nothing of the host's.
    """
    try:
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise HostError(f"cannot open the network namespace of pid {pid}: {e.strerror}") from e
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        # Safe: this thread only; it returns to its own namespace before anything else runs
        _setns(target)
        try:
            sock = socket.socket(
                socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC, socket.IPPROTO_TCP
            )
            # a relayed request's parts go out at once, not after the guest's delayed ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        finally:
            try:
                _setns(own)
            except OSError:
                os.abort()
    except OSError as e:
        raise HostError(f"cannot enter the network namespace of pid {pid}: {e.strerror}") from e
    finally:
        os.close(own)
        os.close(target)
    return sock
