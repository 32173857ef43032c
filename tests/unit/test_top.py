"""``corral top``: one screen through the CLI runner, and the live view under tmux."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import corral
from corral.cli import app as cli_app
from corral.sdk._http import HTTPOps
from corral.spec import ExecRequest, SandboxSpec
from tests.observe_fakes import ObservedFakeNode, observed_app, serve, uds_socket

SRC = Path(__file__).parents[2] / "src"
ARTIFACTS = Path(os.environ.get("CORRAL_TEST_ARTIFACTS", "/tmp/corral-test-artifacts"))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="corral-top-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_top_once_shows_the_figures(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = ObservedFakeNode(short_dir)

    async def setup() -> None:
        info = await node.sandbox_create(SandboxSpec(image="demo/python", labels={"job": "t1"}))
        await node.exec(info.id, ExecRequest(cmd=["true"]))
        node.record_event(info.id, "seccomp", syscall="bpf")

    asyncio.run(setup())
    monkeypatch.setattr(cli_app, "_client_factory", lambda g: corral.AsyncClient(ops=node))
    args = ["top", "--once", "--label", "job=t1"]
    r = CliRunner().invoke(cli_app.app, args, env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    for text in ("corral top", "running", "best_effort", "create", "runtime_start", "seccomp"):
        assert text in r.output, (text, r.output)


def _tmux(sock: str, *args: str) -> str:
    return subprocess.run(
        ["tmux", "-L", sock, *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout


async def _screen_shows(sock: str, *texts: str) -> str:
    """Poll the pane until it shows every text (a readiness condition, no fixed sleep)."""
    screen = ""
    for _ in range(600):
        screen = await asyncio.to_thread(_tmux, sock, "capture-pane", "-p", "-t", "top")
        if all(t in screen for t in texts):
            return screen
        await asyncio.sleep(0.05)
    raise AssertionError(f"corral top never showed {texts}; screen:\n{screen}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
async def test_top_live_under_tmux(short_dir: Path) -> None:
    node = ObservedFakeNode(short_dir)
    api = short_dir / "api.sock"
    sock = f"corral-top-{os.getpid()}"
    async with serve(observed_app(node), uds_socket(api)):
        ops = HTTPOps(f"unix://{api}")
        cmd = (
            f"env -u COLUMNS -u LINES PYTHONPATH={SRC} {sys.executable} -c 'from corral.cli import main; main()' "
            f"--node unix://{api} top --interval 0.3 --label job=live"
        )
        _tmux(sock, "new-session", "-d", "-s", "top", "-x", "160", "-y", "60", cmd)
        try:
            await _screen_shows(sock, "corral top", "(no operations yet)")
            info = await ops.sandbox_create(
                SandboxSpec(image="demo/python", labels={"job": "live"})
            )
            await ops.exec(info.id, ExecRequest(cmd=["true"]))
            screen = await _screen_shows(sock, "runtime_start", "agent_round_trip", "running")
            assert "job=live" in screen
            node.record_event(info.id, "seccomp", syscall="keyctl")
            screen = await _screen_shows(sock, "seccomp", info.id)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / "top.txt").write_text(screen)
        finally:
            subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True, timeout=30)
            await ops.close()
            await node.close()


async def test_corral_ui_prints_a_one_time_url(short_dir: Path) -> None:
    node = ObservedFakeNode(short_dir)
    api = short_dir / "api.sock"
    async with serve(observed_app(node), uds_socket(api)):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from corral.cli import main; main()",
            "--node",
            f"unix://{api}",
            "ui",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(SRC)},
        )
        try:
            assert proc.stdout is not None
            header = await proc.stdout.readline()
            assert b"corral dashboard of unix://" in header
            url = (await proc.stdout.readline()).decode().strip()
            assert url.startswith("http://127.0.0.1:") and "/ui?token=" in url
            async with httpx.AsyncClient(follow_redirects=True) as browser:
                r = await browser.get(url)
                assert r.status_code == 200 and "<title>corral node</title>" in r.text
                assert (await browser.get(url)).status_code == 401  # spent
        finally:
            proc.terminate()
            await proc.wait()
        await node.close()


def test_corral_ui_needs_a_running_node(short_dir: Path) -> None:
    r = CliRunner().invoke(cli_app.app, ["--state-dir", str(short_dir), "ui"])
    assert r.exit_code == 2 and "corral node serve" in r.output


def test_top_on_a_node_without_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    from corral.testing import FakeNode

    monkeypatch.setattr(cli_app, "_client_factory", lambda g: corral.AsyncClient(ops=FakeNode()))
    r = CliRunner().invoke(cli_app.app, ["top", "--once"], env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    assert "(no operations yet)" in r.output and "corral top" in r.output
