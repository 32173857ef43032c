"""The node agent: lifecycle, state, reaper, recovery."""

from corral.node.config import NodeConfig
from corral.node.node import Node

__all__ = ["Node", "NodeConfig"]
