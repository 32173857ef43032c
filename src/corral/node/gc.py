"""Collecting what a crash left behind (``corral node gc``).

Each backend removes what it made for sandboxes that are not live (runtime containers,
mounts, cgroups, writable layers); the node removes scratch work copies no snapshot or
fork is using, stale network objects and a stale seccomp fd holder. With nothing live (or
``everything``, which first destroys every sandbox) the node-wide pieces are torn down and
set up again, so the node is as fresh as after a clean start.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corral.node.node import Node

__all__ = ["collect"]


async def collect(node: Node, everything: bool) -> dict[str, int]:
    removed = {"sandboxes": 0, "containers": 0, "mounts": 0, "cgroups": 0, "subvols": 0}
    table = node.table
    if everything:
        for sid in table.ids():
            await table.created(sid)
            info = table.get(sid)
            if info is not None and info.state != "destroying":
                await node.life.destroy(info, "destroyed")
                removed["sandboxes"] += 1
    live = set(table.ids()) | node.snapshots.in_use
    for backend in node.backends.all():
        for kind, n in (await backend.gc(live)).items():
            removed[kind] = removed.get(kind, 0) + n
    for name in node.scratch.subvols():
        if name not in live and not name.startswith("sb-"):
            node.scratch.delete_subvol(name)  # a snapshot's or fork's work copy
            removed["subvols"] += 1
    removed["networks"] = await node.network.gc(set(table.ids()))
    # A stale seccomp fd holder is ended and replaced (its ping may wait up to 2 s).
    await asyncio.to_thread(node.security.gc, set(table.ids()))
    if everything or not live:
        for backend in node.backends.all():
            await backend.stop(keep_running=False)
        await node.teardown_node_wide()
        # The scratch fs, swap and backends come back at once: the node keeps serving.
        await asyncio.to_thread(node.scratch.setup)
        await asyncio.to_thread(node.swap.setup)
        for backend in node.backends.all():
            await backend.start()
    node.state.add_event(None, "gc", dict(removed))
    return removed
