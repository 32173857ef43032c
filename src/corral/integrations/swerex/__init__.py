"""Run SWE-ReX (and so SWE-agent) on corral: ``pip install 'corral[swerex]'``.

:class:`CorralDeployment` implements swe-rex 1.4.0's deployment interface: it creates a
sandbox from a toolkit image (``corral swerex image``: a base image plus ``swe-rex`` in
``/opt/swerex``), starts ``swerex-remote`` in it, and drives it with swe-rex's own
``RemoteRuntime`` through the node's port proxy (the guest needs no network). See
docs/swerex.md for SWE-agent.
"""

from corral.integrations.swerex._deployment import CorralDeployment, CorralDeploymentConfig
from corral.integrations.swerex._toolkit import SWEREX_REQUIREMENT, TOOLKIT_DIR, ensure_image

__all__ = [
    "CorralDeployment",
    "CorralDeploymentConfig",
    "SWEREX_REQUIREMENT",
    "TOOLKIT_DIR",
    "ensure_image",
]
