"""The E2B gateway over the FakeNode: routing, auth, the control plane's status codes and
error bodies, and envd's answers to bad input (no root, no e2b SDK calls: raw HTTP)."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator

import httpx
import pytest

from corral.api.app import create_app
from corral.testing import FakeNode

pytest.importorskip("e2b", reason="needs the e2b extra: pip install 'corral[e2b]'")

from corral.integrations.e2b import E2BConfig, E2BGateway, envd_token  # noqa: E402

TOKEN = "t0k"
KEY = {"X-API-KEY": TOKEN}


def _app(node: FakeNode, max_upload: int = 1 << 20) -> E2BGateway:
    # root: the FakeNode's toy exec cannot add the default account
    config = E2BConfig(templates={"base": "demo/base"}, default_user="root")
    inner = create_app(node, token=TOKEN)
    return E2BGateway(inner, node, token=TOKEN, config=config, max_upload=max_upload)


@pytest.fixture
async def http() -> AsyncIterator[tuple[FakeNode, httpx.AsyncClient]]:
    node = FakeNode(max_sandboxes=3)
    transport = httpx.ASGITransport(_app(node))
    async with httpx.AsyncClient(transport=transport, base_url="http://node.test") as c:
        yield node, c


def _is_e2b_error(resp: httpx.Response, code: int) -> None:
    assert resp.status_code == code, resp.text
    body = resp.json()
    assert set(body) == {"code", "message"} and body["code"] == code and body["message"]


async def _create(c: httpx.AsyncClient, **body: object) -> dict[str, str]:
    r = await c.post("/v2/sandboxes", json={"templateID": "base", **body}, headers=KEY)
    assert r.status_code == 201, r.text
    return r.json()


async def test_api_key_is_checked(http: tuple[FakeNode, httpx.AsyncClient]) -> None:
    _, c = http
    _is_e2b_error(await c.get("/v2/sandboxes"), 401)
    _is_e2b_error(await c.get("/v2/sandboxes", headers={"X-API-KEY": "wrong"}), 401)
    assert (await c.get("/v2/sandboxes", headers=KEY)).json() == []
    # corral's own API keeps its bearer token; the E2B key does not open it
    assert (await c.get("/v1/sandboxes", headers=KEY)).status_code == 401


async def test_lifecycle_status_codes(http: tuple[FakeNode, httpx.AsyncClient]) -> None:
    _, c = http
    sb = await _create(c, metadata={"k": "v"}, timeout=60)
    sid = sb["sandboxID"]
    assert sb["envdVersion"] >= "0.6.4" and sb["envdAccessToken"] == envd_token(TOKEN, sid)
    detail = (await c.get(f"/sandboxes/{sid}", headers=KEY)).json()
    assert detail["state"] == "running" and detail["metadata"] == {"k": "v"}
    assert (await c.post(f"/sandboxes/{sid}/pause", headers=KEY)).status_code == 204
    _is_e2b_error(await c.post(f"/sandboxes/{sid}/pause", headers=KEY), 409)
    r = await c.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 30}, headers=KEY)
    assert r.status_code == 201 and r.json()["sandboxID"] == sid
    r = await c.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 30}, headers=KEY)
    assert r.status_code == 200
    assert (
        await c.post(f"/sandboxes/{sid}/timeout", json={"timeout": 5}, headers=KEY)
    ).status_code == 204
    assert (await c.delete(f"/sandboxes/{sid}", headers=KEY)).status_code == 204
    _is_e2b_error(await c.delete(f"/sandboxes/{sid}", headers=KEY), 404)
    _is_e2b_error(await c.get(f"/sandboxes/{sid}", headers=KEY), 404)
    # the legacy create and list routes (older SDKs) answer the same shapes
    r = await c.post("/sandboxes", json={"templateID": "base"}, headers=KEY)
    assert r.status_code == 201 and r.json()["envdVersion"] >= "0.6.4"
    listed = (await c.get("/sandboxes", headers=KEY)).json()
    assert [d["sandboxID"] for d in listed] == [r.json()["sandboxID"]]


async def test_bad_requests(http: tuple[FakeNode, httpx.AsyncClient]) -> None:
    _, c = http
    _is_e2b_error(await c.post("/v2/sandboxes", json={"templateID": "no/such"}, headers=KEY), 404)
    _is_e2b_error(await c.post("/v2/sandboxes", content=b"{not json", headers=KEY), 400)
    _is_e2b_error(await c.post("/v2/sandboxes", json={}, headers=KEY), 400)
    _is_e2b_error(
        await c.post("/v2/sandboxes", json={"templateID": "base", "timeout": -1}, headers=KEY), 400
    )
    _is_e2b_error(await c.get("/v2/sandboxes?nextToken=bogus", headers=KEY), 400)


async def test_capacity_is_429_with_retry_after(http: tuple[FakeNode, httpx.AsyncClient]) -> None:
    _, c = http
    for _ in range(3):
        await _create(c)
    r = await c.post("/v2/sandboxes", json={"templateID": "base"}, headers=KEY)
    _is_e2b_error(r, 429)
    assert r.headers["retry-after"].isdigit()
    # the SDK would retry: Should-Retry is not set, so 429 alone marks it retryable
    # (test_the_sdk_retries_a_429_after_retry_after runs the SDK's own retry transport)


async def test_the_sdk_retries_a_429_after_retry_after() -> None:
    """The e2b SDK's control-plane transport (``AsyncRetryableTransport``, 3 retries by
    default) over the gateway: a create at capacity waits the ``Retry-After`` the node
    sent, and succeeds once a slot is free."""
    from e2b.retry import AsyncRetryableTransport

    node = FakeNode(max_sandboxes=1)
    waited: list[float] = []

    async def sleep(delay: float) -> None:  # the SDK's wait: free a slot instead of sleeping
        waited.append(delay)
        for info in await node.sandbox_list():
            await node.sandbox_destroy(info.id)

    inner = httpx.ASGITransport(_app(node))
    transport = AsyncRetryableTransport(inner, 3, sleep=sleep)
    async with httpx.AsyncClient(transport=transport, base_url="http://node.test") as c:
        await _create(c)
        r = await c.post("/v2/sandboxes", json={"templateID": "base"}, headers=KEY, timeout=30)
    assert r.status_code == 201, r.text
    assert waited == [1.0]  # E2BConfig.retry_after


async def test_list_paging_and_filters(http: tuple[FakeNode, httpx.AsyncClient]) -> None:
    _, c = http
    ids = {(await _create(c, metadata={"run": "a"}))["sandboxID"] for _ in range(2)}
    other = (await _create(c, metadata={"run": "b"}))["sandboxID"]
    r = await c.get("/v2/sandboxes", params={"metadata": "run=a", "limit": 1}, headers=KEY)
    token = r.headers["x-next-token"]
    r2 = await c.get(
        "/v2/sandboxes", params={"metadata": "run=a", "limit": 1, "nextToken": token}, headers=KEY
    )
    assert "x-next-token" not in r2.headers
    assert {d["sandboxID"] for d in r.json() + r2.json()} == ids
    paused = await c.get("/v2/sandboxes", params={"state": "paused"}, headers=KEY)
    assert paused.json() == []
    await c.post(f"/sandboxes/{other}/pause", headers=KEY)
    paused = await c.get("/v2/sandboxes", params={"state": "paused"}, headers=KEY)
    assert [d["sandboxID"] for d in paused.json()] == [other]


async def test_envd_refuses_bad_input(http: tuple[FakeNode, httpx.AsyncClient]) -> None:
    _, c = http
    a = (await _create(c))["sandboxID"]
    b = (await _create(c))["sandboxID"]
    own = {"E2b-Sandbox-Id": a, "X-Access-Token": envd_token(TOKEN, a) or ""}
    assert (await c.get("/health", headers=own)).status_code == 204
    # no token, and a token of another sandbox
    _is_e2b_error(await c.get("/health", headers={"E2b-Sandbox-Id": a}), 401)
    _is_e2b_error(await c.get("/health", headers={**own, "E2b-Sandbox-Id": b}), 401)
    # oversized upload
    r = await c.post(
        "/files",
        params={"path": "/tmp/x"},
        content=b"x" * ((1 << 20) + 1),
        headers={**own, "Content-Type": "application/octet-stream"},
    )
    _is_e2b_error(r, 400)
    # a file that is not there
    _is_e2b_error(await c.get("/files", params={"path": "/nope"}, headers=own), 404)
    # Connect: an unknown method, and a frame that is not protobuf
    proto = {**own, "Content-Type": "application/proto", "Connect-Protocol-Version": "1"}
    r = await c.post("/process.Process/Nope", content=b"", headers=proto)
    assert r.status_code == 404
    r = await c.post("/filesystem.Filesystem/Stat", content=b"\xff\xff\xff", headers=proto)
    assert 400 <= r.status_code < 500, r.text
    stream = {**own, "Content-Type": "application/connect+proto", "Connect-Protocol-Version": "1"}
    bad_frame = struct.pack(">BI", 0, 1000) + b"short"
    r = await c.post("/process.Process/Start", content=bad_frame, headers=stream)
    assert r.status_code < 500 or r.status_code == 200, r.text  # an error in the stream's end


async def test_sandbox_gone_reads_as_not_running(http: tuple[FakeNode, httpx.AsyncClient]) -> None:
    _, c = http
    a = (await _create(c))["sandboxID"]
    own = {"E2b-Sandbox-Id": a, "X-Access-Token": envd_token(TOKEN, a) or ""}
    await c.delete(f"/sandboxes/{a}", headers=KEY)
    r = await c.get("/health", headers=own)
    _is_e2b_error(r, 502)
    assert "was not found" in r.json()["message"]


async def test_network_fork_and_snapshot(http: tuple[FakeNode, httpx.AsyncClient]) -> None:
    _, c = http
    sid = (await _create(c))["sandboxID"]
    r = await c.put(f"/sandboxes/{sid}/network", json={"egressProxy": {}}, headers=KEY)
    _is_e2b_error(r, 400)
    assert "egressProxy" in r.json()["message"]
    # corral's policy holds named permissions, not CIDRs: a clear 400
    r = await c.put(f"/sandboxes/{sid}/network", json={"denyOut": ["10.0.0.0/8"]}, headers=KEY)
    _is_e2b_error(r, 400)
    r = await c.put(f"/sandboxes/{sid}/network", json={"allow_internet_access": False}, headers=KEY)
    assert r.status_code == 204, r.text
    r = await c.post(f"/sandboxes/{sid}/snapshots", json={}, headers=KEY)
    assert r.status_code == 201 and r.json()["names"] == [r.json()["snapshotID"]]
    r = await c.post(f"/sandboxes/{sid}/fork", json={"count": 2}, headers=KEY)
    assert r.status_code == 201, r.text
    assert len(r.json()) == 2 and all(f["sandbox"]["sandboxID"] != sid for f in r.json())
    _is_e2b_error(await c.post(f"/sandboxes/{sid}/fork", json={"count": 0}, headers=KEY), 400)


async def test_an_unexpected_error_is_a_500_in_e2b_shape(
    http: tuple[FakeNode, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    node, c = http

    async def broken(*a: object, **k: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(node, "sandbox_list", broken)
    _is_e2b_error(await c.get("/v2/sandboxes", headers=KEY), 500)


async def test_template_table_from_the_node_config() -> None:
    """``[node] e2b_templates`` (or ``serve --e2b-template``) is the table create_app's
    gateway uses, over the built-in one."""
    from types import SimpleNamespace

    from corral.cli.node import _parse_templates
    from corral.errors import InvalidRequest
    from corral.integrations.e2b import e2b_config
    from corral.node.config import NodeConfig

    cfg = NodeConfig(e2b_templates=_parse_templates(["py=no/image", "base = demo/other"]))
    node = FakeNode()
    node.config = cfg  # type: ignore[attr-defined]
    assert e2b_config(node).templates == {"base": "demo/other", "py": "no/image"}
    assert e2b_config(SimpleNamespace()).templates == {"base": "base/debian"}
    with pytest.raises(InvalidRequest, match="TEMPLATE=IMAGE"):
        _parse_templates(["nosep"])
    # the served app maps through the node's table (the 404 names the image it looked for;
    # a create that succeeds needs a real exec to add E2B's account)
    transport = httpx.ASGITransport(create_app(node, token=TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node.test") as c:
        r = await c.post("/v2/sandboxes", json={"templateID": "py"}, headers=KEY)
        _is_e2b_error(r, 404)
        assert "'no/image'" in r.json()["message"]


async def test_create_options_network_and_auto_pause(
    http: tuple[FakeNode, httpx.AsyncClient],
) -> None:
    """A create's ``network``/``allow_internet_access`` become corral's egress lists; what
    corral cannot express is a 400 and leaves no sandbox; ``autoPause`` pauses at the
    deadline instead of killing."""
    node, c = http
    for body, word in (
        ({"mcp": {"x": {}}}, "mcp"),
        ({"volumeMounts": [{"name": "v", "path": "/v"}]}, "volumeMounts"),
        ({"allow_internet_access": True}, "allow_internet_access"),
        ({"network": {"rules": {}}}, "rules"),
        ({"network": {"denyOut": ["10.0.0.0/8"]}}, "10.0.0.0/8"),
    ):
        r = await c.post("/v2/sandboxes", json={"templateID": "base", **body}, headers=KEY)
        _is_e2b_error(r, 400)
        assert word in r.json()["message"], r.json()
    assert await node.sandbox_list() == []  # the refused network left nothing behind
    sid = (await _create(c, allow_internet_access=False))["sandboxID"]
    assert (await node.sandbox_get(sid)).spec.network.allow == []
    paused = (await _create(c, autoPause=True, timeout=1))["sandboxID"]
    info = await node.sandbox_get(paused)  # the node's reaper pauses it (test_e2b.py)
    assert (info.spec.ttl_action, info.spec.ttl) == ("pause", 1)
    await node.sandbox_pause(paused)
    r = await c.post(f"/v2/sandboxes/{paused}/connect", json={"timeout": 30}, headers=KEY)
    assert r.status_code == 201


async def test_create_adds_the_account_without_an_exec() -> None:
    """The default account: passwd/group lines and a home the files API makes already
    owned by uid 1000, no process run in the guest (the chown exec is gone)."""
    node = FakeNode()
    execs: list[object] = []

    async def no_exec(*args: object, **kw: object) -> None:
        execs.append(args)
        raise AssertionError("an exec during the E2B create")

    node.exec = no_exec  # type: ignore[method-assign,assignment]
    config = E2BConfig(templates={"base": "demo/base"})
    gw = E2BGateway(create_app(node, token=TOKEN), node, token=TOKEN, config=config)
    transport = httpx.ASGITransport(gw)
    async with httpx.AsyncClient(transport=transport, base_url="http://node.test") as c:
        sid = (await _create(c))["sandboxID"]
    assert b"\nuser:x:1000:1000:" in b"\n" + await node.file_read(sid, "/etc/passwd")
    assert b"user:x:1000:" in await node.file_read(sid, "/etc/group")
    st = await node.file_stat(sid, "/home/user")
    assert (st.type, st.uid, st.gid) == ("dir", 1000, 1000)
    assert execs == []


async def test_timeouts_are_the_corral_ttl(http: tuple[FakeNode, httpx.AsyncClient]) -> None:
    """create, set_timeout and connect move the sandbox's recorded ``expires_at``."""
    node, c = http
    sid = (await _create(c, timeout=60))["sandboxID"]
    info = await node.sandbox_get(sid)
    assert info.expires_at is not None and 50 < info.expires_at - info.created_at <= 61
    r = await c.post(f"/sandboxes/{sid}/timeout", json={"timeout": 3000}, headers=KEY)
    assert r.status_code == 204, r.text
    longer = (await node.sandbox_get(sid)).expires_at
    assert longer is not None and longer > info.expires_at + 2000
    r = await c.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 30}, headers=KEY)
    assert r.status_code == 200, r.text
    assert (await node.sandbox_get(sid)).expires_at == longer  # connect only extends
    got = (await c.get(f"/sandboxes/{sid}", headers=KEY)).json()
    assert got["endAt"].startswith(_iso_prefix(longer))


def _iso_prefix(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).isoformat()[:19]
