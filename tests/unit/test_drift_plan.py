"""The replica checksum's plan over groups of processes that each hold one shard (FSDP2 groups): properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stalwart.runtime.consistency import drift_plan, drift_slots


def reduced(values: list[tuple[float, float, int]]) -> torch.Tensor:
    """The reduced tail's drift part: each process's values in its own slots, summed as the all-reduce does."""
    world = len(values)
    return torch.stack([drift_slots(rank, world, *value) for rank, value in enumerate(values)]).sum(dim=0)


@st.composite
def fleets(draw: st.DrawFn) -> tuple[int, int, set[tuple[int, int]]]:
    """Groups, processes per group, and the (group, intra-group rank) pairs whose shard drifted (a minority)."""
    groups = draw(st.integers(1, 6))
    group_size = draw(st.integers(1, 4))
    drifted_groups = draw(st.sets(st.integers(0, groups - 1), max_size=(groups - 1) // 2))
    drifted = set()
    for group in drifted_groups:
        ranks = draw(st.sets(st.integers(0, group_size - 1), min_size=1))
        drifted |= {(group, rank) for rank in ranks}
    return groups, group_size, drifted


@given(fleets(), st.integers(0, 1000))
def test_the_groups_with_a_drifted_shard_are_healed_from_a_group_that_agrees(
    fleet: tuple[int, int, set[tuple[int, int]]], step: int
) -> None:
    groups, group_size, drifted = fleet
    values = []
    for group in range(groups):
        for rank in range(group_size):
            shard = (100.0 + rank, 1000.0 + 3 * rank)  # shards of one model differ by rank, not by group
            if (group, rank) in drifted:  # each drifted shard its own way: drifted groups agree with nobody
                shard = (shard[0] + 1.0 + group, shard[1] * 2.0)
            values.append((*shard, step))
    plan = drift_plan(reduced(values), groups * group_size, group_size)
    drifted_groups = {group for group, _ in drifted}
    if not drifted_groups:
        assert plan is None
        return
    assert plan is not None
    assert set(plan.targets) == drifted_groups
    assert plan.source not in drifted_groups and 0 <= plan.source < groups


@given(st.integers(2, 6), st.integers(1, 4), st.data())
def test_a_group_behind_by_one_step_is_healed_even_when_its_shards_agree(
    groups: int, group_size: int, data: st.DataObject
) -> None:
    late = data.draw(st.integers(0, groups - 1))
    rank = data.draw(st.integers(0, group_size - 1))
    values = [(100.0 + r, 1000.0 + r, 7 - (g == late and r == rank)) for g in range(groups) for r in range(group_size)]
    plan = drift_plan(reduced(values), groups * group_size, group_size)
    assert plan is not None
    if groups > 2 or late == 1:
        assert plan.targets == (late,)  # the majority, or the tie's lowest-indexed group, is on time
    else:
        assert plan.targets == (1,)  # two groups, the first late: the tie goes to group 0


@pytest.mark.parametrize(("world_size", "group_size"), [(4, 3), (4, 0)])
def test_a_world_that_groups_do_not_divide_is_refused(world_size: int, group_size: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        drift_plan(torch.zeros(5 * world_size), world_size, group_size)
