"""Sharded streams: an iterable dataset split over ranks and DataLoader workers, exactly once per epoch.

Steps and shares
    Step ``t`` of an epoch trains on ``S(t + 1) - S(t)`` rows, the ledger's
    schedule (:mod:`stalwart.data.schedule`, no ``drop_last``), so the global
    batch is constant and ``local_batch_multiple`` is honoured; rank ``r``
    takes ``split_sizes(total, world_size, local_batch_multiple)[r]`` of them.

Who reads what
    A ``DataLoader`` with ``batch_size=None`` asks its workers in turn, so
    worker ``k`` of ``K`` produces the steps ``first + k, first + k + K, ...``
    of its rank. Each worker reads its own runs of the epoch (*lanes*,
    :mod:`stalwart.data.lanes`): the rest of the epoch is dealt to the ranks
    and, within each rank, to its workers, by the rows each will deliver, in a
    base order that keeps a shard's blocks ascending. So a worker decodes only
    the row groups (Parquet) or pieces (Hugging Face streams, read forwards)
    it delivers, whatever the number of ranks, workers or their start order:
    the rows decoded per row delivered stay near 1 where a cut falls at a
    shard's edge, and a cut inside a forwards-only shard costs its second
    reader the rows before its part (``StreamBatch.rows_decoded`` counts them).

Mixing
    A rank's batch of a step comes from its worker's lane(s): a block of
    ``block_size`` rows shuffled, from one shard. A global batch thus holds
    rows of about ``world_size * interleave`` shards. ``interleave=m`` makes
    each worker read ``m`` lanes at once and take every batch from all of them:
    ``m`` times the shards per batch, for ``m`` shards open, ``m`` times the
    cached pieces per worker (a worker whose ``m`` lanes share a forwards-only
    shard keeps the pieces between them as its cursor passes), and more cuts
    between workers (each a row group, or for a forwards-only shard the rows
    before the cut, decoded twice).

Resuming
    The state is the epoch, the next step and the positions not yet delivered
    (a short list of ranges). A stream of any world size, number of workers or
    ``interleave`` loads it and deals those positions again, so an epoch is
    covered exactly once across the change.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from stalwart._validate import check_int
from stalwart.data.audit import AuditWriter, write_expected
from stalwart.data.lanes import (
    Ranges,
    StreamOrder,
    check_ranges,
    deal,
    lane_rows,
    positions_of,
    remaining,
    size_of,
    take,
)
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_sizes, step_boundaries
from stalwart.data.shard_identity import ShardIdentity, fingerprint_of, shard_difference
from stalwart.data.shards import DEFAULT_CACHED_PIECES, Shard, ShardedDataset

DEFAULT_BLOCK_SIZE = 256
STATE_VERSION = 3
"""Version 3: lanes per rank and worker, the state lists the positions left (version 2 followed the plan's order)."""


@dataclass(frozen=True)
class StreamBatch:
    """One rank's part of one step: its rows (or ``collate_fn(rows)``), their global row ids and keys.

    ``keys`` are the rows' values of the stream's ``key`` column, or content
    hashes; ``rows_decoded`` is how many rows the reading process decoded to
    make this batch (the pieces it read, and rows it passed to reach them).
    """

    epoch: int
    step: int
    rows: Any
    indices: npt.NDArray[np.int64]
    keys: list[Any]
    rows_decoded: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Travel from a DataLoader worker as a tuple, the ids as bytes: half the time of a dataclass's pickle."""
        fields = (self.epoch, self.step, self.rows, self.indices.astype(np.int64).tobytes(), self.keys)
        return _rebuild_batch, (*fields, self.rows_decoded)


def _rebuild_batch(epoch: int, step: int, rows: Any, indices: bytes, keys: list[Any], decoded: int) -> StreamBatch:
    return StreamBatch(epoch, step, rows, np.frombuffer(indices, dtype=np.int64).copy(), keys, decoded)


@dataclass
class _Segment:
    """One dealing of an epoch's rest, from step ``first``, for ``workers`` DataLoader workers per rank."""

    epoch: int
    first: int
    workers: int
    totals: npt.NDArray[np.int64]
    """Rows of each step from ``first`` to the epoch's end, all ranks together."""
    lanes: list[list[list[Ranges]]]
    """``lanes[rank][worker][i]``: the positions that lane delivers, in order."""
    delivered: npt.NDArray[np.int64]
    """Rows each lane has delivered so far, same shape (ranks, workers, interleave)."""


class ShardedStream(IterableDataset[StreamBatch]):
    """An iterable dataset over shards that yields this rank's :class:`StreamBatch` of each step.

    Every rank builds the stream with the same shards, ``seed`` and batch
    settings and its own ``rank``; together the ranks cover each epoch exactly
    once with a global batch of ``global_batch_size`` rows per step (see the
    module doc). ``source`` is a list of shards or a
    :class:`~stalwart.data.shards.ShardedDataset` (whose shards, and ``key`` unless
    one is given here, are used). Iterate it through
    :meth:`consume`, which takes the ``DataLoader`` over the stream
    (``batch_size=None``, any ``num_workers``, the same on every rank; not
    ``persistent_workers``) and runs in the main process: it deals the rest of
    the epoch to the workers, checks that steps arrive in order, records each
    one consumed (so that :meth:`state_dict` is the next step to train on, not
    the next one some worker prefetched) and, with ``audit_dir``, appends the
    batch's row ids and keys to the rank's audit file. Iterating the
    DataLoader without it fails at once::

        stream = ShardedStream(shards, 1024, rank=rank, world_size=world, key="id", audit_dir="audit")
        stream.load_state_dict(checkpoint["data"])          # when resuming, before iterating
        loader = DataLoader(stream, batch_size=None, num_workers=4)
        for batch in stream.consume(loader):                # one epoch; call again for the next
            train(batch.rows)
            checkpoint["data"] = stream.state_dict()        # JSON: the next step and what is left

    After the last step of an epoch the state moves to step 0 of the next
    epoch. A stream built for another world size (and rank, workers,
    ``interleave``) loads the same state and deals the rest of the epoch
    again. ``key`` names the column that identifies a row in the audit (None:
    a hash of each row's content).
    """

    def __init__(
        self,
        source: Sequence[Shard] | ShardedDataset,
        global_batch_size: int,
        *,
        rank: int,
        world_size: int,
        seed: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        interleave: int = 1,
        local_batch_multiple: int = 1,
        key: str | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        audit_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        shards = source.shards if isinstance(source, ShardedDataset) else source
        if isinstance(source, ShardedDataset) and key is None:
            key = source.key
        self.interleave = check_int("interleave", interleave, minimum=1)
        self.dataset = ShardedDataset(shards, key=key, cached_pieces=DEFAULT_CACHED_PIECES * self.interleave)
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        total = len(self.dataset)
        self.order = StreamOrder(
            tuple(shard.num_rows for shard in self.shards),
            check_int("seed", seed, minimum=0),
            min(check_int("block_size", block_size, minimum=1), total),
        )
        self._schedule = EpochPlan(total, global_batch_size, shuffle=False, local_batch_multiple=local_batch_multiple)
        self._steps = self._schedule.steps_per_epoch
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        self.collate_fn = collate_fn
        self.audit_dir = None if audit_dir is None else Path(audit_dir)
        if self.audit_dir is not None:
            shard_list = [identity.to_list() for identity in self.dataset.identities]
            write_expected(self.audit_dir, {"dataset_size": total, "shards": shard_list, "key": key})
        self._audit_writer: AuditWriter | None = None
        self._epoch = 0
        self._step = 0
        self._rest: Ranges | None = None
        self._segment: _Segment | None = None
        self._split: dict[int, npt.NDArray[np.int64]] = {}

    @property
    def shards(self) -> list[Shard]:
        """The shards, in the order their rows are numbered."""
        return self.dataset.shards

    @property
    def key(self) -> str | None:
        """The column that identifies a row (None: a hash of its content)."""
        return self.dataset.key

    @property
    def epoch(self) -> int:
        """The epoch of the next step to consume."""
        return self._epoch

    @property
    def step(self) -> int:
        """The next step of :attr:`epoch` to consume."""
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        """Steps in every epoch (the same for every world size)."""
        return self._steps

    def step_total(self, step: int) -> int:
        """Rows of step ``step``, all ranks together."""
        step = check_int("step", step, minimum=0, maximum=self.steps_per_epoch - 1)
        return self._schedule.step_total(step)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first step, unless the stream already stands inside that epoch.

        Standing inside it (after :meth:`load_state_dict` or a partial pass)
        the stream keeps its step, so a loop that calls ``set_epoch`` at the
        top of every epoch resumes instead of repeating the epoch's first steps.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        if epoch != self._epoch:
            self._epoch, self._step, self._rest, self._segment = epoch, 0, None, None

    def consume(self, loader: DataLoader[StreamBatch] | ShardedStream) -> Iterator[StreamBatch]:
        """Yield this rank's batches of the rest of the epoch from ``loader``, recording each as consumed.

        ``loader`` is a ``DataLoader`` over this stream with ``batch_size=None``
        (its ``num_workers`` must be the same on every rank), or the stream
        itself to read in this process.
        """
        segment = self._deal(self._workers_of(loader))
        self._segment = segment
        batches: Iterable[StreamBatch] = self._batches(segment, 0, 1) if loader is self else loader
        try:
            for batch in batches:
                self._record(batch)
                yield batch
        finally:
            if self._segment is segment:
                self._rest, self._segment = self._remaining(), None

    def state_dict(self) -> dict[str, Any]:
        """The next step to consume and the positions left, with what a resuming stream must share (JSON)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "remaining": [list(part) for part in self._remaining()],
            **self._settings(),
            "shards": [identity.to_list() for identity in self.dataset.identities],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` says; ``state`` may come from a stream of another world size or worker count.

        Raises ``ValueError`` in one line naming what differs: a setting, or
        the first shard whose rows or content are not the state's.
        """
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"state must be a ShardedStream state_dict of version {STATE_VERSION}, got {state!r}")
        try:
            theirs = [ShardIdentity.from_list(item) for item in state.get("shards", ())]
        except ValueError as error:
            raise ValueError(f"state['shards'] is not a list of shard identities: {error}") from None
        difference = shard_difference(theirs, self.dataset.identities, "the state")
        if difference is not None:
            raise ValueError(f"{difference}: a stream resumes only over the same shards, in the same order")
        for name, value in self._settings().items():
            if state.get(name) != value:
                raise ValueError(
                    f"state[{name!r}] is {state.get(name)!r} but this stream has {value!r}: a stream resumes only "
                    "over the same shards, seed, block_size, key, global_batch_size and local_batch_multiple"
                )
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        step = check_int("state['step']", state["step"], minimum=0, maximum=self.steps_per_epoch - 1)
        rest = check_ranges("state['remaining']", state.get("remaining"), self.order.total)
        left = self.order.total - self._schedule.step_start(step)
        if size_of(rest) != left:
            raise ValueError(f"state['remaining'] holds {size_of(rest)} positions but step {step} leaves {left}")
        self._epoch, self._step, self._rest, self._segment = epoch, step, rest, None

    def close(self) -> None:
        """Close the audit file, if one is open, and the shards this process opened."""
        self.dataset.close()
        if self._audit_writer is not None:
            self._audit_writer.close()
            self._audit_writer = None

    def __iter__(self) -> Iterator[StreamBatch]:
        """This worker's batches of the dealing :meth:`consume` made; iterating outside ``consume`` fails at once."""
        segment = self._segment
        if segment is None:
            raise RuntimeError(
                "iterate a ShardedStream through stream.consume(loader), not the DataLoader alone: consume() deals "
                "the epoch to the workers and records what training took (the state and the audit)"
            )
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if workers != segment.workers:
            raise RuntimeError(
                f"the stream was dealt for {segment.workers} DataLoader worker(s) but runs in {workers}: pass "
                "stream.consume() the DataLoader that iterates it"
            )
        return self._batches(segment, worker, workers)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_audit_writer"] = None
        return state

    def _settings(self) -> dict[str, Any]:
        shard_identities = self.dataset.identities
        return {
            "total_rows": self.order.total,
            "fingerprint": fingerprint_of(shard_identities),
            "seed": self.order.seed,
            "block_size": self.order.block_size,
            "key": self.key,
            "global_batch_size": self._schedule.global_batch_size,
            "local_batch_multiple": self._schedule.local_batch_multiple,
        }

    def _workers_of(self, loader: object) -> int:
        """The number of lanes per rank ``loader`` reads with; refuses a loader that would not keep the order."""
        if loader is self:
            return 1
        if not isinstance(loader, DataLoader) or loader.dataset is not self:
            raise TypeError(
                f"loader must be a DataLoader over this stream (or the stream itself), got {type(loader).__name__}"
            )
        if loader.batch_size is not None:
            raise ValueError(f"the DataLoader must have batch_size=None (the stream batches), got {loader.batch_size}")
        if loader.persistent_workers:
            raise ValueError("the DataLoader must not have persistent_workers: each consume() deals the epoch anew")
        if not getattr(loader, "in_order", True):
            raise ValueError("the DataLoader must keep in_order=True: the stream's steps arrive in order")
        return max(1, loader.num_workers)

    def _remaining(self) -> Ranges:
        segment = self._segment
        if segment is None:
            return [(0, self.order.total)] if self._rest is None else list(self._rest)
        flat = [ranges for rank in segment.lanes for worker in rank for ranges in worker]
        return remaining(flat, segment.delivered.reshape(-1).tolist())

    def _deal(self, workers: int) -> _Segment:
        """Deal what is left of the epoch to every rank's ``workers`` workers (each with ``interleave`` lanes)."""
        rest = self._remaining()
        schedule = self._schedule
        steps = np.arange(self.step, self.steps_per_epoch + 1)
        bounds = step_boundaries(steps, schedule.global_batch_size, schedule.local_batch_multiple, self.order.total)
        totals = np.diff(bounds)
        rows = lane_rows(totals, self.world_size, workers, self.interleave, self._schedule.local_batch_multiple)
        breaks = self.order.breaks(self.epoch)
        lanes = []
        for rank, region in enumerate(deal(rest, rows.sum(axis=(1, 2)).tolist(), breaks)):
            dealt = deal(region, rows[rank].reshape(-1).tolist(), breaks)
            lanes.append([dealt[first : first + self.interleave] for first in range(0, len(dealt), self.interleave)])
        return _Segment(self.epoch, self.step, workers, totals, lanes, np.zeros_like(rows))

    def _shares(self, total: int) -> npt.NDArray[np.int64]:
        """Each rank's rows of a step of ``total`` rows cut among its ``interleave`` lanes: (world, interleave)."""
        if total not in self._split:
            parts = split_sizes(total, self.world_size, self._schedule.local_batch_multiple)
            self._split[total] = np.asarray([split_sizes(part, self.interleave) for part in parts], dtype=np.int64)
        return self._split[total]

    def _batches(self, segment: _Segment, worker: int, workers: int) -> Iterator[StreamBatch]:
        rests = list(segment.lanes[self.rank][worker])
        for step in range(segment.first + worker, self.steps_per_epoch, workers):
            taken = []
            for lane, count in enumerate(self._shares(int(segment.totals[step - segment.first]))[self.rank].tolist()):
                head, rests[lane] = take(rests[lane], count)
                taken.append(positions_of(head))
            indices = self.order.rows_at(segment.epoch, np.concatenate(taken))
            before = self.dataset.rows_decoded
            rows, keys = self.dataset.gather(indices)
            decoded = self.dataset.rows_decoded - before
            collated = rows if self.collate_fn is None else self.collate_fn(rows)
            yield StreamBatch(segment.epoch, step, collated, indices, keys, decoded)

    def _record(self, batch: StreamBatch) -> None:
        """Record that ``batch`` was handed to training: advance the state past it and audit it."""
        segment = self._segment
        expected = (self.epoch, self.step)
        if not isinstance(batch, StreamBatch) or segment is None or (batch.epoch, batch.step) != expected:
            got = f"step {batch.step} of epoch {batch.epoch}" if isinstance(batch, StreamBatch) else repr(batch)[:80]
            raise RuntimeError(
                f"expected step {self.step} of epoch {self.epoch} next, got {got}: pass consume() the DataLoader "
                "over this stream, with batch_size=None and in_order=True"
            )
        if self.audit_dir is not None:
            if self._audit_writer is None:
                self._audit_writer = AuditWriter(self.audit_dir, self.rank, world_size=self.world_size)
            self._audit_writer.write(batch.epoch, batch.step, batch.indices, keys=batch.keys)
        offset = batch.step - segment.first
        segment.delivered[:, offset % segment.workers, :] += self._shares(int(segment.totals[offset]))
        if batch.step + 1 < self.steps_per_epoch:
            self._step = batch.step + 1
        else:
            self._epoch, self._step, self._rest, self._segment = batch.epoch + 1, 0, None, None
