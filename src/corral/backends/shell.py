"""Persistent shell sessions without a long-lived shell process.

Each ``Shell.run`` is one exec of bash that first restores the session (exported
variables, functions, aliases, cwd) from a state file inside the sandbox and saves it
again on exit, however the command ends (``exit 3`` included). Why not one bash process
reading commands from a pipe: a command that reads stdin would swallow the next command,
output framing needs markers the guest can forge, and a killed command kills the session.
Here every run gets its own exit code, output caps and timeout, and a session survives an
agent restart. What does not survive between runs: background jobs' job table and
non-exported variables (export them).
"""

from __future__ import annotations

__all__ = ["STATE_DIR", "shell_argv"]

STATE_DIR = "/.corral/shells"

_SCRIPT = r"""
__cs_state=$1; __cs_cmd=$2
if [ -r "$__cs_state" ]; then . "$__cs_state" 2>/dev/null; fi
unset __cs_v
__cs_save() {
  __cs_rc=$?
  {
    printf 'for __cs_v in $(compgen -e); do unset "$__cs_v" 2>/dev/null; done\n'
    export -p
    declare -f
    alias -p
    printf 'cd -- %q 2>/dev/null\n' "$PWD"
  } > "$__cs_state.tmp" 2>/dev/null && mv -f -- "$__cs_state.tmp" "$__cs_state" 2>/dev/null
  exit $__cs_rc
}
trap __cs_save EXIT
eval "$__cs_cmd"
"""


def shell_argv(shell_id: str, command: str) -> list[str]:
    """The exec argv that runs ``command`` in session ``shell_id``."""
    return [
        "bash",
        "--noprofile",
        "--norc",
        "-c",
        _SCRIPT,
        "corral-shell",
        f"{STATE_DIR}/{shell_id}",
        command,
    ]


def init_argv(shell_id: str, cwd: str) -> list[str]:
    """Creates the session's state file with its starting directory."""
    return [
        "bash",
        "--noprofile",
        "--norc",
        "-c",
        'mkdir -p -- "$1" && printf "cd -- %q\\n" "$3" > "$1/$2"',
        "corral-shell",
        STATE_DIR,
        shell_id,
        cwd,
    ]
