"""A restart of the node agent loses no sandbox; gc removes what a crash left."""

from __future__ import annotations

import shutil
from pathlib import Path

from corral.host import leaks
from corral.node import Node
from corral.spec import ExecRequest, Limits, SandboxSpec
from tests.conftest import TAG
from tests.integration.conftest import node_config

STATE = Path(f"/var/lib/corral-test{TAG}-restart")
RUN = Path(f"/run/corral-test{TAG}-restart")
SUBTREE = f"corral-test{TAG}-restart"


def _cfg():  # type: ignore[no-untyped-def]
    return node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE)


async def test_sandboxes_survive_restart(images_ready):
    node = await Node.open(_cfg())
    try:
        spec = SandboxSpec(image="test/debian", limits=Limits(memory="256MiB", disk="128MiB"))
        info = await node.sandbox_create(spec)
        await node.file_write(info.id, "/work/kept.txt", b"kept\n")
        proc = await node.spawn(info.id, ExecRequest(cmd=["sh", "-c", "echo bg; sleep 300"]))
        shell = await node.shell_open(info.id)
        await node.shell_run(info.id, shell.id, "cd /work && export K=v")
    finally:
        await node.close()
    # the agent is gone; the sandbox is not
    node = await Node.open(_cfg())
    try:
        assert [i.id for i in await node.sandbox_list()] == [info.id]
        r = await node.exec(info.id, ExecRequest(cmd=["cat", "/work/kept.txt"]))
        assert r.stdout == b"kept\n"
        p = await node.process_get(info.id, proc.id)
        assert p.running and p.stdout == b"bg\n"
        r = await node.shell_run(info.id, shell.id, "pwd; echo $K")
        assert r.stdout == b"/work\nv\n"
        await node.sandbox_destroy(info.id)
    finally:
        await node.close()
    found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    assert leaks.total(found) == 0, found


async def test_gc_after_crash(images_ready):
    """Simulate a crash: state db says nothing, but a container and its mounts exist."""
    node = await Node.open(_cfg())
    try:
        info = await node.sandbox_create(SandboxSpec(image="test/busybox"))
        # forget it as a crash would: drop the row without destroying anything
        node.table.remove(info.id)
        removed = await node.gc()
        assert removed["containers"] == 1 and removed["subvols"] == 1
    finally:
        await node.close()
    found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    assert leaks.total(found) == 0, found
    shutil.rmtree(RUN, ignore_errors=True)
