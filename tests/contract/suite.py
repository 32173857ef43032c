"""The whole contract: subclass :class:`OpsContract` once per implementation.

    class TestFakeNode(OpsContract):
        image = "demo/python"

        @pytest.fixture(scope="class")
        async def ops(self) -> AsyncIterator[NodeOps]:
            node = FakeNode()
            yield node
            await node.close()

See :mod:`tests.contract.base` for what the image must hold and which sandboxes it makes.
"""

from __future__ import annotations

from tests.contract.derived import DerivedContract
from tests.contract.files import FilesContract
from tests.contract.lifecycle import LifecycleContract
from tests.contract.running import RunContract

__all__ = ["OpsContract"]


class OpsContract(LifecycleContract, RunContract, FilesContract, DerivedContract):
    """Every part of the operations' contract."""
