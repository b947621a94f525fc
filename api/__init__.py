"""The Python API: `Pipeline` (api/pipeline.py), which loads models once and keeps them across calls.

    from vramgraph.api import Pipeline      # or: from vramgraph import Pipeline
"""

from __future__ import annotations

from .pipeline import Generated, Outputs, Pipeline, load

__all__ = ["Generated", "Outputs", "Pipeline", "load"]
