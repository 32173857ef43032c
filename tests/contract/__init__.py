"""One contract for every implementation of the sandbox operations (``corral.ops.NodeOps``).

The suite (:class:`tests.contract.suite.OpsContract`) asserts the operations' observable
behaviour once; ``tests/unit/test_contract_fake.py`` runs it against the in-memory
``corral.testing.FakeNode`` (no root) and ``tests/integration/test_contract_node.py``
against the real ``corral.node.Node`` (runc, overlay, cgroups). A behaviour that differs
between the two fails one side, so the fake that SDK, API and CLI tests stand on cannot
drift from the node it stands in for.
"""
