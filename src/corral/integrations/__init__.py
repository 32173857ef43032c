"""Other platforms' protocols spoken by corral, built on the operations interface only.

Each integration takes a :class:`corral.ops.NodeOps` and nothing of the node's insides,
so it serves one node now and a cluster client later unchanged:

- :mod:`corral.integrations.e2b`: the E2B control plane and envd (the ``e2b`` package,
  unmodified, runs against a corral node). Needs the ``corral[e2b]`` extra.
"""
