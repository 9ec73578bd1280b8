"""The step planner: this process's replica of the ledger, its part of each step, and the parts foreseen.

Pure bookkeeping over :class:`~stalwart.data.ledger.DataLedger` (no I/O, no
collectives): the Manager adopts the ledger of each quorum answer, begins
and commits steps on it exactly as the lighthouse does, and asks for the
positions this process computes next. A step's share of a replica group is
split among its processes by intra-group rank
(:func:`~stalwart.data.info.split_group_share`); after a failure the
positions the group took over are handed out as a further part on top of
what is done (:meth:`StepPlanner.next_part`).

Foresight: the next steps' parts, as they will be if the quorum holds, are
replayed on a copy of the ledger, so a loader can prefetch across step and
epoch boundaries. Sample indices come from a window of permuted positions
(:class:`~stalwart.data.index_window.IndexWindow`): a step's parts, its audit
and the next step's part share one permutation every few hundred steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stalwart.data.index_window import IndexWindow
from stalwart.data.info import DataLoadingInfo, split_group_share
from stalwart.data.ledger import DataLedger
from stalwart.data.schedule import split_microbatches
from stalwart.errors import PlanMismatchError

_NO_POSITIONS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Part:
    """Positions this process computes next in the step, and how its micro-batches go.

    ``sizes``: samples per micro-batch, padded with zeros up to the count the
    group's processes run in step (FSDP2 groups: every forward and backward
    is a collective over the group).
    """

    positions: np.ndarray
    indices: list[int]
    sizes: tuple[int, ...]


class StepPlanner:
    """Which positions this process of ``member`` computes in each step of its ledger replica.

    ``group_rank`` of ``group_size``: this process's place in its replica
    group; ``lockstep``: the group's processes run the same number of
    micro-batches (FSDP2).
    """

    def __init__(self, member: str, group_rank: int, group_size: int, max_microbatch: int, *, lockstep: bool) -> None:
        self.member = member
        self.group_rank = group_rank
        self.group_size = group_size
        self.max_microbatch = max_microbatch
        self.lockstep = lockstep
        self.members: tuple[str, ...] = ()
        self.samples = 0
        """Samples this process computed in the step in progress (all its parts)."""
        self._ledger: DataLedger | None = None
        self._done = _NO_POSITIONS
        self._window = IndexWindow()
        """The plan's indices of the positions around the step's, permuted a window at a time: the step's parts,
        its audit and the next step foreseen all read them there."""

    @property
    def ledger(self) -> DataLedger:
        """This member's replica of the lighthouse's ledger."""
        if self._ledger is None:
            raise RuntimeError("the Manager has not joined a quorum yet; iterate manager.steps() first")
        return self._ledger

    @property
    def joined(self) -> bool:
        """Whether a quorum's ledger was adopted."""
        return self._ledger is not None

    def adopt(self, ledger_state: dict[str, Any], members: Sequence[str]) -> None:
        """Take the ledger of a quorum answer (the step in progress, if any, as the lighthouse records it)."""
        self._ledger = DataLedger.from_state_dict(ledger_state)
        self.members = tuple(members)

    def restore(self, ledger: DataLedger) -> None:
        """Take a ledger restored from a saved state (before any quorum)."""
        self._ledger = ledger

    def check_dataset(self, length: int | None) -> None:
        """Refuse a plan whose dataset size differs from the loader's dataset (it would index past its end)."""
        plan = self.ledger.plan
        if length is not None and length != plan.dataset_size:
            raise PlanMismatchError(
                f"the lighthouse's plan has dataset_size={plan.dataset_size} but this worker's dataset has {length} "
                f"samples: start the lighthouse with --dataset-size {length}, or give the worker that dataset"
            )

    def begin_step(self) -> None:
        """Begin the ledger's next step for the quorum's members, unless a step is in progress already."""
        if not self.ledger.in_step:
            self.ledger.begin_step(list(self.members))

    @property
    def ends_epoch(self) -> bool:
        """Whether the step in progress holds the epoch's last positions (it completes the epoch when it commits)."""
        ledger = self.ledger
        return ledger.base_index >= ledger.plan.epoch_length and not ledger.missing_indices.size

    def next_part(self) -> Part:
        """This process's part of the group's positions not yet covered in this step (marked covered)."""
        ledger = self.ledger
        group_share = ledger.in_flight.get(self.member, _NO_POSITIONS)
        fresh = group_share[~np.isin(group_share, self._done)]
        self._done = np.concatenate([self._done, fresh])
        multiple = ledger.plan.local_batch_multiple
        positions = split_group_share(fresh, self.group_size, self.group_rank, multiple)
        self.samples += positions.size
        sizes = microbatch_sizes(fresh, self.group_size, self.group_rank, multiple, self.max_microbatch, self.lockstep)
        return Part(positions, self._indices_of(positions).tolist(), sizes)

    def mark_done(self, positions: np.ndarray) -> None:
        """Record ``positions`` of the step in progress as trained by this group (DiLoCo's inner steps)."""
        self._done = np.concatenate([self._done, positions])

    @property
    def done(self) -> np.ndarray:
        """The group's positions of the step in progress trained so far (in the order they were trained)."""
        return self._done

    @property
    def covered(self) -> bool:
        """Whether this process took part of the step in progress already (a retry asks as a failure)."""
        return bool(self._done.size)

    def reset_step(self) -> None:
        """Forget what this process covered of the step (a heal or a commit starts it over)."""
        self._done = _NO_POSITIONS
        self.samples = 0

    def step_positions(self) -> np.ndarray:
        """Every position of the step in progress, over all members."""
        shares = [share for share in self.ledger.in_flight.values() if share.size]
        return np.concatenate(shares) if shares else _NO_POSITIONS

    def step_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, indices)``: :meth:`step_positions` and their sample indices in the plan's order."""
        positions = self.step_positions()
        return positions, self._indices_of(positions)

    def data_loading_info(self, group_sizes: Sequence[int]) -> DataLoadingInfo:
        """Where this process's samples of the current step come from (the proposal's ``DataLoadingInfo``)."""
        ledger = self.ledger
        if not ledger.in_step:
            raise RuntimeError("get_data_loading_info() needs a step in progress: call it inside manager.steps()")
        base_index, missing_indices = step_began(ledger)
        return DataLoadingInfo.for_worker(
            ledger.plan,
            epoch=ledger.epoch,
            step=ledger.epoch_step,
            base_index=base_index,
            missing_indices=missing_indices,
            group_sizes=dict(zip(self.members, group_sizes, strict=True)),
            member=self.member,
            group_share=ledger.in_flight.get(self.member, _NO_POSITIONS),
            intra_group_rank=self.group_rank,
        )

    def foresee_next(self, max_steps: int) -> tuple[int, list[int]] | None:
        """``(epoch, indices)`` of this process's part of the next step if the quorum holds, to prefetch."""
        return next(self._foreseen_steps(max_steps, self._window), None)

    def foreseen_parts(self, max_steps: int) -> Iterator[tuple[int, list[int]]]:
        """``(epoch, indices)`` of this process in each later step if the quorum holds (a DataLoader's plan; a window
        of its own, so that running ahead does not move the step's)."""
        return self._foreseen_steps(max_steps, IndexWindow())

    def _indices_of(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices of ``positions`` (some of the step's) in the plan's order."""
        return self._window.indices_at(self.ledger.plan, self.ledger.epoch, positions)

    def _foreseen_steps(self, max_steps: int, window: IndexWindow) -> Iterator[tuple[int, list[int]]]:
        """``(epoch, indices)`` of this process's part of each later step if the quorum holds (from ``window``)."""
        preview = self.ledger.copy()
        members = list(self.members)
        multiple = preview.plan.local_batch_multiple

        def steps() -> Iterator[tuple[int, list[int]]]:
            while True:
                if preview.in_step:
                    preview.commit()
                if preview.step >= max_steps:
                    return
                group_share = preview.begin_step(members).get(self.member, _NO_POSITIONS)
                part = split_group_share(group_share, self.group_size, self.group_rank, multiple)
                yield preview.epoch, window.indices_at(preview.plan, preview.epoch, part).tolist()

        return steps()


def step_began(ledger: DataLedger) -> tuple[int, np.ndarray]:
    """``(base_index, missing_indices)`` of ``ledger`` as its step in progress began.

    A step takes queued positions first, then fresh ones from ``base_index``
    on; after failures and reassigns the ledger no longer says which of its
    positions were which, so the fresh ones are read as the run of positions
    just below ``ledger.base_index`` (none while the queue is not empty).
    The lighthouse reassigns a failed member's positions within the step and
    never queues any, so for the Manager's ledgers this is exact; in a
    re-queue-mode ledger (loaded with ``load_state_dict``) a queued position
    right below the fresh ones would be read as fresh, and the queued ones
    are listed in ascending order.
    """
    positions = np.sort(np.concatenate([_NO_POSITIONS, *ledger.in_flight.values(), ledger.step_missing]))
    queued = ledger.missing_indices
    fresh = 0
    if not queued.size:
        below = ledger.base_index - 1 - np.arange(positions.size)
        mismatch = np.flatnonzero(positions[::-1] != below)
        fresh = int(mismatch[0]) if mismatch.size else positions.size
    return ledger.base_index - fresh, np.concatenate([positions[: positions.size - fresh], queued])


def microbatch_sizes(
    group_positions: np.ndarray, group_size: int, group_rank: int, multiple: int, max_microbatch: int, lockstep: bool
) -> tuple[int, ...]:
    """Sample counts of this process's micro-batches of ``group_positions`` (the group's, cut by process).

    ``lockstep`` (FSDP2 groups): zero-sample micro-batches pad the count to the
    most any process of the group runs, so that the group's collectives match.
    """
    mine = split_group_share(group_positions, group_size, group_rank, multiple).size
    sizes = [len(chunk) for chunk in split_microbatches(range(mine), max_microbatch)]
    if lockstep:
        counts = [
            -(-split_group_share(group_positions, group_size, rank, multiple).size // max_microbatch)
            for rank in range(group_size)
        ]
        sizes += [0] * (max(counts) - len(sizes))
    return tuple(sizes)
