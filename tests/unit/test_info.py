"""DataLoadingInfo, replica-group splits and the fixed-world LocalLedgerSource."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stalwart.data.audit import coverage
from stalwart.data.info import (
    DataLoadingInfo,
    DataLoadingInfoSource,
    LocalLedgerSource,
    split_group_share,
)
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_sizes, step_total
from stalwart.data.world import WorldInfo


@st.composite
def plans(draw: st.DrawFn, max_size: int = 300) -> EpochPlan:
    size = draw(st.integers(1, max_size))
    batch = draw(st.integers(1, 48))
    multiple = draw(st.integers(1, batch))
    drop_last = draw(st.booleans())
    # With drop_last the first step, rounded to the multiple, must fit in the dataset.
    assume(not drop_last or step_total(0, batch, multiple) <= size)
    return EpochPlan(size, batch, seed=draw(st.integers(0, 2**32)), drop_last=drop_last, local_batch_multiple=multiple)


@st.composite
def group_layouts(draw: st.DrawFn) -> list[int]:
    return draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))


def sample_info(**changes: object) -> DataLoadingInfo:
    fields: dict[str, object] = {
        "epoch": 2,
        "step": 3,
        "base_index": 40,
        "missing_indices": [7, 9],
        "num_replica_groups": 2,
        "replica_group_rank": 1,
        "intra_group_world_size": 2,
        "intra_group_rank": 1,
        "global_world_size": 4,
        "global_rank": 3,
        "indices": [12, 5, 30],
    }
    fields.update(changes)
    return DataLoadingInfo(**fields)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 400), st.integers(1, 9), st.integers(1, 16), st.integers(0, 10**6))
def test_group_split_is_contiguous_disjoint_and_follows_split_sizes(
    count: int, workers: int, multiple: int, offset: int
) -> None:
    share = np.arange(offset, offset + count, dtype=np.int64)[::-1]
    parts = [split_group_share(share, workers, rank, multiple) for rank in range(workers)]
    assert [part.size for part in parts] == split_sizes(count, workers, multiple)
    assert np.array_equal(np.concatenate(parts), share)


def test_group_split_rejects_a_rank_outside_the_group() -> None:
    with pytest.raises(ValueError, match=r"intra_group_rank must be in \[0, 2\], got 3"):
        split_group_share(np.arange(6), 3, 3)
    with pytest.raises(ValueError, match="intra_group_world_size"):
        split_group_share(np.arange(6), 0, 0)


@settings(max_examples=60, deadline=None)
@given(plans(), group_layouts(), st.integers(0, 5), st.data())
def test_for_worker_numbers_ranks_group_by_group_and_splits_the_share(
    plan: EpochPlan, layout: list[int], epoch: int, data: st.DataObject
) -> None:
    names = [f"g{index}" for index in range(len(layout))]
    group_sizes = dict(zip(names, layout, strict=True))
    total = data.draw(st.integers(0, plan.epoch_length))
    positions = np.asarray(data.draw(st.permutations(range(plan.epoch_length))), dtype=np.int64)[:total]
    cuts = np.cumsum(split_sizes(total, len(names), plan.local_batch_multiple))[:-1]
    shares = dict(zip(names, np.split(positions, cuts), strict=True))
    infos = [
        DataLoadingInfo.for_worker(
            plan,
            epoch=epoch,
            step=1,
            base_index=total,
            missing_indices=[3, 1],
            group_sizes=group_sizes,
            member=name,
            group_share=shares[name],
            intra_group_rank=intra,
        )
        for name in names
        for intra in range(group_sizes[name])
    ]
    assert [info.global_rank for info in infos] == list(range(sum(layout)))
    assert {info.global_world_size for info in infos} == {sum(layout)}
    assert {info.num_replica_groups for info in infos} == {len(layout)}
    for info in infos:
        name = names[info.replica_group_rank]
        assert info.intra_group_world_size == group_sizes[name]
        multiple = plan.local_batch_multiple
        expected = split_group_share(shares[name], info.intra_group_world_size, info.intra_group_rank, multiple)
        assert info.indices == plan.indices_at(epoch, expected).tolist()
        assert info.missing_indices == [3, 1] and info.base_index == total
    taken = [info.indices for info in infos]
    assert coverage(taken, plan.indices_at(epoch, positions)).exactly_once


def test_for_worker_rejects_a_member_not_in_the_groups() -> None:
    plan = EpochPlan(10, 4)
    with pytest.raises(ValueError, match="member must be one of group_sizes"):
        DataLoadingInfo.for_worker(
            plan,
            epoch=0,
            step=0,
            base_index=0,
            missing_indices=[],
            group_sizes={"a": 1},
            member="b",
            group_share=[0],
            intra_group_rank=0,
        )
    with pytest.raises(ValueError, match=r"group_sizes\['a'\] must be in"):
        DataLoadingInfo.for_worker(
            plan,
            epoch=0,
            step=0,
            base_index=0,
            missing_indices=[],
            group_sizes={"a": 0},
            member="a",
            group_share=[0],
            intra_group_rank=0,
        )


def test_json_round_trip() -> None:
    info = sample_info()
    text = json.dumps(info.to_dict())
    assert DataLoadingInfo.from_dict(json.loads(text)) == info


@settings(max_examples=50, deadline=None)
@given(plans(), group_layouts(), st.data())
def test_json_round_trip_of_built_infos(plan: EpochPlan, layout: list[int], data: st.DataObject) -> None:
    world_size = sum(layout)
    world = WorldInfo(data.draw(st.integers(0, world_size - 1)), world_size)
    source = LocalLedgerSource(plan, world, layout)
    while (info := source.next_step()) is not None:
        assert DataLoadingInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info


def test_from_dict_names_missing_and_unknown_fields() -> None:
    data = sample_info().to_dict()
    del data["global_rank"]
    data["rank"] = 0
    with pytest.raises(ValueError, match=r"missing \['global_rank'\], unknown \['rank'\]"):
        DataLoadingInfo.from_dict(data)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"global_rank": 4}, "global_rank"),
        ({"intra_group_rank": 2}, "intra_group_rank"),
        ({"replica_group_rank": 2}, "replica_group_rank"),
        ({"global_world_size": 1}, "global_world_size"),
        ({"step": -1}, "step"),
        ({"indices": [1, -2]}, "indices"),
        ({"missing_indices": (1, 2)}, "missing_indices"),
    ],
)
def test_info_fields_are_validated(changes: dict[str, object], named: str) -> None:
    with pytest.raises((TypeError, ValueError), match=named):
        sample_info(**changes)


def test_local_source_implements_the_protocol() -> None:
    assert isinstance(LocalLedgerSource(EpochPlan(10, 4), WorldInfo(0, 1)), DataLoadingInfoSource)


@settings(max_examples=60, deadline=None)
@given(plans(), group_layouts(), st.integers(0, 4))
def test_local_source_hands_every_position_once_with_the_schedules_totals(
    plan: EpochPlan, layout: list[int], epoch: int
) -> None:
    world_size = sum(layout)
    per_rank = []
    for rank in range(world_size):
        source = LocalLedgerSource(plan, WorldInfo(rank, world_size), layout)
        source.set_epoch(epoch)
        infos = []
        while (info := source.next_step()) is not None:
            infos.append(info)
        assert len(infos) == len(source) == plan.steps_per_epoch
        assert source.next_step() is None
        per_rank.append(infos)
    for step in range(plan.steps_per_epoch):
        infos = [rank_infos[step] for rank_infos in per_rank]
        assert [info.global_rank for info in infos] == list(range(world_size))
        assert {(info.epoch, info.step, info.base_index) for info in infos} == {(epoch, step, plan.step_start(step))}
        step_indices = np.concatenate([np.asarray(info.indices, dtype=np.int64) for info in infos])
        assert np.array_equal(step_indices, plan.indices(epoch, plan.step_start(step), plan.step_start(step + 1)))
        group_totals = [0] * len(layout)
        for info in infos:
            group_totals[info.replica_group_rank] += len(info.indices)
        assert group_totals == split_sizes(plan.step_total(step), len(layout), plan.local_batch_multiple)
    everything = [info.indices for rank_infos in per_rank for info in rank_infos]
    assert coverage(everything, plan.indices(epoch, 0, plan.epoch_length)).exactly_once


@settings(max_examples=60, deadline=None)
@given(plans(), st.integers(1, 5), st.integers(1, 5), st.data())
def test_local_source_resumes_at_another_world_size(
    plan: EpochPlan, before: int, after: int, data: st.DataObject
) -> None:
    steps_before = data.draw(st.integers(0, plan.steps_per_epoch))
    sources = [LocalLedgerSource(plan, WorldInfo(rank, before)) for rank in range(before)]
    taken = []
    for source in sources:
        source.set_epoch(1)
        for _ in range(steps_before):
            info = source.next_step()
            assert info is not None
            taken.append(info.indices)
    state = json.loads(json.dumps(sources[0].state_dict()))
    assert all(source.state_dict() == sources[0].state_dict() for source in sources)
    for rank in range(after):
        source = LocalLedgerSource(plan, WorldInfo(rank, after))
        source.load_state_dict(state)
        assert source.epoch == 1
        while (info := source.next_step()) is not None:
            assert info.step >= steps_before
            taken.append(info.indices)
    assert coverage(taken, plan.indices(1, 0, plan.epoch_length)).exactly_once


def test_local_source_set_epoch_restarts_from_the_first_step() -> None:
    source = LocalLedgerSource(EpochPlan(20, 4), WorldInfo(0, 1))
    first = source.next_step()
    source.next_step()
    source.set_epoch(0)
    assert source.next_step() == first
    source.set_epoch(1)
    second_epoch = source.next_step()
    assert second_epoch is not None and first is not None
    assert second_epoch.epoch == 1 and second_epoch.step == 0 and second_epoch.indices != first.indices


def test_local_source_rejects_a_state_of_another_plan() -> None:
    state = LocalLedgerSource(EpochPlan(20, 4), WorldInfo(0, 1)).state_dict()
    with pytest.raises(ValueError, match="state was saved for plan"):
        LocalLedgerSource(EpochPlan(20, 5), WorldInfo(0, 1)).load_state_dict(state)
    with pytest.raises(ValueError, match="state must be a LocalLedgerSource state_dict"):
        LocalLedgerSource(EpochPlan(20, 4), WorldInfo(0, 1)).load_state_dict({"epoch": 0})


@pytest.mark.parametrize(("layout", "match"), [([1, 2], "add up to world_size=4"), ([4, 0], r"group_sizes\[1\]")])
def test_local_source_checks_the_group_layout(layout: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LocalLedgerSource(EpochPlan(20, 4), WorldInfo(0, 4), layout)
