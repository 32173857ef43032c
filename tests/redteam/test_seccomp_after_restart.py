"""After an agent restart the seccomp notification fds of running sandboxes are gone (they
lived only in the old agent). The refused calls stay refused (the kernel answers ENOSYS
when nobody listens), the adopted sandbox says so in its event log, and a sandbox created
by the new agent is watched and logged again.

The attack this opens: with corral's listener gone, the kernel would let the guest install
a listener of its own, receive the notifications of the calls corral refuses and answer
them "continue". The profile forbids guest listeners, so that stays refused too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import corral
from corral.node import Node
from tests.conftest import TAG
from tests.integration.conftest import node_config
from tests.redteam.conftest import IMAGE, probe_results, upload_probe
from tests.redteam.test_seccomp_own_listener import PROBE as OWN_LISTENER

STATE = Path(f"/var/lib/corral-test{TAG}-restart")
RUN = Path(f"/run/corral-test{TAG}-restart")
SUBTREE = f"corral-test{TAG}-restart"

PROBE = r"""
#include <errno.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    printf("bpf %d\n", syscall(SYS_bpf, 0, 0, 0) < 0 ? errno : 0);
    printf("keyctl %d\n", syscall(SYS_keyctl, 0, -3, 0, 0, 0) < 0 ? errno : 0);
    return 0;
}
"""
EPERM, ENOSYS = 1, 38


async def _probe(sb: corral.Sandbox) -> dict[str, int]:
    await upload_probe(sb, PROBE)
    r = await sb.exec(["/tmp/probe"], timeout=30)
    return probe_results(r)


async def test_refused_calls_stay_refused_across_restart(images_ready):  # type: ignore[no-untyped-def]
    cfg = node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE)
    node = await Node.open(cfg)
    try:
        async with corral.AsyncClient(ops=node, own_ops=False) as c:
            old = await c.sandboxes.create(image=IMAGE)
            assert await _probe(old) == {"bpf": EPERM, "keyctl": EPERM}
        await node.close()  # the sandbox keeps running
        node = await Node.open(cfg)
        async with corral.AsyncClient(ops=node, own_ops=False) as c:
            old = await c.sandboxes.get(old.id)
            assert await _probe(old) == {"bpf": ENOSYS, "keyctl": ENOSYS}
            await upload_probe(old, OWN_LISTENER, "/tmp/own")
            got = probe_results(await old.exec(["timeout", "20", "/tmp/own"], timeout=30))
            assert got == {"own_listener": ENOSYS, "io_uring_setup": ENOSYS}, got  # no listener
            kinds = [e.kind for e in await old.events()]
            assert kinds.count("seccomp") == 2 and "seccomp_unwatched" in kinds, kinds
            new = await c.sandboxes.create(image=IMAGE)
            assert await _probe(new) == {"bpf": EPERM, "keyctl": EPERM}
            assert {e.detail.get("syscall") for e in await new.events()} >= {"bpf", "keyctl"}
            assert node.security.listener is not None
            assert node.security.listener.watched() == {new.id}
            # The agent's next sandbox gets crun's compiled filter from its cache
            # (run.oci.seccomp_bpf_data), notify rules and all, and is logged just the same.
            again = await c.sandboxes.create(image=IMAGE)
            assert await _probe(again) == {"bpf": EPERM, "keyctl": EPERM}
            assert {e.detail.get("syscall") for e in await again.events()} >= {"bpf", "keyctl"}
            if node.runtime.name == "crun":
                cfg = json.loads((node.backend.dir(again.id) / "config.json").read_text())
                assert "run.oci.seccomp_bpf_data" in cfg["annotations"]
    finally:
        for info in await node.sandbox_list():
            await node.sandbox_destroy(info.id)
        await node.close()
        shutil.rmtree(RUN, ignore_errors=True)
