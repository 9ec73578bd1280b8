"""The dashboard's and /metrics' figures, pure: samples committed, reassigned samples, heal totals, counters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from stalwart.coord.figures import member_counts, samples_committed
from stalwart.coord.heal_report import HealTotals, heal_growth, parse_heal_totals
from stalwart.coord.metrics import LighthouseMetrics
from stalwart.coord.wire import RequestError
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.testing.fleet import SimulatedFleet


def samples(metrics: LighthouseMetrics, status: dict) -> dict[str, float]:
    """``name{labels}`` -> value of every sample of the exposition."""
    text = metrics.exposition(status).decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(20, 300),
    batch=st.integers(4, 40),
    steps=st.integers(0, 30),
    members=st.integers(1, 4),
    failures=st.lists(st.integers(0, 29), max_size=4),
    drop_last=st.booleans(),
)
def test_samples_committed_counts_every_committed_position(
    size: int, batch: int, steps: int, members: int, failures: list[int], drop_last: bool
) -> None:
    plan = EpochPlan(size, batch, seed=2, drop_last=drop_last) if size >= batch else EpochPlan(size, batch, seed=2)
    ledger = DataLedger(plan)
    names = [f"w{i}" for i in range(members)]
    committed = 0
    for step in range(steps):
        ledger.begin_step(names)
        if step in failures and len(names) > 1:
            ledger.member_failed(names[-1])  # its share is lost and not reassigned: it must be trained again
        committed += int(ledger.commit().size)
        status_ledger = {
            "epoch": ledger.epoch,
            "epoch_length": plan.epoch_length,
            "base_index": ledger.base_index,
            "missing": int(ledger.missing_indices.size),
        }
        assert samples_committed(status_ledger) == committed


def test_member_counts_names_every_state() -> None:
    counts = member_counts([{"state": "alive"}, {"state": "alive"}, {"state": "dead"}])
    assert counts == {"alive": 2, "joining": 0, "dead": 1, "left": 0}


@settings(max_examples=30, deadline=None)
@given(size=st.integers(3, 5), steps=st.integers(0, 3), data=st.data())
def test_reassigned_samples_are_the_dead_members_shares_counted_once(size: int, steps: int, data) -> None:
    cluster = SimulatedFleet(EpochPlan(500, 24, seed=1, local_batch_multiple=2))
    metrics = LighthouseMetrics()
    cluster.state.history.listener = metrics.on_history_event
    cluster.start(size)
    cluster.run_steps(steps)
    lost: list[int] = []
    for _ in range(2):  # two failures in the same step: each failure quorum hands out only what it lost
        members = cluster.members
        before = cluster.current_shares()
        dead = data.draw(st.sampled_from(members))
        cluster.kill(dead)
        for member in members:
            if member != dead:
                cluster.ask(member, "failure")
        formation = cluster.settle()
        assert formation.reason == "failure"
        lost.append(len(before[dead]))
        for _ in range(2):  # a hook called again for the same formation counts nothing more
            metrics.on_formation(formation.reason, cluster.state.hosted)
    values = samples(metrics, cluster.state.to_status(cluster.now))
    assert values["stalwart_samples_reassigned_total"] == sum(lost)
    assert values["stalwart_failures_total{kind=socket_closed}"] == 2
    assert values["stalwart_quorums_total{reason=failure}"] == 2
    assert values["stalwart_recovery_seconds_count"] == 2
    assert values["stalwart_steps_committed"] == steps
    assert values["stalwart_members{state=dead}"] == 2
    assert values["stalwart_quorum_size"] == size - 2
    assert cluster.state.hosted.lost_per_failure() == (steps, lost)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.floats(0, 100)), min_size=1, max_size=8), st.data())
def test_heal_totals_add_up_whatever_reports_repeat_or_arrive_late(heals: list[tuple[int, float]], data) -> None:
    totals = [HealTotals()]
    for nbytes, seconds in heals:
        totals.append(totals[-1].add(nbytes, seconds))
    reports = [*data.draw(st.lists(st.sampled_from(totals[1:]), max_size=12)), totals[-1]]
    last: HealTotals | None = None
    counted = HealTotals()
    for report in reports:
        growth = heal_growth(last, report)
        if growth is not None:
            last = report
            counted = HealTotals(
                counted.heals + growth.heals, counted.bytes + growth.bytes, counted.seconds + growth.seconds
            )
    assert (counted.heals, counted.bytes) == (totals[-1].heals, totals[-1].bytes)
    assert abs(counted.seconds - totals[-1].seconds) <= 1e-6 * max(1.0, totals[-1].seconds)


def test_heal_reports_are_counted_per_incarnation_and_malformed_ones_dropped() -> None:
    metrics = LighthouseMetrics()
    report = {"applied_step": 3, "heal": {"heals": 1, "bytes": 1000, "seconds": 0.5}}
    assert metrics.take_heal_report("w0", "a" * 32, report) is None
    assert report == {"applied_step": 3}, "the heal field is removed before the heartbeat is parsed"
    metrics.take_heal_report("w0", "a" * 32, {"heal": {"heals": 1, "bytes": 1000, "seconds": 0.5}})  # repeated
    metrics.take_heal_report("w0", "b" * 32, {"heal": {"heals": 1, "bytes": 24, "seconds": 0.25}})  # restarted
    bad = {"applied_step": 4, "heal": {"heals": -1, "bytes": 0, "seconds": 0}}
    error = metrics.take_heal_report("w1", None, bad)
    assert error is not None and "heal['heals']" in error and "-1" in error
    assert bad == {"applied_step": 4}
    status = SimulatedFleet(EpochPlan(120, 12, seed=3)).state.to_status(0.0)
    values = samples(metrics, status)
    assert values["stalwart_heals_total"] == 2
    assert values["stalwart_heal_bytes_total"] == 1024
    assert values["stalwart_heal_seconds_count"] == 2
    assert values["stalwart_heal_seconds_sum"] == 0.75


def test_malformed_heal_totals_name_the_field_and_value() -> None:
    for value, needle in [
        ([], "heal must be"),
        ({"heals": 1, "bytes": 2}, "heal must be"),
        ({"heals": True, "bytes": 2, "seconds": 0.0}, "heal['heals']"),
        ({"heals": 1, "bytes": 2.5, "seconds": 0.0}, "heal['bytes']"),
        ({"heals": 1, "bytes": 2, "seconds": float("nan")}, "heal['seconds']"),
        ({"heals": 1, "bytes": 2, "seconds": -1}, "heal['seconds']"),
        ({"heals": 1, "bytes": 10**400, "seconds": 0.0}, "heal['bytes']"),  # a float overflow once it was counted
        ({"heals": 2**62 + 1, "bytes": 2, "seconds": 0.0}, "heal['heals']"),
        ({"heals": 1, "bytes": 2, "seconds": float("inf")}, "heal['seconds']"),
        ({"heals": 1, "bytes": 2, "seconds": 10**400}, "heal['seconds']"),
    ]:
        try:
            parse_heal_totals(value)
        except RequestError as error:
            assert error.status == 400 and needle in error.message
            assert error.details["field"] == needle.removesuffix(" must be")
        else:
            raise AssertionError(f"{value!r} was accepted")
