"""`python -m vramgraph` and the `vramgraph` command: the command line (cli/) with `serve` from server/.

This is the one place that sees both entry points' rooms; cli/ and server/ never import each other.
"""

from __future__ import annotations

import argparse
import sys


def _serve(args: argparse.Namespace) -> int:
    from .server.app import serve

    return serve(args)


def _worker(args: argparse.Namespace) -> int:
    from .server.fleet_worker import work

    return work(args)


def main(argv: list[str] | None = None) -> int:
    from .cli.main import main as cli_main

    return cli_main(argv, {"serve": _serve, "worker": _worker})


if __name__ == "__main__":
    sys.exit(main())
