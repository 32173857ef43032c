"""Per-node, refcounted mounts of EROFS layers: each layer is mounted once and shared.

Every sandbox using a layer reads it through the same mount (one page cache, nothing
copied). A layer lives at ``<mount_root>/raw/<hex>``; when sandboxes run in a user
namespace it is also cloned, idmapped to that namespace, at ``<mount_root>/idmap/<hex>``
— the directory handed to overlayfs as a lower — so host-root files appear owned by the
sandbox's root.

With ``leases`` (images/leases.py), a marker on the store says which layers this node has
mounted, so ``corral image gc`` run from any node keeps them: it is taken before a
layer's first mount (in a thread, while the layer is verified: on a network store both
are round trips) and dropped after its last unmount.

With ``hot`` (images/hotblocks.py), a layer's first mount on this node reads its profile,
and once the first sandbox using the layer is up (the backend says so through
:meth:`LayerMounts.started` when a create returns; hotblocks' ``DEFER``) the node reads,
in the background, the parts of the layer file that sandboxes read on the node that
recorded it; when a sandbox using a layer without a profile goes, its reads are recorded.

With ``direct_io`` (``"on"``, or ``"auto"``: when the layer file is on a local disk
filesystem, ``LOCAL_DISK_FS``), a layer is mounted with direct I/O: EROFS then reads the
file past the file's own page cache, so what sandboxes read is cached once, as the EROFS
files' pages, instead of a second time as the layer file's (a used-once duplicate, plus the
file's read-ahead: 46 MiB of a layer file for 26 MiB of a python program's pages). Such a
layer gets no hot-block prefetch or profile (both live in that page cache), and the file's
pages a first mount's verification leaves (it hashes the whole file) are dropped. On a
network store (``"auto"`` leaves FUSE, NFS and the rest buffered) the file's page cache is
what the prefetch fills and the client's read-ahead works in, so it stays.

With ``linger`` (seconds), a layer whose last sandbox went stays mounted (and leased) that
long: an RL loop that destroys a sandbox and creates the next from the same image, or a
burst after a quiet spell, then takes the mounted layer instead of verifying (reading the
whole file, over the network on a shared store) and mounting it again. :meth:`sweep`
unmounts the layers idle past ``linger``; the backend calls it when :meth:`next_due` says
one is due, and sleeps while none lingers (``lingered`` wakes it when one starts to). A
lingering layer is not in :meth:`mounted` (no sandbox uses it) but its lease keeps store gc
off it until it is swept.

Example::

    layers = LayerMounts(Path("/run/corral/layers"), store.path_of, store.verify, userns,
                         leases=store.leases("node-1a2b3c4d5e6f"))
    lower = layers.acquire("sha256:ab12...")    # mounts on first use
    ...                                          # overlay over ``lower``
    layers.release("sha256:ab12...")            # unmounted when the last user goes
                                                 # (or ``linger`` seconds later)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

from corral.errors import HostError, InvalidRequest
from corral.host import _sys, mounts, pagecache
from corral.host.userns import UserNamespace
from corral.images.hotblocks import HotBlocks
from corral.images.leases import Leases

__all__ = ["LayerMounts", "LOCAL_DISK_FS", "DIRECT_IO_MODES"]

LOCAL_DISK_FS = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0xF2F52010: "f2fs"}
"""statfs types of the block-device filesystems on which ``direct_io="auto"`` mounts a
layer file with direct I/O."""

DIRECT_IO_MODES = ("auto", "on", "off")


def _hex(digest: str) -> str:
    algo, sep, value = digest.partition(":")
    hexpart = value if sep else algo
    if not hexpart or not all(c in "0123456789abcdef" for c in hexpart) or len(hexpart) > 128:
        raise InvalidRequest(f"bad layer digest {digest!r} (want sha256:<hex>)")
    return hexpart


class LayerMounts:
    """Refcounted EROFS layer mounts under ``mount_root`` (thread-safe)."""

    def __init__(
        self,
        mount_root: Path,
        resolve: Callable[[str], Path],
        verify: Callable[[str], None],
        userns: UserNamespace | None,
        *,
        leases: Leases | None = None,
        hot: HotBlocks | None = None,
        linger: float = 0.0,
        lingered: Callable[[], None] = lambda: None,
        direct_io: str = "off",
    ) -> None:
        """``lingered``: called when a layer starts to linger, in the thread that released
        it with that layer's lock held (so it must not acquire or release): the sweeper's
        wake-up."""
        self.mount_root = Path(mount_root)
        self.raw_root = self.mount_root / "raw"
        self.idmap_root = self.mount_root / "idmap"
        self._resolve = resolve
        self._verify = verify
        self._userns = userns
        self._leases = leases
        self._hot = hot
        self._files: dict[str, Path] = {}  # digest -> the layer file mounted (for hot)
        self._lock = threading.Lock()  # guards _counts and _locks
        self._counts: dict[str, int] = {}
        self.linger = linger
        self._lingered = lingered
        if direct_io not in DIRECT_IO_MODES:
            raise InvalidRequest(f"direct_io {direct_io!r}: want one of {DIRECT_IO_MODES}")
        self._direct_io = direct_io
        self._idle: dict[str, float] = {}  # digest -> monotonic time its last user went
        # One lock per digest, so a slow first mount (verify hashes the whole file)
        # of one layer does not hold up acquires of others.
        self._locks: dict[str, threading.Lock] = {}
        self.raw_root.mkdir(parents=True, exist_ok=True)
        if userns is not None:
            self.idmap_root.mkdir(parents=True, exist_ok=True)

    def _digest_lock(self, digest: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(digest, threading.Lock())

    def _paths(self, digest: str) -> tuple[Path, Path]:
        h = _hex(digest)
        return self.raw_root / h, self.idmap_root / h

    def _lower(self, digest: str) -> Path:
        raw, idm = self._paths(digest)
        return idm if self._userns is not None else raw

    def acquire(self, digest: str) -> Path:
        """Take a reference to layer ``digest``; returns the directory to use as a lower.

        The first acquire on this node verifies the layer file against its digest and
        mounts it; later ones only count.
        """
        raw, idm = self._paths(digest)
        with self._digest_lock(digest):
            with self._lock:
                if self._counts.get(digest, 0) > 0:
                    self._counts[digest] += 1
                    return self._lower(digest)
                if self._idle.pop(digest, None) is not None:  # lingering: still mounted
                    self._counts[digest] = 1
                    return self._lower(digest)
            lease = _Lease(self._leases, digest)  # before the mount: gc never sees it unleased
            try:
                self._mount(digest, raw, idm, verify=True, leased=lease.wait)
            except BaseException:
                lease.undo()
                raise
            with self._lock:
                self._counts[digest] = 1
        return self._lower(digest)

    def _mount(
        self,
        digest: str,
        raw: Path,
        idm: Path,
        verify: bool,
        leased: Callable[[], None] = lambda: None,
    ) -> None:
        """Mount ``digest`` (verified first if ``verify``); ``leased`` returns once its
        lease is on the store (raising if it could not be taken), and is called right
        before the EROFS mount."""
        if not mounts.is_mountpoint(raw):
            image = self._resolve(digest)
            if verify:
                self._verify(digest)  # raises LayerCorrupt before anything is mounted
            leased()
            direct = self.direct(image)
            if direct:
                with contextlib.suppress(OSError):  # no use to the mount: see the docstring
                    pagecache.evict(image)
            elif self._hot is not None:
                self._hot.prefetch(digest, image)  # in the background, with the mount
                with self._lock:
                    self._files[digest] = image
            raw.mkdir(exist_ok=True)
            mounts.mount_erofs(image, raw, direct=direct)
        else:
            leased()
        if self._userns is not None and not mounts.is_mountpoint(idm):
            idm.mkdir(exist_ok=True)
            try:
                mounts.mount_idmapped(raw, idm, self._userns.fd)
            except HostError:
                self._unmount(raw, idm)
                raise

    def direct(self, image: Path) -> bool:
        """Whether layer file ``image`` is mounted with direct I/O (``direct_io``)."""
        if self._direct_io == "auto":
            try:
                return _sys.fs_type(image) in LOCAL_DISK_FS
            except OSError:
                return False  # the mount will say what is wrong with the file
        return self._direct_io == "on"

    def release(self, digest: str, *, record: bool = True) -> None:
        """Drop a reference; the last one unmounts the layer. ``record``: the sandbox
        ran, so what it read counts for the layer's hot-block profile (not after a
        failed create).

        Overlays already built on the layer keep working: overlayfs holds its own
        reference to each lower.
        """
        raw, idm = self._paths(digest)
        with self._digest_lock(digest):
            with self._lock:
                n = self._counts.get(digest, 0)
                if n <= 0:
                    raise HostError(f"layer {digest} released more often than acquired")
                image = self._files.get(digest)
                if n > 1:
                    self._counts[digest] = n - 1
            if self._hot is not None and image is not None and record:
                self._hot.record(digest, image)  # once per layer on this node
            if n > 1:
                return
            if self.linger > 0:
                with self._lock:
                    del self._counts[digest]
                    self._idle[digest] = time.monotonic()
                self._lingered()
                return
            self._drop(digest)

    def _drop(self, digest: str) -> None:
        """Unmount a layer no sandbox uses (its digest lock held) and drop its lease."""
        raw, idm = self._paths(digest)
        self._unmount(raw, idm)
        if self._hot is not None:
            self._hot.forget(digest)
        with self._lock:
            self._counts.pop(digest, None)
            self._files.pop(digest, None)
        if self._leases is not None:
            self._leases.drop(digest)

    def lingering(self) -> list[str]:
        """Digests of the layers still mounted that no sandbox uses (see ``linger``)."""
        with self._lock:
            return list(self._idle)

    def next_due(self) -> float | None:
        """When (a :func:`time.monotonic` value) the layer lingering longest is due to be
        swept; None while no layer lingers."""
        with self._lock:
            return min(self._idle.values()) + self.linger if self._idle else None

    def sweep(self, now: float | None = None) -> list[str]:
        """Unmount the layers no sandbox has used for ``linger`` seconds (as of ``now``, a
        :func:`time.monotonic` value; default now); returns their digests."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [d for d, t in self._idle.items() if now - t >= self.linger]
        gone = []
        for digest in due:
            with self._digest_lock(digest):
                with self._lock:  # taken again meanwhile, or released once more since?
                    t = self._idle.get(digest)
                    if t is None or now - t < self.linger:
                        continue
                    del self._idle[digest]
                self._drop(digest)
                gone.append(digest)
        return gone

    @staticmethod
    def _unmount(raw: Path, idm: Path) -> None:
        for p in (idm, raw):
            mounts.umount(p)
            try:
                p.rmdir()
            except OSError:
                pass

    def adopt(self, counts: dict[str, int]) -> None:
        """Take over the mounts left by a previous agent, with these refcounts.

        Mounts under ``mount_root`` of layers not in ``counts`` are unmounted; layers in
        ``counts`` that are not (fully) mounted are mounted again (after verification).
        """
        wanted = {_hex(d): d for d, n in counts.items() if n > 0}
        for point in mounts.mounts_under(self.mount_root):
            if point == self.mount_root:
                continue  # the root itself may be a (private) mount made by the node
            if point.parent not in (self.raw_root, self.idmap_root):
                mounts.umount(point, detach=True)  # nothing of ours lives elsewhere
                continue
            if point.name not in wanted or (
                point.parent == self.idmap_root and self._userns is None
            ):
                mounts.umount(point, detach=True)
        for root in (self.idmap_root, self.raw_root):
            if root.is_dir():
                for entry in root.iterdir():
                    if entry.name not in wanted and not mounts.is_mountpoint(entry):
                        try:
                            entry.rmdir()
                        except OSError:
                            pass
        with self._lock:
            self._counts = {}
            self._idle = {}
        if self._leases is not None:
            for digest in self._leases.held():
                if _hex(digest) not in wanted:
                    self._leases.drop(digest)
        for h, digest in wanted.items():
            raw, idm = self.raw_root / h, self.idmap_root / h
            with self._digest_lock(digest):
                if self._leases is not None:
                    self._leases.take(digest)
                self._mount(digest, raw, idm, verify=not mounts.is_mountpoint(raw))
                with self._lock:
                    self._counts[digest] = counts[digest]
        self.started(list(wanted.values()))  # the adopted sandboxes are up

    def started(self, digests: list[str]) -> None:
        """A sandbox using layers ``digests`` is up: their hot-block prefetch may start
        (see :meth:`HotBlocks.start`)."""
        if self._hot is not None:
            self._hot.start(digests)

    def ready(self) -> set[str]:
        """Digests of the layers mounted now, used or lingering: an acquire only counts."""
        with self._lock:
            return {*self._counts, *self._idle}

    def mounted(self) -> dict[str, int]:
        """{digest: refcount} of the layers mounted now."""
        with self._lock:
            return dict(self._counts)

    def unmount_all(self) -> None:
        """Unmount every layer (node shutdown); refcounts are forgotten."""
        with self._lock:
            digests = [*self._counts, *self._idle]
            self._counts = {}
            self._idle = {}
        for d in digests:
            raw, idm = self._paths(d)
            with self._digest_lock(d):
                self._unmount(raw, idm)
            if self._leases is not None:
                self._leases.drop(d)
        for point in mounts.mounts_under(self.mount_root):
            if point != self.mount_root:
                mounts.umount(point, detach=True)
        if self._hot is not None:
            self._hot.drain(_DRAIN_S)  # profiles being written reach the store


class _Lease:
    """A layer's lease being taken on the store in a thread of its own, while the caller
    resolves and verifies the layer: on a network store each of the two is several round
    trips in a row (a lease on MooseFS behind 0.5 ms each way: ~20 ms, mkdir + create +
    write; the stamped verification ~15 ms), and a first mount made them one after the
    other. The lease still comes before the mount (:meth:`wait`)."""

    def __init__(self, leases: Leases | None, digest: str) -> None:
        self._leases = leases
        self._digest = digest
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if leases is not None:
            self._thread = threading.Thread(target=self._take, name="corral-lease", daemon=True)
            self._thread.start()

    def _take(self) -> None:
        assert self._leases is not None
        try:
            self._leases.take(self._digest)
        except BaseException as e:  # handed to wait()
            self._error = e

    def wait(self) -> None:
        """Return once the lease is taken; raise what taking it raised."""
        if self._thread is not None:
            self._thread.join()  # Leases.take has the store's deadline
            if self._error is not None:
                raise self._error

    def undo(self) -> None:
        """The mount failed: drop the lease once taking it has ended."""
        if self._thread is not None:
            self._thread.join()
            if self._error is None:
                assert self._leases is not None
                self._leases.drop(self._digest)


_DRAIN_S = 5.0
"""How long a node's shutdown waits for hot-block profiles being read or written."""
