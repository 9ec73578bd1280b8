"""One step's gradient accumulation on this process: its micro-batches, their weighted losses, and the reduction.

A micro-batch's loss is a **mean** (torch's default reduction): its backward
is weighted by the micro-batch's sample count, or by a count the user gives
(``weight``, such as its tokens), and the reduced gradient is divided by the
quorum's summed weights. Whatever the world size and however the samples
were cut into micro-batches, the gradient is the mean over the step's samples
(or tokens), which is what a fixed-world DDP step with the same global batch
gives.

Each part's last micro-batch arms the bucketed reducer
(:mod:`stalwart.runtime.reducer`) before the user's backward of it, so
buckets are reduced while that backward still runs; the step's tail
(:mod:`stalwart.runtime.tail`) rides with the last bucket. A process of an
FSDP2 group runs as many micro-batches as the group's busiest process (every
forward and backward is a group collective), with zero-sample batches, whose
weight is 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from stalwart.errors import StepContractError
from stalwart.runtime.comm import Communicator
from stalwart.runtime.config import Reduction
from stalwart.runtime.consistency import index_checksum
from stalwart.runtime.reducer import GradientReducer
from stalwart.runtime.sharding import set_gradient_sync
from stalwart.runtime.tail import ReducedTail, TailHead, TailLayout

Key = tuple[int, int]


class Source(Protocol):
    """Where micro-batches come from: an ElasticLoader, or the feed of a user's DataLoader."""

    def microbatches(self, epoch: int, indices: Sequence[int], max_microbatch: int) -> Iterator[Any]: ...

    def take_produced(self) -> list[Key]: ...

    def take_row_checksum(self) -> int: ...


class StepAccumulation:
    """This process's gradients, losses and weights of the step in progress, and their reduction."""

    def __init__(
        self,
        model: torch.nn.Module,
        params: Sequence[torch.nn.Parameter],
        *,
        device: torch.device,
        reduction: Reduction,
        max_microbatch: int,
        lockstep: bool,
    ) -> None:
        self.model = model
        self.device = device
        self.max_microbatch = max_microbatch
        self.lockstep = lockstep
        self.reducer = GradientReducer(
            params, device=device, bucket_cap_mb=reduction.bucket_cap_mb, reduce_dtype=reduction.dtype
        )
        self.loaded_checksum = 0
        """The audit checksum of the samples the loader produced in the step (all parts)."""
        self.row_checksum = 0
        """The row checksum of the rows the loader handed out in the step (0 when its dataset keys no rows)."""
        self._loss = torch.zeros((), device=device)
        self._weight = torch.zeros((), device=device)
        self._size: int | None = None
        """Samples of the micro-batch handed out and not yet back-propagated (None: none pending)."""
        self._template: Any = None
        """The last batch this process trained on: the shape of a zero-sample batch (FSDP2 groups)."""

    def reset(self) -> None:
        """Start the step over (a commit, or a heal that replaced the replica's state)."""
        self._loss = torch.zeros((), device=self.device)
        self._weight = torch.zeros((), device=self.device)
        self.loaded_checksum = 0
        self.row_checksum = 0
        self._size = None

    def microbatches(
        self,
        source: Source,
        epoch: int,
        indices: list[int],
        sizes: Sequence[int],
        *,
        arm: Callable[[], None],
        sample_batch: Callable[[], Any],
    ) -> Iterator[Any]:
        """The part's micro-batches (zero-sample ones up to ``len(sizes)``); ``arm()`` runs before the last one."""
        batches: Iterable[Any] = source.microbatches(epoch, indices, self.max_microbatch) if indices else ()
        for number, (batch, size) in enumerate(
            zip(self._padded(batches, len(sizes), sample_batch), sizes, strict=True), start=1
        ):
            if self.lockstep:  # FSDP2 reduce-scatters in the group only on the part's last backward
                set_gradient_sync(self.model, number == len(sizes))
            if number == len(sizes):
                self.loaded_checksum = (self.loaded_checksum + produced_checksum(source)) % (1 << 64)
                self.row_checksum = (self.row_checksum + source.take_row_checksum()) % (1 << 64)
                arm()
            self._size = size
            yield batch
            if self._size is not None:
                raise StepContractError(
                    "a micro-batch was not back-propagated with step.backward(loss): call it once per micro-batch "
                    "(not loss.backward(): the step must weigh each micro-batch's mean loss)"
                )

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor | None, scaler: Any) -> None:
        """Back-propagate a micro-batch's mean ``loss`` weighted by its samples (or ``weight``), through ``scaler``."""
        if self._size is None:
            raise StepContractError(
                "step.backward() was called outside a micro-batch: call it once for each micro-batch of the step"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss must be a one-element tensor (a mean loss), got {_describe(loss)}")
        count = _weight(self._size if weight is None else weight, self.device)
        weighted = loss.reshape(()) * count
        # a zero-sample batch's mean is NaN; its gradient is empty (no NaN reaches a parameter), but its loss must
        # not reach the step's sum
        counted = torch.where(count > 0, weighted.detach().float(), torch.zeros((), device=self.device))
        self._loss = self._loss + counted
        self._weight = self._weight + count.float()
        self._size = None
        (weighted if scaler is None else scaler.scale(weighted)).backward()

    def arm(
        self,
        comm: Communicator,
        tail_comm: Communicator | None,
        layout: TailLayout,
        head: TailHead,
        balance: Callable[[], torch.Tensor],
        *,
        hold: bool = False,
    ) -> None:
        """Start this round's reduction on ``comm``; the tail is built when the last bucket launches (``hold``: only
        after backward, see :meth:`GradientReducer.arm`)."""
        self.reducer.arm(
            comm,
            lambda: layout.encode(balance(), head, self._weight, self._loss),
            layout.size,
            tail_comm=tail_comm,
            hold=hold,
        )

    @property
    def armed(self) -> bool:
        return self.reducer.armed

    def reduce(self, layout: TailLayout) -> ReducedTail:
        """Finish the round's reduction (launch what backward did not, wait); the reduced tail, decoded."""
        self.reducer.launch_rest()
        return layout.decode(self.reducer.wait())

    def apply(self, weight: float) -> None:
        """Put the reduced sums divided by the quorum's summed ``weight`` into ``param.grad``."""
        self.reducer.apply(weight)

    def close(self) -> None:
        self.reducer.close()

    def _padded(self, batches: Iterable[Any], count: int, sample_batch: Callable[[], Any]) -> Iterator[Any]:
        """``batches``, then zero-sample batches up to ``count`` (FSDP2 groups: the group's processes run in step).

        A zero-sample batch is a real batch with every tensor cut to 0 rows: the
        model runs its collectives on it and its weight is 0.
        """
        produced = 0
        for batch in batches:
            self._template = batch
            produced += 1
            yield batch
        for _ in range(count - produced):
            yield zero_rows(self._template if self._template is not None else sample_batch())


def produced_checksum(source: Source) -> int:
    """The audit checksum of the samples ``source`` produced since it was last asked."""
    produced = source.take_produced()
    if not produced:
        return 0
    keys = np.asarray(produced, dtype=np.int64)
    return index_checksum(keys[:, 0], keys[:, 1])


def zero_rows(batch: Any) -> Any:
    """``batch`` with every tensor cut to its first 0 rows (tuples, lists and dicts followed)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0] if batch.dim() else batch
    if isinstance(batch, tuple | list):
        return type(batch)(zero_rows(item) for item in batch)
    if isinstance(batch, dict):
        return {key: zero_rows(value) for key, value in batch.items()}
    return batch


def _weight(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A micro-batch's weight as a 0-dim float tensor: a count >= 0 (a tensor stays on its device, unsynced)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"weight must be a number or a one-element tensor, got {_describe(value)}")
        return value.detach().reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"weight must be a finite count >= 0 (samples, tokens), got {value!r}")
    return torch.tensor(float(value), device=device)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{value!r} ({type(value).__name__})"
