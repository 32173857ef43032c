"""Backend configuration: a closed, discriminated union over the isolation engines.

``NodeConfig.backends`` lists the engines a node runs (``[[node.backends]]`` in TOML, each
with its ``kind``); the microVM issue adds ``MicroVMConfig`` (``kind = "microvm"``) and
``VMConfig`` to :data:`BackendConfig`.

Example:
    >>> ContainerConfig(runtime="runc").kind
    'container'
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BackendConfig", "ContainerConfig"]


class ContainerConfig(BaseModel):
    """Container sandboxes: an OCI runtime, overlays of idmapped EROFS layers, corral-init."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["container"] = "container"
    runtime: Literal["auto", "runc", "crun"] = "auto"
    """OCI runtime: crun where it works (pure cgroup v2), else runc; or name one."""
    owner_uid: int | None = Field(None, ge=1)
    """First of the host uids that own sandbox user namespaces, one per sandbox (see
    corral.host.owners; nothing else on the host may use them); default
    ``host_uid + id_count``, right after the mapped range."""
    owner_uids: int = Field(65536, ge=1)
    """How many owner uids (at most that many container sandboxes on the host at once)."""


# One member today; a Union so that adding MicroVMConfig is a one-word change.
BackendConfig = Annotated[Union[ContainerConfig], Field(discriminator="kind")]  # noqa: UP007
