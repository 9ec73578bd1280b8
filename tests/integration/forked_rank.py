"""A process of a :class:`~stalwart.testing.groups.ForkedGroup` in ``test_processes``: it records torchrun's
variables as it got them, then the rank named by its options exits with the status they name while the others
end well, or, with ``--others-wait``, wait (bounded) to be killed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables of torchrun's that the process records."""
WAIT_LIMIT = 300.0
"""How long a waiting rank waits before it ends on its own (the test kills it long before)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--failing-rank", type=int, default=-1)
    parser.add_argument("--status", type=int, default=0)
    parser.add_argument("--others-wait", action="store_true")
    options = parser.parse_args()
    rank = int(os.environ["RANK"])
    (options.out / f"rank-{rank}.json").write_text(json.dumps({name: os.environ.get(name) for name in VARIABLES}))
    if rank == options.failing_rank:
        sys.exit(options.status)
    if options.others_wait:
        time.sleep(WAIT_LIMIT)
