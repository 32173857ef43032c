"""The image lookup every create makes: answered from memory while the manifest file is
unchanged, re-read once it changes (here or on another node sharing the store), and run
on reused worker threads that still serve concurrent callers side by side; awaited from
the event loop without blocking it (``image_async``, ``Bounded.acall``)."""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path

import pytest

from corral.errors import ImageNotFound, StoreUnavailable
from corral.images._bounded import Bounded
from corral.images.store import LayerStore


@pytest.fixture
def two(tmp_path: Path) -> tuple[LayerStore, list[str]]:
    store = LayerStore(tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    digests = []
    for name in ("a", "b"):
        (src / name).write_text(name)
        digests.append(store.add_dir(src, kind="dir").digest)
    return store, digests


def test_unchanged_manifest_is_not_read_again(two, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store, (a, _) = two
    store.put_image("t/x", [a], env={"K": "1"})
    first = store.image("t/x")
    reads = []
    orig = store._image
    monkeypatch.setattr(store, "_image", lambda ref: reads.append(ref) or orig(ref))
    again = store.image("t/x")
    assert again == first and reads == []
    # Callers own what they get: changing it changes no later answer.
    again.layers.append("sha256:" + "0" * 64)
    again.env["K"] = "2"
    assert store.image("t/x") == first


def test_a_replaced_manifest_is_seen(two, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, (a, b) = two
    store.put_image("t/x", [a])
    assert store.image("t/x").layers == [a]
    store.put_image("t/x", [a, b])  # this store
    assert store.image("t/x").layers == [a, b]
    LayerStore(tmp_path / "store").put_image("t/x", [b])  # another node on the same store
    assert store.image("t/x").layers == [b]
    LayerStore(tmp_path / "store").remove_image("t/x")
    with pytest.raises(ImageNotFound):
        store.image("t/x")


def test_workers_are_reused_and_concurrent_calls_run_side_by_side() -> None:
    io = Bounded("/nowhere", timeout=30)
    names: set[int] = set()
    for _ in range(50):
        names.add(io.call("x", threading.get_ident))
    assert len(names) == 1  # one worker served every call made one after another

    started, release = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        release.wait(60)

    t = threading.Thread(target=io.call, args=("slow", slow))
    t.start()
    try:
        assert started.wait(30)
        # Answered while the first call still holds its worker: another worker serves it
        # (one worker would leave it queued behind the slow call: StoreUnavailable).
        assert io.call("fast", lambda: 42) == 42
        assert not release.is_set()
    finally:
        release.set()
        t.join()


async def test_image_async_answers_as_image_does(two) -> None:  # type: ignore[no-untyped-def]
    store, (a, b) = two
    store.put_image("t/x", [a, b], env={"K": "1"})
    assert await store.image_async("t/x") == store.image("t/x")  # read, then from memory
    assert await store.image_async("t/x") == store.image("t/x")
    with pytest.raises(ImageNotFound, match="did you mean t/x"):
        await store.image_async("t/y")


async def test_acall_lets_the_event_loop_run_during_the_call() -> None:
    io = Bounded("/nowhere", timeout=60)
    gate = threading.Event()

    async def opener() -> None:
        gate.set()  # runs only if the loop is free while the call below waits

    task = asyncio.create_task(opener())
    assert await io.acall("x", lambda: gate.wait(30)) is True
    await task


async def test_acall_gives_up_and_fails_fast_while_stuck() -> None:
    gate = threading.Event()
    io = Bounded("/srv/store", timeout=0.2)
    with pytest.raises(StoreUnavailable, match="no answer within 0.2 s"):
        await io.acall("reading image 'x'", gate.wait)
    with pytest.raises(StoreUnavailable, match="has not returned yet"):
        await io.acall("reading image 'x'", lambda: 1)
    stuck = io._stuck
    assert stuck is not None
    gate.set()  # the filesystem answers again
    assert stuck.done.wait(10)
    assert await io.acall("reading image 'x'", lambda: 1) == 1
    with pytest.raises(StoreUnavailable, match="Transport endpoint"):
        await io.acall("x", _gone)


def _gone() -> None:
    raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
