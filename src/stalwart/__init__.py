"""stalwart: fault-tolerant, elastic data-parallel training for PyTorch.

Workers die and join while training goes on: the global batch stays the size
asked for, every sample of an epoch is trained on exactly once, and sharded
optimizer state survives the loss of a node.

The public names below are imported on first use (PEP 562), so that
``import stalwart`` (and the ``stalwart`` command's help) does not pay for
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_DATA_NAMES = (
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
)

_LOCATIONS: dict[str, str] = {
    "Manager": "stalwart.runtime.manager",
    "StepReport": "stalwart.runtime.manager",
    "TrainStep": "stalwart.runtime.manager",
    "ElasticLoader": "stalwart.runtime.loader",
    "Lighthouse": "stalwart.coord.server",
    "LighthouseClient": "stalwart.coord.client",
    "LighthouseError": "stalwart.coord.client",
    **dict.fromkeys(_DATA_NAMES, "stalwart.data"),
}
"""Public name -> the module that defines it (``stalwart.data``'s ``__all__`` re-exported whole)."""

__all__ = sorted(_LOCATIONS)


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and cache the name in this module."""
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's own names and the lazily imported public ones."""
    return sorted({*globals(), *__all__})
