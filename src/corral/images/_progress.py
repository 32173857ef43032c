"""Optional rich progress lines for builders: one ``Step`` per phase, silent without a
Progress, so library callers and tests see nothing while the CLI shows bars."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

__all__ = ["Step"]


class Step:
    """One task line on ``progress`` (or a no-op when it is None).

    Example::

        with Step(progress, "mkfs.erofs") as step:
            step.note("writing")
    """

    def __init__(self, progress: Progress | None, description: str, total: float | None = None):
        self._progress = progress
        self._description = description
        self._total = total
        self._task: TaskID | None = None

    def __enter__(self) -> Step:
        if self._progress is not None:
            self._task = self._progress.add_task(self._description, total=self._total)
        return self

    def advance(self, amount: float) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, amount)

    def note(self, text: str) -> None:
        """Show ``text`` (e.g. the last output line of a tool) after the description."""
        if self._progress is not None and self._task is not None:
            text = text.strip().replace("[", r"\[")[:60]
            self._progress.update(self._task, description=f"{self._description}: {text}")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None and self._task is not None:
            if exc is None:
                total = self._total if self._total is not None else 1.0
                self._progress.update(
                    self._task, description=self._description, total=total, completed=total
                )
            else:
                self._progress.update(self._task, description=f"{self._description}: failed")
            self._progress.stop_task(self._task)
