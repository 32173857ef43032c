"""A sandbox's disk quota against metadata churn, and the node's writes into a full one.

btrfs holds a metadata reservation against the sandbox's qgroup for every transaction
handle until the next commit (host/btrfs.py): a guest that only renames and creates
files used to exhaust a small quota hundreds of times a second, and each exhaustion
could end in a spurious EDQUOT. A full quota seen by the node's own file operations is
``QuotaExceeded`` (HTTP 507), never a refused path (a security event).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corral.errors import QuotaExceeded
from corral.host.btrfs import qgroup_limit
from corral.spec import ExecRequest, Limits, SandboxSpec

DISK = 16 << 20
EXCHANGES = 20_000
FILES = 5_000

CHURN = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("/work/churn", exist_ok=True)
os.chdir("/work/churn")
os.mkdir("x"); os.symlink("/", "alt")
done = 0
try:
    for i in range(EXCHANGES):
        # renameat2(RENAME_EXCHANGE): a directory and a symlink swap names
        if libc.renameat2(-100, b"x", -100, b"alt", 2) != 0:
            raise OSError(ctypes.get_errno(), "renameat2")
        done += 1
    for i in range(FILES):
        fd = os.open("f%d" % i, os.O_CREAT | os.O_WRONLY, 0o644)
        os.close(fd)
        os.rename("f%d" % i, "g%d" % i)
        os.mkdir("d%d" % i)
        os.unlink("g%d" % i)
        os.rmdir("d%d" % i)
        done += 1
except OSError as e:
    print("errno", e.errno)
print("done", done)
"""


def _scratch_commits(scratch: Path) -> int:
    """Transaction commits of the btrfs mounted at ``scratch`` since it was mounted."""
    where = os.path.realpath(scratch)
    with open("/proc/self/mountinfo") as f:
        sources = [ln.split(" - ")[1].split()[1] for ln in f if ln.split()[4] == where]
    assert sources, f"{where} is not mounted"
    source = sources[-1]
    for fs in Path("/sys/fs/btrfs").iterdir():
        if (fs / "devices" / Path(source).name).exists():
            text = (fs / "commit_stats").read_text()
            return int(text.split("commits")[1].split()[0])
    raise AssertionError(f"no btrfs in /sys/fs/btrfs for {scratch} ({source})")


@pytest.fixture
async def small_disk(node):  # type: ignore[no-untyped-def]
    spec = SandboxSpec(
        image="test/debian", limits=Limits(cpus=1, memory="256MiB", pids=128, disk=DISK)
    )
    info = await node.sandbox_create(spec)
    try:
        yield info.id
    finally:
        await node.sandbox_destroy(info.id)


async def test_metadata_churn_sees_no_edquot(node, small_disk) -> None:  # type: ignore[no-untyped-def]
    script = CHURN.replace("EXCHANGES", str(EXCHANGES)).replace("FILES", str(FILES))
    await node.file_write(small_disk, "/tmp/churn.py", script.encode())
    scratch = node.config.state_dir / "scratch"
    before = _scratch_commits(scratch)
    r = await node.exec(small_disk, ExecRequest(cmd=["python3", "/tmp/churn.py"], timeout=300))
    commits = _scratch_commits(scratch) - before
    assert r.exit_code == 0 and b"errno" not in r.stdout, (r.stdout, r.stderr)
    assert r.stdout.split()[-1] == str(EXCHANGES + FILES).encode()
    # Each exhaustion of the quota's room costs a commit (and was a chance of EDQUOT).
    # Estimated from the reservation sizes, this churn takes ~300 of them at 16 MiB with
    # 16 KiB nodes and no allowance, ~100 with 4 KiB nodes alone, ~80 with the allowance
    # alone; measured with both: 21 on a quiet machine, 88 during a long loaded run (the
    # count includes the filesystem's periodic commits and other sandboxes' work). The
    # bound only catches a return to committing per exhaustion.
    print(f"metadata churn at {DISK >> 20} MiB: {commits} commits")
    assert commits < 250, commits


async def test_node_write_into_full_sandbox_is_quota_exceeded(node, small_disk) -> None:  # type: ignore[no-untyped-def]
    limit = qgroup_limit(DISK)
    r = await node.exec(
        small_disk,
        ExecRequest(
            cmd=["sh", "-c", f"head -c {limit + (8 << 20)} /dev/zero > /tmp/fill; echo rc=$?"],
            timeout=120,
        ),
    )
    assert b"rc=1" in r.stdout and b"quota" in r.stderr.lower(), (r.stdout, r.stderr)
    with pytest.raises(QuotaExceeded, match="/tmp/api: disk quota exceeded") as ei:
        await node.file_write(small_disk, "/tmp/api", b"z" * (4 << 20))
    assert ei.value.status == 507
    assert "/tmp/api" not in {e.name for e in await node.file_list(small_disk, "/tmp")}
    kinds = {e.kind for e in await node.events(sandbox_id=small_disk)}
    assert "file_refused" not in kinds, kinds
    # freeing space in the sandbox makes the node's write succeed again
    await node.file_remove(small_disk, "/tmp/fill")
    await node.file_write(small_disk, "/tmp/api", b"z" * (4 << 20))
    assert (await node.file_stat(small_disk, "/tmp/api")).size == 4 << 20
