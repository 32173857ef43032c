"""Persistent shell sessions: one real shell process per session, inside the sandbox.

The shell is a corral-init *session* (a background process with a stdin pipe, see
docs/init-protocol.md): it lives in the sandbox, not in the node, so it outlives a node
restart, and the node drives it by attaching to it (``InitClient.attach``), writing
commands to its stdin and reading its stdout/stderr. Everything a shell keeps therefore
survives between commands: plain variables, options, traps, the job table, cwd,
functions, aliases.

One command is three things written to the shell's stdin at once::

    __cs_pre NONCE; eval 'the command' </dev/null
    __cs_post NONCE

``__cs_pre`` prints a start marker on stdout and stderr, ``__cs_post`` an end marker
with the exit status; the node takes what lies between them. Why it holds:

- The markers carry a fresh random nonce per command (``\\x1eS<nonce>\\x1e``,
  ``\\x1eE<nonce>:<status>\\x1e``) that lives only in the shell's input, never in a
  variable, so the command cannot print it, an old log cannot replay it, and output
  without a trailing newline is exact (the marker is found anywhere in the stream).
- The command's stdin is /dev/null (or a file holding the request's stdin): a ``cat``
  cannot eat the next command.
- The shell is interactive (``-i``; prompts emptied), so SIGINT to its process group
  (there is no job control: the command runs in the shell's group) stops the command and
  the shell only abandons the current line, as at a terminal; background jobs ignore it.
  The end marker is on its own line, so it still runs.
- ``set -e``: a failing command would make bash exit. The shell runs with errexit off
  and an ERR trap (errtrace on, so functions are covered) that, when the user asked for
  ``set -e``, records the status and interrupts the current line: the command stops at
  its first failure with that status and ``set -e`` stays on for the next command. The
  user's own ERR trap still runs (it is kept aside and called first). ``exit N`` (in the
  shell itself, not in a subshell) likewise ends the command with N and keeps the
  session.

Where the image has no bash, ``sh -i`` runs the same protocol without the ``set -e`` and
``exit`` handling (in sh, both end the session).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from corral.backends.initclient import ExecStream, InitExit
from corral.errors import CorralError, SandboxError

__all__ = ["STATE_DIR", "MARK", "ShellSession", "shell_argv", "prologue", "command_text"]

STATE_DIR = "/.corral/shells"
"""Where a command's stdin file lives while it runs (``<shell id>.stdin``)."""

MARK = "corral-shell"
"""argv[1] of every session shell, then its shell id: how a restarted node finds it."""

GRACE = 2.0
"""Seconds a command gets to end after SIGINT (then after SIGKILL of the shell's
children) before the next step."""

_BASH = r"""
PS1= PS2= PS0= PS4='+ '; unset PROMPT_COMMAND HISTFILE MAILCHECK; set +o history +H; set --
shopt -s expand_aliases
__cs_x= __cs_e= __cs_uerr=
__cs_err() {
  __cs_s=$?
  if [[ $BASHPID != "$$" ]]; then
    if [[ -n $__cs_uerr ]]; then eval "$__cs_uerr"; fi
    return $__cs_s
  fi
  __cs_ab=
  if [[ $- == *e* ]]; then builtin set +e; __cs_e=1; __cs_ab=1; fi
  if [[ -n $__cs_uerr ]]; then eval "$__cs_uerr"; fi
  if [[ -n $__cs_ab ]]; then __cs_x=$__cs_s; builtin kill -INT $$; fi
  return $__cs_s
}
exit() {
  if [[ $BASHPID == "$$" ]]; then __cs_x=${1-$?}; builtin kill -INT $$; else builtin exit "$@"; fi
}
__cs_pre() {
  { __cs_xt=$-; builtin set +x; } 2>/dev/null
  __cs_x= __cs_e=
  builtin printf '\036S%s\036' "$1"; builtin printf '\036S%s\036' "$1" >&2
  if [[ $__cs_xt == *x* ]]; then builtin set -x; fi
}
__cs_post() {
  { __cs_s=$?; __cs_xt=$-; builtin set +x; } 2>/dev/null
  if [[ $- == *e* ]]; then builtin set +e; __cs_e=1; fi
  __cs_a=; if [[ -n $__cs_x ]]; then __cs_s=$__cs_x __cs_a=a; fi
  __cs_t=$(builtin trap -p ERR)
  if [[ $__cs_t != "trap -- '__cs_err' ERR" ]]; then
    __cs_uerr=
    if [[ -n $__cs_t ]]; then __cs_t=${__cs_t#trap -- }; eval "__cs_uerr=${__cs_t% ERR}"; fi
    builtin trap __cs_err ERR
  fi
  builtin set -E; PS1= PS2= PS0=
  builtin printf '\036E%s:%s%s\036' "$1" "$__cs_s" "$__cs_a"
  builtin printf '\036E%s:%s%s\036' "$1" "$__cs_s" "$__cs_a" >&2
  if [[ -n $__cs_e ]]; then builtin set -e; fi
  __cs_e=
  if [[ $__cs_xt == *x* ]]; then builtin set -x; fi
}
builtin trap __cs_err ERR; builtin set -E
"""
"""Defines the helpers, then errexit/ERR handling; read once by the shell at start.
``__cs_uerr`` holds the user's ERR trap (``trap -p`` is re-read after each command)."""

_SH = r"""
PS1= PS2=; set --
__cs_pre() { printf '\036S%s\036' "$1"; printf '\036S%s\036' "$1" >&2; }
__cs_post() {
  __cs_s=$?; PS1= PS2=
  printf '\036E%s:%s\036' "$1" "$__cs_s"; printf '\036E%s:%s\036' "$1" "$__cs_s" >&2
}
"""


def shell_argv(shell_id: str, bash: bool) -> list[str]:
    """The session's shell: interactive (SIGINT ends a command, not the shell), reading
    its commands from stdin, with no profile or rc file."""
    if bash:
        return ["bash", "--noprofile", "--norc", "--noediting", "-i", "-s", MARK, shell_id]
    return ["sh", "-i", "-s", MARK, shell_id]


def prologue(bash: bool) -> bytes:
    """What the node writes first to a new session's stdin."""
    return (_BASH if bash else _SH).encode()


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def command_text(nonce: str, command: str, stdin_path: str | None) -> bytes:
    """The two lines that run ``command`` (see the module docstring)."""
    src = _quote(stdin_path) if stdin_path else "/dev/null"
    return f"__cs_pre {nonce}; eval {_quote(command)} <{src}\n__cs_post {nonce}\n".encode()


@dataclass
class _Stream:
    """One of the shell's output streams during a command."""

    start: bytes
    end: bytes
    limit: int
    phase: int = 0  # 0: before the start marker, 1: the command's output, 2: done
    status: int | None = None
    aborted: bool = False
    """The shell abandoned the command's line (``set -e`` failure, ``exit``)."""
    kept: bytearray | None = None
    total: int = 0

    def feed(self, buf: bytearray) -> bool:
        """Consume what ``buf`` holds; True once this stream's end marker was seen."""
        if self.phase == 0:
            i = buf.find(self.start)
            if i < 0:
                del buf[: max(0, len(buf) - len(self.start) + 1)]
                return False
            del buf[: i + len(self.start)]
            self.phase, self.kept = 1, bytearray()
        if self.phase == 1:
            i = buf.find(self.end)
            if i >= 0:
                j = buf.find(b"\x1e", i + len(self.end))
                if j < 0:
                    self._take(buf[:i])
                    del buf[:i]
                    return False
                self._take(buf[:i])
                tail = bytes(buf[i + len(self.end) : j])
                del buf[: j + 1]
                self.aborted = tail.endswith(b"a")
                digits = tail.rstrip(b"a")
                self.status = int(digits) if digits.isdigit() else None
                self.phase = 2
            else:
                keep = len(self.end) - 1
                if len(buf) > keep:
                    self._take(buf[: len(buf) - keep])
                    del buf[: len(buf) - keep]
        return self.phase == 2

    def flush(self, buf: bytearray) -> None:
        """No end marker will come: what is held back (in case it began one) is output."""
        if self.phase == 1:
            self._take(buf)
            buf.clear()

    def _take(self, data: bytes | bytearray) -> None:
        assert self.kept is not None
        self.total += len(data)
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += data[:room]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit


class ShellSession:
    """The node's side of one session shell: an attached stream and a pump that buffers
    what the shell writes. :meth:`run` runs one command at a time."""

    def __init__(
        self,
        proc_id: str,
        pid: int,
        attach: Callable[[], ExecStream],
        kill_children: Callable[[int], Awaitable[None]],
    ) -> None:
        self.proc_id = proc_id
        self.pid = pid
        self._attach = attach
        self._kill_children = kill_children
        self._stream: ExecStream | None = None
        self._pump: asyncio.Task[None] | None = None
        self._bufs = {"stdout": bytearray(), "stderr": bytearray()}
        self._data = asyncio.Event()
        self._lock = asyncio.Lock()
        self._running = False
        self._sigint = False
        self._started = asyncio.Event()
        self.ended: InitExit | None = None
        """How the shell itself ended (it exited, was killed): the session is over."""
        self.broken: str | None = None
        """Why the attachment failed (the sandbox stopped, another node attached)."""

    async def open(self) -> None:
        """Attach to the shell (again, after a node restart: what it wrote meanwhile
        comes first, and the next command skips it)."""
        stream = self._attach()
        await stream.__aenter__()
        self._stream = stream
        self._pump = asyncio.create_task(self._read(stream), name=f"shell {self.proc_id}")

    async def close(self) -> None:
        """Detach (the shell keeps running)."""
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump
        if self._stream is not None:
            await self._stream.__aexit__(None, None, None)
        self._stream = self._pump = None

    @property
    def over(self) -> bool:
        """The shell ended or the attachment broke: nothing more will come."""
        return self.ended is not None or self.broken is not None

    @property
    def alive(self) -> bool:
        return self.ended is None and self.broken is None and self._stream is not None

    async def _read(self, stream: ExecStream) -> None:
        try:
            async for name, data in stream:
                buf = self._bufs[name]
                buf += data
                if not self._running and len(buf) > 65536:
                    del buf[:-4096]  # between commands: only a background job's chatter
                self._data.set()
            self.ended = stream.result
        except CorralError as e:
            self.broken = str(e)
        finally:
            self._data.set()
            await stream.__aexit__(None, None, None)  # no fd left behind by a dead session

    async def write(self, data: bytes) -> None:
        if self._stream is None:
            raise SandboxError(f"shell session {self.proc_id} is not attached")
        await self._stream.write(data)

    async def interrupt(self) -> None:
        """SIGINT to the shell's process group: the running command stops, the shell
        abandons the line and reports the status (130 for a command killed by it).

        Not before the command has started (its start marker came): a SIGINT while the
        shell is still reading the command's line would make it drop half a line. A
        command that does not start within GRACE seconds gets the signal anyway."""
        if self._running and not self._started.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(GRACE):
                    await self._started.wait()
        await self._sigint_now()

    async def _sigint_now(self) -> None:
        if self._stream is not None and self.ended is None:
            self._sigint = True
            await self._stream.signal(2)

    async def run(
        self, command: str, timeout: float | None, limit: int, stdin_path: str | None
    ) -> tuple[InitExit, str | None]:
        """Run one command. Returns its result (built like an exec's) and, when the shell
        had to be given up (it ended, or ignored SIGINT and SIGKILL of its children past
        the timeout), why."""
        async with self._lock:
            self._running = True
            try:
                return await self._run(command, timeout, limit, stdin_path)
            finally:
                self._running = False

    async def _run(
        self, command: str, timeout: float | None, limit: int, stdin_path: str | None
    ) -> tuple[InitExit, str | None]:
        nonce = secrets.token_hex(16)
        streams = {
            name: _Stream(f"\x1eS{nonce}\x1e".encode(), f"\x1eE{nonce}:".encode(), limit)
            for name in ("stdout", "stderr")
        }
        t0 = time.monotonic()
        self._sigint = False
        self._started.clear()
        await self.write(command_text(nonce, command, stdin_path))
        reason, signal = "exited", None
        deadline = None if timeout is None else t0 + timeout
        steps = 0  # 1: SIGINT sent, 2: children SIGKILLed, 3: given up
        late = False
        while True:
            done = [s.feed(self._bufs[n]) for n, s in streams.items()]
            if streams["stdout"].phase > 0:
                self._started.set()
            if all(done):
                break
            if not self.alive:
                break
            if reason == "exited" and any(s.truncated for s in streams.values()):
                reason = "output_limit"
                steps, deadline = 1, time.monotonic() + GRACE
                await self._sigint_now()
            self._data.clear()
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                async with asyncio.timeout(wait):
                    await self._data.wait()
                continue
            except TimeoutError:
                pass
            if steps == 0 and not self._started.is_set() and not late:
                late = True  # not even started (the shell is still busy): a little more
                deadline = time.monotonic() + GRACE
                continue
            if reason == "exited":
                reason = "timeout"
            steps += 1
            if steps == 1:
                signal = 2
                await self._sigint_now()
            elif steps == 2:
                signal = 9
                await self._kill_children(self.pid)
            else:
                break
            deadline = time.monotonic() + GRACE
        out, err = streams["stdout"], streams["stderr"]
        for name, st in streams.items():
            st.flush(self._bufs[name])
        if reason == "exited" and (out.truncated or err.truncated):
            reason = "output_limit"  # it ended before we saw it was over: same answer
        given_up = None
        if self.ended is not None:
            given_up = "the shell itself ended"
            base = self.ended
            reason, status, signal = base.reason, base.code, base.signal
        elif self.broken is not None:
            raise SandboxError(f"shell session lost its connection to the shell: {self.broken}")
        elif not (out.phase == 2 and err.phase == 2):
            given_up = "the shell did not come back after SIGINT and SIGKILL of its children"
            status = None
        else:
            status = out.status
        if reason == "output_limit":
            signal = 2
        abandoned = err.aborted or (self._sigint and out.status == 130)
        if err.kept and abandoned and err.kept.endswith(b"\n"):
            # an interactive bash writes a newline to stderr when SIGINT (its own, for
            # set -e and exit, or ours) abandons a line: it is not the command's output
            del err.kept[-1:]
            err.total -= 1
        return (
            InitExit(
                reason=reason,
                code=status if reason == "exited" else None,
                signal=signal if reason != "exited" else None,
                stdout=bytes(out.kept or b""),
                stderr=bytes(err.kept or b""),
                out_trunc=out.truncated,
                err_trunc=err.truncated,
                duration=time.monotonic() - t0,
                pid=self.pid,
                out_len=out.total,
                err_len=err.total,
            ),
            given_up,
        )
