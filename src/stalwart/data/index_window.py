"""A plan's sample indices for a step's positions, served from a window of consecutive positions permuted at once.

A step's fresh positions follow the last step's, and permuting them costs
about 0.15 ms whatever their number: the plan's Feistel rounds are some
hundred numpy calls, whose per-call cost dwarfs 32 positions' arithmetic.
:class:`IndexWindow` permutes ``WINDOW`` consecutive positions in one go and
answers the next steps from that array (32 KiB), so a process pays one
permutation every ``WINDOW / global_batch_size`` steps instead of one a
step. Positions the window does not hold (a step reaching back to requeued
ones) are permuted on their own, as before. Pure: no I/O, no torch.
"""

from __future__ import annotations

import numpy as np

from stalwart.data.plan import EpochPlan

WINDOW = 4096
"""Consecutive positions permuted at once (their indices take 32 KiB)."""


class IndexWindow:
    """``plan.indices_at(epoch, positions)``, from the window of ``WINDOW`` positions the last call opened."""

    def __init__(self) -> None:
        self._key: tuple[EpochPlan, int] | None = None
        self._start = 0
        self._indices = np.zeros(0, dtype=np.int64)

    def indices_at(self, plan: EpochPlan, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The sample indices of ``positions`` (int64) in epoch ``epoch`` of ``plan``, as ``plan.indices_at``."""
        if not positions.size:
            return plan.indices_at(epoch, positions)
        low, high = int(positions.min()), int(positions.max())
        held = self._key == (plan, epoch) and self._start <= low and high < self._start + self._indices.size
        if not held:
            if low < 0 or high - low >= WINDOW:  # spread over more than a window (or invalid): permuted alone
                return plan.indices_at(epoch, positions)
            stop = min(low + WINDOW, plan.dataset_size)
            if high >= stop:  # past the dataset: plan.indices_at says why
                return plan.indices_at(epoch, positions)
            self._indices = plan.indices_at(epoch, np.arange(low, stop, dtype=np.int64))
            self._key, self._start = (plan, epoch), low
        return self._indices[positions - self._start]
