"""Find what corral may have left on the host: mounts, cgroups, loop devices, runtime
containers, network namespaces, processes.

Used by the test suite's session check, by ``corral bench density`` (leftovers) and by
``corral node status``. Reads only; removing is ``corral node gc``'s job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from corral.host.cgroups import latency_root_of
from corral.host.fdstore import holder_socket

__all__ = ["fd_holders", "scan", "total"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _mounts(prefixes: list[Path]) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if any(mp == str(p) or mp.startswith(str(p) + "/") for p in prefixes):
                out.append(mp)
    return out


def _cgroups(subtree: str) -> list[str]:
    out: list[str] = []
    if not _CGROUP_ROOT.is_dir():
        return out
    for base in [_CGROUP_ROOT, *[p for p in _CGROUP_ROOT.iterdir() if p.is_dir()]]:
        for d in (base / subtree, base / latency_root_of(subtree)):
            if d.is_dir():
                for child in d.iterdir():
                    if child.is_dir():
                        out.append(str(child))
                out.append(str(d))
    return sorted(set(out))


def _loops(prefixes: list[Path]) -> list[str]:
    out = []
    block = Path("/sys/block")
    for dev in block.glob("loop*"):
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        # A prefix is a directory: /var/lib/corral must not claim /var/lib/corral-test's.
        if any(backing.startswith(str(p) + "/") for p in prefixes):
            out.append(f"/dev/{dev.name} -> {backing}")
    return out


def _containers(runtime_roots: list[Path]) -> list[str]:
    """State of an OCI runtime's containers (a dir each) and corral-launch's records (a
    file each, host/launch.py; ``.``-names are half-written ones)."""
    out = []
    for root in runtime_roots:
        if root.is_dir():
            for d in root.iterdir():
                if root.name == "launch":
                    if d.is_file() and not d.name.startswith("."):
                        out.append(f"launch:{d.name}")
                elif (d / "state.json").exists() or (d / "status").exists():
                    out.append(f"{root.name}:{d.name}")
    return out


def _netns(prefix: str) -> list[str]:
    d = Path("/run/netns")
    return sorted(p.name for p in d.iterdir() if p.name.startswith(prefix)) if d.is_dir() else []


def _procs(subtree: str) -> list[str]:
    """Processes whose cgroup (any hierarchy) lies in corral's subtree."""
    out = []
    needles = (f"/{subtree}/", f"/{latency_root_of(subtree)}/")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                cg = f.read()
        except OSError:
            continue
        if any(n in cg for n in needles) and not _zombie(pid):
            out.append(pid)
    return out


def fd_holders(run_dirs: list[Path] | None = None) -> list[str]:
    """Seccomp fd holders (``corral-fdstore``, host/fdstore.py) of these run dirs (None:
    of any), as ``PID SOCKET``; one outlives its node only while it keeps fds of sandboxes."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        sock = holder_socket(int(pid))
        if sock is None:
            continue
        if run_dirs is None or any(sock.startswith(str(d) + "/") for d in run_dirs):
            if not _zombie(pid):
                out.append(f"{pid} {sock}")
    return out


def _swap(state_dir: Path, prefixes: list[Path]) -> list[str]:
    """Swap areas on: a file below corral's dirs, or a zram device the node recorded."""
    try:
        with open("/proc/swaps") as f:
            on = [ln.split()[0] for ln in list(f)[1:]]
    except OSError:
        return []
    recorded: set[str] = set()
    try:
        recorded = {d["path"] for d in json.loads((state_dir / "swap.json").read_text())}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    out = []
    for path in on:
        if any(path.startswith(str(p) + "/") for p in prefixes):
            out.append(path)
        elif path in recorded:
            out.append(f"{path} (recorded in {state_dir / 'swap.json'})")
    return out


def _zombie(pid: str) -> bool:
    """A zombie is dead and holds nothing but its pid until its parent (after a sandbox
    destroy: the host's init, which reaps in its own time) collects it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def scan(
    state_dir: Path, run_dir: Path, subtree: str = "corral", netns_prefix: str = "corral-"
) -> dict[str, list[str]]:
    """Everything of corral's on this host, by kind."""
    prefixes = [state_dir, run_dir]
    return {
        "mounts": _mounts(prefixes),
        "cgroups": _cgroups(subtree),
        "loop_devices": _loops(prefixes),
        "containers": _containers([run_dir / "runc", run_dir / "crun", run_dir / "launch"]),
        "netns": _netns(netns_prefix),
        "processes": _procs(subtree),
        "fd_holders": fd_holders([run_dir]),
        "swap": _swap(state_dir, prefixes),
    }


def total(found: dict[str, list[str]]) -> int:
    return sum(len(v) for v in found.values())


if __name__ == "__main__":  # pragma: no cover - manual aid
    print(json.dumps(scan(Path("/var/lib/corral"), Path("/run/corral")), indent=2))
