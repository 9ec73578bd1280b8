"""The window of permuted positions answers exactly what the plan does, whatever the plan, epochs and positions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.index_window import WINDOW, IndexWindow
from stalwart.data.plan import EpochPlan


@st.composite
def plans(draw: st.DrawFn) -> EpochPlan:
    size = draw(st.integers(1, 3 * WINDOW))
    shuffle = draw(st.booleans())
    block = draw(st.integers(1, min(size, 64))) if shuffle else 1
    return EpochPlan(
        size,
        draw(st.integers(1, min(size, 64))),
        seed=draw(st.integers(0, 5)),
        shuffle=shuffle,
        block_size=block,
        window=draw(st.integers(1, -(-size // block))) if shuffle else 1,
    )


@st.composite
def asks(draw: st.DrawFn, size: int) -> tuple[int, np.ndarray]:
    """An epoch and positions: a run of consecutive ones (a step's fresh positions), some scattered ones (requeued
    after a failure), in any order."""
    start = draw(st.integers(0, size - 1))
    run = np.arange(start, min(size, start + draw(st.integers(0, 64))), dtype=np.int64)
    scattered = draw(st.lists(st.integers(0, size - 1), max_size=3))
    positions = np.concatenate([run, np.array(scattered, dtype=np.int64)])
    return draw(st.integers(0, 2)), np.array(draw(st.permutations(positions.tolist())), dtype=np.int64)


@settings(max_examples=150, deadline=None)
@given(st.data(), plans(), st.integers(1, 12))
def test_the_window_answers_as_the_plan(data: st.DataObject, plan: EpochPlan, calls: int) -> None:
    window = IndexWindow()
    other = EpochPlan(plan.dataset_size, plan.global_batch_size, seed=plan.seed + 1)
    for _ in range(calls):
        epoch, positions = data.draw(asks(plan.dataset_size))
        asked = data.draw(st.sampled_from([plan, other]))  # a new plan (a restart with another seed) is not mixed up
        assert window.indices_at(asked, epoch, positions).tolist() == asked.indices_at(epoch, positions).tolist()


def test_positions_outside_the_dataset_are_refused_as_the_plan_refuses_them() -> None:
    plan = EpochPlan(100, 8, seed=1)
    window = IndexWindow()
    assert window.indices_at(plan, 0, np.arange(90, 100)).tolist() == plan.indices_at(0, np.arange(90, 100)).tolist()
    for bad in ([99, 100], [-1, 3]):
        with pytest.raises(ValueError, match="positions must be in"):
            window.indices_at(plan, 0, np.array(bad, dtype=np.int64))
