"""``corral bench neighbours``: one sandbox attacks the node while a latency-class neighbour
keeps working; does the neighbour (and the node's API) notice, and is anyone harmed?

Three sandboxes besides the attacker, on one embedded node. Every call goes through the
node's HTTP API on a unix socket (the server runs in the agent's process, as ``corral node
serve`` does), from client processes of their own (bench/neighbours_probe.py).

- the **neighbour** (``qos="latency"``) gets ``exec true`` and the node's API a sandbox
  list, each started at a fixed rate (``probe_hz``) by the probe process: every window
  holds the same number of probes of the same mix. Before each attack an idle window of
  the same length is measured, and the attack's p99 is compared with that one (the
  machine's load drifts; ``idle`` also pools all idle windows). Each window reports
  ``n``, p50 and p99 of both probes, ``loop_lag`` (how late a 5 ms timer of the
  agent's event loop fired) and ``steal_ms`` (CPU time the hypervisor took from this
  virtual machine in the window: a latency no node can avoid);
- the **bystander** (best effort, like the attacker) holds a file of random bytes and a
  background ``sleep``: after each attack, still inside its window, it must still read its
  file back unchanged, find its ``sleep`` alive, and be able to fork, open files, make an
  inotify instance, allocate memory and write to its disk. That is the harm check: an
  attack that exhausts a shared kernel pool (per-user inotify instances, pids, fds, the
  scratch filesystem) shows up there.

Each attack runs in a fresh best-effort sandbox of its own with bounded limits, is at
full strength (its readiness signal, ``bit``) before its window of ``seconds`` starts, and
is destroyed after it (``destroy_s``: how long that took). The attacks: fork bomb, memory
bomb (allocate until OOM, again and again), disk fill (``yes > file``), output flood (two
client processes each asking for ``yes`` with a 64 MiB cap, one exec after the other for
the whole window; ``floods`` and ``flood_s``: each exec as its client saw it; the node
relays the attacker's output at its ``limits.output_rate``, the default unless
``--attacker-output-rate`` says otherwise, reported as ``output_rate``), inotify
exhaustion, fd exhaustion, and a busy loop on every core. The attack scripts use python3
(inotify and fd exhaustion have no shell tool), so the image must have it ('python'
builds one).

At the end the node is closed and the host scanned (host/leaks.py): ``leaked_total``.

Example::

    result = await neighbours(BenchOptions(image="test/debian"), seconds=2.0)
    assert result["harmed"] == 0 and result["leaked_total"] == 0
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from typing import Any

from corral.bench.leftovers import settled_scan
from corral.bench.neighbours_probe import PROBE_HZ, Flood, Probes, Window
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
    "output_flood": "two clients asking, one exec after the other, for `yes` capped at 64 MiB",
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
_FLOOD_TIMEOUT = 120.0
"""Seconds one flooding exec may take (the node stops it at its cap long before)."""


async def _start_attack(sb: Sandbox, name: str, address: str) -> Flood | None:
    """Start attack ``name`` in ``sb``; the flood's client processes (talking to the node's
    API at ``address``) are returned, to be stopped after the window."""
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
        # Each exec is stopped by the node at its cap; the timeout only bounds one that a
        # saturated host (the attacker is best-effort: idle CPU only) never lets finish.
        return await Flood.start(address, sb.id, clients=2, timeout=_FLOOD_TIMEOUT)
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
    return None


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
    probes: Probes,
    kept: tuple[Sandbox, Sandbox, str],
    address: str,
    output_rate: str | None,
) -> tuple[dict[str, Any], Window]:
    neighbour, bystander, digest = kept
    cpus = os.cpu_count() or 1
    rate = {"output_rate": output_rate} if output_rate else {}
    attacker = await client.sandboxes.create(
        image=img,
        qos="best_effort",
        limits={"cpus": cpus, **_ATTACKER_LIMITS, **rate},
        labels={"corral-bench": "neighbours-attacker", "attack": name},
    )
    res: dict[str, Any] = {"name": name}
    flood: Flood | None = None
    try:
        flood = await _start_attack(attacker, name, address)
        t0 = time.perf_counter()
        res["bit"] = await _until_bitten(node, attacker, name)
        res["ramp_s"] = round(time.perf_counter() - t0, 3)
        w = await probes.window(seconds)
        res["harmed"] = await _harm(bystander, neighbour, digest)
        res["effect"] = await _effect(node, attacker)
        if flood is not None:
            # the floods' answers (truncated at the cap) are their evidence: each client
            # ends the exec it is in, then stops
            answers, errors = await flood.stop(grace=_FLOOD_TIMEOUT + 10)
            flood = None
            res["flood_truncated"] = bool(answers) and all(a.truncated for a in answers)
            res["output_rate"] = int(node.table.get(attacker.id).spec.limits.output_rate)
            res["floods"] = len(answers)
            res["flood_s"] = [round(a.seconds, 3) for a in answers]
            if errors:
                res["flood_errors"] = errors
    finally:
        if flood is not None:
            await flood.kill()
        t0 = time.perf_counter()
        try:
            await attacker.destroy()
        except Exception as e:  # noqa: BLE001 - reported; the node's close destroys it
            res["destroy_error"] = f"{type(e).__name__}: {e}"[:300]
        res["destroy_s"] = round(time.perf_counter() - t0, 3)
    with contextlib.suppress(SandboxNotFound):  # gone entirely: as good as destroyed
        if (await attacker.refresh()).state != "destroyed":
            res["harmed"].append("the attacker's sandbox outlived its destroy")
    return res, w


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _figures(w: Window) -> dict[str, Any]:
    """A window's summaries (n, p50, p99, min, max of each probe) and its errors."""
    return {
        "neighbour": summary_ms(w.exec_s) if w.exec_s else None,
        "api": summary_ms(w.api_s) if w.api_s else None,
        "loop_lag": summary_ms(w.lag_s) if w.lag_s else None,
        "loop_cpu_ms": round(w.loop_cpu_s * 1000, 1),
        "steal_ms": round(w.steal_s * 1000, 1),
        "probe_start_late": summary_ms(w.late_s) if w.late_s else None,
        "errors": w.errors[:5],
        "error_count": len(w.errors),
    }


def _p99(fig: dict[str, Any], probe: str) -> float | None:
    return (fig.get(probe) or {}).get("p99_ms")


async def neighbours(
    opts: BenchOptions,
    seconds: float,
    attacks: list[str] | None = None,
    probe_hz: float = PROBE_HZ,
    attacker_output_rate: str | None = None,
) -> dict[str, Any]:
    """The ``neighbours`` scenario (see the module docstring). ``attacker_output_rate``
    (e.g. ``"1TiB"``: unpaced, the node before ``limits.output_rate``) overrides the
    default rate for the attackers."""
    from corral.api.server import NodeServer

    names = attacks or list(ATTACKS)
    for n in names:
        if n not in ATTACKS:
            raise ValueError(f"unknown attack {n!r}; known: {', '.join(ATTACKS)}")
    async with prepared(opts) as p:
        out = header(
            "neighbours",
            p,
            seconds=seconds,
            probe_hz=probe_hz,
            attacker_output_rate=attacker_output_rate,
        )
        results: list[dict[str, Any]] = []
        idle = Window()
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
                probes = await stack.enter_async_context(
                    Probes(srv.address, neighbour.id, probe_hz)
                )
                await probes.window(1.0)  # warm-up
                for name in names:
                    say(f"neighbours: idle {seconds:.1f} s, then attack {name} {seconds:.1f} s")
                    before = await probes.window(seconds)
                    for k in ("exec_s", "api_s", "lag_s", "errors"):
                        getattr(idle, k).extend(getattr(before, k))
                    idle.steal_s += before.steal_s
                    res, w = await _one_attack(
                        node,
                        client,
                        img,
                        name,
                        seconds,
                        probes,
                        (neighbour, bystander, digest),
                        srv.address,
                        attacker_output_rate,
                    )
                    res.update(_figures(w))
                    res["idle"] = _figures(before)
                    for probe, key in (
                        ("neighbour", "neighbour_p99_ratio"),
                        ("api", "api_p99_ratio"),
                    ):
                        res[key] = _ratio(_p99(res, probe), _p99(res["idle"], probe))
                    results.append(res)
            finally:
                await asyncio.gather(
                    neighbour.destroy(), bystander.destroy(), return_exceptions=True
                )
                left = await client.sandboxes.list()
                await asyncio.gather(*(s.destroy() for s in left), return_exceptions=True)
        found = await settled_scan(opts)
    ratios_n = [r["neighbour_p99_ratio"] for r in results if r["neighbour_p99_ratio"]]
    ratios_a = [r["api_p99_ratio"] for r in results if r["api_p99_ratio"]]
    idle_p99_a = [_p99(r["idle"], "api") for r in results]
    out.update(
        {
            "attacks": results,
            "idle": _figures(idle),
            "idle_api_p99_ms_each": idle_p99_a,
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
