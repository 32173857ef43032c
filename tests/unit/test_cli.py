"""The ``corral`` CLI: sandbox and node commands against FakeNode (through the client
factory hook and through the real HTTP server), image commands against a real layer store
(mkfs.erofs), the terminal attach of ``sandbox shell`` on a real pty pair."""

from __future__ import annotations

import asyncio
import importlib.machinery
import json
import os
import signal
import socket
import struct
import sys
import termios
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import corral.cli.app as cli_app
from corral.api.server import NodeServer
from corral.cli import _pty
from corral.cli import node as node_cmd
from corral.cli._context import EMBEDDED, resolve_target
from corral.node import NodeConfig
from corral.sdk import AsyncClient
from corral.spec import ExecResult
from corral.testing import FakeNode


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNode:
    node = FakeNode(node_id="fake")
    monkeypatch.setattr(cli_app, "_client_factory", lambda g: AsyncClient(ops=node))
    return node


def cli(*args: str, input: str | bytes | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli_app.app, list(args), input=input)


def assert_user_error(r, *words: str) -> None:  # type: ignore[no-untyped-def]
    """Exit 2, one red error line naming ``words``, no traceback."""
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    assert isinstance(r.exception, SystemExit)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert r.stderr.startswith("error: ")
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def new_sandbox(*opts: str) -> str:
    r = cli("sandbox", "create", "demo/python", *opts)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


# ---------------------------------------------------------------------- sandbox commands
def test_create_prints_id_and_json(fake: FakeNode) -> None:
    sid = new_sandbox()
    assert sid.startswith("sb-")
    r = cli(
        "sandbox",
        "create",
        "demo/python",
        "--memory",
        "512MiB",
        "--cpus",
        "0.5",
        "--ttl",
        "60",
        "-l",
        "job=a",
        "--label",
        "k=v",
        "-e",
        "A=1",
        "--json",
    )
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["spec"]["limits"]["memory"] == 512 << 20
    assert info["spec"]["limits"]["cpus"] == 0.5
    assert info["spec"]["labels"] == {"job": "a", "k": "v"}
    assert info["spec"]["env"] == {"A": "1"}
    assert info["expires_at"] is not None


def test_create_errors_are_one_line_exit_2(fake: FakeNode) -> None:
    assert_user_error(cli("sandbox", "create", "nope/img"), "nope/img")
    r = cli("sandbox", "create", "demo/python", "--memory", "lots")
    assert_user_error(r, "--memory", "'lots' is not a size")
    assert "Value error" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert_user_error(cli("sandbox", "create", "demo/python", "--label", "novalue"), "KEY=VALUE")


def test_exec_streams_output_and_exits_with_its_code(fake: FakeNode) -> None:
    sid = new_sandbox()
    r = cli("sandbox", "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert r.exit_code == 3
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"
    # `--` is optional; options before the id are the CLI's, after it the command's.
    r = cli("sandbox", "exec", "--env", "X=42", "--cwd", "/tmp", sid, "printenv", "X")
    assert (r.exit_code, r.stdout) == (0, "42\n")
    r = cli("sandbox", "exec", "--cwd", "/tmp", sid, "pwd")
    assert r.stdout == "/tmp\n"


def test_exec_stdin_timeout_and_truncation(fake: FakeNode) -> None:
    sid = new_sandbox("--output", "1KiB")
    r = cli("sandbox", "exec", "--stdin", sid, "cat", input=b"piped\n")
    assert (r.exit_code, r.stdout) == (0, "piped\n")
    r = cli("sandbox", "exec", sid, "cat")  # without --stdin the command gets none
    assert (r.exit_code, r.stdout) == (0, "")
    r = cli("sandbox", "exec", "--timeout", "0.2", sid, "sleep", "5")
    assert r.exit_code == 124
    assert "timed out" in r.stderr
    r = cli("sandbox", "exec", sid, "echo", "x" * 3000)
    assert r.exit_code != 0 and "output limit" in r.stderr  # killed for it, as on a node
    assert len(r.stdout) == 1024
    assert "stdout was truncated" in r.stderr


def test_exec_unknown_sandbox_and_missing_command(fake: FakeNode) -> None:
    assert_user_error(cli("sandbox", "exec", "sb-000000000000", "true"), "sb-000000000000")
    sid = new_sandbox()
    assert_user_error(cli("sandbox", "exec", sid, "--"), "command")


def test_ls_info_events(fake: FakeNode) -> None:
    a = new_sandbox("-l", "job=a")
    b = new_sandbox("-l", "job=b")
    r = cli("sandbox", "ls")
    assert r.exit_code == 0
    assert a in r.stdout and b in r.stdout and "job=a" in r.stdout
    r = cli("sandbox", "ls", "--label", "job=b", "--json")
    assert [i["id"] for i in json.loads(r.stdout)] == [b]
    r = cli("--json", "sandbox", "ls", "--label", "job=none")
    assert json.loads(r.stdout) == []
    r = cli("sandbox", "info", a)
    assert json.loads(r.stdout)["id"] == a
    r = cli("sandbox", "events", a)
    assert r.exit_code == 0 and "created" in r.stdout
    r = cli("sandbox", "events", "--json")
    evs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["kind"] for e in evs] == ["created", "created"]
    # --after: only what follows an event's cursor
    r = cli("sandbox", "events", "--json", "--after", evs[0]["cursor"])
    assert [json.loads(line)["sandbox_id"] for line in r.stdout.splitlines()] == [b]
    assert_user_error(cli("sandbox", "events", "--after", "12"), "after")
    assert_user_error(cli("sandbox", "info", "sb-000000000000"), "sb-000000000000")
    # --follow ends once the sandbox is gone
    assert cli("sandbox", "rm", b).exit_code == 0
    r = cli("sandbox", "events", "--follow", b)
    assert r.exit_code == 0
    assert [ln.split()[2] for ln in r.stdout.splitlines()] == ["created", "destroyed"]


def test_rm(fake: FakeNode) -> None:
    a, b, c = new_sandbox("-l", "job=x"), new_sandbox("-l", "job=x"), new_sandbox()
    r = cli("sandbox", "rm", a)
    assert (r.exit_code, r.stdout) == (0, f"{a}\n")
    r = cli("sandbox", "rm", "--all", "--label", "job=x")
    assert (r.exit_code, r.stdout) == (0, f"{b}\n")
    assert_user_error(cli("sandbox", "rm", a), a)  # already gone
    r = cli("sandbox", "rm", c, a)  # one of several fails: the other is still removed
    assert r.exit_code == 2 and r.stdout == f"{c}\n" and a in r.stderr
    assert_user_error(cli("sandbox", "rm"), "--all")
    assert_user_error(cli("sandbox", "rm", "--label", "job=x"), "--all")
    new_sandbox()
    r = cli("sandbox", "rm", "--all")
    assert r.exit_code == 0 and len(r.stdout.split()) == 1
    assert json.loads(cli("sandbox", "ls", "--json").stdout) == []


def test_cp_both_ways(fake: FakeNode, tmp_path: Path) -> None:
    sid = new_sandbox()
    (tmp_path / "f.txt").write_text("hello")
    proj = tmp_path / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "a.py").write_text("A")
    (proj / "sub" / "b").write_text("B")

    def ok(*args: str) -> None:
        r = cli("sandbox", "cp", *args)
        assert r.exit_code == 0, r.stderr

    ok(str(tmp_path / "f.txt"), f"{sid}:/tmp")  # into a dir: keeps its name
    ok(str(tmp_path / "f.txt"), f"{sid}:/tmp/renamed.txt")  # new path: takes that name
    ok(str(proj), f"{sid}:/work")
    ok(str(proj), f"{sid}:/work/proj2")
    r = cli(
        "sandbox",
        "exec",
        sid,
        "cat",
        "/tmp/f.txt",
        "/tmp/renamed.txt",
        "/work/proj/a.py",
        "/work/proj2/sub/b",
    )
    assert r.stdout == "hellohelloAB"

    dl = tmp_path / "dl"
    dl.mkdir()
    ok(f"{sid}:/work/proj2", str(dl))
    ok(f"{sid}:/work/proj2", str(dl / "p3"))
    ok(f"{sid}:/tmp/renamed.txt", str(dl / "g.txt"))
    assert (dl / "proj2" / "sub" / "b").read_text() == "B"
    assert (dl / "p3" / "a.py").read_text() == "A"
    assert (dl / "g.txt").read_text() == "hello"
    assert sorted(p.name for p in dl.iterdir()) == ["g.txt", "p3", "proj2"]  # no staging left

    assert_user_error(cli("sandbox", "cp", str(proj), f"{sid}:/missing/x"), "/missing")
    assert_user_error(cli("sandbox", "cp", f"{sid}:/nope", str(dl)), "/nope")
    assert_user_error(cli("sandbox", "cp", str(proj), str(dl)), "exactly one side")
    assert_user_error(cli("sandbox", "cp", str(tmp_path / "absent"), f"{sid}:/tmp"), "absent")


def test_node_status_and_bad_global_options(fake: FakeNode) -> None:
    r = cli("node", "status", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["node_id"] == "fake"
    r = cli("node", "status")
    assert r.exit_code == 0 and "fake" in r.stdout
    assert "backend container" in r.stdout and "runtime=fake" in r.stdout
    assert_user_error(cli("--node", "ftp://x", "node", "status"), "--node")


def test_usage_errors_exit_2(fake: FakeNode) -> None:
    r = cli("sandbox", "frobnicate")
    assert r.exit_code == 2
    r = cli("image", "build", "floppy", "x", "--name", "a")
    assert r.exit_code == 2


def test_node_serve_refuses_open_tcp() -> None:
    assert_user_error(cli("node", "serve", "--tcp", "127.0.0.1:0"), "--token")
    assert_user_error(cli("node", "serve", "--tcp", "nonsense"), "HOST:PORT")
    assert_user_error(cli("node", "serve", "--token", "t"), "--tcp")
    # a malformed E2B template mapping is refused before the node opens
    assert_user_error(cli("node", "serve", "--e2b-template", "noequals"), "TEMPLATE=IMAGE")


def test_demo_and_bench_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    r = cli("--help")
    assert r.exit_code == 0
    for name in ("image", "sandbox", "node", "demo"):
        assert name in r.stdout
    # `corral bench` is whatever corral.bench.cli:app is, loaded only when asked for
    bench = types.ModuleType("corral.bench.cli")
    bench.__spec__ = importlib.machinery.ModuleSpec("corral.bench.cli", None)
    bench_app = bench.app = typer.Typer()  # type: ignore[attr-defined]

    @bench_app.command("hello")
    def hello(n: int = 1) -> None:
        typer.echo(f"bench hello {n}")

    @bench_app.command("other")
    def other() -> None:
        pass

    monkeypatch.setitem(sys.modules, "corral.bench.cli", bench)
    r = cli("bench", "hello", "--n", "3")
    assert (r.exit_code, r.stdout) == (0, "bench hello 3\n")
    assert "bench" in cli("--help").stdout
    # `corral demo` hands its options to corral.demo.run
    calls: list[tuple[int, NodeConfig]] = []
    demo = types.ModuleType("corral.demo")

    def run(count: int = 16, config: NodeConfig | None = None) -> int:
        assert config is not None
        calls.append((count, config))
        return 0

    demo.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "corral.demo", demo)
    r = cli("--state-dir", "/tmp/x", "demo", "--count", "3")
    assert r.exit_code == 0, r.stderr
    assert calls[0][0] == 3 and calls[0][1].state_dir == Path("/tmp/x")


# --------------------------------------------------------------------- target resolution
def test_resolve_target(tmp_path: Path) -> None:
    cfg = NodeConfig(state_dir=tmp_path, run_dir=tmp_path / "run")
    assert resolve_target(None, cfg) == EMBEDDED  # no socket file
    assert resolve_target("embedded", cfg) == EMBEDDED
    assert resolve_target("http://h:1", cfg) == "http://h:1"
    assert resolve_target("h:8700", cfg) == "http://h:8700"
    assert resolve_target("/x/api.sock", cfg) == "unix:///x/api.sock"
    sock_path = cfg.socket_path
    sock_path.parent.mkdir(parents=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(sock_path))
        assert resolve_target(None, cfg) == EMBEDDED  # bound, not listening: stale
        s.listen(1)
        assert resolve_target(None, cfg) == f"unix://{sock_path}"
        assert resolve_target(None, cfg, explicit_local=True) == EMBEDDED
    finally:
        s.close()


# ------------------------------------------------------------------ over the real HTTP API
@pytest.fixture
def http_node(tmp_path: Path) -> Iterator[tuple[str, FakeNode]]:
    """FakeNode served by the real API server on a unix socket, in a thread of its own."""
    node = FakeNode()
    sock = tmp_path / "api.sock"
    loop = asyncio.new_event_loop()
    server = NodeServer(node, uds=sock)
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            await server.start()
            ready.set()
            await server.wait()
            await server.stop()

        loop.run_until_complete(main())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield f"unix://{sock}", node
    finally:
        loop.call_soon_threadsafe(server.request_stop)
        t.join(15)
        loop.close()


def test_cli_over_http(http_node: tuple[str, FakeNode]) -> None:
    url, _ = http_node
    r = cli("--node", url, "sandbox", "create", "demo/python")
    assert r.exit_code == 0, r.stderr
    sid = r.stdout.strip()
    r = cli("--node", url, "sandbox", "exec", sid, "sh", "-c", "echo a; echo b >&2; exit 5")
    assert (r.exit_code, r.stdout, r.stderr) == (5, "a\n", "b\n")
    r = cli("--node", url, "sandbox", "ls", "--json")
    assert [i["id"] for i in json.loads(r.stdout)] == [sid]
    # over HTTP too now (tests/unit/test_pty_ws.py drives it on a real pty); CliRunner's
    # stdin is no terminal
    assert_user_error(cli("--node", url, "sandbox", "shell", sid), "terminal")
    assert_user_error(
        cli("--node", url, "sandbox", "exec", "sb-000000000000", "true"), "sb-000000000000"
    )
    assert_user_error(cli("--node", url, "node", "gc"), "gc")
    r = cli("--node", url, "sandbox", "rm", sid)
    assert r.exit_code == 0


def test_unreachable_node_is_a_clean_error(tmp_path: Path) -> None:
    r = cli("--node", f"unix://{tmp_path}/none.sock", "sandbox", "ls")
    assert r.exit_code == 2 and "Traceback" not in r.stderr


# ------------------------------------------------------------------------- node serve
async def test_serve_until_sigterm_then_close(tmp_path: Path) -> None:
    node = FakeNode(node_id="fake1")
    closed: list[bool] = []
    orig_close = node.close

    async def close() -> None:
        closed.append(True)
        await orig_close()

    node.close = close  # type: ignore[method-assign]

    async def open_node(cfg: NodeConfig) -> FakeNode:
        return node

    sock = tmp_path / "api.sock"
    task = asyncio.create_task(
        node_cmd._serve(
            NodeConfig(state_dir=tmp_path),
            uds=sock,
            host="127.0.0.1",
            port=0,
            token="secret",
            open_node=open_node,
        )
    )
    for _ in range(500):
        if sock.exists():
            break
        await asyncio.sleep(0.01)
    async with AsyncClient(f"unix://{sock}") as client:
        assert (await client.node_status()).node_id == "fake1"
    assert not closed
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 20)
    assert closed == [True]
    assert not sock.exists()


@pytest.mark.parametrize(("flags", "want"), [([], True), (["--e2b"], True), (["--no-e2b"], False)])
def test_serve_e2b_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], want: bool
) -> None:
    """``--e2b`` (the default, as the issue's example writes it) and ``--no-e2b`` reach
    the servers; what each serves is test_api_without_e2b."""
    got: list[bool] = []

    async def fake_serve(cfg: NodeConfig, **kw: object) -> None:
        got.append(bool(kw["e2b"]))

    monkeypatch.setattr(node_cmd, "_serve", fake_serve)
    r = cli("node", "serve", "--socket", str(tmp_path / "api.sock"), *flags)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert got == [want]


async def test_api_without_e2b() -> None:
    """``e2b=False``: E2B paths are corral's own 404s; by default the gateway answers."""
    import httpx

    from corral.api.app import create_app

    pytest.importorskip("e2b")
    for enabled, status in ((True, 401), (False, 404)):
        app = create_app(FakeNode(), token="t", e2b_enabled=enabled)
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://n.test") as c:
            r = await c.get("/v2/sandboxes", headers={"Authorization": "Bearer t"})
        assert r.status_code == status, (enabled, r.text)


# ------------------------------------------------------------------------ image commands
@pytest.fixture
def store_args(tmp_path: Path) -> list[str]:
    return ["--store", str(tmp_path / "store")]


def test_image_build_ls_inspect_compose_rm(tmp_path: Path, store_args: list[str]) -> None:
    base = tmp_path / "base"
    (base / "etc").mkdir(parents=True)
    (base / "etc" / "hello").write_text("hi\n")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "tool").write_text("#!/bin/sh\n")

    r = cli(
        "image",
        "build",
        "dir",
        str(base),
        "--name",
        "t/base",
        "-e",
        "A=1",
        "--workdir",
        "/etc",
        *store_args,
    )
    assert r.exit_code == 0, r.stderr
    base_layer = r.stdout.strip()
    assert base_layer.startswith("sha256:") and len(base_layer) == 71

    r = cli(
        "image",
        "build",
        "dir",
        str(extra),
        "--name",
        "t/tool",
        "--on",
        "t/base",
        "--dest",
        "/",  # a toolkit over the root, not a workspace (default /work): workdir inherited
        "--tag",
        "v1",
        "--json",
        *store_args,
    )
    assert r.exit_code == 0, r.stderr
    built = json.loads(r.stdout)
    tool_layer = built["layer"]["digest"]
    assert [i["name"] for i in built["images"]] == ["t/tool", "t/tool:v1"]
    assert built["images"][0]["layers"] == [base_layer, tool_layer]
    assert built["images"][0]["env"] == {"A": "1"}  # inherited from the base
    assert built["images"][0]["workdir"] == "/etc"

    r = cli("image", "ls", *store_args)
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "DIGEST", "LAYERS", "SIZE"]
    assert [ln.split()[0] for ln in lines[1:]] == ["t/base", "t/tool", "t/tool:v1"]
    assert lines[2].split()[2] == "2"

    r = cli("image", "inspect", "t/tool", *store_args)
    doc = json.loads(r.stdout)
    assert doc["layers"] == [base_layer, tool_layer]
    assert [d["kind"] for d in doc["layer_details"]] == ["dir", "dir"]

    r = cli("image", "layers", "--json", *store_args)
    assert {li["digest"] for li in json.loads(r.stdout)} == {base_layer, tool_layer}
    r = cli("image", "layers", *store_args)
    assert base_layer[7:19] in r.stdout

    # compose: an image name brings all its layers; a layer by digest or unique prefix
    r = cli("image", "compose", "t/mix", "t/base", tool_layer[7:19], "--json", *store_args)
    assert r.exit_code == 0, r.stderr
    mix = json.loads(r.stdout)
    assert mix["layers"] == [base_layer, tool_layer] and mix["workdir"] == "/etc"
    r = cli("image", "compose", "t/flat", tool_layer, "--json", *store_args)
    assert json.loads(r.stdout)["layers"] == [tool_layer]
    assert_user_error(cli("image", "compose", "t/bad", "t/nope", *store_args), "t/nope")
    assert_user_error(cli("image", "compose", "t/bad", "abcdef0123", *store_args), "abcdef0123")

    r = cli("image", "rm", "t/mix", "t/tool:v1", *store_args)
    assert (r.exit_code, r.stdout.split()) == (0, ["t/mix", "t/tool:v1"])
    assert_user_error(cli("image", "rm", "t/mix", *store_args), "t/mix")
    assert_user_error(cli("image", "inspect", "t/mix", *store_args), "t/mix")
    names = [i["name"] for i in json.loads(cli("image", "ls", "--json", *store_args).stdout)]
    assert names == ["t/base", "t/flat", "t/tool"]


def test_image_build_usage_errors(tmp_path: Path, store_args: list[str]) -> None:
    assert_user_error(cli("image", "build", "dir", str(tmp_path), *store_args), "--name")
    assert_user_error(cli("image", "build", "dir", "--name", "x", *store_args), "SOURCE")
    assert_user_error(
        cli("image", "build", "pip", "--req", "six", "--name", "x", *store_args), "--on"
    )
    assert_user_error(
        cli("image", "build", "dir", str(tmp_path / "no"), "--name", "x", *store_args),
        "not a directory",
    )
    assert_user_error(
        cli("image", "build", "dir", str(tmp_path), "--name", "x", "--on", "t/none", *store_args),
        "t/none",
    )


# -------------------------------------------------------------------- the shell terminal
class _EchoPty:
    """Stands in for Node.pty: echoes input upper-cased; Ctrl-D (in raw mode just a byte)
    ends the session with exit code 7."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.resizes: list[tuple[int, int]] = []
        self.result: ExecResult | None = None
        self.pid, self.cmd = 1, ["echo"]

    async def __aenter__(self) -> _EchoPty:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self._out()

    async def _out(self):  # type: ignore[no-untyped-def]
        while (data := await self.inbox.get()) is not None:
            yield data.upper()
            if b"\x04" in data:
                break
        self.result = ExecResult(exit_code=7, reason="exited")

    async def write(self, data: bytes) -> None:
        await self.inbox.put(data)

    async def resize(self, rows: int, cols: int) -> None:
        self.resizes.append((rows, cols))

    async def close_stdin(self) -> None:
        await self.inbox.put(None)

    async def signal(self, sig: int) -> None:
        await self.inbox.put(None)


async def _read_until(fd: int, want: bytes, timeout: float = 5.0) -> bytes:
    got = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    os.set_blocking(fd, False)
    while want not in got:
        try:
            got += os.read(fd, 1024)
        except BlockingIOError:
            if loop.time() > deadline:
                raise AssertionError(f"wanted {want!r}, got {got!r}") from None
            await asyncio.sleep(0.01)
    return got


async def test_pty_attach_raw_mode_resize_restore() -> None:
    master, slave = os.openpty()
    out_r, out_w = os.pipe()
    try:
        fcntl_winsize = struct.pack("HHHH", 40, 120, 0, 0)
        import fcntl

        fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl_winsize)
        assert _pty.window_size(slave) == (40, 120)
        before = termios.tcgetattr(slave)
        stream = _EchoPty()
        task = asyncio.create_task(_pty.attach(stream, stdin_fd=slave, stdout_fd=out_w))
        deadline = time.monotonic() + 30
        while termios.tcgetattr(slave)[3] & termios.ECHO and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # until attach has put the terminal in raw mode
        # raw mode: no local echo, no line buffering, Ctrl-C is just a byte
        assert not termios.tcgetattr(slave)[3] & termios.ECHO
        os.write(master, b"hi\x03")
        assert await _read_until(out_r, b"HI\x03") == b"HI\x03"
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 132, 0, 0))
        os.kill(os.getpid(), signal.SIGWINCH)
        for _ in range(100):
            if stream.resizes:
                break
            await asyncio.sleep(0.01)
        assert stream.resizes == [(50, 132)]
        os.write(master, b"\x04")
        result = await asyncio.wait_for(task, 5)
        assert _pty.exit_status(result) == 7
        assert termios.tcgetattr(slave) == before  # terminal restored
    finally:
        for fd in (master, slave, out_r, out_w):
            os.close(fd)


def test_pty_exit_status() -> None:
    assert _pty.exit_status(ExecResult(exit_code=0, reason="exited")) == 0
    assert _pty.exit_status(ExecResult(exit_code=None, signal=9, reason="signaled")) == 137
    assert _pty.exit_status(None) == 1
