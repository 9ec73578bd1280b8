"""Thread counts as torchrun sets them, for workers started by hand.

torchrun sets ``OMP_NUM_THREADS=1`` for its workers unless the user set it,
so that several workers on one machine do not each start a thread per core.
A worker started without torchrun (by hand, by the demo, by a scheduler of
its own) gets the same default from the Manager; ``OMP_NUM_THREADS`` set in
the environment is left as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

log = logging.getLogger(__name__)
_TORCHRUN = "TORCHELASTIC_RUN_ID"
"""Set by torchrun for its workers (which already got its thread default)."""


def apply_thread_default(environ: Mapping[str, str] | None = None) -> int | None:
    """Give this process one intra-op thread when neither the user nor torchrun chose; the count set, or None."""
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS") or env.get(_TORCHRUN):
        return None
    if torch.get_num_threads() != 1:
        log.info("OMP_NUM_THREADS is not set: using 1 thread per worker, as torchrun does (set it to change)")
        torch.set_num_threads(1)
    return 1
