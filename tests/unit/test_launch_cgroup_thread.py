"""Launcher.make_cgroup_async: a create's cgroups are made off the event loop, and a
cancelled create waits for them (its undo removes what the thread made)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from corral.host.launch import Launcher


def _launcher(tmp_path: Path) -> Launcher:
    # make_cgroup is replaced below: no cgroups, no binary needed.
    return Launcher(tmp_path / "corral-launch", tmp_path / "records", cgroups=None)  # type: ignore[arg-type]


async def test_cgroups_are_made_in_a_thread_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ln = _launcher(tmp_path)
    loop_thread = threading.get_ident()
    threads: list[int] = []

    def make(sandbox_id: str, resources: dict[str, Any], latency: bool) -> Any:
        threads.append(threading.get_ident())
        return [Path(f"/cg/{sandbox_id}")], []

    monkeypatch.setattr(ln, "make_cgroup", make)
    try:
        got = [await ln.make_cgroup_async(f"sb-{i}", {}, False) for i in range(3)]
    finally:
        ln.close()
    assert got == [([Path(f"/cg/sb-{i}")], []) for i in range(3)]
    assert loop_thread not in threads
    assert len(set(threads)) == 1  # one thread for all: the kernel's cgroup mutex is one


async def test_a_cancelled_create_waits_for_its_cgroups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ln = _launcher(tmp_path)
    started, release = threading.Event(), threading.Event()
    made: list[str] = []

    def make(sandbox_id: str, resources: dict[str, Any], latency: bool) -> Any:
        started.set()
        release.wait(60)
        made.append(sandbox_id)
        return [], []

    monkeypatch.setattr(ln, "make_cgroup", make)
    try:
        task = asyncio.ensure_future(ln.make_cgroup_async("sb-1", {}, False))
        assert await asyncio.to_thread(started.wait, 60)
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()  # still waiting for the thread, so no undo runs yet
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert made == ["sb-1"]  # the thread finished before the cancel went on
    finally:
        release.set()
        ln.close()
