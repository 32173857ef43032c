"""``client.stats(labels=...)``: latency percentiles per operation and phase, and event
counts, for the sandboxes carrying some labels.

Kept apart from ``_client.py`` until ``stats`` joins the ``NodeOps`` protocol: any ops
object with an async ``stats(labels, since, until)`` answers directly (the embedded
node); over HTTP it is ``GET /v1/stats``.

Example:
    >>> s = await client.stats(labels={"job": "rl-42"})                  # doctest: +SKIP
    >>> s.ops["create"].phases["runtime_start"].p99                     # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from corral.errors import InvalidRequest
from corral.spec import Stats, TimelineEntry

__all__ = ["fetch_stats", "fetch_timeline"]


async def fetch_stats(
    ops: Any,
    labels: Mapping[str, str] | None = None,
    since: float | None = None,
    until: float | None = None,
) -> Stats:
    """Stats from ``ops`` (a node, or the HTTP transport of one)."""
    from corral.sdk._http import HTTPOps

    want = dict(labels) if labels else None
    if isinstance(ops, HTTPOps):
        params: list[tuple[str, str | float]] = [
            ("label", f"{k}={v}") for k, v in (want or {}).items()
        ]
        params += [(k, v) for k, v in (("since", since), ("until", until)) if v is not None]
        resp = await ops._call("GET", "/stats", params=params)
        return Stats.model_validate_json(resp.content)
    method = getattr(ops, "stats", None)
    if method is None:
        raise InvalidRequest(f"{ops!r} keeps no stats (a node without metrics?)")
    result: Stats = await method(want, since, until)
    return result


async def fetch_timeline(ops: Any, sandbox_id: str, limit: int = 2000) -> list[TimelineEntry]:
    """One sandbox's operations (with phases) and events, oldest first."""
    from urllib.parse import quote

    from pydantic import TypeAdapter

    from corral.sdk._http import HTTPOps

    if isinstance(ops, HTTPOps):
        resp = await ops._call(
            "GET", f"/sandboxes/{quote(sandbox_id, safe='')}/timeline", params={"limit": limit}
        )
        return TypeAdapter(list[TimelineEntry]).validate_json(resp.content)
    method = getattr(ops, "timeline", None)
    if method is None:
        raise InvalidRequest(f"{ops!r} keeps no timelines (a node without metrics?)")
    entries: list[TimelineEntry] = await method(sandbox_id, limit)
    return entries
