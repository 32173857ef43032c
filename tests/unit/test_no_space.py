"""ENOSPC during a create is blamed on the scratch filesystem only when that is what ran
out (its free space faked here: the logic, not the kernel)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from corral.errors import CapacityError, HostError, ScratchFull
from corral.node import lifecycle

SCRATCH = Path("/var/lib/corral/scratch")


def _enospc(filename: str | None = None) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", filename)


def _chained(inner: BaseException) -> HostError:
    try:
        raise inner
    except BaseException as e:
        try:
            raise HostError("creating the sandbox failed") from e
        except HostError as outer:
            return outer


@pytest.fixture
def free(monkeypatch: pytest.MonkeyPatch) -> dict[str, int | None]:
    room: dict[str, int | None] = {"bytes": 10 << 30}
    monkeypatch.setattr(lifecycle, "_free_bytes", lambda path: room["bytes"])
    return room


def test_a_path_on_another_filesystem_is_named(free) -> None:  # type: ignore[no-untyped-def]
    err = lifecycle._no_space_error(
        "sb-1", _chained(_enospc("/run/corral/launch/.sb-1.tmp")), SCRATCH
    )
    assert type(err) is CapacityError
    assert "/run/corral/launch/.sb-1.tmp" in err.message and "not the node's scratch" in err.message
    assert "10240 MiB free" in err.message


def test_a_path_in_the_scratch_is_scratch_full_whatever_statvfs_says(free) -> None:  # type: ignore[no-untyped-def]
    # btrfs can run out of metadata space with data space left.
    err = lifecycle._no_space_error("sb-1", _enospc(str(SCRATCH / "sb-1" / "upper")), SCRATCH)
    assert isinstance(err, ScratchFull)


def test_no_path_scratch_with_room_is_not_blamed(free) -> None:  # type: ignore[no-untyped-def]
    # The launcher's one-line report: no file name, only the message.
    e = HostError("corral-launch sb-1: record: No space left on device")
    err = lifecycle._no_space_error("sb-1", e, SCRATCH)
    assert type(err) is CapacityError and "a host filesystem ran out of space" in err.message


@pytest.mark.parametrize("room", [0, (8 << 20) - 1, None])
def test_no_path_scratch_low_or_unknown_is_scratch_full(free, room) -> None:  # type: ignore[no-untyped-def]
    free["bytes"] = room
    err = lifecycle._no_space_error("sb-1", _chained(_enospc()), SCRATCH)
    assert isinstance(err, ScratchFull) and str(SCRATCH) in err.message
