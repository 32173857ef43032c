"""fncall logic without a kernel: checkers, verdicts, the worker's framing, the SDK over
the fake node and over HTTP, the CLI, the models' validation, the OCI config of pools."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import pytest

import corral
from corral.backends.fncall import worker
from corral.backends.fncall.checkers import check, judged, verdict_of
from corral.backends.fncall.config import DEFAULT_LANGUAGES, FnCallConfig
from corral.backends.oci import build_config, tmpfs_mounts
from corral.spec import CallRequest, CallResult, JudgeRequest, Limits, SandboxSpec
from corral.testing import FakeNode


# ----------------------------------------------------------------------------- checkers
@pytest.mark.parametrize(
    ("kind", "out", "exp", "ok"),
    [
        ("exact", "1 2\n", "1 2\n", True),
        ("exact", "1 2", "1 2\n", False),
        ("lines", "1 2  \n\n\n", "1 2\n", True),
        ("lines", "1\n2\n", "1 2\n", False),
        ("tokens", "1\n 2\t3", "1 2 3\n", True),
        ("tokens", "1 2", "1 2 3", False),
        ("float", "0.1000001 5", "0.1 5", True),
        ("float", "0.11 5", "0.1 5", False),
        ("float", "1e9", "1000000000.5", True),  # relative tolerance for large values
        ("float", "nan", "nan", True),  # identical tokens
        ("float", "nan", "0", False),
        ("float", "abc", "0", False),
    ],
)
def test_builtin_checkers(kind: str, out: str, exp: str, ok: bool) -> None:
    accepted, msg = check(kind, out, exp, tolerance=1e-6)
    assert accepted is ok
    assert bool(msg) is (not ok)


def test_unknown_checker_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown checker"):
        check("fuzzy", "", "")


def test_verdict_of_each_status() -> None:
    want = {
        "ok": None,
        "runtime_error": "RE",
        "timeout": "TLE",
        "memory_limit": "MLE",
        "output_limit": "OLE",
        "compile_error": "CE",
    }
    for status, verdict in want.items():
        assert verdict_of(CallResult(status=status)) == verdict  # type: ignore[arg-type]


async def test_judged_orders_cases_and_runs_custom_checkers_as_separate_calls() -> None:
    seen: list[CallRequest] = []

    async def run(req: CallRequest) -> CallResult:
        seen.append(req)
        d = json.loads(req.stdin)
        ok = d["output"].strip() == d["expected"].strip()
        return CallResult(
            status="ok" if ok else "runtime_error", exit_code=0 if ok else 1, stdout="msg"
        )

    req = JudgeRequest(
        language="python",
        code="x",
        tests=[corral.Case(stdin="a", expected="1"), corral.Case(stdin="b", expected="2")],
        checker=corral.CustomChecker(code="checker"),
    )
    results = [CallResult(status="ok", stdout="1\n"), CallResult(status="ok", stdout="3\n")]
    v = await judged(req, results, run)
    assert [c.verdict for c in v.cases] == ["AC", "WA"] and v.verdict == "WA"
    assert [json.loads(r.stdin)["input"] for r in seen] == ["a", "b"]
    assert all(r.code == "checker" for r in seen)


async def test_judged_stop_on_failure_keeps_the_first_failure() -> None:
    req = JudgeRequest(
        language="bash",
        code="x",
        tests=[corral.Case(expected="1")] * 3,
        stop_on_failure=True,
    )
    results = [CallResult(status="ok", stdout="1"), CallResult(status="timeout")]

    async def never(req: CallRequest) -> CallResult:
        raise AssertionError("no custom checker here")

    v = await judged(req, results, never)
    assert [c.verdict for c in v.cases] == ["AC", "TLE"] and v.verdict == "TLE"


async def test_a_broken_custom_checker_is_an_error_not_a_verdict() -> None:
    async def run(req: CallRequest) -> CallResult:
        return CallResult(status="timeout")

    req = JudgeRequest(
        language="python", code="x", tests=[corral.Case()], checker=corral.CustomChecker(code="c")
    )
    with pytest.raises(corral.SandboxError, match="custom checker failed"):
        await judged(req, [CallResult(status="ok")], run)


# ----------------------------------------------------------------------------- worker frames
def test_worker_frames_round_trip() -> None:
    r, w = os.pipe()
    try:
        worker._write_frame(w, {"a": 1}, b"out", b"err")
        header, payload = worker._read_frame(r)
    finally:
        os.close(r)
        os.close(w)
    assert header == {"a": 1} and payload == b"outerr"


def test_worker_read_frame_at_eof_raises() -> None:
    r, w = os.pipe()
    os.write(w, b"\x00\x00")
    os.close(w)
    try:
        with pytest.raises(EOFError):
            worker._read_frame(r)
    finally:
        os.close(r)


def test_worker_source_is_stdlib_only() -> None:
    # It runs with the image's python3 (-I): only the standard library is there for sure.
    import ast

    tree = ast.parse(Path(worker.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert names <= set(sys.stdlib_module_names), names - set(sys.stdlib_module_names)


_FAULTS = """
import os, resource, sys

def child_faults():
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    pid = os.fork()
    if pid == 0:
        compile("print(1)", "main.py", "exec")
        os._exit(0)
    os.waitpid(pid, 0)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before

cold = child_faults()  # before importing the worker: that may compile it
sys.path.insert(0, sys.argv[1])
import worker
worker._warm(worker.ctypes.CDLL(None, use_errno=True))
print(cold, child_faults())
"""


def test_worker_warm_up_spares_forked_calls_page_faults() -> None:
    # A call's child copies on write every page it touches: the first compile() of a
    # process touches ~2x the pages of later ones, so the worker does it once, for all.
    import py_compile
    import subprocess

    # The child imports the worker from its .pyc: compiling worker.py there would warm
    # the compiler before _warm runs, and hide whether it does anything.
    py_compile.compile(worker.__file__, doraise=True)

    out = subprocess.run(
        [sys.executable, "-I", "-c", _FAULTS, str(Path(worker.__file__).parent)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    cold, warm = map(int, out.split())
    assert warm * 1.5 < cold, (cold, warm)


# ----------------------------------------------------------------------------- models, config
def test_call_limits_parse_sizes_and_refuse_nonsense() -> None:
    lim = corral.CallLimits(memory="64MiB", output="1KiB")
    assert (lim.memory, lim.output) == (64 << 20, 1024)
    with pytest.raises(ValueError, match="cpu_time"):
        corral.CallLimits(cpu_time=0)
    with pytest.raises(ValueError, match="memory"):
        corral.CallLimits(memory="1KiB")


def test_sandbox_spec_tmpfs_validation() -> None:
    assert SandboxSpec(image="x", tmpfs={"/work": "1MiB"}).tmpfs == {"/work": 1 << 20}
    for bad in ("/proc/x", "relative", "/dev/shm", "/a/../b", "/"):
        with pytest.raises(ValueError):
            SandboxSpec(image="x", tmpfs={bad: "1MiB"})
    with pytest.raises(ValueError, match="size"):
        SandboxSpec(image="x", tmpfs={"/tmp": 1024})


def test_pool_sandbox_oci_config_is_readonly_with_tmpfs() -> None:
    cfg = build_config(
        rootfs=Path("/srv/r"),
        init_host_path=Path("/opt/init"),
        hostname="h",
        cgroups_path="/corral/x",
        limits=Limits(),
        extra_mounts=tmpfs_mounts({"/tmp": 1 << 20, "/work": 2 << 20}),
        readonly_root=True,
    )
    assert cfg["root"]["readonly"] is True
    tm = {m["destination"]: m for m in cfg["mounts"] if m["type"] == "tmpfs"}
    assert "size=1048576" in tm["/tmp"]["options"] and "nosuid" in tm["/work"]["options"]
    default = build_config(
        rootfs=Path("/srv/r"),
        init_host_path=Path("/opt/init"),
        hostname="h",
        cgroups_path="/corral/x",
        limits=Limits(),
    )
    assert default["root"]["readonly"] is False


def test_default_languages_and_config() -> None:
    assert set(DEFAULT_LANGUAGES) >= {"python", "bash", "c", "cpp"}
    assert DEFAULT_LANGUAGES["c"].compile and DEFAULT_LANGUAGES["python"].kind == "python"
    cfg = FnCallConfig.model_validate({"pools": [{"image": "demo/python", "size": 3}]})
    assert cfg.pools[0].size == 3 and cfg.call_uid != 0
    with pytest.raises(ValueError):
        FnCallConfig.model_validate({"call_uid": 0})


# ----------------------------------------------------------------------------- SDK on FakeNode
async def test_sdk_run_judge_map_on_the_fake_node() -> None:
    async with corral.AsyncClient(ops=FakeNode()) as c:
        r = await c.fncall.run("bash", "cat; echo oops >&2; exit 2", stdin="in")
        assert (r.status, r.stdout, r.stderr, r.exit_code) == ("runtime_error", "in", "oops\n", 2)
        v = await c.fncall.judge(
            "bash", "cat", [{"stdin": "1 2", "expected": "1  2\n"}], checker="tokens"
        )
        assert v.verdict == "AC" and v.passed == 1
        done: list[tuple[int, int]] = []
        out = await c.fncall.map(
            [{"language": "bash", "code": f"echo {i}"} for i in range(5)],
            concurrency=2,
            progress=lambda d, t: done.append((d, t)),
        )
        assert [r.stdout for r in out] == [f"{i}\n" for i in range(5)]  # type: ignore[union-attr]
        assert sorted(done) == [(i, 5) for i in range(1, 6)]


async def test_sdk_validates_before_sending() -> None:
    async with corral.AsyncClient(ops=FakeNode()) as c:
        with pytest.raises(corral.InvalidRequest, match="limits.cpu_time"):
            await c.fncall.run("bash", "true", limits={"cpu_time": -1})
        with pytest.raises(corral.InvalidRequest, match="tests"):
            await c.fncall.judge("bash", "true", [])
        with pytest.raises(corral.InvalidRequest, match="concurrency"):
            await c.fncall.map([], concurrency=0)


async def test_map_return_exceptions() -> None:
    async with corral.AsyncClient(ops=FakeNode()) as c:
        out = await c.fncall.map(
            [{"language": "bash", "code": "echo ok"}, {"language": "python", "code": "x"}],
            return_exceptions=True,
        )
        assert isinstance(out[0], corral.CallResult) and isinstance(out[1], corral.InvalidRequest)
        with pytest.raises(corral.InvalidRequest):
            await c.fncall.map([{"language": "python", "code": "x"}])


async def test_fncall_over_http() -> None:
    from corral.api.app import create_app
    from corral.sdk._http import HTTPOps

    node = FakeNode()
    ops = HTTPOps("http://corral.test", transport=httpx.ASGITransport(create_app(node)))
    async with corral.AsyncClient(ops=ops, own_ops=True) as c:
        r = await c.fncall.run("bash", "echo 42")
        assert (r.status, r.stdout) == ("ok", "42\n")
        v = await c.fncall.judge("bash", "echo 1", [corral.Case(expected="2\n")])
        assert v.verdict == "WA" and v.cases[0].message
        with pytest.raises(corral.InvalidRequest):
            await c.fncall.run("cobol", "x")


def test_sync_client_has_fncall() -> None:
    with corral.Client(ops=FakeNode()) as c:
        r = c.fncall.run("bash", "echo sync")
        assert r.stdout == "sync\n"


def test_cli_fncall_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import corral.cli.app as cli_app

    monkeypatch.setattr(cli_app, "_client_factory", lambda g: corral.AsyncClient(ops=FakeNode()))
    src = tmp_path / "a.sh"
    src.write_text("cat; exit 0")
    data = tmp_path / "in.txt"
    data.write_text("from stdin")
    r = CliRunner().invoke(
        cli_app.app, ["fncall", "run", "--lang", "bash", str(src), "--stdin", str(data)]
    )
    assert r.exit_code == 0 and "from stdin" in r.output
    src.write_text("exit 5")
    r = CliRunner().invoke(cli_app.app, ["fncall", "run", "--lang", "bash", str(src), "--json"])
    assert r.exit_code == 1 and json.loads(r.output)["exit_code"] == 5


def test_map_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    async def go() -> list[object]:
        async with corral.AsyncClient(ops=FakeNode()) as c:
            return await c.fncall.map([{"language": "bash", "code": "echo"}] * 3, progress=True)

    assert len(asyncio.run(go())) == 3
    assert capsys.readouterr().out == ""
