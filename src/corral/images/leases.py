"""Leases: marker files on the store saying "this node has this layer mounted".

Several nodes share one store, and none of them knows what the others have mounted; a
``corral image gc`` run anywhere must still never remove a layer a sandbox reads. So
each node's layer mounts write a marker on the store itself::

    ROOT/leases/<hex>/<holder>     layer sha256:<hex> is mounted by node <holder>

taken before the layer's first mount on that node and dropped after its last unmount
(images/mounts.py). gc keeps every layer with at least one marker. A marker is one small
file per (layer, node), written and removed with plain create/unlink, which every shared
filesystem (NFS, CephFS, 3FS, JuiceFS, MooseFS) makes visible to the others.

A node that dies keeps its markers (its layers may still be mounted by sandboxes that
outlived the agent); the next agent on that state dir adopts its mounts and rewrites its
markers (``LayerMounts.adopt``). A node that never comes back leaves them for the
operator: ``corral image gc --forget-holder HOLDER`` drops them.

Marker I/O has the store's deadline (images/_bounded.py). Taking a lease while the store
is unreachable raises StoreUnavailable (the mount would fail anyway); dropping one then
is skipped, so destroying a sandbox never waits on the store: the marker stays, keeping
the layer from gc, until the node's next start (``adopt``) drops what it no longer holds.

Example::

    leases = Leases(store_root, holder="node-1a2b3c4d5e6f")
    leases.take("sha256:ab12...")       # before mounting
    leases.drop("sha256:ab12...")       # after the last unmount
    Leases.holders_of(store_root, "sha256:ab12...")   # ["node-1a2b3c4d5e6f"]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from pathlib import Path

from corral.errors import InvalidRequest, StoreUnavailable
from corral.images._bounded import Bounded

__all__ = ["Leases", "check_holder"]

_HOLDER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_holder(holder: str) -> str:
    """Return ``holder`` if it is usable as a file name on every filesystem."""
    if not isinstance(holder, str) or not _HOLDER_RE.match(holder):
        raise InvalidRequest(
            f"lease holder {holder!r} is invalid: use 1-128 of letters, digits and . _ -, "
            "starting with a letter or digit"
        )
    return holder


def _hex(digest: str) -> str:
    hexpart = digest.split(":", 1)[-1]
    if not re.fullmatch(r"[0-9a-f]{64}", hexpart):
        raise InvalidRequest(f"bad layer digest {digest!r} (want sha256:<64 hex digits>)")
    return hexpart


class Leases:
    """The markers one holder (a node) keeps on the store at ``root``."""

    def __init__(self, root: Path, holder: str, *, timeout: float | None = 10.0) -> None:
        self.dir = Path(root) / "leases"
        self.holder = check_holder(holder)
        self._io = Bounded(str(root), timeout)

    def __repr__(self) -> str:
        return f"Leases({str(self.dir)!r}, {self.holder!r})"

    def take(self, digest: str) -> None:
        """Mark ``digest`` as mounted by this holder (idempotent)."""
        d = self.dir / _hex(digest)
        body = {"holder": self.holder, "host": socket.gethostname(), "pid": os.getpid()}
        body["since"] = time.time()  # type: ignore[assignment]

        def write() -> None:
            d.mkdir(parents=True, exist_ok=True)
            # Written in place, not renamed: gc only asks whether the name exists.
            with open(d / self.holder, "w") as f:
                f.write(json.dumps(body))

        self._io.call(f"taking a lease on layer {digest}", write)

    def drop(self, digest: str) -> None:
        """Remove this holder's marker of ``digest`` (idempotent; skipped while the
        store does not answer)."""
        d = self.dir / _hex(digest)

        def remove() -> None:
            (d / self.holder).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                d.rmdir()  # fails while another holder's marker is there: fine

        with contextlib.suppress(StoreUnavailable):
            self._io.call(f"dropping the lease on layer {digest}", remove)

    def held(self) -> list[str]:
        """Digests this holder has markers for."""

        def scan() -> list[str]:
            if not self.dir.is_dir():
                return []
            return sorted(
                f"sha256:{d.name}" for d in self.dir.iterdir() if (d / self.holder).exists()
            )

        return self._io.call("listing leases", scan)

    @staticmethod
    def holders_of(root: Path, digest: str) -> list[str]:
        """Every holder with a marker of ``digest`` on the store at ``root``."""
        d = Path(root) / "leases" / _hex(digest)
        try:
            return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))
        except FileNotFoundError:
            return []

    @staticmethod
    def forget(root: Path, holder: str) -> list[str]:
        """Remove every marker of ``holder`` (a node that is gone for good); returns the
        digests it held."""
        leases = Leases(root, holder)
        held = leases.held()
        for digest in held:
            leases.drop(digest)
        return held
