"""Links, addresses and routes over rtnetlink (pyroute2), without a process per operation.

A sandbox's network namespace is created by the OCI runtime (owned by the sandbox's user
namespace, so the guest's sysfs is its own). To wire it, the node creates a veth pair whose
peer is born inside that namespace (``IFLA_NET_NS_FD``), and configures the peer through
a netlink socket opened *in* the namespace: the calling thread ``setns``-es into it just
long enough to create the socket (sockets keep the namespace they were created in), then
returns. pyroute2's own netns support forks a child per socket; this does not.

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
import os
import socket
from pathlib import Path

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from corral.errors import HostError

__all__ = ["Links", "netlink_socket_in", "write_sysctl"]

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

    @classmethod
    async def open(cls) -> Links:
        ipr = AsyncIPRoute()
        await ipr.setup_endpoint()
        return cls(ipr)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ipr.close()

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

    async def attach_veth(self, host_name: str, pid: int, address: str, gateway: str) -> None:
        """Wire the network namespace of ``pid``: a veth pair, ``eth0`` inside with
        ``address``/32 and a default route via ``gateway``; ``host_name`` outside, up,
        forwarding, with a /32 route to ``address``. Undone on failure."""
        sock, nsfd = netlink_socket_in(pid)
        created = False
        try:
            # Host end up from the start (one rtnl round trip less; nothing can pass before
            # the guest end has an address).
            await self._ipr.link(
                "add",
                ifname=host_name,
                kind="veth",
                state="up",
                peer={"ifname": "eth0", "net_ns_fd": nsfd},
            )
            created = True
            idx = await self.index(host_name)
            if idx is None:
                raise HostError(f"veth {host_name} vanished right after creation")
            # Only for packets arriving from this sandbox: the host's global setting stays.
            write_sysctl(f"net/ipv4/conf/{host_name}/forwarding", "1")
            with contextlib.suppress(OSError):
                write_sysctl(f"net/ipv6/conf/{host_name}/disable_ipv6", "1")
            await self._ipr.route(
                "add",
                dst=f"{address}/32",
                oif=idx,
                scope=_RT_SCOPE_LINK,
                prefsrc=gateway,
            )
            guest = AsyncIPRoute(fileno=sock.detach())
            try:
                await guest.setup_endpoint()
                found = await guest.link_lookup(ifname="eth0")
                if not found:
                    raise HostError("the sandbox's eth0 did not appear in its namespace")
                gidx = found[0]
                await guest.addr("add", index=gidx, address=address, prefixlen=32)
                await guest.link("set", index=gidx, state="up")
                await guest.route(
                    "add", dst="0.0.0.0/0", gateway=gateway, oif=gidx, flags=_RTNH_F_ONLINK
                )
            finally:
                guest.close()
        except (NetlinkError, OSError) as e:
            if created:
                with contextlib.suppress(Exception):
                    await self.delete(host_name)
            raise HostError(f"cannot attach network to pid {pid} ({host_name}): {e}") from e
        except BaseException:
            if created:
                with contextlib.suppress(Exception):
                    await self.delete(host_name)
            raise
        finally:
            os.close(nsfd)
            sock.close()
