"""Node configuration: one closed model, loadable from TOML.

Example:
    >>> NodeConfig(state_dir="/tmp/corral").store_dir
    PosixPath('/tmp/corral/store')
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from corral.backends.config import BackendConfig, ContainerConfig
from corral.backends.fncall.config import FnCallConfig
from corral.node.metrics import MetricsConfig
from corral.policy.network import NetworkConfig
from corral.spec import ByteSize

__all__ = ["NodeConfig", "SwapConfig"]


class SwapConfig(BaseModel):
    """Swap the node adds for paused sandboxes, and removes when it tears down."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["none", "zram", "file"] = "none"
    """``zram``: a new compressed RAM device (memory that compresses well); ``file``: a
    swap file on the state dir's filesystem (releases any memory); ``none``: pausing only
    freezes and drops page cache."""
    size: ByteSize = 8 << 30
    """Size of the swap area (for zram: uncompressed bytes it can hold)."""
    path: Path | None = None
    """``file`` only: where the swap file goes; default ``state_dir/swap/corral.swap``."""


def _containers_only() -> list[BackendConfig]:
    """The default engines: containers alone (a microVM engine needs its kernel fetched)."""
    return [ContainerConfig()]


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state_dir: Path = Path("/var/lib/corral")
    """Node state: SQLite database, sandbox bundles, layer mounts, scratch filesystem."""
    store: Path | None = None
    """Layer store directory (may be a shared filesystem); default ``state_dir/store``."""
    store_compress: Literal["lz4", "lz4hc", "none", "dax"] = "lz4"
    """How layers this node builds are stored: ``lz4`` (smaller store, more CPU to read)
    or ``dax``: uncompressed and block-aligned, so microVMs map their files with DAX (one
    host page cache, no copy in each guest; corral.images.erofs.DAX)."""
    run_dir: Path = Path("/run/corral")
    """Runtime state (OCI runtime root, API socket)."""
    host_uid: int = Field(100000, ge=1000)
    """First host uid/gid that root inside a sandbox maps to."""
    id_count: int = Field(65536, ge=1024)
    scratch_size: ByteSize = 64 << 30
    """Size of the sparse btrfs image holding writable layers."""
    backends: list[BackendConfig] = Field(default_factory=lambda: _containers_only(), min_length=1)
    """The isolation engines this node runs (``[[node.backends]]`` with ``kind``); each kind
    at most once."""
    default_backend: str = "container"
    """The engine of a sandbox whose spec names none."""
    labels: dict[str, str] = Field(default_factory=dict)
    """This node's labels (e.g. ``pool = "onprem"``), reported in its status for placement."""
    max_sandboxes: int = Field(4096, ge=1)
    reaper_interval: float = Field(1.0, gt=0)
    event_retention: int = Field(1_000_000, ge=100)
    """How many of the newest events the node keeps; older ones are trimmed by the reaper
    (corral.node.retention). An ``events`` cursor older than the oldest kept event gets
    ``CursorExpired`` (HTTP 410)."""
    event_max_age: float = Field(30 * 86400.0, gt=0)
    """Seconds an event is kept at most (default 30 days), whatever their number."""
    destroyed_retention: float = Field(86400.0, ge=0)
    """Seconds a destroyed sandbox's record is kept after its destroy (default a day): it
    answers "sandbox X is destroyed" instead of "no sandbox X", keeps its labels for event
    filters and its timeline readable."""
    destroyed_max: int = Field(20_000, ge=0)
    """Most destroyed sandboxes' records kept, the oldest dropped first (~1.5 KiB each)."""
    api_socket: Path | None = None
    """Unix socket of ``corral node serve``; default ``run_dir/api.sock``."""
    cgroup_subtree: str = Field("corral", pattern=r"^corral[a-z0-9-]*$")
    eager_layers: bool = False
    """Benchmark baseline only: copy each layer to node-local disk before mounting."""
    layer_prefetch: bool = True
    """Read a layer's recorded hot blocks (``<hex>.hot`` on the store) in the background,
    once the layer's first sandbox is up, a few large reads in flight, and record them
    for layers without a profile (images/hotblocks.py). On a network store this turns a
    task's page faults, one round trip each, into a few large reads."""
    layer_linger: float = Field(30.0, ge=0)
    """Seconds a layer stays mounted on the node after its last sandbox went (0: unmount at
    once). A create from an image whose layers linger skips their verification (a read of
    the whole layer file, over the network on a shared store) and mount; meanwhile the
    node's lease on the store keeps ``corral image gc`` off them."""
    layer_direct_io: Literal["auto", "on", "off"] = "auto"
    """Mount layer files with direct I/O (EROFS ``directio``), so that what sandboxes read
    is cached once, as the EROFS files' pages, not a second time as the layer file's own.
    ``auto``: when the layer file is on a local disk filesystem (ext4, XFS, btrfs, f2fs);
    a network store (FUSE, NFS, ...) stays buffered, as hot-block prefetch and the client's
    read-ahead work in that page cache. Such layers are not prefetched or profiled."""
    swap: SwapConfig = Field(default_factory=SwapConfig)
    """Swap for paused sandboxes, e.g. ``[node.swap] kind = "file"``, ``size = "8GiB"``."""
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    """Sandbox egress: ``[node.network]`` subnet, upstream resolvers, and the named
    permissions (``[node.network.permissions.NAME]``) sandboxes may be granted."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """``[node.metrics]``: job labels allowed on metrics, a token-free metrics listener,
    how many phase timings are kept (see corral.node.metrics)."""
    fncall: FnCallConfig = Field(default_factory=FnCallConfig)
    """Warm pools for short calls (``[node.fncall]``): default image, pools per image,
    languages; see corral.backends.fncall.config."""
    e2b_templates: dict[str, str] = Field(default_factory=dict)
    """E2B template id/alias -> corral image, for the E2B API on ``corral node serve``
    (``[node.e2b_templates]``, e.g. ``base = "base/debian"``); merged over the built-in
    table; a template not named is used as the image name itself."""

    def backend_config(self, kind: str) -> BackendConfig | None:
        return next((b for b in self.backends if b.kind == kind), None)

    @model_validator(mode="after")
    def _check_backends(self) -> NodeConfig:
        kinds = [b.kind for b in self.backends]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"backends: each kind at most once, got {kinds}")
        if self.default_backend not in kinds:
            raise ValueError(
                f"default_backend: {self.default_backend!r} is not among the configured "
                f"backends {kinds}"
            )
        for b in self.backends:
            if isinstance(b, ContainerConfig):
                first = self.owner_first(b)
                end = first + b.owner_uids
                if first < self.host_uid + self.id_count and self.host_uid < end:
                    raise ValueError(
                        f"owner uids {first}..{end - 1} overlap the mapped sandbox ids "
                        f"{self.host_uid}..{self.host_uid + self.id_count - 1}"
                    )
        return self

    def owner_first(self, container: ContainerConfig) -> int:
        """First owner uid of the container backend (see ContainerConfig.owner_uid)."""
        if container.owner_uid is not None:
            return container.owner_uid
        return self.host_uid + self.id_count

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
