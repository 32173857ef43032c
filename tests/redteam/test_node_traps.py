"""The guest plants traps for the node's host-side reads of its filesystem.

The node reads the sandbox's /etc/passwd to resolve ``user=``, and its files API reads,
lists, tars and removes guest-controlled trees. FIFOs, sparse giants and very deep trees
must neither hang the node nor make it read unbounded data: each call ends (refused or
done) in bounded time, and the node stays healthy.
"""

from __future__ import annotations

import asyncio
import time

import corral
from tests.redteam.conftest import assert_healthy, out, run

BOUND = 30.0


async def _bounded(coro) -> str:  # type: ignore[no-untyped-def]
    """'ok' or the corral error class name, with the seconds it took; anything else (a
    hang, a crash) fails."""
    t = time.monotonic()
    try:
        await asyncio.wait_for(coro, BOUND)
        res = "ok"
    except corral.CorralError as e:
        res = type(e).__name__
    return f"{res} {time.monotonic() - t:.2f}s"


async def test_fifo_and_sparse_etc(red_node, guest, neighbour):  # type: ignore[no-untyped-def]
    r = await run(
        guest,
        "echo alice:x:1000:1000::/:/bin/sh >> /etc/passwd && rm /etc/passwd && mkfifo /etc/passwd && "
        "rm /etc/group && truncate -s 50G /etc/group && stat -c %F /etc/passwd",
    )
    assert r.exit_code == 0, out(r)
    got = {
        "user_name": await _bounded(guest.exec(["id"], user="alice")),
        "user_group": await _bounded(guest.exec(["id"], user="0:staff")),
        "read_fifo": await _bounded(guest.files.read("/etc/passwd")),
        "read_sparse": await _bounded(guest.files.read("/etc/group")),
        "stat_fifo": await _bounded(guest.files.stat("/etc/passwd")),
    }
    kinds = {k: v.split()[0] for k, v in got.items()}
    assert kinds["user_name"] == "InvalidRequest" and kinds["user_group"] == "InvalidRequest", got
    assert kinds["read_fifo"] == "PathRefused" and kinds["read_sparse"] == "InvalidRequest", got
    print(f"node traps (/etc): {got}")
    await assert_healthy(red_node, guest, neighbour)


DEEP = r"""
import os
os.makedirs("/tmp/deep", exist_ok=True); os.chdir("/tmp/deep")
for i in range(DEPTH):
    os.mkdir("d"); os.chdir("d")
open("leaf", "w").write("x")
os.chdir("/tmp")
os.mkdir("/tmp/wide")
for i in range(WIDTH):
    open("/tmp/wide/%06d" % i, "w").close()
print("built")
"""


async def test_deep_wide_and_sparse_trees(red_node, guest, neighbour):  # type: ignore[no-untyped-def]
    script = DEEP.replace("DEPTH", "1500").replace("WIDTH", "5000")
    await guest.files.write("/tmp/deep.py", script)
    t = time.monotonic()
    r = await run(
        guest,
        "python3 /tmp/deep.py && mkdir /tmp/sparse && truncate -s 100G /tmp/sparse/big",
        timeout=60,
    )
    assert r.exit_code == 0, out(r)
    print(f"built trees in {time.monotonic() - t:.1f}s")
    ops = guest.files._ops  # type: ignore[attr-defined]
    got = {
        "tar_sparse": await _bounded(ops.file_download_tar(guest.id, "/tmp/sparse")),
        "tar_deep": await _bounded(ops.file_download_tar(guest.id, "/tmp/deep")),
        "list_wide": await _bounded(guest.files.list("/tmp/wide")),
        "tar_wide": await _bounded(ops.file_download_tar(guest.id, "/tmp/wide")),
        "rm_deep": await _bounded(guest.files.remove("/tmp/deep", recursive=True)),
        "rm_wide": await _bounded(guest.files.remove("/tmp/wide", recursive=True)),
    }
    kinds = {k: v.split()[0] for k, v in got.items()}
    assert kinds["tar_sparse"] == "InvalidRequest", got  # 100 GiB is over the tar budget
    assert kinds["rm_deep"] == "ok" and kinds["rm_wide"] == "ok", got
    r = await run(guest, "ls /tmp")
    assert r.stdout.split().count(b"deep") == 0 and b"wide" not in r.stdout, out(r)
    await assert_healthy(red_node, guest, neighbour)
    print(f"node traps: {got}")
