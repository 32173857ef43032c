"""``corral bench e2b``: what speaking E2B costs, against corral's own SDK in the same run.

One node, one HTTP server on 127.0.0.1 (the E2B gateway in front of the API app, as a
user runs it). Each side does ``count`` creates then ``count`` round trips of ``true`` in
one sandbox, one after another, both over HTTP to that server:

- E2B: the ``e2b`` SDK's ``AsyncSandbox.create(image)`` (which also adds E2B's default
  ``user`` account) and ``commands.run("true")`` (``bash -l -c true`` as that user, a
  Connect server stream);
- native: corral's ``AsyncClient`` ``sandboxes.create`` and ``Sandbox.exec(["true"])``.

The image must have bash (E2B runs every command through ``/bin/bash -l -c``): the
built-in ``debian`` image has it, ``busybox`` has not.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

from corral.bench.scenarios import BenchOptions, Timing, header, many, prepared, say
from corral.errors import CorralError, SandboxError

__all__ = ["e2b"]


async def e2b(opts: BenchOptions, count: int) -> dict[str, Any]:
    try:
        from e2b import AsyncSandbox
    except ImportError:
        raise CorralError(
            "corral bench e2b needs the e2b package: pip install 'corral[e2b]'"
        ) from None
    from corral.api.server import NodeServer
    from corral.sdk import AsyncClient

    async with prepared(opts) as p:
        out = header("e2b", p, count=count)
        image = p.image.info.name
        token = secrets.token_hex(16)
        async with AsyncClient(config=opts.node_config(count)) as embedded:
            ops = await embedded._get_ops()
            async with NodeServer(ops, host="127.0.0.1", port=0, token=token) as srv:
                os.environ.update(
                    E2B_API_URL=srv.address, E2B_SANDBOX_URL=srv.address, E2B_API_KEY=token
                )
                async with AsyncClient(srv.address, token=token) as native:
                    out["native"] = await _native(native, image, count)
                out.update(await _e2b(AsyncSandbox, image, count))
    out["create_overhead_pct"] = round(
        100 * (out["create_p50_ms"] / out["native"]["create_p50_ms"] - 1), 1
    )
    out["run_overhead_ms"] = round(out["run_p50_ms"] - out["native"]["exec_p50_ms"], 3)
    return out


async def _timed(count: int, op: Any) -> Timing:
    return await many(count, 1, op)


async def _native(client: Any, image: str, count: int) -> dict[str, Any]:
    img = await client.images.get(image)
    made: list[Any] = []

    async def create(i: int) -> None:
        made.append(await client.sandboxes.create(image=img, labels={"corral-bench": "e2b"}))

    async def true(i: int) -> None:
        r = await made[0].exec(["true"], timeout=60)
        if not r.ok:
            raise SandboxError(f"`true` ended {r.reason}")

    try:
        say(f"native: {count} creates")
        tc = await _timed(count, create)
        for _ in range(3):
            await true(-1)
        say(f"native: {count} execs of true")
        te = await _timed(count, true)
    finally:
        for sb in made:
            await sb.destroy()
    c, e = tc.figures(per_s=False), te.figures(per_s=False)
    return {
        "create_p50_ms": c["p50_ms"],
        "create_p99_ms": c["p99_ms"],
        "exec_p50_ms": e["p50_ms"],
        "exec_p99_ms": e["p99_ms"],
        "errors": c["errors"] + e["errors"],
    }


async def _e2b(sandbox_cls: Any, image: str, count: int) -> dict[str, Any]:
    made: list[Any] = []

    async def create(i: int) -> None:
        made.append(await sandbox_cls.create(image, metadata={"corral-bench": "e2b"}))

    async def true(i: int) -> None:
        r = await made[0].commands.run("true")
        if r.exit_code != 0:
            raise SandboxError(f"`true` over E2B exited {r.exit_code}")

    t0 = time.perf_counter()
    try:
        say(f"e2b: {count} creates")
        tc = await _timed(count, create)
        for _ in range(3):
            await true(-1)
        say(f"e2b: {count} commands.run('true')")
        te = await _timed(count, true)
    finally:
        for sb in made:
            await sb.kill()
    c, e = tc.figures(per_s=False), te.figures(per_s=False)
    return {
        "create_p50_ms": c["p50_ms"],
        "create_p99_ms": c["p99_ms"],
        "run_p50_ms": e["p50_ms"],
        "run_p99_ms": e["p99_ms"],
        "errors": c["errors"] + e["errors"],
        "e2b_wall_s": round(time.perf_counter() - t0, 3),
    }
