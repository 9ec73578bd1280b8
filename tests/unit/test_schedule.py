"""Step schedule, splitting in multiples, micro-batches and the plan's epoch length."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_microbatches, split_sizes, step_boundary, step_total


@st.composite
def batch_and_multiple(draw: st.DrawFn) -> tuple[int, int]:
    batch = draw(st.integers(1, 500))
    return batch, draw(st.integers(1, batch))


@settings(max_examples=200, deadline=None)
@given(batch_and_multiple(), st.integers(0, 200))
def test_step_totals_are_the_closest_multiples_and_carry_over(bm: tuple[int, int], steps: int) -> None:
    batch, multiple = bm
    totals = [step_total(step, batch, multiple) for step in range(steps)]
    for total in totals:
        assert total % multiple == 0 and total >= multiple
    assert sum(totals) == step_boundary(steps, batch, multiple)
    assert abs(sum(totals) - batch * steps) <= multiple / 2
    first = totals[0] if totals else step_total(0, batch, multiple)
    lower = (batch // multiple) * multiple
    closest = min((lower, lower + multiple), key=lambda total: (abs(total - batch), total))
    assert first == closest


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 300), st.integers(1, 64))
def test_split_sizes_in_multiples_balanced(total: int, parts: int, multiple: int) -> None:
    sizes = split_sizes(total, parts, multiple)
    assert len(sizes) == parts and sum(sizes) == total
    assert max(sizes) - min(sizes) <= multiple
    assert sum(1 for size in sizes if size % multiple) <= (1 if total % multiple else 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(), max_size=300), st.integers(1, 50))
def test_microbatches_cover_the_share_in_order(share: list[int], max_microbatch: int) -> None:
    pieces = split_microbatches(share, max_microbatch)
    assert [item for piece in pieces for item in piece] == share
    assert all(1 <= len(piece) <= max_microbatch for piece in pieces)
    assert len(pieces) == -(-len(share) // max_microbatch)
    if pieces:
        assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), batch_and_multiple(), st.booleans())
def test_plan_steps_tile_the_epoch(size: int, bm: tuple[int, int], drop_last: bool) -> None:
    batch, multiple = bm
    if drop_last and step_boundary(1, batch, multiple) > size:
        with pytest.raises(ValueError, match="dataset_size must be at least the first step"):
            EpochPlan(size, batch, drop_last=drop_last, local_batch_multiple=multiple)
        return
    plan = EpochPlan(size, batch, drop_last=drop_last, local_batch_multiple=multiple)
    totals = [plan.step_total(step) for step in range(plan.steps_per_epoch)]
    assert sum(totals) == plan.epoch_length and all(totals)
    assert totals[:-1] == [step_total(step, batch, multiple) for step in range(len(totals) - 1)]
    if drop_last:
        assert totals[-1] == step_total(len(totals) - 1, batch, multiple)
        assert size - plan.epoch_length < step_total(len(totals), batch, multiple)
    else:
        assert plan.epoch_length == size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset_size": 0, "global_batch_size": 4}, r"dataset_size must be in \[1, "),
        ({"dataset_size": 10, "global_batch_size": 0}, r"global_batch_size must be in \[1, "),
        ({"dataset_size": 10, "global_batch_size": 4, "local_batch_multiple": 5}, r"local_batch_multiple .*\[1, 4\]"),
        ({"dataset_size": 10, "global_batch_size": 4, "seed": -1}, r"seed must be in \[0, "),
        ({"dataset_size": 3, "global_batch_size": 4, "drop_last": True}, "dataset_size must be at least the first"),
    ],
)
def test_plan_bad_arguments(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EpochPlan(**kwargs)


def test_plan_type_errors_name_the_parameter() -> None:
    with pytest.raises(TypeError, match="global_batch_size must be an int"):
        EpochPlan(10, 2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shuffle must be a bool"):
        EpochPlan(10, 2, shuffle="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_microbatch must be in \[1, "):
        split_microbatches([1, 2], 0)
    with pytest.raises(ValueError, match=r"parts must be in \[1, "):
        split_sizes(4, 0)
