"""Pure data placement: epoch order, step schedule, the ledger, samplers and streams.

No network and no torch.distributed here: every rule about which sample goes
where lives in this package once, and the lighthouse and the workers both call it.
"""

from stalwart.data.ledger import DataLedger
from stalwart.data.permutation import FeistelPermutation
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_microbatches, split_sizes, step_boundary, step_total

__all__ = [
    "DataLedger",
    "EpochPlan",
    "FeistelPermutation",
    "split_microbatches",
    "split_sizes",
    "step_boundary",
    "step_total",
]
