"""``corral bench microvm``: what a microVM sandbox costs next to a container, in one run.

Boots ``count`` microVMs one after another (create + first ``true``: boot to exec), times
execs in one of them, reads each VM's host memory from its cgroup while all are up, then
pauses one VM with ``memory_snapshot=True`` three times (the fraction of its cgroup's
memory released, and what stayed charged by kind in the worst round; what the backend
handed to the parent cgroup when it made the paused VM's cgroup anew, and the fraction
had it not; resume to first exec against a cold boot), then creates the same number of containers (boot to exec) for the
comparison. Keys per issue 12. Forks: up to 4 children
of one VM (``fork_per_s``: children per second of the whole fork call, restores included).
``dax``: host memory of ``count`` VMs reading the same files with the layers shared by DAX
against private copies (:mod:`corral.bench.microvm_dax`). Under TCG (this host) absolute
boot times are reported, not targeted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.backends.microvm.backend import MicroVMBackend
from corral.bench.image import ensure_image
from corral.bench.microvm_dax import dax_figure
from corral.bench.scenarios import BenchOptions, machine, say
from corral.bench.stats import p50, p99
from corral.images.store import LayerStore

if TYPE_CHECKING:
    from corral.node import NodeConfig

__all__ = ["microvm"]


def vm_node_config(
    opts: BenchOptions, kind: str, kernel_dir: Path | None, tcg_tb_mib: int | None = None
) -> NodeConfig:
    """The bench node: containers (for the same-run baseline) beside a ``kind`` VM backend
    (``tcg_tb_mib``: its translation cache instead of the default, for an A/B)."""
    from corral.node import NodeConfig

    vm_cfg: dict[str, Any] = {"kind": kind}
    if kernel_dir is not None:
        vm_cfg["kernel_dir"] = str(kernel_dir)
    if tcg_tb_mib is not None:
        vm_cfg["tcg_tb_mib"] = tcg_tb_mib
    return NodeConfig.model_validate(
        {
            "state_dir": opts.state_dir,
            "run_dir": opts.run_dir,
            "store": opts.store,
            "cgroup_subtree": opts.subtree,
            "backends": [{"kind": "container", "runtime": opts.runtime}, vm_cfg],
        }
    )


async def microvm(
    opts: BenchOptions,
    count: int,
    kernel_dir: Path | None,
    only: str | None = None,
    tcg_tb_mib: int | None = None,
) -> dict[str, Any]:
    """The scenario (see the module docstring); ``only="dax"``: the ``dax`` figure alone
    (its own boot times and idle breakdown included), for A/B runs of memory changes."""
    from corral.node import Node
    from corral.spec import ExecRequest, ForkRequest, Limits, SandboxSpec

    store = LayerStore(opts.store_dir)
    image = await asyncio.to_thread(ensure_image, store, opts.image)
    cfg = vm_node_config(opts, "microvm", kernel_dir, tcg_tb_mib)
    limits = Limits(cpus=1, memory="256MiB", disk="1GiB")
    # latency: a TCG boot on idle CPU only would measure the host's other load
    spec = SandboxSpec(image=image.info.name, backend="microvm", limits=limits, qos="latency")
    cspec = spec.model_copy(update={"backend": "container"})
    node = await Node.open(cfg)
    ids: list[str] = []
    out: dict[str, Any] = {"scenario": "microvm", "count": count, "image": image.info.name}
    out["machine"] = machine()
    try:
        await node.gc(everything=True)
        vm = node.backends.get("microvm")
        assert vm is not None
        out["accel"] = vm.status().accel
        out["accel_detail"] = vm.status().detail.get("accel_detail", "")
        assert isinstance(vm, MicroVMBackend)
        out["tcg_tb_mib"] = vm.config.tcg_tb_mib
        if only == "dax":
            out["dax"] = await dax_figure(node, vm, spec, count, opts.state_dir)
            return out

        async def boot(s: SandboxSpec) -> float:
            t0 = time.perf_counter()
            info = await node.sandbox_create(s)
            ids.append(info.id)
            r = await node.exec(info.id, ExecRequest(cmd=["true"]))
            if r.exit_code != 0:
                raise RuntimeError(f"`true` in {info.id}: {r.reason} {r.stderr[:200]!r}")
            return time.perf_counter() - t0

        say(f"microvm: {count} boots to first exec, one after another ({out['accel']})")
        boots = [await boot(spec) for _ in range(count)]
        out["boot_to_exec_ms"] = {"p50": _ms(p50(boots)), "p99": _ms(p99(boots))}
        say("microvm: 50 execs of true in one VM")
        lat = []
        for _ in range(50):
            t0 = time.perf_counter()
            await node.exec(ids[0], ExecRequest(cmd=["true"]))
            lat.append(time.perf_counter() - t0)
        out["exec_p50_ms"] = _ms(p50(lat))
        mem = [vm.meters(i).memory_resident or 0 for i in ids]
        out["host_mem_per_vm_mib"] = round(sum(mem) / len(mem) / (1 << 20), 1)
        say("microvm: pause(memory_snapshot=True) and resume to first exec, 3 rounds")
        released, resumes, left, kept, befores = [], [], [], [], []
        for _ in range(3):
            before = node.cgroups.memory_current(ids[0])
            befores.append(before)
            await node.sandbox_pause(ids[0], memory_snapshot=True)
            after = node.cgroups.memory_current(ids[0])
            released.append((before - after) / before if before else 0.0)
            left.append(node.cgroups.memory_breakdown(ids[0]))
            # what the old cgroup still held when the backend made it anew (its charge
            # went to the parent): the figure before that step, kept for comparison
            ev = [e for e in await node.events(ids[0]) if e.kind == "paused"][-1]
            kept.append(int(ev.detail.get("recycled_cgroup_bytes") or 0))
            t0 = time.perf_counter()
            await node.sandbox_resume(ids[0])
            r = await node.exec(ids[0], ExecRequest(cmd=["true"]))
            if r.exit_code != 0:
                raise RuntimeError(f"`true` after restore: {r.reason} {r.stderr[:200]!r}")
            resumes.append(time.perf_counter() - t0)
        out["pause_released_fraction"] = round(min(released), 3)
        # what stayed charged in that round: page cache ("file") here is the layer files'
        # (shared with every reader; this VM read those pages first), the VMM is gone
        worst = left[released.index(min(released))]
        out["pause_left_mib"] = {k: round(v / (1 << 20), 1) for k, v in worst.items()}
        out["pause_recycled_mib"] = round(max(kept) / (1 << 20), 1)
        out["pause_released_before_recycle"] = round(
            min((b - k) / b if b else 0.0 for b, k in zip(befores, kept, strict=True)), 3
        )
        out["snapshot_resume_to_exec_ms"] = _ms(p50(resumes))
        out["snapshot_resume_vs_boot"] = round(p50(resumes) / p50(boots), 3)
        kids = min(count, 4)
        say(f"microvm: fork {kids} children from one VM (memory snapshot + disk copies)")
        t0 = time.perf_counter()
        made = await node.sandbox_fork(ids[0], ForkRequest(count=kids))
        out["fork_per_s"] = round(kids / (time.perf_counter() - t0), 2)
        out["fork_count"] = kids
        ids.extend(k.id for k in made)
        for k in made:
            r = await node.exec(k.id, ExecRequest(cmd=["true"]))
            if r.exit_code != 0:
                raise RuntimeError(f"`true` in fork {k.id}: {r.reason} {r.stderr[:200]!r}")
        for i in ids:
            await node.sandbox_destroy(i)
        ids.clear()
        out["dax"] = await dax_figure(node, vm, spec, count, opts.state_dir)
        say(f"container: {count} boots to first exec, one after another")
        cboots = [await boot(cspec) for _ in range(count)]
        out["container_boot_to_exec_ms"] = _ms(p50(cboots))
    finally:
        for i in ids:
            await node.sandbox_destroy(i)
        await node.close()
    return out


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
