"""The client processes of ``corral bench neighbours``: the probes and the output flood.

Both run in processes of their own, talking to the node's HTTP API as a trainer's would:
a client's work (building requests, parsing answers, decoding 64 MiB of base64) is not
the node's, and in the bench's process it would run on the event loop the node serves
from and be counted against it.

**Probes** (:class:`Probes`): one process, told over its stdin to measure a window of
``seconds``. In it, the API probe (``GET /v1/sandboxes``) and the latency-class
neighbour's ``exec true`` are each *started at a fixed rate* (``hz`` a second, the exec
half a period after the API call), whatever the answers' latency, so an idle window and
an attack window of the same length hold the same number of probes of the same mix. (A
closed loop, the next call once the last has answered, takes fewer samples exactly when
the node is slow, and the slow ones then weigh less in the p99.) At most
:data:`IN_FLIGHT` of a kind are in flight. Each latency is from the call's start to its
answer. The probe process runs at nice -10 (when allowed): it is the instrument, and on
a loaded host its own wait for a CPU (one process more per request than a probe inside
the node's process) showed as the node's latency, in idle windows as in attack ones.

**Flood** (:class:`Flood`): client processes that each ask for ``yes`` with a 64 MiB
``output_limit`` again and again, one exec after the other, until told to stop: the
flood is at full force for the whole window, not only for the first second or two of it
that one exec each lasted. Each answer (truncated at the cap, its bytes, its seconds) is
its evidence. The flood's clients run in SCHED_IDLE (and nice 19 where that is refused):
they stand for a trainer on another machine, and each answer costs its client ~85 MB of
JSON to parse and 64 MiB of base64 to decode (51% of both CPUs in a flood window, perf -a),
CPU that on this host's 2 cores would otherwise be taken from the node and the probes,
which a node does not pay in production. SCHED_IDLE, like the best-effort attacker
itself: a woken task of any other class preempts it at once, where a nice-19 task may
keep its CPU for the rest of its slice.

Example::

    async with Probes(address, neighbour.id, hz=50) as probes:
        w = await probes.window(6.0)      # w.api_s, w.exec_s, w.errors
    flood = await Flood.start(address, attacker.id, clients=2)
    ...
    answers, errors = await flood.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import psutil

__all__ = ["Probes", "Flood", "FloodAnswer", "Window", "PROBE_HZ"]

PROBE_HZ = 50.0
"""API probes and neighbour execs started a second, each (a 6 s window: 300 of each)."""
IN_FLIGHT = 4
"""Probes of one kind in flight at most: a probe due while this many have not answered
waits for one (an overloaded host would otherwise pile up requests without bound, and
every latency would be the pile's, seconds, not the node's). ``late``
says how late probes started against their due time, so a window that could not keep
its rate shows it."""

_PROBE_CLIENT = """
import asyncio, json, os, sys, time
from corral.sdk import AsyncClient

async def window(client, sb, seconds, hz, in_flight):
    lat = {"exec": [], "api": []}
    errors = []
    late = []
    room = {"exec": asyncio.Semaphore(in_flight), "api": asyncio.Semaphore(in_flight)}

    async def one(kind, due):
        async with room[kind]:
            t0 = time.perf_counter()
            late.append(max(0.0, t0 - due))
            await call(kind, t0)

    async def call(kind, t0):
        try:
            if kind == "exec":
                r = await sb.exec(["true"], timeout=30)
                if r.exit_code != 0:
                    errors.append(f"neighbour exec: exit {r.exit_code} {r.reason}")
            else:
                await client.sandboxes.list()
        except Exception as e:
            errors.append(f"{kind}: {type(e).__name__}: {e}"[:300])
        lat[kind].append(time.perf_counter() - t0)

    async def paced(kind, offset):
        tasks = []
        start = time.perf_counter() + offset
        for k in range(max(1, round(seconds * hz))):
            due = start + k / hz
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(kind, due)))
        await asyncio.gather(*tasks)

    await asyncio.gather(paced("api", 0.0), paced("exec", 0.5 / hz))
    return {"exec_s": lat["exec"], "api_s": lat["api"], "errors": errors, "late_s": late}

async def main(address, sandbox_id):
    try:  # the instrument, not the subject: its own CPU starvation is measurement error
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:
        pass
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with AsyncClient(address) as client:
        sb = await client.sandboxes.get(sandbox_id)
        print(json.dumps({"ready": True}), flush=True)
        while line := await reader.readline():
            ask = json.loads(line)
            res = await window(client, sb, ask["seconds"], ask["hz"], ask["in_flight"])
            print(json.dumps(res), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

_FLOOD_CLIENT = """
import asyncio, json, os, sys, time
from corral.sdk import AsyncClient

async def main(address, sandbox_id, timeout):
    # a trainer's process on another machine, not the node's: its CPU (parsing 85 MB of
    # JSON and decoding 64 MiB of base64 per answer) yields to everything on this host
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    try:  # CPU nobody else on this host wants, as the best-effort attacker gets
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass
    loop = asyncio.get_running_loop()
    stop = loop.run_in_executor(None, sys.stdin.read)  # returns at EOF: stop
    async with AsyncClient(address) as client:
        sb = await client.sandboxes.get(sandbox_id)
        while not stop.done():
            t0 = time.perf_counter()
            r = await sb.exec(["yes"], timeout=timeout, output_limit="64MiB")
            s = time.perf_counter() - t0
            print(json.dumps({"truncated": r.truncated, "bytes": len(r.stdout), "seconds": s}),
                  flush=True)
    await stop

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


@dataclass
class Window:
    """Latencies of one measured window."""

    exec_s: list[float] = field(default_factory=list)
    api_s: list[float] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    """How late a 5 ms timer of the agent's event loop fired: the loop held up by
    work in it (or the host's CPUs busy)."""
    errors: list[str] = field(default_factory=list)
    loop_cpu_s: float = 0.0
    """CPU time of the agent's event-loop thread during the window (its own work: the
    host's load inflates it far less than it does latencies)."""
    steal_s: float = 0.0
    """CPU time the hypervisor took from this machine's CPUs during the window (steal in
    /proc/stat, all CPUs): on a virtual machine, a vCPU that wanted to run and did not.
    Nothing in the node can answer faster then; a window with steal shows it."""
    late_s: list[float] = field(default_factory=list)
    """How late each probe started against its due time (the probe process starved of
    CPU, or :data:`IN_FLIGHT` probes still unanswered): the rate held if these stay small
    against the period."""


async def _client(script: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _line(proc: asyncio.subprocess.Process, what: str) -> dict[str, Any]:
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    if not line:
        err = b""
        if proc.stderr is not None:
            err = await proc.stderr.read()
        await proc.wait()
        raise RuntimeError(f"{what} exited {proc.returncode}: {err.decode()[-300:]}")
    out: dict[str, Any] = json.loads(line)
    return out


async def _end(proc: asyncio.subprocess.Process, grace: float) -> None:
    """Close its stdin (its signal to stop) and wait ``grace`` s; then kill it."""
    if proc.stdin is not None:
        with contextlib.suppress(ConnectionError):
            proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def _steal() -> float:
    return float(getattr(psutil.cpu_times(), "steal", 0.0))


class Probes:
    """The probe process (see the module docstring); one window at a time."""

    def __init__(self, address: str, neighbour_id: str, hz: float = PROBE_HZ) -> None:
        self.address, self.neighbour_id, self.hz = address, neighbour_id, hz
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Probes:
        self._proc = await _client(_PROBE_CLIENT, self.address, self.neighbour_id)
        await _line(self._proc, "the probe process")  # {"ready": true}
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is not None:
            await _end(self._proc, 30)

    async def window(self, seconds: float) -> Window:
        """Probe for ``seconds``; meanwhile time this loop's 5 ms timer (``lag_s``)."""
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise RuntimeError("use Probes inside `async with`")
        ask = {"seconds": seconds, "hz": self.hz, "in_flight": IN_FLIGHT}
        proc.stdin.write(json.dumps(ask).encode() + b"\n")
        await proc.stdin.drain()
        answer = asyncio.create_task(_line(proc, "the probe process"))
        lag: list[float] = []
        loop = asyncio.get_running_loop()
        cpu0 = time.thread_time()
        steal0 = _steal()
        while not answer.done():
            t0 = loop.time()
            await asyncio.sleep(0.005)
            lag.append(max(0.0, loop.time() - t0 - 0.005))
        got = await answer
        cpu = time.thread_time() - cpu0
        return Window(
            loop_cpu_s=cpu,
            steal_s=_steal() - steal0,
            exec_s=got["exec_s"],
            api_s=got["api_s"],
            lag_s=lag,
            errors=got["errors"],
            late_s=got["late_s"],
        )


@dataclass
class FloodAnswer:
    truncated: bool
    bytes: int
    seconds: float
    """The exec call as its client saw it: request to the last byte of its answer."""


class Flood:
    """``clients`` processes, each flooding execs of ``yes`` back to back until stopped."""

    def __init__(self, procs: list[asyncio.subprocess.Process]) -> None:
        self._procs = procs

    @classmethod
    async def start(cls, address: str, sandbox_id: str, clients: int, timeout: float) -> Flood:
        """``timeout``: each exec's own (the node caps the output long before, unless a
        saturated host never lets the best-effort attacker write it)."""
        procs = []
        try:
            for _ in range(clients):
                procs.append(await _client(_FLOOD_CLIENT, address, sandbox_id, str(timeout)))
        except BaseException:
            for p in procs:
                await _end(p, 0)
            raise
        return cls(procs)

    async def stop(self, grace: float) -> tuple[list[FloodAnswer], list[str]]:
        """Stop asking for more; each client finishes the exec it is in (up to ``grace``
        s). Returns every flood's answer and why a client failed, if one did."""
        for p in self._procs:
            if p.stdin is not None:
                with contextlib.suppress(ConnectionError):
                    p.stdin.close()
        answers: list[FloodAnswer] = []
        errors: list[str] = []
        for p in self._procs:
            try:
                out, err = await asyncio.wait_for(p.communicate(), grace)
            except TimeoutError:
                await _end(p, 0)
                errors.append(f"flood client still busy {grace:g} s after the window")
                continue
            answers += [FloodAnswer(**json.loads(ln)) for ln in out.decode().splitlines() if ln]
            if p.returncode != 0:
                errors.append(f"flood client exited {p.returncode}: {err.decode()[-300:]}")
        return answers, errors

    async def kill(self) -> None:
        for p in self._procs:
            if p.returncode is None:
                await _end(p, 0)
