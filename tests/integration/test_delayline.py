"""The userspace delay line that gives the shared-store benches and tests a link with
latency (this kernel has no netem): packets cross it, each way late by the delay, and
nothing of it stays behind."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from corral.bench.delayline import DelayLine

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
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    assert pump.poll() is not None
    assert line.pump_pid is None
    assert not Path(f"/sys/class/net/{DEV}").exists()
    assert not Path(f"/run/netns/{NS}").exists()


def test_bad_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay_ms"):
        DelayLine(DEV, NS, "10.252.250.1", "10.252.250.2", delay_ms=-1).up()
