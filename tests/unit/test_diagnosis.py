"""What a failure says about each peer: the verdict rules, property-tested over random probe findings."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stalwart.runtime.comm import Failure
from stalwart.runtime.diagnosis import LeaderLoss, Verdict, diagnose
from stalwart.runtime.probe import Reach

FOUND = st.none() | st.sampled_from(list(Reach))
PEERS = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.lists(FOUND, max_size=4), max_size=4)


@given(st.sampled_from(list(Failure)), PEERS)
def test_a_member_is_as_bad_as_its_worst_process_and_only_unreachable_ones_are_reported(
    failure: Failure, peers: dict[str, list[Reach | None]]
) -> None:
    diagnosis = diagnose(failure, peers)
    assert list(diagnosis.verdicts) == [member for member, found in peers.items() if found]  # the quorum's order
    for member, verdict in diagnosis.verdicts.items():
        found = set(peers[member])
        if Reach.CUT_OFF in found:
            assert verdict is Verdict.CUT_OFF
        elif Reach.REFUSED in found:
            assert verdict is Verdict.DEAD
        elif Reach.SLOW in found:
            assert verdict is Verdict.SLOW_LINK
        elif None in found:
            assert verdict is Verdict.ABSENT
        else:
            assert verdict is (Verdict.SILENT if failure is Failure.TIMEOUT else Verdict.ALIVE)
    unreachable = {member for member, found in peers.items() if {Reach.CUT_OFF, Reach.REFUSED, Reach.SLOW} & set(found)}
    assert set(diagnosis.unreachable) == unreachable


@given(st.sampled_from(list(Failure)), PEERS, st.data())
def test_the_verdicts_do_not_depend_on_the_order_processes_were_probed_in(
    failure: Failure, peers: dict[str, list[Reach | None]], data: st.DataObject
) -> None:
    shuffled = {member: data.draw(st.permutations(found)) for member, found in peers.items()}
    assert diagnose(failure, shuffled).verdicts == diagnose(failure, peers).verdicts


@given(st.sampled_from(list(Failure)), PEERS)
def test_the_busy_hint_only_when_a_deadline_passed_with_every_peer_alive_and_reachable(
    failure: Failure, peers: dict[str, list[Reach | None]]
) -> None:
    examined = [found for found in peers.values() if found]
    every_peer_reachable = bool(examined) and all(reach is Reach.REACHABLE for found in examined for reach in found)
    assert diagnose(failure, peers).busy_hint == (failure is Failure.TIMEOUT and every_peer_reachable)


def test_the_description_names_each_peer_and_what_it_looked_like() -> None:
    diagnosis = diagnose(
        Failure.TIMEOUT,
        {
            "w1": [Reach.CUT_OFF],
            "w2": [Reach.REACHABLE, Reach.REACHABLE],
            "w3": [None],
            "w4": [Reach.REFUSED],
            "w5": [Reach.REACHABLE, Reach.SLOW],
        },
    )
    assert diagnosis.describe() == (
        "w1 cut off (unreachable from here: the connect timed out or found no route); "
        "w2 silent (reachable, and its link is fast enough, but it sent nothing until the deadline); "
        "w3 never came to the rendezvous (dead, or cut off from the lighthouse); "
        "w4 dead (nothing listens at its address: its process is gone); "
        "w5 on a slow link (reachable, but too slow to carry a step's all-reduce within the collective timeout)"
    )
    assert diagnosis.unreachable == ("w1", "w4", "w5") and not diagnosis.busy_hint
    assert "store did not answer" in diagnose(Failure.ERROR, {}).describe()


def test_an_abandoned_collective_names_the_lighthouse_not_the_store() -> None:
    """Given up on the lighthouse's word that a member is dead, nothing was probed: the line says so."""
    diagnosis = diagnose(Failure.ABANDONED, {})
    assert diagnosis.describe() == "not probed: the lighthouse reported a member of this quorum dead"
    assert diagnosis.unreachable == () and not diagnosis.busy_hint
    assert "store did not answer" in diagnose(Failure.ERROR, {}).describe()


def test_a_quorum_that_broke_during_on_leader_names_whom_it_lost_and_where() -> None:
    """The leader dead inside ``manager.on_leader()`` is named as such, never as a busy peer."""
    dead_leader = LeaderLoss("w0", 3, ("w0",)).describe()
    assert dead_leader.startswith("the leader w0 died inside manager.on_leader(): ") and "quorum 3" in dead_leader
    assert "busy" not in dead_leader
    assert "(and w2 with it)" in LeaderLoss("w0", 3, ("w0", "w2")).describe()
    other = LeaderLoss("w0", 3, ("w1",)).describe()
    assert other.startswith("w1 died while the leader w0 ran manager.on_leader()") and "w0 died" not in other
    unnamed = LeaderLoss("w0", 3, ()).describe()
    assert "while the leader w0 ran manager.on_leader()" in unnamed and "did not say which" in unnamed
