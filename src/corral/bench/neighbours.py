"""``corral bench neighbours``: one sandbox attacks the node while a latency-class neighbour
keeps working; does the neighbour (and the node's API) notice, and is anyone harmed?

Three sandboxes besides the attacker, on one embedded node:

Every call goes through the node's HTTP API on a unix socket (the server runs in the
agent's process, as ``corral node serve`` does).

- the **neighbour** (``qos="latency"``) runs ``exec true`` in a loop, while a second loop
  asks the node's API for its sandbox list: their p99 during each attack is compared with
  their p99 when nothing attacks (idle windows interleaved with the attacks, pooled, since
  the machine's own load drifts);
- the **bystander** (best effort, like the attacker) holds a file of random bytes and a
  background ``sleep``: after each attack, still inside its window, it must still read its
  file back unchanged, find its ``sleep`` alive, and be able to fork, open files, make an
  inotify instance, allocate memory and write to its disk. That is the harm check: an
  attack that exhausts a shared kernel pool (per-user inotify instances, pids, fds, the
  scratch filesystem) shows up there.

Each attack runs in a fresh best-effort sandbox of its own with bounded limits for
``seconds`` and is destroyed after it (``destroy_s``: how long that took). The attacks:
fork bomb, memory bomb (allocate until OOM, again and again), disk fill (``yes > file``),
output flood (``yes`` as an exec whose output the node must cap, asked for by two client
processes of their own, as a trainer's would be; ``flood_s``: each exec as its client saw
it), inotify exhaustion, fd
exhaustion, and a busy loop on every core. The attack scripts use python3 (inotify and
fd exhaustion have no shell tool), so the image must have it ('python' builds one).

At the end the node is closed and the host scanned (host/leaks.py): ``leaked_total``.

Example::

    result = await neighbours(BenchOptions(image="test/debian"), seconds=2.0)
    assert result["harmed"] == 0 and result["leaked_total"] == 0
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from corral.bench.leftovers import settled_scan
from corral.bench.scenarios import BenchOptions, header, prepared, say
from corral.bench.stats import summary_ms
from corral.errors import SandboxNotFound
from corral.sdk import AsyncClient, Sandbox
from corral.spec import ImageInfo

__all__ = ["neighbours", "ATTACKS"]

_INOTIFY = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while libc.inotify_init1(0) >= 0:
    n += 1
print("inotify instances", n, "errno", ctypes.get_errno(), flush=True)
time.sleep(3600)
"""
_FDS = """
import os, time
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    print("fds", len(fds), e, flush=True)
time.sleep(3600)
"""
_MEMORY = 'b = []\nwhile True: b.append(b"x" * (16 << 20))\n'

ATTACKS: dict[str, str] = {
    "fork_bomb": "a shell function that forks itself twice, forever (the pids limit stops it)",
    "memory_bomb": "python allocating 16 MiB at a time until the OOM killer ends it, in a loop",
    "disk_fill": "yes > /tmp/fill in a loop (the sandbox's disk quota stops it)",
    "output_flood": "two execs of `yes` whose output the node must cap",
    "inotify": "8 processes each making inotify instances until refused",
    "fds": "8 processes each opening /dev/null until EMFILE",
    "cpu_burn": "a busy loop on every core",
}

_CHECK = """
import ctypes, hashlib, os, sys
libc = ctypes.CDLL(None, use_errno=True)
bad = []
fd = libc.inotify_init1(0)
if fd < 0:
    bad.append("inotify_init1 failed: errno %d" % ctypes.get_errno())
else:
    os.close(fd)
try:
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(200)]
    for f in fds:
        os.close(f)
except OSError as e:
    bad.append("open: %s" % e)
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
except OSError as e:
    bad.append("fork: %s" % e)
try:
    b = bytearray(32 << 20)
    b[::4096] = b"x" * len(b[::4096])
except MemoryError:
    bad.append("could not allocate 32 MiB")
try:
    with open("/tmp/probe", "wb") as f:
        f.write(b"p" * (1 << 20))
    os.remove("/tmp/probe")
except OSError as e:
    bad.append("write: %s" % e)
alive = any(
    open("/proc/%s/cmdline" % p, "rb").read().startswith(b"sleep")
    for p in os.listdir("/proc") if p.isdigit() and os.path.exists("/proc/%s/cmdline" % p)
)
if not alive:
    bad.append("its background sleep is gone")
print(hashlib.sha256(open("/tmp/kept.bin", "rb").read()).hexdigest())
for b_ in bad:
    print("BAD", b_)
"""

_ATTACKER_LIMITS = {"memory": "256MiB", "pids": 256, "disk": "64MiB"}

_FLOOD_CLIENT = """
import asyncio, json, sys, time
from corral.sdk import AsyncClient

async def main(address, sandbox_id, timeout):
    async with AsyncClient(address) as client:
        sb = await client.sandboxes.get(sandbox_id)
        t0 = time.perf_counter()
        r = await sb.exec(["yes"], timeout=timeout, output_limit="64MiB")
        s = time.perf_counter() - t0
        print(json.dumps({"truncated": r.truncated, "bytes": len(r.stdout), "seconds": s}))

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


@dataclass
class _FloodAnswer:
    truncated: bool
    bytes: int
    seconds: float
    """The exec call as its client saw it: request to the last byte of its answer."""


async def _flood(address: str, sandbox_id: str, timeout: float) -> _FloodAnswer:
    """One flooding exec, asked for by a client process of its own: a trainer that
    reads 64 MiB of output decodes it in its own process, not in the agent's; in this
    process its decoding (~0.2 s a flood, on the event loop the node serves from) would
    be counted as the node's latency."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _FLOOD_CLIENT,
        address,
        sandbox_id,
        str(timeout),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"flood client exited {proc.returncode}: {err.decode()[-300:]}")
    return _FloodAnswer(**json.loads(out.decode().strip().splitlines()[-1]))


async def _start_attack(
    sb: Sandbox, name: str, seconds: float, address: str
) -> list[asyncio.Task[Any]]:
    """Start attack ``name`` in ``sb``; the tasks returned are execs running through it
    (the flood's, from client processes talking to the node's API at ``address``)."""
    cpus = os.cpu_count() or 1
    if name == "fork_bomb":
        await sb.spawn(["sh", "-c", "f() { f | f & }; f; sleep 3600"])
    elif name == "memory_bomb":
        await sb.spawn(["sh", "-c", f"while :; do python3 -c '{_MEMORY}'; done"])
    elif name == "disk_fill":
        await sb.spawn(
            ["sh", "-c", "yes > /tmp/fill; while :; do yes >> /tmp/fill; sleep 0.05; done"]
        )
    elif name == "output_flood":
        return [
            # Stopped by the node at its cap; the timeout only bounds a flood that a
            # saturated host (the attacker is best-effort: idle CPU only) never lets finish.
            asyncio.create_task(_flood(address, sb.id, seconds + 120))
            for _ in range(2)
        ]
    elif name == "inotify":
        for _ in range(8):
            await sb.spawn(["python3", "-c", _INOTIFY])
    elif name == "fds":
        for _ in range(8):
            await sb.spawn(["python3", "-c", _FDS])
    elif name == "cpu_burn":
        for _ in range(cpus):
            await sb.spawn(["sh", "-c", "while :; do :; done"])
    else:
        raise ValueError(f"unknown attack {name!r}; known: {', '.join(ATTACKS)}")
    return []


@dataclass
class _Window:
    """Latencies gathered by the two probe loops while ``running`` is set."""

    exec_s: list[float] = field(default_factory=list)
    api_s: list[float] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    """How late a 5 ms timer of the agent's event loop fired: the loop held up by
    work in it (or the host's CPUs busy)."""
    errors: list[str] = field(default_factory=list)


async def _probe(client: AsyncClient, neighbour: Sandbox, seconds: float) -> _Window:
    """The neighbour's exec loop and the API loop, side by side for ``seconds``."""
    w = _Window()
    end = time.monotonic() + seconds

    async def execs() -> None:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                r = await neighbour.exec(["true"], timeout=30)
                if r.exit_code != 0:
                    w.errors.append(f"neighbour exec: exit {r.exit_code} {r.reason}")
            except Exception as e:  # noqa: BLE001 - an error is a finding, not the end
                w.errors.append(f"neighbour exec: {type(e).__name__}: {e}"[:300])
            w.exec_s.append(time.perf_counter() - t0)

    async def api() -> None:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                await client.sandboxes.list()
            except Exception as e:  # noqa: BLE001
                w.errors.append(f"api: {type(e).__name__}: {e}"[:300])
            w.api_s.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)  # a client polling, not a second flood

    async def lag() -> None:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            w.lag_s.append(max(0.0, time.perf_counter() - t0 - 0.005))

    await asyncio.gather(execs(), api(), lag())
    return w


async def _harm(bystander: Sandbox, neighbour: Sandbox, digest: str) -> list[str]:
    """What the attack did to anyone but itself (empty: nothing)."""
    harmed: list[str] = []
    try:
        r = await bystander.exec(["python3", "-c", _CHECK], timeout=60)
        lines = r.stdout.decode(errors="replace").splitlines()
        if r.exit_code != 0 or not lines:
            harmed.append(f"bystander check failed: exit {r.exit_code} {r.stderr[-300:]!r}")
        else:
            if lines[0] != digest:
                harmed.append("bystander's file changed")
            harmed += [f"bystander: {ln[4:]}" for ln in lines[1:] if ln.startswith("BAD ")]
    except Exception as e:  # noqa: BLE001
        harmed.append(f"bystander: {type(e).__name__}: {e}"[:300])
    try:
        r = await neighbour.exec(["sh", "-c", "echo ok"], timeout=30)
        if r.stdout != b"ok\n":
            harmed.append(f"neighbour answered {r.stdout[:100]!r}")
    except Exception as e:  # noqa: BLE001
        harmed.append(f"neighbour: {type(e).__name__}: {e}"[:300])
    return harmed


async def _effect(node: Any, attacker: Sandbox) -> dict[str, Any]:
    """Evidence that the attack bit: the attacker's kernel counters (OOM kills, forks
    refused at its pids limit, bytes on its disk) and how many processes it has."""
    info = node.table.get(attacker.id)
    if info is None:
        return {}
    m = node.life.backend_of(info).meters(attacker.id)
    out: dict[str, Any] = {
        "oom_kills": m.oom_kills,
        "pids_refused": m.pids_refused,
        "memory_resident": m.memory_resident,
        "memory_swapped": m.memory_swapped,
    }
    with contextlib.suppress(Exception):
        out["processes"] = node.cgroups.pids_current(attacker.id)
    with contextlib.suppress(Exception):  # the quota's accounting lags: ask the file
        r = await attacker.exec(["sh", "-c", "cat /tmp/fill 2>/dev/null | wc -c"], timeout=30)
        out["fill_bytes"] = int(r.stdout or 0)
    return out


async def _bitten(node: Any, attacker: Sandbox, name: str) -> bool:
    """Whether attack ``name`` is at full strength: the kernel refused or killed something
    of it, its disk is full, or every one of its processes has exhausted what it took."""
    if name == "fork_bomb":
        return bool((await _effect(node, attacker)).get("pids_refused"))
    if name == "memory_bomb":
        return bool((await _effect(node, attacker)).get("oom_kills"))
    if name == "disk_fill":
        return (await _effect(node, attacker)).get("fill_bytes", 0) >= 32 << 20
    if name in ("inotify", "fds"):
        outs = [(await p.output())[0] for p in await attacker.processes()]
        return sum(1 for o in outs if o) >= 8  # each printed how far it got
    if name == "cpu_burn":
        return (await _effect(node, attacker)).get("processes", 0) > (os.cpu_count() or 1)
    if name == "output_flood":
        # on from its first byte: once an exec of it is in the node (its clients start
        # in processes of their own), or already over, stopped at its cap
        if node.table.busy(attacker.id):
            return True
        return bool(await node.events(sandbox_id=attacker.id, kinds=["output_limit"]))
    return True


async def _until_bitten(node: Any, attacker: Sandbox, name: str, limit: float = 60) -> bool:
    """Wait (up to ``limit`` s) until the attack is at full strength: the readiness
    signal before its window is measured."""
    deadline = time.monotonic() + limit
    while not await _bitten(node, attacker, name):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def _one_attack(
    node: Any,
    client: AsyncClient,
    img: ImageInfo,
    name: str,
    seconds: float,
    probes: tuple[Sandbox, Sandbox, str],
    address: str,
) -> tuple[dict[str, Any], _Window]:
    neighbour, bystander, digest = probes
    cpus = os.cpu_count() or 1
    attacker = await client.sandboxes.create(
        image=img,
        qos="best_effort",
        limits={"cpus": cpus, **_ATTACKER_LIMITS},
        labels={"corral-bench": "neighbours-attacker", "attack": name},
    )
    res: dict[str, Any] = {"name": name}
    execs: list[asyncio.Task[Any]] = []
    try:
        execs = await _start_attack(attacker, name, seconds, address)
        t0 = time.perf_counter()
        res["bit"] = await _until_bitten(node, attacker, name)
        res["ramp_s"] = round(time.perf_counter() - t0, 3)
        w = await _probe(client, neighbour, seconds)
        res["harmed"] = await _harm(bystander, neighbour, digest)
        res["effect"] = await _effect(node, attacker)
        if execs:
            # the flood's answer (truncated at the cap) is its evidence: let it end first
            await asyncio.wait(execs, timeout=seconds + 130)
    finally:
        t0 = time.perf_counter()
        try:
            await attacker.destroy()
        except Exception as e:  # noqa: BLE001 - reported; the node's close destroys it
            res["destroy_error"] = f"{type(e).__name__}: {e}"[:300]
        res["destroy_s"] = round(time.perf_counter() - t0, 3)
        for t in execs:
            try:
                r = await t
                res["flood_truncated"] = bool(r.truncated)
                res.setdefault("flood_s", []).append(round(r.seconds, 3))
            except BaseException as e:  # noqa: BLE001 - reported: why the flood has no answer
                res.setdefault("flood_errors", []).append(f"{type(e).__name__}: {e}"[:300])
    with contextlib.suppress(SandboxNotFound):  # gone entirely: as good as destroyed
        if (await attacker.refresh()).state != "destroyed":
            res["harmed"].append("the attacker's sandbox outlived its destroy")
    return res, w


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


async def neighbours(
    opts: BenchOptions, seconds: float, attacks: list[str] | None = None
) -> dict[str, Any]:
    """The ``neighbours`` scenario (see the module docstring)."""
    from corral.api.server import NodeServer

    names = attacks or list(ATTACKS)
    for n in names:
        if n not in ATTACKS:
            raise ValueError(f"unknown attack {n!r}; known: {', '.join(ATTACKS)}")
    async with prepared(opts) as p:
        out = header("neighbours", p, seconds=seconds)
        results: list[dict[str, Any]] = []
        idle = _Window()
        async with contextlib.AsyncExitStack() as stack:
            embedded = await stack.enter_async_context(AsyncClient(config=opts.node_config()))
            # everything goes over the node's real HTTP API (a unix socket), as a trainer's
            # calls would: the API p99 includes the agent's HTTP stack, not only a method
            opts.run_dir.mkdir(parents=True, exist_ok=True)
            node = await embedded._get_ops()  # the Node: read for attack evidence only
            srv = await stack.enter_async_context(
                NodeServer(node, uds=opts.run_dir / "neighbours.sock")
            )
            client = await stack.enter_async_context(AsyncClient(srv.address))
            img = await client.images.get(p.image.info.name)
            neighbour = await client.sandboxes.create(
                image=img, qos="latency", labels={"corral-bench": "neighbours"}
            )
            bystander = await client.sandboxes.create(
                image=img, qos="best_effort", labels={"corral-bench": "neighbours-bystander"}
            )
            try:
                kept = os.urandom(1 << 20)
                await bystander.files.write("/tmp/kept.bin", kept)
                await bystander.spawn(["sleep", "86400"])
                digest = hashlib.sha256(kept).hexdigest()
                first = await _harm(bystander, neighbour, digest)
                if first:  # the image cannot run the check: say so, do not blame attacks
                    raise RuntimeError(f"the harm check fails before any attack: {first}")
                await _probe(client, neighbour, 1.0)  # warm-up
                for name in names:
                    say(f"neighbours: idle {seconds / 2:.1f} s, then attack {name} {seconds} s")
                    w = await _probe(client, neighbour, seconds / 2)
                    idle.exec_s += w.exec_s
                    idle.api_s += w.api_s
                    idle.lag_s += w.lag_s
                    idle.errors += w.errors
                    res, w = await _one_attack(
                        node,
                        client,
                        img,
                        name,
                        seconds,
                        (neighbour, bystander, digest),
                        srv.address,
                    )
                    res["neighbour"] = summary_ms(w.exec_s) if w.exec_s else None
                    res["api"] = summary_ms(w.api_s) if w.api_s else None
                    res["loop_lag"] = summary_ms(w.lag_s) if w.lag_s else None
                    res["errors"] = w.errors[:5]
                    res["error_count"] = len(w.errors)
                    results.append(res)
            finally:
                await asyncio.gather(
                    neighbour.destroy(), bystander.destroy(), return_exceptions=True
                )
                left = await client.sandboxes.list()
                await asyncio.gather(*(s.destroy() for s in left), return_exceptions=True)
        found = await settled_scan(opts)
    idle_exec = summary_ms(idle.exec_s)
    idle_api = summary_ms(idle.api_s)
    for r in results:
        r["neighbour_p99_ratio"] = _ratio((r["neighbour"] or {}).get("p99_ms"), idle_exec["p99_ms"])
        r["api_p99_ratio"] = _ratio((r["api"] or {}).get("p99_ms"), idle_api["p99_ms"])
    ratios_n = [r["neighbour_p99_ratio"] for r in results if r["neighbour_p99_ratio"]]
    ratios_a = [r["api_p99_ratio"] for r in results if r["api_p99_ratio"]]
    out.update(
        {
            "attacks": results,
            "idle": {
                "neighbour": idle_exec,
                "api": idle_api,
                "loop_lag": summary_ms(idle.lag_s) if idle.lag_s else None,
                "errors": idle.errors[:5],
            },
            "neighbour_p99_ratio_max": max(ratios_n, default=None),
            "api_p99_ratio_max": max(ratios_a, default=None),
            "harmed": sum(len(r["harmed"]) for r in results),
            "probe_errors": sum(r["error_count"] for r in results) + len(idle.errors),
            "leaks": {k: len(v) for k, v in found.items() if v},
            "leaked_total": sum(len(v) for v in found.values()),
            "attack_detail": {n: ATTACKS[n] for n in names},
        }
    )
    return out
