"""The guest greps the whole filesystem for secrets of the platform.

Canaries sit where a careless platform would leave them reachable: the node's state dir
(next to its SQLite database), the database itself (a neighbour's labels and env), a
neighbour's files (written through the files API) and a hidden-tests directory on the host.
"""

from __future__ import annotations

from tests.redteam.conftest import RED_STATE, new_canary, out, run

SEARCH = (
    # -a: binary files too; -o prints only the match, so a hit is itself a canary leak.
    "timeout -s KILL 40 grep -rao --exclude=pagemap 'CRLCAN[A]RY[0-9a-f]*' / 2>/dev/null | head -50;"
    "timeout -s KILL 20 find / -iname '*canary*' 2>/dev/null | head -50;"
    "echo search-done"
)


async def test_no_platform_secret_is_reachable(red_client, guest, make_sandbox, plant_canary):  # type: ignore[no-untyped-def]
    plant_canary(RED_STATE / "redteam-{c}.txt")
    plant_canary(RED_STATE / "sandboxes" / "redteam-secret.txt")
    plant_canary("/var/lib/corral-hidden-tests-red/{c}/test_hidden.py")
    plant_canary("/tmp/corral-red-hidden/{c}")
    label, env = new_canary(), new_canary()  # stored in the node's state.db
    victim = await make_sandbox(labels={"secret": label}, env={"SECRET": env})
    in_victim = new_canary()
    await victim.files.write(f"/work/{in_victim}.txt", in_victim)
    await victim.files.write("/tmp/secret.txt", in_victim)
    assert (await victim.files.read("/tmp/secret.txt")).decode() == in_victim

    r = await run(guest, SEARCH, timeout=80)
    assert r.reason == "exited" and r.stdout.endswith(b"search-done\n"), out(r)
    # the search works: a canary the guest itself owns is found
    own = "CRLCANARY" + "0" * 24
    await guest.files.write("/tmp/own.txt", own)
    r = await run(guest, "grep -rlo 'CRLCAN[A]RY0*' /tmp")
    assert r.stdout == b"/tmp/own.txt\n", out(r)
