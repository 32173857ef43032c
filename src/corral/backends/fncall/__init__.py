"""fncall: short function calls (online-judge tasks, snippets) served from warm pools.

``worker.py`` runs inside pool sandboxes; ``sandbox.py`` is the node's side of one pool
sandbox (channel + kernel meters); ``checkers.py`` the judge's checkers; ``config.py`` the
language table and pool configuration. The pools themselves live in ``corral.node.fncall``.
"""
