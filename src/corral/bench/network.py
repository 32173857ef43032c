"""``corral bench network``: what an egress policy costs, and how fast a change lands.

Set-up (removed afterwards): a server in its own network namespace (``<subtree>-netsrv``,
10.251.0.2, HTTP on port 80 serving a sparse bulk file), a DNS server in this process on
the host side of its veth (10.251.0.1) that answers ``bulk.bench.test``, and a bench
node whose permissions name only that server: ``bulk`` (by name) and ``bulkip`` (by
address).

Figures, all from the same run:

* ``attach_ms_p50`` / ``_p99``: the node's own time to wire a sandbox (veth into its
  namespace, addresses, routes, its nft chain and sets), as recorded in each sandbox's
  ``network_attached`` event; ``create_ms_p50`` with and without a policy (interleaved,
  one at a time, all kept until the end) and their difference ``create_extra_ms_p50``
  (and ``create_extra_ms_paired_p50``, the median of per-pair differences) are the
  end-to-end view: the extra create cost of a sandbox with a policy.
* ``policy_update_ms_p50`` / ``_p99``: from the start of ``sb.network.update(...)`` to
  the first connection that succeeds from inside the sandbox (a prober retries a 5 ms
  connect in a loop; both clocks are the same kernel's CLOCK_REALTIME), and
  ``policy_update_call_ms_*``, the update call alone (the rules are in the kernel when it
  returns; the rest is the prober being scheduled).
* ``throughput_ratio``: download of the bulk file over the allowed path (an address the
  node resolver handed to the sandbox; its veth, the node's nftables and NAT), by the
  same client program entered into the sandbox's network namespace, divided by that
  download from the host namespace (median of ``rounds``, interleaved).
  ``throughput_ratio_in_sandbox`` is the same download run *by the sandbox* (its own
  CPU share and seccomp filter included): on a loaded host it measures the sandbox's
  CPU class more than the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from corral.bench.netns_host import NetnsHost, wait_port
from corral.bench.scenarios import BenchOptions, header, prepared, say
from corral.bench.stats import p50, p99
from corral.errors import CorralError, SandboxError
from corral.sdk import AsyncClient, Sandbox

__all__ = ["network"]

SRV_IP, HOST_IP, NAME = "10.251.0.2", "10.251.0.1", "bulk.bench.test"

DOWNLOAD = (
    "import sys, time, urllib.request\n"
    "t0 = time.perf_counter(); n = 0\n"
    "with urllib.request.urlopen(sys.argv[1], timeout=60) as r:\n"
    "    while True:\n"
    "        b = r.read(1 << 20)\n"
    "        if not b: break\n"
    "        n += len(b)\n"
    "print(n, time.perf_counter() - t0)\n"
)
PROBE = (
    "import socket, sys, time\n"
    "end = time.time() + float(sys.argv[3])\n"
    "while time.time() < end:\n"
    "    s = socket.socket(); s.settimeout(0.005)\n"
    "    try:\n"
    "        s.connect((sys.argv[1], int(sys.argv[2]))); print(repr(time.time())); break\n"
    "    except OSError:\n"
    "        open(sys.argv[4], 'a').close()  # looping: the address is closed\n"
    "        time.sleep(0.001)\n"
    "    finally:\n"
    "        s.close()\n"
    "else:\n"
    "    print('TIMEOUT')\n"
)


class _Server:
    """The bench's far end: a namespace with an HTTP server, and a DNS answer for it."""

    def __init__(self, subtree: str, size: int) -> None:
        self.host = NetnsHost(
            ns=f"{subtree}-netsrv",
            veth="cb" + hashlib.sha256(subtree.encode()).hexdigest()[:10],
            host_ip=HOST_IP,
            ip=SRV_IP,
        )
        self.size = size
        self.dir = Path(tempfile.mkdtemp(prefix="corral-bench-net-"))
        self.http: subprocess.Popen[bytes] | None = None
        self._dns: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Server:
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _up(self) -> None:
        self.host.up()
        with open(self.dir / "bulk", "wb") as f:
            f.truncate(self.size)
        self.http = self.host.serve_http(self.dir)
        if not wait_port(SRV_IP, 80):
            raise CorralError("the bench HTTP server did not come up")
        self._dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._dns.bind((HOST_IP, 53))
        self._thread = threading.Thread(target=self._serve_dns, daemon=True)
        self._thread.start()

    def _serve_dns(self) -> None:
        from dnslib import QTYPE, RR, A, DNSRecord  # type: ignore[import-untyped]

        sock = self._dns
        while sock is not None:
            try:
                data, addr = sock.recvfrom(4096)
                q = DNSRecord.parse(data)
            except OSError:
                return
            except Exception:
                continue
            r = q.reply()
            if str(q.q.qname).rstrip(".") == NAME and q.q.qtype == QTYPE.A:
                r.add_answer(RR(q.q.qname, QTYPE.A, rdata=A(SRV_IP), ttl=300))
            with contextlib.suppress(OSError):
                sock.sendto(r.pack(), addr)

    def close(self) -> None:
        if self._dns is not None:
            with contextlib.suppress(OSError):
                self._dns.shutdown(socket.SHUT_RDWR)
            self._dns.close()
            self._dns = None
        if self.http is not None:
            self.http.kill()
            self.http.wait(timeout=10)
            self.http = None
        self.host.down()
        shutil.rmtree(self.dir, ignore_errors=True)


async def _py(sb: Sandbox, script: str, *args: str, timeout: float = 120) -> str:
    r = await sb.exec(["python3", "-c", script, *args], timeout=timeout)
    if not r.ok:
        raise SandboxError(
            f"bench script in {sb.id} ended {r.reason} (exit {r.exit_code}): "
            f"{r.stderr.decode(errors='replace')[-500:]} (the image needs python3)"
        )
    return r.stdout.decode()


def _mbps(out: str) -> float:
    n, secs = out.split()
    return int(n) / float(secs) / 1e6


async def network(
    opts: BenchOptions, count: int, updates: int, rounds: int, size: int
) -> dict[str, Any]:
    from corral.policy.network import NetworkConfig, Permission

    async with prepared(opts) as p:
        out = header("network", p, count=count, updates=updates, rounds=rounds)
        cfg = opts.node_config(2 * count + 8)
        cfg.network = NetworkConfig(
            subnet="10.214.0.0/20",
            upstream=[HOST_IP],
            uplinks=[],
            permissions={
                "bulk": Permission(hosts=[NAME], ports=[80]),
                "bulkip": Permission(cidrs=[f"{SRV_IP}/32"], ports=[80]),
            },
        )
        with _Server(opts.subtree, size) as srv:
            async with AsyncClient(config=cfg) as client:
                img = await client.images.get(p.image.info.name)
                made: list[Sandbox] = []
                try:
                    out.update(await _attach(client, img, count, made))
                    # Measured with the CPU class of a latency-sensitive sandbox and two
                    # cores: a best-effort sandbox gets only idle CPU on a loaded host,
                    # which would measure the neighbours, not the network path.
                    sb = await client.sandboxes.create(
                        image=img, network={"allow": ["bulk"]}, qos="latency", limits={"cpus": 2}
                    )
                    made.append(sb)
                    out.update(await _updates(sb, updates))
                    out.update(await _throughput(sb, srv, rounds))
                finally:
                    for sb in made:
                        with contextlib.suppress(CorralError):
                            await sb.destroy()
    return out


async def _attach(client: AsyncClient, img: Any, count: int, made: list[Sandbox]) -> dict[str, Any]:
    say(f"creating {count} sandboxes with a policy and {count} without, interleaved")
    warm = await client.sandboxes.create(image=img, network={"allow": ["bulk"]})
    await warm.destroy()
    plain: list[float] = []
    policed: list[float] = []
    policed_sbs: list[Sandbox] = []
    # All kept until the end: a destroy between two creates would leave kernel work
    # (namespace and veth teardown, which take the rtnl lock) to whichever comes next.
    # Pairs alternate which kind goes first, so neither always follows the other.
    for i in range(count):
        for with_policy in (True, False) if i % 2 == 0 else (False, True):
            t0 = time.perf_counter()
            sb = await client.sandboxes.create(
                image=img, network={"allow": ["bulk"]} if with_policy else None
            )
            (policed if with_policy else plain).append(time.perf_counter() - t0)
            made.append(sb)
            if with_policy:
                policed_sbs.append(sb)
    attach = []
    for sb in policed_sbs:
        for e in await sb.events():
            if e.kind == "network_attached":
                attach.append(float(e.detail["ms"]))  # type: ignore[arg-type]
    if not attach:
        raise CorralError("no network_attached event: the policy was not applied")
    pairs = [a - b for a, b in zip(policed, plain, strict=True)]
    return {
        "attach_ms_p50": round(p50(attach), 2),
        "attach_ms_p99": round(p99(attach), 2),
        "create_ms_p50_with_policy": round(p50(policed) * 1000, 2),
        "create_ms_p50_without": round(p50(plain) * 1000, 2),
        "create_extra_ms_p50": round((p50(policed) - p50(plain)) * 1000, 2),
        # the same, pair by pair (neighbours drift less within a pair than across a run)
        "create_extra_ms_paired_p50": round(p50(pairs) * 1000, 2),
    }


async def _updates(sb: Sandbox, n: int) -> dict[str, Any]:
    say(f"{n} policy updates on a live sandbox, timed until a connection gets through")
    lat: list[float] = []
    calls: list[float] = []
    for _ in range(n):
        await sb.network.update(allow=["bulk"])  # bulkip revoked: the address is closed
        flag = f"/tmp/.corral-bench-probe-{len(lat)}"
        probe = await sb.spawn(["python3", "-c", PROBE, SRV_IP, "80", "60", flag])
        deadline = time.monotonic() + 60
        while True:  # until the prober has failed once: it is looping on a closed address
            with contextlib.suppress(CorralError):
                await sb.files.stat(flag)
                break
            if time.monotonic() > deadline:
                raise CorralError("the prober did not start within 60 s")
            await asyncio.sleep(0.02)
        t0 = time.time()
        await sb.network.update(allow=["bulk", "bulkip"])
        calls.append(time.time() - t0)
        result = await probe.wait(timeout=30)
        text = result.stdout.decode().strip()
        if not result.ok or text == "TIMEOUT":
            raise CorralError(f"the update did not take effect within 10 s: {text[:200]}")
        lat.append(float(text) - t0)
    return {
        "policy_update_ms_p50": round(p50(lat) * 1000, 2),
        "policy_update_ms_p99": round(p99(lat) * 1000, 2),
        # the update call alone (the kernel has the new rules when it returns)
        "policy_update_call_ms_p50": round(p50(calls) * 1000, 2),
        "policy_update_call_ms_p99": round(p99(calls) * 1000, 2),
    }


async def _throughput(sb: Sandbox, srv: _Server, rounds: int) -> dict[str, Any]:
    say(f"downloading {srv.size >> 20} MiB {rounds}x from the sandbox and from the host")
    url = f"http://{NAME}/bulk"

    pid = sb.info.pid
    if not pid:
        raise CorralError(f"sandbox {sb.id} reports no init pid")

    async def from_host(netns_of: int | None = None) -> float:
        # The same client program on the host; with ``netns_of``, entered into that
        # sandbox's network namespace (its veth, the node's nftables and NAT), keeping
        # the host's CPU class. The address was handed to the sandbox by its resolver.
        enter = ["nsenter", "-t", str(netns_of), "-n"] if netns_of else []
        proc = await asyncio.create_subprocess_exec(
            *enter, sys.executable, "-c", DOWNLOAD, f"http://{SRV_IP}/bulk",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, _ = await proc.communicate()
        if proc.returncode != 0:
            raise CorralError(f"the host-side download failed (exit {proc.returncode})")
        return _mbps(stdout.decode())

    await _py(sb, DOWNLOAD, url)  # untimed warm-up (first lookup opens the address)
    await from_host()
    inside, path, host = [], [], []
    for _ in range(rounds):  # interleaved, so all three see the same neighbours
        inside.append(_mbps(await _py(sb, DOWNLOAD, url)))
        path.append(await from_host(pid))
        host.append(await from_host())
    a, c, b = statistics.median(inside), statistics.median(path), statistics.median(host)
    return {
        "throughput_mbps_path": round(c, 1),
        "throughput_mbps_sandbox": round(a, 1),
        "throughput_mbps_host": round(b, 1),
        "throughput_ratio": round(c / b, 3),
        "throughput_ratio_in_sandbox": round(a / b, 3),
        "throughput_detail": json.dumps(
            {
                "path": [round(x) for x in path],
                "sandbox": [round(x) for x in inside],
                "host": [round(x) for x in host],
            }
        ),
    }
