"""The E2B control plane (``api.e2b.app``) over :class:`corral.ops.NodeOps`.

Routes: ``POST /sandboxes`` and ``/v2/sandboxes`` (create), ``GET /sandboxes`` and
``/v2/sandboxes`` (list: metadata/state filters, ``x-next-token`` paging),
``GET/DELETE /sandboxes/{id}``, ``POST /sandboxes/{id}/timeout``, ``/pause``,
``/resume``, ``/connect`` and ``/v2/sandboxes/{id}/connect``, ``GET /sandboxes/{id}/metrics``.
Every answer that is an error is ``{"code", "message"}`` with the status E2B uses, which the
SDK maps to its exceptions; a node at capacity answers 429 with ``Retry-After``.

E2B metadata lives in labels (``e2b.m.<key>``), so a list filters with corral's own label
matching and nothing extra is stored. The E2B timeout is the sandbox's corral TTL: create
sets it, ``set_timeout``/``refresh``/``connect`` move it (``NodeOps.sandbox_set_ttl``), and
the node records it and its reaper acts at it, also after a restart of the node: it
destroys the sandbox, or for ``autoPause`` (``SandboxSpec.ttl_action="pause"``) pauses it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from corral.errors import (
    CapacityError,
    CorralError,
    ImageNotFound,
    InvalidRequest,
    NotFound,
    SandboxNotFound,
)
from corral.integrations.e2b._common import (
    ENVD_VERSION,
    LABEL_E2B,
    LABEL_META,
    E2BConfig,
    e2b_error,
    envd_token,
    error_status,
    home_of,
    token_ok,
)
from corral.ops import NodeOps
from corral.spec import ForkRequest, Limits, SandboxInfo, SandboxSpec

log = logging.getLogger("corral.e2b")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _has_entry(table: bytes, name: str) -> bool:
    """Whether a passwd/group file has an entry for ``name``."""
    return any(line.startswith(f"{name}:".encode()) for line in table.splitlines())


def _ids_of(passwd: bytes, name: str) -> tuple[int, int] | None:
    """The uid and gid of ``name`` in a passwd file; None if it has no (usable) entry."""
    for line in passwd.splitlines():
        f = line.split(b":")
        if f[0] == name.encode() and len(f) >= 4 and f[2].isdigit() and f[3].isdigit():
            return int(f[2]), int(f[3])
    return None


def _egress(body: dict[str, Any]) -> tuple[list[str] | None, list[str] | None]:
    """E2B's network settings (``PUT /network``, or ``network`` and
    ``allow_internet_access`` of a create) as corral's egress (allow, deny); what corral
    cannot express is an InvalidRequest naming it."""
    unknown = set(body) - {"allowOut", "denyOut", "allow_internet_access"}
    if unknown:
        raise InvalidRequest(
            f"network: {', '.join(sorted(unknown))} cannot be expressed on corral "
            "(only allowOut and denyOut: CIDRs or corral's named permissions)"
        )
    allow, deny = body.get("allowOut"), body.get("denyOut")
    if body.get("allow_internet_access") is False:
        allow = []  # corral's empty allow list: loopback only
    elif body.get("allow_internet_access") is True:
        raise InvalidRequest(
            "network: allow_internet_access=true cannot be expressed on corral; "
            "allow the node's named permissions instead (allowOut)"
        )
    for v in (allow, deny):
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise InvalidRequest("network: allowOut/denyOut must be lists of strings")
    return allow, deny


class ControlPlane:
    """The E2B REST API. ``app`` is the ASGI app; the caller routes E2B paths to it."""

    def __init__(self, ops: NodeOps, token: str | None, config: E2BConfig) -> None:
        self.ops = ops
        self.token = token
        self.config = config
        # per sandbox: (wall time, CPU seconds) of the last metrics sample, so that
        # cpuUsedPct is the use between two samples (since creation for the first)
        self._cpu_seen: dict[str, tuple[float, float]] = {}
        sb = "/sandboxes/{sandbox_id}"
        self.app = Router(
            routes=[
                Route("/sandboxes", self.create, methods=["POST"]),
                Route("/v2/sandboxes", self.create, methods=["POST"]),
                Route("/sandboxes", self.list_v1, methods=["GET"]),
                Route("/v2/sandboxes", self.list_v2, methods=["GET"]),
                Route(sb, self.get, methods=["GET"]),
                Route(sb, self.kill, methods=["DELETE"]),
                Route(sb + "/timeout", self.timeout, methods=["POST"]),
                Route(sb + "/pause", self.pause, methods=["POST"]),
                Route(sb + "/resume", self.resume, methods=["POST"]),
                Route(sb + "/connect", self.connect, methods=["POST"]),
                Route("/v2" + sb + "/connect", self.connect, methods=["POST"]),
                Route(sb + "/metrics", self.metrics, methods=["GET"]),
                Route(sb + "/refreshes", self.refresh, methods=["POST"]),
                Route(sb + "/snapshots", self.snapshot, methods=["POST"]),
                Route(sb + "/fork", self.fork, methods=["POST"]),
                Route(sb + "/network", self.network, methods=["PUT"]),
                Route("/templates/{name:path}", self.template_delete, methods=["DELETE"]),
            ]
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await JSONResponse(e2b_error(404, "not an E2B route"), 404)(scope, receive, send)
            return
        headers = dict(scope["headers"])
        got = headers.get(b"x-api-key", b"").decode("latin-1") or None
        if not token_ok(self.token, got):
            body = e2b_error(401, "missing or wrong X-API-KEY (use the node's token)")
            await JSONResponse(body, 401)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except CorralError as exc:
            await self._error(exc)(scope, receive, send)

    def _error(self, exc: CorralError) -> Response:
        status = error_status(exc)
        resp = JSONResponse(e2b_error(status, str(exc)), status)
        if status == 429:
            resp.headers["Retry-After"] = str(self.config.retry_after)
        return resp

    # ----------------------------------------------------------------- helpers
    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise InvalidRequest(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("body must be a JSON object")
        return body

    def _timeout(self, body: dict[str, Any], default: int | None) -> int | None:
        t = body.get("timeout", default)
        if t is None:
            return None
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= self.config.max_timeout:
            raise InvalidRequest(
                f"timeout: {t!r} is not whole seconds from 0 to {self.config.max_timeout}"
            )
        return t

    async def _e2b_sandbox(self, sandbox_id: str) -> SandboxInfo:
        try:
            info = await self.ops.sandbox_get(sandbox_id)
        except (SandboxNotFound, InvalidRequest):
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found") from None
        if info.state in ("destroyed", "destroying", "failed"):
            raise SandboxNotFound(f"sandbox {sandbox_id!r} not found")
        return info

    def _created(self, info: SandboxInfo) -> dict[str, Any]:
        template = info.spec.labels.get(LABEL_E2B, info.image)
        out: dict[str, Any] = {
            "templateID": template,
            "sandboxID": info.id,
            "clientID": info.node_id or "corral",
            "envdVersion": ENVD_VERSION,
            "alias": template,
            "domain": None,
        }
        tok = envd_token(self.token, info.id)
        if tok is not None:
            out["envdAccessToken"] = tok
        return out

    def _end_at(self, info: SandboxInfo) -> float:
        if info.expires_at is not None:
            return info.expires_at
        # no TTL: an autoPause sandbox its timeout paused, or one not created through E2B
        return info.created_at + self.config.max_timeout

    async def _set_timeout(self, info: SandboxInfo, seconds: int, extend: bool = False) -> None:
        """End (or for ``autoPause``, pause) the sandbox ``seconds`` from now; with
        ``extend`` only if that is later than its deadline (E2B's connect to a running
        sandbox). E2B's 0 (end it now) is corral's shortest TTL: the next reaper pass."""
        end = time.time() + seconds
        if not extend or info.expires_at is None or info.expires_at < end:
            await self.ops.sandbox_set_ttl(info.id, max(seconds, 0.001))

    def _detail(self, info: SandboxInfo) -> dict[str, Any]:
        out = self._created(info)
        out.update(
            startedAt=_iso(info.created_at),
            endAt=_iso(self._end_at(info)),
            cpuCount=max(1, int(info.spec.limits.cpus)),
            memoryMB=info.spec.limits.memory >> 20,
            diskSizeMB=info.spec.limits.disk >> 20,
            state="paused" if info.state in ("paused", "pausing") else "running",
            metadata={
                k[len(LABEL_META) :]: v
                for k, v in info.spec.labels.items()
                if k.startswith(LABEL_META)
            },
        )
        return out

    # ------------------------------------------------------------------ routes
    async def create(self, request: Request) -> Response:
        body = await self._body(request)
        template = body.get("templateID")
        if not isinstance(template, str) or not template:
            raise InvalidRequest("templateID: required (a template id or alias)")
        image = self.config.templates.get(template, template)
        try:
            await self.ops.image_get(image)
        except (ImageNotFound, InvalidRequest):
            return JSONResponse(
                e2b_error(404, f"template '{template}' not found (no corral image {image!r})"),
                404,
            )
        default = self.config.default_timeout
        timeout = self._timeout(body, default)
        for key in ("mcp", "iam", "volumeMounts"):
            if body.get(key):
                raise InvalidRequest(f"{key} cannot be expressed on corral (not supported)")
        auto_pause = body.get("autoPause") is True
        network = body.get("network")
        if network is not None and not isinstance(network, dict):
            raise InvalidRequest("network must be an object")
        net_body = dict(network or {})
        if "allow_internet_access" in body:
            net_body["allow_internet_access"] = body["allow_internet_access"]
        allow, deny = _egress(net_body)  # checked before anything is created
        metadata = body.get("metadata") or {}
        env = body.get("envVars") or {}
        if not isinstance(metadata, dict) or not isinstance(env, dict):
            raise InvalidRequest("metadata and envVars must be objects of strings")
        labels = {LABEL_E2B: template[:256]}
        for k, v in metadata.items():
            labels[LABEL_META + str(k)] = str(v)
        try:
            spec = SandboxSpec(
                image=image,
                labels=labels,
                env={str(k): str(v) for k, v in env.items()},
                ttl=timeout or default,
                ttl_action="pause" if auto_pause else "destroy",
                limits=Limits(cpus=self.config.cpus, memory=self.config.memory),
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        try:
            info = await self.ops.sandbox_create(spec)
        except CapacityError as exc:
            return self._error(exc)
        try:
            await self._ensure_user(info.id)
            if allow is not None or deny is not None:
                await self.ops.network_update(info.id, allow=allow, deny=deny)
        except BaseException:
            await self.ops.sandbox_destroy(info.id)
            raise
        return JSONResponse(self._created(info), 201)

    async def _ensure_user(self, sandbox_id: str) -> None:
        """Add the default account where the image has none (E2B images have ``user``,
        uid 1000, home /home/user). All of it is files calls on the host side, no process
        in the guest: the passwd/group lines are appended, and the home is made already
        owned by the account (the files API's owner, so no ``chown`` exec: that exec was
        ~half of what this cost). The reads go concurrently; an image built with the
        account and its home costs two reads and a stat."""
        user = self.config.default_user
        if user == "root":
            return
        sid, home = sandbox_id, home_of(user)
        passwd, group, has_bash = await asyncio.gather(
            self._read(sid, "/etc/passwd"),
            self._read(sid, "/etc/group"),
            self._exists(sid, "/bin/bash"),
        )
        ids = _ids_of(passwd, user)
        if ids is None:
            shell = "/bin/bash" if has_bash else "/bin/sh"
            ids = (1000, 1000)
            line = f"{user}:x:1000:1000:{user}:{home}:{shell}"
            await self._append_line(sid, "/etc/passwd", passwd, line)
            if not _has_entry(group, user):
                await self._append_line(sid, "/etc/group", group, f"{user}:x:1000:")
        elif await self._exists(sid, home):
            return
        await self.ops.file_mkdir(sid, home, True, 0o755, ids[0], ids[1])

    async def _read(self, sandbox_id: str, path: str) -> bytes:
        try:
            return await self.ops.file_read(sandbox_id, path)
        except NotFound:
            return b""

    async def _exists(self, sandbox_id: str, path: str) -> bool:
        try:
            await self.ops.file_stat(sandbox_id, path)
        except NotFound:
            return False
        return True

    async def _append_line(self, sandbox_id: str, path: str, old: bytes, line: str) -> None:
        sep = b"\n" if old and not old.endswith(b"\n") else b""
        data = sep + line.encode() + b"\n"
        await self.ops.file_write(sandbox_id, path, data, append=True)

    async def _listed(self, request: Request) -> list[dict[str, Any]]:
        q = request.query_params
        labels: dict[str, str] = {}
        meta = q.get("metadata")
        if meta:
            for k, v in urllib.parse.parse_qsl(meta, keep_blank_values=True):
                labels[LABEL_META + urllib.parse.unquote(k)] = urllib.parse.unquote(v)
        states = {s for s in (q.get("state") or "").split(",") if s}
        out = []
        for info in await self.ops.sandbox_list(labels=labels or None):
            if LABEL_E2B not in info.spec.labels or info.state in ("destroyed", "failed"):
                continue
            d = self._detail(info)
            if states and d["state"] not in states:
                continue
            out.append(d)
        reverse = q.get("order") == "desc"
        out.sort(key=lambda d: (d["startedAt"], d["sandboxID"]), reverse=reverse)
        return out

    async def list_v1(self, request: Request) -> Response:
        return JSONResponse([d for d in await self._listed(request) if d["state"] == "running"])

    async def list_v2(self, request: Request) -> Response:
        items = await self._listed(request)
        q = request.query_params
        try:
            limit = int(q.get("limit") or 100)
        except ValueError:
            raise InvalidRequest(f"limit: {q.get('limit')!r} is not a number") from None
        if not 1 <= limit <= 1000:
            raise InvalidRequest(f"limit: {limit} is not from 1 to 1000")
        start = 0
        token = q.get("nextToken")
        if token:
            # the token is the id of the first sandbox of the next page
            ids = [d["sandboxID"] for d in items]
            if token not in ids:
                raise InvalidRequest(f"nextToken: {token!r} names no sandbox of this list")
            start = ids.index(token)
        page = items[start : start + limit]
        resp = JSONResponse(page)
        if start + limit < len(items):
            resp.headers["x-next-token"] = items[start + limit]["sandboxID"]
        return resp

    async def get(self, request: Request) -> Response:
        info = await self._e2b_sandbox(request.path_params["sandbox_id"])
        return JSONResponse(self._detail(info))

    async def kill(self, request: Request) -> Response:
        sid = request.path_params["sandbox_id"]
        await self._e2b_sandbox(sid)
        await self.ops.sandbox_destroy(sid)
        self._cpu_seen.pop(sid, None)
        return Response(status_code=204)

    async def timeout(self, request: Request) -> Response:
        info = await self._e2b_sandbox(request.path_params["sandbox_id"])
        t = self._timeout(await self._body(request), None)
        if t is None:
            raise InvalidRequest("timeout: required")
        await self._set_timeout(info, t)
        return Response(status_code=204)

    async def refresh(self, request: Request) -> Response:
        info = await self._e2b_sandbox(request.path_params["sandbox_id"])
        body = await self._body(request)
        t = self._timeout({"timeout": body.get("duration", 60)}, None)
        await self._set_timeout(info, t or 60)
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        sid = request.path_params["sandbox_id"]
        info = await self._e2b_sandbox(sid)
        if info.state in ("paused", "pausing"):
            return JSONResponse(e2b_error(409, f"sandbox {sid!r} is already paused"), 409)
        await self.ops.sandbox_pause(sid)
        # E2B: a paused sandbox does not time out; it is kept until killed or resumed. Kept
        # here for max_timeout, so that one nobody comes back to is not kept for ever.
        await self.ops.sandbox_set_ttl(sid, self.config.max_timeout)
        return Response(status_code=204)

    async def _resume(self, request: Request, running_status: int) -> Response:
        sid = request.path_params["sandbox_id"]
        info = await self._e2b_sandbox(sid)
        t = self._timeout(await self._body(request), None)
        status = running_status
        if info.state in ("paused", "pausing"):
            info = await self.ops.sandbox_resume(sid)
            status = 201
            if t is None:  # the pause's long keep ends: it runs on E2B's default timeout
                t = self.config.default_timeout
        if t is not None:
            await self._set_timeout(info, t, extend=status != 201)
        return JSONResponse(self._created(info), status)

    async def resume(self, request: Request) -> Response:
        sid = request.path_params["sandbox_id"]
        info = await self._e2b_sandbox(sid)
        if info.state not in ("paused", "pausing"):
            return JSONResponse(e2b_error(409, f"sandbox {sid!r} is not paused"), 409)
        return await self._resume(request, 201)

    async def connect(self, request: Request) -> Response:
        return await self._resume(request, 200)

    async def metrics(self, request: Request) -> Response:
        info = await self._e2b_sandbox(request.path_params["sandbox_id"])
        now = time.time()
        cpus = max(1, int(info.spec.limits.cpus))
        sample = {
            "timestamp": _iso(now),
            "timestampUnix": int(now),
            "cpuCount": cpus,
            "cpuUsedPct": self._cpu_pct(info, now, cpus),
            "memUsed": info.memory_resident or 0,
            "memTotal": info.spec.limits.memory,
            "memCache": 0,
            "diskUsed": info.disk_used or 0,
            "diskTotal": info.spec.limits.disk,
        }
        return JSONResponse([sample])

    def _cpu_pct(self, info: SandboxInfo, now: float, cpus: int) -> float:
        """Percent of the sandbox's CPUs used since its previous sample (E2B's cpuUsedPct:
        100 is all of ``cpuCount`` busy); 0 where the backend has no CPU figure."""
        if info.cpu_seconds is None:
            return 0.0
        t0, used0 = self._cpu_seen.get(info.id, (info.created_at, 0.0))
        if len(self._cpu_seen) > 100_000:  # destroyed sandboxes' entries: start afresh
            self._cpu_seen.clear()
        self._cpu_seen[info.id] = (now, info.cpu_seconds)
        if now <= t0:
            return 0.0
        return round(max(0.0, info.cpu_seconds - used0) / (now - t0) / cpus * 100, 2)

    async def snapshot(self, request: Request) -> Response:
        """A corral snapshot image; its name is the snapshot id, usable as a template."""
        sid = request.path_params["sandbox_id"]
        await self._e2b_sandbox(sid)
        name = (await self._body(request)).get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise InvalidRequest("name: a non-empty string")
        img = await self.ops.sandbox_snapshot(sid, name)
        return JSONResponse({"snapshotID": img.name, "names": [img.name]}, 201)

    async def fork(self, request: Request) -> Response:
        """``count`` corral forks (files, not processes) with the parent's labels."""
        sid = request.path_params["sandbox_id"]
        await self._e2b_sandbox(sid)
        body = await self._body(request)
        timeout = self._timeout(body, self.config.default_timeout)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 100:
            raise InvalidRequest(f"count: {count!r} is not from 1 to 100")
        try:
            req = ForkRequest(count=count, ttl=timeout or self.config.default_timeout)
            children = await self.ops.sandbox_fork(sid, req)
        except CapacityError as exc:
            return self._error(exc)
        return JSONResponse([{"sandbox": self._created(c)} for c in children], 201)

    async def network(self, request: Request) -> Response:
        """E2B's ``allowOut``/``denyOut`` as corral's egress allow/deny lists, which hold
        the node's named permissions (not CIDRs or domains); what corral cannot express
        is a 400 naming it."""
        sid = request.path_params["sandbox_id"]
        await self._e2b_sandbox(sid)
        allow, deny = _egress(await self._body(request))
        await self.ops.network_update(sid, allow=allow, deny=deny)
        return Response(status_code=204)

    async def template_delete(self, request: Request) -> Response:
        """``delete_snapshot``: removes the corral image of that name (what the node
        token also allows through ``DELETE /v1/images``); corral refuses to remove an
        image a sandbox still uses."""
        try:
            await self.ops.image_remove(request.path_params["name"])
        except ImageNotFound:
            return JSONResponse(e2b_error(404, "snapshot not found"), 404)
        return Response(status_code=204)
