"""Host side of the virtio-serial multiplexer: one unix socket per sandbox for the node's
:class:`~corral.backends.initclient.InitClient`, many logical connections over QEMU's one.

QEMU's chardev socket (``vm.sock`` in the sandbox dir) takes one client at a time and is
one byte stream to the guest's ``corral.ctl`` port. The init protocol wants one connection
per request, so the node listens on ``ctl.sock`` (also in the sandbox dir, mode 0600) and
carries each accepted connection as a *channel* over ``vm.sock``; corral-init's mux thread
(``--vmux``) turns each channel back into a connection of its own. Framing, both ways:
``u32 channel (BE) · u8 kind · u32 length (BE) · payload``; kinds ``o`` open, ``d`` data,
``c`` close, ``r`` reset (sent first on every new connection to ``vm.sock``: the guest
drops channels of an earlier node process). Documented in docs/init-protocol.md.

While the VM is saved to a memory snapshot (its VMM gone), the node keeps listening on
``ctl.sock``: the first connection calls ``wake`` (the backend restores the VM and calls
:meth:`HostMux.attach`), so any request resumes the sandbox transparently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

from corral.errors import SandboxError

__all__ = ["HostMux"]

log = logging.getLogger("corral.backends.microvm")

_HDR = struct.Struct(">IcI")
_CHUNK = 64 << 10  # largest payload the node sends (the guest's buffer holds 128 KiB)
_MAX_IN = 1 << 20  # largest payload accepted from the guest (corral-init sends <= 64 KiB)
_HIGH = 4 << 20  # bytes queued for one client before the pump waits for it


class HostMux:
    """The node's end of one VM's control channel (see the module docstring)."""

    def __init__(
        self, vm_sock: Path, ctl_sock: Path, wake: Callable[[], Awaitable[object]] | None = None
    ) -> None:
        self.vm_sock = vm_sock
        self._wake = wake
        self._wake_lock = asyncio.Lock()
        self._open = asyncio.Event()  # cleared while the VM is being saved
        self._open.set()
        self.ctl_sock = ctl_sock
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None
        self._server: asyncio.base_events.Server | None = None
        self._chans: dict[int, asyncio.StreamWriter] = {}
        self._next = 1
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self, attach: bool = True) -> None:
        """Listen on ``ctl.sock`` and (``attach``) connect to QEMU's socket (it exists once
        ``qemu -daemonize`` has returned). SandboxError if QEMU's socket refuses."""
        if attach:
            await self.attach()
        with contextlib.suppress(FileNotFoundError):
            self.ctl_sock.unlink()  # an earlier node process's
        self._server = await asyncio.start_unix_server(self._serve, str(self.ctl_sock))
        os.chmod(self.ctl_sock, 0o600)

    async def attach(self) -> None:
        """Connect to (a new) QEMU's socket; the guest drops older channels on the reset."""
        try:
            self._r, self._w = await asyncio.open_unix_connection(str(self.vm_sock))
        except OSError as e:
            raise SandboxError(f"microvm control socket {self.vm_sock}: {e.strerror}") from None
        self._w.write(_HDR.pack(0, b"r", 0))
        self._reader = asyncio.ensure_future(self._pump_guest())

    def hold(self) -> None:
        """New connections wait (until :meth:`release`): the VM is being saved."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def detach(self) -> None:
        """Drop every channel and QEMU's connection, but keep listening (the VMM is about
        to exit for a memory snapshot; a new connection wakes it)."""
        for w in self._chans.values():
            w.close()
        self._chans.clear()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
            self._reader = None
        if self._w is not None:
            self._w.close()
            self._w = None

    @property
    def connected(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def close(self) -> None:
        """Stop listening, drop every channel, disconnect from QEMU, remove ctl.sock."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        for w in self._chans.values():
            w.close()
        self._chans.clear()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        if self._w is not None:
            self._w.close()
        with contextlib.suppress(FileNotFoundError):
            self.ctl_sock.unlink()

    async def _pump_guest(self) -> None:
        """Frames from the guest to the channels' connections."""
        assert self._r is not None
        try:
            while True:
                hdr = await self._r.readexactly(_HDR.size)
                chan, kind, n = _HDR.unpack(hdr)
                if n > _MAX_IN:
                    # The guest is root in its VM and can write the port itself: a forged
                    # length must not make the node buffer gigabytes. The channel is lost.
                    log.warning(
                        "microvm %s: frame of %d bytes from the guest; disconnected",
                        self.vm_sock.parent.name,
                        n,
                    )
                    return
                data = await self._r.readexactly(n) if n else b""
                w = self._chans.get(chan)
                if w is None:
                    continue  # a channel that closed meanwhile
                if kind == b"d":
                    w.write(data)
                    if w.transport.get_write_buffer_size() > _HIGH:
                        # a slow client: wait (all channels do) rather than buffer without end
                        with contextlib.suppress(OSError, ConnectionError):
                            await w.drain()
                elif kind == b"c":
                    del self._chans[chan]
                    w.close()  # after what is buffered: the answer reaches the client
        except (asyncio.IncompleteReadError, OSError):
            pass  # QEMU went away: the VM is gone
        finally:
            for w in self._chans.values():
                w.close()
            self._chans.clear()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        """One client connection = one channel until either side closes."""
        await self._open.wait()
        if not self.connected and self._wake is not None and not self._closed:
            try:
                async with self._wake_lock:
                    if not self.connected:
                        await self._wake()
            except Exception as e:
                log.warning(
                    "microvm %s: wake failed: %s", self.vm_sock.parent.name, e, exc_info=True
                )
        qw = self._w
        if qw is None or not self.connected:
            w.close()
            return
        chan = self._next
        self._next = self._next % 0xFFFFFFFF + 1
        self._chans[chan] = w
        try:
            qw.write(_HDR.pack(chan, b"o", 0))
            while chan in self._chans:
                data = await r.read(_CHUNK)
                if not data:
                    break
                qw.write(_HDR.pack(chan, b"d", len(data)) + data)
                await qw.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            if self._chans.pop(chan, None) is not None:
                w.close()
                with contextlib.suppress(OSError, RuntimeError):
                    qw.write(_HDR.pack(chan, b"c", 0))
