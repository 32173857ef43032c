"""envd, served by the node: ``/health``, ``/files`` and the two Connect services.

A request is for the sandbox named by its ``E2b-Sandbox-Id`` header and must carry that
sandbox's access token (``X-Access-Token``, see :func:`._common.envd_token`): a token of
one sandbox opens no other. Paths are the guest's, confined by corral's files API.
"""

from __future__ import annotations

import base64
import email.parser
import email.policy
import gzip
import logging
import posixpath
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.errors import CorralError, InvalidRequest, NotFound, SandboxNotFound
from corral.integrations.e2b._common import (
    E2BConfig,
    e2b_error,
    envd_token,
    error_status,
    guest_path,
    token_ok,
)
from corral.integrations.e2b._filesystem import FilesystemService
from corral.integrations.e2b._process import ProcessService
from corral.integrations.e2b._rpc import user_from_header
from corral.ops import NodeOps
from corral.spec import ExecRequest

log = logging.getLogger("corral.e2b")


class _StrictCodec:
    """A connectrpc codec whose undecodable input is Connect's ``invalid_argument``
    (connectrpc lets the decoder's ValueError through as an internal error)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def name(self) -> str:
        return str(self._inner.name())

    def encode(self, message: Any) -> bytes:
        return bytes(self._inner.encode(message))

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, f"cannot decode the request: {exc}") from None


_CODECS = [_StrictCodec(proto_binary_codec()), _StrictCodec(proto_json_codec())]


def gone(sandbox_id: str) -> Response:
    """What E2B's proxy answers for a sandbox that is not running; the SDK reads "was not
    found" in the message as "killed or past its timeout"."""
    return JSONResponse(e2b_error(502, f"The sandbox {sandbox_id} was not found"), 502)


class Envd:
    """The envd ASGI app for every sandbox of ``ops``."""

    def __init__(
        self, ops: NodeOps, token: str | None, config: E2BConfig, max_upload: int = 1 << 30
    ) -> None:
        self.ops = ops
        self.token = token
        self.config = config
        self.max_upload = max_upload
        self.process = ProcessService(ops, config)
        self.filesystem = FilesystemService(ops, config)
        self._rpc: dict[str, Any] = {
            "/process.Process/": ProcessASGIApplication(self.process, codecs=_CODECS),
            "/filesystem.Filesystem/": FilesystemASGIApplication(self.filesystem, codecs=_CODECS),
        }

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await JSONResponse(e2b_error(400, "envd serves HTTP only"), 400)(scope, receive, send)
            return
        headers = dict(scope["headers"])
        sid = headers.get(b"e2b-sandbox-id", b"").decode("latin-1")
        got = headers.get(b"x-access-token", b"").decode("latin-1") or None
        if not token_ok(envd_token(self.token, sid), got):
            body = e2b_error(401, f"missing or wrong X-Access-Token for sandbox {sid!r}")
            await JSONResponse(body, 401)(scope, receive, send)
            return
        path = scope["path"]
        for prefix, app in self._rpc.items():
            if path.startswith(prefix):
                await app(scope, receive, send)
                return
        try:
            resp = await self._http(Request(scope, receive), sid)
        except SandboxNotFound:
            resp = gone(sid)
        except CorralError as exc:
            status = error_status(exc)
            resp = JSONResponse(e2b_error(status, str(exc)), status)
        await resp(scope, receive, send)

    async def _http(self, request: Request, sid: str) -> Response:
        path, method = request.url.path, request.method
        if path == "/health" and method == "GET":
            info = await self.ops.sandbox_get(sid)
            if info.state in ("destroying", "destroyed", "failed"):
                return gone(sid)
            return Response(status_code=204)
        if path == "/files" and method == "GET":
            return await self._download(request, sid)
        if path == "/files" and method == "POST":
            return await self._upload(request, sid)
        return JSONResponse(e2b_error(404, f"no envd route {method} {path}"), 404)

    def _user(self, request: Request) -> str:
        name = request.query_params.get("username")
        if name:
            return user_from_header(
                "Basic " + base64.b64encode(name.encode()).decode(), self.config
            )
        return user_from_header(request.headers.get("authorization"), self.config)

    async def _download(self, request: Request, sid: str) -> Response:
        user = self._user(request)
        path = guest_path(request.query_params.get("path") or "", user)
        try:
            st = await self.ops.file_stat(sid, path)
        except SandboxNotFound:
            raise
        except NotFound:
            return JSONResponse(e2b_error(404, f"path '{path}' does not exist"), 404)
        if st.type == "dir":
            return JSONResponse(e2b_error(400, f"path '{path}' is a directory"), 400)
        data = await self.ops.file_read(sid, path)
        return Response(data, media_type="application/octet-stream")

    async def _body(self, request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_upload:
                raise InvalidRequest(f"upload is larger than the limit of {self.max_upload} bytes")
            chunks.append(chunk)
        data = b"".join(chunks)
        if request.headers.get("content-encoding", "").lower() == "gzip":
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError) as exc:
                raise InvalidRequest(f"body is not valid gzip: {exc}") from None
        return data

    async def _upload(self, request: Request, sid: str) -> Response:
        user = self._user(request)
        ctype = request.headers.get("content-type", "")
        body = await self._body(request)
        files: list[tuple[str, bytes]] = []
        if ctype.startswith("multipart/form-data"):
            msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                b"Content-Type: " + ctype.encode("latin-1") + b"\r\n\r\n" + body
            )
            if not msg.is_multipart():
                raise InvalidRequest("multipart body without parts")
            only = request.query_params.get("path")
            for part in msg.iter_parts():
                name = part.get_filename() or only
                if not name:
                    raise InvalidRequest("multipart part without a file name or ?path=")
                payload = part.get_payload(decode=True)
                if not isinstance(payload, bytes):
                    raise InvalidRequest(f"multipart part {name!r} has no body")
                files.append((name if len(files) or not only else only, payload))
        else:
            p = request.query_params.get("path")
            if not p:
                raise InvalidRequest("path: required for an octet-stream upload")
            files.append((p, body))
        out = []
        for name, data in files:
            path = guest_path(name, user)
            await self._write(sid, user, path, data)
            out.append({"name": posixpath.basename(path), "type": "file", "path": path})
        return JSONResponse(out)

    async def _write(self, sid: str, user: str, path: str, data: bytes) -> None:
        """Write as E2B does for ``user``: a new file, and the directories the write
        creates, belong to the user; an existing file keeps its owner. (corral's files
        API writes as root, so permissions are not checked against the user.)"""
        new = [] if user == "root" else await self._missing(sid, path)
        await self.ops.file_write(sid, path, data)
        if new:
            await self.ops.exec(sid, ExecRequest(cmd=["chown", f"{user}:", "--", *new], user="0"))

    async def _missing(self, sid: str, path: str) -> list[str]:
        """``path`` and its ancestors that do not exist yet (nearest first)."""
        out: list[str] = []
        while path != "/":
            try:
                await self.ops.file_stat(sid, path)
                break
            except SandboxNotFound:
                raise
            except NotFound:
                out.append(path)
                path = posixpath.dirname(path)
        return out
