"""The collective timeout's rule: doubled while the same members keep breaking their quorum, bounded, relaxed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.runtime.patience import MAX_GROWTH, QUIET_STEPS, CollectivePatience, QuorumView, next_growth

MEMBERS = ("a", "b", "c")

Event = QuorumView | int
"""A quorum adopted, or that many steps committed in it."""


@st.composite
def histories(draw: st.DrawFn) -> list[Event]:
    """What one long-lived member sees, in order: quorums (same members, new members, a gap) and commits."""
    events: list[Event] = [QuorumView(1, MEMBERS)]
    last = events[0]
    for _ in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(["same", "members", "gap", "commits"]))
        if kind == "commits":
            events.append(draw(st.sampled_from([1, 7, QUIET_STEPS - 1, QUIET_STEPS, 3 * QUIET_STEPS])))
            continue
        assert isinstance(last, QuorumView)
        members = last.members
        if kind == "members":
            members = tuple(draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=5, unique=True)))
        last = QuorumView(last.quorum_id + (draw(st.integers(2, 4)) if kind == "gap" else 1), members)
        events.append(last)
    return events


def see(patience: CollectivePatience, event: Event) -> None:
    if isinstance(event, QuorumView):
        patience.adopt(event)
    else:
        for _ in range(event):
            patience.committed()


def test_the_same_members_breaking_again_double_it_up_to_the_bound() -> None:
    patience = CollectivePatience(1.0)
    timeouts = [patience.adopt(QuorumView(quorum, MEMBERS)) for quorum in range(1, 8)]
    assert timeouts == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]


def test_new_members_reset_it_and_a_gap_keeps_it() -> None:
    patience = CollectivePatience(2.0)
    assert [patience.adopt(QuorumView(1, MEMBERS)), patience.adopt(QuorumView(2, MEMBERS))] == [2.0, 4.0]
    assert patience.adopt(QuorumView(3, MEMBERS[:2])) == 2.0, "a member left: the failure is explained"
    assert next_growth(QuorumView(3, MEMBERS), QuorumView(5, MEMBERS), 4) == 4, "a quorum this member missed"


def test_quiet_steps_halve_it_back_to_the_configured_value() -> None:
    patience = CollectivePatience(1.0)
    for quorum in range(1, 4):
        patience.adopt(QuorumView(quorum, MEMBERS))
    assert patience.timeout == 4.0
    halved = [step for step in range(1, 3 * QUIET_STEPS + 1) if patience.committed()]
    assert halved == [QUIET_STEPS, 2 * QUIET_STEPS]
    assert patience.timeout == 1.0


def test_the_base_is_checked() -> None:
    with pytest.raises(ValueError, match="base must be a positive number of seconds, got 0"):
        CollectivePatience(0)


@given(histories())
def test_the_growth_is_a_bounded_power_of_two(events: list[Event]) -> None:
    patience = CollectivePatience(1.5)
    for event in events:
        see(patience, event)
        assert patience.growth in {1 << k for k in range(MAX_GROWTH.bit_length())}
        assert patience.timeout == 1.5 * patience.growth <= 1.5 * MAX_GROWTH


@given(histories(), st.data())
def test_a_later_joiner_never_waits_longer_and_agrees_within_four_breaks(
    events: list[Event], data: st.DataObject
) -> None:
    """Members that saw the same answers and commits agree; one that joined later starts lower and catches up."""
    quorums = [index for index, event in enumerate(events) if isinstance(event, QuorumView)]
    joined = data.draw(st.sampled_from(quorums))
    veteran, twin, joiner = CollectivePatience(1.0), CollectivePatience(1.0), CollectivePatience(1.0)
    for index, event in enumerate(events):
        see(veteran, event)
        see(twin, event)
        assert veteran.timeout == twin.timeout
        if index >= joined:
            see(joiner, event)
            assert joiner.growth <= veteran.growth
    last = [event for event in events if isinstance(event, QuorumView)][-1]
    for extra in range(1, MAX_GROWTH.bit_length()):  # log2(MAX_GROWTH) breaks of the same members
        again = QuorumView(last.quorum_id + extra, last.members)
        assert veteran.adopt(again) >= joiner.adopt(again)
    assert joiner.growth == veteran.growth == MAX_GROWTH
