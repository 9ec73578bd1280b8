"""Placement is deterministic across interpreters: no set or hash order leaks into which process holds what."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_placement_is_the_same_in_every_process() -> None:
    """Two interpreters with different hash seeds place the same way (no set or hash order leaks in)."""
    code = (
        "import json; from stalwart.redundancy import Parity, Overlap, place; "
        "nodes = ['h%d' % (p % 5) for p in range(23)]; "
        "print(json.dumps([repr(place(Parity(3, 2), nodes)), repr(place(Overlap(0.2), nodes))]))"
    )
    outputs = []
    for seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            timeout=120,
            check=True,
        )
        outputs.append(json.loads(done.stdout))
    assert outputs[0] == outputs[1]
