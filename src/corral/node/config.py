"""Node configuration: one closed model, loadable from TOML.

Example:
    >>> NodeConfig(state_dir="/tmp/corral").store_dir
    PosixPath('/tmp/corral/store')
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from corral.spec import ByteSize

__all__ = ["NodeConfig"]


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state_dir: Path = Path("/var/lib/corral")
    """Node state: SQLite database, sandbox bundles, layer mounts, scratch filesystem."""
    store: Path | None = None
    """Layer store directory (may be a shared filesystem); default ``state_dir/store``."""
    run_dir: Path = Path("/run/corral")
    """Runtime state (OCI runtime root, API socket)."""
    host_uid: int = Field(100000, ge=1000)
    """First host uid/gid that root inside a sandbox maps to."""
    id_count: int = Field(65536, ge=1024)
    scratch_size: ByteSize = 64 << 30
    """Size of the sparse btrfs scratch image holding writable layers."""
    runtime: Literal["auto", "runc", "crun"] = "auto"
    max_sandboxes: int = Field(4096, ge=1)
    reaper_interval: float = Field(1.0, gt=0)
    event_retention: int = Field(1_000_000, ge=1000)
    """How many of the newest events the node keeps; older ones are trimmed by the reaper."""
    api_socket: Path | None = None
    """Unix socket of ``corral node serve``; default ``run_dir/api.sock``."""
    cgroup_subtree: str = Field("corral", pattern=r"^corral[a-z0-9-]*$")
    eager_layers: bool = False
    """Benchmark baseline only: copy each layer to node-local disk before mounting."""

    @property
    def store_dir(self) -> Path:
        return self.store or self.state_dir / "store"

    @property
    def socket_path(self) -> Path:
        return self.api_socket or self.run_dir / "api.sock"

    @classmethod
    def from_toml(cls, path: Path) -> NodeConfig:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        return cls.model_validate(data.get("node", data))
