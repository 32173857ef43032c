"""The spawn helper's sandbox user namespace (corral-spawn -U) against the real kernel."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from corral.host import mounts, spawn
from corral.host.userns import SandboxUserns
from tests.conftest import TAG

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

_NS_GET_OWNER_UID = 0xB704


def _run(argv: list[str]) -> int:
    pid = os.posix_spawn(argv[0], argv, os.environ)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_helper_makes_a_namespace_owned_by_the_given_uid(tmp_path: Path) -> None:
    helper = spawn.ensure_built(Path(f"/var/lib/corral-test{TAG}/bin"))
    u = SandboxUserns(owner=431234, host_uid=100000, size=65536, path=tmp_path / "userns")
    u.prepare()
    try:
        # The "runtime" here reads the namespace it is handed: owner and mapping.
        probe = (
            "import fcntl,os,struct,sys; fd=os.open(sys.argv[1],os.O_RDONLY);"
            f"print(struct.unpack('I',fcntl.ioctl(fd,{_NS_GET_OWNER_UID},b'0000'))[0])"
        )
        out = tmp_path / "out"
        argv = spawn.helper_argv(
            helper,
            ["/bin/sh", "-c", f'python3 -c "{probe}" {u.path} > {out}'],
            userns=u.helper_arg(),
        )
        assert _run(argv) == 0
        assert out.read_text().strip() == "431234"
        assert mounts.is_mountpoint(u.path)  # held for the runtime until the node drops it
        # Joined, it maps guest ids 0.. onto the sandbox range, as the runtime's own did.
        r = subprocess.run(
            ["nsenter", f"--user={u.path}", "cat", "/proc/self/uid_map", "/proc/self/gid_map"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.stdout.split() == ["0", "100000", "65536"] * 2, r
    finally:
        u.drop()
    assert not u.path.exists() and not mounts.is_mountpoint(u.path)


def test_helper_refuses_a_root_owner(tmp_path: Path) -> None:
    helper = spawn.ensure_built(Path(f"/var/lib/corral-test{TAG}/bin"))
    log = tmp_path / "log"
    argv = spawn.helper_argv(helper, ["/bin/true"], userns=f"0:100000:65536:{tmp_path}/x", log=log)
    assert _run(argv) == 127
    assert "bad -U argument" in log.read_text()
