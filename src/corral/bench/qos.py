"""``corral bench qos``: exec round trip of a latency-class sandbox while other sandboxes
burn every CPU, with QoS (they are best effort) and without (they are latency class too).

Three phases, each ``count`` sequential ``exec true`` on the same latency-class sandbox:
idle (no burners), loaded (burners best effort: SCHED_IDLE in idle cgroups) and loaded
without QoS (as many burners created as ``qos="latency"``: normal weight, SCHED_OTHER). Each burner sandbox runs one busy loop per CPU; there are 2 per CPU by default.
The machine is shared and its load drifts, so the phases are interleaved in rounds of 50
execs: both burner sets exist all along and the ones not in use are paused (frozen).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from corral.bench.scenarios import BenchOptions, header, prepared, say
from corral.bench.stats import summary_ms
from corral.sdk import AsyncClient, Sandbox
from corral.spec import ImageInfo

__all__ = ["qos"]

_BURN = ["sh", "-c", "while :; do :; done"]
_ROUND = 50


async def _round_trips(sb: Sandbox, n: int) -> list[float]:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await sb.exec(["true"])
        lat.append(time.perf_counter() - t0)
        if not r.ok:
            raise RuntimeError(f"exec true failed in {sb.id}: {r.reason}")
    return lat


async def _burners(
    client: AsyncClient, img: ImageInfo, n: int, qos: str, sbs: list[Sandbox]
) -> None:
    """Create ``n`` busy sandboxes of class ``qos`` into ``sbs`` (so a failure half-way
    leaves them where the caller destroys them)."""
    cpus = os.cpu_count() or 1
    for _ in range(n):
        sb = await client.sandboxes.create(
            image=img,
            qos=qos,
            limits={"cpus": cpus, "memory": "64MiB", "disk": "16MiB"},
            labels={"corral-bench": "qos-burner"},
        )
        sbs.append(sb)
        for _ in range(cpus):
            await sb.spawn(_BURN)


async def qos(opts: BenchOptions, count: int, burners: int = 0) -> dict[str, Any]:
    """The ``qos`` scenario (see the module docstring)."""
    n = burners or 2 * (os.cpu_count() or 1)
    rounds = max(1, count // _ROUND)
    async with prepared(opts) as p:
        out = header("qos", p, count=rounds * _ROUND, burners=n, rounds=rounds)
        async with AsyncClient(config=opts.node_config()) as client:
            img = await client.images.get(p.image.info.name)
            lat = await client.sandboxes.create(
                image=img, qos="latency", labels={"corral-bench": "qos"}
            )
            sets: dict[str, list[Sandbox]] = {}
            lats: dict[str, list[float]] = {"idle": [], "loaded": [], "loaded_noqos": []}
            try:
                for name, cls in (("loaded", "best_effort"), ("loaded_noqos", "latency")):
                    sets[name] = []
                    await _burners(client, img, n, cls, sets[name])
                    await asyncio.gather(*(s.pause() for s in sets[name]))
                await _round_trips(lat, 5)
                say(f"{rounds} rounds of {_ROUND} execs per phase: idle, loaded, loaded_noqos")
                for _ in range(rounds):
                    for phase in lats:
                        burning = sets.get(phase, [])
                        await asyncio.gather(*(s.resume() for s in burning))
                        await asyncio.sleep(0.3)  # let the load settle
                        try:
                            lats[phase] += await _round_trips(lat, _ROUND)
                        finally:
                            await asyncio.gather(*(s.pause() for s in burning))
            finally:
                every = [lat, *(s for group in sets.values() for s in group)]
                await asyncio.gather(*(s.destroy() for s in every), return_exceptions=True)
            status = await client.node_status()
        figs = {k: summary_ms(v) for k, v in lats.items()}
        out.update(
            {
                "idle_p50_ms": figs["idle"]["p50_ms"],
                "idle_p99_ms": figs["idle"]["p99_ms"],
                "loaded_p50_ms": figs["loaded"]["p50_ms"],
                "loaded_p99_ms": figs["loaded"]["p99_ms"],
                "loaded_noqos_p50_ms": figs["loaded_noqos"]["p50_ms"],
                "loaded_noqos_p99_ms": figs["loaded_noqos"]["p99_ms"],
                "loaded_vs_idle_p99": round(figs["loaded"]["p99_ms"] / figs["idle"]["p99_ms"], 2),
                "loaded_noqos_vs_idle_p99": round(
                    figs["loaded_noqos"]["p99_ms"] / figs["idle"]["p99_ms"], 2
                ),
                "phases": figs,
                "core_scheduling": status.core_scheduling,
                "core_scheduling_detail": status.qos_detail,
            }
        )
        return out
