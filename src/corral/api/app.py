"""The node's REST API: a FastAPI app that translates HTTP into ``NodeOps`` calls.

It only parses: every route turns a request into typed arguments, makes one call on the
``NodeOps`` it was given (which alone decides what is allowed) and serialises the answer.
Wire format: the JSON of :mod:`corral.spec` models (bytes as base64), raw bytes for file
contents and tars, NDJSON for streaming exec, ``{"error": {"kind", "message"}}`` on error,
and a websocket for interactive terminals (:mod:`corral.api._pty`).

Example:
    >>> from corral.testing import FakeNode
    >>> app = create_app(FakeNode(), token="s3cret")
"""

from __future__ import annotations

import hmac
import importlib.metadata
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral import execwire
from corral.api._pty import pty_router
from corral.api.bigbody import exec_raw_response, exec_result_response
from corral.errors import CorralError, InvalidRequest, NotFound, SandboxError, Unauthorized
from corral.integrations.e2b import E2BConfig, E2BGateway, e2b_config
from corral.ops import NodeOps
from corral.spec import (
    CallRequest,
    CallResult,
    DesktopInput,
    Event,
    EventSummary,
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
    SandboxInfo,
    SandboxSpec,
    ShellInfo,
)

__all__ = [
    "create_app",
    "ComposeRequest",
    "ErrorAnswer",
    "ShellOpenRequest",
    "ShellRunRequest",
]

log = logging.getLogger("corral.api")

_RAW_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
_RAW_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "raw bytes"}
}
_PNG_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {"content": {"image/png": {}}, "description": "the screen as a PNG image"}
}
_EXEC_ACCEPT = (
    f"{execwire.MEDIA_TYPE}: the answer in binary form, no base64 (corral.execwire: the "
    "result's JSON with both streams empty, then stdout's bytes, then stderr's; the "
    f"{execwire.HEADER} header gives the three lengths). Otherwise JSON."
)
_EXEC_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {execwire.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        "headers": {
            "X-Corral-Exec": {
                "description": "binary form only: head=N, stdout=N, stderr=N (bytes)",
                "schema": {"type": "string"},
            }
        },
    }
}


class ErrorDetail(BaseModel):
    """What went wrong: ``kind`` is the :mod:`corral.errors` class name (the SDK raises
    the same class again), ``message`` says what was wrong in words."""

    kind: str
    message: str


class ErrorAnswer(BaseModel):
    """The body of every error answer: ``{"error": {"kind", "message"}}``."""

    error: ErrorDetail


def _error(why: str) -> dict[str, Any]:
    return {"model": ErrorAnswer, "description": why}


# Every answer a route can give besides its success, in the spec so that a client (and a
# conformance fuzzer) knows each status and its body. Every route can get the first five:
# auth is checked, bodies and queries are parsed and an unknown id or path is a 404 before
# the route runs; an unexpected exception is a logged 500 (_CatchAll).
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("InvalidRequest: a value the node refuses (bad label, path, size, name...)"),
    401: _error("Unauthorized: missing or wrong bearer token (when the node has one)"),
    404: _error("NotFound: no such sandbox, image, layer, process, shell or route"),
    413: _error("InvalidRequest: the request body is larger than the node's limit"),
    422: _error("InvalidRequest: the body or a query parameter does not fit its schema"),
    500: _error("CorralError: an internal error on the node (logged there)"),
}
# What the node answers when an operation meets a sandbox or the host in a state that
# does not allow it: wrong state (paused, busy), the sandbox's runtime failing, no room.
_SANDBOX_ERRORS: dict[int | str, dict[str, Any]] = {
    409: _error("Conflict: the sandbox, image or shell is in a state that forbids this"),
    502: _error("SandboxError: the sandbox or its runtime failed to do it"),
    503: _error(
        "CapacityError or ScratchFull: the node has no room for it now (sandboxes, memory, "
        "its scratch filesystem)"
    ),
    507: _error("QuotaExceeded: the sandbox's disk quota is full"),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")


class ComposeRequest(_Body):
    """Body of ``POST /v1/images``."""

    name: str = Field(min_length=1, max_length=300)
    layers: list[str] = Field(min_length=1)
    """Layer digests, bottom first."""
    env: dict[str, str] | None = None
    workdir: str = "/"


class NetworkUpdateRequest(_Body):
    """Body of ``POST /v1/sandboxes/{id}/network``; a missing list is kept as it is."""

    allow: list[str] | None = None
    deny: list[str] | None = None


class TtlRequest(_Body):
    """Body of ``POST /v1/sandboxes/{id}/ttl``: seconds from now, or null for no TTL."""

    ttl: float | None = Field(gt=0)


class SnapshotRequest(_Body):
    """Body of ``POST /v1/sandboxes/{id}/snapshot``."""

    name: str | None = Field(None, min_length=1, max_length=300)
    """Image name to write; None: ``snapshot/<sandbox id>:<UTC time>``."""


class ShellOpenRequest(_Body):
    """Body of ``POST /v1/sandboxes/{id}/shells``."""

    cwd: str | None = None
    env: dict[str, str] | None = None


class ShellRunRequest(_Body):
    """Body of ``POST /v1/sandboxes/{id}/shells/{shell_id}/run``."""

    command: str
    timeout: float | None = Field(None, gt=0, le=7 * 86400)
    stdin: bytes | None = None


# ------------------------------------------------------------------- helpers
def _version() -> str:
    try:
        return importlib.metadata.version("corral")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _json(model: BaseModel, status: int = 200) -> Response:
    # pydantic writes the JSON itself (bytes as base64); FastAPI's response_model only
    # documents the shape, it does not re-validate on this path
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _json_list(models: list[Any]) -> Response:
    body = b"[" + b",".join(m.model_dump_json().encode() for m in models) + b"]"
    return Response(body, media_type="application/json")


def _wire(err: CorralError, status: int | None = None) -> JSONResponse:
    # a quota's 429 says when to come back, where that is known (RFC 9110 Retry-After)
    after = getattr(err, "retry_after", None)
    headers = {"retry-after": str(max(1, math.ceil(after)))} if after is not None else None
    return JSONResponse(err.to_wire(), status_code=status or err.status, headers=headers)


def _parse_labels(label: list[str]) -> dict[str, str] | None:
    out: dict[str, str] = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"label: {item!r} must be key=value")
        out[key] = value
    return out or None


def _field_message(errors: Any) -> str:
    """``limits.memory: Value error, 'lots' is not a size...``: the field path without
    where it came from (body/query/path), then pydantic's words, as in
    ``corral.spec.validation_message`` (which cannot see FastAPI's JSON errors)."""
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            source, loc = loc[0], loc[1:]
        else:
            source = "request"
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"body is not valid JSON: {detail} at position {loc[0] if loc else '?'}")
            continue
        where = ".".join(loc) or source
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


class _BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the node's limit of {limit} bytes")


# --------------------------------------------------------------- middleware
class _BearerAuth:
    """Every route requires ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            # constant-time: a timing difference would let a caller guess the token bytewise
            if not hmac.compare_digest(got, self._expected):
                resp = _wire(Unauthorized("missing or wrong bearer token"))
                resp.headers["www-authenticate"] = "Bearer"
                if scope["type"] == "websocket":
                    await _deny_websocket(resp, scope, receive, send)
                else:
                    await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _deny_websocket(resp: Response, scope: Scope, receive: Receive, send: Send) -> None:
    """Refuse a websocket before its handshake: HTTP 401 where the server can answer with
    a response (the ASGI denial extension), else close code 4401."""
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        await resp(scope, receive, send)
    else:
        await send({"type": "websocket.close", "code": 4401, "reason": "unauthorized"})


class _BodyLimit:
    """Refuse bodies over ``max_body`` bytes: by Content-Length up front, else while read."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body:
            exc = _BodyTooLarge(self.max_body)
            await _wire(InvalidRequest(exc.detail), 413)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.max_body:
                # an HTTPException passes through FastAPI's body parsing untouched and
                # reaches the handler below, which answers 413
                raise _BodyTooLarge(self.max_body)
            return msg

        await self.app(scope, limited, send)


class _CatchAll:
    """An unexpected exception becomes a logged 500, never a dead connection or server."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, tracking)
        except Exception:
            log.exception("internal error serving %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # too late for a status: let the server drop the connection
            await _wire(CorralError("internal error (logged on the node)"))(scope, receive, send)


# -------------------------------------------------------------- the app
def create_app(
    ops: NodeOps,
    *,
    token: str | None = None,
    max_body: int = 1 << 30,
    e2b: E2BConfig | None = None,
    e2b_enabled: bool = True,
) -> FastAPI:
    """Build the API app over ``ops``. ``token``: require ``Authorization: Bearer``.
    ``e2b``: how the E2B API maps onto the node (default: :func:`e2b_config` of ``ops``);
    ``e2b_enabled=False`` serves corral's API only (E2B paths are then corral's 404s)."""
    app = FastAPI(
        title="corral node API",
        version=_version(),
        docs_url="/docs",
        redoc_url=None,
        description="Sandboxes, exec, files and events of one corral node.",
        # "/v1/sandboxes/%2f" decodes to a trailing slash: a 307 to the sandbox list is
        # no answer for an id that names nothing, a 404 is
        redirect_slashes=False,
    )
    app.include_router(_routes(ops), prefix="/v1", responses={**_ERRORS, **_SANDBOX_ERRORS})
    app.include_router(pty_router(ops), prefix="/v1")
    observer = getattr(ops, "observer", None)  # the embedded node's metrics, if any
    # /metrics, /v1/stats, timelines, the live feed and the dashboard (/ui); imported here:
    # observe.py's metrics listener builds on the server module, which imports this one
    from corral.api.observe import observe_router

    app.include_router(observe_router(ops, observer), responses=_ERRORS)

    async def corral_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, CorralError)
        if observer is not None:  # errors by kind (a closed table: bounded labels)
            observer.metrics.error(type(exc).__name__)
        return _wire(exc)

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _wire(InvalidRequest(_field_message(exc.errors())), 422)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            err: CorralError = NotFound(f"no route {request.method} {request.url.path}")
        elif exc.status_code == 405:
            err = InvalidRequest(f"method {request.method} is not allowed on {request.url.path}")
        else:
            err = InvalidRequest(str(exc.detail))
        return _wire(err, exc.status_code)

    app.add_exception_handler(CorralError, corral_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    # added last = outermost: auth first (refuse before reading a body), then the catch-all
    app.add_middleware(_BodyLimit, max_body=max_body)
    app.add_middleware(_CatchAll)
    if token:
        app.add_middleware(_BearerAuth, token=token)
    if not e2b_enabled:
        return app
    # E2B's control plane and envd (their own auth: X-API-KEY, X-Access-Token); outermost
    app.add_middleware(
        E2BGateway,
        ops=ops,
        token=token,
        config=e2b or e2b_config(ops),
        max_upload=max_body,
    )
    return app


def _routes(ops: NodeOps) -> APIRouter:  # noqa: C901 - one short function per route
    r = APIRouter()
    sb = "/sandboxes/{sandbox_id}"

    # --- images
    @r.get("/images", response_model=list[ImageInfo], tags=["images"])
    async def image_list() -> Response:
        return _json_list(await ops.image_list())

    @r.post("/images", response_model=ImageInfo, status_code=201, tags=["images"])
    async def image_compose(body: ComposeRequest) -> Response:
        img = await ops.image_compose(body.name, body.layers, env=body.env, workdir=body.workdir)
        return _json(img, 201)

    @r.get("/images/{name:path}", response_model=ImageInfo, tags=["images"])
    async def image_get(name: str) -> Response:
        return _json(await ops.image_get(name))

    @r.delete("/images/{name:path}", status_code=204, tags=["images"])
    async def image_remove(name: str) -> Response:
        await ops.image_remove(name)
        return Response(status_code=204)

    @r.get("/layers", response_model=list[LayerInfo], tags=["images"])
    async def layer_list() -> Response:
        return _json_list(await ops.layer_list())

    # --- lifecycle
    @r.post("/sandboxes", response_model=SandboxInfo, status_code=201, tags=["sandboxes"])
    async def sandbox_create(spec: SandboxSpec) -> Response:
        return _json(await ops.sandbox_create(spec), 201)

    @r.get("/sandboxes", response_model=list[SandboxInfo], tags=["sandboxes"])
    async def sandbox_list(
        label: list[str] = Query([], description="key=value; repeat to require several"),
    ) -> Response:
        return _json_list(await ops.sandbox_list(_parse_labels(label)))

    @r.get(sb, response_model=SandboxInfo, tags=["sandboxes"])
    async def sandbox_get(sandbox_id: str) -> Response:
        return _json(await ops.sandbox_get(sandbox_id))

    @r.delete(sb, status_code=204, tags=["sandboxes"])
    async def sandbox_destroy(sandbox_id: str) -> Response:
        await ops.sandbox_destroy(sandbox_id)
        return Response(status_code=204)

    @r.post(sb + "/pause", response_model=SandboxInfo, tags=["sandboxes"])
    async def sandbox_pause(
        sandbox_id: str,
        memory_snapshot: bool = Query(
            False, description="microVMs: save the machine to a file and end its VMM"
        ),
    ) -> Response:
        return _json(await ops.sandbox_pause(sandbox_id, memory_snapshot))

    @r.post(sb + "/resume", response_model=SandboxInfo, tags=["sandboxes"])
    async def sandbox_resume(
        sandbox_id: str,
        prefetch: bool = Query(False, description="also read all its memory back from swap"),
    ) -> Response:
        return _json(await ops.sandbox_resume(sandbox_id, prefetch))

    @r.post("/sandboxes/pause", response_model=list[SandboxInfo], tags=["sandboxes"])
    async def sandboxes_pause(
        label: list[str] = Query(..., description="key=value; every sandbox with all of them"),
    ) -> Response:
        return _json_list(await ops.sandboxes_pause(_parse_labels(label) or {}))

    @r.post("/sandboxes/resume", response_model=list[SandboxInfo], tags=["sandboxes"])
    async def sandboxes_resume(
        label: list[str] = Query(..., description="key=value; every sandbox with all of them"),
        prefetch: bool = Query(False, description="also read their memory back from swap"),
    ) -> Response:
        return _json_list(await ops.sandboxes_resume(_parse_labels(label) or {}, prefetch))

    @r.post(sb + "/ttl", response_model=SandboxInfo, tags=["sandboxes"])
    async def sandbox_set_ttl(sandbox_id: str, body: TtlRequest) -> Response:
        """Expire the sandbox ``ttl`` seconds from now (null: never); survives a restart."""
        return _json(await ops.sandbox_set_ttl(sandbox_id, body.ttl))

    @r.post(sb + "/network", response_model=SandboxInfo, tags=["sandboxes"])
    async def network_update(sandbox_id: str, body: NetworkUpdateRequest) -> Response:
        return _json(await ops.network_update(sandbox_id, body.allow, body.deny))

    @r.get(
        sb + "/desktop/screenshot", response_class=Response, responses=_PNG_ANSWER, tags=["desktop"]
    )
    async def desktop_screenshot(sandbox_id: str) -> Response:
        """The screen of a ``vm`` sandbox (400 for a sandbox without a display)."""
        return Response(await ops.desktop_screenshot(sandbox_id), media_type="image/png")

    @r.post(sb + "/desktop/input", status_code=204, response_class=Response, tags=["desktop"])
    async def desktop_input(sandbox_id: str, req: DesktopInput) -> Response:
        """One pointer or keyboard action (move, click, drag, scroll, type, key)."""
        await ops.desktop_input(sandbox_id, req)
        return Response(status_code=204)

    @r.post(sb + "/snapshot", response_model=ImageInfo, status_code=201, tags=["sandboxes"])
    async def sandbox_snapshot(sandbox_id: str, body: SnapshotRequest) -> Response:
        return _json(await ops.sandbox_snapshot(sandbox_id, body.name), 201)

    @r.post(sb + "/fork", response_model=list[SandboxInfo], status_code=201, tags=["sandboxes"])
    async def sandbox_fork(sandbox_id: str, req: ForkRequest) -> Response:
        resp = _json_list(await ops.sandbox_fork(sandbox_id, req))
        resp.status_code = 201
        return resp

    # --- exec
    @r.post(sb + "/exec", response_model=ExecResult, responses=_EXEC_ANSWER, tags=["exec"])
    async def exec_(
        sandbox_id: str,
        req: ExecRequest,
        accept: str | None = Header(None, description=_EXEC_ACCEPT),
    ) -> Response:
        res = await ops.exec(sandbox_id, req)
        if execwire.wants(accept):
            return exec_raw_response(res)
        # a big output is streamed in slices: its encoding must not stall the event loop
        return exec_result_response(res)

    @r.post(
        sb + "/exec/stream",
        tags=["exec"],
        responses={
            200: {
                "content": {"application/x-ndjson": {}},
                "description": (
                    'lines {"stream": "stdout"|"stderr", "data": base64}, then {"result": ExecResult}'
                    ' or {"error": {"kind", "message"}}'
                ),
            }
        },
    )
    async def exec_stream(sandbox_id: str, req: ExecRequest) -> StreamingResponse:
        it = aiter(ops.exec_stream(sandbox_id, req))
        # read the first item before answering so that an error that comes before any
        # output (unknown sandbox, bad user) gets its own status instead of a 200 stream
        try:
            first = await anext(it)
        except StopAsyncIteration:
            raise SandboxError("exec stream ended without a result") from None
        return StreamingResponse(_ndjson(first, it), media_type="application/x-ndjson")

    @r.post(sb + "/processes", response_model=ProcessInfo, status_code=201, tags=["exec"])
    async def spawn(sandbox_id: str, req: ExecRequest) -> Response:
        return _json(await ops.spawn(sandbox_id, req), 201)

    @r.get(sb + "/processes", response_model=list[ProcessInfo], tags=["exec"])
    async def process_list(sandbox_id: str) -> Response:
        return _json_list(await ops.process_list(sandbox_id))

    @r.get(sb + "/processes/{process_id}", response_model=ProcessInfo, tags=["exec"])
    async def process_get(
        sandbox_id: str,
        process_id: str,
        wait: float | None = Query(None, ge=0, le=3600, description="seconds to wait for it"),
    ) -> Response:
        return _json(await ops.process_get(sandbox_id, process_id, wait=wait))

    @r.post(sb + "/processes/{process_id}/kill", status_code=204, tags=["exec"])
    async def process_kill(
        sandbox_id: str,
        process_id: str,
        sig: int = Query(9, alias="signal", ge=1, le=64),
    ) -> Response:
        await ops.process_kill(sandbox_id, process_id, signal=sig)
        return Response(status_code=204)

    # --- shells
    @r.post(sb + "/shells", response_model=ShellInfo, status_code=201, tags=["shells"])
    async def shell_open(sandbox_id: str, body: ShellOpenRequest | None = None) -> Response:
        body = body or ShellOpenRequest()
        return _json(await ops.shell_open(sandbox_id, cwd=body.cwd, env=body.env), 201)

    @r.post(sb + "/shells/{shell_id}/run", response_model=ExecResult, tags=["shells"])
    async def shell_run(sandbox_id: str, shell_id: str, body: ShellRunRequest) -> Response:
        result = await ops.shell_run(
            sandbox_id, shell_id, body.command, timeout=body.timeout, stdin=body.stdin
        )
        return _json(result)

    @r.post(sb + "/shells/{shell_id}/interrupt", status_code=204, tags=["shells"])
    async def shell_interrupt(sandbox_id: str, shell_id: str) -> Response:
        await ops.shell_interrupt(sandbox_id, shell_id)
        return Response(status_code=204)

    @r.delete(sb + "/shells/{shell_id}", status_code=204, tags=["shells"])
    async def shell_close(sandbox_id: str, shell_id: str) -> Response:
        await ops.shell_close(sandbox_id, shell_id)
        return Response(status_code=204)

    # --- files
    @r.get(sb + "/files", response_class=Response, responses=_RAW_ANSWER, tags=["files"])
    async def file_read(
        sandbox_id: str,
        path: str,
        offset: int = Query(0, ge=0),
        length: int | None = Query(None, ge=0),
    ) -> Response:
        data = await ops.file_read(sandbox_id, path, offset=offset, length=length)
        return Response(data, media_type="application/octet-stream")

    @r.put(sb + "/files", status_code=204, openapi_extra=_RAW_BODY, tags=["files"])
    async def file_write(
        request: Request,
        sandbox_id: str,
        path: str,
        mode: int = Query(0o644, ge=0, le=0o7777),
        append: bool = False,
    ) -> Response:
        data = await request.body()
        await ops.file_write(sandbox_id, path, data, mode=mode, append=append)
        return Response(status_code=204)

    @r.get(sb + "/files/list", response_model=list[FileStat], tags=["files"])
    async def file_list(sandbox_id: str, path: str) -> Response:
        return _json_list(await ops.file_list(sandbox_id, path))

    @r.get(sb + "/files/stat", response_model=FileStat, tags=["files"])
    async def file_stat(sandbox_id: str, path: str) -> Response:
        return _json(await ops.file_stat(sandbox_id, path))

    @r.delete(sb + "/files", status_code=204, tags=["files"])
    async def file_remove(sandbox_id: str, path: str, recursive: bool = False) -> Response:
        await ops.file_remove(sandbox_id, path, recursive=recursive)
        return Response(status_code=204)

    @r.post(sb + "/files/mkdir", status_code=204, tags=["files"])
    async def file_mkdir(
        sandbox_id: str,
        path: str,
        parents: bool = True,
        mode: int = Query(0o755, ge=0, le=0o7777),
        owner_uid: int = Query(0, ge=0, description="owner of what it creates (guest uid)"),
        owner_gid: int = Query(0, ge=0, description="its group (guest gid)"),
    ) -> Response:
        await ops.file_mkdir(sandbox_id, path, parents, mode, owner_uid, owner_gid)
        return Response(status_code=204)

    @r.put(sb + "/files/tar", status_code=204, openapi_extra=_RAW_BODY, tags=["files"])
    async def file_upload_tar(request: Request, sandbox_id: str, path: str) -> Response:
        await ops.file_upload_tar(sandbox_id, path, await request.body())
        return Response(status_code=204)

    @r.get(sb + "/files/tar", response_class=Response, responses=_RAW_ANSWER, tags=["files"])
    async def file_download_tar(sandbox_id: str, path: str) -> Response:
        data = await ops.file_download_tar(sandbox_id, path)
        return Response(data, media_type="application/x-tar")

    # --- events and node
    _kinds = Query([], description="only events of these kinds (repeatable)")

    _after = Query(None, description="cursor of the last event seen (its ``cursor`` field)")
    _limit = Query(1000, description="most events to return (1-10000)")

    _gone: dict[int | str, dict[str, Any]] = {
        410: _error("CursorExpired: the cursor is older than the node's event retention")
    }

    @r.get("/events", response_model=list[Event], responses=_gone, tags=["events"])
    async def events(
        sandbox_id: str | None = None,
        after: str | None = _after,
        limit: int = _limit,
        label: list[str] = Query([], description="key=value of the sandboxes' labels"),
        kind: list[str] = _kinds,
    ) -> Response:
        found = await ops.events(
            sandbox_id=sandbox_id,
            after=after,
            labels=_parse_labels(label),
            kinds=kind or None,
            limit=limit,
        )
        return _json_list(found)

    @r.get("/events/summary", response_model=EventSummary, tags=["events"])
    async def events_summary(
        sandbox_id: str | None = None,
        label: list[str] = Query([], description="key=value of the sandboxes' labels"),
        kind: list[str] = _kinds,
    ) -> Response:
        found = await ops.events_summary(
            labels=_parse_labels(label), kinds=kind or None, sandbox_id=sandbox_id
        )
        return _json(found)

    @r.get(sb + "/events", response_model=list[Event], responses=_gone, tags=["events"])
    async def sandbox_events(
        sandbox_id: str,
        after: str | None = _after,
        limit: int = _limit,
        kind: list[str] = _kinds,
    ) -> Response:
        found = await ops.events(
            sandbox_id=sandbox_id, after=after, kinds=kind or None, limit=limit
        )
        return _json_list(found)

    # --- fncall
    @r.post("/fncall/run", response_model=CallResult, tags=["fncall"])
    async def fncall_run(body: CallRequest) -> Response:
        return _json(await ops.fncall_run(body))

    @r.post("/fncall/judge", response_model=JudgeResult, tags=["fncall"])
    async def fncall_judge(body: JudgeRequest) -> Response:
        return _json(await ops.fncall_judge(body))

    @r.get("/node", response_model=NodeStatus, tags=["node"])
    async def node_status() -> Response:
        return _json(await ops.node_status())

    @r.get("/healthz", tags=["node"])
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    return r


async def _ndjson(first: Any, it: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """NDJSON lines of a streaming exec; an error mid-stream becomes an ``error`` line."""
    try:
        item = first
        while True:
            if isinstance(item, ExecResult):
                yield b'{"result":' + item.model_dump_json().encode() + b"}\n"
                return
            yield item.model_dump_json().encode() + b"\n"
            item = await anext(it)
    except StopAsyncIteration:
        yield _error_line(SandboxError("exec stream ended without a result"))
    except CorralError as exc:
        yield _error_line(exc)
    except Exception:
        log.exception("internal error in an exec stream")
        yield _error_line(CorralError("internal error (logged on the node)"))
    finally:
        aclose: Callable[[], Awaitable[None]] | None = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


def _error_line(err: CorralError) -> bytes:
    return json.dumps(err.to_wire()).encode() + b"\n"
