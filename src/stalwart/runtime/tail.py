"""The step's tail: the values that ride at the end of the gradient all-reduce, encoded and decoded here only.

Every process puts its own values in its own slots (zeros elsewhere) or adds
its counts to shared slots, so after the sum every member reads the same
table and takes the same decisions. In order::

    [balance slots]  2 per process, balanced ledgers only: compute seconds, samples since the last re-weighing
    drift slots      5 per process (stalwart.runtime.consistency): parameter checksum and applied step
    departure slots  1 per process: 1 when that process leaves at this step's boundary (stalwart.runtime.preemption)
    audit pieces     8: the checksum of the samples the loaders produced (their positions)
    row pieces       8: the checksum of the rows they handed out (their keys, when the dataset keys its rows)
    samples          the step's sample count (this process's part)
    reconfigure      > 0 when a member's lighthouse asked for a step boundary
    weight           the micro-batches' weights (samples, or the user's counts such as tokens)
    loss             the weighted loss sum

The first five are known before the step's last backward; weight and loss
only after it (they stay on the device: no host sync per micro-batch), so
:meth:`TailLayout.encode` takes them separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stalwart.runtime.consistency import AUDIT_PIECES, DRIFT_SLOTS, audit_pieces, audit_value

BALANCE_SLOTS = 2
"""Per process on a balanced ledger: its compute seconds and samples since the last re-weighing."""
_COUNTS = 4
"""samples, reconfigure, weight, loss."""


@dataclass(frozen=True)
class TailHead:
    """This process's values known before the last backward."""

    drift: torch.Tensor
    """``DRIFT_SLOTS * processes`` values, this process's own filled in (zeros when not checking)."""
    loaded_checksum: int
    row_checksum: int
    samples: int
    reconfigure: bool
    departures: torch.Tensor | None = None
    """:meth:`TailLayout.departure_slots`: 1 in this process's own when it leaves at this step's end (None: not)."""


@dataclass(frozen=True)
class ReducedTail:
    """The quorum's reduced tail, decoded."""

    balance: list[float]
    drift: torch.Tensor
    loaded_checksum: int
    row_checksum: int
    samples: int
    reconfigure: bool
    weight: float
    loss: float
    departing: tuple[int, ...] = ()
    """The ranks (in the reducing communicator) of the processes that leave at this step's boundary."""

    @property
    def mean_loss(self) -> float:
        """The loss averaged over the reduced weight (samples, or the users' ``weight=``); 0 for an empty step."""
        return self.loss / self.weight if self.weight > 0 else 0.0


@dataclass(frozen=True)
class TailLayout:
    """Where each value sits for a quorum of ``processes`` processes (``balanced``: with balance slots)."""

    processes: int
    balanced: bool

    @property
    def balance_size(self) -> int:
        return BALANCE_SLOTS * self.processes if self.balanced else 0

    @property
    def size(self) -> int:
        """Float32 values in the tail."""
        return self.balance_size + (DRIFT_SLOTS + 1) * self.processes + 2 * AUDIT_PIECES + _COUNTS

    def departure_slots(self, rank: int, departing: bool) -> torch.Tensor:
        """One slot per process, 1 in ``rank``'s own when it departs."""
        slots = torch.zeros(self.processes)
        if departing:
            slots[rank] = 1.0
        return slots

    def balance_slots(self, rank: int, seconds: float, samples: int) -> torch.Tensor:
        """The balance slots with ``rank``'s compute seconds and samples in its own two."""
        slots = torch.zeros(self.balance_size)
        if self.balanced:
            slots[BALANCE_SLOTS * rank] = seconds
            slots[BALANCE_SLOTS * rank + 1] = float(samples)
        return slots

    def encode(self, balance: torch.Tensor, head: TailHead, weight: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """The whole tail on ``loss``'s device (``weight`` and ``loss`` are 0-dim tensors, possibly on the GPU)."""
        counts = torch.tensor([float(head.samples), 1.0 if head.reconfigure else 0.0])
        pieces = [audit_pieces(head.loaded_checksum), audit_pieces(head.row_checksum)]
        departing = torch.zeros(self.processes) if head.departures is None else head.departures.float()
        known = torch.cat([balance, head.drift.float(), departing, *pieces, counts])
        return torch.cat([known.to(loss.device), weight.reshape(1).float(), loss.reshape(1).float()])

    def decode(self, reduced: torch.Tensor) -> ReducedTail:
        """Read the reduced tail (any device)."""
        values = reduced.detach().cpu()
        if values.numel() != self.size:
            raise ValueError(f"a reduced tail of {values.numel()} values does not fit a layout of {self.size}")
        numbers = values.tolist()  # one conversion: the slices' own tensor operations cost more, every step
        drift_end = self.balance_size + DRIFT_SLOTS * self.processes
        departures_end = drift_end + self.processes
        audit_end = departures_end + AUDIT_PIECES
        rows_end = audit_end + AUDIT_PIECES
        samples, reconfigure, weight, loss = numbers[rows_end:]
        return ReducedTail(
            balance=numbers[: self.balance_size],
            drift=values[self.balance_size : drift_end],
            departing=tuple(rank for rank, flag in enumerate(numbers[drift_end:departures_end]) if flag > 0),
            loaded_checksum=audit_value(numbers[departures_end:audit_end]),
            row_checksum=audit_value(numbers[audit_end:rows_end]),
            samples=round(samples),
            reconfigure=reconfigure > 0,
            weight=weight,
            loss=loss,
        )
