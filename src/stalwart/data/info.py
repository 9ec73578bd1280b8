"""What one worker loads in one step: ``DataLoadingInfo``, where it comes from, and replica groups.

The ledger (:mod:`stalwart.data.ledger`) gives each *member* a share of the
step's positions. A member is a replica group: one or more workers that
together hold one model replica (e.g. the ranks of one FSDP/TP group). The
group's share is split among its workers with the same rule as everywhere
else, :func:`~stalwart.data.schedule.split_sizes`: contiguous parts in
intra-group rank order, in multiples of ``local_batch_multiple``. Global
ranks number the workers group by group, in the members' rank order.

A :class:`DataLoadingInfoSource` hands a worker the :class:`DataLoadingInfo`
of each step of an epoch; :class:`ManagedDistributedSampler
<stalwart.data.sampler.ManagedDistributedSampler>` is driven by one.
:class:`LocalLedgerSource` is the fixed-world source: every rank replays the
same ledger and takes its own share, so no communication is needed. The
fault-tolerant runtime's Manager is the other source, fed by the lighthouse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from stalwart._validate import check_int
from stalwart.data.ledger import DataLedger, Positions
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_sizes
from stalwart.data.world import WorldInfo


def split_group_share(
    group_positions: npt.ArrayLike, intra_group_world_size: int, intra_group_rank: int, multiple: int = 1
) -> Positions:
    """Return worker ``intra_group_rank``'s contiguous part of its replica group's share.

    The parts follow ``split_sizes(len(group_positions), intra_group_world_size, multiple)``
    in intra-group rank order; together they are the group's share, each position once.
    """
    intra_group_world_size = check_int("intra_group_world_size", intra_group_world_size, minimum=1)
    intra_group_rank = check_int("intra_group_rank", intra_group_rank, minimum=0, maximum=intra_group_world_size - 1)
    positions = np.asarray(group_positions, dtype=np.int64).reshape(-1)
    sizes = split_sizes(positions.size, intra_group_world_size, multiple)
    start = sum(sizes[:intra_group_rank])
    return positions[start : start + sizes[intra_group_rank]].copy()


@dataclass(frozen=True)
class DataLoadingInfo:
    """One worker's data for one step, and the world it was computed for (the proposal's names).

    ``base_index`` and ``missing_indices`` are the ledger's, in positions of
    the epoch's order, as they stood when the step began; ``indices`` are this
    worker's *dataset sample indices* for the step. ``step`` counts steps
    within ``epoch`` from 0.
    """

    epoch: int
    step: int
    base_index: int
    missing_indices: list[int]
    num_replica_groups: int
    replica_group_rank: int
    intra_group_world_size: int
    intra_group_rank: int
    global_world_size: int
    global_rank: int
    indices: list[int]

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch, minimum=0)
        check_int("step", self.step, minimum=0)
        check_int("base_index", self.base_index, minimum=0)
        check_int("num_replica_groups", self.num_replica_groups, minimum=1)
        check_int("replica_group_rank", self.replica_group_rank, minimum=0, maximum=self.num_replica_groups - 1)
        check_int("global_world_size", self.global_world_size, minimum=self.num_replica_groups)
        check_int("global_rank", self.global_rank, minimum=0, maximum=self.global_world_size - 1)
        check_int("intra_group_world_size", self.intra_group_world_size, minimum=1, maximum=self.global_world_size)
        check_int("intra_group_rank", self.intra_group_rank, minimum=0, maximum=self.intra_group_world_size - 1)
        _check_index_list("missing_indices", self.missing_indices)
        _check_index_list("indices", self.indices)

    @classmethod
    def for_worker(
        cls,
        plan: EpochPlan,
        *,
        epoch: int,
        step: int,
        base_index: int,
        missing_indices: npt.ArrayLike,
        group_sizes: Mapping[str, int],
        member: str,
        group_share: npt.ArrayLike,
        intra_group_rank: int,
    ) -> DataLoadingInfo:
        """Build the info of worker ``intra_group_rank`` of replica group ``member`` (pure).

        ``group_sizes`` maps each member of the step to its number of workers,
        in the members' rank order; ``group_share`` is ``member``'s share of
        positions from the ledger; ``base_index`` and ``missing_indices`` are
        the ledger's before the step began.
        """
        if not isinstance(plan, EpochPlan):
            raise TypeError(f"plan must be an EpochPlan, got {type(plan).__name__}")
        if not isinstance(group_sizes, Mapping) or not group_sizes:
            raise ValueError(f"group_sizes must map each member to its worker count, got {group_sizes!r}")
        sizes = {name: check_int(f"group_sizes[{name!r}]", size, minimum=1) for name, size in group_sizes.items()}
        if member not in sizes:
            raise ValueError(f"member must be one of group_sizes {list(sizes)}, got {member!r}")
        names = list(sizes)
        replica_group_rank = names.index(member)
        intra_group_world_size = sizes[member]
        positions = split_group_share(group_share, intra_group_world_size, intra_group_rank, plan.local_batch_multiple)
        return cls(
            epoch=epoch,
            step=step,
            base_index=base_index,
            missing_indices=np.asarray(missing_indices, dtype=np.int64).reshape(-1).tolist(),
            num_replica_groups=len(names),
            replica_group_rank=replica_group_rank,
            intra_group_world_size=intra_group_world_size,
            intra_group_rank=intra_group_rank,
            global_world_size=sum(sizes.values()),
            global_rank=sum(sizes[name] for name in names[:replica_group_rank]) + intra_group_rank,
            indices=plan.indices_at(epoch, positions).tolist(),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; :meth:`from_dict` restores it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataLoadingInfo:
        """Rebuild an info from :meth:`to_dict` output (e.g. parsed JSON), checking its fields."""
        if not isinstance(data, Mapping):
            raise TypeError(f"data must be a mapping, got {type(data).__name__}")
        expected = {field.name for field in dataclasses.fields(cls)}
        missing = sorted(expected - data.keys())
        unknown = sorted(data.keys() - expected)
        if missing or unknown:
            raise ValueError(
                f"data must have exactly the fields {sorted(expected)}; missing {missing}, unknown {unknown}"
            )
        return cls(**data)


@runtime_checkable
class DataLoadingInfoSource(Protocol):
    """Hands this worker the :class:`DataLoadingInfo` of each step of an epoch.

    ``next_step()`` returns the next step's info, or None once the epoch has
    ended; a step is taken when it is handed out, so ``state_dict()`` after
    ``k`` calls resumes at step ``k``.
    """

    @property
    def plan(self) -> EpochPlan:
        """The epoch order and step schedule the infos follow."""
        ...

    @property
    def epoch(self) -> int:
        """The current epoch."""
        ...

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the current epoch, from its first step."""
        ...

    def __len__(self) -> int:
        """Steps in the current epoch (as planned; a re-queued failure can add one)."""
        ...

    def next_step(self) -> DataLoadingInfo | None:
        """This worker's info for the next step of the current epoch, or None once the epoch has ended."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; ``load_state_dict`` resumes at the next step not yet handed out."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` output."""
        ...


class LocalLedgerSource:
    """The fixed-world source: every rank replays the same ledger and takes its own share.

    The world's ranks form consecutive replica groups of ``group_sizes``
    workers (default: one group per rank), named ``group-0``, ``group-1``, …
    in rank order. Every rank runs ``begin_step``/``commit`` on its own copy
    of the ledger for the same members, so all copies agree without any
    communication.
    """

    def __init__(self, plan: EpochPlan, world: WorldInfo, group_sizes: Sequence[int] | None = None) -> None:
        if not isinstance(plan, EpochPlan):
            raise TypeError(f"plan must be an EpochPlan, got {type(plan).__name__}")
        if not isinstance(world, WorldInfo):
            raise TypeError(f"world must be a WorldInfo, got {type(world).__name__}")
        sizes = [1] * world.world_size if group_sizes is None else _check_group_sizes(group_sizes, world.world_size)
        self._plan = plan
        self.world = world
        self.group_sizes = {f"group-{group}": size for group, size in enumerate(sizes)}
        first_rank = np.cumsum([0, *sizes])
        group = int(np.searchsorted(first_rank, world.rank, side="right")) - 1
        self.member = f"group-{group}"
        self.intra_group_rank = world.rank - int(first_rank[group])
        self._epoch = 0
        self._ledger = DataLedger(plan)

    @property
    def plan(self) -> EpochPlan:
        """The epoch order and step schedule the infos follow."""
        return self._plan

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the current epoch, from its first step."""
        self._epoch = check_int("epoch", epoch, minimum=0)
        self._ledger = DataLedger(self._plan)

    def __len__(self) -> int:
        """Steps in an epoch: the fixed world never re-queues."""
        return self._plan.steps_per_epoch

    def next_step(self) -> DataLoadingInfo | None:
        """Replay the next step on the local ledger and return this rank's info, or None at the epoch's end."""
        ledger = self._ledger
        if ledger.epoch_complete:
            return None
        step, base_index, missing = ledger.epoch_step, ledger.base_index, ledger.missing_indices
        shares = ledger.begin_step(list(self.group_sizes))
        ledger.commit()
        return DataLoadingInfo.for_worker(
            self._plan,
            epoch=self._epoch,
            step=step,
            base_index=base_index,
            missing_indices=missing,
            group_sizes=self.group_sizes,
            member=self.member,
            group_share=shares[self.member],
            intra_group_rank=self.intra_group_rank,
        )

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the local ledger's state (JSON-serialisable; independent of the world size)."""
        return {"epoch": self._epoch, "ledger": self._ledger.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` output, saved at any world size but for the same plan."""
        if not isinstance(state, Mapping) or set(state) != {"epoch", "ledger"}:
            raise ValueError("state must be a LocalLedgerSource state_dict with keys 'epoch' and 'ledger'")
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        ledger = DataLedger.from_state_dict(state["ledger"])
        if ledger.plan != self._plan:
            raise ValueError(f"state was saved for plan {ledger.plan}, but this source follows {self._plan}")
        if ledger.in_step:
            raise ValueError("state must be saved between steps, but its ledger has a step in progress")
        self._epoch = epoch
        self._ledger = ledger


def _check_group_sizes(group_sizes: Sequence[int], world_size: int) -> list[int]:
    if isinstance(group_sizes, str) or not isinstance(group_sizes, Sequence) or not group_sizes:
        raise ValueError(f"group_sizes must be a non-empty sequence of worker counts, got {group_sizes!r}")
    sizes = [check_int(f"group_sizes[{index}]", size, minimum=1) for index, size in enumerate(group_sizes)]
    if sum(sizes) != world_size:
        raise ValueError(f"group_sizes must add up to world_size={world_size}, got {sizes} (sum {sum(sizes)})")
    return sizes


def _check_index_list(name: str, values: Any) -> None:
    if not isinstance(values, list):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must hold non-negative ints, got {value!r}")
