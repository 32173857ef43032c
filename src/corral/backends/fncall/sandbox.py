"""One pool sandbox seen from the node: its warm worker's channel and its kernel meters.

The worker is a long-lived exec of the sandbox's init (stdin streamed in ``I`` frames,
stdout back in ``O`` frames), so a call costs the node one write and one read on an open
connection, plus a few ``pread``s of the sandbox's cgroup files: no process is started on
the host per call.

Every figure and verdict that matters is the kernel's, read from the host:
  - cpu_time: the cgroup's CPU usage (cpuacct) across the call,
  - peak_memory: the cgroup's peak (reset before the call) above its usage at the start,
  - memory_limit: the cgroup's OOM-kill counter moved during the call,
  - clean: after the call the cgroup holds only the init and the worker, and the scratch
    tmpfs mounts hold nothing (inode counts by statvfs through the init's root).
One call at a time per sandbox, so the sandbox's cgroup measures exactly that call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.backends.base import Agent
from corral.backends.initclient import ExecStream
from corral.errors import SandboxError
from corral.host.cgroups import Cgroups
from corral.host.mounts import is_mountpoint

__all__ = ["PoolSandbox", "Measured", "WORKER_SOURCE"]

log = logging.getLogger("corral.fncall")

WORKER_SOURCE = (Path(__file__).with_name("worker.py")).read_text()
_HDR = struct.Struct(">I")
_READY_TIMEOUT = 30.0
_BACKSTOP = 2.0
"""Seconds past a call's wall time after which the node stops waiting for its worker
(the sandbox is then recycled)."""


@dataclass
class Measured:
    """A worker's reply and the kernel's figures for the call."""

    reply: dict[str, Any]
    stdout: bytes
    stderr: bytes
    cpu_time: float
    peak_memory: int
    oom: bool
    clean: bool


class _Meter:
    """The sandbox cgroup's figures, through fds kept open (one ``pread`` each)."""

    def __init__(self, cgroups: Cgroups, sid: str) -> None:
        self.v2 = cgroups.mode == "v2"
        f = cgroups.control_file
        self._fds: list[int] = []
        if self.v2:
            self._cpu = self._open(f("", sid, "cpu.stat"))
            self._oom = self._open(f("", sid, "memory.events"))
            self._usage = self._open(f("", sid, "memory.current"))
            peak = f("", sid, "memory.peak")
            self._peak = self._open(peak) if peak.exists() else -1
            self._peak_reset = self._open(peak, os.O_WRONLY) if peak.exists() else -1
            self._procs_path = f("", sid, "cgroup.procs")
        else:
            self._cpu = self._open(f("cpuacct", sid, "cpuacct.usage"))
            self._oom = self._open(f("memory", sid, "memory.oom_control"))
            self._usage = self._open(f("memory", sid, "memory.usage_in_bytes"))
            self._peak = self._open(f("memory", sid, "memory.max_usage_in_bytes"))
            self._peak_reset = self._open(
                f("memory", sid, "memory.max_usage_in_bytes"), os.O_WRONLY
            )
            # Opened for each read, never kept: v1 serves cgroup.procs from a pid list
            # cached per open file (rebuilt only when the file is reopened or the cache
            # expires after a second), so a kept fd would miss a process left behind.
            self._procs_path = f("pids", sid, "cgroup.procs")

    def _open(self, path: Path, flags: int = os.O_RDONLY) -> int:
        # Safe: control files of corral's own sandbox cgroup.
        fd = os.open(path, flags | os.O_CLOEXEC)
        self._fds.append(fd)
        return fd

    @staticmethod
    def _read(fd: int) -> bytes:
        return os.pread(fd, 4096, 0)

    def cpu_ns(self) -> int:
        raw = self._read(self._cpu)
        if self.v2:
            for line in raw.split(b"\n"):
                if line.startswith(b"usage_usec "):
                    return int(line.split()[1]) * 1000
            return 0
        return int(raw)

    def oom_kills(self) -> int:
        for line in self._read(self._oom).split(b"\n"):
            if line.startswith(b"oom_kill "):
                return int(line.split()[1])
        return 0

    def usage(self) -> int:
        return int(self._read(self._usage))

    def reset_peak(self) -> None:
        if self._peak_reset >= 0:
            with contextlib.suppress(OSError):
                os.pwrite(self._peak_reset, b"0", 0)

    def peak(self) -> int:
        if self._peak < 0:
            return self.usage()
        return int(self._read(self._peak))

    def procs(self) -> set[int]:
        fd = os.open(self._procs_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return {int(x) for x in os.read(fd, 1 << 16).split()}
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


class PoolSandbox:
    """A running pool sandbox with its worker. Not safe for concurrent calls: the pool
    hands each one to a single caller at a time."""

    def __init__(
        self,
        sid: str,
        image: str,
        client: Agent,
        cgroups: Cgroups,
        init_pid: int,
        scratch_dirs: list[str],
    ) -> None:
        self.sid = sid
        self.image = image
        self._client = client
        self._cgroups = cgroups
        self.init_pid = init_pid
        self.worker_pid = 0
        self._dirs = scratch_dirs
        self._plain_dirs: set[str] | None = None
        self._stream: ExecStream | None = None
        self._ctx: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._buf = bytearray()
        self._replies: asyncio.Queue[tuple[dict[str, Any], bytes] | None] = asyncio.Queue()
        self._meter: _Meter | None = None
        self._mem_limit = 0
        self.baseline = 0
        self.dead = False
        self.calls = 0
        self.idle_since = 0.0
        """When it last went back to its pool (monotonic clock), for trimming."""

    async def start(self, env: dict[str, str], config: dict[str, Any]) -> None:
        """Start the worker and wait until it reports ready (modules imported)."""
        argv = ["python3", "-I", "-c", WORKER_SOURCE, json.dumps(config)]
        self._ctx = self._client.stream(
            argv, env=env, cwd="/", stdin_pipe=True, output_limit=1 << 40, keep_output=False
        )
        self._stream = await self._ctx.__aenter__()
        self._reader = asyncio.create_task(self._read_forever(), name=f"fncall-{self.sid}")
        try:
            first = await asyncio.wait_for(self._replies.get(), _READY_TIMEOUT)
        except TimeoutError:
            raise SandboxError(f"fncall worker in {self.sid} did not start in time") from None
        if first is None or not first[0].get("ready"):
            raise SandboxError(f"fncall worker in {self.sid} failed to start")
        self._meter = _Meter(self._cgroups, self.sid)
        others = self._meter.procs() - {self.init_pid}
        if len(others) != 1:
            raise SandboxError(f"fncall sandbox {self.sid}: expected one worker, saw {others}")
        self.worker_pid = others.pop()
        self.baseline = self._meter.usage()

    async def _read_forever(self) -> None:
        assert self._stream is not None
        try:
            async for name, data in self._stream:
                if name == "stderr":
                    log.warning(
                        "fncall worker %s: %s", self.sid, data[:2000].decode(errors="replace")
                    )
                    continue
                self._buf += data
                while len(self._buf) >= 4:
                    (n,) = _HDR.unpack_from(self._buf)
                    if len(self._buf) < 4 + n:
                        break
                    body = bytes(self._buf[4 : 4 + n])
                    del self._buf[: 4 + n]
                    (hl,) = _HDR.unpack_from(body)
                    self._replies.put_nowait((json.loads(body[4 : 4 + hl]), body[4 + hl :]))
        except Exception as e:  # the connection broke: the worker or the sandbox is gone
            log.info("fncall worker %s channel ended: %s", self.sid, e)
        finally:
            self.dead = True
            self._replies.put_nowait(None)

    def alive(self) -> bool:
        """The worker still runs (a sandbox destroyed from under the pool, e.g. by gc,
        may not have been noticed by its channel yet)."""
        if self.dead or not self.worker_pid:
            return False
        try:
            os.kill(self.worker_pid, 0)
        except OSError:
            return False
        return True

    def set_memory(self, memory: int) -> None:
        """Cgroup memory limit for the next call: the worker's own plus ``memory``."""
        want = self.baseline + memory
        if want != self._mem_limit:
            self._cgroups.set_memory(self.sid, want, 0)
            self._mem_limit = want

    async def call(
        self, header: dict[str, Any], code: bytes, stdin: bytes, wall: float
    ) -> Measured:
        """One request to the worker, measured by the kernel. Raises SandboxError when the
        worker does not answer (dead, or past the backstop); the sandbox is then dead."""
        if self.dead or self._stream is None or self._meter is None:
            raise SandboxError(f"fncall sandbox {self.sid} is not usable")
        m = self._meter
        header = dict(header, code_len=len(code))
        h = json.dumps(header, separators=(",", ":")).encode()
        body = _HDR.pack(len(h)) + h + code + stdin
        m.reset_peak()
        start_usage = m.usage()
        cpu0, oom0 = m.cpu_ns(), m.oom_kills()
        self.calls += 1
        try:
            await self._stream.write(_HDR.pack(len(body)) + body)
            got = await asyncio.wait_for(self._replies.get(), wall + _BACKSTOP)
        except TimeoutError:
            self.dead = True
            raise SandboxError(f"fncall worker in {self.sid} gave no answer in time") from None
        except (OSError, SandboxError) as e:
            self.dead = True
            raise SandboxError(f"fncall sandbox {self.sid}: channel broke: {e}") from None
        oom = m.oom_kills() > oom0
        cpu = (m.cpu_ns() - cpu0) / 1e9
        peak = max(0, m.peak() - start_usage)
        if got is None:
            raise SandboxError(f"fncall worker in {self.sid} died during the call")
        reply, payload = got
        if reply.get("dirty"):
            self.dead = True  # the worker could not clean up: never hand it out again
        out_len = int(reply.get("out_len", 0))
        return Measured(
            reply=reply,
            stdout=payload[:out_len],
            stderr=payload[out_len:],
            cpu_time=cpu,
            peak_memory=peak,
            oom=oom,
            clean=self._clean(m),
        )

    def _clean(self, m: _Meter) -> bool:
        """Kernel check that nothing of the call is left (processes, files)."""
        if self.dead:
            return False
        if m.procs() - {self.init_pid, self.worker_pid}:
            return False
        root = f"/proc/{self.init_pid}/root"
        if self._plain_dirs is None:
            # A scratch dir that is a directory of a bigger tmpfs, not a tmpfs of its own
            # (the launcher's /dev/shm is one of /dev): its inode count says nothing.
            self._plain_dirs = {d for d in self._dirs if not is_mountpoint(Path(root + d))}
        for d in self._dirs:
            try:
                if d in self._plain_dirs:
                    if os.listdir(root + d):
                        return False
                    continue
                st = os.statvfs(root + d)
            except OSError:
                return False
            if st.f_files - st.f_ffree > 1:  # a tmpfs holding anything but its root dir
                return False
        try:
            # POSIX message queues (mqueue has no inode counts): listing names only.
            if os.listdir(root + "/dev/mqueue"):
                return False
        except OSError:
            return False
        return True

    async def wait_clean(self, timeout: float = 0.2) -> bool:
        """Processes the worker killed may take a moment to leave the cgroup."""
        if self._meter is None:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self._clean(self._meter):
                return True
            await asyncio.sleep(0.005)
        return False

    async def close(self) -> None:
        self.dead = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                await self._ctx.__aexit__(None, None, None)
        if self._meter is not None:
            self._meter.close()
