"""The host scan after a bench node closed, given the kernel the time it needs.

An autoclear loop device is freed by the kernel asynchronously after the last unmount;
on a loaded host that takes seconds, so a scan right after ``close()`` can count a loop
device that nothing holds any more. The scan is repeated (up to ``settle`` seconds) until
it is empty or stops changing to empty; what is still there then is reported.
"""

from __future__ import annotations

import asyncio
import time

from corral.bench.scenarios import BenchOptions
from corral.host import leaks

__all__ = ["settled_scan"]


async def settled_scan(opts: BenchOptions, settle: float = 30.0) -> dict[str, list[str]]:
    """``leaks.scan`` of the bench node's dirs and subtree, retried for up to ``settle`` s."""
    deadline = time.monotonic() + settle
    while True:
        found = leaks.scan(opts.state_dir, opts.run_dir, opts.subtree, netns_prefix=opts.subtree)
        if leaks.total(found) == 0 or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.5)
