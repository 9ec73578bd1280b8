"""A step as the training loop sees it: its micro-batches, then what it did.

:class:`TrainStep` is what ``Manager.steps()`` yields: iterating it yields
this worker's micro-batches (the reduction and any failure retry run at the
end of the iteration), ``backward`` weights each micro-batch's mean loss, and
``report`` (a :class:`StepReport`) says what the step did once it is reduced.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stalwart.runtime.accumulation import StepAccumulation


@dataclass(frozen=True)
class StepReport:
    """What one step did, known once its gradients are reduced (it then commits whatever the update does)."""

    step: int
    epoch: int
    samples: int
    loss: float
    """The mean loss over the step's samples (weighted as the micro-batches were)."""
    world_size: int
    quorum_id: int
    recoveries: int
    positions: np.ndarray
    drift_heals: int = 0
    loaded_checksum: int = 0
    """The quorum's reduced checksum of the samples its loaders produced (``consistency.index_checksum``)."""


class TrainStep:
    """One step: iterate its micro-batches (the reduction, and any failure retry, happen at the end), then update.

    ``number`` is the step being trained, ``epoch`` its epoch, ``epoch_end``
    True on an epoch's last step (for an epoch-wise scheduler or an evaluation
    after it). After the iteration, :attr:`report` says what the step did.
    """

    def __init__(
        self,
        number: int,
        epoch: int,
        epoch_end: bool,
        accumulation: StepAccumulation,
        run: Generator[Any, None, StepReport],
    ) -> None:
        self.number = number
        self.epoch = epoch
        self.epoch_end = epoch_end
        self._accumulation = accumulation
        self._run = run
        self._report: StepReport | None = None

    def __iter__(self) -> Iterator[Any]:
        self._report = yield from self._run

    def backward(self, loss: torch.Tensor, *, weight: float | torch.Tensor | None = None, scaler: Any = None) -> None:
        """Back-propagate a micro-batch's **mean** ``loss``, weighted so that the step's gradient is the mean.

        ``weight``: what the mean is over, when not the micro-batch's samples
        (for example its tokens, a tensor: no host sync); the reduced gradient
        is divided by the quorum's summed weights. ``scaler``: a
        ``torch.amp.GradScaler`` whose ``scale()`` the weighted loss goes
        through (then ``scaler.unscale_(optimizer)`` after the step's
        iteration, as usual). Call it once per micro-batch.
        """
        self._accumulation.backward(loss, weight, scaler)

    @property
    def report(self) -> StepReport:
        """What the step did (its samples, mean loss, positions), once its micro-batches are iterated."""
        if self._report is None:
            raise RuntimeError("the step is not reduced yet: iterate its micro-batches to their end first")
        return self._report
