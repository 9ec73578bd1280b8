"""The goodput benchmark's failure trace and sample audit (``benchmarks._goodput_audit``), property-tested."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks._goodput_audit import audit_samples, failure_trace

STEPS_PER_EPOCH = 4


@given(
    rate=st.floats(min_value=0.01, max_value=2.0),
    workers=st.integers(min_value=1, max_value=8),
    horizon=st.integers(min_value=0, max_value=400),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_trace_is_seeded_increasing_and_in_range(rate: float, workers: int, horizon: int, seed: int) -> None:
    trace = failure_trace(rate, workers, horizon, seed)
    assert trace == failure_trace(rate, workers, horizon, seed)
    steps = [failure.at for failure in trace]
    assert steps == sorted(set(steps))
    assert all(1 <= step < horizon for step in steps)
    assert all(0 <= failure.victim < workers for failure in trace)
    assert failure_trace(rate, workers, horizon + 50, seed)[: len(trace)] == trace  # a longer horizon only adds


def test_trace_has_the_rate_it_was_asked_for() -> None:
    for seed in range(3):
        count = len(failure_trace(1 / 30, 3, 60_000, seed))
        assert 1700 <= count <= 2300, count  # 2000 expected; the bounds are several standard deviations wide


@pytest.mark.parametrize(
    ("rate", "workers", "horizon", "named"),
    [(0.0, 3, 10, "rate"), (-1.0, 3, 10, "rate"), (0.1, 0, 10, "workers"), (0.1, 3, -1, "horizon")],
)
def test_trace_rejects_bad_arguments(rate: float, workers: int, horizon: int, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        failure_trace(rate, workers, horizon, seed=0)


def _line(step: int, member: int, share: int, time: float, *, committed: bool = True) -> dict[str, object]:
    """One member's SampleLog line for its share of ``step`` (shares of ``share`` positions, member by member)."""
    start = (step % STEPS_PER_EPOCH) * 100 + member * share  # steps of an epoch apart for any world and share here
    return {
        "incarnation": "run/",
        "step": step,
        "epoch": step // STEPS_PER_EPOCH,
        "positions": list(range(start, start + share)),
        "committed": committed,
        "time": time,
    }


@settings(deadline=None)
@given(
    world=st.integers(min_value=1, max_value=4),
    share=st.integers(min_value=1, max_value=5),
    copies=st.lists(st.lists(st.integers(min_value=0, max_value=3), min_size=4, max_size=4), min_size=1, max_size=12),
    failed=st.integers(min_value=0, max_value=5),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_audit_counts_what_members_trained(
    world: int, share: int, copies: list[list[int]], failed: int, seed: int
) -> None:
    """Each member-step committed ``copies`` times: 0 is lost, 2 and 3 are trained twice (once and twice more)."""
    rng = random.Random(seed)
    lines = []
    for step, per_member in enumerate(copies):
        for member in range(world):
            lines += [_line(step, member, share, rng.random()) for _ in range(per_member[member])]
    lines += [_line(rng.randrange(len(copies)), 0, share, rng.random(), committed=False) for _ in range(failed)]
    rng.shuffle(lines)
    committed_steps = [step for step, per in enumerate(copies) if any(per[:world])]
    last = max(committed_steps, default=-1)
    expected_lost = sum(share for step in range(last + 1) for member in range(world) if copies[step][member] == 0)
    expected_twice = sum(
        share * max(0, copies[step][member] - 1) for step in range(len(copies)) for member in range(world)
    )
    planned = len(copies) * world * share
    audit = audit_samples(lines, world * share, planned + 1, quorum_records=False)  # a target never reached
    assert audit.lost == expected_lost
    assert audit.twice == expected_twice
    assert audit.useful == (last + 1) * world * share - expected_lost
    assert audit.trained == audit.useful + expected_twice
    assert audit.progress == len({line["step"] for line in lines})
    assert audit.finished_at is None
    assert audit.first_at == min((line["time"] for line in lines if line["committed"]), default=None)


@settings(deadline=None)
@given(steps=st.integers(min_value=1, max_value=10), world=st.integers(min_value=1, max_value=4), cut=st.data())
def test_audit_stops_at_the_target(steps: int, world: int, cut: st.DataObject) -> None:
    """The line that completes the target sets ``finished_at``; after it only that step's other lines count."""
    share = 3
    lines = [
        _line(step, member, share, float(step * world + member)) for step in range(steps) for member in range(world)
    ]
    lines += [_line(steps, 0, share, 10_000.0)]  # a later step, after the target: not counted
    target = cut.draw(st.integers(min_value=1, max_value=steps * world * share))
    audit = audit_samples(lines, world * share, target, quorum_records=False)
    completing = next(line for number, line in enumerate(lines, start=1) if number * share >= target)
    assert audit.finished_at == completing["time"]
    assert audit.twice == 0 and audit.lost == 0
    assert audit.useful == (completing["step"] + 1) * world * share  # the whole step that reached the target


def test_quorum_records_count_a_step_once_unless_members_disagree() -> None:
    """stalwart's members each write the whole quorum's positions: identical lines are one step, others are not."""
    whole = [_line(step, 0, 6, float(step)) for step in range(3)]
    every_member = [{**line, "time": line["time"] + 0.5 * member} for line in whole for member in range(3)]
    audit = audit_samples(every_member, 6, 18, quorum_records=True)
    assert (audit.useful, audit.lost, audit.twice, audit.finished_at) == (18, 0, 0, 2.0)
    disagreeing = [*every_member, {**whole[1], "positions": whole[1]["positions"][:3], "time": 0.7}]
    assert audit_samples(disagreeing, 6, 19, quorum_records=True).twice == 3
