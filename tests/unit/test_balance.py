"""Shares that follow weights: the split's rules, the decision, and a balanced ledger's invariants."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.data.balance import apportion, group_measurements, rebalance, resolution, weighted_split_sizes
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_sizes

weight_lists = st.lists(st.integers(1, 1000), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 500), weight_lists, st.integers(1, 9))
def test_weighted_sizes_cover_the_total_in_multiples(total: int, weights: list[int], multiple: int) -> None:
    sizes = weighted_split_sizes(total, weights, multiple)
    assert len(sizes) == len(weights) and sum(sizes) == total and min(sizes) >= 0
    assert sum(1 for size in sizes if size % multiple) <= (1 if total % multiple else 0)
    if total // multiple >= len(weights):
        assert min(sizes) >= multiple  # nobody empty when there are chunks enough


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 500), st.integers(1, 12), st.integers(1, 1000), st.integers(1, 9))
def test_equal_weights_split_exactly_as_split_sizes(total: int, parts: int, weight: int, multiple: int) -> None:
    assert weighted_split_sizes(total, [weight] * parts, multiple) == split_sizes(total, parts, multiple)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 400), weight_lists)
def test_apportion_stays_within_one_chunk_of_the_quota(chunks: int, weights: list[int]) -> None:
    counts = apportion(chunks, weights)
    assert sum(counts) == chunks
    quotas = [chunks * weight / sum(weights) for weight in weights]
    if chunks < len(weights) or min(quotas) >= 1:  # no empty part had to be lifted
        assert all(abs(count - quota) < 1 for count, quota in zip(counts, quotas, strict=True))


def test_a_member_twice_as_slow_gets_half_the_share() -> None:
    weights = rebalance([1, 1, 1], samples=[16, 16, 16], seconds=[1.0, 1.0, 2.0], chunks=12)
    assert weights == [5, 5, 2]
    assert weighted_split_sizes(48, weights, 4) == [20, 20, 8]
    # measured again at the new shares, the same speeds: nothing better to propose
    assert rebalance(weights, samples=[20, 20, 8], seconds=[1.25, 1.25, 1.0], chunks=12) is None


def test_rebalance_keeps_weights_within_the_threshold_and_without_measurements() -> None:
    assert rebalance([2, 2], samples=[10, 10], seconds=[1.0, 1.04], chunks=4) is None
    assert rebalance([2, 2], samples=[0, 0], seconds=[0.0, 0.0], chunks=4) is None
    # an unmeasured member counts at the measured ones' mean throughput
    assert rebalance([1, 1, 1], samples=[10, 0, 10], seconds=[1.0, 0.0, 4.0], chunks=9) == [5, 3, 1]
    # a very slow member still keeps one chunk
    assert rebalance([1, 1], samples=[10, 10], seconds=[1.0, 1000.0], chunks=8) == [7, 1]


def test_a_replica_group_counts_as_its_slowest_process() -> None:
    slots = [1.0, 8.0, 3.0, 8.0, 2.0, 16.0]  # member a: processes 0 and 1; member b: process 2
    assert group_measurements(slots, [2, 1]) == ([16.0, 16.0], [3.0, 2.0])
    with pytest.raises(ValueError, match=r"slots must hold 2 values per process \(4\), got 6"):
        group_measurements(slots, [1, 1])


def test_resolution_is_a_full_step_in_chunks() -> None:
    assert resolution(EpochPlan(1000, 48, local_batch_multiple=4), 3) == 12
    assert resolution(EpochPlan(1000, 8, local_batch_multiple=4), 3) == 3


def test_bad_arguments_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"weights\[1\] must be in \[1, inf\], got 0"):
        weighted_split_sizes(10, [1, 0])
    with pytest.raises(ValueError, match="weights must be a non-empty sequence"):
        apportion(3, [])
    with pytest.raises(ValueError, match="one value per weight"):
        rebalance([1, 1], samples=[1], seconds=[1, 1], chunks=4)
    with pytest.raises(ValueError, match=r"chunks must be in \[2, inf\], got 1"):
        rebalance([1, 1], samples=[1, 1], seconds=[1, 1], chunks=1)
    with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\), got 1.5"):
        rebalance([1, 1], samples=[1, 1], seconds=[1, 1], chunks=4, threshold=1.5)
    ledger = DataLedger(EpochPlan(100, 10))
    with pytest.raises(RuntimeError, match="needs a balanced ledger"):
        ledger.reweigh({"a": 1})
    balanced = DataLedger(EpochPlan(100, 10), balance_every=2)
    with pytest.raises(ValueError, match=r"weights\['a'\] must be in \[1, inf\], got 0"):
        balanced.reweigh({"a": 0})
    balanced.begin_step(["a"])
    with pytest.raises(RuntimeError, match="between steps"):
        balanced.reweigh({"a": 1})
    with pytest.raises(ValueError, match=r"balance_every must be in \[0, inf\], got -1"):
        DataLedger(EpochPlan(100, 10), balance_every=-1)


@st.composite
def plans(draw: st.DrawFn) -> EpochPlan:
    batch = draw(st.integers(1, 64))
    multiple = draw(st.integers(1, min(batch, 8)))
    size = draw(st.integers(1, 500))
    return EpochPlan(size, batch, seed=draw(st.integers(0, 5)), local_batch_multiple=multiple)


def drive(
    ledger: DataLedger, data: st.DataObject, max_steps: int
) -> tuple[list[dict[str, list[int]]], list[np.ndarray]]:
    """Steps with joins, failures, reassigns, re-queues and random reweighs; (shares, committed) per step."""
    members = [f"m{i}" for i in range(data.draw(st.integers(1, 5)))]
    fresh = 100
    shares_seen, committed = [], []
    for _ in range(max_steps):
        if ledger.epoch_complete:
            break
        if data.draw(st.booleans()):
            known = [*members, f"gone{fresh}"]
            ledger.reweigh({m: data.draw(st.integers(1, 50)) for m in known if data.draw(st.booleans())})
        if data.draw(st.integers(0, 3)) == 0:
            members.append(f"m{fresh}")
            fresh += 1
        base, missing = ledger.base_index, ledger.missing_indices
        shares = ledger.begin_step(members)
        step = np.concatenate(list(shares.values()))
        total = step.size
        expected_fresh = total - min(total, missing.size)
        assert np.array_equal(
            step, np.concatenate([missing[: total - expected_fresh], np.arange(base, base + expected_fresh)])
        )
        multiple = ledger.plan.local_batch_multiple
        assert sum(1 for share in shares.values() if share.size % multiple) <= (1 if total % multiple else 0)
        if total // multiple >= len(members):
            assert all(share.size >= multiple for share in shares.values())
        shares_seen.append({member: share.tolist() for member, share in shares.items()})
        alive = list(members)
        for _ in range(data.draw(st.integers(0, min(2, len(alive))))):
            ledger.member_failed(alive.pop(data.draw(st.integers(0, len(alive) - 1))))
        if alive and data.draw(st.booleans()):
            ledger.reassign(alive)
        committed.append(ledger.commit())
        members = alive or [f"m{fresh}"]
        fresh += 1
    return shares_seen, committed


@settings(max_examples=150, deadline=None)
@given(plans(), st.data())
def test_balanced_ledger_commits_each_position_exactly_once(plan: EpochPlan, data: st.DataObject) -> None:
    ledger = DataLedger(plan, balance_every=1)
    _, committed = drive(ledger, data, max_steps=10 * plan.steps_per_epoch + 10)
    assert ledger.epoch_complete
    everything = np.concatenate(committed)
    assert np.array_equal(np.sort(everything), np.arange(plan.epoch_length))


@settings(max_examples=100, deadline=None)
@given(plans(), st.integers(0, 10), st.lists(st.integers(1, 20), min_size=1, max_size=5), st.booleans())
def test_balanced_state_round_trip_continues_identically(
    plan: EpochPlan, steps_before: int, weights: list[int], fail_first: bool
) -> None:
    ledger = DataLedger(plan, balance_every=3)
    members = [f"w{i}" for i in range(len(weights))]
    for _ in range(steps_before):
        ledger.begin_step(members)
        ledger.commit()
    ledger.reweigh(dict(zip(members, weights, strict=True)))
    ledger.begin_step(members)
    if fail_first:
        ledger.member_failed(members[0])
    restored = DataLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.state_dict() == ledger.state_dict()
    survivors = members[1:] if fail_first else members
    for copy in (ledger, restored):
        if survivors:
            copy.reassign(survivors)
    assert np.array_equal(ledger.commit(), restored.commit())
    for _ in range(3):
        next_members = [*survivors, "fresh"]
        original = ledger.begin_step(next_members)
        again = restored.begin_step(next_members)
        assert {m: s.tolist() for m, s in original.items()} == {m: s.tolist() for m, s in again.items()}
        assert np.array_equal(ledger.commit(), restored.commit())


def test_shares_follow_the_recorded_weights() -> None:
    ledger = DataLedger(EpochPlan(1000, 48, local_batch_multiple=4), balance_every=2)
    assert [s.size for s in ledger.begin_step(["a", "b", "c"]).values()] == [16, 16, 16]
    ledger.commit()
    ledger.reweigh({"a": 5, "b": 5, "c": 2})
    assert ledger.weights_record() == {"step": 1, "weights": {"a": 5, "b": 5, "c": 2}}
    assert [s.size for s in ledger.begin_step(["a", "b", "c"]).values()] == [20, 20, 8]
    ledger.member_failed("a")
    extra = ledger.reassign(["b", "c"])
    assert [extra[m].size for m in "bc"] == [16, 4]  # the lost 20 go by weight: b ends with 36, c with 12
    ledger.commit()
    # a newcomer counts at the mean recorded weight of the step's members (b 5, c 2 -> d 4): 12 chunks by 5:2:4
    assert [s.size for s in ledger.begin_step(["b", "c", "d"]).values()] == [24, 8, 16]


def test_an_unbalanced_ledger_state_is_unchanged() -> None:
    plan = EpochPlan(100, 10)
    ledger = DataLedger(plan)
    ledger.begin_step(["a", "b"])
    ledger.commit()
    assert "balance" not in ledger.state_dict() and ledger.weights_record() is None
    assert ledger_digest(ledger.state_dict()) == "76efe539f8329d7594a1d4e407b3cbbb"  # the state format, pinned


def test_corrupt_balance_state_is_refused() -> None:
    ledger = DataLedger(EpochPlan(100, 10), balance_every=2)
    state = ledger.state_dict()
    with pytest.raises(ValueError, match="state\\['balance'\\] must be a mapping"):
        DataLedger.from_state_dict({**state, "balance": {"every": 2}})
    with pytest.raises(ValueError, match=r"state\['balance'\]\['step'\] must be in \[0, 0\], got 3"):
        DataLedger.from_state_dict({**state, "balance": {"every": 2, "step": 3, "weights": {}}})
    with pytest.raises(ValueError, match=r"state\['balance'\]\['weights'\]\['a'\] must be in \[1, inf\], got -2"):
        DataLedger.from_state_dict({**state, "balance": {"every": 2, "step": 0, "weights": {"a": -2}}})
