"""The order of an epoch and how it is cut into steps."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from stalwart._validate import check_bool, check_int
from stalwart.data.permutation import FeistelPermutation
from stalwart.data.schedule import step_boundary


@dataclass(frozen=True)
class EpochPlan:
    """Which sample sits at each position of each epoch, and where steps begin.

    ``plan.indices(epoch, start, stop)`` gives the sample indices at positions
    ``start..stop-1`` of epoch ``epoch``'s order without materialising the
    permutation (see :mod:`stalwart.data.permutation`): the same seed and epoch
    give the same order in every process, each epoch's order differs, and
    ``shuffle=False`` is the identity.

    Positions are what the ledger counts in (``base_index`` and
    ``missing_indices`` are positions in the epoch's order, as in the
    proposal); ``indices_at`` turns them into sample indices.

    With ``drop_last=True`` an epoch covers the positions of its full steps,
    ``[0, epoch_length)``; the tail shorter than a step is not trained on.
    """

    dataset_size: int
    global_batch_size: int
    seed: int = field(default=0, kw_only=True)
    shuffle: bool = field(default=True, kw_only=True)
    drop_last: bool = field(default=False, kw_only=True)
    local_batch_multiple: int = field(default=1, kw_only=True)

    def __post_init__(self) -> None:
        check_int("dataset_size", self.dataset_size, minimum=1, maximum=1 << 62)
        check_int("global_batch_size", self.global_batch_size, minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_bool("shuffle", self.shuffle)
        check_bool("drop_last", self.drop_last)
        check_int("local_batch_multiple", self.local_batch_multiple, minimum=1, maximum=self.global_batch_size)
        first_step = step_boundary(1, self.global_batch_size, self.local_batch_multiple)
        if self.drop_last and first_step > self.dataset_size:
            raise ValueError(
                f"dataset_size must be at least the first step's total {first_step} (global_batch_size="
                f"{self.global_batch_size} rounded to local_batch_multiple={self.local_batch_multiple}) when "
                f"drop_last=True, else an epoch has no full step; got {self.dataset_size}"
            )

    @property
    def epoch_length(self) -> int:
        """How many positions an epoch trains on: the dataset, less the short tail under ``drop_last``."""
        if not self.drop_last:
            return self.dataset_size
        full_steps = self.dataset_size // self.global_batch_size
        while step_boundary(full_steps + 1, self.global_batch_size, self.local_batch_multiple) <= self.dataset_size:
            full_steps += 1
        while step_boundary(full_steps, self.global_batch_size, self.local_batch_multiple) > self.dataset_size:
            full_steps -= 1
        return step_boundary(full_steps, self.global_batch_size, self.local_batch_multiple)

    @property
    def steps_per_epoch(self) -> int:
        """Steps in an epoch without failures (a re-queued failure can add one)."""
        steps = max(0, self.epoch_length // self.global_batch_size - 1)
        while self.step_start(steps) < self.epoch_length:
            steps += 1
        return steps

    def step_start(self, step: int) -> int:
        """First position of step ``step`` of an epoch without failures, clamped to the epoch's length."""
        return min(step_boundary(step, self.global_batch_size, self.local_batch_multiple), self.epoch_length)

    def step_total(self, step: int) -> int:
        """How many samples step ``step`` of an epoch trains on, the last step's remainder included."""
        return self.step_start(step + 1) - self.step_start(step)

    def indices(self, epoch: int, start: int, stop: int) -> npt.NDArray[np.int64]:
        """Sample indices at positions ``start..stop-1`` of epoch ``epoch``'s order (int64)."""
        start = check_int("start", start, minimum=0, maximum=self.dataset_size)
        stop = check_int("stop", stop, minimum=start, maximum=self.dataset_size)
        return self.indices_at(epoch, np.arange(start, stop, dtype=np.int64))

    def indices_at(self, epoch: int, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Sample indices at the given positions of epoch ``epoch``'s order (int64, same shape)."""
        epoch = check_int("epoch", epoch, minimum=0)
        array = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            if array.size and (array.min() < 0 or array.max() >= self.dataset_size):
                raise ValueError(f"positions must be in [0, {self.dataset_size - 1}]")
            return array.copy()
        return _permutation(self.dataset_size, self.seed, epoch)(array)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; ``EpochPlan(**d)`` restores it."""
        return asdict(self)


@functools.lru_cache(maxsize=8)
def _permutation(size: int, seed: int, epoch: int) -> FeistelPermutation:
    """The permutation of one epoch, keyed by (seed, epoch)."""
    key = int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0])
    return FeistelPermutation(size, key)
