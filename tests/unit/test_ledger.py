"""The ledger's invariants over random joins, failures, reassigns and re-queues."""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.ledger import DataLedger, greedy_sizes
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import step_total


@dataclass
class Run:
    """What a driven ledger did: shares per step, committed positions per epoch."""

    shares: list[dict[str, list[int]]] = field(default_factory=list)
    committed: dict[int, list[np.ndarray]] = field(default_factory=dict)
    step_counts: list[tuple[int, int, bool]] = field(default_factory=list)
    took_the_rest: list[bool] = field(default_factory=list)


@st.composite
def plans(draw: st.DrawFn) -> EpochPlan:
    batch = draw(st.integers(1, 64))
    multiple = draw(st.integers(1, min(batch, 8)))
    drop_last = draw(st.booleans())
    size = draw(st.integers(batch if drop_last else 1, 600))
    if drop_last and size < batch + multiple:
        size = batch + multiple
    return EpochPlan(size, batch, seed=draw(st.integers(0, 5)), drop_last=drop_last, local_batch_multiple=multiple)


def drive(ledger: DataLedger, decisions: st.DataObject | list[int], run: Run, max_steps: int) -> list[int]:
    """Run steps until the epoch ends, drawing events; returns the decisions taken, for replay."""
    taken: list[int] = []
    replay = decisions if isinstance(decisions, list) else None

    def choose(low: int, high: int) -> int:
        value = replay.pop(0) if replay is not None else decisions.draw(st.integers(low, high))  # type: ignore[union-attr]
        taken.append(value)
        return value

    next_member = 100
    members = [f"m{i}" for i in range(choose(1, 6))]
    epoch = ledger.epoch
    for _ in range(max_steps):
        if ledger.epoch_complete:
            break
        if choose(0, 3) == 0:
            members.append(f"m{next_member}")
            next_member += 1
        shares = ledger.begin_step(members)
        run.shares.append({member: share.tolist() for member, share in shares.items()})
        run.took_the_rest.append(ledger.base_index == ledger.plan.epoch_length and ledger.missing_indices.size == 0)
        total = sum(share.size for share in shares.values())
        alive = list(members)
        for _ in range(choose(0, min(3, len(alive)))):
            victim = alive.pop(choose(0, len(alive) - 1))
            assert ledger.member_failed(victim)
            assert not ledger.member_failed(victim)
            if alive and choose(0, 1):
                ledger.reassign(alive[: choose(1, len(alive))])
        reassign_all = bool(alive) and choose(0, 1) == 1
        if reassign_all:
            ledger.reassign(alive)
        committed = ledger.commit()
        run.committed.setdefault(epoch, []).append(committed)
        run.step_counts.append((total, committed.size, reassign_all or len(alive) == len(members)))
        members = alive or [f"m{next_member}"]
        next_member += 1
    return taken


@settings(max_examples=150, deadline=None)
@given(plans(), st.data())
def test_driven_epochs_keep_exactly_once_the_global_batch_and_balanced_multiples(
    plan: EpochPlan, data: st.DataObject
) -> None:
    """The ledger's three invariants, each checked on every random run (one drive serves all three: a run of a
    small batch is hundreds of steps, the costly part; the invariants only read its record)."""
    ledger = DataLedger(plan)
    run = Run()
    drive(ledger, data, run, max_steps=10 * plan.steps_per_epoch + 10)
    assert_each_position_committed_once(ledger, run)
    assert_reassigned_steps_keep_the_global_batch(plan, run)
    assert_shares_are_multiples_and_balanced(plan, run)


def assert_each_position_committed_once(ledger: DataLedger, run: Run) -> None:
    plan = ledger.plan
    assert ledger.epoch_complete
    committed = np.concatenate(run.committed[0])
    assert np.array_equal(np.sort(committed), np.arange(plan.epoch_length))
    samples = plan.indices_at(0, committed)
    assert len(set(samples.tolist())) == plan.epoch_length


def assert_reassigned_steps_keep_the_global_batch(plan: EpochPlan, run: Run) -> None:
    requeued = False
    for step, (total, committed, reassigned) in enumerate(run.step_counts):
        if reassigned:
            assert committed == total
        if not requeued:
            assert total == plan.step_total(step)
        elif step < plan.steps_per_epoch - 1:
            assert total == step_total(step, plan.global_batch_size, plan.local_batch_multiple)
        requeued = requeued or committed < total


def assert_shares_are_multiples_and_balanced(plan: EpochPlan, run: Run) -> None:
    multiple = plan.local_batch_multiple
    for step, shares in enumerate(run.shares):
        sizes = [len(share) for share in shares.values()]
        assert max(sizes) - min(sizes) <= multiple
        off_multiple = [size for size in sizes if size % multiple]
        assert not off_multiple or (run.took_the_rest[step] and not plan.drop_last and len(off_multiple) == 1)


@settings(max_examples=100, deadline=None)
@given(plans(), st.data())
def test_replay_gives_the_same_shares(plan: EpochPlan, data: st.DataObject) -> None:
    first = Run()
    decisions = drive(DataLedger(plan), data, first, max_steps=4 * plan.steps_per_epoch + 10)
    second = Run()
    drive(DataLedger(plan), list(decisions), second, max_steps=4 * plan.steps_per_epoch + 10)
    assert first.shares == second.shares


@settings(max_examples=100, deadline=None)
@given(plans(), st.integers(0, 30), st.integers(1, 5), st.booleans())
def test_state_round_trip_mid_step_continues_identically(
    plan: EpochPlan, steps_before: int, world: int, fail_first: bool
) -> None:
    ledger = DataLedger(plan)
    members = [f"w{i}" for i in range(world)]
    for _ in range(steps_before):
        ledger.begin_step(members)
        ledger.commit()
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
        next_members = survivors or ["fresh"]
        original = ledger.begin_step(next_members)
        again = restored.begin_step(next_members)
        assert {m: s.tolist() for m, s in original.items()} == {m: s.tolist() for m, s in again.items()}
        assert np.array_equal(ledger.commit(), restored.commit())


def test_missing_indices_are_handed_out_first() -> None:
    ledger = DataLedger(EpochPlan(100, 8, local_batch_multiple=2))
    shares = ledger.begin_step(["a", "b"])
    lost = shares["b"].tolist()
    ledger.member_failed("b")
    assert ledger.commit().tolist() == shares["a"].tolist()
    assert ledger.missing_indices.tolist() == lost
    following = ledger.begin_step(["a", "c"])
    assert following["a"].tolist() == lost
    assert following["c"].tolist() == [8, 9, 10, 11]
    assert ledger.base_index == 12


def test_a_member_that_got_extra_work_can_fail_too() -> None:
    ledger = DataLedger(EpochPlan(90, 9))
    shares = ledger.begin_step(["a", "b", "c"])
    ledger.member_failed("a")
    extra = ledger.reassign(["b", "c"])
    assert sorted(np.concatenate(list(extra.values())).tolist()) == sorted(shares["a"].tolist())
    ledger.member_failed("b")
    ledger.reassign(["c"])
    assert sorted(ledger.commit().tolist()) == list(range(9))


def test_reassign_balances_loads_in_multiples() -> None:
    ledger = DataLedger(EpochPlan(1000, 48, local_batch_multiple=4))
    ledger.begin_step(["a", "b", "c", "d"])
    ledger.member_failed("d")
    extra = ledger.reassign(["a", "b", "c"])
    assert [len(extra[m]) for m in "abc"] == [4, 4, 4]
    assert all(len(v) == 16 for v in ledger.in_flight.values())


def test_bad_calls_name_what_is_wrong() -> None:
    ledger = DataLedger(EpochPlan(100, 10))
    with pytest.raises(RuntimeError, match="commit\\(\\) needs a step in progress"):
        ledger.commit()
    with pytest.raises(ValueError, match="members must name at least one member"):
        ledger.begin_step([])
    with pytest.raises(ValueError, match="members must not repeat a member"):
        ledger.begin_step(["a", "a"])
    with pytest.raises(TypeError, match="members must be a sequence"):
        ledger.begin_step("ab")
    ledger.begin_step(["a", "b"])
    with pytest.raises(RuntimeError, match="already in progress"):
        ledger.begin_step(["a"])
    with pytest.raises(ValueError, match="member must be one of this step's members"):
        ledger.member_failed("zed")
    ledger.member_failed("b")
    with pytest.raises(ValueError, match="survivors must be live members"):
        ledger.reassign(["b"])
    before = ledger.state_dict()
    with pytest.raises(ValueError):
        ledger.reassign(["a", "zed"])
    assert ledger.state_dict() == before
    ledger.commit()
    with pytest.raises(RuntimeError, match="commit\\(\\) needs a step in progress"):
        ledger.commit()
    with pytest.raises(TypeError, match="plan must be an EpochPlan"):
        DataLedger(100)  # type: ignore[arg-type]


def test_corrupt_state_is_refused() -> None:
    state = DataLedger(EpochPlan(100, 10)).state_dict()
    with pytest.raises(ValueError, match="version"):
        DataLedger.from_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match=r"state\['missing_indices'\] must hold positions in \[0, 99\]"):
        DataLedger.from_state_dict({**state, "missing_indices": [100]})
    with pytest.raises(ValueError, match=r"state\['base_index'\] must be in \[0, 100\]"):
        DataLedger.from_state_dict({**state, "base_index": -1})


def test_epochs_roll_over() -> None:
    ledger = DataLedger(EpochPlan(20, 10))
    for _ in range(2):
        ledger.begin_step(["a"])
        ledger.commit()
    assert ledger.epoch_complete and ledger.epoch == 0
    ledger.begin_step(["a"])
    assert ledger.epoch == 1 and ledger.base_index == 10 and ledger.epoch_step == 0


def handed_out_one_by_one(loads: list[int], total: int, multiple: int) -> list[int]:
    """The reference: chunks of ``multiple`` (the last one smaller) to the least loaded, ties to the lowest index."""
    heap = [(load, index) for index, load in enumerate(loads)]
    heapq.heapify(heap)
    sizes = [0] * len(loads)
    while total:
        load, index = heapq.heappop(heap)
        take = min(multiple, total)
        sizes[index] += take
        total -= take
        heapq.heappush(heap, (load + take, index))
    return sizes


@settings(max_examples=400, deadline=None)
@given(
    loads=st.lists(st.integers(0, 60), min_size=1, max_size=12),
    total=st.integers(0, 200),
    multiple=st.integers(1, 9),
)
def test_greedy_sizes_hand_out_what_one_chunk_at_a_time_would(loads: list[int], total: int, multiple: int) -> None:
    sizes = greedy_sizes(np.array(loads, dtype=np.int64), total, multiple)
    assert sizes.tolist() == handed_out_one_by_one(loads, total, multiple)


def test_a_quarter_of_4096_members_failing_is_reassigned_as_chunk_by_chunk() -> None:
    plan = EpochPlan(1 << 40, 32 * 4096, seed=0, shuffle=False)
    members = [f"m{n}" for n in range(4096)]
    ledger = DataLedger(plan)
    before = ledger.begin_step(members)
    for member in members[::4]:
        ledger.member_failed(member)
    survivors = ledger.members
    extra = ledger.reassign(survivors)
    loads = [before[m].size for m in survivors]
    assert [extra[m].size for m in survivors] == handed_out_one_by_one(loads, 32 * 1024, 1)


def weighted_one_by_one(loads: list[int], weights: list[int], total: int, multiple: int) -> list[int]:
    """The weighted reference: each chunk to the holder whose load per weight would then be least, ties by index."""
    sizes = [0] * len(loads)
    held = list(loads)
    while total:
        index = min(range(len(held)), key=lambda i: (Fraction(held[i] + multiple, weights[i]), i))
        take = min(multiple, total)
        sizes[index] += take
        held[index] += take
        total -= take
    return sizes


@settings(max_examples=200, deadline=None)
@given(
    members=st.integers(2, 9),
    multiple=st.integers(1, 5),
    batch_chunks=st.integers(1, 40),
    weights=st.lists(st.integers(1, 6), min_size=9, max_size=9),
    equal=st.booleans(),
    failed=st.sets(st.integers(0, 8), min_size=1, max_size=8),
)
def test_balanced_reassign_hands_out_chunk_by_chunk_by_weight(
    members: int, multiple: int, batch_chunks: int, weights: list[int], equal: bool, failed: set[int]
) -> None:
    """Equal weights take the binary search (greedy_sizes), unequal ones the heap: both are the weighted greedy."""
    names = [f"m{n}" for n in range(members)]
    plan = EpochPlan(10_000, batch_chunks * multiple + 1, seed=0, local_batch_multiple=multiple)
    ledger = DataLedger(plan, balance_every=1)
    ledger.begin_step(names)
    ledger.commit()
    ledger.reweigh({name: weights[0] if equal else weights[n] for n, name in enumerate(names)})
    before = ledger.begin_step(names)
    for n in sorted(failed):
        if n < members - 1:
            ledger.member_failed(names[n])
    survivors = ledger.members
    lost = sum(before[name].size for name in names if name not in survivors)
    extra = ledger.reassign(survivors)
    expected = weighted_one_by_one(
        [before[m].size for m in survivors], ledger.effective_weights(survivors), lost, multiple
    )
    assert [extra[m].size for m in survivors] == expected
    positions = np.concatenate([ledger.in_flight[m] for m in survivors])
    assert np.unique(positions).size == positions.size == plan.step_total(1)


@settings(max_examples=60, deadline=None)
@given(plan=plans(), data=st.data())
def test_the_binary_digest_tells_states_apart_exactly_as_their_canonical_json_does(
    plan: EpochPlan, data: st.DataObject
) -> None:
    ledger = DataLedger(plan)
    seen: dict[str, str] = {}
    """Each state's canonical JSON, by its binary digest."""

    def record() -> None:
        state = ledger.state_dict()
        text = json.dumps(state, sort_keys=True)
        digest = ledger.binary_digest()
        assert seen.setdefault(digest, text) == text, "two states, one digest"
        assert DataLedger.from_state_dict(state).binary_digest() == digest, "the state's own digest, rebuilt"
        shuffled = {**state, "in_flight": dict(reversed(list(state["in_flight"].items())))}
        assert DataLedger.from_state_dict(shuffled).binary_digest() == digest, "the order of the members' shares"

    members = [f"m{i}" for i in range(data.draw(st.integers(1, 5), label="members"))]
    record()
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        if ledger.epoch_complete:
            break
        ledger.begin_step(members)
        record()
        alive = list(members)
        for _ in range(data.draw(st.integers(0, len(alive) - 1), label="failures")):
            ledger.member_failed(alive.pop(data.draw(st.integers(0, len(alive) - 1))))
            record()
            ledger.reassign(alive)
            record()
        ledger.commit()
        record()
        members = alive
    texts = list(seen.values())
    assert len(set(texts)) == len(texts), "one state, two digests"


@settings(max_examples=60, deadline=None)
@given(
    members=st.integers(2, 12),
    failures=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=4), min_size=1, max_size=4),
    copy_after=st.integers(0, 3),
)
def test_failures_in_one_step_lose_their_shares_in_order_and_a_copy_keeps_its_own(
    members: int, failures: list[list[int]], copy_after: int
) -> None:
    """Members failing one after another (a quarter of a fleet at once) lose their shares in the order they fail,
    ``step_missing`` joins them, its size counts them without joining, and a copy taken between failures goes on
    apart from the original (each failure's share is joined lazily, once)."""
    ledger = DataLedger(EpochPlan(10_000, 96, seed=3, local_batch_multiple=2))
    names = [f"m{number}" for number in range(members)]
    shares = ledger.begin_step(names)
    expected: list[int] = []
    twin, twin_expected = None, None
    for event, failed in enumerate(failures):
        if event == copy_after:
            twin, twin_expected = ledger.copy(), list(expected)
        for number in failed:
            name = names[number % members]
            if name in ledger.members and len(ledger.members) > 1 and ledger.member_failed(name):
                expected += shares[name].tolist()
        assert ledger.step_missing_size == len(expected)
    assert ledger.step_missing.tolist() == expected
    if twin is not None:
        assert twin is not None and twin_expected is not None
        assert twin.step_missing.tolist() == twin_expected
    survivors = ledger.members
    extra = ledger.reassign(survivors)
    assert sorted(np.concatenate([extra[m] for m in survivors]).tolist()) == sorted(expected)
    assert ledger.step_missing_size == 0
