"""The guest looks for its neighbour: processes, files, SysV IPC, network."""

from __future__ import annotations

import asyncio
import secrets

from tests.redteam.conftest import new_canary, out, run

PS = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"


async def _until_running(sb, cmdline: str) -> None:  # type: ignore[no-untyped-def]
    """Wait until a process of ``sb`` reads ``cmdline``: spawn returns once the init forked,
    and until its exec the child still reads /.corral/init."""
    async with asyncio.timeout(30):
        while cmdline not in (await run(sb, PS)).stdout.decode():
            await asyncio.sleep(0.01)


async def test_neighbour_processes_invisible(guest, neighbour):  # type: ignore[no-untyped-def]
    marker = f"{secrets.randbelow(10**6) + 1000}.{secrets.randbelow(999) + 1}"
    await neighbour.spawn(["sleep", marker])
    await _until_running(neighbour, f"sleep {marker}")  # it runs
    r = await run(guest, PS + "; ls /proc | grep -c '^[0-9]'")
    assert marker not in r.stdout.decode(), out(r)
    # the guest sees only its init, bash and the loop's processes
    assert int(r.stdout.split()[-1]) < 10, out(r)


async def test_neighbour_files_invisible(guest, neighbour):  # type: ignore[no-untyped-def]
    c = new_canary()
    await neighbour.files.write(f"/work/{c}", c)
    await neighbour.files.write("/root/secret", c)
    r = await run(
        guest,
        "find / -xdev -iname '*canary*' 2>/dev/null; "
        "timeout -s KILL 30 grep -rao --exclude=pagemap 'CRLCAN[A]RY[0-9a-f]*' / 2>/dev/null;"
        "echo done",
    )
    assert r.stdout.endswith(b"done\n"), out(r)


async def test_sysv_ipc_is_private(guest, neighbour):  # type: ignore[no-untyped-def]
    r = await run(neighbour, "ipcmk -M 4096 && ipcmk -Q && ipcmk -S 1 && ipcs -m -q -s")
    assert r.exit_code == 0 and r.stdout.count(b"0x") >= 3, out(r)
    r = await run(guest, "ipcs -m -q -s | grep -c '^0x'")
    assert r.stdout.strip() == b"0", out(r)


LISTEN = (
    "import socket,time\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', 8080)); s.listen()\n"
    "while True:\n"
    "    c,_=s.accept(); c.sendall(b'NEIGHBOUR'); c.close()\n"
)
CONNECT = (
    "import socket,sys\n"
    "for host in ('127.0.0.1', '::1', '0.0.0.0'):\n"
    "    try:\n"
    "        s=socket.create_connection((host, 8080), timeout=2); print(host, s.recv(20))\n"
    "    except OSError as e: print(host, type(e).__name__)\n"
)


async def test_neighbour_network_unreachable(guest, neighbour):  # type: ignore[no-untyped-def]
    await neighbour.spawn(["python3", "-c", LISTEN])
    for _ in range(100):
        r = await run(neighbour, f'python3 -c "{CONNECT}"')
        if b"NEIGHBOUR" in r.stdout:
            break
        await asyncio.sleep(0.1)
    assert b"NEIGHBOUR" in r.stdout, out(r)  # the server is up, for the neighbour
    r = await run(guest, f'python3 -c "{CONNECT}"')
    assert b"NEIGHBOUR" not in r.stdout and r.stdout.count(b"Error") == 3, out(r)


async def test_kill_all_reaches_only_own_namespace(guest, neighbour):  # type: ignore[no-untyped-def]
    """Both sandboxes run as the same host uid (100000): only the pid namespace keeps a
    guest's ``kill -9 -1`` from reaching the neighbour."""
    marker = f"{secrets.randbelow(10**6) + 1000}.{secrets.randbelow(999) + 1}"
    await neighbour.spawn(["sleep", marker])
    await _until_running(neighbour, f"sleep {marker}")
    r = await run(guest, "kill -9 -1; echo sent", timeout=10)
    r = await run(neighbour, PS)
    assert f"sleep {marker}" in r.stdout.decode(), out(r)
    r = await run(guest, "echo alive")  # its own init survives as well
    assert r.stdout == b"alive\n", out(r)
