"""Sharded optimizer state with partial redundancy (ZeRO stage 1), kept current by computation, repaired in memory.

The model's parameters and gradients stay whole on every process (or, for a
replica group that shards with FSDP2, each process's local shard is the
"whole" that the processes holding the same shard in the other groups split
among themselves: HSDP's replicate dimension becomes a partial one). The
optimizer's state and an fp32 master of the parameters are one flat run of
elements, cut into one shard per process of the quorum
(:mod:`stalwart.redundancy.layout`); each process runs the user's optimizer
(its class and its parameter groups' hyper-parameters) on the shards it holds:

- **overlap**: a process holds its own shard and the shards it copies; every
  holder applies the same deterministic update to the same reduced gradient,
  so copies stay bitwise equal to their primary without sending state (the
  periodic check compares checksums);
- **parity** ``(k, m)``: a process holds its own shard and parity units; after
  each update the data cells go to their stripe's parity holders, which
  re-encode (XOR for ``m = 1``, Reed-Solomon for ``m >= 2``).

The parts: :mod:`~stalwart.runtime.zero.state` (what a process holds, its
rows and parameter groups), :mod:`~stalwart.runtime.zero.step` (the update
and the sync of a step) and :mod:`~stalwart.runtime.zero.repair` (rebuild and
reshard when the quorum changes). More failures than the redundancy covers
raise :class:`~stalwart.redundancy.layout.ShardsLostError` naming the shards.
"""

from stalwart.runtime.zero.state import PER_ELEMENT_OPTIMIZERS, RepairStats
from stalwart.runtime.zero.step import CopyMismatchError, ShardedOptimizer

__all__ = ["PER_ELEMENT_OPTIMIZERS", "CopyMismatchError", "RepairStats", "ShardedOptimizer"]
