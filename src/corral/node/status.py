"""The node's status: what it runs, what it has left (for a placer), what the kernel offers."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Literal, cast

import psutil

from corral import __version__
from corral.host import criu, landlock, sched
from corral.node import limits
from corral.spec import NodeStatus

if TYPE_CHECKING:
    from corral.node.node import Node

__all__ = ["node_status"]


async def node_status(node: Node) -> NodeStatus:
    vm = psutil.virtual_memory()
    core_ok, core_detail = sched.core_scheduling()
    ckpt_ok, ckpt_detail = await asyncio.to_thread(criu.checkpoint_support)  # cached
    ll_abi, ll_detail = landlock.support()
    scratch_total = scratch_free = 0
    try:
        st = os.statvfs(node.scratch.mountpoint)
        scratch_total, scratch_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    except OSError:
        pass
    backends = [b.status() for b in node.backends.all()]
    mounted = sum(int(b.detail.get("layer_mounts", "0")) for b in backends)
    table = node.table
    cap = limits.capacity(vm.available, len(table))
    return NodeStatus(
        node_id=node.node_id,
        version=__version__,
        cgroup_mode=cast(Literal["v1", "v2", "hybrid"], node.cgroups.mode),
        sandboxes=len(table),
        running=table.count("running"),
        paused=table.count("paused"),
        state_dir=str(node.config.state_dir),
        store=str(node.config.store_dir),
        mounted_layers=mounted,
        mem_total=vm.total,
        mem_available=vm.available,
        swap=node.swap.paths(),
        core_scheduling=core_ok,
        qos_detail=core_detail,
        checkpoint=ckpt_ok,
        checkpoint_detail=ckpt_detail,
        landlock=ll_abi,
        landlock_detail=ll_detail,
        max_sandboxes=node.config.max_sandboxes,
        idle_capacity=cap.sandboxes,
        idle_capacity_bound=cap.bound_by,
        cpus=os.cpu_count() or 1,
        load1=os.getloadavg()[0],
        scratch_total=scratch_total,
        scratch_free=scratch_free,
        labels=dict(node.config.labels),
        default_backend=node.config.default_backend,
        backends=backends,
    )
