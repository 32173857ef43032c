"""Hot-block profiles (images/hotblocks.py) without root: what is recorded, what is
refused, what a prefetch reads, and the profile's place on the store."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from corral.host import pagecache
from corral.images import hotblocks
from corral.images.hotblocks import HotBlocks, chunks, decode, encode, resident
from corral.images.store import LayerStore

PAGE = hotblocks.PAGE


class FakeStore:
    """The two calls HotBlocks makes, on a dict."""

    def __init__(self) -> None:
        self.profiles: dict[str, bytes] = {}
        self.saves = 0

    def hot_profile(self, digest: str) -> bytes | None:
        return self.profiles.get(digest)

    def save_hot_profile(self, digest: str, data: bytes, *, replace: bool = False) -> None:
        self.saves += 1
        if replace:
            self.profiles[digest] = data
        else:
            self.profiles.setdefault(digest, data)


def _cold_file(path: Path, pages: int) -> Path:
    path.write_bytes(os.urandom(pages * PAGE))
    os.sync()  # dirty pages cannot be evicted
    pagecache.evict(path)
    return path


def _cached(path: Path) -> list[tuple[int, int]]:
    return resident(path)[1]


def _read(path: Path, off: int, length: int) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # exactly these pages
        f.seek(off)
        f.read(length)


@pytest.fixture
def cold(tmp_path: Path) -> Path:
    path = _cold_file(tmp_path / "layer.erofs", 64)
    if _cached(path):
        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED")
    return path


def test_resident_lists_exactly_the_pages_read(cold: Path) -> None:
    _read(cold, 3 * PAGE, 2 * PAGE)
    _read(cold, 40 * PAGE, PAGE)
    size, extents = resident(cold)
    assert size == 64 * PAGE
    assert extents == [(3 * PAGE, 2 * PAGE), (40 * PAGE, PAGE)]


def test_profile_round_trip_and_refusals() -> None:
    data = encode(10 * PAGE, [(0, PAGE), (4 * PAGE, 3 * PAGE)])
    assert decode(data, 10 * PAGE) == [(0, PAGE), (4 * PAGE, 3 * PAGE)]
    assert decode(data, 11 * PAGE) is None  # a profile of another file
    assert decode(encode(PAGE, [(0, 2 * PAGE)]), PAGE) is None  # past the end
    assert decode(encode(PAGE, [(-1, 1)]), PAGE) is None
    assert decode(b"not json", PAGE) is None
    assert decode(json.dumps({"version": 9, "size": 1, "extents": []}).encode(), 1) is None
    assert decode(json.dumps({"version": 1, "size": 1, "extents": [["a", 1]]}).encode(), 1) is None


def test_chunks_cut_long_extents() -> None:
    assert chunks([(0, 10), (100, 3)], most=4) == [(0, 4), (4, 4), (8, 2), (100, 3)]


def test_record_writes_once_what_was_read(cold: Path) -> None:
    store = FakeStore()
    hot = HotBlocks(store)
    _read(cold, 8 * PAGE, 4 * PAGE)
    hot.record("sha256:a", cold)
    hot.record("sha256:a", cold)  # this node recorded it already
    assert hot.drain(30)
    assert store.saves == 1
    assert decode(store.profiles["sha256:a"], 64 * PAGE) == [(8 * PAGE, 4 * PAGE)]


def test_record_skips_a_mostly_cached_file(cold: Path) -> None:
    store = FakeStore()
    hot = HotBlocks(store)
    _read(cold, 0, 40 * PAGE)  # over MAX_FRACTION: a hash or a copy, not a task's reads
    hot.record("sha256:full", cold)
    assert hot.drain(30)
    assert store.saves == 0


def test_a_profile_grows_only_by_reads_it_lacked(cold: Path) -> None:
    store = FakeStore()
    profile = [(0, 20 * PAGE)]
    store.profiles["sha256:same"] = store.profiles["sha256:more"] = encode(64 * PAGE, profile)
    _read(cold, 0, 20 * PAGE)
    _read(cold, 30 * PAGE, PAGE)  # 1 page more than 20: not worth a write
    hot = HotBlocks(store)
    hot.record("sha256:same", cold)
    assert hot.drain(30)
    assert store.saves == 0
    _read(cold, 40 * PAGE, 4 * PAGE)  # 5 more: the profile becomes the union
    hot.record("sha256:more", cold)
    assert hot.drain(30)
    assert store.saves == 1
    assert decode(store.profiles["sha256:more"], 64 * PAGE) == [
        (0, 20 * PAGE),
        (30 * PAGE, PAGE),
        (40 * PAGE, 4 * PAGE),
    ]


def test_prefetch_reads_the_profile_and_then_nothing_new_is_recorded(cold: Path) -> None:
    store = FakeStore()
    store.profiles["sha256:a"] = encode(64 * PAGE, [(2 * PAGE, 3 * PAGE), (50 * PAGE, PAGE)])
    hot = HotBlocks(store)
    hot.prefetch("sha256:a", cold)
    hot.start(["sha256:a"])
    assert hot.drain(30)
    assert _cached(cold) == [(2 * PAGE, 3 * PAGE), (50 * PAGE, PAGE)]
    hot.record("sha256:a", cold)
    assert hot.drain(30)
    assert store.saves == 0


def test_a_deferred_prefetch_reads_once_a_sandbox_is_up(cold: Path) -> None:
    store = FakeStore()
    store.profiles["sha256:a"] = encode(64 * PAGE, [(2 * PAGE, 3 * PAGE)])
    hot = HotBlocks(store, defer=True)
    hot.prefetch("sha256:a", cold)  # the mount: the profile is read, the blocks are not
    assert hot.drain(30)
    assert _cached(cold) == []
    hot.start(["sha256:a", "sha256:no-profile"])  # a create using it returned
    assert hot.drain(30)
    assert _cached(cold) == [(2 * PAGE, 3 * PAGE)]
    pagecache.evict(cold)
    hot.start(["sha256:a"])  # later creates: under way or done already, nothing again
    assert hot.drain(30)
    assert _cached(cold) == []


def test_a_sandbox_up_before_the_profile_is_read_still_starts_it(cold: Path) -> None:
    store = FakeStore()
    store.profiles["sha256:a"] = encode(64 * PAGE, [(8 * PAGE, PAGE)])
    hot = HotBlocks(store, defer=True)
    hot.prefetch("sha256:a", cold)
    hot.start(["sha256:a"])  # may come before the plan thread has read the profile
    assert hot.drain(30)
    assert _cached(cold) == [(8 * PAGE, PAGE)]


def test_an_unmounted_layer_drops_its_held_reads(cold: Path) -> None:
    store = FakeStore()
    store.profiles["sha256:a"] = encode(64 * PAGE, [(8 * PAGE, PAGE)])
    hot = HotBlocks(store, defer=True)
    hot.prefetch("sha256:a", cold)
    assert hot.drain(30)
    hot.forget("sha256:a")  # its only create failed and the layer went
    hot.start(["sha256:a"])
    assert hot.drain(30)
    assert _cached(cold) == []


def test_prefetch_waits_for_a_sandbox_by_default(cold: Path) -> None:
    store = FakeStore()
    store.profiles["sha256:a"] = encode(64 * PAGE, [(4 * PAGE, 2 * PAGE)])
    hot = HotBlocks(store)
    hot.prefetch("sha256:a", cold)
    assert hot.drain(30)
    assert _cached(cold) == []  # the create that mounts it has the link to itself
    hot.start(["sha256:a"])
    assert hot.drain(30)
    assert _cached(cold) == [(4 * PAGE, 2 * PAGE)]


def test_prefetch_reads_at_the_mount_without_defer(cold: Path) -> None:
    store = FakeStore()
    store.profiles["sha256:a"] = encode(64 * PAGE, [(4 * PAGE, 2 * PAGE)])
    hot = HotBlocks(store, defer=False)
    hot.prefetch("sha256:a", cold)
    assert hot.drain(30)
    assert _cached(cold) == [(4 * PAGE, 2 * PAGE)]


def test_prefetch_ignores_a_profile_of_another_size(cold: Path) -> None:
    store = FakeStore()
    store.profiles["sha256:a"] = encode(65 * PAGE, [(0, PAGE)])
    hot = HotBlocks(store)
    hot.prefetch("sha256:a", cold)
    hot.prefetch("sha256:none", cold)  # no profile: nothing read
    hot.start(["sha256:a", "sha256:none"])
    assert hot.drain(30)
    assert _cached(cold) == []


def test_store_keeps_the_first_profile_and_removes_it_with_the_layer(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    li = store.add_dir(src, kind="dir")
    assert store.hot_profile(li.digest) is None
    store.save_hot_profile(li.digest, b"first")
    store.save_hot_profile(li.digest, b"second")
    assert store.hot_profile(li.digest) == b"first"
    store.save_hot_profile(li.digest, b"union", replace=True)
    assert store.hot_profile(li.digest) == b"union"
    hot_file = store.path_of(li.digest).with_suffix(".hot")
    assert hot_file.exists()
    store.remove_layer(li.digest)
    assert not hot_file.exists()


def test_gc_removes_the_profile_with_its_layer(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("y")
    li = store.add_dir(src, kind="dir")
    store.save_hot_profile(li.digest, b"p")
    hot_file = store.path_of(li.digest).with_suffix(".hot")
    assert store.gc(grace=0).removed == [li.digest]
    assert not hot_file.exists()
    orphan = hot_file.with_name("ab" * 32 + ".hot")  # left by a node after an older gc
    orphan.write_bytes(b"p")
    store.gc(grace=0)
    assert not orphan.exists()


def test_pool_threads_end_when_idle_and_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hotblocks, "_IDLE_S", 0.01)
    pool = hotblocks._Pool(4)
    done: list[int] = []
    for i in range(8):
        pool.submit(lambda i=i: done.append(i))
    assert pool.drain(30)
    assert sorted(done) == list(range(8))
    deadline = time.monotonic() + 30
    while pool._started:  # readiness: every idle thread has ended
        assert time.monotonic() < deadline, "idle pool threads did not end"
        time.sleep(0.01)
    pool.submit(lambda: done.append(8))
    assert pool.drain(30) and done[-1] == 8
