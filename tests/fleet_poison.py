"""`python tests/fleet_poison.py worker …`: a fleet worker whose sampler kills its own process with SIGKILL, as the
kernel's out-of-memory killer does, when it is asked to sample with seed POISON_SEED: the poison prompt of
tests/test_fleet_chaos.py. Every other prompt runs as in `vramgraph worker`."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

POISON_SEED = 666013


def main() -> int:
    from vramgraph.__main__ import main as vramgraph_main
    from vramgraph.nodes.vg import VGSampler

    sample = VGSampler.sample

    def poisoned(self: Any, *args: Any, **kwargs: Any) -> Any:
        seed = kwargs["seed"] if "seed" in kwargs else args[3] if len(args) > 3 else None
        if seed == POISON_SEED:
            os.kill(os.getpid(), signal.SIGKILL)
        return sample(self, *args, **kwargs)

    VGSampler.sample = poisoned  # type: ignore[method-assign]
    return vramgraph_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
