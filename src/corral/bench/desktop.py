"""``corral bench desktop``: what a desktop VM (``backend="vm"``) costs, in one run.

Boots ``count`` desktop VMs one after another and times each from the create request to
its first screenshot (the create returns once the X session's terminal has the focus).
In the first VM: screenshot round trips, input round trips (a pointer move), and typed
text to the file its shell command writes (``echo N > /tmp/typedN`` typed into the
terminal, the file polled through the agent). Host memory per VM from its cgroup while
all are up. Under TCG (this host) the figures are reported, not targeted.

The image: ``--image desktop`` (default) builds Debian bookworm with
:data:`corral.images.build.DESKTOP_PACKAGES` once into the store (``bench/desktop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from corral.bench.microvm import vm_node_config
from corral.bench.scenarios import BenchOptions, machine, say
from corral.bench.stats import p50, p99
from corral.errors import ImageNotFound, NotFound
from corral.images.store import LayerStore
from corral.spec import ImageInfo

__all__ = ["desktop"]

IMAGE = "bench/desktop"


def ensure_desktop_image(store: LayerStore, want: str) -> ImageInfo:
    """``want`` from the store; ``desktop`` is built on first use."""
    if want != "desktop":
        return store.image(want)
    with contextlib.suppress(ImageNotFound):
        return store.image(IMAGE)
    from corral.images import build

    say(f"building {IMAGE} (Debian bookworm + desktop packages) once into {store.root}")
    layer = build.build_debian(store, "bookworm", include=list(build.DESKTOP_PACKAGES))
    return store.put_image(IMAGE, [layer.digest])


async def desktop(
    opts: BenchOptions, count: int, width: int, height: int, kernel_dir: Path | None
) -> dict[str, Any]:
    from corral.node import Node
    from corral.spec import Desktop, DesktopInput, Limits, SandboxSpec

    store = LayerStore(opts.store_dir)
    image = await asyncio.to_thread(ensure_desktop_image, store, opts.image)
    cfg = vm_node_config(opts, "vm", kernel_dir)
    spec = SandboxSpec(
        image=image.name,
        backend="vm",
        desktop=Desktop(width=width, height=height),
        limits=Limits(cpus=1, memory="1GiB", disk="2GiB"),
        qos="latency",  # a TCG boot on idle CPU only would measure the host's other load
    )
    out: dict[str, Any] = {
        "scenario": "desktop",
        "count": count,
        "image": image.name,
        "size": f"{width}x{height}",
        "machine": machine(),
    }
    node = await Node.open(cfg)
    ids: list[str] = []
    try:
        await node.gc(everything=True)
        vm = node.backends.get("vm")
        assert vm is not None
        out["accel"] = vm.status().accel
        if not vm.status().ok:
            raise RuntimeError(f"vm backend unavailable: {vm.status().detail}")
        say(f"desktop: {count} boots to first screenshot, one after another ({out['accel']})")
        boots = []
        for _ in range(count):
            t0 = time.perf_counter()
            info = await node.sandbox_create(spec)
            ids.append(info.id)
            png = await node.desktop_screenshot(info.id)
            boots.append(time.perf_counter() - t0)
        out["boot_to_screenshot_ms"] = {"p50": _ms(p50(boots)), "p99": _ms(p99(boots))}
        out["screenshot_bytes"] = len(png)
        mem = [vm.meters(sb_id).memory_resident or 0 for sb_id in ids]
        out["host_mem_per_vm_mib"] = round(sum(mem) / len(mem) / (1 << 20), 1)
        sid = ids[0]
        say("desktop: 20 screenshots, 20 pointer moves, 3 typed commands in one VM")
        shots, moves, typed = [], [], []
        for i in range(20):
            t0 = time.perf_counter()
            await node.desktop_screenshot(sid)
            shots.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await node.desktop_input(sid, DesktopInput(action="move", x=10 + i, y=10 + i))
            moves.append(time.perf_counter() - t0)
        for i in range(3):
            path = f"/tmp/typed{i}"
            t0 = time.perf_counter()
            await node.desktop_input(sid, DesktopInput(action="type", text=f"echo {i} > {path}\n"))
            await _wait_file(node, sid, path, f"{i}\n".encode())
            typed.append(time.perf_counter() - t0)
        out["screenshot_ms_p50"] = _ms(p50(shots))
        out["input_ms_p50"] = _ms(p50(moves))
        out["type_to_file_ms_p50"] = _ms(p50(typed))
    finally:
        for sb_id in ids:
            await node.sandbox_destroy(sb_id)
        await node.close()
    return out


async def _wait_file(node: Any, sid: str, path: str, want: bytes, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(NotFound):
            got = await node.file_read(sid, path)
            if got == want:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear in {sid} within {timeout:g} s")
        await asyncio.sleep(0.1)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
