"""``corral bench scale``: does create and exec stay as fast while the live count grows?

Sandboxes are created in windows of ``window`` (at ``concurrency`` in flight) and kept
alive; after each window a sample of ``exec true`` runs in sandboxes spread over all the
live ones. A node whose per-operation cost is O(1) shows the same create rate and exec
p50 in the last window as in the first; anything that walks every sandbox (a mount
table, a cgroup hierarchy, a database table, a per-tick scan) shows up as a slope. At
the end all sandboxes are destroyed (timed: ``destroy_per_s``) and the host is scanned
for leftovers, like ``bench density``.

A destroy may leave the sandbox's cgroups to the node's pool of pre-made ones (v1: see
``CgroupPool.give_back``), which removes those beyond its size once the node is quiet.
That removal is work the destroys handed on, so it is timed too: ``after_destroy`` has
the seconds until the pool settled, with the machine's busy CPU (all cores, kernel
threads included) during the destroys and after them, per destroy.

``exec_p50_ms_empty`` is measured with one sandbox alive before the first window,
``exec_p50_ms_full`` with all ``count`` alive (the last window's figure).

The two are not the same kind of exec: the empty figure is 100 execs back to back in one
sandbox, whose init keeps its command spawner (a thread and a Landlock domain) while
commands come within a second; a window's probe is mostly the first exec in its sandbox
for over a second, which starts a new spawner (corral-init.c, ``SPAWNER_IDLE_NS``): ~0.3-0.4
ms more at any live count (docs/design-notes.md, "branch scale5"). So each window also
runs its probes a second time at once (``exec_again_p50_ms``, spawners alive), and
``exec_again_p50_ms_full`` over ``exec_p50_ms_empty`` is the like-for-like ratio.

Each window also says how fast the CPU ran just after it (``cpu_loop_ms``, the fixed loop
of ``machine.cpu_loop_ms``): on a VM whose host slows it down mid-run, a falling create
rate with a rising loop time is the machine's, not the live count's.
"""

from __future__ import annotations

import time
from typing import Any

from corral.bench.scenarios import (
    BenchOptions,
    _cgroup_pool,
    _create_n,
    _destroy_all,
    _true,
    _warm_up,
    cpu_loop_ms,
    header,
    many,
    prepared,
    say,
)
from corral.bench.stats import CpuMeter, machine_busy_s, rate, summary_ms
from corral.errors import CorralError
from corral.host import leaks
from corral.sdk import AsyncClient, Sandbox

__all__ = ["scale", "EXEC_SAMPLES"]

EXEC_SAMPLES = 100
"""Execs per window: enough for a stable p50 at a cost of well under a second."""


async def scale(
    opts: BenchOptions, count: int, window: int, concurrency: int = 8
) -> dict[str, Any]:
    """Create ``count`` sandboxes in windows of ``window``: create/s and exec p50 per
    window, then destroy/s of all of them and the leftovers on the host."""
    if window < 1 or window > count:
        raise CorralError(f"--window {window}: must be between 1 and --count ({count})")
    async with prepared(opts) as p:
        out = header("scale", p, count=count, window=window, concurrency=concurrency)
        before = leaks.scan(opts.state_dir, opts.run_dir, subtree=opts.subtree)
        out.update(await _run(opts, p.image.info.name, count, window, concurrency))
        after = leaks.scan(opts.state_dir, opts.run_dir, subtree=opts.subtree)
        left = {k: sorted(set(v) - set(before.get(k, []))) for k, v in after.items()}
        left = {k: v for k, v in left.items() if v}
        out["leftovers"] = leaks.total(left)
        if left:
            out["leftover_detail"] = {k: v[:20] for k, v in left.items()}
        out["method"] = (
            f"windows of {window} creates at concurrency {concurrency} (create only, "
            f"no exec); after each, {EXEC_SAMPLES} `exec true` spread over all live "
            "sandboxes at concurrency 1 (p50), then the same again at once "
            "(exec_again_p50_ms: spawners alive, as in the empty figure); "
            "exec_p50_ms_empty with 1 alive, back to back"
        )
        return out


async def _exec_p50(sbs: list[Sandbox], w: dict[str, Any]) -> None:
    """p50 of ``exec true`` over up to EXEC_SAMPLES sandboxes spread evenly over ``sbs``,
    into ``w["exec_p50_ms"]``, and the probes' CLOCK_MONOTONIC span (``exec_mono_s``: a
    profiler cuts its samples to the execs by it)."""
    if not sbs:
        w["exec_p50_ms"] = None
        return
    n = min(EXEC_SAMPLES, len(sbs))
    step = len(sbs) / n
    picked = [sbs[int(i * step)] for i in range(n)]
    t0 = time.monotonic()
    t = await many(n, 1, lambda i: _true(picked[i]))
    w["exec_mono_s"] = [round(t0, 3), round(time.monotonic(), 3)]
    if not t.latencies:
        raise CorralError(f"every exec failed; first error: {t.errors[:1]}")
    w["exec_p50_ms"] = float(summary_ms(t.latencies)["p50_ms"])
    # The same sandboxes again at once, their spawners still alive: the kind of exec the
    # empty figure measures (see the module docstring).
    again = await many(n, 1, lambda i: _true(picked[i]))
    if again.latencies:
        w["exec_again_p50_ms"] = float(summary_ms(again.latencies)["p50_ms"])


async def _settle_after(client: AsyncClient, busy0: float, n: int) -> dict[str, Any]:
    """The pool settling after the destroys (removing the cgroups it holds beyond its
    size; the btrfs cleaner is not waited for): seconds, and the machine's busy CPU per
    destroy during the destroys and during the settling."""
    from corral.node import Node  # the embedded node: it is imported when the client opens

    busy1, t0 = machine_busy_s(), time.monotonic()
    pool = await _cgroup_pool(client)
    node = await client._get_ops()
    engine = node.backends.get("container") if isinstance(node, Node) else None
    if engine is not None:
        await engine.settle(300.0)
    busy2 = machine_busy_s()
    per = 1000 / max(n, 1)
    return {
        "settle_s": round(time.monotonic() - t0, 2),
        "machine_busy_ms_per_destroy": round((busy1 - busy0) * per, 2),
        "machine_busy_ms_per_destroy_settling": round((busy2 - busy1) * per, 2),
        "cgroup_pool": pool,
    }


async def _run(
    opts: BenchOptions, image: str, count: int, window: int, concurrency: int
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    windows: list[dict[str, Any]] = []
    async with AsyncClient(config=opts.node_config(count)) as client:
        img = await client.images.get(image)
        await _warm_up(client, img)
        sbs: list[Sandbox] = []
        try:
            first = await client.sandboxes.create(image=img, labels={"corral-bench": "scale"})
            t0 = time.monotonic()
            t = await many(EXEC_SAMPLES, 1, lambda i: _true(first))
            res["exec_empty_mono_s"] = [round(t0, 3), round(time.monotonic(), 3)]
            res["exec_p50_ms_empty"] = summary_ms(t.latencies)["p50_ms"]
            await first.destroy()
            errors = 0
            while len(sbs) < count:
                n = min(window, count - len(sbs))
                cpu = CpuMeter().start()
                t0 = time.monotonic()
                made = await _create_n(client, img, n, concurrency, sbs, False, "scale")
                t1 = time.monotonic()
                errors += len(made.errors)
                if made.errors and "first_error" not in res:
                    res["first_error"] = made.errors[0][:500]
                w = {
                    "live": len(sbs),
                    "create_per_s": rate(n - len(made.errors), made.wall),
                    "cpu_ms_per_create": cpu.per_op(n - len(made.errors)),
                    "exec_p50_ms": None,  # filled in by _exec_p50 below
                    # CLOCK_MONOTONIC of the creates (not the execs): a profiler's samples
                    # (`perf record -k CLOCK_MONOTONIC`) are cut to one window by these.
                    "mono_s": [round(t0, 3), round(t1, 3)],
                }
                await _exec_p50(sbs, w)
                # How fast the CPU ran just after this window: a slope in create/s that
                # the CPU's own speed shows too is the machine's, not the live count's.
                w["cpu_loop_ms"] = cpu_loop_ms()
                windows.append(w)
                say(
                    f"scale: {w['live']} live, window {len(windows)}: "
                    f"{w['create_per_s']} creates/s, exec p50 {w['exec_p50_ms']} ms"
                )
                if made.errors and len(made.errors) == n:
                    break  # the node no longer creates: stop rather than spin
            res["create_errors"] = errors
            res["windows"] = windows
            res["first_window_create_per_s"] = windows[0]["create_per_s"]
            res["last_window_create_per_s"] = windows[-1]["create_per_s"]
            res["exec_p50_ms_full"] = windows[-1]["exec_p50_ms"]
            if windows[-1].get("exec_again_p50_ms") is not None:
                res["exec_again_p50_ms_full"] = windows[-1]["exec_again_p50_ms"]
            say(f"scale: destroying {len(sbs)}")
            todo, sbs = sbs, []
            cpu = CpuMeter().start()
            t0 = time.monotonic()
            busy0 = machine_busy_s()
            gone = await _destroy_all(todo, concurrency)
            res["destroy_mono_s"] = [round(t0, 3), round(time.monotonic(), 3)]
            res["destroy_per_s"] = rate(len(gone.latencies), gone.wall) if todo else 0.0
            res["cpu_ms_per_destroy"] = cpu.per_op(len(gone.latencies))
            res["destroy_errors"] = len(gone.errors)
            res["after_destroy"] = await _settle_after(client, busy0, len(gone.latencies))
        finally:
            await _destroy_all(sbs, concurrency)
    # The spec's key order: scenario, count, windows, then the summary figures.
    order = [
        "windows",
        "first_window_create_per_s",
        "last_window_create_per_s",
        "exec_p50_ms_empty",
        "exec_p50_ms_full",
        "destroy_per_s",
    ]
    return {k: res[k] for k in order if k in res} | {k: v for k, v in res.items() if k not in order}
