"""Sharded streams: an iterable dataset split over ranks and DataLoader workers, exactly once per epoch.

Epoch order
    The rows of all shards, concatenated in order, are the samples of an
    :class:`~stalwart.data.plan.EpochPlan` with ``block_size`` and ``window``:
    the windowed block shuffle that training through failures uses too (see
    its docstring), keyed by the seed and the epoch only, so every rank
    computes the same order without talking to the others. A block is a run
    of consecutive positions and is read in Parquet row groups (or pieces) by
    :class:`~stalwart.data.shards.ShardedDataset`; a window brings a few
    neighbouring shards into the same steps.

Steps and shares
    Step ``t`` of an epoch covers the positions of step ``t`` of the
    ledger's schedule (the same plan, no ``drop_last``), so the global
    batch is constant and ``local_batch_multiple`` is honoured. Within a step
    the ranks take contiguous parts sized by
    :func:`~stalwart.data.schedule.split_sizes` in rank order. A step's
    positions do not depend on the world size, which is why a stream resumed at
    step ``t`` with another world size still covers the epoch exactly once.

DataLoader workers
    Worker ``w`` of ``k`` produces the steps ``first + w, first + w + k, ...``
    where ``first`` is the step the iteration starts at. A ``DataLoader``
    with ``batch_size=None`` asks its workers in turn, so the main process
    receives this rank's batch of every step, in step order.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import IterableDataset, get_worker_info

from stalwart._validate import check_int
from stalwart.data.audit import AuditWriter, write_expected
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_sizes
from stalwart.data.shards import Shard, ShardedDataset

DEFAULT_BLOCK_SIZE = 256
STATE_VERSION = 2
"""Version 2: the order is the plan's windowed block shuffle (version 1 had an order of its own)."""


@dataclass(frozen=True)
class StreamBatch:
    """One rank's part of one step: its rows (or ``collate_fn(rows)``) and their global row ids."""

    epoch: int
    step: int
    rows: Any
    indices: npt.NDArray[np.int64]


class ShardedStream(IterableDataset[StreamBatch]):
    """An iterable dataset over shards that yields this rank's :class:`StreamBatch` of each step.

    Every rank builds the stream with the same shards, ``seed`` and batch
    settings and its own ``rank``; together the ranks cover each epoch exactly
    once with a global batch of ``global_batch_size`` rows per step (see the
    module doc). Iterate it through a ``DataLoader`` with ``batch_size=None``
    (any number of workers; not ``persistent_workers``), and pass what the
    loader yields through :meth:`consume`, which runs in the main process:
    it checks that steps arrive in order, records each consumed step (so
    that :meth:`state_dict` is the next step to train on, not the next one
    some worker prefetched) and, with ``audit_dir``, appends the batch's
    global row ids to the rank's audit file::

        stream = ShardedStream(shards, 1024, rank=rank, world_size=world, seed=0, audit_dir="audit")
        stream.load_state_dict(checkpoint["data"])          # when resuming, before iterating
        loader = DataLoader(stream, batch_size=None, num_workers=4)
        for batch in stream.consume(loader):                # one epoch; call again for the next
            train(batch.rows)
            checkpoint["data"] = stream.state_dict()        # {"epoch", "step", ...}: the next step to train

    After the last step of an epoch the state moves to step 0 of the next
    epoch. A stream built for another world size (and rank) loads the same
    state and continues at that step, re-splitting the rest of the epoch.
    Each iteration reads the row groups (pieces) it touches once; a block cut
    by the edge of a rank's part is read by both ranks, so keep ``block_size``
    (a multiple of the row-group size) below a rank's share of a step unless a
    better shuffle is worth more reading. ``window`` (blocks whose order is
    shuffled together) defaults to about one shard's worth of rows.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        global_batch_size: int,
        *,
        rank: int,
        world_size: int,
        seed: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        window: int | None = None,
        local_batch_multiple: int = 1,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        audit_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.dataset = ShardedDataset(shards)
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        total = len(self.dataset)
        self.block_size = min(check_int("block_size", block_size, minimum=1), total)
        if window is None:
            filled = [shard.num_rows for shard in self.shards if shard.num_rows]
            window = max(1, min(round(sum(filled) / len(filled) / self.block_size), -(-total // self.block_size)))
        self.plan = EpochPlan(
            total,
            global_batch_size,
            seed=check_int("seed", seed, minimum=0),
            block_size=self.block_size,
            window=window,
            local_batch_multiple=local_batch_multiple,
        )
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        self.collate_fn = collate_fn
        self.audit_dir = None if audit_dir is None else Path(audit_dir)
        if self.audit_dir is not None:
            write_expected(self.audit_dir, {"dataset_size": total})
        self._audit_writer: AuditWriter | None = None
        self._epoch = 0
        self._step = 0

    @property
    def shards(self) -> list[Shard]:
        """The shards, in the order their rows are numbered."""
        return self.dataset.shards

    @property
    def epoch(self) -> int:
        """The epoch of the next step to produce."""
        return self._epoch

    @property
    def step(self) -> int:
        """The next step of :attr:`epoch` to produce: the first one not yet consumed."""
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        """Steps in every epoch (the same for every world size)."""
        return self.plan.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first step, unless the stream already stands inside that epoch.

        Standing inside it (after :meth:`load_state_dict` or a partial pass)
        the stream keeps its step, so a loop that calls ``set_epoch`` at the
        top of every epoch resumes instead of repeating the epoch's first steps.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        if epoch != self._epoch:
            self._epoch, self._step = epoch, 0

    def positions(self, step: int) -> tuple[int, int]:
        """The stream positions ``[start, stop)`` this rank takes at step ``step``."""
        step = check_int("step", step, minimum=0, maximum=self.steps_per_epoch - 1)
        start, stop = self.plan.step_start(step), self.plan.step_start(step + 1)
        sizes = split_sizes(stop - start, self.world_size, self.plan.local_batch_multiple)
        first = start + sum(sizes[: self.rank])
        return first, first + sizes[self.rank]

    def batch(self, epoch: int, step: int) -> StreamBatch:
        """This rank's batch of step ``step`` of epoch ``epoch``, read from the shards."""
        return self._read_batch(check_int("epoch", epoch, minimum=0), step)

    def __iter__(self) -> Iterator[StreamBatch]:
        """This rank's batches of the current epoch from the current step (this worker's steps only)."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for step in range(self.step + worker, self.steps_per_epoch, workers):
            yield self._read_batch(self.epoch, step)

    def consume(self, batches: Iterable[StreamBatch]) -> Iterator[StreamBatch]:
        """Yield ``batches`` (what a DataLoader over this stream yields), recording each as consumed."""
        for batch in batches:
            self.record_consumed(batch)
            yield batch

    def record_consumed(self, batch: StreamBatch) -> None:
        """Record that ``batch`` was handed to training: advance the state past it and audit it.

        Raises ``RuntimeError`` if it is not the step the state says comes next.
        """
        if (batch.epoch, batch.step) != (self.epoch, self.step):
            raise RuntimeError(
                f"expected step {self.step} of epoch {self.epoch} next, got step {batch.step} of epoch {batch.epoch}: "
                "iterate a DataLoader with batch_size=None, in_order=True and no persistent_workers, "
                "created after the last set_epoch or load_state_dict"
            )
        if self.audit_dir is not None:
            if self._audit_writer is None:
                self._audit_writer = AuditWriter(self.audit_dir, self.rank)
            self._audit_writer.write(batch.epoch, batch.step, batch.indices)
        if batch.step + 1 < self.steps_per_epoch:
            self._step = batch.step + 1
        else:
            self._epoch, self._step = batch.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The next step to produce, with what a resuming stream must share with this one (JSON-serialisable)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            **self._fingerprint(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at the step ``state`` names; ``state`` may come from a stream of another world size."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"state must be a ShardedStream state_dict of version {STATE_VERSION}, got {state!r}")
        for key, value in self._fingerprint().items():
            if state.get(key) != value:
                raise ValueError(
                    f"state[{key!r}] is {state.get(key)!r} but this stream has {value!r}: a stream resumes only "
                    "over the same shards, seed, block_size, window, global_batch_size and local_batch_multiple"
                )
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        step = check_int("state['step']", state["step"], minimum=0, maximum=self.steps_per_epoch - 1)
        self._epoch, self._step = epoch, step

    def close(self) -> None:
        """Close the audit file, if one is open, and the shards this process opened."""
        self.dataset.close()
        if self._audit_writer is not None:
            self._audit_writer.close()
            self._audit_writer = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_audit_writer"] = None
        return state

    def _fingerprint(self) -> dict[str, Any]:
        sizes = np.asarray([shard.num_rows for shard in self.shards], dtype="<i8").tobytes()
        return {
            "total_rows": self.plan.dataset_size,
            "shard_sizes_sha256": hashlib.sha256(sizes).hexdigest(),
            "seed": self.plan.seed,
            "block_size": self.plan.block_size,
            "window": self.plan.window,
            "global_batch_size": self.plan.global_batch_size,
            "local_batch_multiple": self.plan.local_batch_multiple,
        }

    def _read_batch(self, epoch: int, step: int) -> StreamBatch:
        start, stop = self.positions(step)
        indices = self.plan.indices(epoch, start, stop)
        rows = self.dataset.__getitems__(indices)
        return StreamBatch(epoch, step, rows if self.collate_fn is None else self.collate_fn(rows), indices)
