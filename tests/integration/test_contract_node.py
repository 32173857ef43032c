"""The operations' contract (tests/contract) against the real node: one node (the session's)
and a handful of sandboxes of ``test/debian``. The same suite runs against FakeNode in
tests/unit/test_contract_fake.py."""

from __future__ import annotations

import os

import pytest

from corral.node import Node
from corral.ops import NodeOps
from tests.contract.suite import OpsContract

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


class TestNode(OpsContract):
    image = "test/debian"

    @pytest.fixture(scope="class")
    @classmethod
    def ops(cls, node: Node) -> NodeOps:
        return node
