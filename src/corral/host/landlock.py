"""Whether this kernel's landlock can scope guest commands (corral-init applies it).

corral-init (src/corral/init/corral-init.c) runs every guest command in one landlock
domain scoped against signals and abstract unix sockets (landlock ABI 6, Linux 6.12+);
PID 1 stays outside it. Where the kernel has no landlock, or an older ABI, the init runs
commands without it and the node says so in its status (``landlock_detail``).

Example::

    abi, detail = support()     # (7, "scoped: signals, abstract unix sockets")
"""

from __future__ import annotations

import ctypes

from corral.host._sys import errtext, libc

__all__ = ["SCOPED_ABI", "abi", "support"]

SCOPED_ABI = 6
"""First landlock ABI with LANDLOCK_SCOPE_SIGNAL and LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET."""

_NR_CREATE_RULESET = 444  # the same on x86_64 and the generic (arm64) table
_CREATE_RULESET_VERSION = 1


def abi() -> int:
    """The kernel's landlock ABI version; negative: -errno (landlock absent or disabled)."""
    r = libc.syscall(
        ctypes.c_long(_NR_CREATE_RULESET),
        None,
        ctypes.c_size_t(0),
        ctypes.c_uint32(_CREATE_RULESET_VERSION),
    )
    return int(r) if r >= 0 else -ctypes.get_errno()


def support() -> tuple[int, str]:
    """(ABI, what it means for guest commands)."""
    v = abi()
    if v < 0:
        return 0, f"landlock unavailable ({errtext(-v)}): guest commands run without it"
    if v < SCOPED_ABI:
        return v, (
            f"landlock ABI {v} has no scoping (needs {SCOPED_ABI}, Linux 6.12): guest "
            "commands run without it"
        )
    return v, "guest commands scoped: no signals to or ptrace of PID 1, no foreign abstract sockets"
