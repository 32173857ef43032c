"""Container sandboxes: OCI runtime + overlay of shared EROFS layers + corral-init.

Create, in order (each step undone if a later one fails):
  1. the sandbox dir: a btrfs subvolume with the disk quota (it holds the overlay upper
     and work dirs, the rootfs mountpoint, the bundle and the control socket),
  2. acquire each image layer's node-wide mount (idmapped to the sandbox uid range),
  3. overlay rootfs = layers (lowers) + upper,
  4. a listening control socket in the sandbox dir (host side only; the guest never sees it),
  5. config.json, then ``runc run --detach --preserve-fds 1`` with that socket as fd 3.
No process of ours stays per sandbox: runc exits, the init lives on in the container.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import json
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from corral.backends import oci
from corral.backends.files import SandboxFS
from corral.backends.initclient import InitClient
from corral.errors import HostError, SandboxError
from corral.host import mounts
from corral.host.btrfs import Scratch
from corral.host.cgroups import Cgroups
from corral.host.owners import OwnerUids, namespace_owner
from corral.host.runtime import OCIRuntime
from corral.host.userns import SandboxUserns, drop_file
from corral.images.mounts import LayerMounts
from corral.policy import qos
from corral.spec import ImageInfo, SandboxSpec

__all__ = ["ContainerBackend", "remove_sandbox_dir"]


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
        owners: OwnerUids | None = None,
    ) -> None:
        self.sandboxes_dir = sandboxes_dir
        self.runtime = runtime
        self.cgroups = cgroups
        self.layers = layers
        self.scratch = scratch
        self.init_path = init_path
        self.host_uid = host_uid
        self.id_count = id_count
        # Each sandbox's user namespace is owned by a host uid of its own (host/owners.py);
        # None: the runtime creates it as host root (tests of the old behaviour only).
        self.owners = owners
        self._owner: dict[str, int] = {}
        self._clients: dict[str, InitClient] = {}
        self._fs: dict[str, SandboxFS] = {}
        self._seccomp_bpf: dict[str, str] = {}
        self.seccomp_notify: str | None = None
        self.extra_mounts: list[dict[str, object]] = []
        """OCI mounts every sandbox gets (the node resolver's /etc/resolv.conf)."""
        """The node's seccomp listener socket (corral.node.security), if it has one."""
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
                self.rootfs(sandbox_id),
                uid=self.host_uid,
                gid=self.host_uid,
                require_mount=True,
            )
        return f

    # lifecycle
    async def create(
        self, sandbox_id: str, spec: SandboxSpec, image: ImageInfo, base: str | None = None
    ) -> int:
        """Start a sandbox; with ``base`` (a scratch subvolume laid out like a sandbox dir,
        see corral.node.snapshot), its writable layer starts as a snapshot of that one."""
        undo: list[Callable[[], object]] = []
        try:
            return await self._create(sandbox_id, spec, image, undo, base)
        except BaseException:
            for step in reversed(undo):
                with contextlib.suppress(Exception):
                    r = step()
                    if hasattr(r, "__await__"):
                        await r  # type: ignore[misc]
            raise

    async def _create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: ImageInfo,
        undo: list[Callable[[], object]],
        base: str | None = None,
    ) -> int:
        d = self.dir(sandbox_id)
        in_subvol = d.parent == self.scratch.mountpoint
        if in_subvol:
            # The sandbox's dir is its btrfs subvolume (bundle, control socket, rootfs
            # mountpoint, overlay upper and work), deleted in one call, and refused while the
            # rootfs is still mounted. It also keeps these per-create files off the node's
            # root filesystem: here ext4 without a journal, whose inode allocator rescans
            # recently deleted inodes (~0.3-0.6 ms per new file under create/destroy churn).
            undo.append(lambda: self.scratch.delete_subvol(sandbox_id))
            if base is None:
                self.scratch.create_subvol(sandbox_id, quota=spec.limits.disk)
            else:
                # A snapshot commits a btrfs transaction (2-10 ms): off the event loop, so
                # the other children of a fork go on starting meanwhile.
                await _in_thread(self.scratch.snapshot, base, sandbox_id, spec.limits.disk)
        else:
            d.mkdir(mode=0o711)
            undo.append(lambda: remove_sandbox_dir(d))
        # 0711: runc in the user namespace must traverse it as the mapped uid; no listing.
        os.chmod(d, 0o711)

        lowers: list[Path] = []
        for digest in image.layers:
            if digest in self.layers.mounted():
                lowers.append(self.layers.acquire(digest))
            else:
                # First use on this node: verifying the digest reads the whole layer file
                # (~0.2 s for 150 MB); keep it off the event loop. If the create is
                # cancelled meanwhile, the acquire still completes: record it for undo.
                job = asyncio.ensure_future(asyncio.to_thread(self.layers.acquire, digest))
                try:
                    lowers.append(await asyncio.shield(job))
                except asyncio.CancelledError:
                    await asyncio.wait([job])
                    if not job.cancelled() and job.exception() is None:
                        undo.append(functools.partial(self.layers.release, digest))
                    raise
            undo.append(functools.partial(self.layers.release, digest))

        sub = d
        if not in_subvol:
            if base is None:
                sub = self.scratch.create_subvol(sandbox_id, quota=spec.limits.disk)
            else:
                sub = self.scratch.snapshot(base, sandbox_id, quota=spec.limits.disk)
            undo.append(lambda: self.scratch.delete_subvol(sandbox_id))
        upper, work = sub / "upper", sub / "work"
        if base is None:
            upper.mkdir()
            work.mkdir()
            # The upper belongs to root inside the sandbox (host uid host_uid), so the guest
            # can write where a normal root could and its files land under the mapped owner.
            os.chown(upper, self.host_uid, self.host_uid)

        root = self.rootfs(sandbox_id)
        root.mkdir(exist_ok=base is not None)
        mounts.mount_overlay(list(reversed(lowers)), upper, work, root)
        undo.append(lambda: mounts.umount(root, detach=True))

        userns = None
        if self.owners is not None:
            self._owner[sandbox_id] = owner = self.owners.allocate()
            undo.append(lambda: self._release_owner(sandbox_id))
            # crun opens the namespace in its own process: an fd does (no mount churn).
            path = None if self.runtime.name == "crun" else d / "userns"
            userns = SandboxUserns(owner, self.host_uid, self.id_count, path)
        latency = spec.qos == "latency"  # its cgroup's place (Cgroups.prepare)
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
                cgroups_path=self.cgroups.oci_path(sandbox_id, latency=latency),
                limits=spec.limits,
                host_uid=self.host_uid,
                id_count=self.id_count,
                annotations={"corral.sandbox": sandbox_id, "corral.image": image.digest},
                userns_path=None if userns is None else userns.join_path,
                userns_mappings=self.runtime.name == "runc",
                notify=self.seccomp_notify,
                extra_mounts=[*self.extra_mounts, *oci.tmpfs_mounts(spec.tmpfs)],
                readonly_root=spec.readonly_rootfs,
            )
            bpf_key = self._reuse_seccomp_bpf(config)
            if userns is not None and not oci.joins_userns(config):
                userns = None  # runc with a joined network namespace (see build_config)
                self._release_owner(sandbox_id)
            rlimits = oci.take_rlimits(config) if userns and self.runtime.name == "runc" else []
            oci.write_bundle(d, config)
            self.cgroups.prepare(latency=latency)
            # After the runtime's delete (undo runs in reverse): directories it left, e.g.
            # in hierarchies it does not manage.
            undo.append(lambda: self.cgroups.remove(sandbox_id))
            undo.append(lambda: self.runtime.delete(sandbox_id, force=True))
            await self.runtime.run_detached(
                sandbox_id, d, pass_fd=lsock.fileno(), userns=userns, rlimits=rlimits
            )
            if bpf_key is not None:
                self._remember_seccomp_bpf(bpf_key, sandbox_id)
        finally:
            # The init holds its own copy of the listening socket now; ours must go so that
            # the socket dies with the sandbox.
            lsock.close()
        pid = self.init_pid(sandbox_id)
        if pid is None:
            raise HostError(f"sandbox {sandbox_id}: the runtime started but reports no init pid")
        # Before any guest command exists, so everything the sandbox starts inherits it.
        qos.apply(pid, spec.qos)
        # The runtime may return while the container is still being set up (its last steps,
        # the seccomp listener handover among them, run inside the sandbox's cgroup: for a
        # best-effort sandbox on idle CPU only). "running" means the init answers: a node
        # killed before that would otherwise leave a sandbox whose setup then fails.
        try:
            await self.client(sandbox_id).ping()
        except SandboxError as e:
            raise SandboxError(
                f"sandbox {sandbox_id}: its init did not come up ({e}); a best-effort "
                "sandbox starts on idle CPU only, so normal-priority load on every CPU "
                "delays it"
            ) from None
        return pid

    def _reuse_seccomp_bpf(self, config: dict[str, object]) -> str | None:
        """Hand crun the seccomp filter it compiled for an identical profile before.

        crun compiles the OCI seccomp profile with libseccomp for every container (~7% of
        a create's CPU here). Its ``run.oci.seccomp_bpf_data`` annotation takes the
        compiled program instead; corral reuses crun's own output (the ``seccomp.bpf`` it
        leaves in its state dir), keyed by the exact profile and runtime binary, so the
        guest gets the very filter crun would have built. Returns the cache key when the
        filter is not cached yet (the caller records it after the run), else None.
        """
        if self.runtime.name != "crun":
            return None
        linux = config.get("linux")
        seccomp = linux.get("seccomp") if isinstance(linux, dict) else None
        if not seccomp:
            return None
        key = hashlib.sha256(
            json.dumps([self.runtime.binary, seccomp], sort_keys=True).encode()
        ).hexdigest()
        bpf = self._seccomp_bpf.get(key)
        if bpf is None:
            return key
        annotations = config.setdefault("annotations", {})
        assert isinstance(annotations, dict)
        annotations["run.oci.seccomp_bpf_data"] = bpf
        return None

    def _remember_seccomp_bpf(self, key: str, sandbox_id: str) -> None:
        # Complete: crun wrote it before starting the container, which has started.
        try:
            raw = (self.runtime.root / sandbox_id / "seccomp.bpf").read_bytes()
        except OSError:
            return
        # A classic BPF program is a whole number of 8-byte instructions.
        if raw and len(raw) % 8 == 0:
            self._seccomp_bpf[key] = base64.b64encode(raw).decode()

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

    def freeze(self, sandbox_id: str) -> None:
        """Freeze every process of the sandbox (cgroup freezer). Pause, snapshots and forks
        go through the node's :class:`corral.node.pause.Pauser`, which keeps the state."""
        self.cgroups.freeze(sandbox_id)

    def thaw(self, sandbox_id: str) -> None:
        """Thaw what :meth:`freeze` froze."""
        self.cgroups.thaw(sandbox_id)

    def alive(self, sandbox_id: str) -> bool:
        pid = self.init_pid(sandbox_id)
        if not pid:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        # A killed init stays a zombie until the host's init reaps it (seen: 1.7 s here);
        # it serves nothing any more.
        return state not in (b"Z", b"X")

    async def kill_all(self, sandbox_id: str, wait: float = 5.0) -> bool:
        """SIGKILL the init (the kernel then kills its whole pid namespace) and wait until no
        process of the sandbox is left, so destroy never returns with guest processes alive.
        True when the sandbox's cgroup was seen empty."""
        with contextlib.suppress(Exception):
            # A frozen (paused) task never dies of SIGKILL on cgroup v1 until thawed.
            if self.cgroups.is_frozen(sandbox_id):
                self.cgroups.thaw(sandbox_id, timeout=1.0)
        pid = self.init_pid(sandbox_id)
        if pid:
            # Only if the pid is still the sandbox's: an init that died (and was reaped)
            # before this destroy may have had its pid reused by an unrelated host process.
            _pidfd_kill(pid, in_cgroup=lambda q: q in self.cgroups.procs(sandbox_id))
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + wait
        while loop.time() < deadline:
            try:
                left = self.cgroups.procs(sandbox_id)
            except Exception:
                return False  # no cgroup (never created, or removed): let the runtime decide
            if not left:
                return True
            if not pid or loop.time() - start > 0.2:
                # No runtime record (a create interrupted between the runtime starting the
                # container and writing its state), or the namespace did not go down with
                # the init: kill what the sandbox's cgroup holds, one by one.
                for p in left:
                    _pidfd_kill(p, in_cgroup=lambda q: q in self.cgroups.procs(sandbox_id))
            await asyncio.sleep(0.002)
        return False

    async def adopt(self, sandbox_id: str, image: ImageInfo) -> bool:
        ok = self.alive(sandbox_id) and mounts.is_mountpoint(self.rootfs(sandbox_id))
        pid = self.init_pid(sandbox_id)
        if ok and pid and self.owners is not None:
            # The kernel remembers who owns the namespace: claim that uid again.
            owner = namespace_owner(pid)
            if owner is not None and self.owners.claim(owner):
                self._owner[sandbox_id] = owner
        return ok

    def _release_owner(self, sandbox_id: str) -> None:
        owner = self._owner.pop(sandbox_id, None)
        if owner is not None and self.owners is not None:
            self.owners.release(owner)

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

        async def umount_root() -> None:
            try:
                mounts.umount(root)  # the usual case: nothing holds the overlay any more
            except HostError:
                # Busy: host-side file operations still inside. Their wait (up to 1 s, then
                # a lazy detach) must not stall every other request on the event loop.
                await asyncio.to_thread(mounts.umount, root, detach=True, busy_wait=1.0)

        await step("rootfs umount", umount_root)
        # Left mounted only by a node that died while the runtime was starting.
        await step("userns file", lambda: drop_file(self.dir(sandbox_id) / "userns"))
        await step("writable layer", lambda: self.scratch.delete_subvol(sandbox_id))
        if image is not None:
            for digest in image.layers:
                await step(f"layer {digest[:19]}", functools.partial(self.layers.release, digest))
        await step("dir", lambda: remove_sandbox_dir(self.dir(sandbox_id)))
        if not errors:  # else processes (and so the namespace) may live on: keep the owner
            self._release_owner(sandbox_id)
        if errors:
            raise HostError(f"sandbox {sandbox_id} destroy left problems: " + "; ".join(errors))


async def _in_thread(fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)`` in a worker thread; if the caller is cancelled, it still waits for the
    thread to end, so the caller's undo never runs before what it undoes exists."""
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        raise


def _pidfd_kill(pid: int, in_cgroup: Callable[[int], bool] | None = None) -> None:
    """SIGKILL ``pid`` through a pidfd; with ``in_cgroup``, only if, once the pidfd pins
    the process, it is still in the sandbox's cgroup (the pid may have been reused)."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return
    try:
        if in_cgroup is None or in_cgroup(pid):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (ProcessLookupError, OSError, HostError):
        pass
    finally:
        os.close(fd)


def remove_sandbox_dir(d: Path) -> None:
    """Remove a sandbox dir without ever descending into a still-mounted rootfs."""
    drop_file(d / "userns")  # a namespace bind left by a node that died mid-create
    for name in ("config.json", "ctl.sock"):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()
    with contextlib.suppress(FileNotFoundError):
        (d / "rootfs").rmdir()  # fails (and so keeps guest data) if still mounted
    with contextlib.suppress(FileNotFoundError):
        d.rmdir()
