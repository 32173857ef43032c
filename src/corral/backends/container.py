"""Container sandboxes: OCI runtime + overlay of shared EROFS layers + corral-init.

Create, in order (each step undone if a later one fails):
  1. acquire each image layer's node-wide mount (idmapped to the sandbox uid range),
  2. a btrfs subvolume with the disk quota holds the overlay upper and work dirs,
  3. overlay rootfs = layers (lowers) + upper,
  4. a listening control socket in the sandbox dir (host side only; the guest never sees it),
  5. config.json, then ``runc run --detach --preserve-fds 1`` with that socket as fd 3.
No process of ours stays per sandbox: runc exits, the init lives on in the container.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from corral.backends import oci
from corral.backends.files import SandboxFS
from corral.backends.initclient import InitClient
from corral.errors import HostError
from corral.host import mounts
from corral.host.btrfs import Scratch
from corral.host.cgroups import Cgroups
from corral.host.runtime import OCIRuntime
from corral.images.mounts import LayerMounts
from corral.spec import ImageInfo, SandboxSpec

__all__ = ["ContainerBackend"]


class ContainerBackend:
    kind = "container"

    def __init__(
        self,
        *,
        sandboxes_dir: Path,
        runtime: OCIRuntime,
        cgroups: Cgroups,
        layers: LayerMounts,
        scratch: Scratch,
        init_path: Path,
        host_uid: int,
        id_count: int,
    ) -> None:
        self.sandboxes_dir = sandboxes_dir
        self.runtime = runtime
        self.cgroups = cgroups
        self.layers = layers
        self.scratch = scratch
        self.init_path = init_path
        self.host_uid = host_uid
        self.id_count = id_count
        self._clients: dict[str, InitClient] = {}
        self._fs: dict[str, SandboxFS] = {}
        sandboxes_dir.mkdir(parents=True, exist_ok=True)

    # paths
    def dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def rootfs(self, sandbox_id: str) -> Path:
        return self.dir(sandbox_id) / "rootfs"

    def socket_path(self, sandbox_id: str) -> Path:
        return self.dir(sandbox_id) / "ctl.sock"

    def client(self, sandbox_id: str) -> InitClient:
        c = self._clients.get(sandbox_id)
        if c is None:
            c = self._clients[sandbox_id] = InitClient(self.socket_path(sandbox_id))
        return c

    def fs(self, sandbox_id: str) -> SandboxFS:
        f = self._fs.get(sandbox_id)
        if f is None:
            f = self._fs[sandbox_id] = SandboxFS(
                self.rootfs(sandbox_id), uid=self.host_uid, gid=self.host_uid
            )
        return f

    # lifecycle
    async def create(self, sandbox_id: str, spec: SandboxSpec, image: ImageInfo) -> int:
        undo: list[Callable[[], object]] = []
        try:
            return await self._create(sandbox_id, spec, image, undo)
        except BaseException:
            for step in reversed(undo):
                with contextlib.suppress(Exception):
                    r = step()
                    if hasattr(r, "__await__"):
                        await r  # type: ignore[misc]
            raise

    async def _create(
        self, sandbox_id: str, spec: SandboxSpec, image: ImageInfo, undo: list[Callable[[], object]]
    ) -> int:
        d = self.dir(sandbox_id)
        # 0711: runc in the user namespace must traverse it as the mapped uid; no listing.
        d.mkdir(mode=0o711)
        os.chmod(d, 0o711)
        undo.append(lambda: _remove_dir(d))

        lowers: list[Path] = []
        for digest in image.layers:
            lowers.append(self.layers.acquire(digest))
            undo.append(functools.partial(self.layers.release, digest))

        sub = self.scratch.create_subvol(sandbox_id, quota=spec.limits.disk)
        undo.append(lambda: self.scratch.delete_subvol(sandbox_id))
        upper, work = sub / "upper", sub / "work"
        upper.mkdir()
        work.mkdir()
        # The upper belongs to root inside the sandbox (host uid host_uid), so the guest can
        # write where a normal root could and its files land under the mapped owner.
        os.chown(upper, self.host_uid, self.host_uid)

        root = self.rootfs(sandbox_id)
        root.mkdir()
        mounts.mount_overlay(list(reversed(lowers)), upper, work, root)
        undo.append(lambda: mounts.umount(root, detach=True))

        sock_path = self.socket_path(sandbox_id)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lsock.bind(str(sock_path))
            os.chmod(sock_path, 0o600)
            lsock.listen(64)
            config = oci.build_config(
                rootfs=root,
                init_host_path=self.init_path,
                hostname=spec.hostname,
                cgroups_path=self.cgroups.oci_path(sandbox_id),
                limits=spec.limits,
                host_uid=self.host_uid,
                id_count=self.id_count,
                annotations={"corral.sandbox": sandbox_id, "corral.image": image.digest},
            )
            oci.write_bundle(d, config)
            undo.append(lambda: self.runtime.delete(sandbox_id, force=True))
            await self.runtime.run_detached(sandbox_id, d, pass_fd=lsock.fileno())
        finally:
            # The init holds its own copy of the listening socket now; ours must go so that
            # the socket dies with the sandbox.
            lsock.close()
        pid = self.init_pid(sandbox_id)
        if pid is None:
            raise HostError(f"sandbox {sandbox_id}: the runtime started but reports no init pid")
        return pid

    def init_pid(self, sandbox_id: str) -> int | None:
        """Host pid of the sandbox's init, read from the runtime's state file (no exec)."""
        for name in ("state.json", "status"):
            p = self.runtime.root / sandbox_id / name
            try:
                data = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            pid = data.get("init_process_pid") or data.get("pid")
            if pid:
                return int(pid)
        return None

    def alive(self, sandbox_id: str) -> bool:
        pid = self.init_pid(sandbox_id)
        if not pid:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    async def kill_all(self, sandbox_id: str, wait: float = 5.0) -> bool:
        """SIGKILL the init (the kernel then kills its whole pid namespace) and wait until no
        process of the sandbox is left, so destroy never returns with guest processes alive.
        True when the sandbox's cgroup was seen empty."""
        pid = self.init_pid(sandbox_id)
        if pid:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                fd = -1
            if fd >= 0:
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                finally:
                    os.close(fd)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while loop.time() < deadline:
            try:
                if not self.cgroups.procs(sandbox_id):
                    return True
            except Exception:
                return False  # no cgroup (never created, or removed): let the runtime decide
            await asyncio.sleep(0.002)
        return False

    async def adopt(self, sandbox_id: str, image: ImageInfo) -> bool:
        return self.alive(sandbox_id) and mounts.is_mountpoint(self.rootfs(sandbox_id))

    async def destroy(self, sandbox_id: str, image: ImageInfo | None) -> None:
        self._clients.pop(sandbox_id, None)
        self._fs.pop(sandbox_id, None)
        errors: list[str] = []

        async def step(what: str, fn: Callable[[], object]) -> None:
            try:
                r = fn()
                if hasattr(r, "__await__"):
                    await r  # type: ignore[misc]
            except Exception as e:  # keep going: a half-destroyed sandbox is worse
                errors.append(f"{what}: {e}")

        if await self.kill_all(sandbox_id):
            # Every process is gone: remove the cgroup and the runtime's record directly,
            # saving a runtime process per destroy.
            await step("cgroup", lambda: self.cgroups.remove(sandbox_id))
            await step("runtime state", lambda: self.runtime.forget_stopped(sandbox_id))
        else:
            await step("runtime delete", lambda: self.runtime.delete(sandbox_id, force=True))
            await step("cgroup", lambda: self.cgroups.remove(sandbox_id))
        root = self.rootfs(sandbox_id)
        await step("rootfs umount", lambda: mounts.umount(root, detach=True, busy_wait=1.0))
        await step("writable layer", lambda: self.scratch.delete_subvol(sandbox_id))
        if image is not None:
            for digest in image.layers:
                await step(f"layer {digest[:19]}", functools.partial(self.layers.release, digest))
        await step("dir", lambda: _remove_dir(self.dir(sandbox_id)))
        if errors:
            raise HostError(f"sandbox {sandbox_id} destroy left problems: " + "; ".join(errors))


def _remove_dir(d: Path) -> None:
    """Remove a sandbox dir without ever descending into a still-mounted rootfs."""
    for name in ("config.json", "ctl.sock"):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()
    with contextlib.suppress(FileNotFoundError):
        (d / "rootfs").rmdir()  # fails (and so keeps guest data) if still mounted
    with contextlib.suppress(FileNotFoundError):
        d.rmdir()
