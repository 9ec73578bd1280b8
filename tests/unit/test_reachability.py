"""Reachability: reported cuts, their expiry, and the choice of the largest set of members that reach one another."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.coord.reachability import Reachability, choose, pair

TTL, MAX_TTL = 5.0, 40.0


def cut_graph(cuts: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in cuts:
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set()).add(a)
    return graph


def kept_by(members: list[str], cuts: Iterable[tuple[str, str]], holders: set[str], exact_limit: int = 16) -> list[str]:
    """The members ``choose`` keeps, priority by position in ``members``."""
    rank = {m: i for i, m in enumerate(members)}
    choice = choose(cut_graph(cuts), rank.__contains__, holders.__contains__, rank.__getitem__, exact_limit=exact_limit)
    return [m for m in members if m not in choice.left_out]


@st.composite
def graphs(draw: st.DrawFn) -> tuple[list[str], list[tuple[str, str]], set[str]]:
    """Up to 9 candidates, random cuts (some naming members that are not candidates), random holders."""
    size = draw(st.integers(1, 9))
    members = [f"w{i}" for i in draw(st.permutations(range(size)))]
    everyone = [*members, "gone0", "gone1"]
    pairs = [p for p in itertools.combinations(everyone, 2)]
    cuts = draw(st.lists(st.sampled_from(pairs), max_size=20, unique=True))
    holders = set(draw(st.lists(st.sampled_from(members), unique=True)))
    return members, cuts, holders


def is_clique(kept: list[str], cuts: list[tuple[str, str]]) -> bool:
    cut = {pair(a, b) for a, b in cuts}
    return not any(pair(a, b) in cut for a, b in itertools.combinations(kept, 2))


@settings(max_examples=300, deadline=None)
@given(graph=graphs(), exact=st.booleans())
def test_the_choice_is_a_maximal_clique_that_keeps_the_state(graph, exact: bool) -> None:
    members, cuts, holders = graph
    kept = kept_by(members, cuts, holders, 16 if exact else 0)
    assert is_clique(kept, cuts), "every pair of the chosen members must reach each other"
    for member in set(members) - set(kept):
        assert not is_clique([*kept, member], cuts), f"{member} could have been added: the choice is not maximal"
    if holders:
        assert holders & set(kept), "a live candidate holds the state: the choice must keep one"


@settings(max_examples=300, deadline=None)
@given(graph=graphs())
def test_the_exact_choice_has_the_most_holders_then_the_most_members(graph) -> None:
    members, cuts, holders = graph
    kept = kept_by(members, cuts, holders)
    best = max(
        (len(holders & set(subset)), len(subset))
        for size in range(len(members) + 1)
        for subset in itertools.combinations(members, size)
        if is_clique(list(subset), cuts)
    )
    assert (len(holders & set(kept)), len(kept)) == best


@settings(max_examples=200, deadline=None)
@given(
    majority=st.integers(2, 7),
    minority=st.integers(1, 6),
    joiners=st.integers(0, 4),
    exact=st.booleans(),
    data=st.data(),
)
def test_a_majority_that_reaches_itself_is_never_left_out_for_a_cut_off_minority(
    majority: int, minority: int, joiners: int, exact: bool, data
) -> None:
    minority = min(minority, majority - 1)
    quorum = [f"q{i}" for i in data.draw(st.permutations(range(majority + minority)))]
    kept_side, cut_side = quorum[:majority], quorum[majority:]
    newcomers = [f"j{i}" for i in range(joiners)]
    cuts = [(a, b) for a in cut_side for b in kept_side]
    inside = list(itertools.combinations(cut_side, 2)) + [(j, m) for j in newcomers for m in quorum]
    cuts += data.draw(st.lists(st.sampled_from(inside), unique=True)) if inside else []
    candidates = sorted(quorum) + newcomers  # priority: the rank in the quorum, whoever is cut off
    kept = kept_by(candidates, data.draw(st.permutations(cuts)), set(quorum), 16 if exact else 0)
    assert set(kept_side) <= set(kept), "the members that reach one another, a majority, must all be kept"


@settings(max_examples=200, deadline=None)
@given(graph=graphs(), data=st.data())
def test_the_choice_is_the_same_whatever_the_order_of_the_reports(graph, data) -> None:
    members, cuts, holders = graph
    reports: dict[str, set[str]] = {}
    for a, b in cuts:  # each cut reported by one end or both
        for end, peer in data.draw(st.sampled_from([[(a, b)], [(b, a)], [(a, b), (b, a)]])):
            reports.setdefault(end, set()).add(peer)
    choices = []
    for order in (sorted(reports), data.draw(st.permutations(sorted(reports)))):
        reach = Reachability(TTL, MAX_TTL)
        for when, reporter in enumerate(order):
            reach.report(reporter, 1, reports[reporter], float(when))
        rank = {m: i for i, m in enumerate(members)}
        choices.append(choose(reach.peers, rank.__contains__, holders.__contains__, rank.__getitem__))
        assert sorted(reach.cuts) == sorted({pair(a, b) for a, b in cuts})
    assert choices[0] == choices[1]


def test_members_no_cut_touches_cost_nothing_and_are_always_kept() -> None:
    members = [f"w{i}" for i in range(4096)]
    rank = {m: i for i, m in enumerate(members)}
    choice = choose(
        cut_graph([("w7", "w1"), ("w7", "w2"), ("w9", "gone")]), rank.__contains__, lambda m: True, rank.get
    )
    assert choice.left_out == {"w7"} and choice.touched == 3 and choice.exact


def test_ties_go_to_the_best_ranked_member_and_holders_come_first() -> None:
    assert kept_by(["a", "b"], [("a", "b")], set()) == ["a"]
    assert kept_by(["a", "b"], [("a", "b")], {"b"}) == ["b"], "the state holder wins over a better rank"
    assert kept_by(["a", "b", "c"], [("a", "b"), ("a", "c")], set()) == ["b", "c"], "two beat one"
    assert kept_by(["a", "b", "c"], [("a", "b"), ("a", "c")], {"a"}) == ["a"], "one holder beats two newcomers"


def test_a_big_component_is_chosen_greedily_and_keeps_the_larger_side() -> None:
    left, right = [f"l{i:02}" for i in range(9)], [f"r{i:02}" for i in range(10)]
    members = [*left, *right]  # the smaller side ranks first
    rank = {m: i for i, m in enumerate(members)}
    graph = cut_graph((a, b) for a in left for b in right)
    choice = choose(graph, rank.__contains__, rank.__contains__, rank.__getitem__)
    assert not choice.exact and choice.left_out == set(left)


def test_a_report_cuts_until_its_time_to_live_and_the_same_report_again_renews_nothing() -> None:
    reach = Reachability(TTL, MAX_TTL)
    reach.report("w2", 1, ["w0", "w1"], 0.0)
    assert reach.cut("w0", "w2") and reach.cut("w2", "w1") and not reach.cut("w0", "w1")
    reach.report("w2", 1, ["w1", "w0"], TTL - 1)  # a retried long poll
    reach.expire(TTL - 0.5)
    assert len(reach) == 2
    reach.expire(TTL)
    assert len(reach) == 0 and reach.peers == {}
    reach.report("w2", 1, ["w0", "w1"], TTL + 1)
    assert len(reach) == 0, "an observation already made does not cut again once it expired"


def test_a_pair_cut_again_waits_twice_as_long_up_to_the_cap_and_is_forgiven_later() -> None:
    reach = Reachability(TTL, MAX_TTL)
    now, waited = 0.0, []
    for quorum_id in range(1, 7):  # each time readmitted into a new quorum, and cut again
        reach.report("w2", quorum_id, ["w0"], now)
        start = now
        while reach.cut("w0", "w2"):
            now += 0.5
            reach.expire(now)
        waited.append(now - start)
    assert waited == [5.0, 10.0, 20.0, 40.0, 40.0, 40.0]
    reach.prune(lambda m: True, now + MAX_TTL + 1)
    reach.report("w2", 7, ["w0"], now + MAX_TTL + 1)
    assert reach.cuts[pair("w0", "w2")].strikes == 1


def test_a_newer_report_replaces_the_older_and_a_cut_holds_while_either_end_reports_it() -> None:
    reach = Reachability(TTL, MAX_TTL)
    reach.report("w2", 1, ["w0", "w1"], 0.0)
    reach.report("w0", 1, ["w2"], 1.0)
    reach.report("w2", 1, [], 2.0)  # w2 reaches both again; w0 still says it cannot reach w2
    assert not reach.cut("w1", "w2") and reach.cut("w0", "w2")
    reach.report("w0", 2, [], 3.0)
    assert len(reach) == 0 and reach.reports == {}
    reach.report("w0", 2, ["w2"], 4.0)
    assert reach.cuts[pair("w0", "w2")].strikes == 2, "cut again soon after its last cut ended: a strike more"
    reach.expire(4.0 + 2 * TTL)
    assert len(reach) == 0


def test_a_member_back_from_the_dead_is_cut_from_nobody() -> None:
    reach = Reachability(TTL, MAX_TTL)
    reach.report("w0", 1, ["w2"], 0.0)
    reach.report("w1", 1, ["w2"], 0.0)
    reach.report("w0", 1, ["w1", "w2"], 0.5)
    version = reach.version
    reach.reconnected("w2", 1, 1.0)
    assert sorted(reach.cuts) == [("w0", "w1")] and reach.version > version
    reach.report("w1", 1, ["w2"], 2.0)
    reach.report("w2", 1, ["w0", "w1"], 2.0)
    assert sorted(reach.cuts) == [("w0", "w1")], "observations made before it came back do not cut it again"
    reach.report("w2", 2, ["w0"], 3.0)
    assert sorted(reach.cuts) == [("w0", "w1"), ("w0", "w2")], "an observation about a later quorum does"
    assert [c["members"] for c in reach.to_status(3.0)] == [["w0", "w1"], ["w0", "w2"]]


def test_cuts_are_bounded_and_arguments_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("stalwart.coord.reachability.MAX_CUTS", 3)
    reach = Reachability(TTL, MAX_TTL)
    reach.report("w0", 1, [f"p{i}" for i in range(10)], 0.0)
    assert len(reach) == 3
    with pytest.raises(ValueError, match="max_ttl"):
        Reachability(TTL, TTL / 2)
    with pytest.raises(ValueError, match="ttl"):
        Reachability(0.0, TTL)


def test_a_probe_that_gets_through_ends_the_cut_whoever_reported_it_once_per_run_of_cuts() -> None:
    reach = Reachability(TTL, MAX_TTL)
    reach.report("w2", 1, ["w0", "w1"], 0.0)
    reach.report("w0", 1, ["w2"], 0.5)
    assert reach.reached("w2", ["w0"], 1.0) == [("w0", "w2")]
    assert sorted(reach.cuts) == [("w1", "w2")], "w0's own report no longer holds the pair"
    reach.report("w0", 1, ["w2"], 1.5)
    assert not reach.cut("w0", "w2"), "the same observation sent again cuts nothing"
    reach.report("w0", 2, ["w2"], 2.0)  # readmitted, and the collective failed again: the probe's path fools it
    cut = reach.cuts[pair("w0", "w2")]
    assert cut.strikes == 2 and not cut.probes_end_it
    assert reach.reached("w2", ["w0", "w1"], 2.5) == [("w1", "w2")], "this time only its time to live ends it"
    reach.expire(2.0 + 2 * TTL)
    assert len(reach) == 0
    reach.report("w0", 3, ["w2"], 13.0)  # ended by its time to live: the next cut trusts a probe again
    assert reach.reached("w0", ["w2"], 13.5) == [("w0", "w2")] and len(reach) == 0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_reached_ends_exactly_the_cuts_a_probe_may_end_and_the_graph_stays_the_cuts(data: st.DataObject) -> None:
    members = ["w0", "w1", "w2", "w3"]
    reach = Reachability(TTL, MAX_TTL)
    now, quorum_id = 0.0, 0
    for _ in range(data.draw(st.integers(1, 30), label="events")):
        now += data.draw(st.sampled_from([0.0, 0.5, TTL, MAX_TTL]), label="wait")
        member = data.draw(st.sampled_from(members), label="member")
        peers = data.draw(st.lists(st.sampled_from(members), unique=True), label="peers")
        event = data.draw(st.sampled_from(["report", "report", "reached", "expire"]), label="event")
        if event == "report":
            quorum_id += data.draw(st.integers(0, 1), label="new quorum")
            reach.report(member, quorum_id, peers, now)
        elif event == "reached":
            trusted = {
                p for p in peers if p != member and reach.cut(member, p) and reach.cuts[pair(member, p)].probes_end_it
            }
            distrusted = {p for p in peers if p != member and reach.cut(member, p)} - trusted
            ended = reach.reached(member, peers, now)
            assert ended == sorted(pair(member, p) for p in trusted)
            assert not any(reach.cut(member, p) for p in trusted) and all(reach.cut(member, p) for p in distrusted)
        else:
            reach.expire(now)
        assert cut_graph(reach.cuts) == reach.peers
