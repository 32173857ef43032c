"""Red-team suite: each attack is one small file run by a hostile guest in a REAL sandbox.

The guest is root inside its sandbox and tries to reach the host, the node or a neighbour.
Every test asserts that the attack failed *and* that the host and the neighbours are
unharmed. A new attack is one file ``test_<name>.py`` using these fixtures and helpers:

* ``red_node`` (session): a real :class:`corral.node.Node` with its own state dir, run dir
  and cgroup subtree, so the suite never touches the integration tests' node.
* ``guest``: a fresh sandbox from ``test/debian`` (destroyed after the test). Everything it
  prints through :func:`run` is recorded for the canary check.
* ``neighbour``: a second sandbox on the same node, the victim.
* ``make_sandbox(guest=False, **spec)``: more sandboxes (other limits, a fresh copy of the
  image), destroyed after; ``guest=True`` puts their output under the canary check.
* ``plant_canary(path)``: writes a fresh random canary string into a host file (created
  with its parents, removed after the test) and returns it; ``new_canary()`` returns one to
  put elsewhere (a neighbour's file, a label). At teardown the test fails if any recorded
  guest output (or data the guest got through the API, see :func:`watch`) contains one.
* :func:`run` ``(sandbox, script) -> ExecResult``: ``bash -c script`` in the sandbox.
* :func:`upload_probe` compiles a small static C program on the host and writes it into a
  sandbox through the files API; :func:`probe_results` parses its ``name errno`` lines.
* :func:`assert_healthy` : the node answers and a sandbox still runs commands.

Canaries are ``CRLCANARY`` + 24 hex digits. A guest script that searches for them must not
contain the literal prefix (its own /proc/PID/cmdline would match): write ``CRLCAN[A]RY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

import corral
from corral.sdk import Process, Sandbox
from corral.spec import ExecResult
from tests.conftest import TAG
from tests.integration.conftest import images_ready, open_node  # noqa: F401

BACKEND = os.environ.get("CORRAL_RED_BACKEND", "container")
"""The engine of ``guest``, ``neighbour`` and ``make_sandbox``: ``container`` (default) or
``microvm`` (``CORRAL_RED_BACKEND=microvm``: the attacks below that apply to a VM guest
run against microVMs; the others are skipped)."""

VM_ATTACKS = {
    "test_background_flood.py::test_background_output_is_capped_and_logged",
    "test_output_and_disk.py::test_output_is_capped",
    "test_search_platform_files.py::test_no_platform_secret_is_reachable",
    "test_cross_sandbox.py::test_neighbour_files_invisible",
    "test_cross_sandbox.py::test_sysv_ipc_is_private",
    "test_cross_sandbox.py::test_neighbour_network_unreachable",
    "test_cross_sandbox.py::test_kill_all_reaches_only_own_namespace",
    "test_info_leaks.py::test_node_environment_not_inherited",
}
"""The attacks that apply to a microVM guest as written (files, output, neighbours, the
node's secrets). The rest test container mechanisms a VM guest does not have (seccomp,
Landlock, the host kernel's /proc and cgroup views, the cgroup OOM of the guest's own
processes) or expect a container's process count; the VM-specific attacks are in
tests/integration/test_microvm.py."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="red-team tests need root (a real node)")
        for item in items:
            if "tests/redteam/" in str(item.fspath):
                item.add_marker(skip)
    if BACKEND == "microvm":
        not_vm = pytest.mark.skip(reason="a container attack that does not apply to a VM guest")
        for item in items:
            if "tests/redteam/" in str(item.fspath):
                if f"{Path(str(item.fspath)).name}::{item.name}" not in VM_ATTACKS:
                    item.add_marker(not_vm)


RED_STATE = Path(f"/var/lib/corral-test{TAG}-red")
RED_RUN = Path(f"/run/corral-test{TAG}-red")
RED_SUBTREE = f"corral-test{TAG}-red"
IMAGE = "test/debian"
CANARY_PREFIX = "CRLCANARY"
GUEST_LIMITS = corral.Limits(cpus=1, memory="256MiB", pids=256, disk="256MiB")
"""Limits of ``guest`` and ``neighbour`` (one core each on a 2-core machine)."""


# ------------------------------------------------------------------ canary bookkeeping


class _Watch:
    """What guests produced during the current test, and the canaries planted in it."""

    def __init__(self) -> None:
        self.guest_ids: set[str] = set()
        self.seen: list[bytes] = []
        self.canaries: set[str] = set()

    def leaked(self) -> list[str]:
        found = []
        for c in sorted(self.canaries):
            needle = c.encode()
            if any(needle in blob for blob in self.seen):
                found.append(c)
        return found


_WATCH = _Watch()


def new_canary() -> str:
    """A fresh canary string, checked against guest output at the end of the test."""
    c = CANARY_PREFIX + secrets.token_hex(12)
    _WATCH.canaries.add(c)
    return c


def watch(data: bytes | str) -> None:
    """Record data a guest obtained (e.g. bytes the files API returned for its paths)."""
    _WATCH.seen.append(data.encode() if isinstance(data, str) else data)


@pytest.fixture(autouse=True)
def _canary_check() -> Iterator[None]:
    _WATCH.seen.clear()
    _WATCH.canaries.clear()
    _WATCH.guest_ids.clear()
    yield
    leaked = _WATCH.leaked()
    assert not leaked, f"HOLE: guest output contained host/neighbour canaries {leaked}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "logs(kind, **detail): the attack must leave an event of this kind (whose detail "
        "has these values) on a guest sandbox; checked after the test",
    )


NOT_LOGGED = "NOT LOGGED"
"""Prefix of the failure when an attack was blocked but left no event (corral redteam)."""


@pytest.fixture(autouse=True)
async def _logged_check(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """``@pytest.mark.logs("seccomp", syscall="bpf")``: after the test (the guests are
    destroyed by then, their events stay), some guest has an event of that kind."""
    marks = list(request.node.iter_markers("logs"))
    node = request.getfixturevalue("red_node") if marks else None
    yield
    if node is not None:
        missing = await missing_events(node, [(m.args[0], m.kwargs) for m in marks])
        assert not missing, f"{NOT_LOGGED}: " + "; ".join(missing)


async def missing_events(node: object, wanted: list[tuple[str, dict[str, object]]]) -> list[str]:
    """Which (kind, detail) expectations no event of this test's guests meets."""
    events = [
        e
        for sid in sorted(_WATCH.guest_ids)
        for e in await node.events(sandbox_id=sid)  # type: ignore[attr-defined]
    ]
    seen = sorted({e.kind for e in events})
    return [
        f"no {kind!r} event with {want} on the guests (kinds: {seen})"
        for kind, want in wanted
        if not any(
            e.kind == kind and all(e.detail.get(k) == v for k, v in want.items()) for e in events
        )
    ]


@pytest.fixture
def plant_canary() -> Iterator[Callable[[str | Path], str]]:
    """``plant_canary(path) -> canary``: write a canary into a host file.

    The file (and any parent directories it needed) is removed after the test. A ``{c}``
    in the path is replaced by the canary itself, so the file *name* is a canary too
    (``find -name`` attacks).
    """
    created: list[Path] = []

    def plant(path: str | Path) -> str:
        c = new_canary()
        p = Path(str(path).replace("{c}", c))
        missing = [d for d in reversed(p.parents) if not d.exists()]
        p.parent.mkdir(parents=True, exist_ok=True)
        created.extend(reversed(missing))  # deepest first at cleanup
        p.write_text(f"secret {c}\n")
        created.insert(0, p)
        return c

    yield plant
    for p in created:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------------- node, sandboxes


@pytest.fixture(scope="session")
async def red_node(images_ready):  # type: ignore[no-untyped-def]  # noqa: F811
    kw: dict[str, object] = {}
    if BACKEND == "microvm":
        from corral.backends.config import ContainerConfig, MicroVMConfig

        kernel = Path("/var/cache/corral-test-microvm/kernel")  # test_microvm.py's cache
        kw["backends"] = [ContainerConfig(), MicroVMConfig(kernel_dir=kernel)]
    async with open_node(
        state_dir=RED_STATE, run_dir=RED_RUN, cgroup_subtree=RED_SUBTREE, **kw
    ) as n:
        yield n


@pytest.fixture(scope="session")
async def red_client(red_node):  # type: ignore[no-untyped-def]
    async with corral.AsyncClient(ops=red_node, own_ops=False) as c:
        yield c


async def _sandbox(client: corral.AsyncClient, **kw: object) -> Sandbox:
    kw.setdefault("limits", GUEST_LIMITS)
    if BACKEND != "container":
        kw.setdefault("backend", BACKEND)
        kw.setdefault("qos", "latency")  # a TCG boot on idle CPU only takes minutes
    return await client.sandboxes.create(image=IMAGE, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def guest(red_client) -> AsyncIterator[Sandbox]:  # type: ignore[no-untyped-def]
    """The attacker: a fresh sandbox whose output is checked for canaries."""
    sb = await _sandbox(red_client, labels={"redteam": "guest"})
    _WATCH.guest_ids.add(sb.id)
    try:
        yield sb
    finally:
        await sb.destroy()


@pytest.fixture
async def neighbour(red_client) -> AsyncIterator[Sandbox]:  # type: ignore[no-untyped-def]
    """The victim: another sandbox on the same node."""
    sb = await _sandbox(red_client, labels={"redteam": "neighbour"})
    try:
        yield sb
    finally:
        await sb.destroy()


@pytest.fixture
async def make_sandbox(red_client) -> AsyncIterator[Callable[..., object]]:  # type: ignore[no-untyped-def]
    """``await make_sandbox(guest=False, **spec)``: more sandboxes, destroyed after."""
    made: list[Sandbox] = []

    async def make(guest: bool = False, **kw: object) -> Sandbox:
        sb = await _sandbox(red_client, **kw)
        made.append(sb)
        if guest:
            _WATCH.guest_ids.add(sb.id)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            with contextlib.suppress(corral.SandboxNotFound):  # the test destroyed it
                await sb.destroy()


# ------------------------------------------------------------------------------- helpers


async def run(
    sb: Sandbox,
    script: str,
    *,
    timeout: float = 60,
    user: str | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    output_limit: int | str | None = None,
    shell: str = "bash",
) -> ExecResult:
    """``bash -c script`` in ``sb``; a guest's output is recorded for the canary check."""
    r = await sb.exec(
        [shell, "-c", script],
        timeout=timeout,
        user=user,
        cwd=cwd,
        env=env,
        output_limit=output_limit,
    )
    if sb.id in _WATCH.guest_ids:
        _WATCH.seen.extend((r.stdout, r.stderr))
    return r


async def wait_ready(proc: Process, marker: bytes = b"ready", timeout: float = 60) -> None:
    """Wait until a spawned guest process has printed ``marker`` (its readiness signal);
    fail if it ends first or is not ready within ``timeout`` seconds (a generous bound)."""
    async with asyncio.timeout(timeout):
        while True:
            stdout, stderr = await proc.output()
            if marker in stdout:
                return
            if proc.info.result is not None:
                raise AssertionError(f"{proc} ended before it was ready: {stdout!r} {stderr!r}")
            await asyncio.sleep(0.02)  # a poll of the readiness signal, not a wait for it


def out(r: ExecResult) -> str:
    """stdout + stderr as text, for assertion messages."""
    return (r.stdout + b"\n--- stderr ---\n" + r.stderr).decode(errors="replace")[-4000:]


_PROBE_DIR = Path(tempfile.gettempdir()) / "corral-redteam-probes"


def compile_probe(source: str) -> bytes:
    """A static x86-64/arm64 binary built from C ``source`` on the host (cached by hash)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    exe = _PROBE_DIR / f"probe-{digest}"
    if not exe.exists():
        if not shutil.which("gcc"):
            pytest.skip("needs gcc with static libc")
        _PROBE_DIR.mkdir(exist_ok=True)
        src = _PROBE_DIR / f"probe-{digest}.c"
        src.write_text(source)
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")  # concurrent runs: rename is atomic
        subprocess.run(
            ["gcc", "-static", "-O1", "-w", "-o", str(tmp), str(src)],
            check=True,
            capture_output=True,
        )
        tmp.rename(exe)
    return exe.read_bytes()


async def upload_probe(sb: Sandbox, source: str, path: str = "/tmp/probe") -> str:
    """Compile ``source`` and write it executable into ``sb`` at ``path``; return path."""
    await sb.files.write(path, compile_probe(source), mode=0o755)
    return path


def probe_results(r: ExecResult) -> dict[str, int]:
    """``{name: errno}`` from a probe's ``name errno`` stdout lines (0 = succeeded)."""
    assert r.exit_code == 0, out(r)
    res: dict[str, int] = {}
    for line in r.stdout.decode().splitlines():
        name, _, val = line.partition(" ")
        res[name] = int(val)
    return res


async def assert_healthy(node: object, *sandboxes: Sandbox) -> None:
    """The node answers, each sandbox's init runs a command, and a new sandbox starts."""
    status = await node.node_status()  # type: ignore[attr-defined]
    assert status.running >= len(sandboxes)
    for sb in sandboxes:
        r = await sb.exec(["/bin/echo", "alive"], timeout=30)
        assert r.stdout == b"alive\n", out(r)
