"""The replica-consistency check of a step: is it due, this process's slots, and whom to heal from whom.

Every ``every`` steps each process puts a checksum of its parameters and its
applied step into its own slots of the step's tail
(:mod:`stalwart.runtime.consistency`); the reduced table is the same on every
member, so every member derives the same :class:`~stalwart.runtime.consistency.DriftPlan`.
Replicas that still differ after two heals in one step mean the training step
itself is not deterministic across them: :class:`~stalwart.runtime.consistency.ReplicaDriftError`.
In FSDP2 groups each process checksums its own shard, and a group is
compared with the others shard by shard (process r with process r of every
group): a group that differs is healed whole, from a group that agrees.
With sharded optimizer state (redundancy) the heal moves everything but that
state, whose parts differ by process and are checked against their copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stalwart.runtime.consistency import (
    DRIFT_SLOTS,
    DriftPlan,
    ReplicaDriftError,
    default_check_every,
    drift_plan,
    drift_slots,
    parameter_checksum,
)
from stalwart.runtime.sharding import local_tensor

MAX_HEALS_PER_STEP = 2


class DriftCheck:
    """When replicas are compared, and how often a step healed drifted ones."""

    def __init__(
        self, params: Sequence[torch.Tensor], every: int | None, *, enabled: bool, group_size: int = 1
    ) -> None:
        self.params = list(params)
        self.every = default_check_every(sum(param.numel() for param in self.params)) if every is None else every
        self.enabled = enabled
        self.group_size = group_size
        """Processes per replica: 1, or an FSDP2 group's (its processes hold one shard each)."""
        self.heals = 0
        """Drift heals over the Manager's life."""
        self._step_heals = 0

    @property
    def replica_names(self) -> tuple[str, str]:
        """What a plan's indices count, plural and singular: processes, or FSDP2 groups."""
        return ("processes", "process") if self.group_size == 1 else ("groups", "group")

    def due(self, step: int) -> bool:
        """Whether step ``step``'s tail carries the check (the same decision on every member)."""
        return self.enabled and step % self.every == 0

    def slots(self, step: int, rank: int, processes: int, applied_step: int) -> torch.Tensor:
        """This process's drift slots for step ``step`` (zeros when the check is not due)."""
        if not self.due(step):
            return torch.zeros(DRIFT_SLOTS * processes)
        s1, s2 = parameter_checksum([local_tensor(param) for param in self.params])
        return drift_slots(rank, processes, s1, s2, applied_step)

    def plan(self, step: int, reduced: torch.Tensor, processes: int) -> DriftPlan | None:
        """Whom to heal from whom after step ``step``'s reduction (replica indices), or None when they agree."""
        if not self.due(step):
            return None
        plan = drift_plan(reduced, processes, self.group_size)
        if plan is None:
            return None
        if self._step_heals >= MAX_HEALS_PER_STEP:
            units, unit = self.replica_names
            raise ReplicaDriftError(
                f"step {step}: {units} {list(plan.targets)} still differ from {unit} {plan.source} after "
                f"{MAX_HEALS_PER_STEP} heals; is the training step deterministic across replicas?"
            )
        self._step_heals += 1
        self.heals += 1
        return plan

    def step_committed(self) -> None:
        self._step_heals = 0
