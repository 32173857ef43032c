"""The real ``e2b`` SDK (2.63.0), unmodified, against a real node over HTTP.

The SDK finds the node through E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY, as a user's
harness would. AsyncSandbox is used because the server runs on the test's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.api.server import NodeServer
from corral.host import leaks
from corral.node import Node
from tests.conftest import TAG
from tests.integration.conftest import open_node

e2b = pytest.importorskip("e2b", reason="needs the e2b extra: pip install 'corral[e2b]'")
from e2b import AsyncSandbox  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    NotFoundException,
    SandboxNotFoundException,
    SandboxException,
)

STATE = Path(f"/var/lib/corral-test{TAG}-e2b")
RUN = Path(f"/run/corral-test{TAG}-e2b")
SUBTREE = f"corral-test{TAG}-e2b"
TOKEN = "e2b-test-token"


@pytest.fixture(scope="module")
async def served(images_ready: None) -> AsyncIterator[tuple[Node, str]]:
    async with open_node(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, gc=True) as node:
        async with NodeServer(node, host="127.0.0.1", port=0, token=TOKEN) as srv:
            yield node, srv.address
    found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    assert leaks.total(found) == 0, found


@pytest.fixture
def e2b_env(served: tuple[Node, str], monkeypatch: pytest.MonkeyPatch) -> Node:
    node, address = served
    monkeypatch.setenv("E2B_API_URL", address)
    monkeypatch.setenv("E2B_SANDBOX_URL", address)
    monkeypatch.setenv("E2B_API_KEY", TOKEN)
    return node


@pytest.fixture
async def sbx(e2b_env: Node) -> AsyncIterator[AsyncSandbox]:
    sb = await AsyncSandbox.create("test/debian", timeout=120)
    try:
        yield sb
    finally:
        await sb.kill()


async def test_create_run_and_kill(e2b_env: Node) -> None:
    sb = await AsyncSandbox.create("test/debian", metadata={"job": "smoke"})
    try:
        info = await sb.get_info()
        assert info.sandbox_id == sb.sandbox_id
        assert info.metadata == {"job": "smoke"}
        assert info.state.value == "running"
        assert await sb.is_running()
        r = await sb.commands.run("echo hi; echo err >&2; id -un; pwd")
        assert r.exit_code == 0
        assert r.stdout == "hi\nuser\n/home/user\n"
        assert r.stderr == "err\n"
    finally:
        assert await sb.kill()
    assert (await e2b_env.sandbox_list(labels={"e2b": "test/debian"})) == []
