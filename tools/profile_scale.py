#!/usr/bin/env python3
"""Profile what grows with the live count: ``bench scale`` under ``perf record -a -g``.

Runs ``corral bench scale`` (an embedded node, sandboxes created in windows and kept
alive) under a system-wide ``perf record`` on the ``cpu-clock`` event (a sample is
1/FREQ s of CPU, whatever the CPU model), with CLOCK_MONOTONIC timestamps so that the
bench's own window marks (``windows[i].mono_s``) cut the samples to one window. Then,
for the first and the last window, it attributes every sample to a group by process:

- ``node``: the bench process (the embedded node and its client, every thread);
- ``launch``: its descendants named corral-launch (and any other non-sandbox child);
- ``sandbox``: its descendants that became sandbox processes (corral-init and below);
- ``kthread``: kernel threads (kworker, ksoftirqd, rcu, btrfs-*...): work queued by
  anyone, the node's share not separable; shown, not charged per create;
- ``other``: everything else on the host (other engineers' work), ignored.

and prints, per group, CPU ms per create, and per kernel/user symbol the ms per create
(inclusive: the symbol anywhere in the stack; self: the leaf) in the first and the last
window, sorted by growth. Compare ms per create, not wall rates: the host is shared.
``--phase exec`` cuts out the exec probes instead (one sandbox alive vs all: ms per
exec), ``--phase destroy`` the destroy of all of them (in two halves by time, sorted by
the biggest cost: ms per destroy); one recording serves all three.

Example (root; takes about as long as the bench plus a minute of ``perf script``)::

    PYTHONPATH=src python tools/profile_scale.py --count 3200 --window 400 --out /tmp/prof
    PYTHONPATH=src python tools/profile_scale.py --report /tmp/prof   # re-read a run
    PYTHONPATH=src python tools/profile_scale.py --report /tmp/prof --phase destroy

Nothing is left behind but OUT (perf.data, result.json, report-PHASE.txt); the bench itself
checks the host for leftovers.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

FREQ = 499
_FORK = re.compile(r"PERF_RECORD_FORK\((\d+):(\d+)\):\((\d+):(\d+)\)")
_COMM = re.compile(r"PERF_RECORD_COMM(?: exec)?: (.*?):(\d+)/(\d+)")
_HEAD = re.compile(r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s")
_KTHREAD = re.compile(
    r"^(kworker|ksoftirqd|rcu|migration|kswapd|khugepaged|btrfs|kcompactd|jbd2|"
    r"loop\d|irq/|kthreadd|cpuhp|idle_inject|oom_reaper|writeback|kauditd|khungtaskd|"
    r"scsi|dio/|ext4|xfs|kblockd|md|watchdog|kintegrityd|ksmd|swapper)"
)


def run(args: argparse.Namespace, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag
    bench = [
        sys.executable,
        "-m",
        "corral.cli.app",
        "bench",
        "scale",
        "--count",
        str(args.count),
        "--window",
        str(args.window),
        "--json",
        "--state-dir",
        f"/var/lib/corral-bench-{tag}",
        "--run-dir",
        f"/run/corral-bench-{tag}",
        "--cgroup-subtree",
        f"corral-bench-{tag}",
    ]
    if args.image:
        bench += ["--image", args.image]
    if args.store:
        bench += ["--store", str(args.store)]
    perf = [
        "perf",
        "record",
        "-a",
        "-g",
        "-e",
        "cpu-clock",
        "-F",
        str(FREQ),
        "-k",
        "CLOCK_MONOTONIC",
        "-o",
        str(out / "perf.data"),
        "--",
        "sh",
        "-c",
        'echo $$ > "$0"; exec "$@"',  # the bench's pid (sh execs it: same pid)
        str(out / "bench.pid"),
        *bench,
    ]
    (out / "load.txt").write_text(Path("/proc/loadavg").read_text())
    with open(out / "result.json", "w") as res, open(out / "bench.err", "w") as err:
        rc = subprocess.call(perf, stdout=res, stderr=err)
    with open(out / "load.txt", "a") as f:
        f.write(Path("/proc/loadavg").read_text())
    if rc != 0:
        sys.exit(f"perf record / bench failed ({rc}); see {out / 'bench.err'}")


def _script(out: Path, t0: float, t1: float) -> list[str]:
    cmd = ["perf", "script", "-i", str(out / "perf.data"), "--time", f"{t0:.6f},{t1:.6f}"]
    cmd += ["-F", "comm,pid,tid,cpu,time,ip,sym", "--show-task-events"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()


def _tasks(out: Path) -> tuple[dict[int, int], dict[int, str]]:
    """pid -> parent pid and pid -> last comm, from the whole recording's task events."""
    cmd = ["perf", "script", "-i", str(out / "perf.data"), "--show-task-events", "-F", "comm"]
    parent: dict[int, int] = {}
    comm: dict[int, str] = {}
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    for line in p.stdout.splitlines():
        m = _FORK.search(line)
        if m:
            child, cpid = int(m.group(1)), int(m.group(3))
            if child != cpid:
                parent.setdefault(child, cpid)
            continue
        m = _COMM.search(line)
        if m:
            comm[int(m.group(2))] = m.group(1)
    return parent, comm


def _group(pid: int, comm: str, root: int, parent: dict[int, int], names: dict[int, str]) -> str:
    if pid == root:
        return "node"
    p, seen = pid, 0
    chain = []
    while p in parent and seen < 64:
        chain.append(p)
        p = parent[p]
        seen += 1
        if p == root:
            # A descendant: a sandbox process once any ancestor below the node ran
            # corral-init (the launcher's child execs it), else the launcher.
            below = [names.get(q, "") for q in chain]
            return "sandbox" if any("init" in n for n in below) or "init" in comm else "launch"
    if pid == 0:
        return "idle"
    if _KTHREAD.match(comm):
        return "kthread"
    return "other"


def _samples(lines: list[str]):
    """(comm, pid, [symbols leaf first]) per sample."""
    head = None
    stack: list[str] = []
    for line in lines + [""]:
        if not line.strip():
            if head is not None:
                yield head[0], head[1], stack
            head, stack = None, []
            continue
        if head is None:
            m = _HEAD.match(line)
            if m and "PERF_RECORD" not in line:
                head = (m.group(1), int(m.group(2)))
            continue
        parts = line.split(None, 1)
        sym = parts[1] if len(parts) > 1 else parts[0]
        sym = re.sub(r"\+0x[0-9a-f]+$", "", sym.strip())
        stack.append(sym)


def _cuts(result: dict, phase: str) -> list[tuple[str, float, float, int, dict]]:
    """The spans to compare, as (label, t0, t1, ops, window): for ``create``, the first
    and the last window's creates; for ``exec``, the probes with one sandbox alive and
    with all of them (``exec_mono_s``); for ``destroy``, the first and the second half of
    the destroy of all of them (split by time: ops counted pro rata)."""
    windows = result["windows"]
    if phase == "create":
        last = len(windows) - 1
        prev = windows[last - 1]["live"] if last else 0
        return [
            ("first", *windows[0]["mono_s"], windows[0]["live"], windows[0]),
            ("last", *windows[-1]["mono_s"], windows[-1]["live"] - prev, windows[-1]),
        ]
    if phase == "exec":
        n = 100  # corral.bench.scale.EXEC_SAMPLES (kept import-free: runs from any tree)
        empty = {"live": 1, "create_per_s": None, "exec_p50_ms": result["exec_p50_ms_empty"]}
        return [
            ("empty", *result["exec_empty_mono_s"], n, empty),
            ("full", *windows[-1]["exec_mono_s"], min(n, windows[-1]["live"]), windows[-1]),
        ]
    t0, t1 = result["destroy_mono_s"]
    half = windows[-1]["live"] / 2
    mid = (t0 + t1) / 2
    w = {"live": windows[-1]["live"], "create_per_s": result.get("destroy_per_s")}
    return [("first-half", t0, mid, int(half), w), ("second-half", mid, t1, int(half), w)]


def analyse(out: Path, top: int, phase: str = "create") -> str:
    result = json.loads((out / "result.json").read_text().strip().splitlines()[-1])
    parent, names = _tasks(out)
    root = int((out / "bench.pid").read_text())
    per: dict[str, dict] = {}
    cuts = _cuts(result, phase)
    for label, t0, t1, ops, w in cuts:
        groups: collections.Counter[str] = collections.Counter()
        incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        leaf: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for comm, pid, stack in _samples(_script(out, t0, t1)):
            g = _group(pid, comm, root, parent, names)
            groups[g] += 1
            if g in ("other", "idle"):
                continue
            key = "ours" if g in ("node", "launch", "sandbox") else g
            if stack:
                leaf[key][stack[0]] += 1
            for s in set(stack):
                incl[key][s] += 1
        per[label] = {
            "creates": ops,
            "wall_s": t1 - t0,
            "groups": groups,
            "incl": incl,
            "leaf": leaf,
            "live": w["live"],
            "cpu": w.get("cpu_ms_per_create") if phase == "create" else None,
            "rate": w.get("create_per_s") if phase != "exec" else w.get("exec_p50_ms"),
        }
    a_label, b_label = cuts[0][0], cuts[1][0]
    ms = lambda n, label: 1000.0 * n / FREQ / max(per[label]["creates"], 1)  # noqa: E731
    load = (out / "load.txt").read_text().split()
    lines = [f"load average (before, after): {load[:3]}, {load[5:8]}; phase {phase}"]
    unit = {"create": "create", "exec": "exec", "destroy": "destroy"}[phase]
    for label in (a_label, b_label):
        p = per[label]
        rate = f"p50 {p['rate']} ms" if phase == "exec" else f"{p['rate']}/s"
        lines.append(
            f"{label}: live {p['live']}, {p['creates']} {unit}s in {p['wall_s']:.1f}s "
            f"({rate}), bench CpuMeter {p['cpu']}"
        )
        lines.append(
            f"  ms CPU per {unit} by group: "
            + ", ".join(f"{g} {ms(n, label):.2f}" for g, n in sorted(p["groups"].items()))
        )
    for key in ("ours", "kthread"):
        for kind in ("incl", "leaf"):
            a, b = per[a_label][kind][key], per[b_label][kind][key]
            syms = set(a) | set(b)
            if phase == "destroy":  # one phase in two halves: the biggest, not the growth
                order = lambda s: ms(a[s], a_label) + ms(b[s], b_label)  # noqa: E731
                what = "top total"
            else:
                order = lambda s: ms(b[s], b_label) - ms(a[s], a_label)  # noqa: E731
                what = "top growth"
            rows = sorted(syms, key=order, reverse=True)
            lines.append(f"\n{key}: {kind} ms per {unit}, {a_label} -> {b_label} ({what})")
            for s in rows[:top]:
                lines.append(
                    f"  {ms(a[s], a_label):7.3f} -> {ms(b[s], b_label):7.3f}  "
                    f"(+{ms(b[s], b_label) - ms(a[s], a_label):.3f})  {s}"
                )
    text = "\n".join(lines) + "\n"
    (out / f"report-{phase}.txt").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=3200)
    ap.add_argument("--window", type=int, default=400)
    ap.add_argument("--image", default=None)
    ap.add_argument("--tag", default="prof", help="bench state/run dir and cgroup suffix")
    ap.add_argument("--store", type=Path, help="an image store to share between tags")
    ap.add_argument("--out", type=Path, default=Path("/tmp/corral-profile"))
    ap.add_argument("--report", type=Path, help="only analyse an earlier --out")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--phase",
        choices=("create", "exec", "destroy"),
        default="create",
        help="what to cut out: the first/last window's creates, the exec probes at one and "
        "at all sandboxes alive, or the destroy of all (its two halves)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (the bench node and perf -a need it)")
    out = args.report or args.out
    if args.report is None:
        run(args, out)
    print(analyse(out, args.top, args.phase))


if __name__ == "__main__":
    main()
