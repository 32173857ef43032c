"""User namespaces: one held by an fd for idmapped mounts, and each sandbox's own.

:class:`UserNamespace` is the node's namespace for idmapped layer mounts.
:class:`SandboxUserns` describes a sandbox's namespace, which the runtime spawn helper
creates as the sandbox's owner uid (see :mod:`corral.host.owners` for why) and
bind-mounts onto a file for the runtime to join.

An idmapped mount needs a user namespace whose mapping says how to translate ids;
nothing has to run in it. We fork a child that unshares a new user namespace, write its
uid/gid maps from the parent (as host root, so no ``setgroups`` dance), open
``/proc/<pid>/ns/user`` and let the child exit: the fd keeps the namespace alive.

Example::

    ns = UserNamespace.create(host_uid=100000, size=65536)
    mount_idmapped(raw, idmapped, ns.fd)
    ns.close()   # mounts made with it keep their own reference
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from corral.errors import HostError
from corral.host import _sys
from corral.host._sys import errtext

__all__ = ["SandboxUserns", "UserNamespace"]


@dataclass(frozen=True)
class SandboxUserns:
    """A sandbox's user namespace: owned by host uid/gid ``owner``, mapping ids
    0..size-1 to host_uid.., held while the runtime joins it at ``path`` (a bind mount),
    or, with ``path`` None, as fd 4 of the runtime's process (no mount to make and undo;
    for a runtime that opens the namespace itself, as crun does: runc opens it in a
    child with other fds)."""

    owner: int
    host_uid: int
    size: int
    path: Path | None = None

    FD_PATH = Path("/proc/self/fd/4")

    @property
    def join_path(self) -> Path:
        """What the runtime's config names as the namespace to join."""
        return self.FD_PATH if self.path is None else self.path

    def helper_arg(self) -> str:
        """The ``-U`` argument of corral-spawn (:mod:`corral.host.spawn`)."""
        return f"{self.owner}:{self.host_uid}:{self.size}:{self.path or '@'}"

    def prepare(self) -> None:
        """Create the empty file the helper bind-mounts the namespace onto."""
        if self.path is None:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise HostError(f"user namespace file {self.path}: {e.strerror}") from None
        os.close(fd)

    def drop(self) -> None:
        """Unmount and remove the file; the namespace lives on in the sandbox's processes."""
        if self.path is not None:
            drop_file(self.path)


def drop_file(path: Path) -> None:
    """Remove a sandbox's namespace file, unmounting it first if it is still mounted."""
    with contextlib.suppress(OSError):  # EINVAL: not (or no longer) mounted
        # Safe: only ever a namespace file in one of corral's sandbox dirs.
        _sys.umount2(path, _sys.MNT_DETACH | _sys.UMOUNT_NOFOLLOW)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@dataclass
class UserNamespace:
    """A user namespace mapping ids 0..size-1 inside to host_uid..host_uid+size-1."""

    fd: int
    host_uid: int
    size: int

    @classmethod
    def create(
        cls, host_uid: int = 100000, size: int = 65536, *, inverse: bool = False
    ) -> UserNamespace:
        """Create the namespace (~1 ms: one fork, two map writes).

        ``inverse``: map the other way, ids host_uid.. inside to 0.. outside. An idmapped
        mount made with it shows a sandbox's files (owned by host_uid..) as image-relative
        ids (0..), which is how a snapshot of a writable layer becomes a layer.
        """
        if host_uid <= 0 or size <= 0 or host_uid + size > 2**32 - 1:
            raise HostError(f"user namespace: bad mapping host_uid={host_uid} size={size}")
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: only raw syscalls and fd I/O, then _exit, no Python cleanup
            code = 0
            try:
                os.close(ready_r)
                os.close(go_w)
                try:
                    # Safe: a new, empty user namespace for a process that runs nothing.
                    _sys.unshare(_sys.CLONE_NEWUSER)
                    os.write(ready_w, b"1")
                except OSError as e:
                    os.write(ready_w, b"E" + str(e.errno).encode())
                    code = 1
                os.read(go_r, 1)  # returns b"" when the parent closes its end
            finally:
                os._exit(code)
        os.close(ready_w)
        os.close(go_r)
        try:
            msg = os.read(ready_r, 16)
            if msg != b"1":
                err = int(msg[1:] or b"0") if msg.startswith(b"E") else 0
                raise HostError(f"user namespace: unshare(CLONE_NEWUSER) failed: {errtext(err)}")
            mapping = f"{host_uid} 0 {size}\n" if inverse else f"0 {host_uid} {size}\n"
            try:
                # Safe: maps the child's namespace onto corral's reserved sandbox range;
                # writing as host root (CAP_SETUID in the parent ns) is what the kernel
                # requires for a range, and we are that process's parent.
                for name in ("uid_map", "gid_map"):
                    with open(f"/proc/{pid}/{name}", "w") as f:
                        f.write(mapping)
                fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise HostError(
                    f"user namespace: writing maps for pid {pid} ({mapping.strip()}): "
                    f"{errtext(e.errno or 0)}"
                ) from None
        finally:
            os.close(ready_r)
            os.close(go_w)  # the child's read returns and it exits
            os.waitpid(pid, 0)
        return cls(fd=fd, host_uid=host_uid, size=size)

    def close(self) -> None:
        """Close the fd; mounts idmapped with this namespace stay valid."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
