"""fncall pools: warm sandboxes per image serving short calls (``Node.fncall_run/judge``).

A pool sandbox is a normal corral sandbox (``Node.sandbox_create``) with a read-only root
filesystem, scratch tmpfs mounts (/tmp, /var/tmp, /work) and a warm worker
(``corral.backends.fncall.worker``). Each pool keeps ``size`` sandboxes idle, refilled in
the background, and grows on demand up to ``max_size``. A sandbox goes back to the pool
only when the kernel says it is clean (``PoolSandbox.call``: no process of the call left,
scratch empty) and its worker lives; otherwise it is destroyed and replaced, never handed
out again.

Example:
    r = await node.fncall_run(CallRequest(language="python", code="print(6*7)"))
    assert r.status == "ok" and r.stdout == "42\\n"
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import TYPE_CHECKING, Any

from corral.backends.fncall.checkers import judged
from corral.backends.fncall.config import SETUP_IMAGE, FnCallConfig, LanguageConfig, PoolConfig
from corral.backends.fncall.sandbox import Measured, PoolSandbox
from corral.errors import CorralError, ImageNotFound, InvalidRequest, SandboxError
from corral.spec import (
    CallLimits,
    CallRequest,
    CallResult,
    CustomChecker,
    JudgeRequest,
    JudgeResult,
    Limits,
    SandboxSpec,
)

if TYPE_CHECKING:
    from corral.node.node import Node

__all__ = ["FnCallService", "POOL_LABEL"]

log = logging.getLogger("corral.fncall")

POOL_LABEL = "corral.fncall"
"""Label of every pool sandbox (value: ``pool``)."""
_SCRATCH = ("/tmp", "/var/tmp", "/work")
_WORKER_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}


class _Pool:
    def __init__(self, service: FnCallService, cfg: PoolConfig) -> None:
        self.service = service
        self.cfg = cfg
        self.idle: list[PoolSandbox] = []
        self.total = 0  # idle + busy + being created
        self.creating = 0
        self.waiting = 0
        self.failures = 0
        self.last_error: str | None = None
        self.cond = asyncio.Condition()

    def refill(self) -> None:
        want = max(self.cfg.size, self.waiting)
        while (
            len(self.idle) + self.creating < want
            and self.total < self.cfg.max_size
            and not self.service.closed
        ):
            self.total += 1
            self.creating += 1
            self.service.background(self._create())

    async def _create(self) -> None:
        try:
            if self.failures:
                # Back off: a broken image must not turn into a create storm.
                await asyncio.sleep(min(5.0, 0.1 * 2**self.failures))
            ps = await self.service.make_sandbox(self.cfg)
        except Exception as e:
            self.failures = min(self.failures + 1, 6)
            self.last_error = str(e)[:1000]
            log.warning("fncall pool %s: could not make a sandbox: %s", self.cfg.image, e)
            async with self.cond:
                self.total -= 1
                self.creating -= 1
                self.cond.notify_all()
            return
        self.failures = 0
        self.last_error = None
        async with self.cond:
            self.creating -= 1
            ps.idle_since = time.monotonic()
            self.idle.append(ps)
            self.cond.notify_all()
        if self.service.closed:
            await self.discard(ps)

    async def acquire(self) -> PoolSandbox:
        async with self.cond:
            self.waiting += 1
            failed = False
            try:
                while True:
                    while self.idle:
                        ps = self.idle.pop()
                        if ps.alive():
                            return ps
                        self.total -= 1
                        self.service.background(self.service.destroy(ps))
                    if self.service.closed:
                        raise CorralError("the node is closing; fncall pools are stopped")
                    if self.last_error is None:
                        self.refill()
                    elif self.creating == 0 and self.total == 0:
                        # The last round of creates failed and nothing is coming: say why.
                        # The next acquire tries again (after a backoff).
                        failed = True
                        err, self.last_error = self.last_error, None
                        raise SandboxError(
                            f"fncall pool for {self.cfg.image} cannot make sandboxes: {err}"
                        )
                    await self.cond.wait()
            finally:
                self.waiting -= 1
                if not failed and self.last_error is None:
                    self.refill()

    async def release(self, ps: PoolSandbox, clean: bool) -> None:
        if clean and not ps.dead and not self.service.closed:
            async with self.cond:
                ps.idle_since = time.monotonic()
                self.idle.append(ps)
                self.cond.notify()
            return
        await self.discard(ps)

    async def trim(self, idle_for: float) -> None:
        """Shrink back to ``size``: destroy sandboxes above it idle for ``idle_for`` s."""
        now = time.monotonic()
        async with self.cond:
            # idle is used last-in first-out, so the longest idle come first.
            extra = len(self.idle) - self.cfg.size
            old = [ps for ps in self.idle[: max(extra, 0)] if now - ps.idle_since >= idle_for]
            for ps in old:
                self.idle.remove(ps)
                self.total -= 1
        for ps in old:
            self.service.background(self.service.destroy(ps))

    async def discard(self, ps: PoolSandbox) -> None:
        self.service.recycled += 1
        async with self.cond:
            if ps in self.idle:
                self.idle.remove(ps)
            self.total -= 1
            self.refill()
        self.service.background(self.service.destroy(ps))


class FnCallService:
    """Every fncall pool of one node."""

    def __init__(self, node: Node, config: FnCallConfig) -> None:
        self.node = node
        self.config = config
        self.pools: dict[str, _Pool] = {}
        self.closed = False
        self.recycled = 0
        """Pool sandboxes destroyed because they were dirty or dead (tests read this)."""
        self.requests: dict[str, int] = {"build": 0, "run": 0}
        """Worker requests sent, by kind."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sandboxes: set[PoolSandbox] = set()
        self._trimmer: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Destroy pool sandboxes of an earlier run (their workers died with its
        connections) and start filling the configured pools in the background."""
        for info in await self.node.sandbox_list({POOL_LABEL: "pool"}):
            with contextlib.suppress(CorralError):
                await self.node.sandbox_destroy(info.id)
        for p in self.config.pools:
            self.pools[p.image] = pool = _Pool(self, p)
            pool.refill()
        self._trimmer = asyncio.get_running_loop().create_task(
            self._trim_forever(), name="fncall-trim"
        )

    async def _trim_forever(self) -> None:
        every = min(5.0, self.config.idle_trim / 2)
        while not self.closed:
            await asyncio.sleep(every)
            for pool in list(self.pools.values()):
                try:
                    await pool.trim(self.config.idle_trim)
                except Exception:
                    log.exception("fncall: trimming the pool of %s failed", pool.cfg.image)

    async def close(self) -> None:
        self.closed = True
        if self._trimmer is not None:
            self._trimmer.cancel()
            with contextlib.suppress(BaseException):
                await self._trimmer
        for pool in self.pools.values():
            async with pool.cond:
                pool.cond.notify_all()
        for t in list(self._tasks):
            if not t.done():
                with contextlib.suppress(BaseException):
                    await t
        for ps in list(self._sandboxes):
            await self.destroy(ps)

    def background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def make_sandbox(self, cfg: PoolConfig) -> PoolSandbox:
        fc = self.config
        spec = SandboxSpec(
            image=cfg.image,
            limits=Limits(cpus=1.0, memory=fc.memory + (256 << 20), pids=fc.pids),
            labels={POOL_LABEL: "pool"},
            readonly_rootfs=True,
            tmpfs={d: fc.scratch for d in _SCRATCH},
            hostname="fncall",
            qos=fc.qos,
        )
        info = await self.node.sandbox_create(spec)
        dirs = [*_SCRATCH, "/dev/shm"]
        ps = PoolSandbox(
            info.id,
            cfg.image,
            self.node.backend_of(info.id).agent(info.id),
            self.node.cgroups,
            info.pid or 0,
            dirs,
        )
        self._sandboxes.add(ps)
        langs = {
            name: lang.model_dump()
            for name, lang in fc.languages.items()
            if cfg.languages is None or name in cfg.languages
        }
        worker_cfg = {
            "uid": fc.call_uid,
            "gid": fc.call_uid,
            "dirs": [*dirs, "/dev/mqueue"],
            "workdir": fc.workdir,
            "languages": langs,
            "preimport": cfg.preimport,
            "env": {
                "PATH": _WORKER_ENV["PATH"],
                "HOME": fc.workdir,
                "TMPDIR": "/tmp",
                "LANG": "C.UTF-8",
            },
        }
        env = dict(_WORKER_ENV, **info.image_env)
        try:
            await ps.start(env, worker_cfg)
        except BaseException:
            await self.destroy(ps)
            raise
        return ps

    async def destroy(self, ps: PoolSandbox) -> None:
        self._sandboxes.discard(ps)
        await ps.close()
        with contextlib.suppress(CorralError):
            await self.node.sandbox_destroy(ps.sid)

    def _pool(self, image: str | None) -> _Pool:
        name = image or self.config.default_image or SETUP_IMAGE
        pool = self.pools.get(name)
        if pool is None:
            try:
                self.node.store.image(name)  # ImageNotFound now, not at the first create
            except ImageNotFound:
                if name != SETUP_IMAGE or image:
                    raise
                raise InvalidRequest(
                    "image: no image given, the node has no fncall.default_image configured "
                    f"and its store has no {SETUP_IMAGE}: build that once with `corral "
                    "fncall setup` on the node's host (Debian with python3, gcc and g++; about a "
                    "minute, then cached in the store), or pass image=..."
                ) from None
            cfg = PoolConfig(image=name, size=self.config.on_demand_size)
            pool = self.pools[name] = _Pool(self, cfg)
        return pool

    def _language(self, pool: _Pool, name: str) -> LanguageConfig:
        allowed = pool.cfg.languages
        lang = self.config.languages.get(name)
        if lang is None or (allowed is not None and name not in allowed):
            names = sorted(n for n in self.config.languages if allowed is None or n in allowed)
            raise InvalidRequest(
                f"language: {name!r} is not served by the pool of {pool.cfg.image} "
                f"(languages: {', '.join(names)})"
            )
        return lang

    # ---------------------------------------------------------------- calls
    async def run(self, req: CallRequest) -> CallResult:
        if self.closed:
            raise CorralError("the node is closing; fncall pools are stopped")
        pool = self._pool(req.image)
        lang = self._language(pool, req.language)
        ps = await pool.acquire()
        clean = False
        try:
            if lang.compile:
                built, clean = await self._call(ps, "build", req.language, req.code, "", None)
                if built.status != "ok":
                    return built
            result, clean = await self._call(
                ps, "run", req.language, req.code, req.stdin, req.limits
            )
            return result
        finally:
            await pool.release(ps, clean)

    async def judge(self, req: JudgeRequest) -> JudgeResult:
        if self.closed:
            raise CorralError("the node is closing; fncall pools are stopped")
        pool = self._pool(req.image)
        lang = self._language(pool, req.language)
        if isinstance(req.checker, CustomChecker):
            self._language(pool, req.checker.language)
        compiled: CallResult | None = None
        results: list[CallResult] = []
        ps: PoolSandbox | None = None
        clean = False
        try:
            for case in req.tests:
                if ps is None:
                    ps = await pool.acquire()
                    if lang.compile:
                        # Compile once per sandbox (once per judge unless one got dirty).
                        compiled, clean = await self._call(
                            ps, "build", req.language, req.code, "", None
                        )
                        if compiled.status != "ok":
                            return JudgeResult(verdict="CE", compile=compiled)
                r, clean = await self._call(
                    ps, "run", req.language, req.code, case.stdin, req.limits
                )
                results.append(r)
                if not clean:
                    await pool.release(ps, False)
                    ps = None
                if req.stop_on_failure and r.status != "ok":
                    break
        finally:
            if ps is not None:
                await pool.release(ps, clean)
        # Checkers run after the submission's sandbox is back: a custom checker is a call
        # of its own, in another sandbox the submission never touched.
        out = await judged(req, results, self.run)
        return out.model_copy(update={"compile": compiled})

    async def _call(
        self,
        ps: PoolSandbox,
        op: str,
        language: str,
        code: str,
        stdin: str,
        limits: CallLimits | None,
    ) -> tuple[CallResult, bool]:
        """One worker request, turned into a CallResult; and whether the sandbox may be
        handed out again."""
        lim = limits or self.config.compile_limits
        header = {
            "op": op,
            "language": language,
            "limits": {
                "cpu": lim.cpu_time,
                "wall": lim.wall_time,
                "output": lim.output,
                "fsize": lim.file_size,
                "nproc": lim.processes,
            },
        }
        start = time.monotonic()
        self.requests[op] += 1
        try:
            ps.set_memory(lim.memory)
            m = await ps.call(header, code.encode(), stdin.encode(), lim.wall_time)
        except CorralError as e:
            # The worker or the sandbox died, or did not answer: the sandbox is recycled;
            # the call's verdict says what the node saw.
            wall = time.monotonic() - start
            status = "timeout" if wall >= lim.wall_time else "runtime_error"
            return (
                CallResult(status=status, stderr=f"corral: {e.message}", wall_time=round(wall, 6)),
                False,
            )
        try:
            result = _result(m, lim, op)
        except SandboxError as e:
            return CallResult(status="runtime_error", stderr=f"corral: {e.message}"), False
        clean = m.clean or await ps.wait_clean()
        return result, clean


def _result(m: Measured, lim: CallLimits, op: str) -> CallResult:
    rep = m.reply
    st = rep.get("status")
    if st == "error":
        raise SandboxError(f"fncall worker error: {m.stderr.decode(errors='replace')[:2000]}")
    code, sig = rep.get("code"), rep.get("signal")
    if m.oom:
        status = "memory_limit"
    elif st == "output_limit":
        status = "output_limit"
    elif st == "timeout":
        status = "timeout"
    # SIGXCPU: RLIMIT_CPU's soft limit; SIGKILL past the hard one (a call that ignored
    # SIGXCPU). The cgroup's figure reads below the process's own CPU clock on this VM
    # (~0.8 s at 1 s), hence the margin.
    elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and m.cpu_time >= 0.75 * lim.cpu_time):
        status = "timeout"
    elif st == "exited" and code == 0:
        status = "ok"
    else:
        status = "runtime_error"
    if op == "build" and status != "ok":
        status = "compile_error"
    return CallResult(
        status=status,  # type: ignore[arg-type]
        stdout=m.stdout.decode(errors="replace"),
        stderr=m.stderr.decode(errors="replace"),
        exit_code=code,
        signal=sig,
        cpu_time=round(m.cpu_time, 6),
        wall_time=round(float(rep.get("wall", 0.0)), 6),
        peak_memory=m.peak_memory,
        stdout_truncated=bool(rep.get("out_trunc")),
        stderr_truncated=bool(rep.get("err_trunc")),
    )
