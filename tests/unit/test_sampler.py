"""ManagedDistributedSampler: exactly-once shares, constant step totals, resume, and a real DataLoader."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stalwart.data import schedule
from stalwart.data.audit import audit_directory, coverage
from stalwart.data.info import LocalLedgerSource
from stalwart.data.plan import EpochPlan
from stalwart.data.sampler import ManagedDistributedSampler, split_microbatches
from stalwart.data.schedule import split_sizes, step_total
from stalwart.data.world import WorldInfo


@st.composite
def sampler_settings(draw: st.DrawFn) -> dict[str, Any]:
    size = draw(st.integers(1, 300))
    batch = draw(st.integers(1, 48))
    multiple = draw(st.integers(1, batch))
    drop_last = draw(st.booleans())
    # With drop_last the first step, rounded to the multiple, must fit in the dataset.
    assume(not drop_last or step_total(0, batch, multiple) <= size)
    return {
        "dataset": size,
        "global_batch_size": batch,
        "local_batch_multiple": multiple,
        "drop_last": drop_last,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32)),
        "allow_empty_shares": True,
    }


def flat(lists: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def all_ranks(world_size: int, epoch: int = 0, **kwargs: Any) -> list[list[list[int]]]:
    """Every rank's shares of one epoch, each from its own sampler."""
    shares = []
    for rank in range(world_size):
        sampler = ManagedDistributedSampler(world=WorldInfo(rank, world_size), **kwargs)
        sampler.set_epoch(epoch)
        rank_shares = list(sampler)
        assert len(rank_shares) == len(sampler)
        shares.append(rank_shares)
    return shares


@settings(max_examples=80, deadline=None)
@given(sampler_settings(), st.integers(1, 6), st.integers(0, 3))
def test_shares_are_exactly_once_with_the_schedules_totals(kwargs: dict[str, Any], world_size: int, epoch: int) -> None:
    plan = ManagedDistributedSampler(world=WorldInfo(0, 1), **kwargs).plan
    shares = all_ranks(world_size, epoch, **kwargs)
    assert {len(rank_shares) for rank_shares in shares} == {plan.steps_per_epoch}
    multiple = plan.local_batch_multiple
    for step in range(plan.steps_per_epoch):
        step_shares = [rank_shares[step] for rank_shares in shares]
        total = plan.step_total(step)
        if plan.step_start(step + 1) < plan.epoch_length:
            assert total == step_total(step, plan.global_batch_size, multiple)
        assert [len(share) for share in step_shares] == split_sizes(total, world_size, multiple)
        assert flat(step_shares) == plan.indices(epoch, plan.step_start(step), plan.step_start(step + 1)).tolist()
    consumed = [share for rank_shares in shares for share in rank_shares]
    assert coverage(consumed, plan.indices(epoch, 0, plan.epoch_length)).exactly_once
    if not plan.drop_last:
        assert sorted(flat(consumed)) == list(range(plan.dataset_size))


@settings(max_examples=40, deadline=None)
@given(sampler_settings(), st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_replica_groups_split_their_share(kwargs: dict[str, Any], layout: list[int]) -> None:
    world_size = sum(layout)
    plan = ManagedDistributedSampler(world=WorldInfo(0, 1), **kwargs).plan
    shares = []
    for rank in range(world_size):
        world = WorldInfo(rank, world_size)
        sampler = ManagedDistributedSampler(world=world, source=LocalLedgerSource(plan, world, layout), **kwargs)
        shares.append(list(sampler))
    first_ranks = np.cumsum([0, *layout])
    for step in range(plan.steps_per_epoch):
        sizes = [len(rank_shares[step]) for rank_shares in shares]
        group_totals = split_sizes(plan.step_total(step), len(layout), plan.local_batch_multiple)
        for group, workers in enumerate(layout):
            group_sizes = sizes[first_ranks[group] : first_ranks[group + 1]]
            assert group_sizes == split_sizes(group_totals[group], workers, plan.local_batch_multiple)
    consumed = [share for rank_shares in shares for share in rank_shares]
    assert coverage(consumed, plan.indices(0, 0, plan.epoch_length)).exactly_once


@settings(max_examples=60, deadline=None)
@given(sampler_settings(), st.integers(1, 4), st.data())
def test_state_round_trip_mid_epoch_yields_exactly_the_remainder(
    kwargs: dict[str, Any], world_size: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world_size - 1))
    sampler = ManagedDistributedSampler(world=WorldInfo(rank, world_size), **kwargs)
    sampler.set_epoch(2)
    full = list(sampler)
    taken = data.draw(st.integers(0, len(full)))
    iterator = iter(sampler)
    assert [next(iterator) for _ in range(taken)] == full[:taken]
    state = json.loads(json.dumps(sampler.state_dict()))

    restored = ManagedDistributedSampler(world=WorldInfo(rank, world_size), **kwargs)
    restored.load_state_dict(state)
    restored.set_epoch(2)
    assert restored.epoch == 2
    assert list(restored) == full[taken:]
    assert list(restored) == full


def test_iteration_starts_when_iter_is_called() -> None:
    sampler = ManagedDistributedSampler(50, 8, world=WorldInfo(0, 2))
    start = sampler.state_dict()
    list(sampler)
    assert sampler.state_dict() != start
    iter(sampler)
    assert sampler.state_dict() == start


def test_load_state_dict_resumes_the_next_iteration_only() -> None:
    sampler = ManagedDistributedSampler(50, 8, world=WorldInfo(0, 2))
    full = list(sampler)
    iterator = iter(sampler)
    next(iterator), next(iterator)
    state = sampler.state_dict()
    restored = ManagedDistributedSampler(50, 8, world=WorldInfo(0, 2))
    iter(restored)  # a DataLoader iterator made before restoring does not undo the restore
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert list(restored) == full[2:]
    assert list(restored) == full


def test_set_epoch_of_another_epoch_drops_a_pending_resume() -> None:
    sampler = ManagedDistributedSampler(50, 8, world=WorldInfo(0, 1))
    sampler.set_epoch(3)
    iterator = iter(sampler)
    next(iterator)
    restored = ManagedDistributedSampler(50, 8, world=WorldInfo(0, 1))
    restored.load_state_dict(sampler.state_dict())
    restored.set_epoch(4)
    fresh = ManagedDistributedSampler(50, 8, world=WorldInfo(0, 1))
    fresh.set_epoch(4)
    assert list(restored) == list(fresh)


def test_a_state_saved_after_the_epoch_resumes_to_nothing() -> None:
    sampler = ManagedDistributedSampler(50, 8, world=WorldInfo(0, 1))
    list(sampler)
    restored = ManagedDistributedSampler(50, 8, world=WorldInfo(0, 1))
    restored.load_state_dict(sampler.state_dict())
    assert list(restored) == []
    assert len(list(restored)) == len(restored)


def test_epochs_differ_and_repeat_like_distributed_sampler() -> None:
    sampler = ManagedDistributedSampler(64, 8, world=WorldInfo(1, 2), seed=5)
    first = list(sampler)
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert len(list(sampler)) == len(first)


def test_a_rank_without_chunks_yields_an_empty_share_every_step_when_allowed() -> None:
    shares = all_ranks(3, dataset=10, global_batch_size=4, local_batch_multiple=2, allow_empty_shares=True)
    assert [len(rank_shares) for rank_shares in shares] == [3, 3, 3]
    assert [len(share) for share in shares[2]] == [0, 0, 0]
    assert [len(share) for share in shares[0]] == [2, 2, 2]


def test_audit_dir_records_every_share(tmp_path: Path) -> None:
    for rank in range(3):
        sampler = ManagedDistributedSampler(45, 8, world=WorldInfo(rank, 3), audit_dir=tmp_path)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            list(sampler)
    report = audit_directory(tmp_path)
    assert report.ok and [audit.epoch for audit in report.epochs] == [0, 1]
    assert all(audit.complete and audit.coverage.exactly_once for audit in report.epochs)
    assert report.epochs[0].rank_batches == {(0, 3): 6, (1, 3): 6, (2, 3): 6}


def test_audit_dir_rejects_a_different_plan(tmp_path: Path) -> None:
    ManagedDistributedSampler(45, 8, world=WorldInfo(0, 1), audit_dir=tmp_path)
    with pytest.raises(ValueError, match="conflicts"):
        ManagedDistributedSampler(45, 9, world=WorldInfo(0, 1), audit_dir=tmp_path)


def test_world_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = ManagedDistributedSampler(range(20), 4)
    assert sampler.world == WorldInfo(1, 2)
    assert list(sampler) == all_ranks(2, dataset=20, global_batch_size=4)[1]


def test_split_microbatches_is_the_schedules() -> None:
    assert split_microbatches is schedule.split_microbatches


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"dataset": 0}, ValueError, "dataset"),
        ({"dataset": True}, TypeError, "dataset"),
        ({"dataset": object()}, TypeError, "dataset"),
        ({"dataset": [], "global_batch_size": 1}, ValueError, "len"),
        ({"global_batch_size": 0}, ValueError, "global_batch_size"),
        ({"local_batch_multiple": 9}, ValueError, "local_batch_multiple"),
        ({"shuffle": 1}, TypeError, "shuffle"),
        ({"seed": -1}, ValueError, "seed"),
        ({"world": (0, 1)}, TypeError, "world"),
        ({"source": object()}, TypeError, "source"),
        ({"source": LocalLedgerSource(EpochPlan(20, 4), WorldInfo(0, 1))}, ValueError, "source"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs: dict[str, Any], error: type[Exception], named: str) -> None:
    arguments: dict[str, Any] = {"dataset": 20, "global_batch_size": 8, "world": WorldInfo(0, 1), **kwargs}
    with pytest.raises(error, match=named):
        ManagedDistributedSampler(**arguments)


def test_bad_epoch_and_state_name_the_parameter() -> None:
    sampler = ManagedDistributedSampler(20, 8, world=WorldInfo(0, 1))
    with pytest.raises(ValueError, match="epoch"):
        sampler.set_epoch(-1)
    with pytest.raises(ValueError, match="state"):
        sampler.load_state_dict({"epoch": 0})
    state = sampler.state_dict()
    state["epoch"] = 1
    with pytest.raises(ValueError, match=r"state\['epoch'\] is 1"):
        sampler.load_state_dict(state)
    assert list(sampler) == all_ranks(1, dataset=20, global_batch_size=8)[0]
