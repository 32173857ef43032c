"""A real node with ``layer_linger``: the image's layers stay mounted after its last
sandbox goes, the next create takes them without verifying them again, and the node's
sweeper unmounts them once the linger is up (and sleeps while none lingers); closing the
node unmounts lingering layers."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from corral.host import mounts
from corral.spec import ExecRequest, SandboxSpec
from tests.conftest import TAG
from tests.integration.conftest import assert_no_leaks, node_config, open_node

STATE = Path(f"/var/lib/corral-test{TAG}-linger")
RUN = Path(f"/run/corral-test{TAG}-linger")
SUBTREE = f"corral-test{TAG}-linger"


async def test_layers_linger_then_the_sweeper_unmounts_them(images_ready) -> None:  # type: ignore[no-untyped-def]
    cfg = node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, layer_linger=0.5)
    spec = SandboxSpec(image="test/busybox")
    try:
        async with open_node(cfg) as node:
            layers = node.backend.layers  # type: ignore[attr-defined]
            verified: list[str] = []
            real_verify = layers._verify
            layers._verify = lambda d: (verified.append(d), real_verify(d))[1]
            looks: list[float | None] = []  # the sweeper's looks at the lingering layers
            real_next_due = layers.next_due
            layers.next_due = lambda: (looks.append(real_next_due()), looks[-1])[1]

            info = await node.sandbox_create(spec)
            await node.sandbox_destroy(info.id)
            digests = list(info.layers)
            assert sorted(layers.lingering()) == sorted(set(digests))
            assert layers.mounted() == {}
            first = len(verified)
            assert first == len(set(digests))  # each verified at its first mount

            info = await node.sandbox_create(spec)  # takes the lingering mounts
            r = await node.exec(info.id, ExecRequest(cmd=["echo", "again"]))
            assert r.stdout == b"again\n"
            assert len(verified) == first and layers.lingering() == []
            await node.sandbox_destroy(info.id)

            # The sweeper sleeps until the linger is up: readiness, polled by loop turns.
            points = [layers._lower(d) for d in digests]
            async with asyncio.timeout(60):
                while layers.lingering():
                    await asyncio.sleep(0.05)
            assert not any(mounts.is_mountpoint(p) for p in points)
            # Then nothing lingers: once it has seen that, it waits for the next layer to
            # linger without looking again. A check that nothing happens needs a wait: 1 s
            # is 8 of the old loop's looks (every quarter linger); it cannot fail by being
            # slow.
            async with asyncio.timeout(60):
                while looks[-1] is not None:
                    await asyncio.sleep(0.05)
            n = len(looks)
            await asyncio.sleep(1.0)
            assert len(looks) == n and not layers.lingering(), looks[n:]

            info = await node.sandbox_create(spec)  # mounted (and verified) afresh
            assert len(verified) == 2 * first
            await node.sandbox_destroy(info.id)
            assert layers.lingering()  # left lingering: the node's close takes it
        assert_no_leaks(STATE, RUN, SUBTREE)
    finally:
        shutil.rmtree(STATE, ignore_errors=True)
