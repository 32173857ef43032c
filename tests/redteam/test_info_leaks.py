"""What the guest learns about the host without breaking anything.

Not escapes, but maps for one: host paths, the host's boot command line, physical kernel
addresses, other cgroups, other network devices.
"""

from __future__ import annotations

import socket

from tests.redteam.conftest import RED_RUN, RED_STATE, new_canary, out, run, watch


async def test_mountinfo_shows_no_host_paths(guest, red_node):  # type: ignore[no-untyped-def]
    """No mount the guest can list names where the node keeps its state: overlayfs shows
    its layer options as given (corral gives /proc/self/fd/N), and the init is bound from
    a tmpfs of its own (root /corral-init), not from the node's state dir."""
    r = await run(guest, "cat /proc/self/mountinfo /proc/1/mountinfo /proc/self/mounts")
    assert r.exit_code == 0 and b" /.corral/init " in r.stdout, out(r)
    cfg = red_node.config
    for host_path in (cfg.state_dir, cfg.run_dir, cfg.store_dir, RED_STATE, RED_RUN):
        assert str(host_path).encode() not in r.stdout, (host_path, out(r))
    init = next(line for line in r.stdout.split(b"\n") if b" /.corral/init " in line)
    assert init.split()[3] == b"/corral-init", init


async def test_host_identity_hidden(guest):  # type: ignore[no-untyped-def]
    r = await run(
        guest,
        "hostname; cat /proc/sys/kernel/hostname; ls /sys/class/net; "
        "cat /proc/self/cgroup | cut -d: -f3 | sort -u; head -c 100 /proc/cmdline | wc -c",
    )
    lines = r.stdout.decode().split()
    assert lines[:2] == ["sandbox", "sandbox"], out(r)
    assert socket.gethostname() not in lines or socket.gethostname() == "sandbox"
    assert lines[2:] == ["lo", "/", "0"], out(r)  # own netns, own cgroup root, masked cmdline


async def test_cgroup_view_is_own(guest):  # type: ignore[no-untyped-def]
    """The guest's /sys/fs/cgroup is its own cgroup (read-only), with its own limits."""
    r = await run(
        guest,
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max; "
        "ls /sys/fs/cgroup/memory | grep -c '^corral' ; "
        "echo 1 > /sys/fs/cgroup/pids/pids.max; echo rc=$?",
    )
    lines = r.stdout.decode().split()
    assert lines[:2] == [str(256 << 20), "256"], out(r)
    assert lines[2] == "0" and lines[3] == "rc=1", out(r)


async def test_node_environment_not_inherited(make_sandbox, monkeypatch):  # type: ignore[no-untyped-def]
    """The node's own environment (tokens, credentials of its operator) never reaches a
    guest: not through the runtime, the init, exec or the shell."""
    c = new_canary()
    monkeypatch.setenv("CORRAL_RED_NODE_SECRET", c)
    sb = await make_sandbox(guest=True)
    r = await run(sb, "env; tr '\\0' '\\n' < /proc/self/environ; cat /proc/1/environ; echo end")
    assert r.stdout.endswith(b"end\n"), out(r)
    shell = await sb.shell()
    r = await shell.run("env")
    watch(r.stdout + r.stderr)
    p = await sb.spawn(["env"])
    res = await p.wait(timeout=30)
    watch(res.stdout + res.stderr)
