"""The seccomp listener's thread looks at its throttled sandboxes on each wake-up, not at
every sandbox it serves (a count of watches visited, not a timing)."""

from __future__ import annotations

import os
from pathlib import Path

from corral.host.seccomp_notify import NotifyListener


class _Counting(dict):  # type: ignore[type-arg]
    """A watch table that counts full walks over it."""

    walks = 0

    def values(self):  # type: ignore[no-untyped-def]
        type(self).walks += 1
        return super().values()


def test_a_wake_up_visits_only_throttled_watches(tmp_path: Path) -> None:
    lis = NotifyListener(tmp_path / "s.sock", lambda sid, call: None, rate=1.0, burst=1.0)
    pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(200)]
    try:
        for i, (r, _w) in enumerate(pipes):
            lis.watch(f"sb-{i}", r)
        lis._watches = _Counting(lis._watches)
        w = lis._watches[pipes[0][0]]
        lis._charge(w)
        lis._charge(w)  # out of tokens: throttled
        assert w.paused
        wait = lis._resume_due()
        assert 0 < wait and _Counting.walks == 0
        w.resume_at = 0.0  # its wait is over
        assert lis._resume_due() == -1.0 and not w.paused
        assert _Counting.walks == 0 and lis._paused == {}
    finally:
        lis.close()  # closes the read ends it owns
        for _r, wfd in pipes:
            os.close(wfd)
