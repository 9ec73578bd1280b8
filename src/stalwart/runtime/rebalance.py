"""Straggler relief on a balanced ledger: each process's compute time and samples, and the re-weighing.

Each process measures its compute seconds and samples since the last
re-weighing and puts them into its own two balance slots of the step's tail
(:mod:`stalwart.runtime.tail`); every ``balance_every`` steps every member
derives the same new weights from the reduced values
(:func:`~stalwart.data.balance.rebalance`) and records them in its ledger, so
the next steps' shares follow the members' throughput.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from stalwart.data.balance import group_measurements, rebalance, resolution
from stalwart.data.ledger import DataLedger
from stalwart.runtime.tail import BALANCE_SLOTS, TailLayout

log = logging.getLogger(__name__)


class BalanceWindow:
    """This process's compute seconds and samples since the last re-weighing."""

    def __init__(self) -> None:
        self._part_started = 0.0
        self._step_seconds = 0.0
        self._window_seconds = 0.0
        self._window_samples = 0

    def part_started(self) -> None:
        self._part_started = time.perf_counter()

    def slots(self, layout: TailLayout, rank: int, step_samples: int) -> torch.Tensor:
        """The balance slots as the tail launches (the part's compute ends there)."""
        if not layout.balanced:
            return layout.balance_slots(rank, 0.0, 0)
        self._step_seconds += time.perf_counter() - self._part_started
        return layout.balance_slots(
            rank, self._window_seconds + self._step_seconds, self._window_samples + step_samples
        )

    def reset_step(self) -> None:
        self._step_seconds = 0.0

    def after_commit(
        self,
        ledger: DataLedger,
        reduced: Sequence[float],
        members: Sequence[str],
        group_sizes: Sequence[int],
        step_samples: int,
        member: str,
    ) -> None:
        """Add the committed step to the window; every ``balance_every`` steps re-weigh the members by ``reduced``."""
        self._window_seconds += self._step_seconds
        self._window_samples += step_samples
        if ledger.step % ledger.balance_every:
            return
        self._window_seconds, self._window_samples = 0.0, 0
        samples, seconds = group_measurements(list(reduced), list(group_sizes), BALANCE_SLOTS)
        current = ledger.effective_weights(list(members))
        weights = rebalance(current, samples, seconds, resolution(ledger.plan, len(members)))
        if weights is not None:
            ledger.reweigh(dict(zip(members, weights, strict=True)))
            log.info("%s: step %d re-weighed the shares %s -> %s", member, ledger.step, current, weights)
