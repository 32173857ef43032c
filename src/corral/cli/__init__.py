"""corral's command-line interface (``corral ...``); see :mod:`corral.cli.app`."""

from corral.cli.app import main

__all__ = ["main"]
