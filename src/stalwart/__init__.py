"""stalwart: fault-tolerant, elastic data-parallel training for PyTorch.

Workers die and join while training goes on: the global batch stays the size
asked for, every sample of an epoch is trained on exactly once, and sharded
optimizer state survives the loss of a node.

The public names below are imported on first use (PEP 562), so that
``import stalwart`` (and the ``stalwart`` command's help) does not pay for
importing torch.
"""

from __future__ import annotations

from stalwart._exports import lazy_exports

__version__ = "0.1.0"

_LOCATIONS: dict[str, str] = {
    "Manager": "stalwart.runtime.manager",
    "StepReport": "stalwart.runtime.step",
    "TrainStep": "stalwart.runtime.step",
    "Event": "stalwart.runtime.events",
    "Checkpointing": "stalwart.runtime.config",
    "Checks": "stalwart.runtime.config",
    "Reduction": "stalwart.runtime.config",
    "ReplicaGroup": "stalwart.runtime.config",
    "Transport": "stalwart.runtime.config",
    "Timeouts": "stalwart.runtime.timeouts",
    "DiLoCo": "stalwart.runtime.diloco.config",
    "ElasticLoader": "stalwart.runtime.loader",
    "sample_generator": "stalwart.runtime.loader",
    "DataLoadingInfo": "stalwart.data",
    "EpochPlan": "stalwart.data",
    "ManagedDistributedSampler": "stalwart.data",
    "ShardedDataset": "stalwart.data",
    "ShardedStream": "stalwart.data",
    "WorldInfo": "stalwart.data",
    "Overlap": "stalwart.redundancy.config",
    "Parity": "stalwart.redundancy.config",
    "Lighthouse": "stalwart.coord.server",
    "LighthouseSettings": "stalwart.coord.settings",
    "StalwartError": "stalwart.errors",
    "JobFinishedError": "stalwart.errors",
    "JoinError": "stalwart.errors",
    "PlanMismatchError": "stalwart.errors",
    "ShardingMismatchError": "stalwart.errors",
    "StateLostError": "stalwart.errors",
    "StepContractError": "stalwart.errors",
    "InsecureLighthouseError": "stalwart.errors",
    "AuditFileError": "stalwart.data.audit",
    "ExposedSecretError": "stalwart.coord.tls",
    "RequestError": "stalwart.coord.wire",
    "StaleAnswer": "stalwart.coord.protocol",
    "StateLockedError": "stalwart.coord.persist",
    "StoreGone": "stalwart.coord.store",
    "GroupBrokenError": "stalwart.runtime.diloco.rounds",
    "UnreadableAudit": "stalwart.cli.audit",
    "AuditError": "stalwart.runtime.consistency",
    "ReplicaDriftError": "stalwart.runtime.consistency",
    "CheckpointError": "stalwart.runtime.checkpoint",
    "CollectiveError": "stalwart.runtime.comm",
    "CopyMismatchError": "stalwart.runtime.zero",
    "HealError": "stalwart.runtime.heal",
    "ShardsLostError": "stalwart.redundancy.layout",
    "ShardError": "stalwart.data.shard_identity",
    "LighthouseError": "stalwart.errors",
    "LighthouseUnreachable": "stalwart.errors",
}
"""Public name -> the module that defines it: what a training script writes, and every error stalwart raises (the
one place to import them from: ``tests/unit/test_errors.py`` fails on a public error class missing here)."""

__all__ = sorted(_LOCATIONS)


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LOCATIONS)
