"""``corral bench pause``: park N sandboxes holding memory, measure what the kernel released,
resume them through their first exec, and prove their state intact.

Each sandbox runs a holder (perl, part of every Debian base) that reads ``--mem`` bytes of
/dev/urandom into one buffer (incompressible, so zram cannot cheat) and appends a checksum
of the buffer to /tmp/sums at start and on SIGUSR1; a file of random bytes in the writable
layer is hashed too. All N are paused in one job-wide call. Released memory comes from the
kernel's cgroup figures (memory resident before and after), minus what a zram device holds
in RAM for them (its compressed pages). Then, one sandbox after the other: with
``--prefetch`` an explicit ``resume(prefetch=True)`` (``resume_prefetch_ms``); one ``exec
true`` (which resumes it transparently when it is still paused): that latency is
``resume_first_exec``, next to the same exec on a running sandbox in the same run (the
baseline); then the holder checksums its whole buffer again, timing itself
(``touch_after_resume_ms``, next to the same pass over the buffer in RAM at start:
``touch_resident_ms``). So the two modes compare on the same figures: what the resume
costs, and how long the process then takes to get all its memory back. Finally the
checksums and the files' hashes are compared with those taken before the pause.
"""

from __future__ import annotations

import asyncio
import platform
import time
from typing import Any

from corral.bench.scenarios import BenchOptions, header, many, prepared, say
from corral.bench.stats import p50, p99, summary_ms
from corral.errors import SandboxError
from corral.host import swap as swapmod
from corral.sdk import AsyncClient, Sandbox
from corral.spec import Event

__all__ = ["pause"]

MIB = 1 << 20
# Each report line: the buffer's checksum and the ms the pass over it took, timed by the
# holder itself with clock_gettime(CLOCK_MONOTONIC) through perl's syscall builtin
# (Time::HiRes is not in perl-base), so no exec or polling latency is in the figure.
HOLDER = r"""
my $n = $ENV{HOLD_BYTES};
my $nr = $ENV{CLOCK_GETTIME_NR};
sub now { my $ts = "\0" x 16; syscall($nr, 1, $ts) == 0 or die "clock_gettime: $!";
          my ($s, $ns) = unpack("q q", $ts); return $s * 1000 + $ns / 1e6; }
open(my $f, "<", "/dev/urandom") or die "urandom: $!";
my $b = "";
while (length($b) < $n) { read($f, $b, $n - length($b), length($b)) or die "read: $!"; }
sub report { my $t0 = now(); my $sum = unpack("%32N*", $b); my $ms = now() - $t0;
             open(my $o, ">>", "/tmp/sums") or die; printf $o "%s %.3f\n", $sum, $ms; close $o; }
$SIG{USR1} = \&report;
open(my $p, ">", "/tmp/holder.pid") or die; print $p $$; close $p;
report();
while (1) { sleep 3600; }
"""
_LABEL = "corral-bench-pause"
_CLOCK_GETTIME = {"x86_64": 228, "aarch64": 113}[platform.machine()]


async def _sums(sb: Sandbox) -> list[tuple[str, float]]:
    """The holder's reports so far: (checksum, ms the pass over the buffer took)."""
    try:
        text = (await sb.files.read("/tmp/sums")).decode()
    except Exception:
        return []
    return [(w[0], float(w[1])) for w in (ln.split() for ln in text.splitlines()) if len(w) == 2]


async def _setup(sb: Sandbox, mem: int) -> str:
    """Start the holder and write a random file; returns the file's sha256."""
    await sb.files.write("/tmp/holder.pl", HOLDER.encode())
    await sb.spawn(
        ["perl", "/tmp/holder.pl"],
        env={"HOLD_BYTES": str(mem), "CLOCK_GETTIME_NR": str(_CLOCK_GETTIME)},
    )
    r = await sb.exec(
        [
            "sh",
            "-c",
            "mkdir -p /work && head -c 16777216 /dev/urandom > /work/data && sha256sum /work/data",
        ]
    )
    if not r.ok:
        raise SandboxError(f"{sb.id}: writing the data file failed: {r.stderr[:300]!r}")
    deadline = time.monotonic() + 120
    while not await _sums(sb):
        if time.monotonic() > deadline:
            raise SandboxError(f"{sb.id}: the memory holder did not start (is perl there?)")
        await asyncio.sleep(0.1)
    return r.stdout.split()[0].decode()


async def _touch(sb: Sandbox) -> tuple[bool, float, float]:
    """Have the holder pass over its whole buffer again: (checksum as at start, ms of this
    pass, ms of the pass at start, when the buffer was all in RAM)."""
    pid = (await sb.files.read("/tmp/holder.pid")).decode().strip()
    r = await sb.exec(["sh", "-c", f"kill -USR1 {pid}"])
    if not r.ok:
        raise SandboxError(f"{sb.id}: signalling the holder failed: {r.stderr[:300]!r}")
    deadline = time.monotonic() + 300  # it reads its whole buffer back from swap first
    while len(sums := await _sums(sb)) < 2:
        if time.monotonic() > deadline:
            raise SandboxError(f"{sb.id}: the holder did not report after resume")
        await asyncio.sleep(0.02)
    return sums[0][0] == sums[1][0], sums[1][1], sums[0][1]


async def _file_intact(sb: Sandbox, file_sum: str) -> bool:
    r = await sb.exec(["sha256sum", "/work/data"])
    return r.stdout.split()[:1] == [file_sum.encode()]


async def pause(
    opts: BenchOptions,
    count: int,
    mem: int,
    swap_kind: str = "file",
    concurrency: int = 4,
    prefetch: bool = False,
) -> dict[str, Any]:
    """The ``pause`` scenario (see the module docstring); ``prefetch``: resume each sandbox
    with ``resume(prefetch=True)`` before its first exec."""
    cfg = opts.node_config(count)
    cfg = type(cfg).model_validate(
        {
            **cfg.model_dump(),
            "swap": {"kind": swap_kind, "size": count * (mem + 32 * MIB) + 512 * MIB},
        }
    )
    async with prepared(opts) as p:
        out = header("pause", p, count=count, mem_mib=mem // MIB, swap=swap_kind, prefetch=prefetch)
        async with AsyncClient(config=cfg) as client:
            img = await client.images.get(p.image.info.name)
            sbs: list[Sandbox] = []
            sums: dict[str, str] = {}
            try:
                say(f"creating {count} sandboxes holding {mem // MIB} MiB each")

                async def make(i: int) -> None:
                    sb = await client.sandboxes.create(
                        image=img,
                        labels={_LABEL: "1"},
                        limits={"memory": mem + 128 * MIB, "disk": "256MiB"},
                    )
                    sbs.append(sb)
                    sums[sb.id] = await _setup(sb, mem)

                t = await many(count, concurrency, make)
                if t.errors:
                    raise SandboxError(f"setup failed: {t.errors[0]}")
                base = await _exec_latency(sbs[0], 50)
                await asyncio.sleep(1.0)
                before = {sb.id: (await sb.refresh()).memory_resident or 0 for sb in sbs}
                devs = [
                    swapmod.SwapDevice("zram", d, 0)
                    for d in (await client.node_status()).swap
                    if d.startswith("/dev/zram")
                ]
                zram0 = _zram_ram(devs)
                say("pausing all of them in one job-wide call")
                t0 = time.perf_counter()
                paused = await client.sandboxes.pause(labels={_LABEL: "1"})
                job_wall = time.perf_counter() - t0
                infos = [await sb.refresh() for sb in sbs]
                zram1 = _zram_ram(devs)
                ms = []
                for sb in sbs:
                    evs = [e for e in await sb.events() if e.kind == "paused"]
                    if evs:
                        ms.append(float(evs[-1].detail["ms"] or 0))
                total_before = sum(before.values())
                resident = sum(i.memory_resident or 0 for i in infos)
                swapped = sum(i.memory_swapped or 0 for i in infos)
                zram_held = max(0, zram1 - zram0)
                released = total_before - resident - zram_held
                how = "resume(prefetch=True), then first exec" if prefetch else "first exec"
                say(f"{how} on each paused sandbox, then a pass over its memory")
                first: list[float] = []
                resume_pf: list[float] = []
                touch: list[float] = []
                touch_resident: list[float] = []
                intact = True
                for sb in sbs:
                    if prefetch:
                        t1 = time.perf_counter()
                        await sb.resume(prefetch=True)
                        resume_pf.append(time.perf_counter() - t1)
                    t1 = time.perf_counter()
                    r = await sb.exec(["true"])
                    first.append(time.perf_counter() - t1)
                    if not r.ok:
                        raise SandboxError(f"{sb.id}: first exec after pause failed")
                    same, ms_after, ms_resident = await _touch(sb)
                    touch.append(ms_after)
                    touch_resident.append(ms_resident)
                    intact = intact and same
                pf = _prefetch_figures(
                    [await sb.events(kinds=["resumed"]) for sb in sbs] if prefetch else []
                )
                for sb in sbs:
                    intact = intact and await _file_intact(sb, sums[sb.id])
                out.update(
                    {
                        "paused": len(paused),
                        "released_fraction": round(released / total_before, 3)
                        if total_before
                        else 0.0,
                        "pause_ms_p50": round(p50(ms), 1) if ms else None,
                        "pause_ms_p99": round(p99(ms), 1) if ms else None,
                        "pause_job_wall_s": round(job_wall, 3),
                        "resume_first_exec_ms_p50": round(p50(first) * 1000, 2),
                        "resume_first_exec_ms_p99": round(p99(first) * 1000, 2),
                        "exec_running_ms_p50": base["p50_ms"],
                        "exec_running_ms_p99": base["p99_ms"],
                        "resume_first_exec_vs_running_p50": round(
                            p50(first) * 1000 / base["p50_ms"], 2
                        ),
                        "resident_before_mib": round(total_before / MIB, 1),
                        "resident_paused_mib": round(resident / MIB, 1),
                        "swapped_mib": round(swapped / MIB, 1),
                        "zram_ram_mib": round(zram_held / MIB, 1),
                        "state_intact": intact,
                        "prefetch": prefetch,
                        "resume_prefetch_ms_p50": round(p50(resume_pf) * 1000, 2)
                        if resume_pf
                        else None,
                        "resume_prefetch_ms_p99": round(p99(resume_pf) * 1000, 2)
                        if resume_pf
                        else None,
                        "touch_after_resume_ms_p50": round(p50(touch), 1),
                        "touch_after_resume_ms_p99": round(p99(touch), 1),
                        "touch_resident_ms_p50": round(p50(touch_resident), 1),
                        "touch_after_resume_vs_resident_p50": round(
                            p50(touch) / max(p50(touch_resident), 0.001), 2
                        ),
                        **pf,
                    }
                )
            finally:
                await asyncio.gather(*(sb.destroy() for sb in sbs), return_exceptions=True)
        out["swap_left"] = [
            pth for pth in swapmod.active() if pth.startswith(str(opts.state_dir) + "/")
        ]
        return out


def _prefetch_figures(events: list[list[Event]]) -> dict[str, Any]:
    """Sums over the sandboxes' last ``resumed`` events (the node's own prefetch figures)."""
    last = [evs[-1].detail for evs in events if evs and evs[-1].detail.get("prefetch")]
    if not last:
        return {}

    def total(key: str) -> float:
        return sum(float(v) for d in last if isinstance(v := d.get(key), int | float))

    ms = [float(v) for d in last if isinstance(v := d.get("prefetch_ms"), int | float)]
    return {
        "prefetch_node_ms_p50": round(p50(ms), 2) if ms else None,
        "prefetch_advised_mib": round(total("prefetch_bytes") / MIB, 1),
        "prefetch_swapped_before_mib": round(total("swapped_before") / MIB, 1),
        "prefetch_swapped_after_mib": round(total("swapped_after") / MIB, 1),
        "prefetch_errors": int(total("prefetch_errors")),
    }


def _zram_ram(devs: list[swapmod.SwapDevice]) -> int:
    return sum(swapmod.zram_stats(d).get("mem_used", 0) for d in devs)


async def _exec_latency(sb: Sandbox, n: int) -> dict[str, float]:
    for _ in range(3):
        await sb.exec(["true"])
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await sb.exec(["true"])
        lat.append(time.perf_counter() - t0)
    return summary_ms(lat)
