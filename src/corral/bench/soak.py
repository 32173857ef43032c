"""``corral bench soak``: the whole life of a sandbox, thousands of times over, to find
what one run of each test never shows: a leak per cycle, a slower create after hours, a
database that only grows.

One cycle: create, exec, write a file and read it back, open a shell and run in it, pause
and resume (every 10th), fork one child and destroy it (every 50th), destroy. Every 25th
sandbox has a network permission (a veth, nft sets and chain of its own; the address it
may reach is a documentation one, never contacted). Cycles run
``concurrency`` at a time on an embedded node. The figures compare tenths of the run by
cycle index: node RSS and SQLite size at the end of the second tenth against the end of
the last (the first tenth is warm-up: caches, pools, the first layer mount), create p99 of
the last tenth against the first. The node keeps ``retention`` destroyed sandboxes' records,
events and timings (corral.node.retention; a node's defaults keep far more, bounded by
days): about 400 cycles fill that, so from the second tenth of a long soak on, the
database's size shows whether pruning keeps it flat (SQLite reusing the freed pages). After the last cycle the node is closed and the host
scanned (host/leaks.py) plus the node's own view before it closes: cgroups, subvolumes,
and the networked sandboxes' veths and entries in the node's nft table (the table itself
goes with the node, so per-sandbox leftovers are only visible before).

Example::

    result = await soak(BenchOptions(image="busybox"), cycles=200, concurrency=8, retention=100)
    assert result["errors"] == 0 and result["leaked_total"] == 0
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from corral.bench.leftovers import settled_scan
from corral.bench.scenarios import BenchOptions, say
from corral.bench.stats import summary_ms

__all__ = ["soak"]


def _rss() -> int:
    """Resident bytes of this process: the embedded node's agent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _db_bytes(state_dir: Path) -> int:
    return sum(p.stat().st_size for p in state_dir.glob("state.db*") if p.is_file())


def _threads() -> int:
    """Threads of this process but the event loop's executor pool, which grows to its
    bound (to_thread) when busy and is no leak."""
    # Bounded pools that start their threads on demand grow when later work overlaps more
    # than the first tenth's did: growth, not a leak. The pauser's reclaim pool (up to 4),
    # the store's I/O workers (each create's image lookup is one since it left the event
    # loop, so concurrent creates can add one late), the hot-block readers and the exec
    # output readers.
    bounded = (
        "asyncio_",
        "corral-reclaim",
        "corral-store-io",
        "corral-hotblocks",
        "corral-exec-read",
        "corral-exec-b64",
    )
    return sum(1 for t in threading.enumerate() if not t.name.startswith(bounded))


_NET_EVERY = 25


def _subnet(subtree: str) -> str:
    """A /24 of 10.219/16 picked by the node's subtree: the default subnet may be another
    node's on this host, and two soaks at once (two test runs) must not share one."""
    return f"10.219.{zlib.crc32(subtree.encode()) % 256}.0/24"


_PER_VETH = ("veths", "ifaddr", "out")
"""The node's sets and maps with one element per sandbox veth (node/netrules.py)."""


def _net_leftovers(subtree: str, keys: set[str]) -> dict[str, int]:
    """Host veths (``cv<key>``) and nft entries of the node's table that name one of the
    networked sandboxes' keys, or any element of its per-veth sets, once every sandbox is
    gone."""
    from corral.host.nft import Nft, NftError

    veths = sum(1 for k in keys if Path(f"/sys/class/net/cv{k}").exists())
    nft = Nft()
    try:
        data = nft.json(f"list table inet {subtree}")
    except NftError:
        return {"veths": veths, "nft_elements": 0}  # no table: nothing in it
    finally:
        nft.close()
    entries = 0
    for item in data.get("nftables", []):
        for kind in ("set", "map", "chain"):
            obj = item.get(kind)
            if not isinstance(obj, dict):
                continue
            name = str(obj.get("name", ""))
            if name.split("_", 1)[-1] in keys:
                entries += 1
            elif name in _PER_VETH:
                entries += len(obj.get("elem", []))
    return {"veths": veths, "nft_elements": entries}


def _growth(early: int, late: int) -> float:
    return round((late - early) / early, 4) if early else 0.0


async def soak(
    opts: BenchOptions, cycles: int, concurrency: int, retention: int = 1000
) -> dict[str, Any]:
    """Run ``cycles`` sandbox lives, ``concurrency`` at once, and report what grew."""
    from corral.bench.image import ensure_image
    from corral.images.store import LayerStore
    from corral.node import Node
    from corral.policy.network import NetworkConfig, Permission
    from corral.spec import ExecRequest, ForkRequest, NetworkPolicy, SandboxSpec, sandbox_local

    image = await asyncio.to_thread(ensure_image, LayerStore(opts.store_dir), opts.image)
    cfg = opts.node_config(concurrency * 2)
    cfg.event_retention = cfg.metrics.timing_retention = cfg.destroyed_max = retention
    cfg.network = NetworkConfig(
        subnet=_subnet(opts.subtree),
        upstream=["192.0.2.53"],  # no lookup is made
        uplinks=[],  # the host's forwarding is left alone
        permissions={"soak": Permission(cidrs=["192.0.2.1/32"], ports=[80])},
    )
    node = await Node.open(cfg)
    spec = SandboxSpec(image=image.info.name, labels={"bench": "soak"})
    net_spec = spec.model_copy(update={"network": NetworkPolicy(allow=["soak"])})
    net_keys: set[str] = set()
    create_s: list[float | None] = [None] * cycles
    errors: list[str] = []
    shells = True
    tenth = max(1, cycles // 10)
    samples: dict[int, tuple[int, int]] = {}
    done = 0
    base: dict[str, int] = {}

    def finished() -> None:
        """Count a cycle, failed or not, and sample at every tenth."""
        nonlocal done
        done += 1
        if done % tenth == 0:
            samples[done // tenth] = (_rss(), _db_bytes(opts.state_dir))
        if done == tenth:
            # after the first tenth at full concurrency: the thread pool and the
            # node's caches have grown to their working size
            base["fds"] = len(os.listdir("/proc/self/fd"))
            base["threads"] = _threads()

    async def cycle(i: int) -> None:
        t0 = time.perf_counter()
        networked = i % _NET_EVERY == 3
        info = await node.sandbox_create(net_spec if networked else spec)
        create_s[i] = time.perf_counter() - t0
        sid = info.id
        if networked:
            net_keys.add(sandbox_local(sid))
            if not info.address:
                await node.sandbox_destroy(sid)
                raise AssertionError("a sandbox with a network permission has no address")
        try:
            r = await node.exec(sid, ExecRequest(cmd=["echo", str(i)]))
            if r.stdout != f"{i}\n".encode():
                raise AssertionError(f"exec answered {r.stdout!r}, not {i}")
            data = os.urandom(4096)
            await node.file_write(sid, "/tmp/soak.bin", data)
            if await node.file_read(sid, "/tmp/soak.bin") != data:
                raise AssertionError("file read back differs from what was written")
            if shells:
                shell = await node.shell_open(sid)
                r = await node.shell_run(sid, shell.id, f"X={i}; echo $X")
                if r.stdout != f"{i}\n".encode():
                    raise AssertionError(f"shell answered {r.stdout!r}, not {i}")
                await node.shell_close(sid, shell.id)
            if i % 10 == 0:
                await node.sandbox_pause(sid)
                await node.sandbox_resume(sid)
                r = await node.exec(sid, ExecRequest(cmd=["true"]))
                if r.exit_code != 0:
                    raise AssertionError("exec after resume failed")
            if i % 50 == 0:
                for child in await node.sandbox_fork(sid, ForkRequest(count=1)):
                    got = await node.file_read(child.id, "/tmp/soak.bin")
                    await node.sandbox_destroy(child.id)
                    if got != data:
                        raise AssertionError("the fork's copy of the file differs")
        finally:
            await node.sandbox_destroy(sid)

    sem = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> None:
        nonlocal shells
        async with sem:
            try:
                await cycle(i)
            except Exception as e:  # noqa: BLE001 - every failure is a figure of the soak
                if i == 0 and "needs bash" in str(e):
                    shells = False  # the image has no bash: shells are left out, said so
                    return
                errors.append(f"cycle {i}: {type(e).__name__}: {e}"[:600])
            finally:
                finished()

    view: dict[str, int] = {}
    fds_threads: dict[str, int] = {}
    try:
        await node.gc(everything=True)
        await guarded(0)  # alone first: finds out whether the image has bash
        say(f"soak: {cycles} cycles at concurrency {concurrency} on {image.info.name}")
        started = time.monotonic()
        await asyncio.gather(*(guarded(i) for i in range(1, cycles)))
        wall = time.monotonic() - started
        left = await node.sandbox_list()
        view["sandboxes"] = len(left)
        view["node_cgroups"] = len(list(node.cgroups.list()))
        view["subvolumes"] = len(list(node.scratch.subvols()))
        view.update(await asyncio.to_thread(_net_leftovers, opts.subtree, net_keys))
        # the process's own fds and threads after all sandboxes are gone, against the
        # end of the first tenth (pools and the database are open by then)
        fds_threads["fds"] = max(0, len(os.listdir("/proc/self/fd")) - base.get("fds", 0))
        fds_threads["threads"] = max(0, _threads() - base.get("threads", 0))
    finally:
        for info in await node.sandbox_list():
            await node.sandbox_destroy(info.id)
        await node.close()
    found = await settled_scan(opts)
    by_kind = {k: len(v) for k, v in found.items()}
    by_kind.update(view)
    by_kind.update(fds_threads)
    first = [t for t in create_s[:tenth] if t is not None]
    last = [t for t in create_s[-tenth:] if t is not None]
    p_first = summary_ms(first) if first else {}
    p_last = summary_ms(last) if last else {}
    early, late = samples.get(2, (0, 0)), samples.get(max(samples, default=0), (0, 0))
    return {
        "scenario": "soak",
        "cycles": cycles,
        "concurrency": concurrency,
        "retention": retention,
        "errors": len(errors),
        "leaks": by_kind,
        "leaked_total": sum(by_kind.values()),
        "rss_growth": _growth(early[0], late[0]),
        "db_growth": _growth(early[1], late[1]),
        "p99_ratio_last_first": round(p_last["p99_ms"] / p_first["p99_ms"], 3)
        if p_first.get("p99_ms") and p_last
        else None,
        "create_p99_ms_first": p_first.get("p99_ms"),
        "create_p99_ms_last": p_last.get("p99_ms"),
        "rss_mib": {k: round(v[0] / 2**20, 1) for k, v in sorted(samples.items())},
        "db_kib": {k: round(v[1] / 1024, 1) for k, v in sorted(samples.items())},
        "shells": shells,
        "networked": len(net_keys),
        "wall_s": round(wall, 1),
        "cycles_per_s": round(cycles / wall, 2) if wall else None,
        "error_examples": errors[:10],
        "image": image.info.name,
    }
