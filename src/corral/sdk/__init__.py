"""corral's SDK: ``AsyncClient`` (async first) and ``Client`` (blocking, generated from it).

Example:
    >>> import corral
    >>> async with corral.AsyncClient() as client:                            # doctest: +SKIP
    ...     sb = await client.sandboxes.create(image="demo/python", ttl=3600)
    ...     r = await sb.exec(["python", "-c", "print(1+1)"], timeout=30)
"""

from corral.sdk._client import AsyncClient, Images, Sandboxes
from corral.sdk._sandbox import ExecStream, Files, Process, Sandbox, Shell
from corral.sdk._sync_gen import Client

__all__ = [
    "AsyncClient",
    "Client",
    "Images",
    "Sandboxes",
    "Sandbox",
    "ExecStream",
    "Process",
    "Shell",
    "Files",
]
