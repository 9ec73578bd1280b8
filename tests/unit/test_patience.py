"""The collective timeout's growth rule: doubled while the same members keep breaking their quorum, bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.runtime.patience import MAX_GROWTH, QUIET_STEPS, CollectivePatience, QuorumView, next_growth

MEMBERS = ("a", "b", "c")


@st.composite
def histories(draw: st.DrawFn) -> list[QuorumView]:
    """Answers one long-lived member adopts, in order: membership changes, same-member failures, commits."""
    views = [QuorumView(1, MEMBERS, 0)]
    for _ in range(draw(st.integers(0, 30))):
        last = views[-1]
        kind = draw(st.sampled_from(["same", "committed", "members", "gap"]))
        members = last.members
        if kind == "members":
            members = tuple(draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=5, unique=True)))
        step = last.step + (draw(st.sampled_from([1, 5, QUIET_STEPS])) if kind == "committed" else 0)
        quorum_id = last.quorum_id + (draw(st.integers(2, 4)) if kind == "gap" else 1)
        views.append(QuorumView(quorum_id, members, step))
    return views


def test_the_same_members_failing_again_double_it_up_to_the_bound() -> None:
    patience = CollectivePatience(1.0)
    timeouts = [patience.adopt(QuorumView(quorum, MEMBERS, 7)) for quorum in range(1, 8)]
    assert timeouts == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]


def test_a_break_after_quiet_steps_keeps_it_and_new_members_reset_it() -> None:
    patience = CollectivePatience(2.0)
    assert [patience.adopt(QuorumView(1, MEMBERS, 0)), patience.adopt(QuorumView(2, MEMBERS, 0))] == [2.0, 4.0]
    assert patience.adopt(QuorumView(3, MEMBERS, 1)) == 8.0, "a straggler late at every step: it grows on"
    assert patience.adopt(QuorumView(4, MEMBERS, 1 + QUIET_STEPS)) == 8.0, "a rare break of quiet links: kept"
    assert patience.adopt(QuorumView(5, MEMBERS[:2], 200)) == 2.0, "a member left: the failure is explained"


def test_a_quorum_this_member_was_not_in_between_does_not_grow_it() -> None:
    assert next_growth(QuorumView(3, MEMBERS, 4), QuorumView(5, MEMBERS, 4), 2) == 2


def test_the_base_is_checked() -> None:
    with pytest.raises(ValueError, match="base must be a positive number of seconds, got 0"):
        CollectivePatience(0)


@given(histories())
def test_the_growth_is_a_bounded_power_of_two(views: list[QuorumView]) -> None:
    patience = CollectivePatience(1.5)
    for view in views:
        timeout = patience.adopt(view)
        assert patience.growth in {1 << k for k in range(MAX_GROWTH.bit_length())}
        assert timeout == 1.5 * patience.growth <= 1.5 * MAX_GROWTH


@given(histories(), st.data())
def test_a_later_joiner_never_waits_longer_and_agrees_within_four_failures(
    views: list[QuorumView], data: st.DataObject
) -> None:
    """Members that held the same answers agree; one that joined later starts lower and catches up."""
    joined = data.draw(st.integers(0, len(views) - 1))
    veteran, twin, joiner = CollectivePatience(1.0), CollectivePatience(1.0), CollectivePatience(1.0)
    for index, view in enumerate(views):
        assert veteran.adopt(view) == twin.adopt(view)
        if index >= joined:
            joiner.adopt(view)
            assert joiner.growth <= veteran.growth
    last = views[-1]
    for extra in range(1, MAX_GROWTH.bit_length()):  # log2(MAX_GROWTH) breaks of the same members, no commit
        again = QuorumView(last.quorum_id + extra, last.members, last.step)
        assert veteran.adopt(again) >= joiner.adopt(again)
    assert joiner.growth == veteran.growth == MAX_GROWTH
