"""Snapshots and forks of a sandbox's filesystem (the node's side of both).

A sandbox's writable layer (overlay upper and work dir) lives in its own btrfs subvolume
(see ContainerBackend). Both operations start the same way: freeze the sandbox's
processes (a few ms; a paused sandbox simply stays frozen), take a btrfs snapshot of its
subvolume (~2 ms), thaw. Everything after that works on the private, immutable copy
while the sandbox runs on.

* ``snapshot``: the copy's upper, scrubbed of corral's own files, is packed into a new
  EROFS layer (corral.images.pack) and written as an image: the source image's layers +
  that layer. Any node that reads the store creates sandboxes from it.
* ``fork``: each child's writable layer is a snapshot of the copy (copy-on-write: no data
  is copied; btrfs simple quotas charge every child only for what it writes itself), on
  the parent's layers. Children are independent sandboxes from then on (restart, adopt,
  destroy and gc treat them like any other).

Processes are not cloned (CRIU fails ``criu check`` on our kernels; see
corral.host.criu): a fork or a restored snapshot boots a fresh init over the copied
files. Shell sessions do not carry over either (their state files are scrubbed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import ValidationError

from corral.errors import CapacityError, Conflict, CorralError, HostError, InvalidRequest
from corral.host.userns import UserNamespace
from corral.images.pack import pack_upper, scrub
from corral.images.store import check_image_name
from corral.spec import ForkRequest, ImageInfo, SandboxInfo, SandboxSpec, validation_message

if TYPE_CHECKING:
    from corral.node.node import Node

__all__ = ["Snapshots", "child_spec", "FORK_CONCURRENCY"]

T = TypeVar("T")

FORK_CONCURRENCY = 8
"""Children started at once by one fork (each is a runtime process)."""

_SOURCE_STATES = ("running", "paused")
_KEEP = ("upper", "work", "rootfs")  # what a fork base keeps of a sandbox dir


class CreateFrom(Protocol):
    """The node's create of a sandbox from an image (``Node._create_sandbox``); with
    ``fork_base``, its writable layer starts as a snapshot of that scratch subvolume."""

    def __call__(
        self, spec: SandboxSpec, image: ImageInfo, fork_base: str | None = None, **why: str
    ) -> Awaitable[SandboxInfo]: ...


class Snapshots:
    """The node's snapshot and fork operations.

    Built once by the node, which hands over, besides itself (for its public parts), the
    few pieces of its own state these operations need and no NodeOps caller may touch.
    """

    def __init__(
        self,
        node: Node,
        *,
        need: Callable[[str], SandboxInfo],
        working: Callable[[str], AbstractContextManager[None]],
        create: CreateFrom,
        scratch_in_use: set[str],
    ) -> None:
        self.node = node
        self._need = need
        """The live sandbox's info (SandboxNotFound, naming it, if there is none)."""
        self._working = working
        """Marks a request in flight on a sandbox, so the idle reaper leaves it alone."""
        self._create = create
        self._scratch_in_use = scratch_in_use
        """Scratch subvolumes of work in progress: the node's gc leaves them alone."""

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> ImageInfo:
        """Pack the sandbox's filesystem changes into a new layer; returns the new image."""
        node = self.node
        info = self._source(sandbox_id)
        name = _default_name(sandbox_id) if name is None else check_image_name(name)
        t0 = time.perf_counter()
        with self._scratch_temp("snap") as work:
            frozen = await self._copy(sandbox_id, work)
            copied = time.perf_counter()
            inverse = UserNamespace.create(node.config.host_uid, node.config.id_count, inverse=True)
            try:
                layer = await _in_thread(
                    functools.partial(
                        pack_upper,
                        node.store,
                        node.scratch.mountpoint / work / "upper",
                        inverse=inverse,
                        mount_dir=node.config.state_dir / "pack" / work,
                        source=sandbox_id,
                        max_bytes=info.spec.limits.disk,
                    )
                )
            except OSError as e:
                # The tree is the guest's: e.g. paths nested past PATH_MAX cannot be packed.
                raise HostError(
                    f"snapshot of {sandbox_id}: packing its files failed: {e}"
                ) from None
            finally:
                inverse.close()
            image = node.store.put_image(
                name,
                [*info.layers, layer.digest],
                env=dict(info.image_env),
                workdir=info.spec.workdir,
            )
        node.state.add_event(
            sandbox_id,
            "snapshot",
            {
                "image": image.name,
                "layer": layer.digest,
                "bytes": layer.size,
                "copy_ms": round((copied - t0) * 1000, 1),
                "frozen_ms": round(frozen * 1000, 1),
                "total_ms": round((time.perf_counter() - t0) * 1000, 1),
            },
        )
        return image

    async def fork(self, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        """``req.count`` new sandboxes starting from the sandbox's current files.

        All or nothing: if any child fails to start, the others are destroyed and the error
        is raised; nothing (subvolume, mount, cgroup) of the attempt stays behind.
        """
        node = self.node
        parent = self._source(sandbox_id)
        spec = child_spec(parent.spec, req)
        free = node.config.max_sandboxes - len(await node.sandbox_list())
        if req.count > free:
            raise CapacityError(
                f"node {node.node_id} has room for {max(free, 0)} more sandbox(es), not "
                f"{req.count} (max_sandboxes={node.config.max_sandboxes})"
            )
        # The parent's own layers, not its image name's current ones.
        image = parent.image_info()
        with self._scratch_temp("fork") as base:
            made: list[SandboxInfo] = []
            failed = False
            sem = asyncio.Semaphore(FORK_CONCURRENCY)

            async def one() -> None:
                nonlocal failed
                async with sem:
                    if failed:
                        return  # another child failed: do not start more that would be undone
                    try:
                        info = await self._create(
                            spec, image, fork_base=base, forked_from=sandbox_id
                        )
                    except BaseException:
                        failed = True
                        raise
                    made.append(info)

            frozen = 0.0
            try:
                frozen = await self._copy(sandbox_id, base)
                await _in_thread(_reset_base, node.scratch.mountpoint / base)
                results = await asyncio.gather(
                    *(one() for _ in range(req.count)), return_exceptions=True
                )
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    raise errors[0]
            except BaseException:
                await asyncio.shield(self._destroy_all(made))
                raise
        node.state.add_event(
            sandbox_id,
            "forked",
            {
                "count": len(made),
                "children": ",".join(i.id for i in made)[:2000],
                "frozen_ms": round(frozen * 1000, 1),
            },
        )
        return made

    def _source(self, sandbox_id: str) -> SandboxInfo:
        info = self._need(sandbox_id)
        if info.state not in _SOURCE_STATES:
            raise Conflict(f"sandbox {sandbox_id} is {info.state}: only a running or paused one")
        return info

    async def _copy(self, sandbox_id: str, dst: str) -> float:
        """Snapshot the sandbox's subvolume as ``dst`` with its processes frozen, so no write
        is caught half done (a write(2) in flight finishes before its task freezes).

        A btrfs snapshot first writes out the subvolume's dirty data (~1 s for 500 MiB just
        written). A throwaway snapshot taken beforehand, while the sandbox runs, does that
        writeback, so the frozen one only flushes what came since: the sandbox stays frozen
        for milliseconds. Returns how long it was held frozen (seconds).
        """
        scratch = self.node.scratch
        with self._working(sandbox_id):  # a request in flight: the idle reaper waits
            await _in_thread(scratch.snapshot, sandbox_id, dst, None)
            await _in_thread(scratch.delete_subvol, dst)
            t0 = time.perf_counter()
            async with self.node.pauser.frozen(sandbox_id):
                scratch.snapshot(sandbox_id, dst, None)
            return time.perf_counter() - t0

    @contextlib.contextmanager
    def _scratch_temp(self, kind: str) -> Iterator[str]:
        """A name for a temporary subvolume on the scratch fs, protected from gc while in use
        and deleted (if it was made) afterwards."""
        name = _work_name(kind)
        self._scratch_in_use.add(name)
        try:
            yield name
        finally:
            with contextlib.suppress(CorralError):
                self.node.scratch.delete_subvol(name)
            self._scratch_in_use.discard(name)

    async def _destroy_all(self, infos: list[SandboxInfo]) -> None:
        for info in infos:
            with contextlib.suppress(CorralError):
                await self.node.sandbox_destroy(info.id)


def _work_name(kind: str) -> str:
    # Not "sb-...": a scratch subvolume that is no sandbox's (gc skips it while in use).
    return f"{kind}-{secrets.token_hex(6)}"


def _default_name(sandbox_id: str) -> str:
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}"
    return f"snapshot/{sandbox_id}:{stamp}"


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread; a cancelled caller still waits for it to end, so
    its cleanup never runs under a thread that is still creating what it removes."""
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        raise


def child_spec(parent: SandboxSpec, req: ForkRequest) -> SandboxSpec:
    """The parent's spec with what ``req`` overrides (InvalidRequest if that is invalid)."""
    data = parent.model_dump()
    for key in ("limits", "labels", "env", "ttl", "idle_timeout"):
        value = getattr(req, key)
        if value is not None:
            data[key] = value.model_dump() if hasattr(value, "model_dump") else value
    try:
        return SandboxSpec.model_validate(data)
    except ValidationError as e:
        raise InvalidRequest(validation_message(e)) from None


def _reset_base(d: Path) -> None:
    """Turn a snapshot of a sandbox dir into a fork base: only the upper (scrubbed of
    corral's files), an empty work dir and the rootfs mountpoint stay."""
    for entry in os.scandir(d):
        if entry.name in _KEEP:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    scrub(d / "upper")
    # Overlay's work dir may hold a half-done copy-up of the parent's: start empty.
    work = d / "work"
    st = os.lstat(work)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(work)
    work.mkdir()
