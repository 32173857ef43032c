#!/usr/bin/env python3
"""Tell the host's own cost of many namespaces from corral's: ``bench create`` on an
empty node with N idle processes around it that are not sandboxes.

``bench scale`` grows the live count and watches create and exec slow down. Part of
that can be the host's rather than corral's: on the VMs this project is measured on,
pid 1 is the VM's agent, whose CPU follows the number of processes in network namespaces
of their own (docs/design-notes.md, sessions 19-22). This tool takes corral's sandboxes
out of the picture: for each condition it starts N ``sleep`` processes, waits, measures
pid 1's CPU while they idle, runs ``corral bench create --json`` against a node with no
sandbox alive, then ends them and waits until the cores are idle again (the kernel tears
their namespaces down in a worker after the processes end, which would slow the next
condition's bench).

Conditions:

- ``none``: no extra processes;
- ``netns``: each process in a network namespace of its own (``unshare -n``), as a
  sandbox's init is;
- ``pidmnt``: each in a pid and a mount namespace of its own, sharing the host's network
  namespace (the same count of processes, without the network namespaces).

Prints one JSON object per condition run (its last line, with ``--json``, holds them
all): create/s, p50, p99, the bench's CPU per create (``machine``, ``host_init``: pid 1's
share) and pid 1's share of a core while the processes idled.

Example (root; about two minutes per condition with 3,200 processes)::

    PYTHONPATH=src python tools/host_load.py --count 3200 none netns pidmnt netns none

Ends only the processes it started, by pid; nothing else is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from corral.bench.stats import host_init_s, machine_busy_s

_UNSHARE = {
    "none": None,
    "netns": ["-n"],
    "pidmnt": ["-p", "-m", "--fork", "--kill-child"],
}


def start(cond: str, count: int, procs: list[subprocess.Popen[bytes]]) -> None:
    """Start ``count`` idle processes for ``cond`` into ``procs`` (filled as they start,
    so that a failure part way leaves the caller every one to end)."""
    flags = _UNSHARE[cond]
    if flags is None:
        return
    for _ in range(count):
        procs.append(
            subprocess.Popen(
                ["unshare", *flags, "sleep", "86400"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        )


def _ns(pid: int, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:  # exited (a zombie's links cannot be read)
        return None


def await_unshared(procs: list[subprocess.Popen[bytes]], cond: str, timeout: float) -> int:
    """Wait until every process has left the host's namespace (``unshare`` has run);
    returns how many distinct network namespaces they are in."""
    kind = "net" if cond == "netns" else "mnt"
    host = os.readlink(f"/proc/self/ns/{kind}")
    deadline = time.monotonic() + timeout
    for p in procs:
        while (ns := _ns(p.pid, kind)) is None or ns == host:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args!r} exited {p.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pid {p.pid} still in the host's {kind} namespace")
            time.sleep(0.01)
    return len({_ns(p.pid, "net") for p in procs})


def stop(procs: list[subprocess.Popen[bytes]], timeout: float) -> float:
    """End ``procs`` by pid and wait for the kernel's teardown of their namespaces
    (``cleanup_net`` in a kernel worker, after the processes are gone) to finish: until
    the cores are idle again (under 10% busy over 2 s). Returns the wait."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)  # unshare --kill-child takes its child along
    for p in procs:
        p.wait()
    cores = os.cpu_count() or 1
    t0 = at = time.monotonic()
    busy = machine_busy_s()
    while at - t0 < timeout:
        time.sleep(2)
        busy_now, now = machine_busy_s(), time.monotonic()
        if busy_now - busy < 0.1 * cores * (now - at):
            break
        busy, at = busy_now, now
    return time.monotonic() - t0


def bench(corral: list[str], extra: list[str]) -> dict[str, object]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        rc = subprocess.run([*corral, "bench", "create", "--json", *extra], stdout=out, stderr=err)
        if rc.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"bench create exited {rc.returncode}:\n{tail}")
        out.seek(0)
        result: dict[str, object] = json.loads(out.read().decode().strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("conditions", nargs="+", choices=sorted(_UNSHARE))
    ap.add_argument("--count", type=int, default=3200, help="idle processes per condition")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds before measuring")
    ap.add_argument("--idle-window", type=float, default=10.0, help="seconds pid 1 is timed")
    ap.add_argument("--creates", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--teardown-timeout", type=float, default=600.0, help="most seconds to wait for idle"
    )
    ap.add_argument(
        "--bench-args", default="", help='more options for bench create: --bench-args="--image X"'
    )
    ap.add_argument("--json", action="store_true", help="all runs as one JSON line at the end")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("run as root (the bench starts a node)")
    corral = [sys.executable, "-m", "corral.cli.app"]
    extra = ["--count", str(args.creates), "--concurrency", str(args.concurrency)]
    extra += shlex.split(args.bench_args)
    runs = []
    for cond in args.conditions:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            start(cond, args.count, procs)
            netns = await_unshared(procs, cond, timeout=120) if procs else 0
            time.sleep(args.settle)
            init0 = host_init_s()
            time.sleep(args.idle_window)
            idle = host_init_s() - init0
            result = bench(corral, extra)
        finally:
            waited = stop(procs, timeout=args.teardown_timeout)
        c = result["corral"]
        assert isinstance(c, dict)
        run = {
            "condition": cond,
            "processes": len(procs),
            "network_namespaces": netns,
            "init_cpu_share_idle": round(idle / args.idle_window, 3),
            "per_s": c["per_s"],
            "p50_ms": c["p50_ms"],
            "p99_ms": c["p99_ms"],
            "cpu_ms_per_create": result["cpu_ms_per_create"],
            "teardown_wait_s": round(waited, 1),
        }
        runs.append(run)
        print(json.dumps(run), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps({"scenario": "host_load", "count": args.count, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
