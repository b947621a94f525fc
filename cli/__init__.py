"""The command line (`vramgraph ...`): commands in `main.py`, the interactive session, the demo."""

from __future__ import annotations

from .main import main

__all__ = ["main"]
