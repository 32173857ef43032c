"""The layer store on a real distributed filesystem, read by two nodes at once.

A MooseFS master and chunkserver run in a network namespace of their own behind a
bandwidth-capped veth (corral/bench/dfs.py), started once for this module; the store is
a directory of its FUSE mount, so every layer byte a node reads crosses that link. Two
``Node``s with their own state dirs use the store together: build, compose, create,
snapshot on one and restore on the other, gc while the other has a layer mounted, a
corrupted layer, and the store's servers cut off.
Each node leases the layers it mounts on the store (``node-<node id>`` markers).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from corral.bench import dfs
from corral.errors import LayerCorrupt, NotFound, StoreUnavailable
from corral.host import pagecache
from corral.images import build, hotblocks
from corral.images.leases import Leases
from corral.images.store import LayerStore
from corral.node import Node
from corral.spec import ExecRequest, SandboxSpec
from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import assert_no_leaks, mount_options, node_config, open_node

WORK = Path(f"/var/tmp/corral-test{TAG}-dfs")
NAME = f"t{TAG.lstrip('-')}"[:8]
BASE, APP = "dfs/busybox", "dfs/app"


def _cfg(n: int, store: Path) -> Any:
    return node_config(
        state_dir=Path(f"/var/lib/corral-test{TAG}-dfs{n}"),
        run_dir=Path(f"/run/corral-test{TAG}-dfs{n}"),
        cgroup_subtree=f"corral-test{TAG}-dfs{n}",
        store=store,
        scratch_size="2GiB",
        backends=[{"kind": "container", "owner_uid": 240000 + 8192 * n, "owner_uids": 4096}],
        network={"subnet": f"10.218.{n}.0/24"},
    )


@pytest.fixture(scope="module")
def moose() -> Iterator[dfs.MooseStore]:
    why = dfs.available()
    if why:
        pytest.skip(why)
    # 1 ms each way: every store read pays a round trip, as on a real network.
    fs = dfs.MooseStore(WORK, name=NAME, subnet=40, rate_mbit=800, delay_ms=1.0)
    fs.start()
    try:
        yield fs
    finally:
        fs.stop()
        assert not WORK.exists()
        assert not Path(f"/run/netns/{fs.host.ns}").exists()
        assert not Path(f"/sys/class/net/{fs.host.veth}").exists()


@pytest.fixture(scope="module")
async def nodes(images_ready, moose) -> AsyncIterator[tuple[Node, Node]]:  # type: ignore[no-untyped-def]
    root = moose.mountpoint / "store"
    store = LayerStore(root)
    busybox = LayerStore(TEST_STORE).image("test/busybox").layers[0]
    base = store.add_file(LayerStore(TEST_STORE).path_of(busybox), kind="dir", source="busybox")
    assert base.digest == busybox
    store.put_image(BASE, [base.digest])
    src = WORK / "app-src"
    (src / "app").mkdir(parents=True)
    (src / "app" / "data.bin").write_bytes(os.urandom(4 << 20))
    (src / "app" / "hello.txt").write_text("from the shared store\n")
    app = build.build_dir(store, src)
    shutil.rmtree(src)
    store.put_image(APP, [base.digest, app.digest], workdir="/app")
    for digest in (base.digest, app.digest):
        _drop_cache(store.path_of(digest))  # written here: make the nodes read them

    async with open_node(_cfg(1, root)) as a, open_node(_cfg(2, root)) as b:
        yield a, b
    for n in (1, 2):
        cfg = _cfg(n, root)
        assert_no_leaks(cfg.state_dir, cfg.run_dir, cfg.cgroup_subtree)
        shutil.rmtree(cfg.state_dir, ignore_errors=True)
    left = [p for p in (root / "leases").rglob("*") if p.is_file()]
    assert left == [], f"leases left on the store: {left}"


_drop_cache = pagecache.evict


async def sh(node: Node, sid: str, script: str) -> str:
    r = await node.exec(sid, ExecRequest(cmd=["sh", "-c", script], timeout=60))
    assert r.ok, (script, r.reason, r.exit_code, r.stdout, r.stderr)
    return r.stdout.decode()


async def test_two_nodes_create_from_the_shared_store(nodes, moose) -> None:  # type: ignore[no-untyped-def]
    a, b = nodes
    got0 = moose.link_bytes()[1]
    sa = await a.sandbox_create(SandboxSpec(image=APP))
    sb = await b.sandbox_create(SandboxSpec(image=APP))
    try:
        for node, sid in ((a, sa.id), (b, sb.id)):
            assert await sh(node, sid, "cat hello.txt") == "from the shared store\n"
            assert (await sh(node, sid, "wc -c < data.bin")).strip() == str(4 << 20)
        # The layers came over the link (each node verifies and reads them once).
        assert moose.link_bytes()[1] - got0 > 4 << 20
        layer = a.store.image(APP).layers[-1]
        # A layer file on the network store is mounted buffered (layer_direct_io "auto"):
        # hot-block prefetch and the client's read-ahead work in its page cache.
        for node in (a, b):
            assert "directio" not in mount_options(node.backend.layers.raw_root / layer[7:])
        holders = Leases.holders_of(a.store.root, layer)
        assert holders == sorted(f"node-{n.node_id}" for n in (a, b))
    finally:
        await a.sandbox_destroy(sa.id)
        await b.sandbox_destroy(sb.id)
    # Unused, each node's mount lingers (layer_linger), still leased; a sweep past the
    # linger unmounts it and drops the lease.
    assert Leases.holders_of(a.store.root, layer) == sorted(f"node-{n.node_id}" for n in (a, b))
    await _sweep(a, b)
    assert Leases.holders_of(a.store.root, layer) == []


async def _sweep(*nodes: Node) -> None:
    """Unmount every node's lingering layers now, as their sweeper will after the linger."""
    for n in nodes:
        await asyncio.to_thread(n.backend.layers.sweep, time.monotonic() + n.config.layer_linger)


async def test_snapshot_on_one_node_restores_on_the_other_and_gc_keeps_it(nodes) -> None:  # type: ignore[no-untyped-def]
    a, b = nodes
    src = await a.sandbox_create(SandboxSpec(image=BASE))
    try:
        await sh(a, src.id, "mkdir -p /work && echo snapped > /work/state")
        snap = await a.sandbox_snapshot(src.id, name="dfs/snap:one")
    finally:
        await a.sandbox_destroy(src.id)
    layer = snap.layers[-1]
    restored = await b.sandbox_create(SandboxSpec(image="dfs/snap:one"))
    try:
        assert await sh(b, restored.id, "cat /work/state") == "snapped\n"
        # The image goes; b still runs from its layer: gc from a must keep it.
        a.store.remove_image("dfs/snap:one")
        report = a.store.gc(grace=0)
        assert layer not in report.removed
        assert report.kept_leased[layer] == [f"node-{b.node_id}"]
        assert a.store.path_of(layer).exists()
        assert await sh(b, restored.id, "cat /work/state") == "snapped\n"
    finally:
        await b.sandbox_destroy(restored.id)
    # b's mount lingers, leased: gc keeps the layer until b's sweep drops it.
    assert layer not in a.store.gc(grace=0).removed
    await _sweep(a, b)
    # Nobody uses it any more: the next gc removes it (and nothing an image names).
    report = a.store.gc(grace=0)
    assert layer in report.removed
    assert {d for i in a.store.images() for d in i.layers} <= {li.digest for li in a.store.layers()}


async def test_a_corrupted_layer_is_refused_by_digest(nodes, moose) -> None:  # type: ignore[no-untyped-def]
    a, _ = nodes
    store = LayerStore(moose.mountpoint / "store")
    src = WORK / "bad-src"
    src.mkdir(parents=True)
    (src / "f").write_text("soon corrupt " * 1000)
    bad = build.build_dir(store, src)
    shutil.rmtree(src)
    base = store.image(BASE).layers[0]
    store.put_image("dfs/bad", [base, bad.digest])
    path = store.path_of(bad.digest)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))  # a bit flipped on the shared store
    with pytest.raises(LayerCorrupt, match="corrupt"):
        await a.sandbox_create(SandboxSpec(image="dfs/bad"))
    assert Leases.holders_of(store.root, bad.digest) == []  # the failed mount let go
    store.remove_image("dfs/bad")


async def _until(what: str, ok: Any, timeout: float = 60.0) -> None:
    """Readiness: poll ``ok()`` (a function or a coroutine function) until true
    (background work of a node or a sandbox), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (await r if inspect.isawaitable(r := ok()) else r):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        await asyncio.sleep(0.05)


def _pages(extents: list[tuple[int, int]]) -> set[int]:
    page = hotblocks.PAGE
    return {p for off, n in extents for p in range(off // page, (off + n + page - 1) // page)}


async def test_hot_blocks_recorded_on_one_node_are_prefetched_by_the_other(nodes, moose) -> None:  # type: ignore[no-untyped-def]
    a, b = nodes
    store = LayerStore(moose.mountpoint / "store")
    src = WORK / "hot-src"
    (src / "app").mkdir(parents=True)
    (src / "app" / "big.bin").write_bytes(os.urandom(8 << 20))
    (src / "app" / "hello.txt").write_text("hot\n")
    layer = store.add_dir(src, kind="dir", source="hot", compress=None).digest
    shutil.rmtree(src)
    store.put_image("dfs/hot", [store.image(BASE).layers[0], layer], workdir="/app")
    path = store.path_of(layer)
    # A settled verification stamp (store.py: 2 s after the file's last change), so that
    # neither node hashes the layer: a hash reads the whole file, and a node records no
    # profile of a file it holds all of.
    changed = path.stat().st_ctime
    await _until("the layer file settling", lambda: time.time() > changed + 2.2)
    LayerStore(store.root).verify(layer)
    try:
        _drop_cache(path)
        sa = await a.sandbox_create(SandboxSpec(image="dfs/hot"))
        try:
            assert await sh(a, sa.id, "cat hello.txt") == "hot\n"
        finally:
            await a.sandbox_destroy(sa.id)
        # a recorded what its sandbox read: a little of the layer, not the 8 MiB file.
        await _until("a's profile", lambda: store.hot_profile(layer) is not None)
        size = path.stat().st_size
        profile = hotblocks.decode(store.hot_profile(layer) or b"", size)
        assert profile, "the profile does not decode"
        assert sum(n for _, n in profile) < size // 4

        # b mounts the layer cold and reads the profile's blocks by itself, before its
        # sandbox reads anything.
        _drop_cache(path)
        assert hotblocks.resident(path)[1] == []
        sb = await b.sandbox_create(SandboxSpec(image="dfs/hot"))
        try:

            def covered() -> bool:
                return _pages(profile) <= _pages(hotblocks.resident(path)[1])

            await _until("b's prefetch", covered)
            assert await sh(b, sb.id, "cat hello.txt") == "hot\n"
        finally:
            await b.sandbox_destroy(sb.id)
    finally:
        store.remove_image("dfs/hot")


async def test_unreachable_store_fails_new_creates_and_spares_running_ones(nodes, moose) -> None:  # type: ignore[no-untyped-def]
    a, _ = nodes
    running = await a.sandbox_create(SandboxSpec(image=BASE))
    try:
        # What is spared is what runs: a process started before the cut keeps running on
        # the pages it has mapped. A new exec is not promised: its pages come from the page
        # cache only if they are still there, and this VM pages out cold unmapped page
        # cache within seconds (a DAMON pageout scheme of the host's), so an `ls` run
        # before the cut died of SIGBUS when run again after it (the store's read failed).
        # The loop below uses builtins only (it answers the last line of /tmp/ping), and
        # answers once before the cut, so every code path it takes after the cut is mapped
        # already.
        assert await sh(a, running.id, "mkfifo /tmp/idle && echo ok") == "ok\n"
        loop = (
            "exec 3<>/tmp/idle; while :; do read -t 1 x <&3; "
            "if [ -e /tmp/ping ]; then while read l; do n=$l; done < /tmp/ping; "
            'echo "pong $n" > /tmp/pong; fi; done'
        )
        await a.spawn(running.id, ExecRequest(cmd=["sh", "-c", loop]))

        async def ping(n: int) -> None:
            # Appended in place: a replace makes a temp file, whose name the overlay looks
            # up in the store's layer too (a directory page that may be gone by now).
            await a.file_write(running.id, "/tmp/ping", f"{n}\n".encode(), append=True)

            async def answered() -> bool:
                try:
                    return await a.file_read(running.id, "/tmp/pong") == f"pong {n}\n".encode()
                except NotFound:  # not written yet
                    return False

            await _until(f"the sandbox's loop to answer ping {n}", answered)

        await ping(1)
        moose.cut()
        try:
            with pytest.raises(StoreUnavailable, match="unavailable") as e:
                await a.sandbox_create(SandboxSpec(image=APP))
            assert str(a.store.root) in e.value.message
            with pytest.raises(StoreUnavailable):
                await a.sandbox_create(SandboxSpec(image=APP))
            # The running sandbox's process goes on, and its files answer.
            await ping(2)
            assert [p.running for p in await a.process_list(running.id)] == [True]
        finally:
            moose.heal()
        # Readiness: the store answers again once the client has reconnected.
        deadline = time.monotonic() + 300
        while True:
            try:
                a.store.image(APP)
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "the store did not come back after heal"
                await asyncio.sleep(0.5)
        again = await a.sandbox_create(SandboxSpec(image=APP))
        await a.sandbox_destroy(again.id)
    finally:
        await a.sandbox_destroy(running.id)
