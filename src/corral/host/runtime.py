"""The OCI runtime (runc or crun), driven through its command line.

Each call is one short-lived runtime process (runc ~30-50 ms, crun ~15 ms); corral keeps
the runtime's state under its own ``--root`` so it never sees or touches containers of
other software on the host. Processes are started through the small corral-spawn helper
(:mod:`corral.host.spawn`: vfork-style, no fork of the agent) from a sealed memfd copy
of the runtime binary (no self-copy and re-exec by the runtime).

Example::

    rt = OCIRuntime.detect(Cgroups().mode)
    await rt.run_detached("sb-1", bundle, pass_fd=sock.fileno())   # fd 3 in PID 1
    await rt.state("sb-1")          # {"status": "running", "pid": 1234, ...}
    await rt.kill("sb-1"); await rt.delete("sb-1")
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from corral.errors import HostError
from corral.host import _sys, mounts, spawn
from corral.host.userns import SandboxUserns

__all__ = ["OCIRuntime", "pick"]

log = logging.getLogger("corral.runtime")

_GONE = (
    "does not exist",
    "not found",
    "no such file",
    "container not running",
    "not running",
    "process already finished",
)


def pick(cgroup_mode: str, prefer: str | None = None) -> tuple[Literal["runc", "crun"], str, bool]:
    """(name, binary, legacy_view) of the runtime :meth:`OCIRuntime.detect` would use;
    looks at PATH only, changes nothing (``corral doctor`` asks it too).

    crun first (3x faster to start a container than runc: C vs Go start-up); on hybrid
    cgroups it runs in the legacy view (see :attr:`OCIRuntime.legacy_view`). ``prefer``
    forces one; HostError if it (or any) is not installed.
    """
    order: list[Literal["runc", "crun"]]
    if prefer is not None:
        if prefer not in ("runc", "crun"):
            raise HostError(f"unknown OCI runtime {prefer!r} (runc or crun)")
        order = [prefer]  # type: ignore[list-item]
    else:
        order = ["crun", "runc"]
    for name in order:
        binary = shutil.which(name)
        if binary:
            return name, binary, name == "crun" and cgroup_mode == "hybrid"
    raise HostError(
        f"no usable OCI runtime: looked for {', '.join(order)} on PATH "
        f"(cgroup mode {cgroup_mode}); install the Debian package crun or runc"
    )


@dataclass
class OCIRuntime:
    """One OCI runtime binary with corral's state directory."""

    name: Literal["runc", "crun"]
    binary: str
    root: Path
    legacy_view: bool = False
    """Run the runtime in a private mount namespace without the hybrid cgroup2 mount.

    crun refuses hybrid hosts ("cgroups in hybrid mode not supported") whenever the
    cgroup2 mount at /sys/fs/cgroup/unified has controllers. In a private copy of the
    mount table with that mount detached, crun sees a plain cgroup v1 host, which it
    supports fully; the host's own mounts and cgroups are untouched. An empty throwaway
    tmpfs takes the detached mount's place: crun still makes a directory per container
    below that path, which would otherwise pile up in the host's /sys/fs/cgroup tmpfs.
    """
    helper: Path | None = None
    """corral-spawn (:mod:`corral.host.spawn`): starts every runtime process, doing the
    legacy view and the control fd move in C, so the agent never has to fork itself."""
    root_tmpfs: bool = False
    """Mount a tmpfs at ``root`` when it is not on one (:meth:`_prepare_root`)."""
    exe_fd: int | None = None
    """A sealed memfd copy of ``binary`` that the helper executes (:func:`spawn.sealed_copy`:
    spares the runtime its per-call self-copy and re-exec). Closed by :meth:`close`."""

    def __post_init__(self) -> None:
        self._root_ready = False
        if self.exe_fd is not None:
            # Objects dropped without close() (tests, a failed Node.open) free the memfd too.
            self._finalizer = weakref.finalize(self, os.close, self.exe_fd)

    def close(self) -> None:
        """Release the memfd copy of the runtime binary (later calls run it from disk)."""
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        self.exe_fd = None

    @classmethod
    def detect(
        cls,
        cgroup_mode: str,
        root_base: Path = Path("/run/corral"),
        prefer: str | None = None,
        helper_dir: Path | None = None,
        root_tmpfs: bool = False,
    ) -> OCIRuntime:
        """crun on pure cgroup v2 (faster), runc otherwise: crun 1.8 refuses hybrid mode.

        ``prefer`` forces one ("runc"/"crun"); HostError if it (or any) is not installed.
        ``helper_dir`` is where the corral-spawn helper is built (default ``root_base/bin``).
        ``root_tmpfs``: keep ``--root`` on a tmpfs (see :meth:`_prepare_root`); whoever
        asks for it calls :meth:`teardown` when done.
        """
        name, binary, legacy = pick(cgroup_mode, prefer)
        helper = spawn.ensure_built(helper_dir or Path(root_base) / "bin")
        try:
            exe: int | None = spawn.sealed_copy(binary)
        except OSError:
            exe = None  # no memfd sealing here: the runtime copies itself, slower
        rt = cls(
            name=name,
            binary=binary,
            root=Path(root_base) / name,
            legacy_view=legacy,
            helper=helper,
            exe_fd=exe,
            root_tmpfs=root_tmpfs,
        )
        rt._prepare_root()
        return rt

    # -- runtime state dir ------------------------------------------------------------

    def _prepare_root(self) -> None:
        """Keep ``--root`` on a tmpfs, where /run is on most hosts.

        The runtime writes 3-4 files per container there. Where ``root`` is on a disk
        filesystem instead (this VM's /run is ext4 without a journal, whose inode allocator
        rescans recently deleted inodes: ~0.3-0.6 ms per new file under create/destroy
        churn), corral mounts a small tmpfs of its own on the still empty directory;
        :meth:`teardown` removes it with the last container.
        """
        if self._root_ready:
            return
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if (
            self.root_tmpfs
            and _sys.fs_type(self.root) != _TMPFS_MAGIC
            and not any(self.root.iterdir())
        ):
            try:
                mounts.mount_tmpfs(self.root, size=_ROOT_TMPFS_SIZE, mode=0o700)
            except HostError as e:  # only slower without it
                log.warning("runtime state stays on disk: %s", e.message)
        self._root_ready = True

    def teardown(self) -> None:
        """Unmount corral's tmpfs at ``--root`` (if it made one) once no container is left."""
        self._root_ready = False
        with contextlib.suppress(OSError):
            if (
                mounts.is_mountpoint(self.root)
                and _sys.fs_type(self.root) == _TMPFS_MAGIC
                and not any(self.root.iterdir())
            ):
                mounts.umount(self.root)

    # -- plumbing ---------------------------------------------------------------------

    def _argv(self, *args: str) -> list[str]:
        return [self.binary, "--root", str(self.root), *args]

    async def _call(self, *args: str) -> tuple[int, str, str]:
        argv = self._argv(*args)
        keep: tuple[int, ...] = ()
        if self.helper is not None:
            # No preexec_fn, so subprocess can vfork instead of forking the agent.
            argv = spawn.helper_argv(
                self.helper, argv, legacy_view=self.legacy_view, exe_fd=self.exe_fd
            )
            keep = () if self.exe_fd is None else (self.exe_fd,)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=keep,
            preexec_fn=_hide_unified if self.legacy_view and self.helper is None else None,
        )
        out, err = await proc.communicate()
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    def _error(self, what: str, container_id: str, rc: int, err: str) -> HostError:
        text = err.strip() or f"exit status {rc}"
        return HostError(f"{self.name} {what} {container_id}: {text}")

    @staticmethod
    def _is_gone(err: str) -> bool:
        low = err.lower()
        return any(s in low for s in _GONE)

    # -- lifecycle --------------------------------------------------------------------

    async def run_detached(
        self,
        container_id: str,
        bundle: Path,
        pass_fd: int | None = None,
        userns: SandboxUserns | None = None,
        rlimits: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """Create and start the container; returns once its process runs.

        ``userns``: the helper first creates the container's user namespace as its owner
        uid at ``userns.path``, which the bundle's config names for the runtime to join
        (the file is unmounted again before this returns). ``rlimits``: (resource, soft,
        hard) the runtime's process starts with, for a config that names none.
        ``pass_fd`` arrives as fd 3 in the container's PID 1 (``--preserve-fds 1``). The
        runtime's stdio (which a detached container inherits) is /dev/null, so PID 1
        holds no host path or pipe; errors are read from a per-call ``--log`` file.
        """
        self._prepare_root()
        # In the bundle (corral's own dir for this container), not inside --root: runtimes
        # take every entry there for a container.
        try:
            fd, log = tempfile.mkstemp(prefix=".runtime.", suffix=".log", dir=bundle)
        except OSError as e:
            raise HostError(f"{self.name} run {container_id}: bundle {bundle}: {e}") from None
        os.close(fd)
        # --no-new-keyring: a session keyring per container would count against the kernel's
        # 200-key quota of the one host uid all sandboxes map to (creates failed past ~195);
        # the guest cannot use keyrings anyway (keyctl/add_key/request_key are denied by seccomp).
        args = [
            f"--log={log}",
            "--log-format=json",
            "run",
            "--detach",
            "--no-new-keyring",
            "--bundle",
            str(bundle),
        ]
        if pass_fd is not None:
            args += ["--preserve-fds", "1"]
        args.append(container_id)

        if userns is not None and self.helper is None:
            Path(log).unlink(missing_ok=True)
            raise HostError(
                f"{self.name} run {container_id}: a sandbox user namespace needs corral-spawn"
            )
        if self.helper is not None:
            try:
                if userns is not None:
                    userns.prepare()
                # Safe: runs the container corral configured in ``bundle`` (userns, seccomp,
                # masked paths); only the one fd we chose crosses into it (the helper
                # closes every other fd above 2).
                rc = await _outlive_cancel(
                    asyncio.ensure_future(
                        spawn.spawn_helper(
                            self.helper,
                            self._argv(*args),
                            legacy_view=self.legacy_view,
                            ctl_fd=pass_fd,
                            exe_fd=self.exe_fd,
                            log=Path(log),
                            userns=None if userns is None else userns.helper_arg(),
                            rlimits=rlimits,
                        )
                    )
                )
                if rc != 0:
                    raise self._error("run", container_id, rc, _log_errors(Path(log)))
            finally:
                Path(log).unlink(missing_ok=True)
                if userns is not None:
                    userns.drop()
            return

        keep: tuple[int, ...] = ()
        if pass_fd is not None:
            _ensure_fd3_open()
            keep = (pass_fd, 3)  # subprocess closes every other fd in the child

        move_fd = pass_fd is not None and pass_fd != 3
        legacy = self.legacy_view

        def child_setup() -> None:  # in the child between fork and exec
            if move_fd:
                os.dup2(pass_fd, 3, inheritable=True)  # type: ignore[arg-type]
            if legacy:
                _hide_unified()

        try:
            # Safe: runs the container corral configured in ``bundle`` (userns, seccomp,
            # masked paths); only the one fd we chose crosses into it.
            proc = await asyncio.create_subprocess_exec(
                *self._argv(*args),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                pass_fds=keep,
                preexec_fn=child_setup if move_fd or legacy else None,
            )
            rc = await _outlive_cancel(asyncio.ensure_future(proc.wait()))
            if rc != 0:
                raise self._error("run", container_id, rc, _log_errors(Path(log)))
        finally:
            Path(log).unlink(missing_ok=True)

    async def kill(self, container_id: str, signal: str = "KILL", all: bool = True) -> None:
        """Signal the container's processes; a stopped or missing container is fine."""
        args = ["kill"] + (["--all"] if all else []) + [container_id, signal]
        rc, _, err = await self._call(*args)
        if rc != 0 and not self._is_gone(err):
            raise self._error("kill", container_id, rc, err)

    async def delete(self, container_id: str, force: bool = True) -> None:
        """Delete the container (``force``: kill it first); missing is not an error.

        runc's own ``delete --force`` polls for the exit in 100 ms steps; SIGKILL, then a
        plain delete as soon as the container has stopped, takes about half as long.
        """
        if force:
            await self.kill(container_id, "KILL", all=True)
            for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.05):
                await asyncio.sleep(delay)
                rc, _, err = await self._call("delete", container_id)
                if rc == 0 or self._is_gone(err):
                    return
                if "stopped" not in err:
                    raise self._error("delete", container_id, rc, err)
                if "paused" in err:
                    # A v1-frozen task does not die of SIGKILL until thawed.
                    await self._call("resume", container_id)
            # still not stopped: let the runtime insist (it polls for up to 10 s)
        rc, _, err = await self._call("delete", *(["--force"] if force else []), container_id)
        if rc != 0 and not self._is_gone(err):
            raise self._error("delete", container_id, rc, err)

    def forget_stopped(self, container_id: str) -> None:
        """Drop the runtime's record of a container whose processes are all gone.

        This is what ``delete`` does for a stopped container once its cgroup is removed,
        without starting a runtime process (~15 ms each): corral owns this --root, so no
        other software's state is touched. Callers must have verified that no process of
        the container is left and must remove its cgroups themselves.
        """
        d = self.root / container_id
        if d.parent != self.root or not container_id or "/" in container_id:
            raise HostError(f"refusing to forget container {container_id!r}")
        shutil.rmtree(d, ignore_errors=True)

    async def state(self, container_id: str) -> dict[str, Any] | None:
        """The runtime's ``state`` JSON (status, pid, bundle...), or None if unknown."""
        rc, out, err = await self._call("state", container_id)
        if rc != 0:
            if self._is_gone(err):
                return None
            raise self._error("state", container_id, rc, err)
        return json.loads(out)  # type: ignore[no-any-return]

    async def list(self) -> list[dict[str, Any]]:
        """Every container under corral's runtime root."""
        rc, out, err = await self._call("list", "--format", "json")
        if rc != 0:
            raise self._error("list", "", rc, err)
        data = json.loads(out or "null")
        return list(data or [])

    async def pause(self, container_id: str) -> None:
        """Freeze the container's cgroup."""
        rc, _, err = await self._call("pause", container_id)
        if rc != 0:
            raise self._error("pause", container_id, rc, err)

    async def resume(self, container_id: str) -> None:
        """Thaw the container's cgroup."""
        rc, _, err = await self._call("resume", container_id)
        if rc != 0:
            raise self._error("resume", container_id, rc, err)


async def _outlive_cancel(job: asyncio.Future[int]) -> int:
    """The runtime's exit status. If our caller is cancelled, the runtime still gets to
    finish (milliseconds) before the cancellation goes on, so the caller's undo (runtime
    delete) finds the container it made. Abandoned, the runtime finished later: measured,
    about 1 in 20 creates cancelled mid-run left a running, untracked container (and the
    runtime re-created its deleted log file)."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job], timeout=30)
        raise


def _hide_unified() -> None:
    """In a forked child only: private mount namespace without /sys/fs/cgroup/unified."""
    # Safe: affects only this child's new mount namespace (a private copy), never the host.
    _sys.unshare(_CLONE_NEWNS)
    _sys.mount(None, "/", None, _sys.MS_REC | _sys.MS_PRIVATE)
    _sys.umount2("/sys/fs/cgroup/unified", _sys.MNT_DETACH)


_CLONE_NEWNS = 0x00020000
_TMPFS_MAGIC = 0x01021994
_ROOT_TMPFS_SIZE = 1 << 30
"""A cap, not an allocation: ~20 KiB of runtime state per container."""


def _ensure_fd3_open() -> None:
    """Make sure fd 3 is open in this process, so subprocess can keep it in the child.

    The child gets fd 3 by dup2 in preexec_fn; subprocess only spares fds listed in
    pass_fds from its close-all, and fails on a listed fd that is not open. In a running
    agent fd 3 is practically always in use; if it is free, /dev/null takes it for good.
    """
    try:
        os.fstat(3)
    except OSError:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        if fd != 3:  # someone else took 3 meanwhile: it is open, which is all we need
            os.close(fd)


def _log_errors(log: Path) -> str:
    """The error/fatal messages of a runtime's JSON log (or its raw text)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    msgs = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            msgs.append(line)
            continue
        if entry.get("level") in ("error", "fatal", "warning"):
            msgs.append(str(entry.get("msg", "")))
    return "; ".join(m for m in msgs if m) or text.strip()[-2000:]
