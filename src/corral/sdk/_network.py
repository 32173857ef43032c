"""``sandbox.network``: the egress policy of one sandbox, changed while it runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from corral.ops import NodeOps
from corral.spec import NetworkPolicy, SandboxInfo

__all__ = ["Network"]


class Network:
    """Egress of one sandbox, by permission names of the node's config.

    Example:
        >>> await sb.network.update(allow=["pypi", "github"])   # doctest: +SKIP
        >>> await sb.network.update(allow=[])                   # back to no egress  # doctest: +SKIP
    """

    __slots__ = ("_ops", "_sandbox_id", "_on_info")

    def __init__(
        self, ops: NodeOps, sandbox_id: str, on_info: Callable[[SandboxInfo], None]
    ) -> None:
        self._ops, self._sandbox_id, self._on_info = ops, sandbox_id, on_info

    def __repr__(self) -> str:
        return f"Network(sandbox={self._sandbox_id!r})"

    async def update(
        self, allow: Sequence[str] | None = None, deny: Sequence[str] | None = None
    ) -> NetworkPolicy:
        """Replace the allow and/or deny list (None keeps it); in effect when this returns,
        without disturbing the sandbox's processes. Returns the policy now in force."""
        info = await self._ops.network_update(
            self._sandbox_id,
            list(allow) if allow is not None else None,
            list(deny) if deny is not None else None,
        )
        self._on_info(info)
        return info.spec.network

    async def policy(self) -> NetworkPolicy:
        """The policy in force now (asks the node)."""
        info = await self._ops.sandbox_get(self._sandbox_id)
        self._on_info(info)
        return info.spec.network
