"""The userspace delay line that gives the shared-store benches and tests a link with
latency (this kernel has no netem): packets cross it, each way late by the delay, and
nothing of it stays behind."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.bench.delayline import DelayLine
from corral.bench.netns_host import delete_netns

pytestmark = pytest.mark.skipif(not Path("/dev/net/tun").exists(), reason="no /dev/net/tun")

NS = "corral-test-dline"
DEV = "ctdline0"


def test_a_round_trip_pays_the_delay_both_ways_and_nothing_stays() -> None:
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NS], check=True)
    line = DelayLine(DEV, NS, "10.252.250.1", "10.252.250.2", delay_ms=20.0)
    try:
        line.up()
        # A refused connect is one round trip (SYN out, RST back) through the line.
        rtts = []
        for _ in range(3):
            t = time.monotonic()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("10.252.250.2", 9), timeout=10)
            rtts.append(time.monotonic() - t)
        assert min(rtts) >= 0.040  # a lower bound only: the line never delivers early
        pump = line._pump
        assert pump is not None and pump.poll() is None
        assert line.pump_pid == pump.pid  # what the benches account the link's CPU by
    finally:
        line.down()
        delete_netns(NS)
    assert pump.poll() is not None
    assert line.pump_pid is None
    assert not Path(f"/sys/class/net/{DEV}").exists()
    assert not Path(f"/run/netns/{NS}").exists()


def test_bad_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay_ms"):
        DelayLine(DEV, NS, "10.252.250.1", "10.252.250.2", delay_ms=-1).up()


SERVE = r"""
import hashlib, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.252.250.2", 9000))
s.listen(1)
print("listening", flush=True)
c, _ = s.accept()
block = bytes(range(256)) * 256  # 64 KiB, so reordering or a lost byte shows in the hash
h = hashlib.sha256()
for i in range(int(sys.argv[1])):
    chunk = i.to_bytes(8, "big") + block[8:]
    h.update(chunk)
    c.sendall(chunk)
c.close()
print(h.hexdigest(), flush=True)
"""


def test_a_bulk_transfer_arrives_whole_and_in_order() -> None:
    """A TCP stream of 32 MiB through the line (big packets, both ways: data and acks)
    arrives byte for byte as sent."""
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "netns", "add", NS], check=True)
    line = DelayLine(DEV, NS, "10.252.250.1", "10.252.250.2", delay_ms=0.5)
    server = None
    try:
        line.up()
        server = subprocess.Popen(
            ["ip", "netns", "exec", NS, sys.executable, "-c", SERVE, "512"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "listening"
        got = hashlib.sha256()
        n = 0
        with socket.create_connection(("10.252.250.2", 9000), timeout=60) as c:
            while data := c.recv(1 << 20):
                got.update(data)
                n += len(data)
        assert n == 512 * 65536
        assert server.stdout.readline().strip() == got.hexdigest()
        assert server.wait(timeout=60) == 0
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.wait()
        line.down()
        delete_netns(NS)
    assert not Path(f"/run/netns/{NS}").exists()
