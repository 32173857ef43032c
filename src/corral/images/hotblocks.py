"""Hot-block profiles: fetch the parts of a layer that sandboxes read, ahead of the faults.

On a network store every page fault of a sandbox on a layer page that is not cached is
one round trip to the store's servers, and a starting program faults one page after the
other: a Python start, five imports and a walk of a tree made ~300 faults in a row here,
~3 ms each through MooseFS behind a link with 0.5 ms each way, so the task took 1.1 s
where it took 0.18 s with the layers on local disk. The bytes were few (20 MiB); the
waiting was in series.

So a node records, once per layer, which parts of the layer file its sandboxes read, and
keeps that profile on the store next to the layer (``layers/<hex>.hot``); the next node
that mounts the layer reads the profile at the mount and, once the first sandbox using
the layer is up (:data:`DEFER`), exactly those parts, :data:`WORKERS` reads of
:data:`READ_CHUNK` in flight, while the burst goes on. The sandboxes' faults then find
the pages in the page cache, or wait for a read already under way. Measured (one image,
8 sandboxes at once, MooseFS behind 1 Gbit/s and 0.5 ms each way): the task took 0.21 s
instead of 1.15 s. This is what DSec's and Nydus's prefetch lists and eStargz's
"landmark" ordering do: what a task reads at start is much the same from one run to the
next.

Why only once a sandbox is up, and only a few reads in flight: a burst's creates make
store round trips of their own in series (a layer's first mount: lease, stamp, mount,
~17 round trips; every create: the image manifest), and on the link each queues behind
the prefetch bytes already asked for. Started at the mount with 16 x 256 KiB in flight
(the first default), up to 4 MiB (33 ms of 1 Gbit/s) sat ahead of each of those round
trips, and a quiet 64-sandbox burst's creates ended 1.5 s later than without prefetch.
Deferred, the create that mounts a layer has none of its prefetch ahead of it, and
later ones at most :data:`WORKERS` x 1 MiB (8 ms each on 1 Gbit/s, against a 1-3 ms round
trip). The lead's quiet pair (docs/shared-store.md): on-demand done 2.54 s deferred
against 3.10 s at the mount (cached 1.60-1.73 s). 8 reads in flight, not 2: a 1 MiB read
of a FUSE file reaches the store's client as 128 KiB requests in series, so 2 workers kept
about 2 requests on the wire.
:meth:`HotBlocks.start` is what the backend calls when a create returns
(``LayerMounts.started``; adopted layers count as up).

What a profile is: the byte extents of the layer file that were in this node's page cache
when the first sandbox using the layer was destroyed (``mincore`` over a read-only shared
mapping of the file: file-backed EROFS reads through the layer file's page cache). Each
node records once per layer: it writes a profile if the layer has none, and rewrites it
as the union if its sandboxes read :data:`GROW` more than the profile holds (so a
profile taken from a sandbox that did nothing does not stay). Never when the result
would cover over :data:`MAX_FRACTION` of the file: a layer hashed on its first mount, or
copied to local disk, is fully cached, and prefetching all of it would be an eager
pull. A profile is only a hint: the bytes still come from the layer file, which EROFS
reads as before; a bad or stale profile (a size that does not match the file) is
ignored. ``corral image gc`` removes it with its layer; delete it to record a new one.

Everything here is best effort and off the create path: the profile is read and the
reads are issued by daemon threads (a read on a store whose servers are gone blocks in
the kernel; it must not hold up a create or the node's exit), failures are logged and
dropped.

Example::

    hot = HotBlocks(store)
    hot.prefetch("sha256:ab12...", store.path_of("sha256:ab12..."))   # at first mount
    hot.start(["sha256:ab12..."])          # a sandbox using it is up (matters with defer)
    ...
    hot.record("sha256:ab12...", path)     # when a sandbox using the layer goes
    hot.drain(5.0)                         # node shutdown: let pending records finish
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from corral.errors import CorralError

__all__ = [
    "HotBlocks",
    "resident",
    "encode",
    "decode",
    "chunks",
    "resident_bytes",
    "MAX_FRACTION",
    "READ_CHUNK",
    "WORKERS",
]

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MAX_FRACTION = 0.5
"""A profile covering more of the file than this is not written (see the module doc)."""
MAX_EXTENTS = 1 << 16
"""Extents a profile may hold (a 1 MiB file at most; a longer one is refused on load)."""
READ_CHUNK = 1 << 20
"""Bytes per prefetch read. With :data:`WORKERS` reads in flight, the bytes a store round
trip of a create may find queued ahead of it on the link (see the module docstring).
Measured for one image's task alone, reads at the mount, at load ~10, three interleaved
runs each: 16 x 256 KiB 0.29-0.44 s, 8 x 128 KiB 0.40-0.65, 4 x 256 KiB 0.40-0.72,
32 x 128 KiB 0.43-0.49, 8 x 64 KiB 0.49-0.60 (none: 1.14-1.41); a burst's creates, not
one task, decided for 2 x 1 MiB."""
WORKERS = 8
"""Prefetch reads in flight per node. ``bench ondemand --sandboxes 64 --images 8``, three
interleaved pairs on a quiet machine (2026-12-04): on-demand done 1.829 / 1.931 / 1.852 s
with 8 against 1.979 / 2.198 / 2.103 s with 2 (cached 1.33-1.43 s in all six). Session 7
measured the same and kept 2 because the unreachable-store test then failed; that test's
failures turned out to be the host's page-cache reclaim, not the workers
(docs/shared-store.md, "When the store is unreachable")."""
DEFER = True
"""Hold a layer's prefetch until a sandbox using it is up (see the module docstring); False
reads from the mount on (the first default: 16 x 256 KiB)."""
GROW = 0.1
"""A node whose sandboxes read this much more of a layer than its profile says (a
fraction of the profile's pages) rewrites the profile as the union: a profile recorded
from a sandbox that did little (destroyed right after its create) does not stay the
layer's profile for good."""
_VERSION = 1
_IDLE_S = 10.0

# libc's mmap, munmap and mincore, declared once: the mapping's address must stay a
# pointer (a ctypes default int would truncate it). tests/unit/test_prefetch.py maps its
# anonymous regions with these too.
_libc = ctypes.CDLL(None, use_errno=True)
c_mmap = _libc.mmap
c_mmap.restype = ctypes.c_void_p
c_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
c_munmap = _libc.munmap
c_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
MAP_FAILED = ctypes.c_void_p(-1).value


class Store(Protocol):
    """What a profile needs of the layer store (LayerStore has it)."""

    def hot_profile(self, digest: str) -> bytes | None: ...

    def save_hot_profile(self, digest: str, data: bytes, *, replace: bool = False) -> None: ...


def resident(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """(file size, byte extents of ``path`` in the page cache), by ``mincore`` over a
    read-only shared mapping (nothing is read: mapping faults no page in)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, []
        addr = c_mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            c_munmap(addr, size)
    finally:
        os.close(fd)
    extents: list[tuple[int, int]] = []
    data = bytes(vec)
    start = -1
    for i, v in enumerate(data):
        if v & 1:
            if start < 0:
                start = i
        elif start >= 0:
            extents.append((start * PAGE, (i - start) * PAGE))
            start = -1
    if start >= 0:
        extents.append((start * PAGE, min(size, pages * PAGE) - start * PAGE))
    return size, extents


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (:func:`resident`'s extents summed)."""
    return sum(n for _, n in resident(path)[1])


def encode(size: int, extents: list[tuple[int, int]]) -> bytes:
    """The profile file: JSON with the layer file's size and ``[offset, length]`` pairs."""
    doc = {"version": _VERSION, "size": size, "extents": [list(e) for e in extents]}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes, size: int) -> list[tuple[int, int]] | None:
    """The extents of a profile for a layer file of ``size`` bytes; None if the profile
    is not one, is for another size, or reaches past the file."""
    try:
        doc = json.loads(data)
        if doc.get("version") != _VERSION or doc.get("size") != size:
            return None
        raw = doc["extents"]
        if not isinstance(raw, list) or len(raw) > MAX_EXTENTS:
            return None
        out = []
        for off, length in raw:
            if not (isinstance(off, int) and isinstance(length, int)):
                return None
            if off < 0 or length <= 0 or off + length > size:
                return None
            out.append((off, length))
        return out
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _pages(extents: list[tuple[int, int]]) -> set[int]:
    return {p for off, n in extents for p in range(off // PAGE, (off + n + PAGE - 1) // PAGE)}


def _extents(pages: set[int], size: int) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for p in sorted(pages):
        if out and out[-1][0] + out[-1][1] == p:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return [(p * PAGE, min(n * PAGE, size - p * PAGE)) for p, n in out if p * PAGE < size]


def chunks(extents: list[tuple[int, int]], most: int = READ_CHUNK) -> list[tuple[int, int]]:
    """``extents`` cut into reads of at most ``most`` bytes."""
    out = []
    for off, length in extents:
        while length > 0:
            n = min(length, most)
            out.append((off, n))
            off += n
            length -= n
    return out


class _Pool:
    """A few daemon threads taking jobs from a queue; a thread idle for :data:`_IDLE_S`
    ends (a process that opens many nodes keeps no idle threads of the closed ones). Not
    ThreadPoolExecutor: its threads are joined at interpreter exit, and a read stuck on a
    dead store would hang the exit."""

    def __init__(self, workers: int) -> None:
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._workers = workers
        self._started = 0
        self._lock = threading.Lock()
        self._busy = 0
        self._idle = threading.Condition(self._lock)

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._busy += 1
            if self._started < self._workers:
                self._started += 1
                threading.Thread(target=self._run, name="corral-hotblocks", daemon=True).start()
            self._jobs.put(job)  # under the lock: an idle thread ends only on an empty queue

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._started -= 1
                        return
                continue
            try:
                job()
            except (OSError, CorralError) as e:
                # A read-only or unreachable store, a layer removed meanwhile: a hint that
                # failed is only a slower start.
                log.debug("hot blocks: %s", e)
            except Exception:
                log.warning("hot-block job failed", exc_info=True)
            finally:
                with self._lock:
                    self._busy -= 1
                    if self._busy == 0:
                        self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until no job is queued or running; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True


class _File:
    """An fd shared by the reads of one prefetch, closed after the last one."""

    def __init__(self, path: Path, reads: int) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        # Each read fetches its own extent, no more: no kernel read-ahead on this fd.
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._left = reads
        self._lock = threading.Lock()

    def read(self, off: int, length: int) -> None:
        try:
            os.pread(self.fd, length, off)
        finally:
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                os.close(self.fd)


class HotBlocks:
    """Prefetch of recorded hot blocks from a layer's mount (with ``defer``: once a
    sandbox using it is up), and their recording (see the module docstring).
    Thread-safe."""

    def __init__(
        self,
        store: Store,
        *,
        workers: int | None = None,
        chunk: int | None = None,
        defer: bool | None = None,
    ) -> None:
        # The module's switches are read here, not bound as defaults: a bench (or an
        # operator's test) that flips them affects the nodes it opens afterwards.
        self._store = store
        self._chunk = READ_CHUNK if chunk is None else chunk
        self._defer = DEFER if defer is None else defer
        self._plan = _Pool(2)  # reads profiles and records: a store round trip or a few
        self._reads = _Pool(WORKERS if workers is None else workers)
        self._lock = threading.Lock()
        self._recorded: set[str] = set()
        """Layers this node has recorded (or tried to): one record per layer per node."""
        self._up: set[str] = set()
        """Mounted layers a sandbox using them is up on (:meth:`start`)."""
        self._held: dict[str, tuple[Path, list[tuple[int, int]]]] = {}
        """Planned reads of mounted layers no sandbox is up on yet."""

    def prefetch(self, digest: str, path: Path) -> None:
        """At layer ``digest``'s mount (file ``path``): read its profile now and its hot
        blocks once :meth:`start` says a sandbox using it is up (at once if not
        ``defer``); returns at once."""
        with self._lock:
            self._up.discard(digest)
        self._plan.submit(lambda: self._prefetch(digest, path))

    def start(self, digests: list[str]) -> None:
        """A sandbox using layers ``digests`` is up (its create has returned): start
        reading their hot blocks, if not under way already."""
        for digest in digests:
            with self._lock:
                self._up.add(digest)
                held = self._held.pop(digest, None)
            if held is not None:
                self._issue(*held)

    def forget(self, digest: str) -> None:
        """Layer ``digest`` is unmounted: drop its held reads."""
        with self._lock:
            self._up.discard(digest)
            self._held.pop(digest, None)

    def _prefetch(self, digest: str, path: Path) -> None:
        data = self._store.hot_profile(digest)
        if data is None:
            return
        extents = decode(data, path.stat().st_size)
        if extents is None:
            log.warning("ignoring the hot-block profile of %s: not one for %s", digest, path)
            return
        reads = chunks(extents, self._chunk)
        if not reads:
            return
        with self._lock:
            if self._defer and digest not in self._up:
                self._held[digest] = (path, reads)
                return
        self._issue(path, reads)

    def _issue(self, path: Path, reads: list[tuple[int, int]]) -> None:
        try:
            f = _File(path, len(reads))
        except OSError as e:  # unmounted and removed meanwhile
            log.debug("hot blocks of %s: %s", path, e)
            return
        for off, length in reads:
            self._reads.submit(functools.partial(f.read, off, length))

    def record(self, digest: str, path: Path) -> None:
        """Record what of ``path`` is cached as (or into) the profile of ``digest``, once
        per layer on this node; in the background (destroys never wait on the store)."""
        with self._lock:
            if digest in self._recorded:
                return
            self._recorded.add(digest)
        self._plan.submit(lambda: self._record(digest, path))

    def _record(self, digest: str, path: Path) -> None:
        size, extents = resident(path)
        if not extents or len(extents) > MAX_EXTENTS:
            return
        cached = _pages(extents)
        raw = self._store.hot_profile(digest)
        old = decode(raw, size) if raw is not None else None
        known = _pages(old) if old else set()
        union = cached | known
        if len(union) * PAGE > MAX_FRACTION * size:
            return  # hashed or copied here (or profiles grown past a hint): keep the old
        if raw is not None and len(union) - len(known) <= GROW * len(known):
            return  # nothing much new (a node that prefetched holds the profile itself)
        self._store.save_hot_profile(
            digest, encode(size, _extents(union, size)), replace=raw is not None
        )

    def drain(self, timeout: float) -> bool:
        """Wait for pending profile reads, prefetches and records (node shutdown, benches);
        False if they did not finish within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        return self._plan.drain(timeout) and self._reads.drain(
            max(0.0, deadline - time.monotonic())
        )
