"""The operations' contract (tests/contract) against the real node: one node (the session's)
and a handful of sandboxes of ``test/debian``, called directly and through the REST API
and the HTTP client. The same suite runs against FakeNode in tests/unit/test_contract_fake.py."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import httpx
import pytest

from corral.api import create_app
from corral.node import Node
from corral.ops import NodeOps
from corral.sdk._http import HTTPOps
from tests.contract.suite import OpsContract

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


class TestNode(OpsContract):
    image = "test/debian"

    @pytest.fixture(scope="class")
    @classmethod
    def ops(cls, node: Node) -> NodeOps:
        return node


class TestNodeOverHTTP(OpsContract):
    image = "test/debian"

    @pytest.fixture(scope="class")
    @classmethod
    async def ops(cls, node: Node) -> AsyncIterator[NodeOps]:
        http = HTTPOps("http://corral.test", transport=httpx.ASGITransport(create_app(node)))
        yield http
        await http.close()
