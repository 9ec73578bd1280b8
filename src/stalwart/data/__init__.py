"""Pure data placement: epoch order, step schedule, the ledger, samplers and streams.

No network and no torch.distributed here: every rule about which sample goes
where lives in this package once, and the lighthouse and the workers both call it.

The public names below are imported on first use (PEP 562), as the top
package's are: the lighthouse reads plans and the ledger from here without
importing torch (which the shards and samplers need).
"""

from __future__ import annotations

from stalwart._exports import lazy_exports

_LOCATIONS: dict[str, str] = {
    "AuditWriter": "stalwart.data.audit",
    "DataLedger": "stalwart.data.ledger",
    "DataLoadingInfo": "stalwart.data.info",
    "DataLoadingInfoSource": "stalwart.data.info",
    "EpochPlan": "stalwart.data.plan",
    "FeistelPermutation": "stalwart.data.permutation",
    "InMemoryShard": "stalwart.data.shards",
    "LocalLedgerSource": "stalwart.data.info",
    "ManagedDistributedSampler": "stalwart.data.sampler",
    "ParquetShard": "stalwart.data.shards",
    "ShardError": "stalwart.data.shard_identity",
    "ShardedDataset": "stalwart.data.shards",
    "ShardedStream": "stalwart.data.streaming",
    "StreamBatch": "stalwart.data.streaming",
    "WorldInfo": "stalwart.data.world",
    "audit_directory": "stalwart.data.audit",
    "coverage": "stalwart.data.audit",
    "split_group_share": "stalwart.data.info",
    "split_microbatches": "stalwart.data.schedule",
    "split_sizes": "stalwart.data.schedule",
    "step_boundary": "stalwart.data.schedule",
    "step_total": "stalwart.data.schedule",
    "write_expected": "stalwart.data.audit",
}
"""Public name -> the module of this package that defines it."""

__all__ = sorted(_LOCATIONS)


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LOCATIONS)
