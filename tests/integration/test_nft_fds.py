"""libnftables select()s on its netlink socket: a context made by a process that already
holds more than FD_SETSIZE fds would abort the process on its first command (glibc's
FD_SET check). host/nft.py refuses such a context with a clear error, and a context made
early keeps working however many fds the process opens later (the node makes its one at
start: node/network.py). Each case runs in a child process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest

SCRIPT = textwrap.dedent(
    """\
    import os, resource, sys
    from corral.errors import HostError
    from corral.host.nft import Nft
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
    early = sys.argv[1] == "early"
    table = sys.argv[2]
    nft = Nft() if early else None
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    if nft is None:
        try:
            nft = Nft()
        except HostError as e:
            print("refused:", e.message)
            sys.exit(0)
    nft.run(f"add table inet {table}")
    nft.run(f"delete table inet {table}")
    nft.close()
    print("ran")
    """
)


@pytest.mark.parametrize(("when", "want"), [("early", "ran"), ("late", "refused:")])
def test_nft_context_and_many_fds(when: str, want: str) -> None:
    table = f"corral-fdtest-{uuid.uuid4().hex[:8]}"
    try:
        p = subprocess.run(
            [sys.executable, "-c", SCRIPT, when, table],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)  # never an abort (134)
    assert p.stdout.startswith(want), p.stdout
    if want == "refused:":
        assert "netlink socket would be fd 1" in p.stdout  # names the fd it would be
