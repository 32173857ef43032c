"""A desktop VM's screen and input over QMP: screenshots (``screendump``, PNG) and
pointer/keyboard events (``input-send-event``).

Every event batch ends in one report to the guest's virtio input device, which drops a
report when the guest has not handed it enough buffers back (64 per device). Events are
therefore sent one report at a time with a short pause between reports, so a slow TCG
guest keeps up; an action returns once its last report was delivered to the device.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from corral.backends.vm import keys
from corral.backends.vm.qmp import QMP
from corral.errors import InvalidRequest, SandboxError
from corral.spec import DesktopInput

__all__ = ["Screen"]

_PACE = 0.01  # seconds between input reports
_DRAG_STEPS = 20  # most intermediate pointer moves of a drag
_PNG = b"\x89PNG\r\n\x1a\n"

Events = list[dict[str, object]]


class Screen:
    """The display and input devices of one VM (QMP at ``sandbox_dir/qmp.sock``)."""

    def __init__(self, sandbox_dir: Path, width: int, height: int) -> None:
        self.dir = sandbox_dir
        self.width = width
        self.height = height
        self._lock = asyncio.Lock()  # QMP serves one client at a time

    async def screenshot(self) -> bytes:
        """The screen as PNG bytes."""
        async with self._lock:
            data = await asyncio.to_thread(self._screendump)
        if not data.startswith(_PNG):
            raise SandboxError(f"screenshot: QEMU wrote {len(data)} bytes that are not a PNG")
        return data

    def _screendump(self) -> bytes:
        """QEMU writes the PNG into a memfd handed to it over QMP (``add-fd``): QEMU runs
        chrooted as an unprivileged uid and opens no path of ours."""
        mem = os.memfd_create("corral-screendump", os.MFD_CLOEXEC)
        try:
            # An fd set hands out a dup only to an open with the same access mode:
            # QEMU opens the screendump file write-only.
            wr = os.open(f"/proc/self/fd/{mem}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                with QMP(self.dir / "qmp.sock") as q:
                    added = q.execute("add-fd", fds=[wr])
                    fdset = added["fdset-id"]
                    try:
                        q.execute("screendump", filename=f"/dev/fdset/{fdset}", format="png")
                    finally:
                        q.execute("remove-fd", **{"fdset-id": fdset})
            finally:
                os.close(wr)
            size = os.fstat(mem).st_size
            return os.pread(mem, size, 0)
        finally:
            os.close(mem)

    async def act(self, req: DesktopInput) -> None:
        """One input action (see :class:`corral.spec.DesktopInput`)."""
        batches = self._batches(req)
        async with self._lock:
            await asyncio.to_thread(self._send, batches)

    def _send(self, batches: list[Events]) -> None:
        with QMP(self.dir / "qmp.sock") as q:
            for i, b in enumerate(batches):
                if i:
                    time.sleep(_PACE)
                q.execute("input-send-event", events=b)

    def _at(self, req: DesktopInput, what: str) -> Events:
        if req.x is None or req.y is None:
            raise InvalidRequest(f"{what}: needs x and y")
        return keys.abs_events(req.x, req.y, self.width, self.height)

    def _batches(self, req: DesktopInput) -> list[Events]:
        a = req.action
        if a == "move":
            return [self._at(req, a)]
        if a == "click":
            out = [self._at(req, a)]
            for _ in range(req.count):
                out += [keys.button_events(req.button, True), keys.button_events(req.button, False)]
            return out
        if a == "drag":
            if req.to_x is None or req.to_y is None:
                raise InvalidRequest("drag: needs to_x and to_y")
            assert req.x is not None and req.y is not None
            start = self._at(req, a)
            keys.abs_events(req.to_x, req.to_y, self.width, self.height)  # checks the end
            # Intermediate moves, as a hand makes: a window manager starts a move on the
            # first motion past its threshold and follows the later ones.
            dist = max(abs(req.to_x - req.x), abs(req.to_y - req.y))
            steps = max(2, min(_DRAG_STEPS, dist // 10))
            path = [
                keys.abs_events(
                    req.x + (req.to_x - req.x) * i // steps,
                    req.y + (req.to_y - req.y) * i // steps,
                    self.width,
                    self.height,
                )
                for i in range(1, steps + 1)
            ]
            return [
                start,
                keys.button_events(req.button, True),
                *path,
                keys.button_events(req.button, False),
            ]
        if a == "scroll":
            out = [self._at(req, a)] if req.x is not None or req.y is not None else []
            wheel = keys.wheel_events(req.dy, req.dx)
            if not wheel:
                raise InvalidRequest("scroll: needs dy or dx (wheel clicks, > 0 down/right)")
            return out + wheel
        if a == "type":
            if not req.text:
                raise InvalidRequest("type: needs text")
            return [b for c in keys.text_combos(req.text) for b in _press(c)]
        if not req.keys:
            raise InvalidRequest("key: needs keys, e.g. 'ctrl+l'")
        return _press(keys.combo(req.keys))


def _press(combo: list[dict[str, object]]) -> list[Events]:
    """Key reports: each key down in order, then up in reverse (one report each)."""
    down: list[Events] = [[{"type": "key", "data": {"down": True, "key": k}}] for k in combo]
    up: list[Events] = [
        [{"type": "key", "data": {"down": False, "key": k}}] for k in reversed(combo)
    ]
    return down + up
