"""A real distributed filesystem for tests and benches: MooseFS behind a slow link.

The layer store "may be a shared filesystem mount"; this module makes one on a single
machine so that claim is exercised, not assumed. Its servers (``mfsmaster`` and one
``mfschunkserver``, from Debian's moosefs packages) run in a network namespace of their
own, joined to this one by a link whose both ends are shaped with ``tc tbf`` (a
bandwidth cap) and, with ``delay_ms``, delayed each way by a userspace delay line
(:mod:`corral.bench.delayline`: this kernel has no ``sch_netem``); without it the link is
a veth and the round trip only the veth's plus the FUSE and MooseFS protocol hops.
``mfsmount`` FUSE-mounts the filesystem here: every
byte a node reads from the store crosses that link, and the link's counters say how many.

Why MooseFS rather than GlusterFS: two daemons with flat config files, no peer probing
or volume creation step, up in well under a second as root on one machine, and its
client handles hard links, rename and flock (what ``LayerStore`` relies on).

Only addresses of the namespace made here (``10.252.<n>.0/24``, unused by the node's
default sandbox subnet 10.213.0.0/16 and by the test hosts' 10.250/10.251) are targets.
:meth:`MooseStore.stop` removes everything :meth:`MooseStore.start` made: the FUSE
mount, the three processes (ended by their pids), the namespace and veth (their qdiscs go
with them) and the data dir.

A work dir belongs to one running store at a time (a lock file beside it, ``<workdir>.lock``,
held from ``start`` to ``stop``): a second ``start`` on it is refused and touches nothing.
Before that lock, a second run on the same state dir took the first run's store away,
since ``start`` first removes what a crashed run left.

Example::

    dfs = MooseStore(Path("/var/tmp/dfs-x"), name="x", subnet=7, rate_mbit=1000)
    dfs.start()
    try:
        store = LayerStore(dfs.mountpoint / "store")
        ...
        print(dfs.link_bytes())   # (bytes node->servers, bytes servers->node)
    finally:
        dfs.stop()
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

from corral.bench import cores
from corral.bench.delayline import DelayLine
from corral.bench.netns_host import NetnsHost, wait_port
from corral.errors import Conflict
from corral.host import pagecache

__all__ = ["MooseStore", "available", "MASTER_PORT", "CHUNK_PORT"]

MASTER_PORT = 9421
CHUNK_PORT = 9422
_EMPTY_METADATA = Path("/var/lib/mfs/metadata.mfs.empty")
_BINARIES = ("mfsmaster", "mfschunkserver", "mfsmount")


def available() -> str | None:
    """None if MooseFS can run here, else why not (for a test's skip reason)."""
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if missing or not _EMPTY_METADATA.exists():
        return (
            f"MooseFS is not installed ({', '.join(missing) or _EMPTY_METADATA}): "
            "apt-get install moosefs-master moosefs-chunkserver moosefs-client"
        )
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse on this machine"
    return None


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, timeout=30)


class MooseStore:
    """A MooseFS master and chunkserver in netns ``corral-dfs-<name>``, mounted at
    ``<workdir>/mnt``; the link shaped to ``rate_mbit`` each way.

    ``readahead_kib``: the client's read-ahead (``mfsreadaheadleng``, with a 1 MiB
    buffer); None keeps MooseFS's default (1 MiB more per read once reads look
    sequential). Measured: reading 16 KiB every 160 KiB of a 30 MiB file pulled all
    30 MiB over the link by default, 3.1 MiB with 64 KiB; ``mfsreadaheadsize=0`` means
    "default", not "off".

    ``delay_ms``: latency added each way (0: a plain veth).

    ``server_cpus``: cores the servers and the delay line's pump run on (None: any), as
    if they were other machines (bench/cores.py). The client, mfsmount, is the node's:
    it runs wherever the process that mounts runs."""

    def __init__(
        self,
        workdir: Path,
        *,
        name: str,
        subnet: int = 0,
        rate_mbit: int = 1000,
        readahead_kib: int | None = None,
        delay_ms: float = 0.0,
        server_cpus: frozenset[int] | None = None,
    ) -> None:
        if not 0 <= subnet <= 255:
            raise ValueError(f"subnet {subnet} must be 0..255 (10.252.<subnet>.0/24)")
        self.workdir = Path(workdir)
        self.mountpoint = self.workdir / "mnt"
        self.rate_mbit = rate_mbit
        self.readahead_kib = readahead_kib
        self.host = NetnsHost(
            ns=f"corral-dfs-{name}",
            veth=f"cdfs{name}"[:15],
            host_ip=f"10.252.{subnet}.1",
            ip=f"10.252.{subnet}.2",
        )
        self.delay_ms = delay_ms
        self.server_cpus = server_cpus
        self._line: DelayLine | None = None
        self._procs: list[subprocess.Popen[bytes]] = []  # master, chunkserver, mount
        self.lock_path = self.workdir.with_name(self.workdir.name + ".lock")
        self._lock_fd: int | None = None

    @property
    def ip(self) -> str:
        """The servers' address (in the namespace)."""
        return self.host.ip

    # ------------------------------------------------------------------ start

    def start(self, timeout: float = 30.0) -> None:
        """Bring the servers up, shape the link and mount; stops what it made on failure."""
        why = available()
        if why:
            raise RuntimeError(why)
        self._claim()
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _claim(self) -> None:
        """Own the work dir until :meth:`stop`: an exclusive lock on :attr:`lock_path`,
        the owner's pid written in it. Refused (Conflict, naming that pid) while another
        store object, in this process or another, owns it. A run that crashed held its lock
        only as long as its process lived."""
        if self._lock_fd is not None:
            return
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise Conflict(
                    f"the MooseFS store in {self.workdir} belongs to a run still going "
                    f"(pid {owner}, lock {self.lock_path}): wait for it to end, or give this "
                    "run another state dir; nothing of the running one was touched"
                ) from None
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its last owner removed that file meanwhile: lock the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _release(self) -> None:
        """Give the work dir up: the lock file goes, then the lock (in that order, so a
        starter that opened the old file finds it gone and takes the new one)."""
        if self._lock_fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock_path)
        os.close(self._lock_fd)
        self._lock_fd = None

    def _start(self, timeout: float) -> None:
        self._teardown()  # what a crashed run left
        w = self.workdir
        for d in ("master", "cs", "chunks", "mnt"):
            (w / d).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_EMPTY_METADATA, w / "master" / "metadata.mfs")
        ip = self.ip
        # One chunkserver: a goal above 1 would leave every chunk "undergoal" forever.
        (w / "exports.cfg").write_text("* / rw,alldirs,maproot=0,mingoal=1,maxgoal=1\n")
        (w / "topology.cfg").write_text("")
        (w / "hdd.cfg").write_text(f"{w / 'chunks'}\n")
        common = "WORKING_USER = root\nWORKING_GROUP = root\nSYSLOG_IDENT = corral-dfs\n"
        (w / "master.cfg").write_text(
            common + f"DATA_PATH = {w / 'master'}\nEXPORTS_FILENAME = {w / 'exports.cfg'}\n"
            f"TOPOLOGY_FILENAME = {w / 'topology.cfg'}\nMATOML_LISTEN_HOST = {ip}\n"
            f"MATOCS_LISTEN_HOST = {ip}\nMATOCL_LISTEN_HOST = {ip}\n"
        )
        (w / "cs.cfg").write_text(
            common + f"DATA_PATH = {w / 'cs'}\nHDD_CONF_FILENAME = {w / 'hdd.cfg'}\n"
            f"MASTER_HOST = {ip}\nCSSERV_LISTEN_HOST = {ip}\nHDD_LEAVE_SPACE_DEFAULT = 256MiB\n"
        )
        if self.delay_ms > 0:
            subprocess.run(["ip", "netns", "add", self.host.ns], check=True, capture_output=True)
            h = self.host
            self._line = DelayLine(
                h.veth, h.ns, h.host_ip, h.ip, self.delay_ms, cpus=self.server_cpus
            )
            self._line.up()
        else:
            self.host.up()
        self._shape()
        self._spawn_in_ns(["mfsmaster", "-c", str(w / "master.cfg"), "-f", "start"], "master")
        if not wait_port(ip, MASTER_PORT, timeout):
            raise RuntimeError(f"mfsmaster did not listen on {ip}:{MASTER_PORT}: see {w}")
        self._spawn_in_ns(["mfschunkserver", "-c", str(w / "cs.cfg"), "-f", "start"], "cs")
        if not wait_port(ip, CHUNK_PORT, timeout):
            raise RuntimeError(f"mfschunkserver did not listen on {ip}:{CHUNK_PORT}: see {w}")
        self.mount(timeout)

    def _spawn_in_ns(self, argv: list[str], log: str) -> None:
        if self.server_cpus is not None:
            argv = cores.taskset(self.server_cpus, argv)
        with open(self.workdir / f"{log}.log", "wb") as out:
            self._procs.append(
                subprocess.Popen(
                    # joins the netns only: no copy of the host's mounts (NetnsHost.spawn)
                    ["nsenter", f"--net=/run/netns/{self.host.ns}", *argv],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )

    def _shape(self) -> None:
        """tbf on both ends: writes leave through the host's veth, reads through the
        namespace's eth0. The burst is ~1 ms of the rate (at least 64 KiB), so the cap
        holds at millisecond scale."""
        burst = max(64 << 10, self.rate_mbit * 125)
        q = ["root", "tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst)]
        q += ["latency", "50ms"]
        _tc("qdisc", "replace", "dev", self.host.veth, *q)
        _tc("-n", self.host.ns, "qdisc", "replace", "dev", "eth0", *q)

    def mount(self, timeout: float = 30.0) -> None:
        """FUSE-mount the filesystem at ``mountpoint`` and wait until the chunkserver's
        space shows (before that, writes fail with ENOSPC)."""
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "mount.log", "wb") as out:
            # Foreground (-f), so the client is our child and is ended by its pid.
            argv = ["mfsmount", "-f", "-H", self.ip, "-o", "mfsioretries=10"]
            if self.readahead_kib is not None:
                argv += ["-o", f"mfsreadaheadsize=1,mfsreadaheadleng={self.readahead_kib << 10}"]
            proc = subprocess.Popen(
                [*argv, str(self.mountpoint)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._procs.append(proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"mfsmount exited {proc.returncode}: see {self.workdir}")
            if self.is_mounted():
                with contextlib.suppress(OSError):
                    st = os.statvfs(self.mountpoint)
                    if st.f_blocks > 0:
                        return
            time.sleep(0.05)
        raise RuntimeError(f"MooseFS at {self.mountpoint} did not come up in {timeout}s")

    def is_mounted(self) -> bool:
        target = str(self.mountpoint)
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4] == target for line in f)

    # ------------------------------------------------------------------ control

    def link_bytes(self) -> tuple[int, int]:
        """(bytes sent to the servers, bytes received from them) on the link so far."""
        stats = Path(f"/sys/class/net/{self.host.veth}/statistics")
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time used so far by the store's processes, which on a test machine share
        its cores with the node under test: ``servers`` (master and chunkserver: another
        machine's in a cluster), ``link`` (the delay line's pump: the network's) and
        ``client`` (mfsmount: the node's own store client)."""
        procs = [p.pid for p in self._procs]
        pump = self._line.pump_pid if self._line is not None else None
        return {
            "servers": sum(_cpu_seconds(pid) for pid in procs[:2]),
            "link": _cpu_seconds(pump) if pump is not None else 0.0,
            "client": sum(_cpu_seconds(pid) for pid in procs[2:]),
        }

    def affinity(self) -> dict[str, list[int]]:
        """The cores each of the store's processes may run on now (its main thread's):
        ``servers`` (master and chunkserver, the union), ``link`` and ``client``; a
        process that has ended is left out."""
        pump = self._line.pump_pid if self._line is not None else None
        groups = {
            "servers": [p.pid for p in self._procs[:2]],
            "link": [pump] if pump is not None else [],
            "client": [p.pid for p in self._procs[2:]],
        }
        out: dict[str, list[int]] = {}
        for name, pids in groups.items():
            seen: set[int] = set()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    seen |= os.sched_getaffinity(pid)
            if seen:
                out[name] = sorted(seen)
        return out

    def drop_server_cache(self) -> None:
        """Evict the chunkserver's chunk files from the page cache (this machine's, which
        the servers share), so reads that cross the link are cold on the server too."""
        for root, _, files in os.walk(self.workdir / "chunks"):
            for name in files:
                with contextlib.suppress(OSError):
                    pagecache.evict(os.path.join(root, name))

    def cut(self) -> None:
        """Make the servers unreachable (the link goes down; nothing is ended)."""
        subprocess.run(["ip", "link", "set", self.host.veth, "down"], check=True, timeout=30)

    def heal(self) -> None:
        """Undo :meth:`cut`: the link and its address back up."""
        subprocess.run(["ip", "link", "set", self.host.veth, "up"], check=True, timeout=30)

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        """Unmount, end the processes by pid, remove the namespace and the data dir; then
        give the work dir up. Only its owner stops a store: an object whose :meth:`start`
        was refused (another run owns the dir) stops nothing."""
        if self._lock_fd is None:
            return
        try:
            self._teardown()
        finally:
            self._release()

    def _teardown(self) -> None:
        if self.mountpoint.exists() and self.is_mounted():
            r = subprocess.run(["umount", str(self.mountpoint)], capture_output=True, timeout=60)
            if r.returncode != 0:  # busy (a test left a file open): detach it
                subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
        # Client first (it has unmounted), then chunkserver, then master.
        for proc in reversed(self._procs):
            _end(proc)
        self._procs.clear()
        if self._line is not None:
            self._line.down()  # ends the pump; its TUN devices and their qdiscs go with it
            self._line = None
        self.host.down()  # deletes the veth pair (or what is left) and with it the qdiscs
        shutil.rmtree(self.workdir, ignore_errors=True)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0 if it is gone)."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def _end(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM (MooseFS daemons save their state and exit), SIGKILL after ``grace``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=30)
