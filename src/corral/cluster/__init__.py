"""The cluster room: many nodes behind one :class:`~corral.ops.NodeOps`.

- :mod:`~corral.cluster.placement`: which node gets a sandbox (pure, no I/O).
- :mod:`~corral.cluster.fleet`: ``FleetClient``, routing per-sandbox calls by the id's
  node, placing creates, fanning fleet calls out, reporting lost nodes.
- :mod:`~corral.cluster.jobs`: quotas, rate back-pressure, groups and leases of jobs.
- :mod:`~corral.cluster.events`: the control plane's own events (jobs, node loss, bursts).
- :mod:`~corral.cluster.autoscale`: the cloud pool grown and shrunk through Ray's autoscaler.

Ray (the optional extra ``corral[cluster]``) only hosts these; nothing here imports it.
"""

from corral.cluster.autoscale import CloudPool, CloudScaler
from corral.cluster.events import ControlEvents
from corral.cluster.fleet import CLUSTER_ID, FleetClient
from corral.cluster.jobs import JOB_LABEL, Job, JobLimits, JobManager, JobNotFound, TokenBucket
from corral.cluster.placement import (
    NODE_LABEL_PREFIX,
    NodeReport,
    PlacementPolicy,
    Placer,
    place_and_create,
)

__all__ = [
    "CLUSTER_ID",
    "CloudPool",
    "CloudScaler",
    "ControlEvents",
    "FleetClient",
    "JOB_LABEL",
    "Job",
    "JobLimits",
    "JobManager",
    "JobNotFound",
    "TokenBucket",
    "NODE_LABEL_PREFIX",
    "NodeReport",
    "PlacementPolicy",
    "Placer",
    "place_and_create",
]
