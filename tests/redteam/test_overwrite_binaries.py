"""The guest overwrites its shell, env, the dynamic loader and tries corral-init itself.

The platform's next ``exec /bin/sh`` in *this* sandbox runs the guest's copy; that is the
guest's own business. What must hold: the init is untouched (read-only bind of a host
file), the init still answers, the node's file API still works on the sandbox, and a FRESH
sandbox from the same image has pristine binaries (the image layers are read-only and
shared, the writes went to this sandbox's upper layer only).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.redteam.conftest import RED_STATE, out, run

TARGETS = (
    "/bin/bash",
    "/bin/sh",  # -> dash
    "/usr/bin/env",
    "/lib64/ld-linux-x86-64.so.2",  # -> the loader in /lib/x86_64-linux-gnu
    "/usr/bin/python3",  # -> python3.11
)
EVIL = b"#!/bin/sh\necho PWNED\n"

# One python process does every write: after the loader is gone, no dynamic program starts.
ATTACK = f"""
import os
for p in {TARGETS!r}:
    try:
        with open(p, "wb") as f: f.write({EVIL!r})  # in place (through symlinks)
    except OSError:  # ETXTBSY: this very python; replace the file instead
        real = os.path.realpath(p); os.unlink(real)
        with open(real, "wb") as f: f.write({EVIL!r})
for p, how in (("/.corral/init", "w"), ("/.corral/init", "rm"), ("/.corral/init", "chmod"),
               ("/.corral", "rename")):
    try:
        if how == "w": open(p, "wb").write(b"x")
        elif how == "rm": os.unlink(p)
        elif how == "chmod": os.chmod(p, 0o777)
        else: os.rename(p, "/corral-moved")
        print(p, how, "DONE")
    except OSError as e: print(p, how, e.__class__.__name__, e.errno)
"""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _init_binaries() -> dict[Path, str]:
    return {p: _sha(p.read_bytes()) for p in (RED_STATE / "bin").glob("corral-init-*")}


async def test_overwrites_stay_in_the_sandbox(red_node, guest, make_sandbox):  # type: ignore[no-untyped-def]
    if not (await guest.files.exists("/lib64/ld-linux-x86-64.so.2")):
        import pytest

        pytest.skip("image has no x86-64 loader")
    init_before = _init_binaries()
    assert init_before
    pristine = {p: _sha(await guest.files.read(p)) for p in TARGETS}
    # the same as the image layer itself, as mounted on the host
    for digest in guest.info.layers:
        layer = RED_STATE / "mnt" / "raw" / digest
        if (layer / "usr/bin/env").exists():
            assert _sha((layer / "usr/bin/env").read_bytes()) == pristine["/usr/bin/env"]

    await guest.files.write("/tmp/attack.py", ATTACK)
    r = await run(guest, "python3 /tmp/attack.py")
    assert r.exit_code == 0, out(r)
    lines = r.stdout.decode().splitlines()
    assert lines[:3] == [
        "/.corral/init w OSError 30",  # EROFS: read-only bind
        "/.corral/init rm OSError 16",  # EBUSY: a mount point
        "/.corral/init chmod OSError 30",
    ], out(r)
    # Renaming the *parent* of the mount point is allowed (the mount moves along). Harmless:
    # PID 1 is already running and nothing execs /.corral/init again; the bind's source on
    # the host is what must stay untouched (checked below).
    assert lines[3] in ("/.corral rename DONE", "/.corral rename OSError 16"), out(r)
    if lines[3].endswith("DONE"):
        await guest.files.write("/.corral/init", EVIL, mode=0o755)

    # the node's file API still works on the broken sandbox
    for p in TARGETS:
        assert await guest.files.read(p) == EVIL
    await guest.files.write("/tmp/note", b"ok")
    assert await guest.files.read("/tmp/note") == b"ok"
    # the init still answers; a static program uploaded by the node still runs
    await guest.files.write("/tmp/busybox", Path("/bin/busybox").read_bytes(), mode=0o755)
    real_init = "/corral-moved/init" if lines[3].endswith("DONE") else "/.corral/init"
    r = await guest.exec(["/tmp/busybox", "sha256sum", real_init, "/bin/bash"])
    assert r.exit_code == 0, out(r)
    in_guest = dict(reversed(line.split()) for line in r.stdout.decode().splitlines())
    assert in_guest[real_init] in init_before.values()
    assert in_guest["/bin/bash"] == _sha(EVIL)
    # (exec of /bin/sh now runs the guest's copy: a script naming itself as interpreter,
    # which the kernel refuses with ELOOP. The guest broke its own sandbox, nothing else.)
    r = await guest.exec(["/bin/sh", "-c", "true"])
    assert r.exit_code != 0 and r.reason == "exited", out(r)
    assert _init_binaries() == init_before

    fresh = await make_sandbox()
    r = await fresh.exec(["sha256sum", "/.corral/init"])
    assert r.stdout.split()[0].decode() in init_before.values(), out(r)
    for p in TARGETS:
        assert _sha(await fresh.files.read(p)) == pristine[p], p
    r = await fresh.exec(["sha256sum", *TARGETS])
    assert r.exit_code == 0, out(r)
    assert [line.split()[0] for line in r.stdout.decode().splitlines()] == [
        pristine[p] for p in TARGETS
    ]
