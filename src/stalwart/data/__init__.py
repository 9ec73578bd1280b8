"""Pure data placement: epoch order, step schedule, the ledger, samplers and streams.

No network and no torch.distributed here: every rule about which sample goes
where lives in this package once, and the lighthouse and the workers both call it.
"""

from stalwart.data.audit import AuditWriter, audit_directory, coverage, write_expected
from stalwart.data.info import DataLoadingInfo, DataLoadingInfoSource, LocalLedgerSource, split_group_share
from stalwart.data.ledger import DataLedger
from stalwart.data.permutation import FeistelPermutation
from stalwart.data.plan import EpochPlan
from stalwart.data.sampler import ManagedDistributedSampler
from stalwart.data.schedule import split_microbatches, split_sizes, step_boundary, step_total
from stalwart.data.shards import InMemoryShard, ParquetShard, ShardedDataset, ShardError
from stalwart.data.streaming import ShardedStream, StreamBatch
from stalwart.data.world import WorldInfo

__all__ = [
    "AuditWriter",
    "DataLedger",
    "DataLoadingInfo",
    "DataLoadingInfoSource",
    "EpochPlan",
    "FeistelPermutation",
    "InMemoryShard",
    "LocalLedgerSource",
    "ManagedDistributedSampler",
    "ParquetShard",
    "ShardError",
    "ShardedDataset",
    "ShardedStream",
    "StreamBatch",
    "WorldInfo",
    "audit_directory",
    "coverage",
    "split_group_share",
    "split_microbatches",
    "split_sizes",
    "step_boundary",
    "step_total",
    "write_expected",
]
