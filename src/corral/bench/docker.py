"""Docker as the side-by-side baseline of ``corral bench ... --vs docker``.

:class:`DockerBaseline` gives the benchmarks a working Docker daemon and leaves the host
as it found it:

- If a daemon already answers ``docker info``, it is used as it is and never stopped;
  only the containers and images this run made are removed.
- Otherwise ``docker.io`` is installed with apt-get when ``dockerd`` is missing, and a
  ``dockerd`` of our own is started as a child process with its data root, exec root and
  socket in bench-only directories (``/var/lib/corral-bench-docker``,
  ``/run/corral-bench-docker``), its containers' cgroups under ``corral-bench-docker``,
  and no iptables, ip forwarding or docker0 bridge (every benchmark container runs with
  ``--network none``, so none of those is on the measured path). On exit it is stopped by
  pid (SIGTERM, then SIGKILL after a grace period) and what it added to the host is
  removed: nft tables ``ip/ip6 filter|nat`` (Docker's FORWARD policy drop lives there),
  the docker0 / br-* links, ``docker`` and ``corral-bench-docker`` cgroups (empty ones,
  deepest first), ``/etc/docker/key.json``, ``/run/docker``, ``/run/containerd``, the
  forwarding sysctls, and its data and exec roots. Only what did not exist before start
  is removed.

Example:
    with DockerBaseline(Path("/var/lib/corral-bench"), Path("/run/corral-bench")) as d:
        image = d.import_rootfs(rootfs_dir, "corral-bench:deb")
        elapsed = asyncio.run(d.timed("run", "--rm", "--network", "none", image, "true"))
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from corral.errors import HostError
from corral.host import mounts

__all__ = ["DockerBaseline", "HostSnapshot", "docker_cli"]

# Tables that iptables-nft creates for dockerd; we delete only these, and only if new.
_DOCKER_NFT_TABLES = {"ip filter", "ip nat", "ip6 filter", "ip6 nat"}
_DOCKER_LINK_RE = re.compile(r"^(docker0|br-[0-9a-f]{12})$")
_SYSCTLS = ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP_PARENT = "corral-bench-docker"
# Files and directories dockerd/containerd create outside the roots we give them.
_STRAY_PATHS = (
    Path("/etc/docker/key.json"),
    Path("/run/docker"),
    Path("/run/containerd"),
    Path("/var/run/docker.sock"),
    Path("/var/run/docker.pid"),
)
_READY_TIMEOUT = 60.0
_STOP_GRACE = 30.0


def _say(msg: str) -> None:
    print(f"[docker] {msg}", file=sys.stderr, flush=True)


def docker_cli() -> str | None:
    """The docker client to use: the distribution's (same version as its dockerd) first."""
    if Path("/usr/bin/docker").exists():
        return "/usr/bin/docker"
    return shutil.which("docker")


def _run(
    argv: list[str], timeout: float = 60, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise HostError(f"{' '.join(argv[:3])} failed: {e}") from None
        return subprocess.CompletedProcess(argv, 127, "", str(e))
    if check and r.returncode != 0:
        raise HostError(f"{' '.join(argv)} failed (exit {r.returncode}): {r.stderr.strip()[:800]}")
    return r


@dataclass
class HostSnapshot:
    """What of Docker's footprint existed on the host at one moment."""

    nft_tables: set[str] = field(default_factory=set)
    links: set[str] = field(default_factory=set)
    cgroups: set[Path] = field(default_factory=set)
    paths: set[Path] = field(default_factory=set)
    sysctls: dict[str, str] = field(default_factory=dict)

    @classmethod
    def take(cls) -> HostSnapshot:
        s = cls()
        r = _run(["nft", "list", "tables"], timeout=15)
        s.nft_tables = {
            ln.removeprefix("table ").strip()
            for ln in r.stdout.splitlines()
            if ln.startswith("table ")
        }
        with contextlib.suppress(OSError):
            s.links = set(os.listdir("/sys/class/net"))
        for ctrl in _cgroup_controllers():
            for name in ("docker", _CGROUP_PARENT):
                if (ctrl / name).is_dir():
                    s.cgroups.add(ctrl / name)
        s.paths = {p for p in _STRAY_PATHS if p.exists() or p.is_symlink()}
        for k in _SYSCTLS:
            with contextlib.suppress(OSError):
                s.sysctls[k] = Path("/proc/sys", k).read_text().strip()
        return s


def _cgroup_controllers() -> list[Path]:
    if not _CGROUP_ROOT.is_dir():
        return []
    if (_CGROUP_ROOT / "cgroup.controllers").exists():  # pure v2: one hierarchy
        return [_CGROUP_ROOT]
    return sorted(p for p in _CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink())


def _rmdir_tree(top: Path) -> list[str]:
    """rmdir a cgroup directory and its children, deepest first; returns what stayed."""
    stuck = []
    for root, dirs, _files in os.walk(top, topdown=False):
        for d in dirs:
            with contextlib.suppress(FileNotFoundError):
                try:
                    os.rmdir(Path(root, d))
                except OSError as e:
                    stuck.append(f"{Path(root, d)}: {e.strerror}")
    try:
        os.rmdir(top)
    except FileNotFoundError:
        pass
    except OSError as e:
        stuck.append(f"{top}: {e.strerror}")
    return stuck


def restore_host(before: HostSnapshot) -> tuple[list[str], list[str]]:
    """Remove Docker's additions made since ``before``. Returns (removed, could_not)."""
    now = HostSnapshot.take()
    removed: list[str] = []
    failed: list[str] = []
    for table in sorted((now.nft_tables - before.nft_tables) & _DOCKER_NFT_TABLES):
        family, name = table.split()
        r = _run(["nft", "delete", "table", family, name], timeout=15)
        (removed if r.returncode == 0 else failed).append(f"nft table {table}")
    for link in sorted(now.links - before.links):
        if _DOCKER_LINK_RE.match(link):
            r = _run(["ip", "link", "delete", link], timeout=15)
            (removed if r.returncode == 0 else failed).append(f"link {link}")
    # The bench's own cgroup parent is ours by name: removed even if a crashed earlier run
    # left it (so it was already in ``before``).
    ours = {cg for cg in now.cgroups if cg.name == _CGROUP_PARENT}
    gone: dict[str, int] = {}
    for cg in sorted((now.cgroups - before.cgroups) | ours):
        stuck = _rmdir_tree(cg)
        if stuck:
            failed.extend(f"cgroup {s}" for s in stuck)
        else:
            gone[cg.name] = gone.get(cg.name, 0) + 1
    removed.extend(f"cgroup {name} in {n} hierarchies" for name, n in sorted(gone.items()))
    for p in sorted(now.paths - before.paths):
        try:
            if p.is_dir() and not p.is_symlink():
                for m in sorted(mounts.mounts_under(p), key=lambda m: -len(m.parts)):
                    mounts.umount(m, detach=True)
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(f"path {p}")
        except (OSError, HostError) as e:
            failed.append(f"path {p}: {e}")
    for key, old in before.sysctls.items():
        if now.sysctls.get(key) not in (None, old):
            try:
                Path("/proc/sys", key).write_text(old)
                removed.append(f"sysctl {key}={now.sysctls[key]} (back to {old})")
            except OSError as e:
                failed.append(f"sysctl {key}: {e}")
    return removed, failed


class DockerBaseline:
    """A Docker daemon for side-by-side figures; see the module docstring for the rules.

    ``state_dir``/``run_dir`` are the bench node's; Docker's own roots are their siblings
    with a ``-docker`` suffix, so corral's leak scan of the bench node never sees them.
    """

    def __init__(self, state_dir: Path, run_dir: Path, install: bool = True) -> None:
        self.data_root = state_dir.with_name(state_dir.name + "-docker")
        self.exec_root = run_dir.with_name(run_dir.name + "-docker")
        self.install = install
        self.owned = False
        """True when this object started the dockerd it talks to."""
        self.cli = ""
        self.env: dict[str, str] = dict(os.environ)
        self.version = ""
        self.run_label = f"corral-bench.run={uuid.uuid4().hex[:12]}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._before: HostSnapshot | None = None
        self._images: list[str] = []
        self._log: Path | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> DockerBaseline:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> DockerBaseline:
        return await asyncio.to_thread(self.__enter__)

    async def __aexit__(self, *exc: object) -> None:
        # Shielded: an interrupted benchmark must still stop the daemon it started.
        await asyncio.shield(asyncio.to_thread(self.stop))

    def start(self) -> None:
        """Find or start a daemon and wait until it answers."""
        cli = docker_cli()
        if cli and self._info(cli, self.env):
            self.cli = cli
            _say(f"using the running Docker daemon ({self.version}); it will be left running")
            return
        if shutil.which("dockerd") is None:
            if not self.install:
                raise HostError("dockerd is not installed (apt-get install docker.io)")
            self._apt_install()
        cli = docker_cli()
        if cli is None:
            raise HostError("docker.io is installed but no docker client was found")
        self.cli = cli
        self._start_dockerd()

    def _info(self, cli: str, env: dict[str, str]) -> bool:
        r = _run([cli, "info", "--format", "{{.ServerVersion}}"], timeout=20, env=env)
        if r.returncode == 0 and r.stdout.strip():
            self.version = r.stdout.strip()
            return True
        return False

    def _apt_install(self) -> None:
        _say("dockerd not found: installing docker.io with apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        argv = ["apt-get", "install", "-y", "-q", "docker.io"]
        r = _run(argv, timeout=900, env=env)
        if r.returncode != 0:
            _run(["apt-get", "update", "-q"], timeout=900, env=env)
            _run(argv, timeout=900, env=env, check=True)

    def _start_dockerd(self) -> None:
        self._stop_stale()
        self._before = HostSnapshot.take()
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.exec_root.mkdir(parents=True, exist_ok=True)
        sock = self.exec_root / "docker.sock"
        self._log = self.data_root / "dockerd.log"
        argv = [
            "dockerd",
            "--data-root",
            str(self.data_root / "data"),
            "--exec-root",
            str(self.exec_root / "exec"),
            "--pidfile",
            str(self.exec_root / "dockerd.pid"),
            "-H",
            f"unix://{sock}",
            # Benchmark containers use --network none: no bridge, NAT or forwarding needed,
            # so the host's firewall and sysctls stay as they are.
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-forward=false",
            f"--cgroup-parent=/{_CGROUP_PARENT}",
        ]
        with open(self._log, "ab") as log:
            # Own session: a Ctrl-C in the terminal reaches us, and we stop dockerd only
            # after removing its containers.
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        self.owned = True
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{sock}"}
        _say(f"started dockerd pid {self._proc.pid} (data root {self.data_root})")
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise HostError(f"dockerd exited with {self._proc.returncode}: {self._log_tail()}")
            if sock.exists() and self._info(self.cli, self.env):
                return
            time.sleep(0.2)
        raise HostError(f"dockerd did not answer within {_READY_TIMEOUT:.0f} s: {self._log_tail()}")

    def _stop_stale(self) -> None:
        """Stop a dockerd that an earlier, killed bench run left on our private roots."""
        pidfile = self.exec_root / "dockerd.pid"
        try:
            pid = int(pidfile.read_text().strip())
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        if str(self.data_root).encode() not in cmd or b"dockerd" not in cmd:
            return
        _say(f"stopping dockerd pid {pid} left by an earlier bench run")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE
        while time.monotonic() < deadline:
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() != cmd:
                    break  # gone (the pid may even be someone else's by now)
            except OSError:
                break
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._unmount_roots()

    def _log_tail(self) -> str:
        if self._log is None or not self._log.exists():
            return "(no log)"
        return self._log.read_text(errors="replace")[-1500:]

    def stop(self) -> None:
        """Remove this run's containers and images; stop and clean up our own dockerd."""
        if self.cli and (not self.owned or (self._proc and self._proc.poll() is None)):
            self._remove_own_objects()
        if not self.owned:
            return
        self.owned = False
        if self._proc is not None:
            self._stop_daemon(self._proc)
            self._proc = None
        self._unmount_roots()
        if self._before is not None:
            removed, failed = restore_host(self._before)
            if removed:
                _say("removed what dockerd added: " + ", ".join(removed))
            for f in failed:
                _say(f"could not remove {f}")
            self._before = None
        for root in (self.exec_root, self.data_root):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(root)

    def _remove_own_objects(self) -> None:
        r = _run(
            [self.cli, "ps", "-aq", "--filter", f"label={self.run_label}"], timeout=60, env=self.env
        )
        ids = r.stdout.split()
        for i in range(0, len(ids), 100):
            _run([self.cli, "rm", "-f", *ids[i : i + 100]], timeout=300, env=self.env)
        if self._images:
            _run([self.cli, "rmi", "-f", *self._images], timeout=120, env=self.env)
            self._images.clear()

    def _stop_daemon(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_GRACE)
            except subprocess.TimeoutExpired:
                _say(f"dockerd pid {proc.pid} ignored SIGTERM for {_STOP_GRACE:.0f} s; killing")
                proc.kill()
                proc.wait(timeout=30)
        # dockerd stops the containerd it started; if it died without doing so, that
        # containerd (recognised by our exec root in its command line) is ours to stop.
        for pid in _pids_with_arg(str(self.exec_root)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _unmount_roots(self) -> None:
        for root in (self.exec_root, self.data_root):
            for m in sorted(mounts.mounts_under(root), key=lambda m: -len(m.parts)):
                with contextlib.suppress(HostError):
                    mounts.umount(m, detach=True)

    # ------------------------------------------------------------------ operations
    def import_rootfs(self, rootfs: Path, tag: str) -> str:
        """``tar -C rootfs -c . | docker import - tag``; the image is removed on exit
        unless it existed before."""
        have = _run([self.cli, "image", "inspect", tag], timeout=30, env=self.env)
        if have.returncode == 0:
            return tag
        tar = subprocess.Popen(
            ["tar", "-C", str(rootfs), "--numeric-owner", "--xattrs", "-cf", "-", "."],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert tar.stdout is not None
        imp = subprocess.run(
            [self.cli, "import", "-", tag],
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=900,
        )
        tar.stdout.close()
        tar_err = tar.stderr.read().decode(errors="replace") if tar.stderr else ""
        tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise HostError(
                f"docker import of {rootfs} failed: {imp.stderr.strip()[:500]} "
                f"{tar_err.strip()[:500]}"
            )
        self._images.append(tag)
        return tag

    def label_args(self) -> list[str]:
        """Arguments that mark a container as this run's (so ``stop`` removes it)."""
        return ["--label", self.run_label]

    async def docker(self, *args: str, timeout: float = 300) -> str:
        """Run one docker CLI command; its stdout, or HostError naming the failure."""
        proc = await asyncio.create_subprocess_exec(
            self.cli,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise HostError(
                f"docker {' '.join(args[:6])} failed (exit {proc.returncode}): "
                f"{err.decode(errors='replace').strip()[:500]}"
            )
        return out.decode()

    async def timed(self, *args: str) -> float:
        """Seconds one docker CLI command took, client start to client exit."""
        t0 = time.perf_counter()
        await self.docker(*args)
        return time.perf_counter() - t0

    def daemon_pids(self) -> list[int]:
        """dockerd, containerd and shim pids serving our containers (for memory figures)."""
        if self._proc is None:
            return []
        return [self._proc.pid, *_descendants(self._proc.pid), *_pids_with_arg(str(self.exec_root))]


def _pids_with_arg(needle: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        if needle.encode() in cmd and b"dockerd" not in cmd.split(b"\0")[0]:
            out.append(int(d))
    return out


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
