"""Cores for the node, cores for a co-located store: how a one-machine bench keeps the
servers of its network store off the node's CPUs.

A shared-store bench (``bench ondemand --store-cores N``) runs the store's servers and
its link's pump on the same machine as the node under test. In a cluster they are other
machines; here their CPU competes with the node's sandboxes unless they get cores of
their own. :func:`split` gives the last ``N`` of the cores this process may use to the
store and the rest to the node; :func:`pinned` moves every thread of this process (the
embedded node and its client) onto the node's cores, so everything it starts from then
on (the store's FUSE client, corral-launch, the sandboxes) inherits them; :func:`taskset`
starts a server on the store's.

Example::

    node, store = split(1)          # e.g. ({0}, {1}) on 2 cores
    with pinned(node):
        subprocess.Popen(taskset(store, ["mfsmaster", "-f", "start"]))
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

__all__ = ["cpu_list", "pinned", "split", "taskset"]


def split(store_cores: int) -> tuple[frozenset[int], frozenset[int]]:
    """(node's cores, store's cores): the last ``store_cores`` of this process's allowed
    cores go to the store. At least one must stay the node's."""
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= store_cores < len(allowed):
        raise ValueError(
            f"store cores {store_cores} must be 1..{len(allowed) - 1}: this process may "
            f"use {len(allowed)} core(s) ({cpu_list(allowed)}) and the node keeps at least one"
        )
    return frozenset(allowed[:-store_cores]), frozenset(allowed[-store_cores:])


def cpu_list(cpus: Iterable[int]) -> str:
    """``0,1,3`` as ``taskset -c`` and /proc's lists read it."""
    return ",".join(str(c) for c in sorted(cpus))


def taskset(cpus: Iterable[int], argv: list[str]) -> list[str]:
    """``argv`` run on ``cpus`` only: the affinity is set before the program's first
    instruction, so every thread it makes has it too."""
    return ["taskset", "-c", cpu_list(cpus), *argv]


def _threads() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


@contextlib.contextmanager
def pinned(cpus: Iterable[int]) -> Iterator[None]:
    """Every thread of this process on ``cpus`` while the block runs; threads and
    children started meanwhile inherit it. Each thread's own affinity is put back after
    (threads started inside the block keep ``cpus``)."""
    want = set(cpus)
    before: dict[int, set[int]] = {}
    for tid in _threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, want)
    try:
        yield
    finally:
        for tid, mask in before.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, mask)
