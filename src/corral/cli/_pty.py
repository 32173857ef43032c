"""Attach the local terminal to a sandbox pty stream (``corral sandbox shell``).

The local terminal goes into raw mode, so every key (Ctrl-C, Ctrl-D, arrows) is sent to
the remote side and the remote pty does the line editing and echo; the window size
follows SIGWINCH. The terminal is restored however the session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal
import struct
import termios
import tty

from corral.ops import PtyStream
from corral.spec import ExecResult

__all__ = ["attach", "exit_status", "window_size"]

_READ = 64 * 1024


def window_size(fd: int) -> tuple[int, int]:
    """(rows, cols) of the terminal on ``fd``; (24, 80) when it is not a terminal."""
    try:
        packed = fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8)
        rows, cols = struct.unpack("HHHH", packed)[:2]
    except OSError:
        return 24, 80
    return (rows or 24), (cols or 80)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except BlockingIOError:
            # stdout may be non-blocking if another program left it so: wait for room.
            import select

            select.select([], [fd], [])
            continue
        view = view[n:]


async def attach(stream: PtyStream, *, stdin_fd: int = 0, stdout_fd: int = 1) -> ExecResult | None:
    """Run the session: ``stream`` is what ``await ops.pty(...)`` returns (not yet entered).

    Returns ``stream.result`` (how the remote command ended; None if it never said).
    """
    loop = asyncio.get_running_loop()
    saved = termios.tcgetattr(stdin_fd) if os.isatty(stdin_fd) else None
    inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
    reading = False

    def on_readable() -> None:
        nonlocal reading
        try:
            data = os.read(stdin_fd, _READ)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno != errno.EIO:  # EIO: the terminal went away, same as end of input
                raise
            data = b""
        if not data:
            loop.remove_reader(stdin_fd)
            reading = False
        inbox.put_nowait(data or None)

    async with stream as s:
        resizes: set[asyncio.Task[None]] = set()

        async def pump() -> None:
            # One writer, so keystrokes arrive in order.
            while (data := await inbox.get()) is not None:
                await s.write(data)
            await s.close_stdin()

        def on_winch() -> None:
            t = loop.create_task(s.resize(*window_size(stdin_fd)))
            resizes.add(t)
            t.add_done_callback(resizes.discard)

        pump_task: asyncio.Task[None] | None = None
        try:
            if saved is not None:
                tty.setraw(stdin_fd, termios.TCSANOW)
            loop.add_reader(stdin_fd, on_readable)
            reading = True
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread
                loop.add_signal_handler(signal.SIGWINCH, on_winch)
            pump_task = loop.create_task(pump())
            async for data in s:
                _write_all(stdout_fd, data)
        finally:
            if reading:
                loop.remove_reader(stdin_fd)
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(signal.SIGWINCH)
            for t in [*([pump_task] if pump_task else []), *resizes]:
                t.cancel()
                # The remote end may be gone already: a late keystroke's error is moot.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            if saved is not None:
                termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
    return s.result


def exit_status(result: ExecResult | None) -> int:
    """Shell-style status of a finished pty command (128+N when killed by signal N)."""
    if result is None:
        return 1
    if result.signal:
        return 128 + result.signal
    return result.exit_code if result.exit_code is not None else 1
