"""A failure quorum formed ahead of its survivors' requests (docs/protocol.md, "Forming a failure quorum ahead").

The lighthouse forms the survivors' quorum from their last counted reports
once the deaths settled; a survivor's request that fits what it presumed is
answered at once, one that does not (it applied a step its reports had not
shown yet) withdraws it, and the next quorum forms from the requests, as
without forming ahead. The property: whatever the survivors' real steps,
the quorum they end in, its ledger, its heal and the ledger's commits are
those of the lighthouse that waits for every request.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.coord.quorum import Formation, LighthouseState, QuorumRequest, RequestError
from stalwart.data.plan import EpochPlan
from stalwart.testing.fleet import SimulatedFleet

PLAN = EpochPlan(600, 12, seed=5)
SETTLE = 0.05


def fleet(size: int, steps: int, *, ahead: bool = True) -> SimulatedFleet:
    """``size`` members that trained ``steps`` steps, reporting each with their ledger's digest."""
    cluster = SimulatedFleet(PLAN, replay_ledgers=True, **({"ahead_settle": SETTLE} if ahead else {}))
    cluster.start(size)
    cluster.run_steps(steps)
    return cluster


def survivor_request(cluster: SimulatedFleet, member: str, quorum_id: int, reason: str = "failure") -> QuorumRequest:
    process = cluster.processes[member]
    return QuorumRequest(member, process.applied, quorum_id, reason, process.digest, process.weights)


def test_the_failure_quorum_forms_from_the_survivors_reports_without_their_requests() -> None:
    cluster = fleet(4, 3)
    first, second, dead, last = cluster.members
    cluster.kill(dead)
    assert cluster.state.quorum_broken
    cluster.now += SETTLE / 2
    assert cluster.state.tick(cluster.now) is None, "deaths settle first (members dying together: one quorum)"
    cluster.now += SETTLE
    formation = cluster.state.tick(cluster.now)
    assert formation is not None, "no survivor asked: the quorum forms from their reports"
    assert (formation.quorum_id, formation.reason, formation.members) == (2, "failure", (first, second, last))
    assert formation.applied_step == 3 and formation.heal is None and not cluster.state.quorum_broken
    assert cluster.state.quorums[-1]["ahead"] is True
    for member in (first, second, last):
        answer = cluster.state.request(survivor_request(cluster, member, 1), cluster.now)
        assert answer is not None and answer["quorum_id"] == 2, "a request that fits is answered at once"
    assert cluster.state.pending == {} and not cluster.state.quorum_broken


def test_a_survivor_a_step_past_its_reports_withdraws_the_quorum_and_the_requests_decide() -> None:
    cluster = fleet(3, 2)
    kept, ahead, dead = cluster.members
    cluster.finish(ahead)  # the step's all-reduce completed before the death; its report did not go out
    cluster.finish(kept)
    cluster.kill(dead)
    cluster.now += SETTLE
    early = cluster.state.tick(cluster.now)
    assert early is not None and early.applied_step == 2 and early.ahead is not None
    assert cluster.state.request(survivor_request(cluster, kept, 1), cluster.now) is None, "kept is at 3, not 2"
    assert cluster.state.quorum_broken, "a request that does not fit withdraws the quorum formed ahead"
    assert cluster.state.roster.withdrawn, "it will never run: the lighthouse ends its store"
    assert cluster.state.request(survivor_request(cluster, ahead, 1), cluster.now) is None
    formation = cluster.state.tick(cluster.now)
    assert formation is not None and formation.quorum_id == 3 and formation.ahead is None
    assert not cluster.state.roster.withdrawn
    assert formation.applied_step == 3 and formation.members == (kept, ahead) and formation.heal is None
    assert formation.begun_by == (kept, ahead, dead), "step 3 was begun by the quorum the survivors were in"
    assert sorted(cluster.log) == [0, 1, 2], "step 2 committed once, from the survivors' digests"


@pytest.mark.parametrize("names", ["the dead member", "a survivor"])
def test_a_survivor_naming_unreachable_peers_confirms_unless_it_names_one_the_quorum_kept(names: str) -> None:
    """A survivor whose own collective timed out probes its peers and names the dead one: that is no cut inside the
    quorum formed ahead, so it confirms; naming a survivor is one, and reachability decides."""
    cluster = fleet(3, 2)
    first, second, dead = cluster.members
    cluster.kill(dead)
    cluster.now += SETTLE
    early = cluster.state.tick(cluster.now)
    assert early is not None and early.members == (first, second)
    unreachable = (dead,) if names == "the dead member" else (first,)
    request = QuorumRequest(second, 2, 1, "failure", cluster.processes[second].digest, unreachable=unreachable)
    answer = cluster.state.request(request, cluster.now)
    if names == "the dead member":
        assert answer is not None and answer["quorum_id"] == 2 and not cluster.state.roster.withdrawn
        assert cluster.state.request(survivor_request(cluster, first, 1), cluster.now) is not None
        assert cluster.state.pending == {} and not cluster.state.quorum_broken
    else:
        assert answer is None and cluster.state.roster.withdrawn and cluster.state.quorum_broken


def test_a_report_past_the_presumed_step_withdraws_the_quorum() -> None:
    cluster = fleet(3, 1)
    _, second, dead = cluster.members
    cluster.kill(dead)
    cluster.now += SETTLE
    assert cluster.state.tick(cluster.now) is not None
    cluster.finish(second)
    cluster.heartbeat([second])
    assert cluster.state.quorum_broken and cluster.state.step == 2


def test_an_unconfirmed_survivor_asks_naming_the_quorum_it_was_in_and_is_not_told_to_join() -> None:
    cluster = fleet(3, 1)
    first, second, dead = cluster.members
    cluster.kill(dead)
    cluster.now += SETTLE
    assert cluster.state.tick(cluster.now) is not None
    cluster.finish(second)
    cluster.heartbeat([second])
    assert cluster.state.request(survivor_request(cluster, second, 1), cluster.now) is None
    assert second in cluster.state.pending, "it waits for the next quorum as a survivor (no 409: ask to join)"
    with pytest.raises(RequestError) as refused:
        cluster.state.request(survivor_request(cluster, first, 0), cluster.now)
    assert refused.value.status == 409, "only the quorum the survivors were in is accepted besides the current one"


@pytest.mark.parametrize("why", ["healing", "cut", "join", "rollback", "departure", "off"])
def test_the_requests_decide_when_the_survivors_state_is_not_known(why: str) -> None:
    cluster = fleet(3, 2, ahead=why != "off")
    first, second, dead = cluster.members
    if why == "healing":
        cluster.state.commits.heal({second: False}, 2)
    elif why == "cut":
        cluster.state.request(
            QuorumRequest(first, 2, 1, "failure", cluster.processes[first].digest, unreachable=(second,)), cluster.now
        )
    elif why == "join":
        cluster.ask(second, "join", 0)
    elif why == "rollback":
        cluster.finish(dead)
        cluster.heartbeat([dead])
        assert cluster.state.step == 3
    if why == "departure":
        cluster.state.leave(dead, cluster.now)
        del cluster.processes[dead]
    else:
        cluster.kill(dead)
    cluster.now += SETTLE
    formation = cluster.state.tick(cluster.now)
    assert formation is None or formation.ahead is None, "the requests decide (here the cut's rule formed one)"


def test_joiners_wait_for_the_next_boundary() -> None:
    cluster = fleet(3, 1)
    joiner = cluster.spawn()
    cluster.ask(joiner, "join")
    first, second, dead = cluster.members
    cluster.kill(dead)
    cluster.now += SETTLE
    formation = cluster.state.tick(cluster.now)
    assert formation is not None and formation.members == (first, second)
    assert joiner in cluster.state.pending and cluster.state.reconfigure_pending


def test_the_presumption_and_the_confirmations_survive_a_restart() -> None:
    cluster = fleet(3, 1)
    first, second, dead = cluster.members
    cluster.kill(dead)
    cluster.now += SETTLE
    assert cluster.state.tick(cluster.now) is not None
    assert cluster.state.request(survivor_request(cluster, first, 1), cluster.now) is not None
    restored = LighthouseState.from_state_dict(cluster.state.state_dict(), now=cluster.now, ahead_settle=SETTLE)
    assert restored.formation is not None and restored.formation.ahead == cluster.state.formation.ahead
    assert restored.former.unconfirmed() == {second}
    assert restored.request(survivor_request(cluster, second, 1), cluster.now) is not None


def settle_failure(cluster: SimulatedFleet, survivors: list[str], order: list[str], early: int) -> Formation:
    """Drive the survivors as workers do until they all hold the same unbroken quorum: the first ``early`` of
    ``order`` ask before the deaths settle; then, tick after tick, each asks (naming the quorum it holds) when its
    quorum is broken or it holds an older one, and adopts the answer it gets; returns the final formation."""
    holds = dict.fromkeys(survivors, 1)
    waiting: set[str] = set()
    for member in order[:early]:
        assert cluster.state.request(survivor_request(cluster, member, 1), cluster.now) is None
        waiting.add(member)
    cluster.now += SETTLE
    for _ in range(12):
        formation = cluster.state.tick(cluster.now)
        for member in sorted(waiting):
            if formation is not None and member in formation.members:
                waiting.discard(member)
                adopt(holds, member, formation.answer(member))
        current = cluster.state.quorum
        assert current is not None
        settled = not cluster.state.quorum_broken and not waiting
        if settled and all(holds[m] == current.quorum_id for m in survivors):
            assert cluster.state.formation is not None
            return cluster.state.formation
        for member in order:
            broken = holds[member] != current.quorum_id or cluster.state.quorum_broken
            if member in waiting or not broken:
                continue
            answer = cluster.state.request(survivor_request(cluster, member, holds[member]), cluster.now)
            if answer is None:
                waiting.add(member)
            else:
                adopt(holds, member, answer)
        cluster.now += SETTLE
    raise AssertionError(f"the survivors never settled: {holds}, waiting {waiting}")


def adopt(holds: dict[str, int], member: str, answer: dict[str, Any]) -> None:
    """``member`` holds the quorum it was answered (a heal needs every member of the quorum: none runs here)."""
    holds[member] = answer["quorum_id"]


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(2, 6),
    steps=st.integers(1, 3),
    data=st.data(),
)
def test_forming_ahead_ends_where_the_requests_would(size: int, steps: int, data: st.DataObject) -> None:
    ends = []
    dead_count = data.draw(st.integers(1, size - 1))
    finished = data.draw(st.sets(st.integers(0, size - 1)))
    reported = data.draw(st.sets(st.integers(0, size - 1)))
    seed = data.draw(st.randoms(use_true_random=False))
    early = data.draw(st.integers(0, size - dead_count))
    for ahead in (False, True):
        cluster = fleet(size, steps, ahead=ahead)
        members = cluster.members
        # the step's all-reduce completed on some members before the death; some of them reported it
        for index in sorted(finished):
            cluster.finish(members[index])
        cluster.heartbeat([members[index] for index in sorted(finished & reported)])
        dead = members[size - dead_count :]
        survivors = members[: size - dead_count]
        for member in dead:
            cluster.kill(member)
        order = list(survivors)
        seed.shuffle(order)
        final = settle_failure(cluster, survivors, order, early)
        ends.append(
            (final.members, final.applied_step, final.heal, final.ledger, sorted(cluster.log), cluster.state.step)
        )
    assert ends[0] == ends[1]


def test_a_death_in_a_quorum_formed_ahead_leaves_the_next_one_to_the_requests() -> None:
    cluster = fleet(4, 2)
    first, second, third, dead = cluster.members
    cluster.finish(first)
    cluster.finish(second)
    cluster.kill(dead)
    cluster.now += SETTLE
    assert cluster.state.tick(cluster.now) is not None
    cluster.kill(third)
    cluster.now += SETTLE
    assert cluster.state.tick(cluster.now) is None, "its members may hold steps it did not presume: they ask"
    for member in (first, second):
        assert cluster.state.request(survivor_request(cluster, member, 1), cluster.now) is None
    formation = cluster.state.tick(cluster.now)
    assert formation is not None and formation.ahead is None and formation.members == (first, second)
    assert formation.applied_step == 3 and sorted(cluster.log) == [0, 1, 2]
    assert formation.begun_by == (first, second, third, dead) and formation.failed == ((third, dead),)
