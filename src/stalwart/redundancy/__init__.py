"""Redundancy of sharded optimizer state: the choice, its placement over processes and nodes, and its memory.

Pure logic, no I/O and no torch here, so that ``stalwart redundancy`` answers
at once. The erasure code on tensors is :mod:`stalwart.redundancy.parity`,
imported on its own (it needs torch, and pyeclib for ``m >= 2``).
"""

from stalwart.redundancy.config import Overlap, Parity, Redundancy, parse_parity, parse_redundancy
from stalwart.redundancy.memory import OPTIMIZER_STATE_ELEMENTS, split_lengths, state_bytes
from stalwart.redundancy.placement import (
    Cell,
    FailurePattern,
    Placement,
    Stripe,
    lost_shards,
    place,
    survived_patterns,
    survives,
)

__all__ = [
    "OPTIMIZER_STATE_ELEMENTS",
    "Cell",
    "FailurePattern",
    "Overlap",
    "Parity",
    "Placement",
    "Redundancy",
    "Stripe",
    "lost_shards",
    "parse_parity",
    "parse_redundancy",
    "place",
    "split_lengths",
    "state_bytes",
    "survived_patterns",
    "survives",
]
