"""nftables through libnftables, in process (ctypes): no ``nft`` process per change.

One :class:`Nft` context runs whole batches of nft commands (``nft -f`` syntax) atomically:
the kernel applies all of a buffer's commands in one netlink transaction or none. Output
can be JSON for reading sets back.

Example::

    nft = Nft()
    nft.run("add table inet corral-x")
    nft.json("list table inet corral-x")["nftables"][1]["table"]["name"]   # 'corral-x'
    nft.run("delete table inet corral-x")
    nft.close()
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from typing import Any

from corral.errors import HostError

__all__ = ["Nft", "NftError"]

_OUTPUT_JSON = 1 << 4  # NFT_CTX_OUTPUT_JSON, nftables/libnftables.h
FD_SETSIZE = 1024
"""libnftables (1.0.6) waits for the kernel's answer with select() on the netlink socket
it opens in nft_ctx_new and keeps; with that socket at fd >= FD_SETSIZE, glibc's
FD_SET check aborts the whole process. A node past ~500 sandboxes holds more fds than
that, so its context is made at start (node/network.py) and a late one is refused."""


class NftError(HostError):
    """The kernel (or libnftables' parser) refused an nft batch."""


class Nft:
    """A libnftables context. Thread-safe (one call at a time); cheap to keep for a node's
    lifetime: a batch costs one netlink transaction, ~0.1-1 ms here.

    HostError (never an abort) if the context's socket would sit at or above
    :data:`FD_SETSIZE`: make it while the process holds fewer fds."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libnftables.so.1", use_errno=True)
        except OSError as e:
            raise HostError(
                f"libnftables is not installed ({e}); install the Debian package nftables"
            ) from e
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        before = set(os.listdir("/proc/self/fd"))
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise HostError("libnftables: nft_ctx_new failed")
        high = [int(f) for f in set(os.listdir("/proc/self/fd")) - before if int(f) >= FD_SETSIZE]
        if high:
            lib.nft_ctx_free(ctx)
            raise HostError(
                f"libnftables: its netlink socket would be fd {max(high)}, but libnftables "
                f"select()s on it and aborts the process past fd {FD_SETSIZE - 1}; this "
                "process holds too many fds to open an nft context now (the node opens its "
                "context at start)"
            )
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        self._lib = lib
        self._ctx: int | None = ctx
        self._lock = threading.Lock()

    def run(self, commands: str) -> str:
        """Run a batch (nft -f syntax, one command per line); return its text output."""
        return self._run(commands, 0)

    def json(self, commands: str) -> dict[str, Any]:
        """Run a listing command and return its JSON output, parsed."""
        out = self._run(commands, _OUTPUT_JSON)
        return json.loads(out) if out.strip() else {"nftables": []}

    def _run(self, commands: str, flags: int) -> str:
        with self._lock:
            if self._ctx is None:
                raise HostError("libnftables context is closed")
            self._lib.nft_ctx_output_set_flags(self._ctx, flags)
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, commands.encode())
            out = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode()
            err = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode()
        if rc != 0:
            first = commands.strip().splitlines()[:3]
            raise NftError(f"nft refused {' / '.join(first)[:300]!r}: {err.strip()[:1500]}")
        return out

    def close(self) -> None:
        with self._lock:
            if self._ctx is not None:
                self._lib.nft_ctx_free(self._ctx)
                self._ctx = None
