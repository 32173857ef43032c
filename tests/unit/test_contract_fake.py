"""The operations' contract (tests/contract) against FakeNode: the SDK, API and CLI tests
stand on it, so it must behave as the real node does (tests/integration/test_contract_node.py
runs the same suite there)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from corral.ops import NodeOps
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
