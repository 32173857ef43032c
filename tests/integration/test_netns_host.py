"""Named network namespaces leave the host's mount table as they found it.

The first ``ip netns add`` on a freshly booted host makes /run/netns a shared bind mount of
itself, and ``ip netns del`` leaves that mount behind: CI on a fresh machine found it as the
one thing the suite left on the host. :func:`release_run_netns` (which :func:`delete_netns` calls) removes it once no named
namespace (anyone's) is left in it.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from corral.bench.netns_host import RUN_NETNS, NetnsHost, delete_netns, release_run_netns
from corral.host.mounts import is_mountpoint

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def _names() -> list[str]:
    return os.listdir(RUN_NETNS) if RUN_NETNS.is_dir() else []


def test_the_mount_stays_while_a_namespace_is_in_it_and_goes_with_the_last() -> None:
    name = f"corral-test-rn-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert is_mountpoint(RUN_NETNS)
        release_run_netns()  # busy: a namespace is in it
        assert is_mountpoint(RUN_NETNS)
        assert is_mountpoint(RUN_NETNS / name)
        out = subprocess.run(
            ["ip", "-n", name, "link", "show", "lo"], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr  # the namespace still works
    finally:
        delete_netns(name, check=True)
    assert name not in _names()
    # gone when nothing else is in it; another test's or the host's namespaces keep it
    assert is_mountpoint(RUN_NETNS) == bool(_names())


def test_a_netns_host_removes_what_it_made() -> None:
    host = NetnsHost(
        ns=f"corral-test-rn-{uuid.uuid4().hex[:8]}",
        veth=f"ctrn{uuid.uuid4().hex[:8]}",
        host_ip="10.252.251.1",
        ip="10.252.251.2",
    )
    host.up()
    try:
        assert host.ns in _names()
        out = subprocess.run(["ip", "-n", host.ns, "-br", "addr"], capture_output=True, text=True)
        assert "10.252.251.2/24" in out.stdout, out
    finally:
        host.down()
    assert host.ns not in _names()
    assert not Path(f"/sys/class/net/{host.veth}").exists()
    assert is_mountpoint(RUN_NETNS) == bool(_names())
