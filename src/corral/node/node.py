"""The node agent: the single owner of sandbox state on one host.

Every API (embedded SDK, REST) ends here as a typed call; this object decides what is
allowed in which state, talks to the backend, and records the outcome in SQLite.

Example:
    node = await Node.open(NodeConfig(state_dir=Path("/var/lib/corral")))
    info = await node.sandbox_create(SandboxSpec(image="demo/python"))
    print((await node.exec(info.id, ExecRequest(cmd=["true"]))).reason)
    await node.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from corral.backends import shell as shellmod
from corral.backends.container import ContainerBackend, remove_sandbox_dir
from corral.backends.initclient import InitExit
from corral.errors import (
    CapacityError,
    Conflict,
    CorralError,
    HostError,
    InvalidRequest,
    ProcessNotFound,
    SandboxError,
    SandboxNotFound,
)
from corral.host import criu, initfs, landlock, mounts, sched
from corral.host.btrfs import Scratch
from corral.host.cgroups import Cgroups, detect_mode
from corral.host.owners import OwnerUids
from corral.host.runtime import OCIRuntime
from corral.host.userns import UserNamespace
from corral.images.mounts import LayerMounts
from corral.images.store import LayerStore
from corral.init import ensure_built
from corral.node.snapshot import Snapshots
from corral.node.config import NodeConfig
from corral.node.network import NodeNetwork
from corral.node.fncall import FnCallService
from corral.node.security import NodeSecurity
from corral.node.pause import NodeSwap, Pauser
from corral.node.state import StateStore
from pydantic import ValidationError

from corral.spec import (
    validation_message,
    CallRequest,
    CallResult,
    JudgeRequest,
    JudgeResult,
    Event,
    EventSummary,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileStat,
    ForkRequest,
    ImageInfo,
    LayerInfo,
    NetworkPolicy,
    NodeStatus,
    ProcessInfo,
    SandboxInfo,
    SandboxSpec,
    ShellInfo,
)

__all__ = ["Node"]

log = logging.getLogger("corral.node")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def _install_init(cfg: NodeConfig) -> Path:
    """Build corral-init if needed and put it on its own tmpfs (see corral.host.initfs)."""
    return initfs.install(cfg.run_dir / "initfs", ensure_built(cfg.state_dir / "bin"))


def _new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))


class Node:
    """One host's sandboxes. Create with :meth:`open`; implements :class:`corral.ops.NodeOps`."""

    def __init__(self, config: NodeConfig, **parts: object) -> None:
        # Private: use Node.open(). Parts are assembled there.
        self.config = config
        self.node_id: str = parts["node_id"]  # type: ignore[assignment]
        self.state: StateStore = parts["state"]  # type: ignore[assignment]
        self.store: LayerStore = parts["store"]  # type: ignore[assignment]
        self.cgroups: Cgroups = parts["cgroups"]  # type: ignore[assignment]
        self.runtime: OCIRuntime = parts["runtime"]  # type: ignore[assignment]
        self.userns: UserNamespace = parts["userns"]  # type: ignore[assignment]
        self.layers: LayerMounts = parts["layers"]  # type: ignore[assignment]
        self.scratch: Scratch = parts["scratch"]  # type: ignore[assignment]
        self.backend: ContainerBackend = parts["backend"]  # type: ignore[assignment]
        self._lock_fd: int = parts["lock_fd"]  # type: ignore[assignment]
        self.security: NodeSecurity = parts["security"]  # type: ignore[assignment]
        self.swap: NodeSwap = parts["swap"]  # type: ignore[assignment]
        self.network: NodeNetwork = parts["network"]  # type: ignore[assignment]
        self._live: dict[str, SandboxInfo] = {}
        self.pauser = Pauser(
            self.cgroups,
            self._live.get,
            self._put,
            self.state.add_event,
            busy=lambda sid: sid in self._busy,
        )
        self._touched: dict[str, float] = {}
        self._busy: dict[str, int] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._destroys: set[asyncio.Task[None]] = set()
        self._scratch_work: set[str] = set()  # snapshot/fork subvolumes in use (not gc's)
        self._snapshots = Snapshots(
            self,
            need=self._need,
            working=self._working,
            create=self._create_sandbox,
            scratch_in_use=self._scratch_work,
        )
        self._closed = False
        self.fncall = FnCallService(self, config.fncall)

    # ------------------------------------------------------------------ open / close
    @classmethod
    async def open(cls, config: NodeConfig | None = None) -> Node:
        cfg = config or NodeConfig()
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(cfg.state_dir / "node.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise Conflict(
                f"another corral node already owns {cfg.state_dir}; connect to it "
                f"(AsyncClient('unix://{cfg.socket_path}')) or use another state_dir"
            ) from None
        opened: list[object] = []
        try:
            node_id_file = cfg.state_dir / "node_id"
            if not node_id_file.exists():
                node_id_file.write_text(uuid.uuid4().hex[:12])
            node_id = node_id_file.read_text().strip()
            state = StateStore(cfg.state_dir / "state.db")
            store = LayerStore(cfg.store_dir)
            mode = detect_mode()
            cgroups = Cgroups(cfg.cgroup_subtree)
            runtime = OCIRuntime.detect(
                mode,
                root_base=cfg.run_dir,
                prefer=None if cfg.runtime == "auto" else cfg.runtime,
                helper_dir=cfg.state_dir / "bin",
                root_tmpfs=True,
            )
            init_path = await asyncio.to_thread(_install_init, cfg)
            userns = UserNamespace.create(cfg.host_uid, cfg.id_count)
            opened.append(userns)
            resolve = store.path_of
            if cfg.eager_layers:
                resolve = _eager_resolver(store, cfg.state_dir / "eager")
            layers = LayerMounts(cfg.state_dir / "mnt", resolve, store.verify, userns)
            scratch = Scratch(
                cfg.state_dir / "scratch.img", cfg.state_dir / "scratch", cfg.scratch_size
            )
            await asyncio.to_thread(scratch.setup)
            swap = NodeSwap(cfg.swap, cfg.state_dir)
            await asyncio.to_thread(swap.setup)
            backend = ContainerBackend(
                # Each sandbox's dir is its scratch subvolume (see ContainerBackend._create).
                sandboxes_dir=scratch.mountpoint,
                runtime=runtime,
                cgroups=cgroups,
                layers=layers,
                scratch=scratch,
                init_path=init_path,
                host_uid=cfg.host_uid,
                id_count=cfg.id_count,
                owners=OwnerUids(cfg.owner_first, cfg.owner_uids),
            )
            opened.append(backend.owners)
            security = NodeSecurity(
                state.add_event,
                cgroups,
                scratch,
                # crun and runc >= 1.1 hand the filter's notification fd to this socket.
                listener_path=cfg.run_dir / "seccomp.sock",
                helper_dir=cfg.state_dir / "bin",  # its fd holder (host/fdstore.py)
            )
            opened.append(security)
            backend.seccomp_notify = security.notify_path
            network = NodeNetwork(cfg.network, cfg.cgroup_subtree, cfg.state_dir, state.add_event)
            backend.extra_mounts = network.mounts()
        except BaseException:
            for o in opened:
                with contextlib.suppress(Exception):
                    o.close()  # type: ignore[attr-defined]
            os.close(lock_fd)
            raise
        node = cls(
            cfg,
            node_id=node_id,
            state=state,
            store=store,
            cgroups=cgroups,
            runtime=runtime,
            userns=userns,
            layers=layers,
            scratch=scratch,
            backend=backend,
            lock_fd=lock_fd,
            swap=swap,
            security=security,
            network=network,
        )
        try:
            await node._recover()
        except BaseException:
            # Release the state dir: otherwise this process could never open it again.
            for part in (
                node.userns,
                node.backend.owners,
                node.runtime,
                node.scratch,
                node.security,
                node.state,
            ):
                with contextlib.suppress(Exception):
                    part.close()  # type: ignore[attr-defined,union-attr]
            os.close(lock_fd)
            raise
        await node.fncall.start()
        node._reaper = asyncio.create_task(node._reap_forever(), name="corral-reaper")
        return node

    async def _recover(self) -> None:
        """Reconcile the database with what is really running after a (re)start."""
        counts: dict[str, int] = {}
        lost: list[SandboxInfo] = []
        for info in self.state.live_sandboxes():
            image = info.image_info()
            adoptable = info.state in ("running", "pausing", "paused", "resuming")
            if adoptable and await self.backend.adopt(info.id, image):
                self._live[info.id] = info
                self.pauser.recovered(info)
                self.security.adopted(info.id)
                for d in info.layers:
                    counts[d] = counts.get(d, 0) + 1
            else:
                lost.append(info)
        self.security.recovered()  # the fd holder forgets sandboxes not adopted
        self.layers.adopt(counts)
        await self.network.adopt(
            (i.id, i.pid, i.address, i.spec.network) for i in self._live.values() if i.address
        )
        for info in lost:
            log.warning("sandbox %s did not survive (state %s); cleaning up", info.id, info.state)
            with contextlib.suppress(Exception):
                await self.backend.destroy(info.id, None)
            self.state.mark_destroyed(info.id)
            self.state.add_event(info.id, "lost", {"state": info.state})

    async def close(self) -> None:
        """Stop serving. Running sandboxes keep running (a later open adopts them); shared
        resources (layer mounts, scratch filesystem, cgroup subtree) go if none is left."""
        if self._closed:
            return
        self._closed = True
        await self.fncall.close()
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reaper
        await self.pauser.close()
        try:
            await self._settle()
            self._flush_touches()
            with contextlib.suppress(Exception):
                await self.network.close(keep=bool(self._live))
            if not self._live:
                try:
                    await self._teardown_shared()
                except CorralError as e:
                    # Something the node does not know holds them (a process left by a
                    # create cut short): the next open adopts them; gc removes the rest.
                    log.warning("close: shared resources stay mounted (run gc): %s", e.message)
                    self.scratch.close()
            else:
                self.scratch.close()
        finally:
            # Even when the teardown fails (a mount still busy): release the state dir, or
            # this process could never open a node on it again.
            self.userns.close()
            if self.backend.owners is not None:
                self.backend.owners.close()  # its host-wide claims go with it
            self.runtime.close()
            self.security.close()
            self.state.close()
            os.close(self._lock_fd)

    async def _settle(self, timeout: float = 60.0) -> None:
        """Wait for creates and destroys in flight (new ones are refused now): each records
        its outcome in the state db, which closes next. A create that finishes is adopted by
        the next open; one cancelled meanwhile undoes itself."""
        deadline = time.monotonic() + timeout
        while any(i.state in ("creating", "destroying") for i in self._live.values()):
            if time.monotonic() > deadline:
                log.warning("closing with creates/destroys still in flight after %.0f s", timeout)
                return
            await asyncio.sleep(0.005)

    async def _teardown_shared(self) -> None:
        initfs.remove(self.config.run_dir / "initfs")
        self.layers.unmount_all()
        await asyncio.to_thread(self.scratch.teardown)
        self.cgroups.remove_subtree_if_empty()
        await asyncio.to_thread(self.swap.teardown)
        self.runtime.teardown()  # its tmpfs at --root, if it made one
        for d in (self.runtime.root, self.runtime.root.with_name(self.runtime.root.name + "-log")):
            with contextlib.suppress(OSError):
                d.rmdir()

    async def __aenter__(self) -> Node:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ images
    async def image_get(self, name: str) -> ImageInfo:
        return self.store.image(name)

    async def image_list(self) -> list[ImageInfo]:
        return self.store.images()

    async def image_compose(
        self, name: str, layers: list[str], env: dict[str, str] | None = None, workdir: str = "/"
    ) -> ImageInfo:
        return self.store.put_image(name, layers, env=env, workdir=workdir)

    async def image_remove(self, name: str) -> None:
        self.store.remove_image(name)

    async def layer_list(self) -> list[LayerInfo]:
        return self.store.layers()

    # ------------------------------------------------------------------ lifecycle
    async def sandbox_create(self, spec: SandboxSpec) -> SandboxInfo:
        self._check_open()
        return await self._create_sandbox(spec, self.store.image(spec.image))

    async def _create_sandbox(
        self, spec: SandboxSpec, image: ImageInfo, fork_base: str | None = None, **why: str
    ) -> SandboxInfo:
        """Create from ``image``; with ``fork_base``, the writable layer starts as a
        snapshot of that scratch subvolume (see corral.node.snapshot)."""
        _check_fits(spec, self.config)
        self.network.compile(spec.network)  # unknown permission names: refused up front
        if len(self._live) >= self.config.max_sandboxes:
            raise CapacityError(
                f"node {self.node_id} is full: {len(self._live)} sandboxes "
                f"(max_sandboxes={self.config.max_sandboxes})"
            )
        sid = _new_id("sb-")
        now = time.time()
        info = SandboxInfo(
            id=sid,
            state="creating",
            image=spec.image,
            image_digest=image.digest,
            layers=list(image.layers),
            image_env=dict(image.env),
            spec=spec,
            created_at=now,
            expires_at=now + spec.ttl if spec.ttl else None,
            last_active_at=now,
            runtime=self.runtime.name,
        )
        if spec.workdir == "/" and image.workdir != "/":
            info.spec = spec.model_copy(update={"workdir": image.workdir})
        self.state.put_sandbox(info)
        self._live[sid] = info
        try:
            pid = await self.backend.create(sid, info.spec, image, base=fork_base)
            try:
                address = await self.network.attach(sid, pid, spec.network)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.backend.destroy(sid, image)
                raise
        except BaseException as e:
            self._live.pop(sid, None)
            self.state.mark_destroyed(sid)
            self.state.add_event(sid, "create_failed", {"error": str(e)[:2000]})
            if isinstance(e, CorralError):
                raise
            if isinstance(e, Exception):
                raise HostError(f"creating sandbox failed: {e}") from e
            raise
        info = info.model_copy(update={"state": "running", "pid": pid, "address": address})
        self._live[sid] = info
        self.state.put_sandbox(info)
        self.state.add_event(sid, "created", {"image": spec.image, "pid": pid, **why})
        self.security.created(sid)
        return info

    async def network_update(
        self, sandbox_id: str, allow: list[str] | None = None, deny: list[str] | None = None
    ) -> SandboxInfo:
        """Change a live sandbox's egress policy (None keeps that list); in effect when this
        returns, without touching its processes."""
        info = self._active(sandbox_id)
        try:
            policy = NetworkPolicy(
                allow=info.spec.network.allow if allow is None else allow,
                deny=info.spec.network.deny if deny is None else deny,
            )
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
        address = await self.network.update(sandbox_id, info.pid, info.address, policy)
        cur = self._live.get(sandbox_id, info)
        info = cur.model_copy(
            update={"spec": cur.spec.model_copy(update={"network": policy}), "address": address}
        )
        self._live[sandbox_id] = info
        self.state.put_sandbox(info)
        detail = {"allow": ",".join(policy.allow), "deny": ",".join(policy.deny)}
        self.state.add_event(sandbox_id, "network_updated", detail)
        return info

    async def sandbox_snapshot(self, sandbox_id: str, name: str | None = None) -> ImageInfo:
        self._check_open()
        return await self._snapshots.snapshot(sandbox_id, name)

    async def sandbox_fork(self, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        self._check_open()
        return await self._snapshots.fork(sandbox_id, req)

    async def sandbox_get(self, sandbox_id: str) -> SandboxInfo:
        info = self._live.get(sandbox_id)
        if info is None:
            info = self.state.get_sandbox(sandbox_id) if _plausible_id(sandbox_id) else None
            if info is None:
                raise SandboxNotFound(f"no sandbox {_shown(sandbox_id)} on node {self.node_id}")
        update: dict[str, object] = {
            "last_active_at": self._touched.get(sandbox_id, info.last_active_at)
        }
        if sandbox_id in self._live and info.state not in ("creating", "destroying"):
            with contextlib.suppress(CorralError):
                update["memory_resident"], update["memory_swapped"] = self.cgroups.memory_usage(
                    sandbox_id
                )
        return info.model_copy(update=update)

    async def sandbox_list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        out = list(self._live.values())
        if labels:
            out = [i for i in out if all(i.spec.labels.get(k) == v for k, v in labels.items())]
        return out

    async def sandbox_destroy(self, sandbox_id: str) -> None:
        info = self._need(sandbox_id)
        if info.state == "creating":
            # Destroying under a create would race it (the create may make what destroy
            # just removed, and come back "running"): let it end, then destroy.
            await self._created(sandbox_id)
            if sandbox_id not in self._live:
                return  # the create failed and undid itself: nothing is left to destroy
            info = self._need(sandbox_id)
        if info.state == "destroying":
            raise Conflict(f"sandbox {sandbox_id} is already being destroyed")
        await self._destroy(info, "destroyed")

    async def sandbox_pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze the sandbox and reclaim its memory to swap (see :mod:`corral.node.pause`)."""
        self._check_open()
        self._need(sandbox_id)
        await self.pauser.pause(sandbox_id)
        return await self.sandbox_get(sandbox_id)

    async def sandbox_resume(self, sandbox_id: str, prefetch: bool = False) -> SandboxInfo:
        """Thaw a paused sandbox; its pages come back from swap as they are touched, or with
        ``prefetch`` are all read back at once (returns when the reads are started)."""
        self._check_open()
        self._need(sandbox_id)
        await self.pauser.resume(sandbox_id, prefetch)
        self._touched[sandbox_id] = time.time()
        return await self.sandbox_get(sandbox_id)

    async def sandboxes_pause(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Pause every sandbox with these labels (e.g. a job's) at once; returns those paused."""
        self._check_open()
        if not labels:
            raise InvalidRequest("labels: name at least one label (e.g. job=...) to pause by")
        done = await self.pauser.pause_many(await self.sandbox_list(labels))
        return [await self.sandbox_get(i.id) for i in done if i.id in self._live]

    async def sandboxes_resume(
        self, labels: dict[str, str], prefetch: bool = False
    ) -> list[SandboxInfo]:
        """Resume every paused sandbox with these labels (``prefetch``: as in
        :meth:`sandbox_resume`); returns those resumed."""
        self._check_open()
        if not labels:
            raise InvalidRequest("labels: name at least one label (e.g. job=...) to resume by")
        done = await self.pauser.resume_many(await self.sandbox_list(labels), prefetch)
        now = time.time()
        for i in done:
            self._touched[i.id] = now
        return [await self.sandbox_get(i.id) for i in done if i.id in self._live]

    def _put(self, info: SandboxInfo) -> None:
        """Record a state change of a live sandbox (for the pauser)."""
        cur = self._live.get(info.id)
        if cur is not None and cur.state not in ("creating", "destroying"):
            self._live[info.id] = info
            self.state.put_sandbox(info)

    async def _created(self, sandbox_id: str) -> None:
        """Wait until the sandbox is no longer being created (made, or failed and gone)."""
        while (i := self._live.get(sandbox_id)) is not None and i.state == "creating":
            await asyncio.sleep(0.005)

    async def _destroy(self, info: SandboxInfo, why: str) -> None:
        sid = info.id
        cur = self._live.get(sid)
        if cur is None or cur.state == "destroying":
            # Someone else (the reaper, a user, gc) got there first: a second destroy would
            # release the sandbox's layer references twice, from under its neighbours.
            return
        self._live[sid] = cur.model_copy(update={"state": "destroying"})
        self.pauser.forget(sid)
        # Once started, a destroy runs to its end even if its caller is cancelled (a client
        # that goes away, the reaper stopped by close(), which then waits for it): half a
        # destroy, already marked destroyed, would leak its mounts, cgroups and processes.
        task = asyncio.create_task(self._finish_destroy(cur, why), name=f"destroy-{sid}")
        self._destroys.add(task)
        task.add_done_callback(self._destroys.discard)
        await asyncio.shield(task)

    async def _finish_destroy(self, info: SandboxInfo, why: str) -> None:
        sid = info.id
        with contextlib.suppress(Exception):
            self.security.before_destroy(sid, info.spec.limits.disk)
        try:
            await self.backend.destroy(sid, info.image_info())
        except CorralError as e:
            self.state.add_event(sid, "destroy_error", {"error": e.message[:2000]})
            log.error("%s", e.message)
        finally:
            with contextlib.suppress(Exception):
                await self.network.detach(sid)
            self._live.pop(sid, None)
            self._touched.pop(sid, None)
            self.state.mark_destroyed(sid)
            self.state.add_event(sid, why, {})

    # ------------------------------------------------------------------ exec
    def _prepare(self, info: SandboxInfo, req: ExecRequest) -> dict[str, object]:
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": info.spec.hostname}
        env.update(info.image_env)
        env.update(info.spec.env)
        env.update(req.env)
        uid, gid = self._resolve_user(info.id, req.user)
        if req.user and uid != 0 and "HOME" not in req.env:
            env["HOME"] = "/"
        limit = req.output_limit if req.output_limit is not None else info.spec.limits.output
        return {
            "env": env,
            "cwd": req.cwd or info.spec.workdir,
            "uid": uid,
            "gid": gid,
            "timeout": req.timeout,
            "output_limit": limit,
        }

    def _resolve_user(self, sandbox_id: str, user: str | None) -> tuple[int, int]:
        if not user:
            return 0, 0
        name, _, group = user.partition(":")
        uid = gid = None
        if name.isdigit():
            uid = int(name)
        else:
            for line in self._etc(sandbox_id, "/etc/passwd"):
                f = line.split(":")
                if len(f) >= 4 and f[0] == name:
                    uid, gid = int(f[2]), int(f[3])
                    break
            if uid is None:
                raise InvalidRequest(f"user: no user {name!r} in the sandbox's /etc/passwd")
        if group:
            if group.isdigit():
                gid = int(group)
            else:
                for line in self._etc(sandbox_id, "/etc/group"):
                    f = line.split(":")
                    if len(f) >= 3 and f[0] == group:
                        gid = int(f[2])
                        break
                else:
                    raise InvalidRequest(f"user: no group {group!r} in the sandbox's /etc/group")
        if gid is None:
            gid = uid
        if not (0 <= uid < self.config.id_count and 0 <= gid < self.config.id_count):
            raise InvalidRequest(f"user: ids must be below {self.config.id_count}")
        return uid, gid

    def _etc(self, sandbox_id: str, path: str) -> list[str]:
        try:
            return (
                self.backend.fs(sandbox_id)
                .read(path, length=1 << 20)
                .decode(errors="replace")
                .splitlines()
            )
        except CorralError:
            return []

    def _to_result(self, sid: str, r: InitExit, oom_before: int) -> ExecResult:
        reason = r.reason
        if (live := self._live.get(sid)) is not None:
            # Truncated without being stopped for it (output_limit has its own event).
            cut = reason != "output_limit" and (r.out_trunc or r.err_trunc)
            self.security.after_exec(sid, live.spec.limits.disk, truncated=cut)
        if reason == "signaled" and r.signal == 9 and self._oom_kills(sid) > oom_before:
            reason = "oom"
        if reason not in ("exited", "signaled", "timeout", "oom", "output_limit"):
            raise SandboxError(f"sandbox {sid}: init reported unknown end {reason!r}")
        if reason in ("oom", "output_limit", "timeout"):
            detail: dict[str, object] = {"duration": round(r.duration, 3)}
            if reason == "output_limit":
                detail.update(stdout_bytes=r.out_len, stderr_bytes=r.err_len)
            self.state.add_event(sid, reason, detail)  # type: ignore[arg-type]
        return ExecResult(
            exit_code=r.code if reason == "exited" else None,
            signal=r.signal if reason != "exited" else None,
            stdout=r.stdout,
            stderr=r.stderr,
            stdout_truncated=r.out_trunc,
            stderr_truncated=r.err_trunc,
            duration=r.duration,
            reason=reason,  # type: ignore[arg-type]
        )

    def _oom_kills(self, sid: str) -> int:
        try:
            return self.cgroups.oom_kills(sid)
        except Exception:
            return 0

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        info = self._active(sandbox_id)
        p = self._prepare(info, req)
        before = self._oom_kills(sandbox_id)
        with self._working(sandbox_id):
            async with self._init_errors(sandbox_id, "the exec"):
                r = await self.backend.client(sandbox_id).exec(req.cmd, stdin=req.stdin, **p)  # type: ignore[arg-type]
        return self._to_result(sandbox_id, r, before)

    async def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[ExecChunk | ExecResult]:
        info = self._active(sandbox_id)
        p = self._prepare(info, req)
        before = self._oom_kills(sandbox_id)
        with self._working(sandbox_id):
            stream = self.backend.client(sandbox_id).stream(
                req.cmd,
                stdin_pipe=req.stdin is not None,
                tty=req.tty,
                keep_output=False,
                **p,  # type: ignore[arg-type]
            )
            async with self._init_errors(sandbox_id, "the exec"), stream as s:
                if req.stdin is not None:
                    await s.write(req.stdin)
                    await s.close_stdin()
                async for name, data in s:
                    yield ExecChunk(stream=name, data=data)  # type: ignore[arg-type]
                result = s.result
        yield self._to_result(sandbox_id, result, before)

    def pty(
        self,
        sandbox_id: str,
        cmd: list[str],
        rows: int,
        cols: int,
        env: dict[str, str] | None = None,
    ) -> _BusyStream:
        """An interactive terminal stream (for ``corral sandbox shell``). The sandbox counts
        as busy while it is open, so the idle reaper never takes it from under a user."""
        info = self._active(sandbox_id)
        p = self._prepare(info, ExecRequest(cmd=cmd, env={"TERM": "xterm-256color", **(env or {})}))
        p["output_limit"] = 1 << 40
        stream = self.backend.client(sandbox_id).stream(
            cmd,
            stdin_pipe=True,
            tty=True,
            rows=rows,
            cols=cols,
            keep_output=False,
            **p,  # type: ignore[arg-type]
        )
        return _BusyStream(stream, self._working(sandbox_id))

    async def spawn(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        info = self._active(sandbox_id)
        if req.stdin is not None or req.tty:
            raise InvalidRequest("stdin/tty: background processes get no stdin; use exec_stream")
        p = self._prepare(info, req)
        p.pop("timeout")
        async with self._init_errors(sandbox_id, "spawn"):
            pid_id, pid = await self.backend.client(sandbox_id).spawn(req.cmd, **p)  # type: ignore[arg-type]
        return ProcessInfo(id=pid_id, pid=pid, cmd=req.cmd, running=True)

    async def process_get(
        self, sandbox_id: str, process_id: str, wait: float | None = None
    ) -> ProcessInfo:
        self._active(sandbox_id)
        before = self._oom_kills(sandbox_id)
        with self._working(sandbox_id):
            async with self._init_errors(sandbox_id, "the process wait"):
                p = await self.backend.client(sandbox_id).wait(process_id, timeout=wait or 0)
        result = self._to_result(sandbox_id, p.exit, before) if p.exit else None
        return ProcessInfo(
            id=p.id,
            pid=p.pid,
            cmd=p.argv,
            running=p.running,
            stdout=p.stdout,
            stderr=p.stderr,
            result=result,
        )

    async def process_kill(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        self._active(sandbox_id)
        if not 1 <= signal <= 64:
            raise InvalidRequest(f"signal: {signal} is not a signal number (1-64)")
        async with self._init_errors(sandbox_id, "process kill"):
            await self.backend.client(sandbox_id).kill(process_id, signal)

    async def process_list(self, sandbox_id: str) -> list[ProcessInfo]:
        self._active(sandbox_id)
        async with self._init_errors(sandbox_id, "process list"):
            procs = await self.backend.client(sandbox_id).list()
        return [ProcessInfo(id=p.id, pid=p.pid, cmd=p.argv, running=p.running) for p in procs]

    # ------------------------------------------------------------------ shells
    async def shell_open(
        self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ShellInfo:
        info = self._active(sandbox_id)
        try:
            req = ExecRequest(cmd=["true"], cwd=cwd, env=env or {})  # validates cwd and env
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
        shell_id = _new_id("sh-")
        start = req.cwd or info.spec.workdir
        r = await self.exec(
            sandbox_id, ExecRequest(cmd=shellmod.init_argv(shell_id, start), timeout=30)
        )
        if not r.ok:
            raise SandboxError(
                f"sandbox {sandbox_id}: could not start a shell session (needs bash in the "
                f"image): {r.stderr.decode(errors='replace')[:500]}"
            )
        created = self.state.put_shell(shell_id, sandbox_id, start, req.env)
        return ShellInfo(id=shell_id, cwd=start, created_at=created)

    async def shell_run(
        self,
        sandbox_id: str,
        shell_id: str,
        command: str,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        row = self.state.get_shell(shell_id)
        if row is None or row[0] != sandbox_id:
            raise ProcessNotFound(f"no shell session {shell_id!r} in sandbox {sandbox_id}")
        if "\0" in command:
            raise InvalidRequest("command: cannot contain NUL bytes")
        return await self.exec(
            sandbox_id,
            ExecRequest(
                cmd=shellmod.shell_argv(shell_id, command),
                env=row[2],
                timeout=timeout,
                stdin=stdin,
            ),
        )

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        row = self.state.get_shell(shell_id)
        if row is None or row[0] != sandbox_id:
            raise ProcessNotFound(f"no shell session {shell_id!r} in sandbox {sandbox_id}")
        self.state.delete_shell(shell_id)
        with contextlib.suppress(CorralError):
            await asyncio.to_thread(
                self.backend.fs(sandbox_id).remove, f"{shellmod.STATE_DIR}/{shell_id}"
            )

    # ------------------------------------------------------------------ files
    async def _fs_call(self, sandbox_id: str, method: str, *args: object, **kw: object):  # type: ignore[no-untyped-def]
        self._active(sandbox_id)
        with self._working(sandbox_id):
            fs = self.backend.fs(sandbox_id)
            try:
                return await asyncio.to_thread(getattr(fs, method), *args, **kw)
            except CorralError as e:
                info = self._live.get(sandbox_id)
                if (info is None or info.state == "destroying") and e.status != 400:
                    raise SandboxNotFound(
                        f"sandbox {sandbox_id} was destroyed during file {method}"
                    ) from e
                if e.status == 400:
                    self.state.add_event(
                        sandbox_id, "file_refused", {"op": method, "error": e.message[:500]}
                    )
                raise

    async def file_read(
        self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None
    ) -> bytes:
        return await self._fs_call(sandbox_id, "read", path, offset, length)  # type: ignore[no-any-return]

    async def file_write(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, append: bool = False
    ) -> None:
        await self._fs_call(sandbox_id, "write", path, data, mode=mode, append=append)

    async def file_list(self, sandbox_id: str, path: str) -> list[FileStat]:
        return await self._fs_call(sandbox_id, "list", path)  # type: ignore[no-any-return]

    async def file_stat(self, sandbox_id: str, path: str) -> FileStat:
        return await self._fs_call(sandbox_id, "stat", path)  # type: ignore[no-any-return]

    async def file_remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self._fs_call(sandbox_id, "remove", path, recursive=recursive)

    async def file_mkdir(
        self, sandbox_id: str, path: str, parents: bool = True, mode: int = 0o755
    ) -> None:
        await self._fs_call(sandbox_id, "mkdir", path, parents=parents, mode=mode)

    async def file_upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._fs_call(sandbox_id, "upload_tar", path, data)

    async def file_download_tar(self, sandbox_id: str, path: str) -> bytes:
        return await self._fs_call(sandbox_id, "download_tar", path)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ fncall
    async def fncall_run(self, req: CallRequest) -> CallResult:
        """One short call in a warm pool sandbox (see corral.node.fncall)."""
        return await self.fncall.run(req)

    async def fncall_judge(self, req: JudgeRequest) -> JudgeResult:
        return await self.fncall.judge(req)

    # ------------------------------------------------------------------ events, status
    async def events(
        self,
        sandbox_id: str | None = None,
        since_id: int = 0,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
    ) -> list[Event]:
        self.security.flush()  # denials counted so far are part of the answer
        if sandbox_id is not None:
            await self.sandbox_get(sandbox_id)
            return self.state.events(sandbox_id, since_id, kinds=kinds)
        evs = self.state.events(None, since_id, kinds=kinds)
        if labels:
            ids = set(self.state.sandbox_ids_with_labels(labels))
            evs = [e for e in evs if e.sandbox_id in ids]
        return evs

    async def events_summary(
        self,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        sandbox_id: str | None = None,
    ) -> EventSummary:
        """Occurrences of each event kind per sandbox (live or destroyed) and in total."""
        if sandbox_id is not None:
            await self.sandbox_get(sandbox_id)
        return self.security.summary(self.state, labels, kinds, sandbox_id)

    async def node_status(self) -> NodeStatus:
        import psutil

        from corral import __version__

        vm = psutil.virtual_memory()
        core_ok, core_detail = sched.core_scheduling()
        ckpt_ok, ckpt_detail = await asyncio.to_thread(criu.checkpoint_support)  # cached
        ll_abi, ll_detail = landlock.support()
        return NodeStatus(
            node_id=self.node_id,
            version=__version__,
            runtime=self.runtime.name,
            cgroup_mode=self.cgroups.mode,  # type: ignore[arg-type]
            sandboxes=len(self._live),
            running=sum(1 for i in self._live.values() if i.state == "running"),
            state_dir=str(self.config.state_dir),
            store=str(self.config.store_dir),
            mounted_layers=len(self.layers.mounted()),
            mem_total=vm.total,
            mem_available=vm.available,
            paused=sum(1 for i in self._live.values() if i.state == "paused"),
            swap=self.swap.paths(),
            core_scheduling=core_ok,
            qos_detail=core_detail,
            checkpoint=ckpt_ok,
            checkpoint_detail=ckpt_detail,
            landlock=ll_abi,
            landlock_detail=ll_detail,
        )

    # ------------------------------------------------------------------ gc
    async def gc(self, everything: bool = False) -> dict[str, int]:
        """Remove what a crash left behind; with ``everything``, destroy all sandboxes too."""
        removed = {"sandboxes": 0, "containers": 0, "mounts": 0, "cgroups": 0, "subvols": 0}
        if everything:
            for sid in list(self._live):
                await self._created(sid)
                info = self._live.get(sid)
                if info is not None and info.state != "destroying":
                    await self._destroy(info, "destroyed")
                    removed["sandboxes"] += 1
        live = set(self._live) | self._scratch_work
        for c in await self.runtime.list():
            cid = c.get("id", "")
            if cid and cid not in live:
                await self.backend.kill_all(cid)
                await self.runtime.delete(cid, force=True)
                removed["containers"] += 1
        for m in mounts.mounts_under(self.backend.sandboxes_dir):
            # Only sandbox rootfs mounts (DIR/<id>/rootfs): DIR itself is the scratch mount.
            if m.parent.parent == self.backend.sandboxes_dir and m.parent.name not in live:
                mounts.umount(m, detach=True)
                removed["mounts"] += 1
        for name in self.cgroups.list():
            if name not in live:
                # Processes of no known container (a create cut short) would keep it busy.
                await self.backend.kill_all(name)
                self.cgroups.remove(name)
                removed["cgroups"] += 1
        for name in self.scratch.subvols():
            if name not in live:
                self.scratch.delete_subvol(name)
                removed["subvols"] += 1
        if self.backend.sandboxes_dir.exists():
            for d in self.backend.sandboxes_dir.iterdir():
                if d.name not in live:
                    try:
                        remove_sandbox_dir(d)
                    except OSError as e:
                        # Kept, not forced: it may hold guest data (an unmounted rootfs).
                        log.warning("gc: sandbox dir %s left in place: %s", d, e.strerror)
        removed["networks"] = await self.network.gc(set(self._live))
        # A stale seccomp fd holder is ended and replaced (its ping may wait up to 2 s).
        await asyncio.to_thread(self.security.gc, set(self._live))
        if everything or not live:
            await self._teardown_shared()
            # The scratch fs and layer mounts come back on the next use of this node.
            await asyncio.to_thread(self.scratch.setup)
            await asyncio.to_thread(self.swap.setup)  # removed with the rest; close removes it
            await asyncio.to_thread(_install_init, self.config)
        self.state.add_event(None, "gc", removed)  # type: ignore[arg-type]
        return removed

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise Conflict("this node has been closed")

    def _need(self, sandbox_id: str) -> SandboxInfo:
        info = self._live.get(sandbox_id)
        if info is None:
            old = self.state.get_sandbox(sandbox_id) if _plausible_id(sandbox_id) else None
            if old is not None:
                raise SandboxNotFound(f"sandbox {sandbox_id} is {old.state}")
            raise SandboxNotFound(f"no sandbox {_shown(sandbox_id)} on node {self.node_id}")
        return info

    def _active(self, sandbox_id: str) -> SandboxInfo:
        self._check_open()
        info = self._need(sandbox_id)
        if info.state in ("pausing", "paused", "resuming"):
            info = self.pauser.wake(sandbox_id)  # transparent resume
        if info.state not in ("running", "resuming") and not self.pauser.held(sandbox_id):
            # resuming: the pause being stopped thaws it in a moment; the request waits
            raise Conflict(f"sandbox {sandbox_id} is {info.state}, not running")
        self._touched[sandbox_id] = time.time()
        return info

    @contextlib.asynccontextmanager
    async def _init_errors(self, sandbox_id: str, what: str):  # type: ignore[no-untyped-def]
        """Say why an init connection broke: the sandbox was destroyed meanwhile, or its
        init died (the reaper then cleans it up). Other init errors pass unchanged."""
        try:
            yield
        except SandboxError as e:
            for _ in range(5):
                info = self._live.get(sandbox_id)
                if info is None or info.state == "destroying":
                    raise SandboxNotFound(
                        f"sandbox {sandbox_id} was destroyed while {what} was running"
                    ) from e
                if not self.backend.alive(sandbox_id):
                    raise SandboxError(
                        f"sandbox {sandbox_id} has stopped: its init is not running any more "
                        f"({what} failed; the node cleans the sandbox up)"
                    ) from e
                # An init that closed our connection may still be exiting: look again.
                await asyncio.sleep(0.01)
            raise

    @contextlib.contextmanager
    def _working(self, sandbox_id: str):  # type: ignore[no-untyped-def]
        """Marks a request in flight, so the idle reaper never takes a busy sandbox."""
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        try:
            yield
        finally:
            self._touched[sandbox_id] = time.time()
            n = self._busy.get(sandbox_id, 1) - 1
            if n:
                self._busy[sandbox_id] = n
            else:
                self._busy.pop(sandbox_id, None)

    def _background(self, job: Any, name: str) -> None:
        """Run ``job`` (a coroutine) as a task the node keeps a reference to; failures are
        logged (the reaper's idle pauses)."""

        async def run() -> None:
            try:
                await job
            except CorralError as e:
                log.warning("%s: %s", name, e.message)
            except Exception:
                log.exception("%s failed", name)

        task = asyncio.create_task(run(), name=name)
        self._destroys.add(task)
        task.add_done_callback(self._destroys.discard)

    def _flush_touches(self) -> None:
        if self._touched:
            self.state.touch_many(self._touched)
            for sid, t in self._touched.items():
                if sid in self._live:
                    self._live[sid] = self._live[sid].model_copy(update={"last_active_at": t})
            self._touched.clear()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reaper_interval)
            try:
                await self.reap_once()
            except Exception:
                log.exception("reaper pass failed")

    async def reap_once(self) -> None:
        self._flush_touches()
        self.state.trim_events(self.config.event_retention)
        self.security.flush()
        now = time.time()
        for sid in list(self._live):
            info = self._live.get(sid)  # as it is now: an earlier destroy here awaited
            if info is not None and info.state == "paused":
                if info.expires_at and now >= info.expires_at:
                    await self._destroy(info, "ttl_expired")
                continue  # idle_timeout spares a paused sandbox: pausing is how it is kept
            if info is None or info.state != "running" or sid in self._busy:
                continue
            if info.expires_at and now >= info.expires_at:
                await self._destroy(info, "ttl_expired")
            elif info.spec.idle_pause and now - info.last_active_at >= info.spec.idle_pause:
                self._background(self.pauser.pause(sid), f"idle-pause-{sid}")
            elif info.spec.idle_timeout and now - info.last_active_at >= info.spec.idle_timeout:
                await self._destroy(info, "idle_timeout")
            elif not self.backend.alive(info.id):
                self.state.add_event(info.id, "died", {})
                await self._destroy(info, "destroyed")


def _check_fits(spec: SandboxSpec, cfg: NodeConfig) -> None:
    """Refuse limits no sandbox of this node can have: past them the kernel would wrap the
    number (a btrfs quota is a u64, the OCI memory limit an int64) or ignore it."""
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if spec.limits.memory > mem:
        raise InvalidRequest(
            f"limits.memory: {spec.limits.memory} bytes is more than this node's memory "
            f"({mem} bytes)"
        )
    if spec.limits.disk > cfg.scratch_size:
        raise InvalidRequest(
            f"limits.disk: {spec.limits.disk} bytes is more than this node's scratch "
            f"filesystem ({cfg.scratch_size} bytes)"
        )


def _shown(sandbox_id: str) -> str:
    """An id as quoted in an error: a caller's 20,000-character id is not echoed whole."""
    return repr(sandbox_id) if len(sandbox_id) <= 80 else repr(sandbox_id[:80]) + "..."


class _BusyStream:
    """Wraps an init ExecStream and holds a sandbox's busy mark while the block is open."""

    def __init__(self, stream: Any, busy: contextlib.AbstractContextManager[None]) -> None:
        self._stream = stream
        self._busy = busy

    async def __aenter__(self) -> Any:
        self._busy.__enter__()
        try:
            return await self._stream.__aenter__()
        except BaseException:
            self._busy.__exit__(None, None, None)
            raise

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self._stream.__aexit__(*exc)
        finally:
            self._busy.__exit__(None, None, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _plausible_id(sandbox_id: str) -> bool:
    return sandbox_id.startswith("sb-") and len(sandbox_id) <= 64


def _eager_resolver(store: LayerStore, local: Path):  # type: ignore[no-untyped-def]
    """Benchmark baseline: copy a layer to node-local disk before its first mount."""
    import shutil

    local.mkdir(parents=True, exist_ok=True)

    def resolve(digest: str) -> Path:
        dst = local / (digest.split(":", 1)[1] + ".erofs")
        if not dst.exists():
            tmp = dst.with_suffix(".tmp")
            shutil.copyfile(store.path_of(digest), tmp)
            os.replace(tmp, dst)
        return dst

    return resolve
