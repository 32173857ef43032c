"""IPv4 forwarding on the host's uplinks, which replies to sandboxes come back through.

Per interface (the host's global setting is left alone); the old values are recorded in
the node's state dir and restored on teardown, also by a node after a crash.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from corral.host import netlink

__all__ = ["enable", "restore", "default_route_devices"]

log = logging.getLogger("corral.network")


def default_route_devices() -> list[str]:
    out: list[str] = []
    try:
        with open("/proc/net/route") as f:
            for line in list(f)[1:]:
                p = line.split()
                if len(p) > 2 and p[1] == "00000000" and p[0] not in out:
                    out.append(p[0])
    except OSError:
        pass
    return out


def enable(configured: list[str] | None, record: Path) -> None:
    """Forwarding on ``configured`` uplinks (None: the default-route devices); the old
    values are kept in ``record`` for :func:`restore`."""
    saved: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads(record.read_text())
    devices = list(configured) if configured is not None else default_route_devices()
    for dev in devices:
        key = f"net/ipv4/conf/{dev}/forwarding"
        try:
            old = netlink.read_sysctl(key)
            if old != "1":
                saved.setdefault(dev, old)
                netlink.write_sysctl(key, "1")
        except OSError as e:
            log.warning("cannot enable forwarding on %s: %s", dev, e)
    if saved:
        record.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        record.write_text(json.dumps(saved))


def restore(record: Path) -> None:
    try:
        saved = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    for dev, old in saved.items():
        with contextlib.suppress(OSError):
            netlink.write_sysctl(f"net/ipv4/conf/{dev}/forwarding", str(old))
    record.unlink(missing_ok=True)
