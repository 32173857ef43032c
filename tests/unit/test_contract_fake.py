"""The operations' contract (tests/contract) against FakeNode: the SDK, API and CLI tests
stand on it, so it must behave as the real node does (tests/integration/test_contract_node.py
runs the same suite there)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from corral.api import create_app
from corral.ops import NodeOps
from corral.sdk._http import HTTPOps
from corral.testing import FakeNode
from tests.contract.suite import OpsContract


class TestFakeNode(OpsContract):
    image = "demo/python"

    @pytest.fixture(scope="class")
    @classmethod
    async def ops(cls) -> AsyncIterator[NodeOps]:
        node = FakeNode()
        yield node
        await node.close()


class TestFakeNodeOverHTTP(OpsContract):
    """The same contract through the REST API and the HTTP client: what crosses the wire
    (errors by kind, bytes, streams) must arrive as the node said it."""

    image = "demo/python"

    @pytest.fixture(scope="class")
    @classmethod
    async def ops(cls) -> AsyncIterator[NodeOps]:
        node = FakeNode()
        http = HTTPOps("http://corral.test", transport=httpx.ASGITransport(create_app(node)))
        yield http
        await http.close()
        await node.close()
