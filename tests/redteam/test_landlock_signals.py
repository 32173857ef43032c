"""Signals to PID 1: root in the guest (CAP_KILL) cannot send PID 1 any signal.

Guest commands run in a landlock domain scoped against signals (corral-init, landlock ABI
6+) that PID 1 is outside of: kill(1, sig) fails with EPERM for every signal, even 0. Without
landlock it would succeed for the signals PID 1's pid namespace lets through (all but
KILL/STOP, which the kernel drops for a namespace's init). A signal aimed at one of PID 1's
threads stays pending there (all blocked). Processes of different commands share the
domain, so the guest can still signal its own processes across exec calls.
"""

from __future__ import annotations

import pytest

from tests.redteam.conftest import out, run

KILL_PID1 = r"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
for sig in (0, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD,
            signal.SIGKILL, signal.SIGSTOP, signal.SIGRTMIN):
    r = libc.kill(1, sig)
    print("kill", int(sig), 0 if r == 0 else ctypes.get_errno())
# every thread of PID 1, directly (tgkill), with what could stop or end it
for tid in sorted(int(t) for t in os.listdir("/proc/1/task")):
    for sig in (signal.SIGTERM, signal.SIGSTOP, signal.SIGKILL):
        r = libc.syscall(234, 1, tid, sig)  # tgkill
        print("tgkill", tid, int(sig), 0 if r == 0 else ctypes.get_errno())
"""


async def test_guest_cannot_signal_pid1(red_node, guest):  # type: ignore[no-untyped-def]
    if (await red_node.node_status()).landlock < 6:
        pytest.skip("no landlock scoping on this kernel")
    await guest.files.write("/tmp/kill1.py", KILL_PID1)
    r = await run(guest, "grep CapEff /proc/self/status; python3 /tmp/kill1.py")
    assert r.exit_code == 0, out(r)
    lines = r.stdout.decode().splitlines()
    cap_eff = int(lines[0].split()[1], 16)
    assert cap_eff & (1 << 5), f"the attacker should have CAP_KILL: {lines[0]}"
    kills = [line.split() for line in lines if line.startswith("kill ")]
    assert len(kills) == 9 and all(k[2] == "1" for k in kills), out(r)  # EPERM each
    # PID 1's main thread, addressed directly, is outside the domain too; the spawner thread
    # is inside (it forks the guest's commands), so those signals are merely ignored.
    main = [t.split() for t in lines if t.startswith("tgkill 1 ")]
    assert len(main) == 3 and all(t[3] == "1" for t in main), out(r)
    # Signals aimed at PID 1's threads changed nothing: it still serves.
    r2 = await run(guest, "echo alive; cat /proc/1/status | grep -E '^State'")
    lines = r2.stdout.decode().split()
    assert lines[:2] == ["alive", "State:"] and lines[2] in ("S", "R"), out(r2)  # not T


async def test_guest_signals_its_own_processes_across_calls(guest):  # type: ignore[no-untyped-def]
    """One domain for every command: a process started by one call can be signalled by
    another (a background server killed later), as without landlock."""
    p = await guest.spawn(["sleep", "300"])
    r = await run(
        guest,
        'for d in /proc/[0-9]*; do [ "$(cat $d/comm 2>/dev/null)" = sleep ] && pid=${d#/proc/}; '
        "done; kill -TERM $pid; echo rc=$?",
    )
    assert r.stdout.strip() == b"rc=0", out(r)
    res = await p.wait(timeout=30)
    assert res.signal == 15, res
