"""A link with added latency, made in userspace: netem's job on a kernel without netem.

The shared-store benches want their servers "behind a link with limited bandwidth and
added latency". This kernel has ``tbf`` (bandwidth) but neither ``sch_netem`` nor
``sch_fq`` (which would honour per-packet departure times), so no qdisc can delay a
packet. A delay line does it instead: two TUN devices, ``dev`` on the host and ``eth0``
in the namespace, joined by a small process that reads each packet from one, holds it
for ``delay_ms`` and writes it to the other (one FIFO per direction: the delay is
constant, so order is kept). ``tbf`` still shapes both devices' egress, so bandwidth and
latency combine as on a real link; the round trip grows by twice ``delay_ms``.

The pump is corral-delayline (``corral/init/corral-delayline.c``, built with gcc on first
use into ``helper_dir``), its own process. 256 MiB through a 1 Gbit/s line cost it
0.46-0.83 s of CPU (9,000-byte packets) against 0.81-1.27 s for the Python pump before it
(32,000-byte packets), on this 2-core VM: CPU on the node's cores that a real network
does not cost it. Most of what is left is the kernel's: a write to a TUN device runs the
receiving side's network stack in the writer's context (in a cluster, the receiving
NIC's softirq). And it holds packets for the delay asked: the Python pump's waits were
rounded up to whole milliseconds (epoll's timeout), so at 0.5 ms each way a refused
connect (one round trip and the client's own work) took p50 3.1 ms through it and 1.8 ms
through this one (50 each, twice). The pump owns both TUN fds, so when it
ends the devices go with it; :meth:`DelayLine.down` ends it by pid.

Example::

    line = DelayLine(dev="cdfsx", ns="corral-dfs-x", host_ip="10.252.7.1",
                     ns_ip="10.252.7.2", delay_ms=1.0)
    line.up()            # the namespace must exist
    ...
    line.down()
"""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from corral.bench import cores
from corral.host import cbuild

__all__ = ["DelayLine"]

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_MTU = 9000
"""Jumbo frames, as a storage network runs them. Larger packets (32,000 bytes, which kept
the Python pump's packet rate low) and an exact 0.5 ms delay made TCP's receive window
stall at ~95 KB in 9 of 18 runs of a 256 MiB transfer (42 MiB/s on a 1 Gbit/s link,
throughout in 6 of them). At 9,000 every run reached the link's rate (111-118 MiB/s, 12
of 12)."""


SOURCE = Path(__file__).parent.parent / "init" / "corral-delayline.c"
CFLAGS = ("-static", "-O2", "-Wall", "-s")
HELPER_DIR = Path("/var/lib/corral-bench-bin")
"""Bench-only, like ``/var/lib/corral-bench-dfs``: never a user's node's ``bin``."""


def ensure_built(out_dir: Path = HELPER_DIR) -> Path:
    """Compile corral-delayline into ``out_dir`` unless this source version is there."""
    return cbuild.build_static("corral-delayline", SOURCE.read_bytes(), CFLAGS, out_dir)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class DelayLine:
    """``dev`` (host, ``host_ip``) <-> ``eth0`` in netns ``ns`` (``ns_ip``), each way
    delayed by ``delay_ms``."""

    dev: str
    ns: str
    host_ip: str
    ns_ip: str
    delay_ms: float
    helper_dir: Path = HELPER_DIR
    """Where the pump is built (once per source version)."""
    cpus: frozenset[int] | None = None
    """Cores the pump runs on (None: any), e.g. the store's own (bench/cores.py)."""
    _pump: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def up(self, timeout: float = 30.0) -> None:
        """Make both devices, address them, start the pump (the namespace must exist)."""
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms {self.delay_ms} must be >= 0")
        exe = ensure_built(self.helper_dir)
        far = f"{self.dev[:11]}-far"
        fds = [_open_tun(self.dev), _open_tun(far)]
        try:
            _ip("link", "set", far, "netns", self.ns)
            _ip("-n", self.ns, "link", "set", far, "name", "eth0")
            for ns, dev, ip, peer in (
                (None, self.dev, self.host_ip, self.ns_ip),
                (self.ns, "eth0", self.ns_ip, self.host_ip),
            ):
                pre = [] if ns is None else ["-n", ns]
                _ip(*pre, "addr", "add", ip, "peer", peer, "dev", dev)
                _ip(*pre, "link", "set", dev, "mtu", str(_MTU), "up")
            _ip("-n", self.ns, "link", "set", "lo", "up")
            argv = [str(exe), *map(str, fds), str(round(self.delay_ms * 1000))]
            self._pump = subprocess.Popen(
                argv if self.cpus is None else cores.taskset(self.cpus, argv),
                pass_fds=fds,
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
            )
        finally:
            for fd in fds:  # the pump holds its own copies
                os.close(fd)
        assert self._pump.stdout is not None
        ready = self._pump.stdout.readline()  # the pump's readiness line
        if ready.strip() != b"ready":
            self.down()
            raise RuntimeError(f"the delay line's pump did not start (said {ready!r})")

    @property
    def pump_pid(self) -> int | None:
        """The pump's pid while it runs (the bench accounts its CPU)."""
        return self._pump.pid if self._pump is not None else None

    def down(self) -> None:
        """End the pump (its devices go with it) and remove what is left."""
        if self._pump is not None:
            if self._pump.poll() is None:
                self._pump.send_signal(signal.SIGTERM)
                try:
                    self._pump.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._pump.kill()
                    self._pump.wait(timeout=30)
            if self._pump.stdout is not None:
                self._pump.stdout.close()
            self._pump = None
        subprocess.run(["ip", "link", "del", self.dev], capture_output=True)
