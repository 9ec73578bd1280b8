"""The lighthouse's heartbeat reader: whatever JSON a member sends, it refuses by name and never raises."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from stalwart.coord.heartbeat import read_heartbeat
from stalwart.coord.metrics import LighthouseMetrics
from stalwart.coord.rounds import RoundsBoard
from stalwart.coord.wire import MAX_WIRE_INT

numbers = (
    st.integers()
    | st.integers(min_value=10**300, max_value=10**420)
    | st.integers(min_value=-(10**420), max_value=-(10**300))
    | st.floats()  # NaN and infinities too: Python's json reads and writes them
    | st.sampled_from([0, 1, MAX_WIRE_INT, MAX_WIRE_INT + 1, -1, 2**63, 1e308, -0.0])
)
scalars = st.none() | st.booleans() | numbers | st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=16,
)
HEAL_FIELDS = ("heals", "bytes", "seconds")
ROUNDS_FIELDS = ("inner_steps", "fragments", "inner_step", "in_flight", "bytes", "exchanges")


def shaped(names: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """An object with (mostly) the right field names and any values: the parsers' number checks are reached."""
    return st.fixed_dictionaries({name: json_values | numbers for name in names}) | json_values


heartbeats = (
    st.fixed_dictionaries(
        {},
        optional={
            "applied_step": json_values | numbers,
            "digest": json_values | st.sampled_from(["ab" * 16, "AB" * 16]),
            "weights": st.fixed_dictionaries({"step": json_values | numbers, "weights": json_values}) | json_values,
            "heal": shaped(HEAL_FIELDS),
            "rounds": shaped(ROUNDS_FIELDS),
        },
    )
    | json_values
)


def in_range(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_WIRE_INT


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=heartbeats)
def test_any_json_heartbeat_is_read_or_refused_by_name_and_nothing_is_raised(message: Any) -> None:
    registry = CollectorRegistry()
    metrics, rounds = LighthouseMetrics(), RoundsBoard(registry)
    text = json.dumps(message)
    for incarnation in ("a" * 32, "a" * 32, None):  # a repeat and a new incarnation: the growth paths too
        reading = read_heartbeat(text, "w0", incarnation, metrics, rounds)
        assert all(isinstance(error, str) and error for error in reading.errors)
        if reading.applied_step is None:
            assert reading.errors, "a refused heartbeat says why"
        else:
            assert in_range(reading.applied_step)
            assert reading.weights is None or all(in_range(w) for w in reading.weights["weights"].values())
    metrics.exposition(_status())  # every figure the heartbeats fed is a number Prometheus can write


def _status() -> dict[str, Any]:
    from stalwart.coord.quorum import LighthouseState
    from stalwart.data.plan import EpochPlan

    return LighthouseState(EpochPlan(64, 8), 1, 1.0, 1.0).to_status(0.0)


def test_a_heal_of_10_to_the_400_bytes_is_refused_naming_the_field_and_the_value() -> None:
    metrics, rounds = LighthouseMetrics(), RoundsBoard(CollectorRegistry())
    text = '{"applied_step": 3, "heal": {"heals": 1, "bytes": 1' + "0" * 400 + ', "seconds": 1.0}}'
    reading = read_heartbeat(text, "w0", "a" * 32, metrics, rounds)
    assert reading.applied_step == 3, "the heartbeat itself counts; the malformed figure is dropped"
    (error,) = reading.errors
    assert "heal['bytes']" in error and "1000000" in error and "2**62" in error


def test_numbers_out_of_range_refuse_the_heartbeat_naming_the_field() -> None:
    metrics, rounds = LighthouseMetrics(), RoundsBoard(CollectorRegistry())
    for message, field in (
        ({"applied_step": 10**400}, "applied_step"),
        ({"applied_step": 2**62 + 1}, "applied_step"),
        ({"applied_step": float("inf")}, "applied_step"),
        ({"applied_step": 1, "weights": {"step": 1, "weights": {"a": 10**30}}}, "weights['weights']['a']"),
    ):
        reading = read_heartbeat(json.dumps(message), "w0", None, metrics, rounds)
        assert reading.applied_step is None and field in reading.errors[-1], (message, reading)
