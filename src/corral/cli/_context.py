"""What every command shares: the global options, how to reach a node, and output helpers.

The root callback of :mod:`corral.cli.app` builds one :class:`Globals` per invocation and
puts it on ``ctx.obj``; commands ask it for a client (``g.client()``) or the embedded node's
config (``g.config()``), so no command knows how the node is reached.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console

from corral.errors import InvalidRequest
from corral.node.config import NodeConfig
from corral.spec import validation_message

if TYPE_CHECKING:
    from corral.sdk import AsyncClient

__all__ = [
    "Globals",
    "ClientFactory",
    "EMBEDDED",
    "resolve_target",
    "parse_pairs",
    "validation_text",
    "emit_json",
    "out",
    "err",
    "human_bytes",
]

EMBEDDED = "embedded"
"""``--node embedded``: run the node inside this process, even if a server is listening."""

ClientFactory = Callable[["Globals"], "AsyncClient"]


@dataclass
class Globals:
    """The global options of one ``corral`` invocation."""

    node: str | None = None
    """``--node``: ``unix:///path``, ``http://host:port``, a socket path, or ``embedded``."""
    token: str | None = None
    state_dir: Path | None = None
    config_file: Path | None = None
    json: bool = False
    verbose: int = 0
    client_factory: ClientFactory | None = field(default=None, repr=False)

    def config(self) -> NodeConfig:
        """The embedded node's configuration (``--config`` file, then ``--state-dir``)."""
        if self.config_file is None:
            cfg = NodeConfig()
        else:
            try:
                cfg = NodeConfig.from_toml(self.config_file)
            except OSError as e:
                raise InvalidRequest(f"--config {self.config_file}: {e.strerror}") from None
            except ValidationError as e:
                raise InvalidRequest(f"--config {self.config_file}: {validation_text(e)}") from None
            except ValueError as e:  # TOML syntax
                raise InvalidRequest(f"--config {self.config_file}: {e}") from None
        if self.state_dir is not None:
            cfg = cfg.model_copy(update={"state_dir": self.state_dir})
        return cfg

    def target(self) -> str:
        """Where the node is: a URL, or :data:`EMBEDDED`."""
        explicit = self.state_dir is not None or self.config_file is not None
        return resolve_target(self.node, self.config(), explicit_local=explicit)

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[AsyncClient]:
        """An SDK client of the node, closed when the block ends.

        The CLI uses the async client: live exec output and the terminal of ``sandbox
        shell`` are concurrent by nature, and each command is one ``asyncio.run``.
        """
        factory = self.client_factory or default_client_factory
        c = factory(self)
        try:
            yield c
        finally:
            await c.close()


def default_client_factory(g: Globals) -> AsyncClient:
    """An SDK client for the node named by the global options."""
    from corral.sdk import AsyncClient

    target = g.target()
    if target == EMBEDDED:
        return AsyncClient(config=g.config())
    return AsyncClient(target, token=g.token)


def resolve_target(node: str | None, cfg: NodeConfig, *, explicit_local: bool = False) -> str:
    """Turn ``--node`` into a URL or :data:`EMBEDDED`.

    Without ``--node`` the default API socket is used when a server accepts connections on
    it, else an embedded node. ``explicit_local`` (``--state-dir``/``--config`` given) means
    the user named a local state dir, so the embedded node is meant.
    """
    if node:
        if node in (EMBEDDED, "local"):
            return EMBEDDED
        if node.startswith(("unix://", "http://", "https://", "ray://")):
            return node
        if node.startswith("/") or node.startswith("."):
            return f"unix://{Path(node).resolve()}"
        if ":" in node and "/" not in node:
            return f"http://{node}"
        raise InvalidRequest(
            f"--node {node!r}: use unix:///path/to/api.sock, http://host:port, ray://auto, "
            f"a socket path, or 'embedded'"
        )
    if explicit_local:
        return EMBEDDED
    sock = cfg.socket_path
    if _accepts(sock):
        return f"unix://{sock}"
    return EMBEDDED


def _accepts(path: Path) -> bool:
    """True when something listens on the unix socket ``path`` (a stale file is not enough)."""
    if not path.exists():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    try:
        s.connect(str(path))
    except OSError:
        return False
    finally:
        s.close()
    return True


def validation_text(e: ValidationError) -> str:
    """One line naming each bad field, without pydantic's "Value error, " noise."""
    return validation_message(e).replace("Value error, ", "")


def parse_pairs(items: list[str] | None, what: str) -> dict[str, str]:
    """``["a=1", "b=2"]`` → ``{"a": "1", "b": "2"}``; ``what`` names the option in errors."""
    pairs: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"{what} {item!r}: expected KEY=VALUE")
        pairs[key] = value
    return pairs


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def emit_json(value: Any) -> None:
    """Print models, lists of models or plain data as indented JSON on stdout."""
    typer.echo(json.dumps(_jsonable(value), indent=2, sort_keys=False))


def out() -> Console:
    """A console on the current stdout (made per call so test runners can swap stdout)."""
    return Console(highlight=False)


def err() -> Console:
    """A console on the current stderr."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def human_bytes(n: int) -> str:
    """``1536`` → ``1.5 KiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
