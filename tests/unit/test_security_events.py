"""The security event log without a kernel: coalescing, bounds, the summary and its
plumbing (FakeNode, SDK, REST API through the HTTP client, CLI), the seccomp profile's
notify rules, and ``corral redteam``'s suite lookup and failure reporting."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import corral
import corral.cli.app as cli_app
from corral.api import create_app
from corral.cli import redteam
from corral.errors import CorralError
from corral.host.seccomp_notify import SeccompCall, syscall_name
from corral.node.security import SecurityLog, describe_call
from corral.node.state import StateStore
from corral.policy import seccomp
from corral.sdk import AsyncClient
from corral.sdk._http import HTTPOps
from corral.testing import FakeNode

X86_64 = 0xC000003E


def _call(name_nr: int, *args: int) -> SeccompCall:
    return SeccompCall(nr=name_nr, arch=X86_64, args=(*args, 0, 0, 0, 0, 0, 0)[:6], pid=1)


def test_describe_call_names_the_deciding_argument() -> None:
    assert syscall_name(X86_64, 321) == "bpf"
    key, d = describe_call(_call(16, 3, 0xDEAD000040049409))  # ioctl(fd, FICLONE | hi bits)
    assert key == "ioctl:0x40049409" and d == {
        "syscall": "ioctl",
        "comm": None,
        "arg": "0x40049409",
        "what": "FICLONE",
    }
    key, d = describe_call(_call(41, 17, 3))  # socket(AF_PACKET, SOCK_RAW)
    assert key == "socket:17" and d["what"] == "AF_PACKET"
    key, d = describe_call(_call(41, 2, 3 | 0o4000))  # socket(AF_INET, SOCK_RAW|NONBLOCK)
    assert key == "socket:2:raw" and d["what"] == "AF_INET SOCK_RAW"
    key, d = describe_call(_call(259, -100 & 0xFFFFFFFF, 0, 0o060600, 0))  # mknodat blk
    assert key == "mknodat:0o60000" and d["what"] == "S_IFBLK"
    key, d = describe_call(_call(272, 0x10000000))  # unshare(CLONE_NEWUSER)
    assert key == "unshare:0x10000000"


def test_repeats_coalesce_into_counted_events(tmp_path: Path) -> None:
    st = StateStore(tmp_path / "s.db")
    log = SecurityLog(st.add_event, window=3600)
    log.record_call("sb-a", _call(321))
    log.record_call("sb-b", _call(321))
    assert log.flush() == 2  # the first of each is news at once
    for _ in range(999):
        log.record_call("sb-a", _call(321))
    assert log.flush() == 0  # the repeats wait for the window
    evs = st.events()
    assert [(e.sandbox_id, e.detail["count"]) for e in evs] == [("sb-a", 1), ("sb-b", 1)]
    assert log.pending() == [("sb-a", "seccomp", 999)]
    assert log.flush("sb-a", final=True) == 1  # destroy: everything pending, then forget
    last = st.events()[-1]
    assert last.detail["count"] == 999 and last.detail["first"] <= last.detail["last"]
    counts = st.event_counts(kinds=["seccomp"])
    assert sorted(counts) == [("sb-a", "seccomp", 1000), ("sb-b", "seccomp", 1)]
    st.close()


def test_distinct_keys_per_sandbox_are_bounded(tmp_path: Path) -> None:
    st = StateStore(tmp_path / "s.db")
    log = SecurityLog(st.add_event, window=3600, max_keys=8)
    for cmd in range(10_000):  # a guest walking the ioctl space
        log.record_call("sb-a", _call(16, 3, 0x9400 | cmd << 16))
    log.flush("sb-a", final=True)
    evs = st.events()
    assert len(evs) <= 9
    assert sum(int(e.detail["count"] or 0) for e in evs) == 10_000
    assert any(e.detail.get("note") for e in evs)  # the overflow key says so
    st.close()


def test_counters_record_only_growth(tmp_path: Path) -> None:
    st = StateStore(tmp_path / "s.db")
    log = SecurityLog(st.add_event)
    log.seen("sb-a", {"pids_limit": 5})  # adopted with 5 refusals already counted
    log.check_counter("sb-a", "pids_limit", 5)
    log.check_counter("sb-a", "pids_limit", 12)
    log.flush("sb-a", final=True)
    assert [(e.kind, e.detail["count"]) for e in st.events()] == [("pids_limit", 7)]
    st.close()


def test_notify_rules_do_not_change_what_is_allowed() -> None:
    plain = seccomp.default_profile()
    notify = seccomp.default_profile(notify="/run/x/seccomp.sock")
    assert notify["listenerPath"] == "/run/x/seccomp.sock" and "listenerPath" not in plain
    assert [r for r in notify["syscalls"] if r["action"] != "SCMP_ACT_NOTIFY"] == plain["syscalls"]
    notified = {
        n for r in notify["syscalls"] if r["action"] == "SCMP_ACT_NOTIFY" for n in r["names"]
    }
    assert {"bpf", "mount", "ptrace", "ioctl", "socket", "clone"} <= notified
    assert not notified & set(seccomp.ALLOWED)  # only calls the allowlist refuses
    assert not notified & seccomp.QUIET
    # the ioctl notify cubes are exactly the refused commands
    cubes = [
        (a["value"], a["valueTwo"])
        for r in notify["syscalls"]
        if r["action"] == "SCMP_ACT_NOTIFY" and r["names"] == ["ioctl"]
        for a in r["args"]
    ]
    for cmd in (0x40049409, 0x9401, 0x5877, 0x1272, 0x5412, 0x541B, 0x8004667D):
        assert any(cmd & m == v for m, v in cubes) == (not seccomp.ioctl_allowed(cmd)), hex(cmd)


async def _two_jobs(c: AsyncClient, node: FakeNode) -> tuple[str, str]:
    a = await c.sandboxes.create(image="demo/base", labels={"job": "rl-42"})
    b = await c.sandboxes.create(image="demo/base", labels={"job": "other"})
    node.record_event(a.id, "seccomp", syscall="bpf", count=3)
    node.record_event(a.id, "pids_limit", count=1)
    node.record_event(b.id, "seccomp", syscall="mount")
    return a.id, b.id


async def test_summary_and_kind_filter_through_the_sdk() -> None:
    node = FakeNode()
    async with AsyncClient(ops=node) as c:
        a, b = await _two_jobs(c, node)
        s = await c.events_summary(labels={"job": "rl-42"})
        assert s.sandboxes == {a: {"created": 1, "seccomp": 3, "pids_limit": 1}}
        assert s.totals == {"created": 1, "seccomp": 3, "pids_limit": 1}
        s = await c.events_summary(kinds=["seccomp"])
        assert s.totals == {"seccomp": 4} and set(s.sandboxes) == {a, b}
        sb = await c.sandboxes.get(a)
        assert [e.kind for e in await sb.events(kinds=["pids_limit"])] == ["pids_limit"]
        assert len(await c.events(kinds=["seccomp", "pids_limit"])) == 3
        with pytest.raises(corral.InvalidRequest, match="kinds"):
            await c.events(kinds="seccomp")


@pytest.fixture
async def http_ops() -> AsyncIterator[tuple[HTTPOps, FakeNode]]:
    node = FakeNode()
    app = create_app(node)  # type: ignore[arg-type]
    ops = HTTPOps("http://corral.test", transport=httpx.ASGITransport(app))
    try:
        yield ops, node
    finally:
        await ops.close()


async def test_summary_and_kinds_over_rest(http_ops: tuple[HTTPOps, FakeNode]) -> None:
    ops, node = http_ops
    async with AsyncClient(ops=ops, own_ops=False) as c:
        a, b = await _two_jobs(c, node)
        s = await c.events_summary(labels={"job": "rl-42"}, kinds=["seccomp"])
        assert s.sandboxes == {a: {"seccomp": 3}} and s.labels == {"job": "rl-42"}
        evs = await c.events(sandbox_id=b, kinds=["seccomp"])
        assert [e.detail["syscall"] for e in evs] == ["mount"]
        evs = await c.events(labels={"job": "rl-42"}, kinds=["pids_limit"])
        assert [e.kind for e in evs] == ["pids_limit"]


def test_cli_events_summary_table_and_json(monkeypatch: pytest.MonkeyPatch) -> None:
    node = FakeNode()
    monkeypatch.setattr(cli_app, "_client_factory", lambda g: AsyncClient(ops=node))
    import asyncio

    async def setup() -> str:
        async with AsyncClient(ops=node, own_ops=False) as c:
            return (await _two_jobs(c, node))[0]

    a = asyncio.run(setup())
    runner = CliRunner()
    r = runner.invoke(cli_app.app, ["events", "summary", "--label", "job=rl-42"])
    assert r.exit_code == 0, r.output
    assert a in r.stdout and "seccomp" in r.stdout and "total" in r.stdout
    r = runner.invoke(cli_app.app, ["events", "summary", "-k", "seccomp", "--json"])
    assert json.loads(r.stdout)["totals"] == {"seccomp": 4}
    r = runner.invoke(cli_app.app, ["sandbox", "events", a, "--kind", "pids_limit"])
    assert r.exit_code == 0 and "pids_limit" in r.stdout and "seccomp" not in r.stdout


def test_redteam_needs_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = Path(__file__).resolve().parents[2]
    assert redteam.find_suite(repo / "src") == repo / "tests" / "redteam"
    monkeypatch.setattr(redteam, "__file__", str(tmp_path / "x.py"))
    with pytest.raises(CorralError, match="tests/redteam"):
        redteam.find_suite(tmp_path)


def test_redteam_table_marks_failures() -> None:
    attacks = [
        redteam.Attack("kernel::bpf", expects=["seccomp"], blocked=True, logged=True),
        redteam.Attack("fs::walk", blocked=True),
        redteam.Attack("net::x", expects=["net_denied"], blocked=True, logged=False, detail="no"),
        redteam.Attack("leak::y", blocked=False, detail="HOLE"),
    ]
    assert [a.ok for a in attacks] == [True, True, False, False]
    from rich.console import Console

    con = Console(width=200, record=True)
    con.print(redteam.table(attacks))
    text = con.export_text()
    assert "n/a" in text and "NO" in text and "HOLE" in text
