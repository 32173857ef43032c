"""``corral bench crash``: SIGKILL the node agent under load, start it again, and check
that nothing was lost and nothing was left.

Each round a child process opens the node (the agent), tops it up to ``count`` live
sandboxes and gives them a mix of states: background processes (``sleep``), a few busy
ones (a shell loop on the CPU), open shells, every 4th paused. It writes down what it
has, then starts operations and is killed while they are in flight: creates, forks,
pauses, destroys, a snapshot, and execs whose output is still streaming. This process
then opens the node on the same state (as a restarted agent would) and checks:

- ``lost``: a sandbox the child had before its in-flight operations that is gone, or a
  paused one that is no longer paused (destroy targets may go either way);
- ``leftovers``: what the new agent's ``gc()`` still finds to remove after its recovery,
  plus cgroups and subvolumes that belong to no live sandbox;
- ``recover_s``: from the start of the open until every live sandbox answers an exec
  (paused ones are resumed for it, then paused again).

At the end everything is destroyed and the host scanned (host/leaks.py).

Example::

    result = await crash(BenchOptions(image="busybox"), count=20, rounds=2)
    assert result["lost"] == 0 and result["leftovers"] == 0
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from corral.bench.leftovers import settled_scan
from corral.bench.scenarios import BenchOptions, say
from corral.host import leaks

__all__ = ["crash"]

_BUSY = 2
"""Sandboxes that spin a CPU loop: enough to keep the agent's host busy, few enough to
leave room for the rest on a small machine (they run best-effort, on idle CPU)."""
_INFLIGHT_CREATES = 4
_INFLIGHT_FORKS = 2
_INFLIGHT_PAUSES = 2
_INFLIGHT_DESTROYS = 2
_INFLIGHT_SNAPSHOTS = 1
_INFLIGHT_STREAMS = 2
"""Execs whose output is still streaming (a loop printing) when the agent is killed."""


async def _child(config_json: str, image: str, count: int, out: Path) -> None:
    """The agent that is killed: runs in its own process (``python -m corral.bench.crash``)."""
    from corral.node import Node
    from corral.node.config import NodeConfig
    from corral.spec import ExecRequest, ForkRequest, SandboxSpec

    node = await Node.open(NodeConfig.model_validate_json(config_json))
    spec = SandboxSpec(image=image, labels={"bench": "crash"})
    sem = asyncio.Semaphore(8)

    async def create() -> None:
        async with sem:
            await node.sandbox_create(spec)

    have = await node.sandbox_list()
    await asyncio.gather(*(create() for _ in range(count - len(have))))
    infos = sorted(await node.sandbox_list(), key=lambda i: i.id)
    running = [i.id for i in infos if i.state == "running"]
    for n, sid in enumerate(running):
        if n < _BUSY:
            await node.spawn(sid, ExecRequest(cmd=["sh", "-c", "while :; do :; done"]))
        elif n % 5 == 0:
            await node.spawn(sid, ExecRequest(cmd=["sleep", "86400"]))
        elif n % 6 == 0:
            await node.shell_open(sid)
    to_pause = [sid for n, sid in enumerate(running) if n >= _BUSY and n % 4 == 0]
    await asyncio.gather(*(node.sandbox_pause(sid) for sid in to_pause))
    infos = await node.sandbox_list()
    running = sorted(i.id for i in infos if i.state == "running")[_BUSY:]
    # the in-flight victims: taken from the end so busy ones and forks' parents differ
    destroys = running[-_INFLIGHT_DESTROYS:]
    pauses = running[-_INFLIGHT_DESTROYS - _INFLIGHT_PAUSES : -_INFLIGHT_DESTROYS]
    parents = running[:_INFLIGHT_FORKS]
    rest = running[_INFLIGHT_FORKS : -_INFLIGHT_DESTROYS - _INFLIGHT_PAUSES]
    snapshots = rest[:_INFLIGHT_SNAPSHOTS]
    streams = rest[_INFLIGHT_SNAPSHOTS : _INFLIGHT_SNAPSHOTS + _INFLIGHT_STREAMS]
    roles: dict[str, str] = {i.id: i.state for i in infos}
    roles.update({s: "inflight-destroy" for s in destroys})
    roles.update({s: "inflight-pause" for s in pauses})
    roles.update({s: "fork-parent" for s in parents})
    roles.update({s: "inflight-snapshot" for s in snapshots})
    roles.update({s: "open-stream" for s in streams})
    roles.update({s: "busy" for s in sorted(i.id for i in infos if i.state == "running")[:_BUSY]})
    record = {
        "roles": roles,
        "ids": sorted(i.id for i in infos),
        "paused": sorted(i.id for i in infos if i.state == "paused"),
        "uncertain": destroys + pauses,
    }
    out.write_text(json.dumps(record))
    tasks: list[asyncio.Task[Any]] = [
        asyncio.create_task(node.sandbox_create(spec)) for _ in range(_INFLIGHT_CREATES)
    ]
    tasks += [asyncio.create_task(node.sandbox_fork(p, ForkRequest(count=1))) for p in parents]
    tasks += [asyncio.create_task(node.sandbox_pause(s)) for s in pauses]
    tasks += [asyncio.create_task(node.sandbox_destroy(s)) for s in destroys]
    tasks += [asyncio.create_task(node.sandbox_snapshot(s)) for s in snapshots]
    loop = "while :; do echo streaming; sleep 0.05; done"
    tasks += [
        asyncio.create_task(node.exec(s, ExecRequest(cmd=["sh", "-c", loop], timeout=3600)))
        for s in streams
    ]
    for _ in range(5):
        await asyncio.sleep(0)  # let each operation get past its first await
    print("inflight", flush=True)
    await asyncio.sleep(3600)  # the parent kills this process now


async def _kill_child(opts: BenchOptions, image: str, count: int, record: Path) -> None:
    config = opts.node_config(count).model_dump_json()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "corral.bench.crash",
        config,
        image,
        str(count),
        str(record),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(1800):
            while True:
                line = await proc.stdout.readline()
                if not line:
                    raise RuntimeError(
                        f"the agent child ended before its operations began "
                        f"(exit {await proc.wait()})"
                    )
                if line.strip() == b"inflight":
                    break
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()


async def _recover(opts: BenchOptions, count: int, record: dict[str, Any]) -> dict[str, Any]:
    """Open the node again as a restarted agent and check what the killed one had."""
    from corral.node import Node
    from corral.spec import ExecRequest

    t0 = time.monotonic()
    node = await Node.open(opts.node_config(count))
    try:
        live = {i.id: i for i in await node.sandbox_list()}
        uncertain = set(record["uncertain"])
        lost = [s for s in record["ids"] if s not in live and s not in uncertain]
        unpaused = [s for s in record["paused"] if s in live and live[s].state != "paused"]
        sem = asyncio.Semaphore(8)
        silent: list[str] = []

        async def answers(sid: str) -> None:
            async with sem:
                paused = live[sid].state == "paused"
                try:
                    if paused:
                        await node.sandbox_resume(sid)
                    r = await node.exec(sid, ExecRequest(cmd=["echo", sid], timeout=30))
                    if r.stdout != f"{sid}\n".encode():
                        silent.append(f"{sid}: answered {r.stdout!r}")
                except Exception as e:  # noqa: BLE001 - counted and shown
                    role = record["roles"].get(sid, "adopted")
                    silent.append(f"{sid} ({role}): {type(e).__name__}: {e}"[:300])
                finally:
                    if paused:
                        await node.sandbox_pause(sid)

        await asyncio.gather(*(answers(s) for s in live))
        recover_s = time.monotonic() - t0
        removed = await node.gc()
        ids = set(live)
        stray_cgroups = sorted(set(node.cgroups.list()) - ids)
        stray_subvols = sorted(set(node.scratch.subvols()) - ids)
    finally:
        await node.close()
    return {
        "live": len(live),
        "lost": len(lost) + len(unpaused),
        "lost_ids": (lost + unpaused)[:10],
        "not_answering": len(silent),
        "not_answering_examples": silent[:5],
        "adopted": len(ids - set(record["ids"])),
        "leftovers": sum(removed.values()) + len(stray_cgroups) + len(stray_subvols),
        "leftover_detail": {
            "gc": {k: v for k, v in removed.items() if v},
            "cgroups": stray_cgroups[:10],
            "subvolumes": stray_subvols[:10],
        },
        "recover_s": round(recover_s, 2),
    }


async def crash(opts: BenchOptions, count: int, rounds: int) -> dict[str, Any]:
    """``rounds`` times: an agent child with ``count`` sandboxes is SIGKILLed mid-work,
    the node is opened again and checked; then everything is destroyed."""
    from corral.bench.image import ensure_image
    from corral.images.store import LayerStore
    from corral.node import Node

    image = await asyncio.to_thread(ensure_image, LayerStore(opts.store_dir), opts.image)
    node = await Node.open(opts.node_config(count))
    await node.gc(everything=True)
    await node.close()
    record_file = opts.run_dir.with_name(opts.run_dir.name + "-crash.json")
    results = []
    try:
        for r in range(rounds):
            say(f"crash round {r + 1}/{rounds}: {count} sandboxes, SIGKILL mid-operations")
            await _kill_child(opts, image.info.name, count, record_file)
            record = json.loads(record_file.read_text())
            res = await _recover(opts, count, record)
            say(f"round {r + 1}: {res}")
            results.append(res)
    finally:
        record_file.unlink(missing_ok=True)
        node = await Node.open(opts.node_config(count))
        try:
            for info in await node.sandbox_list():
                await node.sandbox_destroy(info.id)
        finally:
            await node.close()
    found = await settled_scan(opts)
    return {
        "scenario": "crash",
        "count": count,
        "rounds": rounds,
        "lost": sum(r["lost"] for r in results),
        "not_answering": sum(r["not_answering"] for r in results),
        "leftovers": sum(r["leftovers"] for r in results) + leaks.total(found),
        "recover_s_max": max((r["recover_s"] for r in results), default=None),
        "leaks_after": {k: len(v) for k, v in found.items() if v},
        "per_round": results,
        "image": image.info.name,
    }


if __name__ == "__main__":  # the agent child of a round
    asyncio.run(_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])))
