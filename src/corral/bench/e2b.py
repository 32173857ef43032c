"""``corral bench e2b``: what speaking E2B costs, against corral's own SDK in the same run.

One node, one HTTP server on 127.0.0.1 (the E2B gateway in front of the API app, as a
user runs it). ``count`` creates, then ``count`` round trips of ``true`` in one sandbox,
both over HTTP to that server, the two sides taking turns one operation each (so drift of
a shared machine falls on both alike):

- E2B: the ``e2b`` SDK's ``AsyncSandbox.create(image)`` (which also adds E2B's default
  ``user`` account) and ``commands.run("true")`` (``bash -l -c true`` as that user, a
  Connect server stream);
- native: corral's ``AsyncClient`` ``sandboxes.create`` and ``Sandbox.exec(["true"])``,
  and ``exec(["/bin/bash", "-l", "-c", "true"])``: the work E2B's run asks
  for, so ``run_overhead_ms`` (E2B's run minus that) is what the protocol costs.

``ports``: ``count`` GETs of a 1 KiB file from ``python3 -m http.server`` in a sandbox,
through the port proxy in process (ASGI, no socket to the node), taking turns: ``direct``
(the node's socket in the sandbox's network namespace) against ``exec_relay`` (the
fallback, one exec of bash's ``/dev/tcp`` per request). Skipped for an image without
python3.

The image must have bash (E2B runs every command through ``/bin/bash -l -c``): the
built-in ``debian`` image has it, ``busybox`` has not.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from corral.bench.scenarios import BenchOptions, Timing, header, prepared, say
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
        token = secrets.token_hex(16)
        async with AsyncClient(config=opts.node_config(count * 2)) as embedded:
            ops = await embedded._get_ops()
            async with NodeServer(ops, host="127.0.0.1", port=0, token=token) as srv:
                os.environ.update(
                    E2B_API_URL=srv.address, E2B_SANDBOX_URL=srv.address, E2B_API_KEY=token
                )
                async with AsyncClient(srv.address, token=token) as native:
                    out.update(await _both(native, AsyncSandbox, p.image.info.name, count))
                    out["ports"] = await _ports(ops, token, native, p.image.info.name, count)
    out["create_overhead_pct"] = round(
        100 * (out["create_p50_ms"] / out["native"]["create_p50_ms"] - 1), 1
    )
    # the protocol's cost: E2B's run against corral running the same login bash
    out["run_overhead_ms"] = round(out["run_p50_ms"] - out["native"]["exec_bash_p50_ms"], 3)
    return out


async def _ports(ops: Any, token: str, client: Any, image: str, count: int) -> dict[str, Any]:
    import asyncio

    import httpx

    from corral.integrations.e2b._ports import PortProxy

    sb = await client.sandboxes.create(image=image, labels={"corral-bench": "e2b"})
    try:
        if not (await sb.exec(["sh", "-c", "command -v python3"], timeout=60)).ok:
            return {"skipped": f"image {image} has no python3 for a test server"}
        await sb.files.write("/tmp/www/f", b"x" * 1024)
        await sb.spawn(["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1",
                        "--directory", "/tmp/www"])  # fmt: skip
        direct, relay = PortProxy(ops, token), PortProxy(ops, token)
        relay.link = None  # the fallback path
        path, headers = f"/sandboxes/{sb.id}/ports/8000/f", {"X-API-KEY": token}
        async with (
            httpx.AsyncClient(transport=httpx.ASGITransport(direct), base_url="http://n") as d,
            httpx.AsyncClient(transport=httpx.ASGITransport(relay), base_url="http://n") as r,
        ):
            for _ in range(600):  # readiness: the server answers once it listens
                if (await d.get(path, headers=headers)).status_code == 200:
                    break
                await asyncio.sleep(0.05)

            def get(c: httpx.AsyncClient) -> Callable[[], Awaitable[object]]:
                async def op() -> None:
                    resp = await c.get(path, headers=headers)
                    if resp.status_code != 200 or len(resp.content) != 1024:
                        raise SandboxError(f"port GET: {resp.status_code} {resp.text[:200]}")

                return op

            say(f"{count} GETs through the port proxy each way, taking turns")
            ds, rs = _Side(), _Side()
            for _ in range(count):
                await ds.timed(get(d))
                await rs.timed(get(r))
        a, b = ds.figures(), rs.figures()
        return {
            "direct_p50_ms": a["p50_ms"],
            "direct_p99_ms": a["p99_ms"],
            "exec_relay_p50_ms": b["p50_ms"],
            "exec_relay_p99_ms": b["p99_ms"],
            "errors": a["errors"] + b["errors"],
        }
    finally:
        await sb.destroy()


class _Side:
    def __init__(self) -> None:
        self.lat: list[float] = []
        self.errors: list[str] = []
        self.t0 = time.perf_counter()

    async def timed(self, op: Callable[[], Awaitable[object]]) -> None:
        t0 = time.perf_counter()
        try:
            await op()
        except Exception as e:  # counted, not fatal to the run
            self.errors.append(f"{type(e).__name__}: {e}")
            return
        self.lat.append(time.perf_counter() - t0)

    def figures(self) -> dict[str, Any]:
        t = Timing(self.lat, time.perf_counter() - self.t0, self.errors)
        return t.figures(per_s=False)


async def _both(client: Any, sandbox_cls: Any, image: str, count: int) -> dict[str, Any]:
    img = await client.images.get(image)
    natives: list[Any] = []
    e2bs: list[Any] = []

    async def native_create() -> None:
        natives.append(await client.sandboxes.create(image=img, labels={"corral-bench": "e2b"}))

    async def e2b_create() -> None:
        e2bs.append(await sandbox_cls.create(image, metadata={"corral-bench": "e2b"}))

    async def native_true() -> None:
        r = await natives[0].exec(["true"], timeout=60)
        if not r.ok:
            raise SandboxError(f"`true` ended {r.reason}")

    async def native_bash() -> None:
        # the same work commands.run("true") asks for, a login bash (as root here: the
        # native sandbox has no E2B account)
        r = await natives[0].exec(["/bin/bash", "-l", "-c", "true"], timeout=60)
        if not r.ok:
            raise SandboxError(f"`bash -l -c true` ended {r.reason}: {r.stderr[:200]!r}")

    async def e2b_true() -> None:
        r = await e2bs[0].commands.run("true")
        if r.exit_code != 0:
            raise SandboxError(f"`true` over E2B exited {r.exit_code}")

    nc, ec, nx, ex, nb = _Side(), _Side(), _Side(), _Side(), _Side()
    try:
        say(f"{count} creates each, taking turns")
        for _ in range(count):
            await nc.timed(native_create)
            await ec.timed(e2b_create)
        if not natives or not e2bs:
            raise CorralError(f"creates failed: {(nc.errors + ec.errors)[:1]}")
        for _ in range(3):
            await native_true()
            await e2b_true()
        say(f"{count} round trips of true each, taking turns")
        for _ in range(count):
            await nx.timed(native_true)
            await ex.timed(e2b_true)
            await nb.timed(native_bash)
    finally:
        for sb in natives:
            await sb.destroy()
        for sb in e2bs:
            await sb.kill()
    c, e, n_c, n_e, n_b = ec.figures(), ex.figures(), nc.figures(), nx.figures(), nb.figures()
    return {
        "create_p50_ms": c["p50_ms"],
        "create_p99_ms": c["p99_ms"],
        "run_p50_ms": e["p50_ms"],
        "run_p99_ms": e["p99_ms"],
        "errors": c["errors"] + e["errors"],
        "native": {
            "create_p50_ms": n_c["p50_ms"],
            "create_p99_ms": n_c["p99_ms"],
            "exec_p50_ms": n_e["p50_ms"],
            "exec_p99_ms": n_e["p99_ms"],
            "exec_bash_p50_ms": n_b["p50_ms"],
            "errors": n_c["errors"] + n_e["errors"] + n_b["errors"],
        },
    }
