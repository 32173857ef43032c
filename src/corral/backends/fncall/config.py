"""Configuration of fncall pools: languages and per-image pools (``NodeConfig.fncall``).

Example (TOML)::

    [node.fncall]
    default_image = "demo/python"
    [[node.fncall.pools]]
    image = "demo/python"
    size = 8
    preimport = ["json", "math", "numpy"]
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from corral.spec import ByteSize, CallLimits

__all__ = [
    "LanguageConfig",
    "PoolConfig",
    "FnCallConfig",
    "DEFAULT_LANGUAGES",
    "SETUP_IMAGE",
    "SETUP_PACKAGES",
]

SETUP_IMAGE = "fncall/default"
"""Image of calls that name none on a node without ``default_image``: built once into the
store by ``corral fncall setup`` (a Debian release with :data:`SETUP_PACKAGES`)."""
SETUP_PACKAGES = ("python3", "gcc", "g++", "libc6-dev")
"""What the built-in languages need beyond Debian's minbase (which has bash)."""


class LanguageConfig(BaseModel):
    """How one language runs in a pool sandbox (paths relative to the work dir)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["python", "exec"] = "exec"
    """python: the warm interpreter forks and ``exec``s the code; exec: run ``run``."""
    source: str = Field("main", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """File name the code is written to."""
    compile: list[str] | None = None
    """Compile command; its exit status decides ``compile_error``."""
    artifact: str = Field("prog", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """What ``compile`` produces (kept between the cases of a judge)."""
    run: list[str] = Field(default_factory=list)


DEFAULT_LANGUAGES: dict[str, LanguageConfig] = {
    "python": LanguageConfig(kind="python", source="main.py"),
    "bash": LanguageConfig(source="main.sh", run=["bash", "main.sh"]),
    "c": LanguageConfig(
        source="main.c",
        compile=["gcc", "-O2", "-pipe", "-std=gnu11", "-o", "prog", "main.c", "-lm"],
        run=["./prog"],
    ),
    "cpp": LanguageConfig(
        source="main.cpp",
        compile=["g++", "-O2", "-pipe", "-std=gnu++17", "-o", "prog", "main.cpp"],
        run=["./prog"],
    ),
}


class PoolConfig(BaseModel):
    """A warm pool for one image."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(min_length=1)
    size: int = Field(4, ge=0, le=1024)
    """Sandboxes kept warm (idle) and refilled in the background."""
    max_size: int = Field(16, ge=1, le=4096)
    """Upper bound when demand grows past ``size`` (extra sandboxes are made on demand)."""
    languages: list[str] | None = None
    """Languages this image serves; None: every configured language."""
    preimport: list[str] = Field(default_factory=lambda: ["json", "math", "re", "collections"])
    """Python modules the warm worker imports before the first call."""


class FnCallConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default_image: str | None = None
    """Image of calls that name none."""
    pools: list[PoolConfig] = Field(default_factory=list)
    """Pools started with the node; other images get an on-demand pool at first use."""
    on_demand_size: int = Field(2, ge=0, le=1024)
    """Warm size of a pool made on demand."""
    idle_trim: float = Field(60.0, gt=0)
    """Seconds a sandbox above its pool's ``size`` stays idle before it is destroyed (a
    pool grows with demand up to ``max_size`` and shrinks back)."""
    languages: dict[str, LanguageConfig] = Field(default_factory=lambda: dict(DEFAULT_LANGUAGES))
    memory: ByteSize = Field(2 << 30, ge=64 << 20)
    """Memory limit of a pool sandbox: the largest ``CallLimits.memory`` it accepts
    (plus the worker's own)."""
    pids: int = Field(128, ge=16, le=1 << 16)
    """pids limit of a pool sandbox's cgroup (a backstop under each call's RLIMIT_NPROC)."""
    scratch: ByteSize = Field(256 << 20, ge=1 << 20)
    """Size of each scratch tmpfs (/tmp, /work, /var/tmp) of a pool sandbox."""
    qos: Literal["best_effort", "latency"] = "best_effort"
    """CPU class of pool sandboxes (``SandboxSpec.qos``). Best effort by default: the node
    must turn every call around, and when calls saturate the CPUs a latency-class pool
    (maximum cgroup weight) starves the node itself; measured here at concurrency 8,
    best-effort pools gave 650-720 calls/s with p99 22-27 ms against 455-480/s with p99
    48-134 ms. Use ``latency`` where other CPU-bound work runs at normal priority on the
    host (best-effort pools then get only idle CPU)."""
    workdir: str = "/work"
    call_uid: int = Field(1000, ge=1, lt=65536)
    """The unprivileged uid calls run as (never the worker's)."""
    compile_limits: CallLimits = Field(
        default_factory=lambda: CallLimits(
            cpu_time=20, wall_time=40, memory=1 << 30, output=256 << 10, processes=64
        )
    )
    """Limits of a compile step."""
