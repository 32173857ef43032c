"""Serve the API over a unix socket or TCP with uvicorn.

Who may connect (decided here, once):

- **unix socket** (the default way to reach a local node): the socket is mode 0600, so
  only the node's own user connects; a token is optional. The mode is set between
  ``bind()`` and ``listen()``: before ``listen()`` every ``connect()`` is refused, so no
  peer can slip in while the file still has the umask's permissions.
- **TCP always needs a token**, loopback included: 127.0.0.1 is reachable by every local
  user and every process in the host's network namespace, and this API runs anything in
  any sandbox. Put TLS in front of it (a reverse proxy) when it leaves the host.

Example:
    >>> from corral.testing import FakeNode
    >>> asyncio.run(serve(FakeNode(), uds=Path("/run/corral/api.sock")))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from corral.api.app import create_app
from corral.errors import Conflict, HostError, InvalidRequest
from corral.ops import NodeOps

__all__ = ["serve", "NodeServer"]

log = logging.getLogger("corral.api")

_BACKLOG = 2048
# Seconds that in-flight requests get to finish after a stop request before being cut.
_GRACE = 10
# Seconds an idle HTTP connection is kept: longer than the pools of the clients that keep
# connections longest (the e2b SDK: 300 s), so a client's pool drops an idle connection
# before the node does. With uvicorn's 5 s, a pooled connection the node had just closed
# was reused now and then, and the request failed with "connection reset by peer".
_KEEP_ALIVE = 310


_SNDBUF = 1 << 20
"""Send buffer asked for on each accepted connection (the kernel doubles it and clamps it
to ``net.core.wmem_max``): room for one slice of a big answer (``bigbody.RAW_SLICE``), and
no more. With 4 MiB (8 MiB granted), a client that had fallen behind let the transport
pile slices up and then ``send`` several MiB at once, one copy the loop waited for:
``corral bench neighbours --attack output_flood``, 5 interleaved pairs (s9), API p99 ratio
0.97-1.73 with 4 MiB against 1.13-1.31 with 1 MiB, the loop's CPU the same."""


class _Connection(h11.Connection):
    """h11's connection that hands a lone piece of output over as it is.

    ``h11.Connection.send`` joins the pieces an event makes: for a body piece of a response
    with a Content-Length that is one piece, and ``b"".join`` of one ``memoryview`` copies
    it. The binary exec answer (api/bigbody.py) is sent as views into the result's bytes,
    so without this every byte of it was copied once more on the loop's thread (a third of
    the loop's time in ``corral bench neighbours``' output flood, py-spy). The transport
    takes any bytes-like object."""

    def send(self, event: h11.Event) -> bytes | None:  # type: ignore[override]
        data = self.send_with_data_passthrough(event)
        if data is None:
            return None
        # a view goes to transport.write, which takes it as it takes bytes
        return data[0] if len(data) == 1 else b"".join(data)  # type: ignore[return-value]


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with a bigger send buffer on each connection.

    A big exec answer is written in 1 MiB slices (api/bigbody.py). With the default
    ~208 KiB send buffer, the transport's first ``send`` takes ~208 KiB of a slice and the
    rest is copied twice on the loop's thread (``data[n:]``, then into the transport's
    buffer) and sent in more steps; with room for the slice (:data:`_SNDBUF`), one
    ``send`` (the kernel's copy, the GIL let go) takes it all. The room is only used while a client is
    slower than the node, and what it holds would otherwise sit in the transport's buffer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn.__class__ = _Connection  # made by uvicorn's __init__; no request yet

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # Safe: a buffer size on our own socket
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
        super().connection_made(transport)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: corral decides what a signal means (and
    uvicorn would re-raise the signal after shutdown, killing an embedding process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _freeze_startup_heap() -> None:
    """Leave what the process built to serve (modules, classes, the app's routes and
    schemas, the node's tables: ~120,000 tracked objects) out of the cyclic GC's full
    collections. Each full collection walked all of it in one step of the event loop the
    API answers from: 50-135 ms of CPU (``corral bench neighbours``, the biggest step the
    loop took under the output flood, bigger than any of the flood's own), at a moment set
    by allocation counts, so any request could land on it. Frozen objects are still freed
    by reference counting; only a cycle among them would outlive its use. Idempotent: a
    second server in the process freezes what was built since."""
    gc.collect()
    gc.freeze()


class NodeServer:
    """The API of ``ops`` on one listening socket; ``serve`` is its blocking form.

    Example:
        >>> async with NodeServer(FakeNode(), uds=Path("/tmp/x/api.sock")) as srv:  # doctest: +SKIP
        ...     client = corral.AsyncClient(srv.address)
    """

    def __init__(
        self,
        ops: NodeOps,
        *,
        uds: Path | str | None = None,
        host: str | None = None,
        port: int | None = None,
        token: str | None = None,
        max_body: int = 1 << 30,
        e2b: bool = True,
    ) -> None:
        """``e2b``: also speak the E2B API (control plane, envd, port hosts) on this socket."""
        if (uds is None) == (host is None and port is None):
            raise InvalidRequest("serve on exactly one of uds= or host=/port=")
        self._uds = Path(uds) if uds is not None else None
        self._host = host or "127.0.0.1"
        self._port = 8700 if port is None else port
        if self._uds is None and not token:
            raise InvalidRequest(
                f"refusing to serve the API on TCP {self._host}:{self._port} without a token: "
                "anyone who reaches the port could run commands in every sandbox; pass a "
                "token, or serve on a unix socket (uds=) for tokenless local access"
            )
        self._config = uvicorn.Config(
            create_app(ops, token=token, max_body=max_body, e2b_enabled=e2b),
            lifespan="off",
            http=_Protocol,
            # leave logging to the embedding program; access logs would sit on the exec path
            log_config=None,
            access_log=False,
            server_header=False,
            # the terminal route is a websocket; "auto" picks the websockets library
            ws="auto",
            timeout_graceful_shutdown=_GRACE,
            timeout_keep_alive=_KEEP_ALIVE,
        )
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._uds_inode: int | None = None
        self.address = ""
        """``unix:///path`` or ``http://host:port`` once started (the real port if 0 was asked)."""

    async def start(self) -> None:
        sock = self._bind_uds(self._uds) if self._uds is not None else self._bind_tcp()
        self._server = _Server(self._config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._cleanup()
                await self._task
                raise HostError(f"the API server on {self.address} stopped while starting")
            await asyncio.sleep(0.005)
        _freeze_startup_heap()
        log.info("corral API listening on %s", self.address)

    def request_stop(self) -> None:
        """Begin a graceful stop; a second request cuts in-flight requests short."""
        if self._server is None:
            return
        if self._server.should_exit:
            self._server.force_exit = True
        self._server.should_exit = True

    async def wait(self) -> None:
        """Return when the server has stopped (after ``request_stop``)."""
        if self._task is not None:
            # shielded: cancelling the waiter must not cancel uvicorn half-way; stop() does
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        self.request_stop()
        try:
            if self._task is not None:
                await self._task
        finally:
            self._cleanup()

    async def __aenter__(self) -> NodeServer:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --------------------------------------------------------------- sockets
    def _bind_uds(self, path: Path) -> socket.socket:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.is_symlink() or path.exists():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise InvalidRequest(f"{path} exists and is not a socket; refusing to replace it")
            if _answers(path):
                raise Conflict(f"another server already listens on {path}")
            path.unlink()  # stale socket of a previous run that did not clean up
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o600)  # before listen(): see the module docstring
            sock.listen(_BACKLOG)
        except OSError as exc:
            sock.close()
            raise HostError(f"cannot listen on unix socket {path}: {exc}") from exc
        self._uds_inode = path.stat().st_ino
        self.address = f"unix://{path}"
        return sock

    def _bind_tcp(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when
        # the listening socket names its protocol. Without it a response written in two
        # parts (headers, then body) waited for the client's delayed ACK: ~40 ms per call.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(_BACKLOG)
        except OSError as exc:
            sock.close()
            raise HostError(f"cannot listen on {self._host}:{self._port}: {exc}") from exc
        port = sock.getsockname()[1]
        host = f"[{self._host}]" if family == socket.AF_INET6 else self._host
        self.address = f"http://{host}:{port}"
        return sock

    def _cleanup(self) -> None:
        # remove the socket file only if it is still ours (not replaced by a newer server)
        if self._uds is not None and self._uds_inode is not None:
            with contextlib.suppress(FileNotFoundError):
                if self._uds.stat().st_ino == self._uds_inode:
                    self._uds.unlink()
            self._uds_inode = None


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


async def serve(
    ops: NodeOps,
    *,
    uds: Path | None = None,
    host: str | None = None,
    port: int | None = None,
    token: str | None = None,
) -> None:
    """Serve the API of ``ops`` until SIGTERM or SIGINT, then stop gracefully: stop
    accepting, let in-flight requests finish (up to 10 s), return. A second signal cuts
    them short. ``ops`` stays open: the caller closes it.
    """
    server = NodeServer(ops, uds=uds, host=host, port=port, token=token)
    await server.start()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, server.request_stop)
            installed.append(sig)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # not the main thread: whoever runs us stops us by cancelling
    try:
        await server.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await server.stop()
