"""The suite's own detectors work: a canary that does reach guest output is reported, and
an attack that leaves no event is reported as not logged."""

from __future__ import annotations

from tests.redteam.conftest import _WATCH, missing_events, new_canary, run


async def test_canary_detector_fires(guest):  # type: ignore[no-untyped-def]
    c = new_canary()
    await guest.files.write("/work/leak.txt", f"x {c} y")  # as if it had leaked in
    r = await run(guest, "grep -rao 'CRLCAN[A]RY[0-9a-f]*' /work; echo done")
    assert r.stdout.splitlines()[-1] == b"done"
    assert _WATCH.leaked() == [c]
    # and the search pattern itself never matches (it is in the guest's /proc/*/cmdline)
    _WATCH.seen.clear()
    r = await run(
        guest,
        "rm /work/leak.txt; grep -rao --exclude=pagemap 'CRLCAN[A]RY[0-9a-f]*' /proc /work; echo done",
    )
    assert r.stdout == b"done\n"
    assert _WATCH.leaked() == []


async def test_event_check_fires(red_node, guest):  # type: ignore[no-untyped-def]
    r = await run(guest, "python3 -c 'import ctypes; ctypes.CDLL(None).syscall(321, 0, 0, 0)'")
    assert r.exit_code == 0
    assert await missing_events(red_node, [("seccomp", {"syscall": "bpf"})]) == []
    missing = await missing_events(
        red_node, [("seccomp", {"syscall": "kexec_load"}), ("pids_limit", {})]
    )
    assert len(missing) == 2 and "kexec_load" in missing[0], missing
