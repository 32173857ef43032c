"""What the reaper needs to know without looking at every sandbox on every pass.

The reaper used to ask every live sandbox's backend "alive?" once per second (a state
file read, a JSON parse and a /proc read each: ~0.3 s of the event loop per second at
3,200 sandboxes, the exec latency growing with them) and to compare every sandbox's
TTL and idle clock. Both are O(live) per pass. Here:

* :class:`DeathWatch` holds a pidfd of each sandbox's main process (the init, the VMM) in
  the event loop's epoll: the kernel makes it readable when the process exits, so a
  death costs one callback when it happens and nothing meanwhile. A sandbox whose pid
  cannot be watched (no pid, out of fds, a backend whose pid is not its life) is still
  covered by a bounded round-robin slice of ``alive()`` checks per pass
  (:meth:`DeathWatch.sample`), a safety net for deaths a pid does not show.
  Pidfds are capped (:func:`pidfd_budget`): with one seccomp listener fd per sandbox as
  well, 10,000 sandboxes would take every fd of a node whose RLIMIT_NOFILE it cannot
  raise (20,000 here, without CAP_SYS_RESOURCE), and a create needs fds of its own.
  Past the cap a sandbox's death is found by the sample instead (slower, not missed).
* :class:`Deadlines` is a heap of the next moment each sandbox with a TTL, idle pause or
  idle timeout needs a look. A pass pops only what is due; activity does not touch the
  heap: a popped idle deadline is recomputed from the last activity and pushed again.
  One live heap entry per sandbox (``_armed``), so re-arming never piles up entries.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import resource

from corral.spec import SandboxInfo

__all__ = ["DeathWatch", "Deadlines", "next_deadline", "pidfd_budget", "SAMPLE"]

log = logging.getLogger("corral.node")

SAMPLE = 32
"""Sandboxes whose ``alive()`` a pass checks besides the ones a pidfd reported: at one
pass a second, every sandbox of a 3,200 node is looked at every 100 s."""


RESERVED_FDS = 2048
"""Open files the node keeps for everything but pidfds: the other fd each sandbox holds
(its seccomp listener) is counted apart; this is the state database, sockets, clients,
and what a create, an exec or an image build opens while it runs."""


def pidfd_budget(nofile: int | None = None) -> int:
    """How many pidfds the node may hold: half of what RLIMIT_NOFILE leaves beyond
    :data:`RESERVED_FDS` (the other half is each sandbox's seccomp listener fd)."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(0, (nofile - RESERVED_FDS) // 2)


class DeathWatch:
    """Pidfds of the sandboxes' main processes, read by the event loop; at most
    ``max_fds`` (default :func:`pidfd_budget` at construction)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop | None = None, max_fds: int | None = None
    ) -> None:
        self._loop = loop
        self.max_fds = pidfd_budget() if max_fds is None else max_fds
        self._fds: dict[str, int] = {}
        self._dead: set[str] = set()
        self._ring: dict[str, None] = {}  # insertion-ordered: the round-robin order

    def watch(self, sandbox_id: str, pid: int | None) -> None:
        """Track ``sandbox_id`` (idempotent); with a pid, be told when it exits."""
        self._ring.setdefault(sandbox_id, None)
        if not pid or sandbox_id in self._fds or pid == os.getpid():
            return
        if len(self._fds) >= self.max_fds:
            return  # out of budget: the ring covers it
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._dead.add(sandbox_id)  # gone before we looked: the next pass checks it
            return
        except OSError as e:  # EMFILE, or a kernel without pidfds: the ring covers it
            log.debug("no pidfd for sandbox %s (pid %d): %s", sandbox_id, pid, e)
            return
        try:
            loop = self._loop or asyncio.get_running_loop()
            loop.add_reader(fd, self._exited, sandbox_id)
        except Exception:
            os.close(fd)  # no loop to read it (a synchronous caller): the ring covers it
            return
        self._fds[sandbox_id] = fd

    def _exited(self, sandbox_id: str) -> None:
        self._close(sandbox_id)
        self._dead.add(sandbox_id)

    def _close(self, sandbox_id: str) -> None:
        fd = self._fds.pop(sandbox_id, None)
        if fd is not None:
            loop = self._loop or asyncio.get_running_loop()
            loop.remove_reader(fd)
            os.close(fd)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: drop its pidfd and marks."""
        self._close(sandbox_id)
        self._dead.discard(sandbox_id)
        self._ring.pop(sandbox_id, None)

    def close(self) -> None:
        for sid in list(self._fds):
            self._close(sid)

    def reported(self) -> list[str]:
        """Sandboxes whose process exited since they were last taken (kept until
        :meth:`settled`: a busy or paused one is looked at again on a later pass)."""
        return list(self._dead)

    def settled(self, sandbox_id: str) -> None:
        self._dead.discard(sandbox_id)

    def sample(self, n: int = SAMPLE) -> list[str]:
        """The next ``n`` tracked sandboxes in round-robin order: O(n), not O(live). The
        ring is an insertion-ordered dict; a taken sandbox moves to its end."""
        out: list[str] = []
        for _ in range(min(n, len(self._ring))):
            sid = next(iter(self._ring))
            del self._ring[sid]
            self._ring[sid] = None
            out.append(sid)
        return out

    @property
    def watched(self) -> int:
        """Sandboxes with a pidfd in the loop (for tests and status)."""
        return len(self._fds)


def next_deadline(info: SandboxInfo) -> float | None:
    """When ``info`` next needs the reaper: its TTL, and for a running one the end of its
    idle pause or idle timeout counted from its last activity; None if never."""
    times = []
    if info.expires_at:
        times.append(info.expires_at)
    if info.state == "running":
        for idle in (info.spec.idle_pause, info.spec.idle_timeout):
            if idle:
                times.append(info.last_active_at + idle)
    return min(times) if times else None


class Deadlines:
    """A lazy heap of (when, sandbox) with one live entry per sandbox."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._armed: dict[str, float] = {}

    def arm(self, sandbox_id: str, when: float | None) -> None:
        """Look at ``sandbox_id`` no later than ``when`` (an earlier arming stands)."""
        if when is None:
            return
        cur = self._armed.get(sandbox_id)
        if cur is not None and cur <= when:
            return
        self._armed[sandbox_id] = when
        heapq.heappush(self._heap, (when, sandbox_id))

    def forget(self, sandbox_id: str) -> None:
        if self._armed.pop(sandbox_id, None) is not None and len(self._heap) > 64 + 2 * len(
            self._armed
        ):
            # Entries of forgotten sandboxes wait in the heap until their time (a day's
            # TTL): rebuild once they are half of it, O(1) amortised per forget.
            self._heap = [(w, sid) for sid, w in self._armed.items()]
            heapq.heapify(self._heap)

    def due(self, now: float) -> list[str]:
        """Sandboxes whose deadline is at or before ``now``, taken off the heap (the caller
        re-arms the ones that still have a deadline)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            when, sid = heapq.heappop(self._heap)
            if self._armed.get(sid) == when:
                del self._armed[sid]
                out.append(sid)
        return out

    def __len__(self) -> int:
        return len(self._armed)


def rearm_all(deadlines: Deadlines, infos: list[SandboxInfo]) -> None:
    """Arm every sandbox (once, at start: the ones adopted before the reaper ran)."""
    for info in infos:
        deadlines.arm(info.id, next_deadline(info))
