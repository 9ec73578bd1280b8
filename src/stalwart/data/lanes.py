"""Lanes: how a sharded stream deals what is left of an epoch to its readers, so that each row is read once.

Pure functions of integers; :class:`~stalwart.data.streaming.ShardedStream`
uses them in every rank and DataLoader worker, which therefore agree without
talking to each other.

The base order of an epoch
    Positions ``0..N-1`` of epoch ``e`` run through the shards in a keyed
    order of shards (a fresh permutation per epoch); inside a shard, through
    its blocks of ``block_size`` consecutive rows in order, and inside a block
    through its rows in a keyed order (:meth:`StreamOrder.rows_at`). A shard's
    rows therefore come in ascending blocks, which is what a shard that reads
    only forwards (a Hugging Face stream) needs, and a block is read once.

Lanes
    A *lane* is one reader's run of base positions: lane ``(r, k, i)`` is the
    ``i``-th of the ``interleave`` runs that DataLoader worker ``k`` of rank
    ``r`` reads, and it delivers part of rank ``r``'s batch of every step that
    worker produces. How many rows a lane delivers follows from the step
    schedule (:func:`lane_rows`). What is left of the epoch (a list of
    position ranges) is cut into the ranks' regions by their demands, and each
    region into its lanes' (:func:`deal`): so where each rank's region lies
    does not depend on how many workers any rank runs.

Cuts inside a shard
    Where a cut falls inside a shard, the parts of that shard are laid out
    smallest first: a forwards-only shard is then read from its start by the
    reader of the smallest part, and a later part costs its reader only the
    rows before it, at most half the shard for a cut in two.

Resuming
    After ``n`` steps every lane has delivered a prefix of its run;
    :func:`remaining` is the union of the rest, which the next dealing (at
    any world size, worker count or interleave) deals again. Every position
    of the epoch is therefore delivered exactly once, whatever the changes.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from stalwart._validate import check_int
from stalwart.data.permutation import FeistelPermutation
from stalwart.data.schedule import split_sizes

Ranges = list[tuple[int, int]]
"""Disjoint ``[start, stop)`` ranges of base positions, ascending."""

_SHARDS, _ROWS = 1, 2
"""Key domains: the epoch's order of shards, and the order of rows inside one block."""
_Layout = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]


@dataclass(frozen=True)
class StreamOrder:
    """The base order of every epoch over shards of ``shard_sizes`` rows (see the module doc)."""

    shard_sizes: tuple[int, ...]
    seed: int
    block_size: int
    _layouts: dict[int, _Layout] = field(default_factory=dict, init=False, repr=False, compare=False)
    _offsets: npt.NDArray[np.int64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("seed", self.seed, minimum=0)
        check_int("block_size", self.block_size, minimum=1)
        if not self.shard_sizes or sum(self.shard_sizes) < 1:
            raise ValueError(f"shard_sizes must hold at least one row, got {self.shard_sizes!r}")
        object.__setattr__(self, "_offsets", np.concatenate([[0], np.cumsum(self.shard_sizes, dtype=np.int64)]))

    @property
    def total(self) -> int:
        """Rows in an epoch."""
        return int(self._offsets[-1])

    def shard_starts(self, epoch: int) -> npt.NDArray[np.int64]:
        """The base position where each shard's rows begin in epoch ``epoch`` (by shard number)."""
        return self._layout(check_int("epoch", epoch, minimum=0))[1]

    def breaks(self, epoch: int) -> list[int]:
        """Ascending base positions where a shard begins, and the end: where dealing lays out cut shards."""
        return sorted({*self.shard_starts(epoch).tolist(), self.total})

    def rows_at(self, epoch: int, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Global row ids (shards concatenated by number) at base positions ``positions`` of epoch ``epoch``."""
        epoch = check_int("epoch", epoch, minimum=0)
        array = np.asarray(positions, dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= self.total):
            raise ValueError(f"positions must be in [0, {self.total - 1}], got [{array.min()}, {array.max()}]")
        ordered, _, ordered_starts = self._layout(epoch)
        slot = np.searchsorted(ordered_starts, array, side="right") - 1
        shard = ordered[slot]
        within_shard = array - ordered_starts[slot]
        block, within_block = np.divmod(within_shard, self.block_size)
        rows = np.empty_like(array)
        codes = shard * (self.total // self.block_size + 1) + block
        for code in np.unique(codes).tolist():
            where = codes == code
            number, first = int(shard[where][0]), int(block[where][0]) * self.block_size
            length = min(self.block_size, self.shard_sizes[number] - first)
            picked = within_block[where]
            if length > 1:
                picked = _permutation(length, (self.seed, epoch, _ROWS, number, first))(picked)
            rows[where] = self._offsets[number] + first + picked
        return rows

    def _layout(self, epoch: int) -> _Layout:
        """(shards in epoch order, base start by shard number, base start of each ordered shard plus the end)."""
        if epoch not in self._layouts:
            count = len(self.shard_sizes)
            ordered = _permutation(count, (self.seed, epoch, _SHARDS))(np.arange(count, dtype=np.int64))
            sizes = np.asarray(self.shard_sizes, dtype=np.int64)[ordered]
            ordered_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            by_number = np.empty(count, dtype=np.int64)
            by_number[ordered] = ordered_starts[:-1]
            if len(self._layouts) >= 4:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[epoch] = (ordered, by_number, ordered_starts)
        return self._layouts[epoch]


@functools.lru_cache(maxsize=4096)
def _permutation(size: int, key: tuple[int, ...]) -> FeistelPermutation:
    return FeistelPermutation(size, int(np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0]))


def lane_rows(
    step_totals: Sequence[int] | npt.NDArray[np.int64],
    ranks: int,
    workers: int,
    interleave: int,
    local_batch_multiple: int = 1,
) -> npt.NDArray[np.int64]:
    """Rows each lane delivers over steps of ``step_totals`` (the first one is worker 0's): shape (ranks, workers,
    interleave). Rank ``r`` takes ``split_sizes(total, ranks, local_batch_multiple)[r]`` of each step, the worker
    whose turn it is takes all of that, split among its ``interleave`` lanes by ``split_sizes``."""
    ranks = check_int("ranks", ranks, minimum=1)
    workers = check_int("workers", workers, minimum=1)
    interleave = check_int("interleave", interleave, minimum=1)
    totals = np.asarray(step_totals, dtype=np.int64).reshape(-1)
    rows = np.zeros((ranks, workers, interleave), dtype=np.int64)
    turns = np.arange(totals.size) % workers
    values, inverse = np.unique(totals, return_inverse=True)
    counts = np.zeros((values.size, workers), dtype=np.int64)
    np.add.at(counts, (inverse.reshape(-1), turns), 1)
    for number, total in enumerate(values.tolist()):
        for rank, part in enumerate(split_sizes(total, ranks, local_batch_multiple)):
            rows[rank] += np.outer(counts[number], split_sizes(part, interleave))
    return rows


def deal(ranges: Ranges, demands: Sequence[int], breaks: Sequence[int]) -> list[Ranges]:
    """Cut ``ranges`` (in order) into consecutive parts of ``demands`` rows, one per lane, and lay the parts that
    share a piece between two ``breaks`` (a shard) out smallest first (see the module doc). ``sum(demands)``
    must be the rows of ``ranges``."""
    wanted = [check_int(f"demands[{number}]", demand, minimum=0) for number, demand in enumerate(demands)]
    if sum(wanted) != size_of(ranges):
        raise ValueError(f"demands must add up to the {size_of(ranges)} rows to deal, got {sum(wanted)}")
    dealt: list[Ranges] = [[] for _ in wanted]
    lane, left = 0, wanted[0] if wanted else 0
    for start, stop in _atoms(ranges, breaks):
        parts: list[tuple[int, int]] = []  # (size, lane) in lane order
        position = start
        while position < stop:
            while left == 0:
                lane += 1
                left = wanted[lane]
            size = min(left, stop - position)
            parts.append((size, lane))
            position += size
            left -= size
        position = start
        for size, owner in sorted(parts, key=lambda part: part[0]):  # stable: ties keep lane order
            _append(dealt[owner], position, position + size)
            position += size
    return dealt


def take(ranges: Ranges, count: int) -> tuple[Ranges, Ranges]:
    """The first ``count`` positions of ``ranges`` and the rest, each as ranges."""
    count = check_int("count", count, minimum=0, maximum=size_of(ranges))
    head: Ranges = []
    rest: Ranges = []
    for start, stop in ranges:
        if count >= stop - start:
            head.append((start, stop))
            count -= stop - start
        elif count > 0:
            head.append((start, start + count))
            rest.append((start + count, stop))
            count = 0
        else:
            rest.append((start, stop))
    return head, rest


def remaining(lanes: Sequence[Ranges], delivered: Sequence[int]) -> Ranges:
    """What the lanes have not delivered after ``delivered`` rows each: their runs' rest, ascending and merged."""
    rest = sorted(part for ranges, count in zip(lanes, delivered, strict=True) for part in take(ranges, count)[1])
    merged: Ranges = []
    for start, stop in rest:
        _append(merged, start, stop)
    return merged


def positions_of(ranges: Ranges) -> npt.NDArray[np.int64]:
    """Every position of ``ranges``, in order."""
    if not ranges:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(start, stop, dtype=np.int64) for start, stop in ranges])


def size_of(ranges: Ranges) -> int:
    """How many positions ``ranges`` hold."""
    return sum(stop - start for start, stop in ranges)


def check_ranges(name: str, value: object, total: int) -> Ranges:
    """``value`` as ranges inside ``[0, total)`` (from JSON: lists of two ints), disjoint and ascending, else raise."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list of [start, stop] ranges, got {value!r}")
    ranges: Ranges = []
    for number, item in enumerate(value):
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise ValueError(f"{name}[{number}] must be [start, stop], got {item!r}")
        floor = ranges[-1][1] if ranges else 0
        start = check_int(f"{name}[{number}][0]", item[0], minimum=floor, maximum=total)
        stop = check_int(f"{name}[{number}][1]", item[1], minimum=start + 1, maximum=total)
        ranges.append((start, stop))
    return ranges


def _atoms(ranges: Ranges, breaks: Sequence[int]) -> list[tuple[int, int]]:
    """``ranges`` cut at every break that falls strictly inside one."""
    cuts = np.asarray(breaks, dtype=np.int64)
    atoms: list[tuple[int, int]] = []
    for start, stop in ranges:
        inner = cuts[(cuts > start) & (cuts < stop)].tolist()
        atoms.extend(itertools.pairwise([start, *inner, stop]))
    return atoms


def _append(ranges: Ranges, start: int, stop: int) -> None:
    """Add ``[start, stop)`` after the last range, merging when they touch."""
    if start == stop:
        return
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], stop)
    else:
        ranges.append((start, stop))
