"""Store hygiene without root: gc's three conditions, leases, and reads with a deadline."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from corral.errors import LayerNotFound, StoreUnavailable
from corral.images._bounded import Bounded
from corral.images.leases import Leases
from corral.images.store import LayerStore
from corral.spec import LayerInfo


def _layer(store: LayerStore, src: Path, name: str) -> LayerInfo:
    (src / name).write_text(name)
    return store.add_dir(src, kind="dir")


def _age(store: LayerStore, digest: str, seconds: float) -> None:
    t = time.time() - seconds
    for p in store._layer_paths(digest):
        os.utime(p, (t, t))


@pytest.fixture
def store(tmp_path: Path) -> LayerStore:
    return LayerStore(tmp_path / "store")


def test_gc_removes_only_unreferenced_unleased_old_layers(store: LayerStore, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    used, leased, young, dead = (_layer(store, src, n) for n in ("a", "b", "c", "d"))
    store.put_image("t/used", [used.digest])
    store.leases("node-other").take(leased.digest)
    for li in (used, leased, dead):
        _age(store, li.digest, 7200)

    dry = store.gc(grace=3600, dry_run=True)
    assert dry.removed == [dead.digest]
    assert store.path_of(dead.digest).exists()  # dry run removed nothing

    report = store.gc(grace=3600)
    assert report.removed == [dead.digest]
    assert report.kept_leased == {leased.digest: ["node-other"]}
    assert report.kept_young == [young.digest]
    assert report.referenced == 1
    assert {li.digest for li in store.layers()} == {used.digest, leased.digest, young.digest}
    with pytest.raises(LayerNotFound):
        store.path_of(dead.digest)

    # The node that held the lease lets go: the next gc takes the layer.
    store.leases("node-other").drop(leased.digest)
    assert store.gc(grace=3600).removed == [leased.digest]


def test_reusing_a_layer_restarts_its_grace(store: LayerStore, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    li = _layer(store, src, "a")
    _age(store, li.digest, 7200)
    again = store.add_dir(src, kind="dir")  # a second build of the same bytes
    assert again.digest == li.digest
    assert store.gc(grace=3600).kept_young == [li.digest]


def test_compose_of_a_collected_layer_fails_cleanly(store: LayerStore, tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    li = _layer(store, src, "a")
    _age(store, li.digest, 7200)
    assert store.gc(grace=3600).removed == [li.digest]
    with pytest.raises(LayerNotFound, match="not in the store"):
        store.put_image("t/late", [li.digest])


def test_leases_held_and_forget(tmp_path: Path):
    d1, d2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    a, b = Leases(tmp_path, "node-a"), Leases(tmp_path, "node-b")
    a.take(d1)
    a.take(d2)
    b.take(d1)
    assert a.held() == [d1, d2]
    assert Leases.holders_of(tmp_path, d1) == ["node-a", "node-b"]
    assert Leases.forget(tmp_path, "node-a") == [d1, d2]
    assert Leases.holders_of(tmp_path, d1) == ["node-b"]
    assert Leases.holders_of(tmp_path, d2) == []
    with pytest.raises(Exception, match="lease holder"):
        Leases(tmp_path, "../etc")


def test_bounded_call_gives_up_and_fails_fast_while_stuck():
    gate = threading.Event()
    io = Bounded("/srv/store", timeout=0.2)
    with pytest.raises(StoreUnavailable, match="no answer within 0.2 s"):
        io.call("reading image 'x'", gate.wait)
    # While the first call hangs, the next fails at once instead of adding a thread.
    with pytest.raises(StoreUnavailable, match="has not returned yet"):
        io.call("listing images", lambda: 1)
    stuck = io._stuck
    assert stuck is not None
    gate.set()  # the filesystem answers again
    assert stuck.done.wait(10)
    assert io.call("listing images", lambda: 1) == 1


def test_bounded_call_translates_a_gone_transport():
    def gone() -> None:
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    with pytest.raises(StoreUnavailable, match="Transport endpoint"):
        Bounded("/srv/store", timeout=5).call("reading image 'x'", gone)
    with pytest.raises(FileNotFoundError):
        Bounded("/srv/store", timeout=5).call("x", lambda: open("/nonexistent/x"))


def test_one_nodes_verification_stands_for_all_until_the_file_changes(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from corral.errors import LayerCorrupt
    from corral.images import store as store_mod

    src = tmp_path / "src"
    src.mkdir()
    li = _layer(store, src, "a")
    LayerStore(store.root).verify(li.digest)  # node 1 hashes and stamps
    stamp = store.path_of(li.digest).with_suffix(".verified")
    assert stamp.exists()
    hashed: list[Path] = []
    real = store_mod._hash_file
    monkeypatch.setattr(store_mod, "_hash_file", lambda p, s=None: hashed.append(p) or real(p))
    # Written in the second of the file's last change: not settled, so hashed again.
    LayerStore(store.root).verify(li.digest)
    assert hashed == [store.path_of(li.digest)]
    hashed.clear()
    t = time.time() + 3  # as if written 3 s later
    os.utime(stamp, (t, t))
    LayerStore(store.root).verify(li.digest)  # node 2 trusts the settled stamp
    assert hashed == []
    path = store.path_of(li.digest)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(LayerCorrupt, match="corrupt"):
        LayerStore(store.root).verify(li.digest)
    assert hashed == [path]
