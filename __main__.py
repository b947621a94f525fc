"""`python -m vramgraph` runs the command line."""

from __future__ import annotations

import sys

from .cli.main import main

sys.exit(main())
