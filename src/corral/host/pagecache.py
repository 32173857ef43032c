"""Evicting one file from the page cache (cold reads in benches and tests, without
dropping the whole machine's cache)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["evict"]


def evict(path: Path | str) -> None:
    """Drop ``path``'s clean pages from the page cache (OSError if it cannot be opened)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
