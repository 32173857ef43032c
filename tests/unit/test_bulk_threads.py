"""The node's threads that move a sandbox's bulk output (exec readers, the answers'
base64 encoders) run at nice 19, each on its own (Linux's nice is per thread): the event
loop's thread and every other thread of the node keep their priority."""

from __future__ import annotations

import os
import threading

from corral.api import bigbody
from corral.backends import initclient
from corral.host.sched import BULK_NICE, bulk_thread


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_bulk_thread_lowers_only_the_calling_thread() -> None:
    before = _nice()
    seen: list[int] = []

    def body() -> None:
        bulk_thread()
        seen.append(_nice())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [BULK_NICE]
    assert _nice() == before  # the caller's own thread is untouched


def test_the_readers_and_encoders_run_at_the_bulk_nice() -> None:
    before = _nice()
    for pool in (initclient._reader_pool, bigbody._encoders):
        assert pool.submit(_nice).result(timeout=30) == BULK_NICE
    assert _nice() == before
