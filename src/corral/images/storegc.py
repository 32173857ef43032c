"""Garbage collection of the layer store: remove layers nothing uses any more.

Snapshots, builds and composes add layers; removing an image leaves its layers. gc
removes a layer only when all three hold:

* no image manifest references it;
* no node holds a lease on it (``leases/<hex>/<holder>``, written by every node's layer
  mounts before the first mount, images/leases.py), so a layer mounted anywhere stays,
  whichever node runs gc;
* its files have not been touched for ``grace`` seconds. A build adds its layer before
  it writes the image that references it, and a deduplicated build or a compose touches
  the layer's record (store.py ``_adopt``, ``put_image``), so a layer a build is about to
  reference is young and stays.

Right before a removal both conditions that other hosts can change (references, leases)
are read again. What remains is a window of the length of one unlink between that check
and the removal, against a writer that must touch the record, write a manifest and check
the record again (``put_image``) inside it; a writer that loses reports LayerNotFound
instead of leaving a broken image.

The record goes first (a file without a record is invisible to every reader), then the
file; a file left without a record (a gc or builder that died between the two) is
removed by a later run once it is older than the grace period. ``tmp/`` files of dead
builders go after ``max(grace, 6 h)``.

Example::

    report = store.gc(grace=3600, dry_run=True)
    print(report.removed, report.kept_leased)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from corral.images.leases import Leases

if TYPE_CHECKING:
    from corral.images.store import LayerStore

__all__ = ["GcReport", "collect"]

_TMP_MIN_AGE = 6 * 3600.0


@dataclass
class GcReport:
    """What one gc run did (or, with ``dry_run``, would do)."""

    dry_run: bool
    removed: list[str] = field(default_factory=list)
    """Digests removed (or that would be)."""
    freed_bytes: int = 0
    kept_leased: dict[str, list[str]] = field(default_factory=dict)
    """Unreferenced layers kept because nodes have them mounted: digest -> holders."""
    kept_young: list[str] = field(default_factory=list)
    """Unreferenced layers kept because they were touched within the grace period."""
    referenced: int = 0
    """Layers referenced by at least one image."""
    tmp_removed: int = 0


def _mtime(paths: tuple[Path, Path]) -> float | None:
    times = []
    for p in paths:
        try:
            times.append(p.stat().st_mtime)
        except FileNotFoundError:
            continue
    return max(times) if times else None


def _referenced(store: LayerStore) -> set[str]:
    return {d for image in store.images() for d in image.layers}


def collect(store: LayerStore, *, grace: float, dry_run: bool) -> GcReport:
    """Remove (or list, with ``dry_run``) the layers of ``store`` that nothing uses."""
    if grace < 0:
        raise ValueError(f"grace {grace} must be >= 0 seconds")
    report = GcReport(dry_run=dry_run)
    layers_dir = store.root / "layers"
    digests = sorted(
        {f"sha256:{p.stem}" for p in layers_dir.iterdir() if p.suffix in (".erofs", ".json")}
    )
    referenced = _referenced(store)
    report.referenced = len(referenced & set(digests))
    now = time.time()
    for digest in digests:
        if digest in referenced:
            continue
        holders = Leases.holders_of(store.root, digest)
        if holders:
            report.kept_leased[digest] = holders
            continue
        paths = store._layer_paths(digest)
        mtime = _mtime(paths)
        if mtime is None:
            continue  # removed meanwhile
        if now - mtime < grace:
            report.kept_young.append(digest)
            continue
        # Read again what other hosts may have changed since the listing.
        if digest in _referenced(store) or Leases.holders_of(store.root, digest):
            continue
        path, record = paths
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        report.removed.append(digest)
        report.freed_bytes += size
        if not dry_run:
            record.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            path.with_suffix(".verified").unlink(missing_ok=True)
            path.with_suffix(".hot").unlink(missing_ok=True)
            store.forget_verified(digest)
    if not dry_run:
        for suffix in ("*.verified", "*.hot"):  # of layers removed by older versions
            for stamp in layers_dir.glob(suffix):
                if not stamp.with_suffix(".erofs").exists():
                    stamp.unlink(missing_ok=True)
        report.tmp_removed = store.clean_tmp(older_than=max(grace, _TMP_MIN_AGE))
    return report
