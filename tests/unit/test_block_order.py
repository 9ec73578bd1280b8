"""The windowed block shuffle of ``EpochPlan(block_size=..., window=...)``: a permutation that keeps locality."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.permutation import FeistelPermutation
from stalwart.data.plan import EpochPlan


@st.composite
def block_plans(draw: st.DrawFn) -> EpochPlan:
    size = draw(st.integers(1, 3000))
    block = draw(st.integers(1, min(size, 300)))
    window = draw(st.integers(1, -(-size // block)))
    return EpochPlan(size, 7, seed=draw(st.integers(0, 2**32)), block_size=block, window=window)


def runs(labels: np.ndarray) -> int:
    """How many runs of equal consecutive labels ``labels`` has."""
    return int(np.count_nonzero(np.diff(labels))) + 1 if labels.size else 0


@settings(max_examples=80, deadline=None)
@given(plan=block_plans(), epoch=st.integers(0, 50))
def test_the_order_is_a_permutation_whose_blocks_and_windows_are_runs_of_positions(plan: EpochPlan, epoch: int) -> None:
    order = plan.indices(epoch, 0, plan.dataset_size)
    assert np.array_equal(np.sort(order), np.arange(plan.dataset_size))
    block, span = plan.block_size, plan.block_size * plan.window
    assert runs(order // block) == -(-plan.dataset_size // block)
    assert runs(order // span) == -(-plan.dataset_size // span)


@settings(max_examples=60, deadline=None)
@given(plan=block_plans(), epoch=st.integers(0, 50), data=st.data())
def test_a_share_of_consecutive_positions_reads_few_blocks_and_windows(
    plan: EpochPlan, epoch: int, data: st.DataObject
) -> None:
    start = data.draw(st.integers(0, plan.dataset_size - 1))
    stop = data.draw(st.integers(start + 1, plan.dataset_size))
    share = plan.indices(epoch, start, stop)
    span = plan.block_size * plan.window
    for unit in (plan.block_size, span):
        # every block (window) is a run of positions; the one short block (window), when the dataset does not
        # divide evenly, may sit inside the share and count once more
        extra = 2 if plan.dataset_size % unit else 1
        assert np.unique(share // unit).size <= -(-(stop - start) // unit) + extra


@settings(max_examples=30, deadline=None)
@given(size=st.integers(1, 5000), seed=st.integers(0, 2**32), epoch=st.integers(0, 100))
def test_block_size_one_and_window_one_is_the_global_shuffle(size: int, seed: int, epoch: int) -> None:
    key = int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0])
    expected = FeistelPermutation(size, key)(np.arange(size))
    assert np.array_equal(EpochPlan(size, 4, seed=seed).indices(epoch, 0, size), expected)


def test_epochs_and_seeds_give_other_orders_and_the_short_window_moves() -> None:
    plan = EpochPlan(1000, 10, block_size=30, window=4)  # windows of 120, the last one 40 rows
    orders = [plan.indices(epoch, 0, 1000) for epoch in range(8)]
    assert all((orders[0] != other).mean() > 0.9 for other in orders[1:])
    assert (orders[0] != EpochPlan(1000, 10, block_size=30, window=4, seed=1).indices(0, 0, 1000)).mean() > 0.9
    short_window_starts = {int(np.flatnonzero(order >= 960)[0]) for order in orders}
    assert len(short_window_starts) > 1
    rows_in_first_block = orders[0][:30]
    assert not np.array_equal(rows_in_first_block, np.sort(rows_in_first_block))


def test_steps_of_a_block_plan_cover_the_epoch_once() -> None:
    plan = EpochPlan(1797, 48, block_size=32, window=4, seed=5)
    steps = [plan.indices(0, plan.step_start(step), plan.step_start(step + 1)) for step in range(plan.steps_per_epoch)]
    assert np.array_equal(np.sort(np.concatenate(steps)), np.arange(1797))
    assert max(np.unique(step // 32).size for step in steps) <= 48 // 32 + 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"block_size": 0}, r"block_size must be in \[1, 100\], got 0"),
        ({"block_size": 101}, r"block_size must be in \[1, 100\], got 101"),
        ({"block_size": 30, "window": 5}, r"window must be in \[1, 4\], got 5"),
        ({"window": 0}, r"window must be in \[1, 100\], got 0"),
        ({"block_size": 10, "shuffle": False}, r"must stay 1 with shuffle=False, got block_size=10, window=1"),
    ],
)
def test_bad_block_arguments_are_refused_with_the_allowed_range(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EpochPlan(100, 10, **arguments)  # type: ignore[arg-type]


def test_the_plan_round_trips_through_its_dict() -> None:
    plan = EpochPlan(100, 10, block_size=10, window=3)
    assert EpochPlan(**plan.to_dict()) == plan
    older = {key: value for key, value in plan.to_dict().items() if key not in {"block_size", "window"}}
    assert EpochPlan(**older) == EpochPlan(100, 10)
