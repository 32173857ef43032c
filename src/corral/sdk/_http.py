"""NodeOps over a node's REST API (``corral.api``), on a unix socket or TCP.

The wire format is the JSON of :mod:`corral.spec` models (bytes as base64), raw bytes for
file contents and tar archives, and NDJSON for streaming exec. Errors come back as
``{"error": {"kind", "message"}}`` and are rebuilt by ``error_from_wire``.
"""

from __future__ import annotations

import base64
import ipaddress
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, TypeAdapter

from corral import execwire
from corral.errors import (
    CorralError,
    InvalidRequest,
    SandboxError,
    TransportError,
    error_from_wire,
)
from corral.ops import NodeOps
from corral.spec import (
    CallRequest,
    CallResult,
    DesktopInput,
    Event,
    EventSummary,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileStat,
    ForkRequest,
    ImageInfo,
    JudgeRequest,
    JudgeResult,
    LayerInfo,
    NodeStatus,
    ProcessInfo,
    PtyRequest,
    SandboxInfo,
    SandboxSpec,
    ShellInfo,
)

if TYPE_CHECKING:
    from corral.sdk._ports import PortEndpoint
    from corral.sdk._ws import PtySession

__all__ = ["HTTPOps", "parse_target"]

_JSON = {"content-type": "application/json"}
_EXEC_HEADERS = {**_JSON, "accept": f"{execwire.MEDIA_TYPE}, application/json;q=0.5"}
"""An exec's answer in binary form where the node has it (corral.execwire), else JSON."""
_RAW = {"content-type": "application/octet-stream"}
# Slack added to a request's read timeout over the command's own timeout: the node needs
# a moment to kill the command and answer after the deadline.
_SLACK = 30.0
# Snapshots pack a whole writable layer, forks start many sandboxes: no read deadline.
_SLOW = httpx.Timeout(30.0, read=None, pool=None)

_Images: TypeAdapter[list[ImageInfo]] = TypeAdapter(list[ImageInfo])
_Layers: TypeAdapter[list[LayerInfo]] = TypeAdapter(list[LayerInfo])
_Sandboxes: TypeAdapter[list[SandboxInfo]] = TypeAdapter(list[SandboxInfo])
_Processes: TypeAdapter[list[ProcessInfo]] = TypeAdapter(list[ProcessInfo])
_Stats: TypeAdapter[list[FileStat]] = TypeAdapter(list[FileStat])
_Events: TypeAdapter[list[Event]] = TypeAdapter(list[Event])


class _ResultLine(BaseModel):
    # the last NDJSON line of a stream; JSON validation keeps bytes as base64
    model_config = ConfigDict(val_json_bytes="base64")
    result: ExecResult


def parse_target(target: str) -> tuple[str, str]:
    """``unix:///run/corral/api.sock`` → ("unix", path); ``http(s)://h:p`` → ("http", url)."""
    parts = urlsplit(target)
    if parts.scheme == "unix" and parts.path.startswith("/") and not parts.netloc:
        return "unix", parts.path
    if parts.scheme in ("http", "https") and parts.netloc:
        return "http", target.rstrip("/")
    raise InvalidRequest(
        f"target {target!r} is not understood; use unix:///path/to/api.sock or "
        "http://host:port (None means the embedded node)"
    )


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _params(**kv: Any) -> dict[str, Any]:
    return {k: v for k, v in kv.items() if v is not None}


def _labels(labels: dict[str, str] | None) -> list[tuple[str, str]]:
    return [("label", f"{k}={v}") for k, v in (labels or {}).items()]


def _read_timeout(seconds: float | None) -> httpx.Timeout:
    return httpx.Timeout(30.0, read=None if seconds is None else seconds + _SLACK, pool=None)


class HTTPOps(NodeOps):
    """Talk to a node's API.

    ``transport`` replaces the network (e.g. ``httpx.ASGITransport(app)`` in tests).

    Example:
        >>> ops = HTTPOps("unix:///run/corral/api.sock")              # doctest: +SKIP
        >>> await ops.node_status()                                   # doctest: +SKIP
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 300.0,
        max_connections: int = 512,
    ) -> None:
        kind, where = parse_target(target)
        self._target = target
        self._kind, self._where, self._token = kind, where, token
        if transport is None:
            transport = httpx.AsyncHTTPTransport(
                uds=where if kind == "unix" else None,
                limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
            )
        headers = {"authorization": f"Bearer {token}"} if token else {}
        base = "http://corral" if kind == "unix" else where
        self._http = httpx.AsyncClient(
            base_url=base + "/v1",
            transport=transport,
            headers=headers,
            # pool=None: with thousands of concurrent execs, waiting for a free connection
            # is normal and must not fail on its own
            timeout=httpx.Timeout(timeout, pool=None),
        )

    def __repr__(self) -> str:
        return f"HTTPOps({self._target!r})"

    # ------------------------------------------------------------- plumbing
    def _transport_error(self, exc: httpx.HTTPError) -> TransportError:
        return TransportError(
            f"cannot reach the corral node at {self._target}: {type(exc).__name__}: {exc}"
        )

    async def _call(
        self, method: str, path: str, *, timeout: httpx.Timeout | None = None, **kw: Any
    ) -> httpx.Response:
        try:
            if timeout is not None:
                kw["timeout"] = timeout
            resp = await self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        if resp.status_code >= 400:
            raise self._error(resp)
        return resp

    @staticmethod
    def _error(resp: httpx.Response) -> CorralError:
        try:
            body: object = resp.json()
        except ValueError:
            body = resp.text
        return error_from_wire(body, resp.status_code)

    @staticmethod
    def _sb(sandbox_id: str, rest: str = "") -> str:
        return f"/sandboxes/{quote(sandbox_id, safe='')}{rest}"

    # --------------------------------------------------------------- images
    async def image_get(self, name: str) -> ImageInfo:
        resp = await self._call("GET", f"/images/{quote(name, safe='/:')}")
        return ImageInfo.model_validate_json(resp.content)

    async def image_list(self) -> list[ImageInfo]:
        return _Images.validate_json((await self._call("GET", "/images")).content)

    async def image_compose(
        self, name: str, layers: list[str], env: dict[str, str] | None = None, workdir: str = "/"
    ) -> ImageInfo:
        body = {"name": name, "layers": layers, "env": env, "workdir": workdir}
        resp = await self._call("POST", "/images", json=body)
        return ImageInfo.model_validate_json(resp.content)

    async def image_remove(self, name: str) -> None:
        await self._call("DELETE", f"/images/{quote(name, safe='/:')}")

    async def layer_list(self) -> list[LayerInfo]:
        return _Layers.validate_json((await self._call("GET", "/layers")).content)

    # ------------------------------------------------------------ lifecycle
    async def sandbox_create(self, spec: SandboxSpec) -> SandboxInfo:
        resp = await self._call(
            "POST",
            "/sandboxes",
            content=spec.model_dump_json(),
            headers=_JSON,
            timeout=_SLOW if spec.desktop else None,  # a desktop VM boots for minutes under TCG
        )
        return SandboxInfo.model_validate_json(resp.content)

    async def sandbox_get(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._call("GET", self._sb(sandbox_id))
        return SandboxInfo.model_validate_json(resp.content)

    async def sandbox_list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        resp = await self._call("GET", "/sandboxes", params=_labels(labels))
        return _Sandboxes.validate_json(resp.content)

    async def sandbox_destroy(self, sandbox_id: str) -> None:
        await self._call("DELETE", self._sb(sandbox_id))

    async def sandbox_pause(self, sandbox_id: str, memory_snapshot: bool = False) -> SandboxInfo:
        params = {"memory_snapshot": "true"} if memory_snapshot else None
        resp = await self._call("POST", self._sb(sandbox_id, "/pause"), params=params)
        return SandboxInfo.model_validate_json(resp.content)

    async def sandbox_resume(self, sandbox_id: str, prefetch: bool = False) -> SandboxInfo:
        params = {"prefetch": "true"} if prefetch else None
        resp = await self._call("POST", self._sb(sandbox_id, "/resume"), params=params)
        return SandboxInfo.model_validate_json(resp.content)

    async def sandboxes_pause(self, labels: dict[str, str]) -> list[SandboxInfo]:
        resp = await self._call("POST", "/sandboxes/pause", params=_labels(labels))
        return _Sandboxes.validate_json(resp.content)

    async def sandboxes_resume(
        self, labels: dict[str, str], prefetch: bool = False
    ) -> list[SandboxInfo]:
        params = _labels(labels) + ([("prefetch", "true")] if prefetch else [])
        resp = await self._call("POST", "/sandboxes/resume", params=params)
        return _Sandboxes.validate_json(resp.content)

    async def sandbox_set_ttl(self, sandbox_id: str, ttl: float | None) -> SandboxInfo:
        resp = await self._call("POST", self._sb(sandbox_id, "/ttl"), json={"ttl": ttl})
        return SandboxInfo.model_validate_json(resp.content)

    async def network_update(
        self, sandbox_id: str, allow: list[str] | None = None, deny: list[str] | None = None
    ) -> SandboxInfo:
        resp = await self._call(
            "POST", self._sb(sandbox_id, "/network"), json={"allow": allow, "deny": deny}
        )
        return SandboxInfo.model_validate_json(resp.content)

    async def desktop_screenshot(self, sandbox_id: str) -> bytes:
        resp = await self._call("GET", self._sb(sandbox_id, "/desktop/screenshot"))
        return resp.content

    async def desktop_input(self, sandbox_id: str, req: DesktopInput) -> None:
        await self._call(
            "POST", self._sb(sandbox_id, "/desktop/input"), json=req.model_dump(mode="json")
        )

    async def sandbox_snapshot(self, sandbox_id: str, name: str | None = None) -> ImageInfo:
        resp = await self._call(
            "POST", self._sb(sandbox_id, "/snapshot"), json={"name": name}, timeout=_SLOW
        )
        return ImageInfo.model_validate_json(resp.content)

    async def sandbox_fork(self, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        resp = await self._call(
            "POST",
            self._sb(sandbox_id, "/fork"),
            content=req.model_dump_json(),
            headers=_JSON,
            timeout=_SLOW,
        )
        return _Sandboxes.validate_json(resp.content)

    # ----------------------------------------------------------------- exec
    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        resp = await self._call(
            "POST",
            self._sb(sandbox_id, "/exec"),
            content=req.model_dump_json(),
            headers=_EXEC_HEADERS,
            timeout=_read_timeout(req.timeout),
        )
        if resp.headers.get("content-type", "").startswith(execwire.MEDIA_TYPE):
            try:
                return execwire.parse(resp.headers.get(execwire.HEADER), resp.content)
            except ValueError as e:  # FramingError, or a head that is not an ExecResult
                raise TransportError(f"exec in {sandbox_id}: a damaged answer: {e}") from None
        return ExecResult.model_validate_json(resp.content)  # a node without the binary form

    async def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[ExecChunk | ExecResult]:
        try:
            async with self._http.stream(
                "POST",
                self._sb(sandbox_id, "/exec/stream"),
                content=req.model_dump_json(),
                headers=_JSON,
                timeout=_read_timeout(req.timeout),
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise self._error(resp)
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield self._stream_line(line)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc

    @staticmethod
    def _stream_line(line: str) -> ExecChunk | ExecResult:
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            if "stream" in obj:
                return ExecChunk.model_validate_json(line)
            if "result" in obj:
                return _ResultLine.model_validate_json(line).result
            if "error" in obj:
                raise error_from_wire(obj)
        raise SandboxError(f"node sent an unexpected exec stream line: {line[:200]!r}")

    async def spawn(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        resp = await self._call(
            "POST",
            self._sb(sandbox_id, "/processes"),
            content=req.model_dump_json(),
            headers=_JSON,
        )
        return ProcessInfo.model_validate_json(resp.content)

    async def process_get(
        self, sandbox_id: str, process_id: str, wait: float | None = None
    ) -> ProcessInfo:
        resp = await self._call(
            "GET",
            self._sb(sandbox_id, f"/processes/{quote(process_id, safe='')}"),
            params=_params(wait=wait),
            timeout=_read_timeout(wait or 0.0),
        )
        return ProcessInfo.model_validate_json(resp.content)

    async def process_kill(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        await self._call(
            "POST",
            self._sb(sandbox_id, f"/processes/{quote(process_id, safe='')}/kill"),
            params={"signal": signal},
        )

    async def process_list(self, sandbox_id: str) -> list[ProcessInfo]:
        return _Processes.validate_json(
            (await self._call("GET", self._sb(sandbox_id, "/processes"))).content
        )

    # --------------------------------------------------------------- shells
    async def shell_open(
        self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ShellInfo:
        resp = await self._call(
            "POST", self._sb(sandbox_id, "/shells"), json={"cwd": cwd, "env": env}
        )
        return ShellInfo.model_validate_json(resp.content)

    async def shell_run(
        self,
        sandbox_id: str,
        shell_id: str,
        command: str,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        body = {
            "command": command,
            "timeout": timeout,
            "stdin": None if stdin is None else base64.b64encode(stdin).decode(),
        }
        resp = await self._call(
            "POST",
            self._sb(sandbox_id, f"/shells/{quote(shell_id, safe='')}/run"),
            json=body,
            timeout=_read_timeout(timeout),
        )
        return ExecResult.model_validate_json(resp.content)

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        await self._call("DELETE", self._sb(sandbox_id, f"/shells/{quote(shell_id, safe='')}"))

    async def shell_interrupt(self, sandbox_id: str, shell_id: str) -> None:
        path = f"/shells/{quote(shell_id, safe='')}/interrupt"
        await self._call("POST", self._sb(sandbox_id, path))

    # ---------------------------------------------------------------- files
    async def file_read(
        self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None
    ) -> bytes:
        resp = await self._call(
            "GET",
            self._sb(sandbox_id, "/files"),
            params=_params(path=path, offset=offset or None, length=length),
        )
        return resp.content

    async def file_write(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, append: bool = False
    ) -> None:
        await self._call(
            "PUT",
            self._sb(sandbox_id, "/files"),
            content=data,
            headers=_RAW,
            params={"path": path, "mode": mode, "append": str(append).lower()},
        )

    async def file_list(self, sandbox_id: str, path: str) -> list[FileStat]:
        resp = await self._call("GET", self._sb(sandbox_id, "/files/list"), params={"path": path})
        return _Stats.validate_json(resp.content)

    async def file_stat(self, sandbox_id: str, path: str) -> FileStat:
        resp = await self._call("GET", self._sb(sandbox_id, "/files/stat"), params={"path": path})
        return FileStat.model_validate_json(resp.content)

    async def file_remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self._call(
            "DELETE",
            self._sb(sandbox_id, "/files"),
            params={"path": path, "recursive": str(recursive).lower()},
        )

    async def file_mkdir(
        self,
        sandbox_id: str,
        path: str,
        parents: bool = True,
        mode: int = 0o755,
        owner_uid: int = 0,
        owner_gid: int = 0,
    ) -> None:
        params: dict[str, str | int] = {"path": path, "parents": str(parents).lower()}
        params["mode"] = mode
        if owner_uid or owner_gid:
            params.update(owner_uid=owner_uid, owner_gid=owner_gid)
        await self._call("POST", self._sb(sandbox_id, "/files/mkdir"), params=params)

    async def file_upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._call(
            "PUT",
            self._sb(sandbox_id, "/files/tar"),
            content=data,
            headers={"content-type": "application/x-tar"},
            params={"path": path},
        )

    async def file_download_tar(self, sandbox_id: str, path: str) -> bytes:
        resp = await self._call("GET", self._sb(sandbox_id, "/files/tar"), params={"path": path})
        return resp.content

    # ------------------------------------------------------ events and node
    async def events(
        self,
        sandbox_id: str | None = None,
        after: str | None = None,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        limit: int = 1000,
    ) -> list[Event]:
        page = [*([("after", after)] if after else []), ("limit", str(limit))]
        kind_params = [("kind", k) for k in kinds or ()]
        if sandbox_id is not None and not labels:
            resp = await self._call(
                "GET", self._sb(sandbox_id, "/events"), params=[*page, *kind_params]
            )
        else:
            params = [*_labels(labels), *page, *kind_params]
            if sandbox_id is not None:
                params.append(("sandbox_id", sandbox_id))
            resp = await self._call("GET", "/events", params=params)
        return _Events.validate_json(resp.content)

    async def events_summary(
        self,
        labels: dict[str, str] | None = None,
        kinds: list[str] | None = None,
        sandbox_id: str | None = None,
    ) -> EventSummary:
        params = [*_labels(labels), *[("kind", k) for k in kinds or ()]]
        if sandbox_id is not None:
            params.append(("sandbox_id", sandbox_id))
        resp = await self._call("GET", "/events/summary", params=params)
        return EventSummary.model_validate_json(resp.content)

    async def node_status(self) -> NodeStatus:
        return NodeStatus.model_validate_json((await self._call("GET", "/node")).content)

    # ------------------------------------------------------------- fncall
    async def fncall_run(self, req: CallRequest) -> CallResult:
        resp = await self._call(
            "POST",
            "/fncall/run",
            content=req.model_dump_json(),
            headers=_JSON,
            # a compile step may come first (fncall.compile_limits, 40 s by default)
            timeout=_read_timeout(req.limits.wall_time + 60),
        )
        return CallResult.model_validate_json(resp.content)

    async def fncall_judge(self, req: JudgeRequest) -> JudgeResult:
        resp = await self._call(
            "POST",
            "/fncall/judge",
            content=req.model_dump_json(),
            headers=_JSON,
            timeout=_read_timeout(None),  # as long as its cases take
        )
        return JudgeResult.model_validate_json(resp.content)

    # ------------------------------------------------------------- terminal
    async def pty(self, sandbox_id: str, req: PtyRequest) -> PtySession:
        """An interactive terminal over the API's websocket (a :class:`corral.ops.PtyStream`,
        connected when entered). Always over the network, even when ``transport`` was given.

        Example:
            >>> async with await ops.pty(sid, PtyRequest(cmd=["/bin/sh"])) as s:  # doctest: +SKIP
            ...     await s.write(b"exit 3\\n")
            ...     async for data in s: ...
            >>> s.result.exit_code                                      # doctest: +SKIP
            3
        """
        from corral.sdk._ws import pty_session

        return pty_session(self._kind, self._where, sandbox_id, req, token=self._token)

    # ------------------------------------------------------------- ports
    def port_endpoint(self, sandbox_id: str, port: int) -> PortEndpoint:
        """Where the node's port proxy serves ``port`` of ``sandbox_id`` (no request made;
        see :class:`corral.sdk.Ports`). The access token is the sandbox's own
        (``HMAC(node token, id)``), computed here from the node's token."""
        from corral.integrations.e2b._common import envd_token
        from corral.sdk._ports import PortEndpoint

        path = f"/sandboxes/{quote(sandbox_id, safe='')}/ports/{port}/"
        own = envd_token(self._token, sandbox_id)
        headers = {"X-Access-Token": own} if own else {}
        if self._kind == "unix":
            return PortEndpoint(
                sandbox_id, port, "http://localhost" + path, None, headers, self._where
            )
        parts = urlsplit(self._where)
        name, at = parts.hostname or "", f":{parts.port}" if parts.port else ""
        if name in ("127.0.0.1", "::1", "localhost"):
            name = "localhost"  # *.localhost resolves to loopback
        elif _is_ip(name):
            name = ""  # an address has no subdomains: no host form
        host_url = f"{parts.scheme}://{port}-{sandbox_id}.{name}{at}/" if name else None
        url = self._where.rstrip("/") + path
        return PortEndpoint(sandbox_id, port, url, host_url, headers)

    async def close(self) -> None:
        await self._http.aclose()
