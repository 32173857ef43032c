"""The node-wide pieces a node is assembled from, opened in order.

State database, layer store, cgroup subtree, scratch filesystem, swap, the security log
(with its seccomp listener), the network, and the backends (built from the config and
started). Each piece's close is registered as it opens, so an open that fails part-way
closes exactly what it opened.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from corral.backends.base import Backend, FixedMeters, HostContext, Meters
from corral.host.btrfs import Scratch
from corral.host.cgroups import Cgroups
from corral.images.store import LayerStore
from corral.node.config import NodeConfig
from corral.node.network import NodeNetwork
from corral.node.pause import NodeSwap
from corral.node.registry import Backends, make_backend
from corral.node.security import NodeSecurity
from corral.node.state import CHECKPOINT_INTERVAL, StateStore
from corral.node.table import SandboxTable

__all__ = ["NodeHost", "open_host", "Parts"]

Parts = tuple[Callable[[HostContext], list[Backend]], tuple[Cgroups, Scratch]]
"""Engines and node-wide kernel pieces given by a test (corral.testing.open_fake_node)."""


@dataclass
class NodeHost:
    """The node-wide pieces every part shares (opened in this order, closed in reverse)."""

    lock_fd: int
    table: SandboxTable
    node_id: str
    state: StateStore
    store: LayerStore
    cgroups: Cgroups
    scratch: Scratch
    swap: NodeSwap
    security: NodeSecurity
    network: NodeNetwork
    backends: Backends


async def open_host(
    cfg: NodeConfig,
    lock_fd: int,
    closers: list[Callable[[], object]],
    parts: Parts | None,
) -> NodeHost:
    """Open the node-wide pieces and the backends, registering each one's close."""
    node_id_file = cfg.state_dir / "node_id"
    if not node_id_file.exists():
        node_id_file.write_text(uuid.uuid4().hex[:12])
    node_id = node_id_file.read_text().strip()
    state = StateStore(cfg.state_dir / "state.db", checkpoint_interval=CHECKPOINT_INTERVAL)
    closers.append(state.close)
    store = LayerStore(
        cfg.store_dir, compress=None if cfg.store_compress == "none" else cfg.store_compress
    )
    if parts is None:
        cgroups = Cgroups(cfg.cgroup_subtree)
        scratch = Scratch(
            cfg.state_dir / "scratch.img", cfg.state_dir / "scratch", cfg.scratch_size
        )
    else:
        cgroups, scratch = parts[1]
    await asyncio.to_thread(scratch.setup)
    closers.append(scratch.close)
    swap = NodeSwap(cfg.swap, cfg.state_dir)
    await asyncio.to_thread(swap.setup)
    table = SandboxTable(state, node_id)
    # The backends are made after the security log (they need its listener path): the
    # meters of a sandbox are looked up through this registry once they exist.
    registry: list[Backends] = []

    def meters(sandbox_id: str) -> Meters:
        info = table.get(sandbox_id)
        if not registry or info is None:
            return FixedMeters()
        backend = registry[0].get(info.backend)
        return FixedMeters() if backend is None else backend.meters(sandbox_id)

    security = NodeSecurity(
        state.add_event,
        meters,
        # crun and runc >= 1.1 hand the filter's notification fd to this socket.
        listener_path=cfg.run_dir / "seccomp.sock" if parts is None else None,
        helper_dir=cfg.state_dir / "bin",  # its fd holder (host/fdstore.py)
    )
    closers.append(security.close)
    network = NodeNetwork(cfg.network, cfg.cgroup_subtree, cfg.state_dir, state.add_event)
    ctx = HostContext(
        node_id=node_id,
        state_dir=cfg.state_dir,
        run_dir=cfg.run_dir,
        cgroups=cgroups,
        scratch=scratch,
        store=store,
        host_uid=cfg.host_uid,
        id_count=cfg.id_count,
        seccomp_notify=security.notify_path,
        extra_mounts=network.mounts(),
        eager_layers=cfg.eager_layers,
        layer_prefetch=cfg.layer_prefetch,
        layer_linger=cfg.layer_linger,
        layer_direct_io=cfg.layer_direct_io,
    )
    made = [make_backend(b, ctx, cfg) for b in cfg.backends] if parts is None else parts[0](ctx)
    for backend in made:
        await backend.start()
        closers.append(_stopper(backend))
    backends = Backends(made, cfg.default_backend)
    registry.append(backends)
    return NodeHost(
        lock_fd=lock_fd,
        table=table,
        node_id=node_id,
        state=state,
        store=store,
        cgroups=cgroups,
        scratch=scratch,
        swap=swap,
        security=security,
        network=network,
        backends=backends,
    )


def _stopper(backend: Backend) -> Callable[[], object]:
    """A closer that stops ``backend`` keeping its sandboxes (an open that failed)."""
    return lambda: backend.stop(keep_running=True)
