"""Lanes: the stream's base order, the dealing of an epoch's rest to readers, and exactly once across changes."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.lanes import (
    StreamOrder,
    check_ranges,
    deal,
    lane_rows,
    positions_of,
    remaining,
    size_of,
    take,
)
from stalwart.data.schedule import split_sizes, step_total

shard_sizes = st.lists(st.integers(0, 60), min_size=1, max_size=7).filter(lambda sizes: sum(sizes) > 0)


@settings(max_examples=80, deadline=None)
@given(shard_sizes, st.integers(1, 16), st.integers(0, 2**32), st.integers(0, 4))
def test_the_base_order_runs_through_each_shard_in_ascending_blocks(
    sizes: list[int], block: int, seed: int, epoch: int
) -> None:
    order = StreamOrder(tuple(sizes), seed, block)
    total = sum(sizes)
    rows = order.rows_at(epoch, np.arange(total))
    assert sorted(rows.tolist()) == list(range(total)), "a bijection of the rows"
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    shard_of = np.searchsorted(offsets, rows, side="right") - 1
    starts = order.shard_starts(epoch)
    for shard, size in enumerate(sizes):
        where = np.flatnonzero(shard_of == shard)
        assert where.tolist() == list(range(starts[shard], starts[shard] + size)), "a shard is one run"
        blocks = (rows[where] - offsets[shard]) // block
        assert blocks.tolist() == sorted(blocks.tolist()), "its blocks come in ascending order"
    assert order.breaks(epoch) == sorted({*starts.tolist(), total})


def test_each_epoch_orders_the_shards_and_rows_afresh() -> None:
    order = StreamOrder((50, 50, 50, 50), 7, 10)
    epochs = [order.rows_at(epoch, np.arange(200)).tolist() for epoch in range(3)]
    assert len({tuple(rows) for rows in epochs}) == 3
    assert len({tuple(order.shard_starts(epoch).tolist()) for epoch in range(6)}) > 1
    assert StreamOrder((50, 50, 50, 50), 7, 10).rows_at(1, [5, 0]).tolist() == [epochs[1][5], epochs[1][0]]


@st.composite
def ranges_and_demands(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    total = draw(st.integers(1, 200))
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=8))) if total > 1 else []
    bounds = [0, *cuts, total]
    kept = [part for part in itertools.pairwise(bounds) if draw(st.booleans())] or [(0, total)]
    rows = size_of(kept)
    lanes = draw(st.integers(1, 8))
    marks = sorted(draw(st.lists(st.integers(0, rows), min_size=lanes - 1, max_size=lanes - 1)))
    demands = [high - low for low, high in itertools.pairwise([0, *marks, rows])]
    breaks = sorted({0, total, *draw(st.sets(st.integers(1, total), max_size=6))})
    return kept, demands, breaks


@settings(max_examples=150, deadline=None)
@given(ranges_and_demands())
def test_dealing_gives_each_lane_its_demand_and_every_position_once(case: Any) -> None:
    ranges, demands, breaks = case
    dealt = deal(ranges, demands, breaks)
    assert [size_of(lane) for lane in dealt] == demands
    everything = sorted(itertools.chain.from_iterable(positions_of(lane).tolist() for lane in dealt))
    assert everything == positions_of(ranges).tolist()
    for lane in dealt:
        assert lane == sorted(lane) and all(stop > start for start, stop in lane)
        assert all(low[1] < high[0] for low, high in itertools.pairwise(lane)), "merged and disjoint"


@settings(max_examples=100, deadline=None)
@given(ranges_and_demands())
def test_a_cut_shard_is_laid_out_smallest_part_first(case: Any) -> None:
    """The second reader of a forwards-only shard pays for the rows before its part: the smaller part goes first."""
    ranges, demands, breaks = case
    dealt = deal(ranges, demands, breaks)
    for low, high in itertools.pairwise(breaks):
        for start, stop in ranges:
            atom = (max(low, start), min(high, stop))
            if atom[0] >= atom[1]:
                continue
            parts = sorted(
                (max(a, atom[0]), min(b, atom[1])) for lane in dealt for a, b in lane if a < atom[1] and b > atom[0]
            )
            sizes = [b - a for a, b in parts]
            assert sizes == sorted(sizes)
            assert parts[0][0] == atom[0] and parts[-1][1] == atom[1]


def test_dealing_refuses_demands_that_do_not_add_up() -> None:
    with pytest.raises(ValueError, match="demands must add up to the 10 rows to deal, got 9"):
        deal([(0, 10)], [4, 5], [0, 10])
    with pytest.raises(ValueError, match=r"demands\[1\] must be in \[0, inf\], got -1"):
        deal([(0, 10)], [11, -1], [0, 10])


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=30),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 4),
)
def test_lane_rows_split_each_step_by_rank_then_worker_turn_then_interleave(
    totals: list[int], ranks: int, workers: int, interleave: int, multiple: int
) -> None:
    multiple = min(multiple, min(totals))
    rows = lane_rows(totals, ranks, workers, interleave, multiple)
    assert rows.shape == (ranks, workers, interleave) and rows.sum() == sum(totals)
    expected = np.zeros_like(rows)
    for step, total in enumerate(totals):
        for rank, part in enumerate(split_sizes(total, ranks, multiple)):
            expected[rank, step % workers] += split_sizes(part, interleave)
    assert (rows == expected).all()


@st.composite
def epoch_with_changes(draw: st.DrawFn) -> dict[str, Any]:
    sizes = draw(shard_sizes)
    batch = draw(st.integers(1, 24))
    steps = -(-sum(sizes) // batch)
    changes = sorted(draw(st.sets(st.integers(1, steps - 1), max_size=3))) if steps > 1 else []
    worlds = [
        (draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3))) for _ in range(len(changes) + 1)
    ]
    return {"sizes": sizes, "batch": batch, "block": draw(st.integers(1, 9)), "changes": changes, "worlds": worlds}


@settings(max_examples=120, deadline=None)
@given(epoch_with_changes(), st.integers(0, 2**16))
def test_an_epoch_is_delivered_exactly_once_across_world_worker_and_interleave_changes(
    case: dict[str, Any], seed: int
) -> None:
    """The whole protocol on integers: deal the rest to ranks, then to each rank's lanes; deliver the steps of
    each lane's turns; at a change, what is left is dealt again to the next (ranks, workers, interleave)."""
    order = StreamOrder(tuple(case["sizes"]), seed, case["block"])
    total, batch = order.total, case["batch"]
    steps = -(-total // batch)
    totals = [min(step_total(step, batch), total - step * batch) for step in range(steps)]
    rest = [(0, total)]
    delivered: list[int] = []
    bounds = [0, *case["changes"], steps]
    for (first, stop), (ranks, workers, interleave) in zip(itertools.pairwise(bounds), case["worlds"], strict=True):
        demand = lane_rows(totals[first:], ranks, workers, interleave)
        lanes = []
        for rank, region in enumerate(deal(rest, demand.sum(axis=(1, 2)).tolist(), order.breaks(0))):
            lanes.extend(deal(region, demand[rank].reshape(-1).tolist(), order.breaks(0)))
        done = lane_rows(totals[first:stop], ranks, workers, interleave).reshape(-1).tolist()
        for lane, count in zip(lanes, done, strict=True):
            delivered.extend(order.rows_at(0, positions_of(take(lane, count)[0])).tolist())
        rest = remaining(lanes, done)
        assert size_of(rest) == total - sum(totals[:stop])
    assert rest == [] and sorted(delivered) == list(range(total))


def test_ranges_from_a_state_are_checked() -> None:
    assert check_ranges("r", [[0, 3], [5, 9]], 10) == [(0, 3), (5, 9)]
    with pytest.raises(ValueError, match=r"r\[1\]\[0\] must be in \[3, 10\], got 2"):
        check_ranges("r", [[0, 3], [2, 9]], 10)
    with pytest.raises(ValueError, match=r"r\[0\]\[1\] must be in \[4, 10\], got 11"):
        check_ranges("r", [[3, 11]], 10)
    with pytest.raises(ValueError, match=r"r\[0\] must be \[start, stop\]"):
        check_ranges("r", [3], 10)
    with pytest.raises(ValueError, match="r must be a list of"):
        check_ranges("r", "0-3", 10)
