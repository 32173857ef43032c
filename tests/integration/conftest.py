"""Fixtures for tests that drive a real node: runc, EROFS, overlayfs, btrfs, cgroups."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import TEST_RUN, TEST_STATE, TEST_STORE, TEST_SUBTREE

if TYPE_CHECKING:
    from corral.node import Node, NodeConfig

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def node_config(**kw):  # type: ignore[no-untyped-def]
    from corral.node import NodeConfig

    base = dict(
        state_dir=TEST_STATE,
        run_dir=TEST_RUN,
        store=TEST_STORE,
        cgroup_subtree=TEST_SUBTREE,
        scratch_size="16GiB",
        reaper_interval=0.5,
    )
    base.update(kw)
    return NodeConfig(**base)


def assert_no_leaks(state: Path, run: Path, subtree: str) -> None:
    """Nothing of the node on these dirs and subtree is left (host/leaks.py). The kernel
    frees an autoclear loop device asynchronously after the unmount; on a loaded host that
    can take seconds, so the scan is retried for up to 30 s."""
    from corral.host import leaks

    deadline = time.monotonic() + 30
    while leaks.total(found := leaks.scan(state, run, subtree, netns_prefix=subtree)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert leaks.total(found) == 0, {k: v for k, v in found.items() if v}


async def close_swap_node(node: Node, swap_file: Path, subtree: str) -> None:
    """Destroy a swap-configured node's sandboxes and close it: the swap file it added must
    be off and gone, nothing of the node left (its state dir is removed afterwards)."""
    from corral.host import swap as swapmod

    assert str(swap_file) in swapmod.active()
    for info in await node.sandbox_list():
        await node.sandbox_destroy(info.id)
    await node.close()
    assert str(swap_file) not in swapmod.active()
    assert not swap_file.exists()
    assert_no_leaks(node.config.state_dir, node.config.run_dir, subtree)
    shutil.rmtree(node.config.state_dir)


def mount_options(point: Path) -> set[str]:
    """The superblock options of the mount at ``point`` (mountinfo's last field)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        if f[4] == str(point):
            return set(f[f.index("-") + 3].split(","))
    raise AssertionError(f"{point} is not mounted")


def run_bench(
    *args: str, state: Path, run: Path, subtree: str, store: Path | None, image: str, timeout: float
) -> dict[str, Any]:
    """``corral bench ARGS --json`` on a bench node of its own; its last stdout line parsed."""
    argv = [sys.executable, "-m", "corral.bench.cli", *args, "--json"]
    argv += ["--state-dir", str(state), "--run-dir", str(run), "--cgroup-subtree", subtree]
    argv += ["--store", str(store)] if store is not None else []
    argv += ["--image", image]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:  # its timeout, pytest-timeout's, ^C: leave nothing of its node
        proc.kill()  # sandboxes outlive their node by design (adoption): gc them below
        proc.communicate()
        _gc_bench_node(state, run, subtree, store)
        raise
    r = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines, r.stderr[-3000:]
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _gc_bench_node(state: Path, run: Path, subtree: str, store: Path | None) -> None:
    """What `corral node gc --all` does, on a bench node that was stopped mid-run."""
    from corral.bench.scenarios import BenchOptions
    from corral.cli.node import _gc

    opts = BenchOptions(state_dir=state, run_dir=run, subtree=subtree, store=store)
    try:
        asyncio.run(_gc(opts.node_config(), True))
    except Exception as e:  # noqa: BLE001 - the test's own failure is the one to report
        print(f"gc of the stopped bench node on {state} failed: {type(e).__name__}: {e}")


@contextlib.asynccontextmanager
async def open_node(
    config: NodeConfig | None = None, *, gc: bool = True, **kw: Any
) -> AsyncIterator[Node]:
    """A node on ``config`` (default: ``node_config(**kw)``) for a test or fixture.

    With ``gc``, what an earlier, crashed run left on its dirs is removed first. At the
    end its sandboxes are destroyed, it is closed and its run dir is removed.

        async with open_node(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE) as n:
            ...
    """
    from corral.node import Node

    n = await Node.open(config if config is not None else node_config(**kw))
    try:
        if gc:
            await n.gc(everything=True)
        yield n
    finally:
        for info in await n.sandbox_list():
            await n.sandbox_destroy(info.id)
        await n.close()
        shutil.rmtree(n.config.run_dir, ignore_errors=True)


def _ensure_images() -> None:
    """Test images, built once into a store kept between runs (/var/tmp)."""
    from corral.images import build
    from corral.images.store import LayerStore

    store = LayerStore(TEST_STORE)
    names = {i.name for i in store.images()}
    if "test/debian" not in names:
        layer = build.build_debian(store, "bookworm", include=["python3", "python3-pip"])
        store.put_image("test/debian", [layer.digest])
    if "test/busybox" not in names:
        tmp = TEST_STORE / "tmp" / "busybox-src"
        shutil.rmtree(tmp, ignore_errors=True)
        for d in ("bin", "etc", "tmp", "root", "work", "proc", "sys", "dev"):
            (tmp / d).mkdir(parents=True, exist_ok=True)
        shutil.copy("/bin/busybox", tmp / "bin" / "busybox")
        for applet in (
            "sh",
            "ls",
            "cat",
            "echo",
            "true",
            "false",
            "sleep",
            "dd",
            "yes",
            "id",
            "head",
            "wc",
            "mkdir",
            "rm",
            "touch",
            "env",
            "pwd",
            "ps",
            "kill",
            "seq",
        ):
            os.symlink("busybox", tmp / "bin" / applet)
        (tmp / "etc" / "passwd").write_text(
            "root:x:0:0:root:/root:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/:/bin/false\n"
            "alice:x:1000:1000::/work:/bin/sh\n"
        )
        (tmp / "etc" / "group").write_text("root:x:0:\nalice:x:1000:\n")
        os.chmod(tmp / "tmp", 0o1777)
        layer = build.build_dir(store, tmp)
        store.put_image("test/busybox", [layer.digest])
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def images_ready() -> None:
    _ensure_images()


@pytest.fixture(scope="session")
async def node(images_ready):  # type: ignore[no-untyped-def]
    async with open_node() as n:
        yield n


@pytest.fixture
async def client(node):  # type: ignore[no-untyped-def]
    import corral

    async with corral.AsyncClient(ops=node, own_ops=False) as c:
        yield c
