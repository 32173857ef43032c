"""Snapshots and forks on a real node: EROFS packing of the overlay upper, btrfs snapshots.

The nodes here use their own layer store (the shared test store's busybox layer linked
in, plus a small fixture layer), so packed snapshot layers never land in the shared one.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.errors import CapacityError, Conflict, HostError, InvalidRequest
from corral.host import mounts
from corral.host.btrfs import qgroup_limit
from corral.images import build
from corral.images.store import LayerStore
from corral.node import Node
from corral.spec import ExecRequest, ForkRequest, Limits, SandboxSpec
from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import node_config, open_node

STORE = Path(f"/var/tmp/corral-test{TAG}-snapstore")
IMAGE = "snaptest/base"


def _cfg(n: int, **kw):  # type: ignore[no-untyped-def]
    return node_config(
        state_dir=Path(f"/var/lib/corral-test{TAG}-snap{n}"),
        run_dir=Path(f"/run/corral-test{TAG}-snap{n}"),
        cgroup_subtree=f"corral-test{TAG}-snap{n}",
        store=STORE,
        scratch_size="4GiB",
        **kw,
    )


def _make_store() -> None:
    """busybox (hard-linked from the shared test store) + a fixture layer with content
    to delete, make opaque and copy up: root-owned, as image layers are."""
    shared = LayerStore(TEST_STORE)
    busybox = shared.image("test/busybox").layers[0]
    store = LayerStore(STORE)
    hex_ = busybox.split(":", 1)[1]
    for suffix in (".erofs", ".json"):
        dst = STORE / "layers" / (hex_ + suffix)
        if not dst.exists():
            os.link(TEST_STORE / "layers" / (hex_ + suffix), dst)
    src = STORE / "tmp" / "fixture-src"
    shutil.rmtree(src, ignore_errors=True)
    for d in ("data/keep", "data/gone", "data/opaque/sub"):
        (src / d).mkdir(parents=True)
    (src / "data/keep/a").write_text("a\n")
    (src / "data/gone/b").write_text("b\n")
    (src / "data/opaque/c").write_text("c\n")
    (src / "data/opaque/sub/d").write_text("d\n")
    fixture = build.build_dir(store, src)
    shutil.rmtree(src)
    store.put_image(IMAGE, [busybox, fixture.digest])


@pytest.fixture(scope="module")
async def nodes(images_ready) -> AsyncIterator[tuple[Node, Node]]:  # type: ignore[no-untyped-def]
    shutil.rmtree(STORE, ignore_errors=True)
    _make_store()
    try:
        async with open_node(_cfg(1, max_sandboxes=12)) as a, open_node(_cfg(2)) as b:
            yield a, b
    finally:
        shutil.rmtree(STORE, ignore_errors=True)


async def sh(node: Node, sid: str, script: str) -> str:
    r = await node.exec(sid, ExecRequest(cmd=["sh", "-c", script], timeout=60))
    assert r.ok, (script, r.reason, r.exit_code, r.stdout, r.stderr)
    return r.stdout.decode()


# Everything about the files a test changes, as the guest sees it: type, mode, owner,
# link count, size, content hash or link target, for every path under the roots.
LISTING = r"""
for p in $(busybox find /data /home2 /etc /root | busybox sort); do
  if [ -L "$p" ]; then what="-> $(busybox readlink "$p")"
  elif [ -f "$p" ]; then what="$(busybox stat -c '%h %s' "$p") $(busybox md5sum < "$p")"
  else what=; fi   # a directory's size and link count are the filesystem's own
  echo "$(busybox stat -c '%n %F %a %u:%g' "$p") $what"
done
"""

CHANGES = r"""
set -e
rm /data/gone/b                                    # whiteout of an image file
rm -r /data/opaque && mkdir /data/opaque           # opaque dir over an image dir
echo new > /data/opaque/n
echo more >> /data/keep/a                          # copy-up of an image file...
busybox chown 1000:1000 /data/keep/a               # ...with a new owner
echo hello > /data/keep/new && busybox chmod 640 /data/keep/new
busybox ln -s /data/keep/new /data/link
busybox ln /data/keep/new /data/hard               # hard link
mkdir -m 700 /home2 && busybox chown 1000:1000 /home2 && echo s > /home2/secret
rm /etc/group                                      # a base-layer file deleted
mkdir -p /.corral/shells && echo state > /.corral/shells/sh-x   # corral's, scrubbed
"""


async def test_snapshot_restores_the_same_files_here_and_on_another_node(nodes) -> None:  # type: ignore[no-untyped-def]
    a, b = nodes
    src = await a.sandbox_create(SandboxSpec(image=IMAGE, workdir="/data"))
    try:
        await sh(a, src.id, CHANGES)
        before = await sh(a, src.id, LISTING)
        assert "/data/gone/b" not in before and "/data/opaque/c" not in before

        snap = await a.sandbox_snapshot(src.id, name="snaptest/snap:one")
        assert snap.name == "snaptest/snap:one"
        assert snap.layers[:-1] == src.layers and len(snap.layers) == len(src.layers) + 1
        assert snap.workdir == "/data"
        layer = a.store.layer(snap.layers[-1])
        assert layer.kind == "snapshot" and layer.source == src.id
        # The source keeps running, unchanged, and can still be written.
        assert await sh(a, src.id, LISTING) == before
        await sh(a, src.id, "echo after > /data/after")

        for node in (a, b):  # b: another node instance reading the same store
            copy = await node.sandbox_create(SandboxSpec(image=snap.digest))
            try:
                assert await sh(node, copy.id, LISTING) == before
                assert await sh(node, copy.id, "pwd") == "/data\n"
                assert await sh(node, copy.id, "cat /data/hard; id -u alice") == "hello\n1000\n"
                # Deleted image files stay deleted, opaque dirs hide the image's content.
                out = await sh(node, copy.id, "ls -a /data/gone /data/opaque; ls /etc")
                assert out.split() == [
                    "/data/gone:",
                    ".",
                    "..",
                    "/data/opaque:",
                    ".",
                    "..",
                    "n",
                    "passwd",
                ]
                # The platform's files are gone; what comes after the snapshot is not in it.
                assert await sh(node, copy.id, "ls -a /.corral") == ".\n..\ninit\n"
                assert await sh(node, copy.id, "test -e /data/after || echo absent") == "absent\n"
                # Still writable as root, and owned as inside.
                await sh(node, copy.id, "echo w >> /data/keep/a && echo x > /home2/y")
            finally:
                await node.sandbox_destroy(copy.id)

        # The layer stores image-relative owners (root 0, alice 1000), as image layers do.
        probe = a.config.state_dir / "probe"
        probe.mkdir(exist_ok=True)
        mounts.mount_erofs(a.store.path_of(snap.layers[-1]), probe)
        try:
            assert os.stat(probe / "data/keep/a").st_uid == 1000
            assert os.stat(probe / "data").st_uid == 0
            assert not (probe / ".corral").exists()
            wh = os.lstat(probe / "data/gone/b")
            assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
            assert os.getxattr(probe / "data/opaque", "trusted.overlay.opaque") == b"y"
            assert "trusted.overlay.origin" not in os.listxattr(probe / "data/keep/a")
        finally:
            mounts.umount(probe)
            probe.rmdir()
    finally:
        await a.sandbox_destroy(src.id)
    events = [e.kind for e in await a.events(src.id)]
    assert "snapshot" in events


async def test_snapshot_of_a_snapshot_and_bad_names(nodes) -> None:  # type: ignore[no-untyped-def]
    a, _ = nodes
    sb = await a.sandbox_create(SandboxSpec(image=IMAGE))
    try:
        await sh(a, sb.id, "echo 1 > /one")
        first = await a.sandbox_snapshot(sb.id)
        assert first.name.startswith(f"snapshot/{sb.id}:")
        with pytest.raises(InvalidRequest, match="image name"):
            await a.sandbox_snapshot(sb.id, name="Bad Name!")
        # Holes cost the guest nothing, but a layer would store them in full: refused.
        subvols = set(a.scratch.subvols())
        await sh(a, sb.id, "busybox truncate -s 64G /holes")
        with pytest.raises(Conflict, match="'holes'"):
            await a.sandbox_snapshot(sb.id)
        assert set(a.scratch.subvols()) == subvols
        await sh(a, sb.id, "rm /holes")
        second_src = await a.sandbox_create(SandboxSpec(image=first.name))
        try:
            await sh(a, second_src.id, "echo 2 > /two; rm /one")
            second = await a.sandbox_snapshot(second_src.id)
            assert second.layers[:-1] == first.layers
            again = await a.sandbox_create(SandboxSpec(image=second.digest))
            out = await sh(a, again.id, "cat /two; test -e /one || echo gone")
            assert out == "2\ngone\n"
            await a.sandbox_destroy(again.id)
        finally:
            await a.sandbox_destroy(second_src.id)
    finally:
        await a.sandbox_destroy(sb.id)


async def test_forks_are_independent_and_inherit_the_spec(nodes) -> None:  # type: ignore[no-untyped-def]
    a, _ = nodes
    spec = SandboxSpec(
        image=IMAGE, labels={"job": "f1"}, env={"E": "parent"}, limits=Limits(memory="96MiB")
    )
    parent = await a.sandbox_create(spec)
    try:
        await sh(a, parent.id, "echo parent > /data/f; rm /data/keep/a; busybox chown 1000 /data")
        proc = await a.spawn(parent.id, ExecRequest(cmd=["sleep", "300"]))
        kids = await a.sandbox_fork(parent.id, ForkRequest(count=3, labels={"job": "f1-kid"}))
        assert len({k.id for k in kids}) == 3
        for k in kids:
            assert k.state == "running" and k.layers == parent.layers
            assert k.spec.labels == {"job": "f1-kid"}  # overridden
            assert k.spec.limits.memory == 96 << 20 and k.spec.env == {"E": "parent"}  # inherited
            out = await sh(a, k.id, "cat /data/f; ls /data/keep; busybox stat -c %u /data; echo $E")
            assert out == "parent\n1000\nparent\n"
            # Processes are not cloned: the child has its init and nothing else.
            assert "sleep 300" not in await sh(a, k.id, "ps -o args")
        # Writes after the fork are private to whoever makes them.
        await sh(a, parent.id, "echo p2 > /data/f")
        for i, k in enumerate(kids):
            await sh(a, k.id, f"echo kid{i} > /data/f; echo {i} > /data/only{i}")
        assert await sh(a, parent.id, "cat /data/f; ls /data") == "p2\nf\ngone\nkeep\nopaque\n"
        for i, k in enumerate(kids):
            assert (
                await sh(a, k.id, "cat /data/f; ls /data | busybox grep only")
                == f"kid{i}\nonly{i}\n"
            )
        ev = await a.events(kids[0].id)
        assert ev[0].kind == "created" and ev[0].detail.get("forked_from") == parent.id
        # A child can be forked in turn; the parent's process still runs.
        grandkids = await a.sandbox_fork(kids[0].id, ForkRequest(count=1))
        assert await sh(a, grandkids[0].id, "cat /data/f") == "kid0\n"
        assert (await a.process_get(parent.id, proc.id)).running
        for k in [*kids, *grandkids]:
            await a.sandbox_destroy(k.id)
    finally:
        await a.sandbox_destroy(parent.id)


async def test_a_paused_sandbox_stays_paused(nodes) -> None:  # type: ignore[no-untyped-def]
    a, _ = nodes
    sb = await a.sandbox_create(SandboxSpec(image=IMAGE))
    try:
        await sh(a, sb.id, "echo p > /p")
        await a.sandbox_pause(sb.id)
        snap = await a.sandbox_snapshot(sb.id)
        (kid,) = await a.sandbox_fork(sb.id, ForkRequest(count=1))
        assert (await a.sandbox_get(sb.id)).state == "paused" and a.cgroups.is_frozen(sb.id)
        assert await sh(a, kid.id, "cat /p") == "p\n"
        copy = await a.sandbox_create(SandboxSpec(image=snap.name))
        assert await sh(a, copy.id, "cat /p") == "p\n"
        for sid in (kid.id, copy.id):
            await a.sandbox_destroy(sid)
    finally:
        await a.sandbox_destroy(sb.id)


async def test_fork_quota_counts_only_the_childs_own_writes(nodes) -> None:  # type: ignore[no-untyped-def]
    a, _ = nodes
    parent = await a.sandbox_create(SandboxSpec(image=IMAGE, limits=Limits(disk="48MiB")))
    try:
        await sh(a, parent.id, "dd if=/dev/urandom of=/big bs=1M count=32 2>/dev/null")
        (kid,) = await a.sandbox_fork(parent.id, ForkRequest(count=1))
        # 32 MiB shared with the parent are not the child's: it may write 32 MiB more...
        await sh(a, kid.id, "dd if=/dev/urandom of=/mine bs=1M count=32 2>/dev/null; busybox sync")
        # ...but the quota still holds for what it writes itself.
        # (its kernel limit is the quota plus a metadata allowance: host/btrfs.py)
        limit_mib = qgroup_limit(48 << 20) >> 20
        r = await a.exec(
            kid.id,
            ExecRequest(
                cmd=["sh", "-c", f"dd if=/dev/zero of=/more bs=1M count={limit_mib} || exit 3"]
            ),
        )
        assert not r.ok and b"quota" in r.stderr.lower(), r.stderr
        used = int(await sh(a, kid.id, "busybox du -m -s /more | busybox cut -f1"))
        assert used < limit_mib
        await a.sandbox_destroy(kid.id)
    finally:
        await a.sandbox_destroy(parent.id)


async def test_fork_is_all_or_nothing(nodes, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    a, _ = nodes
    parent = await a.sandbox_create(SandboxSpec(image=IMAGE))
    try:
        before = set(a.scratch.subvols())
        with pytest.raises(CapacityError, match="room for"):
            await a.sandbox_fork(parent.id, ForkRequest(count=20))
        with pytest.raises(InvalidRequest, match="label"):
            await a.sandbox_fork(parent.id, ForkRequest(labels={"bad key": "x"}))
        real = a.backend.create
        calls = 0

        async def flaky(*args, **kw):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            if calls == 3:
                raise HostError("injected failure of the third child")
            return await real(*args, **kw)

        monkeypatch.setattr(a.backend, "create", flaky)
        with pytest.raises(HostError, match="injected"):
            await a.sandbox_fork(parent.id, ForkRequest(count=5))
        monkeypatch.undo()
        assert [i.id for i in await a.sandbox_list()] == [parent.id]
        assert set(a.scratch.subvols()) == before
        assert set(a.cgroups.list()) == {parent.id}
    finally:
        await a.sandbox_destroy(parent.id)


async def test_forks_survive_a_restart_and_nothing_is_left(images_ready) -> None:  # type: ignore[no-untyped-def]
    made_store = not STORE.exists()  # run alone, without the module's nodes
    if made_store:
        _make_store()
    cfg = _cfg(3)
    node = await Node.open(cfg)
    try:
        await node.gc(everything=True)
        parent = await node.sandbox_create(SandboxSpec(image=IMAGE))
        await sh(node, parent.id, "echo kept > /kept")
        kids = await node.sandbox_fork(parent.id, ForkRequest(count=2))
        snap = await node.sandbox_snapshot(kids[0].id)
    finally:
        await node.close()
    node = await Node.open(cfg)
    try:
        assert {i.id for i in await node.sandbox_list()} == {parent.id, *(k.id for k in kids)}
        for k in kids:
            assert await sh(node, k.id, "cat /kept") == "kept\n"
        status = await node.node_status()
        assert status.checkpoint is False and status.checkpoint_detail  # CRIU: says why not
        restored = await node.sandbox_create(SandboxSpec(image=snap.digest))
        assert await sh(node, restored.id, "cat /kept") == "kept\n"
        for sid in [restored.id, parent.id, *(k.id for k in kids)]:
            await node.sandbox_destroy(sid)
        assert node.scratch.subvols() == []
        assert not (cfg.state_dir / "pack").exists() or not os.listdir(cfg.state_dir / "pack")
        assert [p for p in mounts.mounts_under(cfg.state_dir) if p.name.startswith("snap-")] == []
        assert not [p for p in (STORE / "tmp").iterdir() if p.suffix == ".erofs"]
        node.store.remove_image(snap.name)
        gone = await node.gc()
        assert gone["subvols"] == 0 and gone["mounts"] == 0
        # What a fork cut short by a crash would leave: gc removes it.
        node.scratch.create_subvol("fork-0123456789ab", quota=None)
        assert (await node.gc())["subvols"] == 1
        assert node.scratch.subvols() == []
    finally:
        await node.close()
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        if made_store:
            shutil.rmtree(STORE, ignore_errors=True)


def test_bench_fork_json_shape(nodes) -> None:  # type: ignore[no-untyped-def]
    """``corral bench fork`` end to end at a tiny size, on this module's store and image."""
    state, run = (
        Path(f"/var/lib/corral-test{TAG}-snapbench"),
        Path(f"/run/corral-test{TAG}-snapbench"),
    )
    argv = [sys.executable, "-m", "corral.bench.cli", "fork", "--count", "2", "--rounds", "1"]
    argv += ["--size", "4MiB", "--json", "--state-dir", str(state), "--run-dir", str(run)]
    argv += ["--cgroup-subtree", f"corral-test{TAG}-snapbench", "--store", str(STORE)]
    argv += ["--image", IMAGE]
    before = {p.name for p in (STORE / "layers").iterdir()}
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    assert out["scenario"] == "fork" and out["written_mib"] == 4
    for k in ("snapshot_ms", "fork_per_s", "create_ms", "create_per_s", "naive_per_s"):
        assert isinstance(out[k], int | float) and out[k] > 0, (k, out)
    assert out["ratio"]["fork_vs_naive"] > 0
    assert {p.name for p in (STORE / "layers").iterdir()} == before  # its snapshot is removed
