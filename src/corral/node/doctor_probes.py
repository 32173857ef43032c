"""The host that ``corral doctor`` reads (see corral.node.doctor): the probes that are
system calls or commands (:class:`Probes`), a root directory standing for ``/`` (:class:`Host`),
and the small helpers of the checks; tests replace both to run the checks on fake trees.
"""

from __future__ import annotations

import ctypes.util
import fcntl
import os
import re
import resource
import shutil
import sqlite3
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from corral.errors import HostError
from corral.host import criu, fdstore, landlock, leaks, sched
from corral.host.launch import supported as launch_supported
from corral.host.runtime import pick
from corral.node.config import NodeConfig

__all__ = ["Probes", "Host", "Ctx", "node_running"]


def _run_version(binary: str) -> str | None:
    """First line of ``binary --version``; None if it does not run."""
    try:
        p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (p.stdout or p.stderr).strip().splitlines()
    return lines[0].strip() if p.returncode == 0 and lines else None


def _nft_probe() -> str | None:
    """None if libnftables lists the ruleset (read-only), else why not."""
    from corral.host.nft import Nft

    try:
        nft = Nft()
    except HostError as e:
        return e.message
    try:
        nft.run("list tables")
    except HostError as e:
        return e.message
    finally:
        nft.close()
    return None


def _gcc_static() -> str | None:
    """None if gcc can link static programs (libc.a present), else why not."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return "gcc is not installed"
    try:
        p = subprocess.run(
            [gcc, "-print-file-name=libc.a"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"gcc does not run: {e}"
    if not os.path.isabs(p.stdout.strip()):
        return "gcc finds no static C library (libc.a, Debian package libc6-dev)"
    return None


def node_running(state_dir: Path) -> bool:
    """Whether a node holds ``state_dir``'s lock (a flock, see Node.open). A node in this
    very process counts too: flock locks belong to open file descriptions."""
    try:
        fd = os.open(state_dir / "node.lock", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False


def _live_ids(state_dir: Path) -> set[str]:
    """Sandboxes the state database calls live (read-only; empty without a database)."""
    db = state_dir / "state.db"
    if not db.exists():
        return set()
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            rows = con.execute("SELECT id FROM sandboxes WHERE state != 'destroyed'").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return set()
    return {r[0] for r in rows}


def _scan_leftovers(cfg: NodeConfig) -> dict[str, list[str]]:
    """host/leaks.py's scan of this node's dirs and cgroup subtree. Without named network
    namespaces: the node makes none (the runtime's are unnamed), and a ``corral-`` prefix
    would claim other software's and tests' (``corral-test-...``)."""
    found = leaks.scan(cfg.state_dir, cfg.run_dir, cfg.cgroup_subtree, f"{cfg.cgroup_subtree}-")
    found.pop("netns", None)
    return found


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


@dataclass
class Probes:
    """The checks' system calls and commands; tests replace them. Defaults: the real ones."""

    which: Callable[[str], str | None] = shutil.which
    euid: Callable[[], int] = os.geteuid
    landlock: Callable[[], tuple[int, str]] = landlock.support
    core_scheduling: Callable[[], tuple[bool, str]] = sched.core_scheduling
    criu: Callable[[], tuple[bool, str]] = criu.checkpoint_support
    runtime: Callable[[str, str | None], tuple[str, str, bool]] = pick
    launch: Callable[[], str | None] = launch_supported
    version: Callable[[str], str | None] = _run_version
    nft: Callable[[], str | None] = _nft_probe
    gcc: Callable[[], str | None] = _gcc_static
    free_bytes: Callable[[Path], int] = _free_bytes
    nofile: Callable[[], int] = field(default=lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    node_running: Callable[[Path], bool] = node_running
    live_ids: Callable[[Path], set[str]] = _live_ids
    leftovers: Callable[[NodeConfig], dict[str, list[str]]] = _scan_leftovers
    holder_pid: Callable[[Path], int | None] = fdstore.holder_pid
    libnftables: Callable[[], str | None] = field(
        default=lambda: ctypes.util.find_library("nftables")
    )


@dataclass
class Host:
    """Reads of the kernel's files below ``root``."""

    root: Path

    def read(self, rel: str) -> str | None:
        try:
            return (self.root / rel.lstrip("/")).read_text()
        except OSError:
            return None

    def exists(self, rel: str) -> bool:
        return (self.root / rel.lstrip("/")).exists()

    def sysctl(self, name: str) -> int | None:
        text = self.read("proc/sys/" + name.replace(".", "/"))
        try:
            return int(text.split()[0]) if text else None
        except ValueError:
            return None

    def filesystem(self, fstype: str, module: str) -> str | None:
        """How ``fstype`` is available: registered, or a module the kernel can load."""
        text = self.read("proc/filesystems") or ""
        if any(line.split()[-1:] == [fstype] for line in text.splitlines()):
            return "registered"
        release = (self.read("proc/sys/kernel/osrelease") or "").strip()
        pattern = re.compile(rf"(^|/){re.escape(module)}\.ko(\.[a-z]+)?(:|$)", re.M)
        for index in ("modules.builtin", "modules.dep"):
            if pattern.search(self.read(f"lib/modules/{release}/{index}") or ""):
                return "module"
        return None


@dataclass
class Ctx:
    config: NodeConfig
    host: Host
    probes: Probes
