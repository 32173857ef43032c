"""``sandbox.desktop``: the screen and input of a ``vm`` sandbox with a display."""

from __future__ import annotations

from pydantic import ValidationError

from corral.errors import InvalidRequest
from corral.ops import NodeOps
from corral.spec import DesktopInput, validation_message

__all__ = ["Display"]


class Display:
    """Screenshots and pointer/keyboard input of one desktop VM (computer use).

    Coordinates are pixels of the screenshot, (0, 0) top left. Every action returns once
    its events reached the VM's input devices; what the guest does with them (a window
    redrawing) shows in a later screenshot.

    Example:
        >>> png = await vm.desktop.screenshot()                         # doctest: +SKIP
        >>> await vm.desktop.click(200, 120)                            # doctest: +SKIP
        >>> await vm.desktop.type("echo hi\\n"); await vm.desktop.key("ctrl+l")  # doctest: +SKIP
    """

    __slots__ = ("_ops", "_sandbox_id")

    def __init__(self, ops: NodeOps, sandbox_id: str) -> None:
        self._ops, self._sandbox_id = ops, sandbox_id

    def __repr__(self) -> str:
        return f"Display(sandbox={self._sandbox_id!r})"

    async def _act(self, **fields: object) -> None:
        try:
            req = DesktopInput.model_validate(fields)
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
        await self._ops.desktop_input(self._sandbox_id, req)

    async def screenshot(self) -> bytes:
        """The screen as PNG bytes (the desktop's width x height)."""
        return await self._ops.desktop_screenshot(self._sandbox_id)

    async def move(self, x: int, y: int) -> None:
        """Move the pointer to (x, y)."""
        await self._act(action="move", x=x, y=y)

    async def click(self, x: int, y: int, button: str = "left", count: int = 1) -> None:
        """Move to (x, y) and click ``button`` (left, right, middle) ``count`` times."""
        await self._act(action="click", x=x, y=y, button=button, count=count)

    async def drag(self, x: int, y: int, to_x: int, to_y: int, button: str = "left") -> None:
        """Press ``button`` at (x, y), move to (to_x, to_y), release."""
        await self._act(action="drag", x=x, y=y, to_x=to_x, to_y=to_y, button=button)

    async def scroll(
        self, dy: int = 0, dx: int = 0, x: int | None = None, y: int | None = None
    ) -> None:
        """Wheel clicks: ``dy`` > 0 down, < 0 up; ``dx`` > 0 right; at (x, y) if given."""
        await self._act(action="scroll", dy=dy, dx=dx, x=x, y=y)

    async def type(self, text: str) -> None:
        """Type ``text`` as key presses (US layout; printable ASCII, newline, tab)."""
        await self._act(action="type", text=text)

    async def key(self, keys: str) -> None:
        """Press one key combo, e.g. ``ctrl+l``, ``alt+f4``, ``enter``."""
        await self._act(action="key", keys=keys)
