"""The agent restarts while sandboxes keep running: corral's listener (and its notification
fd) goes away with the old agent, but the node's fd holder (corral.host.fdstore) keeps a
dup, so the next agent takes the fd back and refused calls of adopted sandboxes are still
refused with EPERM *and* recorded. A refused call made while no agent runs waits in the
kernel and is answered once the agent is back. If the holder is gone (killed; a reboot
takes the sandboxes too), refused calls still fail (ENOSYS), the guest still cannot
install a listener of its own to answer them, and the sandbox is marked
``seccomp_unwatched``. gc ends a stale holder; none is left once the sandboxes are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

import corral
from corral.cli.node import _gc
from corral.host import fdstore, leaks
from corral.host.cgroups import Cgroups
from corral.node import Node
from tests.conftest import TAG
from tests.integration.conftest import node_config
from tests.redteam.conftest import (
    IMAGE,
    RED_RUN,
    probe_results,
    run,
    upload_probe,
)
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
SYS_BPF = 321


async def _probe(sb: corral.Sandbox) -> dict[str, int]:
    await upload_probe(sb, PROBE)
    r = await sb.exec(["/tmp/probe"], timeout=30)
    return probe_results(r)


def _cfg():  # type: ignore[no-untyped-def]
    return node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE)


def _holders() -> list[int]:
    return [int(h.split()[0]) for h in leaks.fd_holders([RUN])]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _notify_files(pid: int) -> int:
    """How many seccomp notification files process ``pid`` has open (kernel figure)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:seccomp notify"
    return n


async def _notify_files_become(pid: int, n: int) -> None:
    for _ in range(200):  # put/drop are one-way messages: the holder acts a moment later
        if _notify_files(pid) == n:
            return
        await asyncio.sleep(0.01)
    assert _notify_files(pid) == n


async def _seccomp_since(sb: corral.Sandbox, t0: float) -> set[str]:
    return {
        str(e.detail.get("syscall"))
        for e in await sb.events()
        if e.kind == "seccomp" and e.time >= t0
    }


async def _waiting_in_bpf(sid: str, timeout: float = 20) -> int:
    """A process of the sandbox that sits in bpf(2) (kernel figure: /proc/PID/syscall),
    found through its cgroup without opening a node (which would answer it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in Cgroups(SUBTREE).procs(sid):
            try:
                nr = Path(f"/proc/{pid}/syscall").read_text().split()[0]
            except (OSError, IndexError):
                continue
            if nr == str(SYS_BPF):
                return pid
        await asyncio.sleep(0.05)
    raise AssertionError("no process of the sandbox is waiting in bpf()")


@pytest.fixture
async def fresh_node_dirs(images_ready):  # type: ignore[no-untyped-def]
    """Cleans up this file's node (sandboxes, holder, run dir) whatever the test left."""
    yield
    node = await Node.open(_cfg())
    try:
        await node.gc(everything=True)
    finally:
        await node.close()
    left = _holders()
    for pid in left:  # only a bug leaves one: end it, then fail below
        if fdstore.is_holder(pid, RUN):
            os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    shutil.rmtree(RUN, ignore_errors=True)
    assert not left, f"fd holder left behind: {left}"


async def test_refused_calls_are_recorded_across_restart(fresh_node_dirs):  # type: ignore[no-untyped-def]
    """After an agent restart an adopted sandbox's refused calls get EPERM and are logged.

    (This file's nodes are its own, opened and closed by the tests, so the events are
    asserted inline rather than with ``@pytest.mark.logs``, which reads ``red_node``.)"""
    node = await Node.open(_cfg())
    try:
        async with corral.AsyncClient(ops=node, own_ops=False) as c:
            old = await c.sandboxes.create(image=IMAGE)
            assert await _probe(old) == {"bpf": EPERM, "keyctl": EPERM}
            holder = node.security.fdstore.pid if node.security.fdstore else None
            assert holder is not None and _holders() == [holder]
            assert os.getsid(holder) == holder  # detached from the agent: its own session
            await _notify_files_become(holder, 1)  # it keeps the sandbox's listener open
            # A refused call made while no agent runs: it waits for the next one.
            await upload_probe(old, PROBE, "/tmp/late")
            r = await old.exec(
                ["sh", "-c", "setsid -f sh -c 'sleep 5; /tmp/late > /tmp/late.out' "
                 "</dev/null >/dev/null 2>&1"],
                timeout=30,
            )  # fmt: skip
            assert r.exit_code == 0, r
        await node.close()  # the sandbox keeps running, and so does the holder
        assert _holders() == [holder]
        waiting = await _waiting_in_bpf(old.id)  # no agent: it neither fails nor runs
        await asyncio.sleep(0.5)
        assert Path(f"/proc/{waiting}/syscall").read_text().split()[0] == str(SYS_BPF)

        t0 = time.time()
        node = await Node.open(_cfg())
        async with corral.AsyncClient(ops=node, own_ops=False) as c:
            old = await c.sandboxes.get(old.id)
            assert node.security.listener is not None
            assert node.security.listener.watched() == {old.id}
            for _ in range(200):  # the waiting call is answered as soon as the fd is back
                if (await old.exec(["cat", "/tmp/late.out"], timeout=30)).stdout:
                    break
                await asyncio.sleep(0.05)
            late = (await old.exec(["cat", "/tmp/late.out"], timeout=30)).stdout.decode()
            assert late.split() == ["bpf", "1", "keyctl", "1"], late
            assert await _probe(old) == {"bpf": EPERM, "keyctl": EPERM}
            assert await _seccomp_since(old, t0) >= {"bpf", "keyctl"}
            kinds = [e.kind for e in await old.events()]
            assert "seccomp_unwatched" not in kinds, kinds
            # Corral's listener is back, so the guest cannot install one of its own.
            await upload_probe(old, OWN_LISTENER, "/tmp/own")
            got = probe_results(await old.exec(["timeout", "20", "/tmp/own"], timeout=30))
            assert got == {"own_listener": EPERM, "io_uring_setup": EPERM}, got
            assert await _seccomp_since(old, t0) >= {"seccomp", "io_uring_setup"}
            new = await c.sandboxes.create(image=IMAGE)
            assert await _probe(new) == {"bpf": EPERM, "keyctl": EPERM}
            assert await _seccomp_since(new, t0) >= {"bpf", "keyctl"}
            assert node.security.listener.watched() == {old.id, new.id}
            assert node.security.fdstore is not None
            assert node.security.fdstore.held() == {old.id, new.id}
            await _notify_files_become(holder, 2)
            assert _holders() == [holder]  # the same holder served both agents
            await new.destroy()
            assert node.security.fdstore.held() == {old.id}
            await old.destroy()
            assert node.security.fdstore.held() == set()
            await _notify_files_become(holder, 0)
        await node.close()
    finally:
        await node.close()  # idempotent; the fixture destroys what a failure left
    # Every sandbox destroyed and the node closed: the holder is gone, and so are its files.
    assert _gone(holder) and _holders() == []
    assert not (RUN / fdstore.SOCK_NAME).exists() and not (RUN / fdstore.PID_NAME).exists()


async def test_without_the_holder_refused_calls_stay_refused(fresh_node_dirs):  # type: ignore[no-untyped-def]
    """The fd holder killed: refused calls still fail (ENOSYS), no guest listener, marked."""
    node = await Node.open(_cfg())
    try:
        async with corral.AsyncClient(ops=node, own_ops=False) as c:
            old = await c.sandboxes.create(image=IMAGE)
            assert await _probe(old) == {"bpf": EPERM, "keyctl": EPERM}
        await node.close()
        [holder] = _holders()
        os.kill(holder, signal.SIGKILL)  # the holder is lost (by its pid, we started it)
        while not _gone(holder):
            await asyncio.sleep(0.01)
        node = await Node.open(_cfg())
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
            if node.backend.runtime.name == "crun":
                cfg = json.loads((node.backend.dir(again.id) / "config.json").read_text())
                assert "run.oci.seccomp_bpf_data" in cfg["annotations"]
            for sb in (old, new, again):
                await sb.destroy()
        await node.close()
    finally:
        await node.close()  # idempotent; the fixture destroys what a failure left
    assert _holders() == []


async def test_node_gc_ends_a_stale_holder(fresh_node_dirs):  # type: ignore[no-untyped-def]
    """gc ends a holder that stopped answering (or cannot be reached) and hands a new one
    the live fds, so refused calls neither hang nor go unrecorded."""
    node = await Node.open(_cfg())
    try:
        async with corral.AsyncClient(ops=node, own_ops=False) as c:
            sb = await c.sandboxes.create(image=IMAGE)
            [stuck] = _holders()
            os.kill(stuck, signal.SIGSTOP)  # a holder that no longer answers
            removed = await node.gc()
            assert removed["sandboxes"] == 0
            assert _gone(stuck)  # ended by its recorded pid
            [holder] = _holders()
            assert holder != stuck and node.security.fdstore is not None
            assert node.security.fdstore.held() == {sb.id}  # the live fds, handed again
        await node.close()
        node = await Node.open(_cfg())
        async with corral.AsyncClient(ops=node, own_ops=False) as c:
            sb = await c.sandboxes.get(sb.id)
            t0 = time.time()
            assert await _probe(sb) == {"bpf": EPERM, "keyctl": EPERM}  # via the new holder
            assert await _seccomp_since(sb, t0) >= {"bpf", "keyctl"}
        await node.close()

        # `corral node gc` with the holder unreachable (its socket was removed): ended too.
        (RUN / fdstore.SOCK_NAME).unlink()
        await _gc(_cfg(), everything=False)
        assert _gone(holder) and _holders() == []
        node = await Node.open(_cfg())
        async with corral.AsyncClient(ops=node, own_ops=False) as c:
            sb = await c.sandboxes.get(sb.id)
            # No fd anywhere now: the call fails at once (it does not hang) and is marked.
            assert await _probe(sb) == {"bpf": ENOSYS, "keyctl": ENOSYS}
            assert "seccomp_unwatched" in [e.kind for e in await sb.events()]
            await sb.destroy()
        await node.close()
    finally:
        await node.close()  # idempotent; the fixture destroys what a failure left
    assert _holders() == []


async def test_guest_cannot_reach_the_fd_holder(red_node, guest):  # type: ignore[no-untyped-def]
    """The guest looks for the fd holder's socket and process: neither is in its world."""
    store = red_node.security.fdstore
    assert store is not None and store.pid is not None
    sock = RED_RUN / fdstore.SOCK_NAME
    assert sock.exists()  # on the host
    r = await run(
        guest,
        f"test -e {sock} && echo visible; test -e {RED_RUN} && echo rundir; "
        "find / -xdev -name 'fdstore*' 2>/dev/null; "
        "grep -ls 'corral-fdstor[e]' /proc/[0-9]*/cmdline; "
        f'python3 -c "import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n'
        f"try: s.connect('{sock}')\nexcept OSError as e: print('connect', e.errno)\"",
    )
    assert r.stdout == b"connect 2\n", r  # ENOENT: the path is not in its mount namespace
