"""Sharded streams: an iterable dataset split over ranks and DataLoader workers, exactly once per epoch.

Epoch order
    The rows of all shards form one stream of ``total_rows`` positions per
    epoch, shuffled in three cheap levels, each keyed by the seed and the epoch
    only, so every rank computes the same order without talking to the others:

    * the shards, in an order permuted by ``(seed, epoch)``;
    * inside a shard, blocks of ``block_size`` consecutive rows (the last one
      may be shorter), in an order permuted by ``(seed, epoch, shard)``;
    * inside a block, its rows, permuted by ``(seed, epoch, shard, block)``.

    A block is the unit that is read, so shuffling rows inside it costs no
    extra I/O; a larger block mixes rows better, a smaller one reads less
    (see ``ShardedStream``). :class:`StreamOrder` is this mapping from stream
    positions to (shard, row), pure numpy and no I/O.

Steps and shares
    Step ``t`` of an epoch covers the stream positions of step ``t`` of the
    ledger's schedule (:class:`~stalwart.data.plan.EpochPlan` with
    ``dataset_size = total_rows``, unshuffled, no ``drop_last``), so the global
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

import functools
import hashlib
import os
from collections import OrderedDict
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
from stalwart.data.shards import Shard

DEFAULT_BLOCK_SIZE = 256
STATE_VERSION = 1
_SHARD_DOMAIN, _BLOCK_DOMAIN, _ROW_DOMAIN = 0, 1, 2
_CACHED_BLOCKS = 2


@dataclass(frozen=True)
class BlockSlice:
    """Consecutive stream positions that fall in one block: the block's row range and the rows, in stream order."""

    shard: int
    start: int
    stop: int
    rows: npt.NDArray[np.int64]


class StreamOrder:
    """The order of an epoch's stream: which (shard, row) sits at each position (see the module doc).

    Pure and deterministic: the same shard sizes, seed and block size give the
    same order in every process, and each epoch's order differs.
    """

    def __init__(self, shard_sizes: Sequence[int], seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if isinstance(shard_sizes, str) or not isinstance(shard_sizes, Sequence) or not shard_sizes:
            raise ValueError(f"shard_sizes must be a non-empty sequence of row counts, got {shard_sizes!r}")
        sizes = [check_int(f"shard_sizes[{index}]", size, minimum=0) for index, size in enumerate(shard_sizes)]
        self.shard_sizes: tuple[int, ...] = tuple(sizes)
        self.seed = check_int("seed", seed, minimum=0)
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.total_rows = int(self.offsets[-1])

    def shard_order(self, epoch: int) -> npt.NDArray[np.int64]:
        """The shards in the order epoch ``epoch`` streams them."""
        epoch = check_int("epoch", epoch, minimum=0)
        return _shard_layout(self.shard_sizes, self.seed, epoch)[0].copy()

    def locate(self, epoch: int, start: int, stop: int) -> list[BlockSlice]:
        """Where positions ``start..stop-1`` of epoch ``epoch`` are: one slice per run within a block."""
        epoch = check_int("epoch", epoch, minimum=0)
        start = check_int("start", start, minimum=0, maximum=self.total_rows)
        stop = check_int("stop", stop, minimum=start, maximum=self.total_rows)
        order, ends = _shard_layout(self.shard_sizes, self.seed, epoch)
        slices = []
        position = start
        while position < stop:
            ordinal = int(np.searchsorted(ends, position, side="right"))
            shard = int(order[ordinal])
            shard_start = int(ends[ordinal]) - self.shard_sizes[shard]
            shard_stop = min(stop, int(ends[ordinal]))
            blocks, block_ends = _block_layout(self.shard_sizes[shard], self.block_size, self.seed, epoch, shard)
            while position < shard_stop:
                offset = position - shard_start
                block_ordinal = int(np.searchsorted(block_ends, offset, side="right"))
                block_start = int(blocks[block_ordinal]) * self.block_size
                length = min(self.block_size, self.shard_sizes[shard] - block_start)
                within = offset - (int(block_ends[block_ordinal]) - length)
                take = min(length - within, shard_stop - position)
                rows = _row_order(self.seed, epoch, shard, block_start, length)[within : within + take]
                slices.append(BlockSlice(shard, block_start, block_start + length, block_start + rows))
                position += take
        return slices

    def global_ids(self, epoch: int, start: int, stop: int) -> npt.NDArray[np.int64]:
        """Global row ids (shard offset + row) at positions ``start..stop-1`` of epoch ``epoch``."""
        slices = self.locate(epoch, start, stop)
        return np.concatenate([np.zeros(0, dtype=np.int64), *(self.offsets[s.shard] + s.rows for s in slices)])


@functools.lru_cache(maxsize=16)
def _shard_layout(sizes: tuple[int, ...], seed: int, epoch: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The shard order of an epoch and the stream position where each shard in that order ends."""
    order = np.random.default_rng([seed, epoch, _SHARD_DOMAIN]).permutation(len(sizes)).astype(np.int64)
    return order, np.cumsum(np.asarray(sizes, dtype=np.int64)[order])


@functools.lru_cache(maxsize=256)
def _block_layout(
    size: int, block_size: int, seed: int, epoch: int, shard: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """A shard's block order in an epoch and the shard offset where each block in that order ends."""
    count = -(-size // block_size)
    order = np.random.default_rng([seed, epoch, _BLOCK_DOMAIN, shard]).permutation(count).astype(np.int64)
    lengths = np.minimum(block_size, size - order * block_size)
    return order, np.cumsum(lengths)


@functools.lru_cache(maxsize=1024)
def _row_order(seed: int, epoch: int, shard: int, block_start: int, length: int) -> npt.NDArray[np.int64]:
    """The order of the rows of one block (offsets from the block's first row)."""
    return np.random.default_rng([seed, epoch, _ROW_DOMAIN, shard, block_start]).permutation(length).astype(np.int64)


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
    Each iteration reads every block it touches whole (a block is read by up
    to ``world_size * num_workers`` readers), so keep ``block_size`` near a
    rank's share of a step unless a better shuffle is worth more reading.
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
        local_batch_multiple: int = 1,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        audit_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(shards, str) or not isinstance(shards, Sequence) or not shards:
            raise ValueError(f"shards must be a non-empty sequence of shards, got {shards!r}")
        for index, shard in enumerate(shards):
            if not isinstance(shard, Shard):
                raise TypeError(f"shards[{index}] must have num_rows and read(start, stop), got {shard!r}")
        self.shards = list(shards)
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        self.order = StreamOrder([shard.num_rows for shard in self.shards], seed, block_size)
        if self.order.total_rows == 0:
            raise ValueError(f"shards must hold at least one row in total, got {len(self.shards)} empty shards")
        self.plan = EpochPlan(
            self.order.total_rows, global_batch_size, shuffle=False, local_batch_multiple=local_batch_multiple
        )
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        self.collate_fn = collate_fn
        self.audit_dir = None if audit_dir is None else Path(audit_dir)
        if self.audit_dir is not None:
            write_expected(self.audit_dir, {"dataset_size": self.order.total_rows})
        self._audit_writer: AuditWriter | None = None
        self._epoch = 0
        self._step = 0

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
        return self._read_batch(check_int("epoch", epoch, minimum=0), step, _BlockCache(self.shards))

    def __iter__(self) -> Iterator[StreamBatch]:
        """This rank's batches of the current epoch from the current step (this worker's steps only)."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        blocks = _BlockCache(self.shards)
        for step in range(self.step + worker, self.steps_per_epoch, workers):
            yield self._read_batch(self.epoch, step, blocks)

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
                    "over the same shards, seed, block_size, global_batch_size and local_batch_multiple"
                )
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        step = check_int("state['step']", state["step"], minimum=0, maximum=self.steps_per_epoch - 1)
        self._epoch, self._step = epoch, step

    def close(self) -> None:
        """Close the audit file, if one is open."""
        if self._audit_writer is not None:
            self._audit_writer.close()
            self._audit_writer = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_audit_writer"] = None
        return state

    def _fingerprint(self) -> dict[str, Any]:
        sizes = np.asarray(self.order.shard_sizes, dtype="<i8").tobytes()
        return {
            "total_rows": self.order.total_rows,
            "shard_sizes_sha256": hashlib.sha256(sizes).hexdigest(),
            "seed": self.order.seed,
            "block_size": self.order.block_size,
            "global_batch_size": self.plan.global_batch_size,
            "local_batch_multiple": self.plan.local_batch_multiple,
        }

    def _read_batch(self, epoch: int, step: int, blocks: _BlockCache) -> StreamBatch:
        start, stop = self.positions(step)
        rows: list[Any] = []
        ids = []
        for piece in self.order.locate(epoch, start, stop):
            block = blocks.read(piece)
            rows.extend(block[row] for row in (piece.rows - piece.start).tolist())
            ids.append(self.order.offsets[piece.shard] + piece.rows)
        indices = np.concatenate([np.zeros(0, dtype=np.int64), *ids])
        return StreamBatch(epoch, step, rows if self.collate_fn is None else self.collate_fn(rows), indices)


class _BlockCache:
    """The last few blocks read by one iterator, so that consecutive steps in one block read it once."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        self._shards = shards
        self._blocks: OrderedDict[tuple[int, int], list[Any]] = OrderedDict()

    def read(self, piece: BlockSlice) -> list[Any]:
        key = (piece.shard, piece.start)
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return self._blocks[key]
        rows = self._shards[piece.shard].read(piece.start, piece.stop)
        if len(rows) != piece.stop - piece.start:
            raise RuntimeError(
                f"shard {piece.shard} returned {len(rows)} rows for read({piece.start}, {piece.stop}); "
                f"expected {piece.stop - piece.start}"
            )
        self._blocks[key] = rows
        if len(self._blocks) > _CACHED_BLOCKS:
            self._blocks.popitem(last=False)
        return rows
