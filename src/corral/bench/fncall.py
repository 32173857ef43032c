"""``corral bench fncall``: isolated Python calls per second from a warm pool, measured
in the same run against (a) a fresh corral container per call and (b) a plain fresh
``python3`` process per call without any isolation.

The call is a trivial program (``print(1)``). The pool has ``concurrency`` sandboxes,
warm before timing starts. Each side runs ``count`` calls with ``concurrency`` in flight
(the per-call-container side runs ``min(count, 100)``: it is two orders of magnitude
slower, and its rate does not depend on the count).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from typing import Any

from corral.backends.fncall.config import FnCallConfig, PoolConfig
from corral.bench.scenarios import BenchOptions, header, many, prepared, say
from corral.errors import CorralError, ImageNotFound, SandboxError
from corral.images.store import LayerStore
from corral.sdk import AsyncClient

__all__ = ["fncall"]

PYTHON = "bench/python"
"""The built-in image of this scenario: Debian minbase + python3, built once."""
CODE = "print(1)"


def _ensure_python_image(opts: BenchOptions) -> str:
    if opts.image not in ("debian", "python"):
        return opts.image
    store = LayerStore(opts.store_dir)
    with contextlib.suppress(ImageNotFound):
        store.image(PYTHON)
        return PYTHON
    from corral.images import build

    say(f"building {PYTHON} (Debian minbase + python3) once into {store.root}")
    layer = build.build_debian(store, include=["python3"])
    store.put_image(PYTHON, [layer.digest])
    return PYTHON


def _host_python() -> str:
    """The host's system python3 (a version manager's ``python3`` on PATH may be a shell
    shim that costs more than the interpreter itself); else this interpreter."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    return sys.executable


async def fncall(opts: BenchOptions, count: int, concurrency: int) -> dict[str, Any]:
    image = await asyncio.to_thread(_ensure_python_image, opts)
    opts = BenchOptions(**{**opts.__dict__, "image": image})
    async with prepared(opts) as p:
        out = header("fncall", p, count=count, concurrency=concurrency)
        pools = FnCallConfig(
            default_image=image,
            pools=[PoolConfig(image=image, size=concurrency, max_size=concurrency)],
        )
        cfg = opts.node_config(count).model_copy(update={"fncall": pools})
        async with AsyncClient(config=cfg) as client:
            fc = client.fncall

            async def call(i: int) -> None:
                r = await fc.run("python", CODE)
                if r.status != "ok" or r.stdout != "1\n":
                    raise SandboxError(f"call ended {r.status}: {r.stderr[:300]}")

            say(f"fncall: warming a pool of {concurrency}")
            await asyncio.gather(*(call(-1) for _ in range(concurrency * 3)))
            say(f"fncall: {count} python calls at concurrency {concurrency}")
            t = await many(count, concurrency, call)
            f = t.figures()
            out.update(
                python_per_s=f["per_s"],
                python_p50_ms=f["p50_ms"],
                python_p99_ms=f["p99_ms"],
                python_errors=f["errors"],
            )

            n_cont = min(count, 100)
            say(f"per-call container: {n_cont} create + python3 + destroy at {concurrency}")
            img = await client.images.get(image)

            async def container(i: int) -> None:
                # The same CPU class as the pool's sandboxes (fncall.qos, "latency").
                sb = await client.sandboxes.create(
                    image=img, labels={"corral-bench": "fncall"}, qos="latency"
                )
                try:
                    r = await sb.exec(["python3", "-c", CODE], timeout=60)
                    if not r.ok:
                        raise SandboxError(f"python3 in a container ended {r.reason}")
                finally:
                    await sb.destroy()

            await container(-1)
            tc = await many(n_cont, concurrency, container)
            fcont = tc.figures()
            out.update(
                per_call_container_per_s=fcont["per_s"],
                per_call_container_p50_ms=fcont["p50_ms"],
                per_call_container_count=n_cont,
            )

        python = _host_python()
        out["fresh_process_python"] = python
        say(f"fresh process: {count} {python} -c at concurrency {concurrency}")

        async def fresh(i: int) -> None:
            proc = await asyncio.create_subprocess_exec(
                python,
                "-c",
                CODE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            stdout, _ = await proc.communicate()
            if proc.returncode != 0 or stdout != b"1\n":
                raise CorralError(f"python3 exited {proc.returncode}")

        ff = (await many(count, concurrency, fresh)).figures()
        out.update(fresh_process_per_s=ff["per_s"], fresh_process_p50_ms=ff["p50_ms"])
        out["ratio"] = {
            "vs_per_call_container": round(
                out["python_per_s"] / out["per_call_container_per_s"], 2
            ),
            "vs_fresh_process": round(out["python_per_s"] / out["fresh_process_per_s"], 2),
        }
        out["targets"] = {
            "python_per_s>=300": out["python_per_s"] >= 300,
            "vs_per_call_container>=10": out["ratio"]["vs_per_call_container"] >= 10,
            "python_p99_ms<=50": out["python_p99_ms"] <= 50,
        }
        return out
