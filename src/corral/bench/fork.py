"""``corral bench fork``: forks of a sandbox holding many written files, against copying.

One parent sandbox writes ``size`` bytes of incompressible files. Then, in the same run:

* ``snapshot_ms``: ``sb.snapshot()`` (freeze, btrfs snapshot, pack into an EROFS layer);
  the snapshot image and layer are removed from the store afterwards.
* ``fork_per_s``: ``sb.fork(count)``, count / wall time to all children running (each
  child's first exec is checked to see the parent's files, untimed).
* baselines: plain creates of the same image (``create_ms`` one at a time,
  ``create_per_s`` as many in flight as a fork starts), and the naive copy —
  create a fresh sandbox, ``files.download`` the files from the parent to the host and
  ``files.upload`` them into it (``naive_copy_ms``, ``naive_per_s``).

``ratio.fork_vs_naive`` = fork_per_s / naive_per_s; ``fork_vs_create`` = fork_per_s /
create_per_s (a fork costs what a create costs: no data is copied).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Any

from corral.bench.scenarios import BenchOptions, header, prepared, say
from corral.bench.stats import rate, summary_ms
from corral.errors import CorralError, SandboxError
from corral.images.store import LayerStore
from corral.sdk import AsyncClient, Sandbox

__all__ = ["fork"]

DATA = "/work/forkbench"
FORK_CONCURRENCY = 8  # children a fork starts at once (corral.node.snapshot's figure)
_FILE = 1 << 20


async def _check(sb: Sandbox, cmd: str) -> str:
    r = await sb.exec(["sh", "-c", cmd], timeout=600)
    if not r.ok:
        raise SandboxError(
            f"{cmd!r} in {sb.id} ended {r.reason} (exit {r.exit_code}): "
            f"{r.stderr.decode(errors='replace')[:300]}"
        )
    return r.stdout.decode()


async def fork(opts: BenchOptions, count: int, size: int, rounds: int = 3) -> dict[str, Any]:
    """Fork ``count`` children from a parent with ``size`` bytes of files, ``rounds`` times."""
    files = max(1, size // _FILE)
    async with prepared(opts) as p:
        out = header("fork", p, count=count, rounds=rounds, written_mib=files * _FILE >> 20)
        cfg = opts.node_config(count + 16)
        async with AsyncClient(config=cfg) as client:
            img = await client.images.get(p.image.info.name)
            disk = max(2 << 30, 3 * files * _FILE)
            made: list[Sandbox] = []
            try:
                creates = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    sb = await client.sandboxes.create(image=img, limits={"disk": disk})
                    await _check(sb, "true")
                    creates.append(time.perf_counter() - t0)
                    await sb.destroy()
                out["create_ms"] = summary_ms(creates[1:])["p50_ms"]  # first one warms up
                # The same number of plain creates, as many in flight as a fork starts.
                sem = asyncio.Semaphore(FORK_CONCURRENCY)

                async def plain() -> None:
                    async with sem:
                        made.append(await client.sandboxes.create(image=img))

                t0 = time.perf_counter()
                await asyncio.gather(*(plain() for _ in range(count)))
                out["create_per_s"] = rate(count, time.perf_counter() - t0)
                for sb in made[:]:
                    await sb.destroy()
                    made.remove(sb)

                parent = await client.sandboxes.create(image=img, limits={"disk": disk})
                made.append(parent)
                say(f"parent {parent.id}: writing {files} files of 1 MiB")
                await _check(
                    parent,
                    f"mkdir -p {DATA} && for i in $(seq 1 {files}); do "
                    f"dd if=/dev/urandom of={DATA}/f$i bs=1M count=1 2>/dev/null || exit 1; done",
                )
                probe = f"{DATA}/f{files}"
                want = await parent.files.read(probe)
                # Writing the fresh files out to disk is a one-time cost of the data (the
                # first snapshot of them would pay it): measured here, on its own.
                t0 = time.perf_counter()
                await _check(
                    parent, f"if command -v sync; then sync -f {probe}; else busybox sync; fi"
                )
                out["writeback_ms"] = round((time.perf_counter() - t0) * 1000, 1)

                walls, lat = [], []
                for r in range(rounds):
                    say(f"round {r + 1}/{rounds}: fork({count})")
                    t0 = time.perf_counter()
                    kids = await parent.fork(count)
                    wall = time.perf_counter() - t0
                    walls.append(wall)
                    lat.append(wall / count)
                    made.extend(kids)
                    for k in kids[:3]:
                        if await k.files.read(probe) != want:
                            raise CorralError(f"fork {k.id} does not hold the parent's files")
                    for k in kids:
                        await k.destroy()
                        made.remove(k)
                out["fork_per_s"] = rate(count * rounds, sum(walls))
                out["fork_wall_s"] = [round(w, 3) for w in walls]
                out["fork_ms_per_child_p50"] = summary_ms(lat)["p50_ms"]

                t0 = time.perf_counter()
                snap = await parent.snapshot()
                out["snapshot_ms"] = round((time.perf_counter() - t0) * 1000, 1)
                # How long the parent was held frozen (the rest runs beside it).
                ev = await parent.events()
                frozen = {
                    k: [e.detail.get("frozen_ms") for e in ev if e.kind == k]
                    for k in ("snapshot", "forked")
                }
                out["snapshot_frozen_ms"] = frozen["snapshot"][-1] if frozen["snapshot"] else None
                out["fork_frozen_ms"] = frozen["forked"]
                store = LayerStore(cfg.store_dir)
                out["snapshot_layer_mib"] = round(store.layer(snap.layers[-1]).size / (1 << 20), 1)
                store.remove_image(snap.name)
                store.remove_layer(snap.layers[-1])

                say("naive copy: create + files.download + files.upload (tar both ways)")
                with tempfile.TemporaryDirectory(prefix="corral-forkbench-", dir="/var/tmp") as d:
                    t0 = time.perf_counter()
                    copy = await client.sandboxes.create(image=img, limits={"disk": disk})
                    made.append(copy)
                    local = await parent.files.download(DATA, d)
                    await copy.files.upload(local, "/work")
                    naive = time.perf_counter() - t0
                if await copy.files.read(probe) != want:
                    raise CorralError("the naive copy does not hold the parent's files")
                out["naive_copy_ms"] = round(naive * 1000, 1)
                out["naive_per_s"] = round(1 / naive, 3)
            finally:
                for sb in made:
                    try:
                        await sb.destroy()
                    except CorralError as e:
                        say(f"destroy {sb.id}: {e.message}")
        out["ratio"] = {
            "fork_vs_naive": round(out["fork_per_s"] / out["naive_per_s"], 1),
            "fork_vs_create": round(out["fork_per_s"] / out["create_per_s"], 2),
        }
        out["method"] = (
            "fork_per_s: children / wall of sb.fork(count) until all run, over rounds, after "
            "the parent's files were written out to disk (writeback_ms, sync -f inside); "
            "snapshot after the forks; "
            "naive: create + files.download + files.upload of the files; create_ms: plain "
            "create + exec true, p50 of 4 after a warm-up; create_per_s: count plain creates "
            f"with {FORK_CONCURRENCY} in flight, as a fork starts them"
        )
        return out
