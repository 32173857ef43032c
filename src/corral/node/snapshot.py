"""Snapshots and forks of a sandbox's filesystem (the node's side of both).

A sandbox's writable layer lives in its own btrfs subvolume, whatever its backend. Both
operations start the same way: the backend copies the writable layer
(``Backend.copy_writable``) while the node holds the sandbox's processes frozen (a few ms;
a paused sandbox simply stays frozen). Everything after that works on the private,
immutable copy while the sandbox runs on.

* ``snapshot``: the backend packs the copy into a new layer (``Backend.pack``: for
  containers the upper, scrubbed of corral's own files, as EROFS, corral.images.pack) and written as an image: the source image's layers +
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
import secrets
import time
from collections.abc import Iterator

from pydantic import ValidationError

from corral.errors import CapacityError, Conflict, CorralError, HostError, InvalidRequest
from corral.host.btrfs import Scratch
from corral.images.store import LayerStore, check_image_name
from corral.node.lifecycle import Lifecycle
from corral.node.pause import Pauser
from corral.node.state import StateStore
from corral.node.table import SandboxTable
from corral.spec import ForkRequest, ImageInfo, SandboxInfo, SandboxSpec, validation_message

__all__ = ["Snapshots", "child_spec", "FORK_CONCURRENCY"]

FORK_CONCURRENCY = 8
"""Children started at once by one fork (each is a runtime process)."""

_SOURCE_STATES = ("running", "paused")
_WORK_KINDS = ("snap-", "fork-")
"""Names of work copies on the scratch fs (see _work_name)."""


class Snapshots:
    """The node's snapshot and fork operations."""

    def __init__(
        self,
        life: Lifecycle,
        table: SandboxTable,
        pauser: Pauser,
        state: StateStore,
        store: LayerStore,
        scratch: Scratch,
    ) -> None:
        self.life = life
        self.table = table
        self.pauser = pauser
        self.state = state
        self.store = store
        self.scratch = scratch
        self.in_use: set[str] = set()
        """Scratch subvolumes of work in progress: the node's gc leaves them alone."""

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> ImageInfo:
        """Pack the sandbox's filesystem changes into a new layer; returns the new image."""
        self.life.check_open()
        info = self._source(sandbox_id)
        name = _default_name(sandbox_id) if name is None else check_image_name(name)
        backend = self.life.backend_of(info)
        t0 = time.perf_counter()
        with self._scratch_temp("snap") as work:
            frozen = await self._copy(info, work, "snapshot")
            copied = time.perf_counter()
            try:
                layer = await backend.pack(work, source=sandbox_id, max_bytes=info.spec.limits.disk)
            except OSError as e:
                # The tree is the guest's: e.g. paths nested past PATH_MAX cannot be packed.
                raise HostError(
                    f"snapshot of {sandbox_id}: packing its files failed: {e}"
                ) from None
            image = self.store.put_image(
                name,
                [*info.layers, layer.digest],
                env=dict(info.image_env),
                workdir=info.spec.workdir,
            )
        self.state.add_event(
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
        self.life.check_open()
        parent = self._source(sandbox_id)
        spec = child_spec(parent.spec, req)
        max_sandboxes = self.life.config.max_sandboxes
        free = max_sandboxes - len(self.table)
        if req.count > free:
            raise CapacityError(
                f"node {self.life.node_id} has room for {max(free, 0)} more sandbox(es), not "
                f"{req.count} (max_sandboxes={max_sandboxes})"
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
                        info = await self.life.create(
                            spec, image, writable_from=base, forked_from=sandbox_id
                        )
                    except BaseException:
                        failed = True
                        raise
                    made.append(info)

            frozen = 0.0
            try:
                frozen = await self._copy(parent, base, "fork")
                results = await asyncio.gather(
                    *(one() for _ in range(req.count)), return_exceptions=True
                )
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    raise errors[0]
            except BaseException:
                await asyncio.shield(self._destroy_all(made))
                raise
        self.state.add_event(
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
        info = self.table.need(sandbox_id)
        if info.state not in _SOURCE_STATES:
            raise Conflict(f"sandbox {sandbox_id} is {info.state}: only a running or paused one")
        return info

    async def _copy(self, info: SandboxInfo, dst: str, purpose: str) -> float:
        """The backend's copy of the writable layer, taken with the sandbox frozen; returns
        how long it was held frozen (seconds)."""
        with self.table.working(info.id):  # a request in flight: the idle reaper waits
            return await self.life.backend_of(info).copy_writable(
                info.id,
                dst,
                lambda: self.pauser.frozen(info.id),
                "fork" if purpose == "fork" else "snapshot",
            )

    @contextlib.contextmanager
    def _scratch_temp(self, kind: str) -> Iterator[str]:
        """A name for a temporary subvolume on the scratch fs, protected from gc while in use
        and deleted (if it was made) afterwards."""
        name = _work_name(kind)
        self.in_use.add(name)
        try:
            yield name
        finally:
            with contextlib.suppress(CorralError):
                self.scratch.delete_subvol(name)
            self.in_use.discard(name)

    def drop_crashed_work(self) -> int:
        """At open: delete the work copies of snapshots and forks that died with the last
        agent (nothing uses them any more); returns how many."""
        n = 0
        for name in self.scratch.subvols():
            if name.startswith(_WORK_KINDS) and name not in self.in_use:
                with contextlib.suppress(CorralError):
                    self.scratch.delete_subvol(name)
                    n += 1
        return n

    async def _destroy_all(self, infos: list[SandboxInfo]) -> None:
        for info in infos:
            with contextlib.suppress(CorralError):
                await self.life.destroy_request(info.id)


def _work_name(kind: str) -> str:
    # Not "sb-...": a scratch subvolume that is no sandbox's (gc skips it while in use).
    return f"{kind}-{secrets.token_hex(6)}"


def _default_name(sandbox_id: str) -> str:
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}"
    return f"snapshot/{sandbox_id}:{stamp}"


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
