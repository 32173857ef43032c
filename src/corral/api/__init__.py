"""The node's REST API (FastAPI) and its server (uvicorn).

Importing this package imports FastAPI; ``import corral`` does not.
"""

from corral.api.app import create_app
from corral.api.server import NodeServer, serve

__all__ = ["create_app", "serve", "NodeServer"]
