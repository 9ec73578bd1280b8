"""The lighthouse state machine: quorum rules, failures, healing, rollback and the ledger's exactly-once invariant."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.coord.quorum import Formation, LighthouseState, QuorumRequest, RequestError
from stalwart.coord.roster import NAMED_DOWN, Quorum, Roster
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.testing.fleet import SimulatedFleet

PLAN = EpochPlan(120, 12, seed=3)
HEARTBEAT_TIMEOUT = 1.0
JOIN_TIMEOUT = 2.0


def expected_shares(state: dict[str, Any], members: list[str]) -> dict[str, list[int]]:
    """The shares of a fresh ``begin_step(members)`` on a committed ledger state."""
    ledger = DataLedger.from_state_dict(state)
    return {member: share.tolist() for member, share in ledger.begin_step(members).items()}


def union(in_flight: dict[str, list[int]]) -> list[int]:
    return sorted(position for positions in in_flight.values() for position in positions)


def test_start_up_quorum_waits_for_every_live_member_then_admits_them_in_arrival_order() -> None:
    cluster = SimulatedFleet(PLAN)
    late = cluster.spawn()
    first, second = cluster.spawn(), cluster.spawn()
    cluster.ask(second, "join")
    cluster.ask(first, "join")
    assert cluster.state.tick(cluster.now) is None, "start-up must wait for the live member that has not asked"
    cluster.now += 0.5
    cluster.heartbeat()
    cluster.ask(late, "join")
    formation = cluster.state.tick(cluster.now)
    assert formation is not None
    assert formation.members == (second, first, late)
    start_up_heal = {"source_rank": 0, "targets": [first, late], "checkpoint": None}
    assert (formation.quorum_id, formation.reason, formation.applied_step) == (1, "start-up", 0)
    assert formation.heal == start_up_heal, "at start-up every member begins from rank 0's state"
    fresh = DataLedger(PLAN)
    assert formation.ledger["in_flight"] == {m: s.tolist() for m, s in fresh.begin_step([second, first, late]).items()}
    answer = formation.answer(first)
    assert (answer["rank"], answer["world_size"], answer["quorum_id"]) == (1, 3, 1)
    assert cluster.state.pending == {}


def test_start_up_forms_without_a_silent_member_after_join_timeout() -> None:
    cluster = SimulatedFleet(PLAN)
    silent = cluster.spawn()
    asker = cluster.spawn()
    cluster.ask(asker, "join")
    cluster.now += JOIN_TIMEOUT * 0.9
    cluster.heartbeat()
    assert cluster.state.tick(cluster.now) is None
    cluster.now += JOIN_TIMEOUT * 0.1
    cluster.heartbeat()
    formation = cluster.state.tick(cluster.now)
    assert formation is not None and formation.members == (asker,) and formation.timed_out
    assert cluster.state.member_state(silent) == "joining"


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(2, 6),
    multiple=st.integers(1, 3),
    steps=st.integers(0, 4),
    data=st.data(),
)
def test_failure_quorum_gives_survivors_exactly_the_lost_positions(size: int, multiple: int, steps: int, data) -> None:
    plan = EpochPlan(500, 24, seed=1, local_batch_multiple=multiple)
    cluster = SimulatedFleet(plan)
    cluster.start(size)
    cluster.run_steps(steps)
    members = cluster.members
    before = cluster.current_shares()
    dead = data.draw(st.lists(st.sampled_from(members), min_size=1, max_size=min(2, size - 1), unique=True))
    how = data.draw(st.sampled_from(["socket", "timeout"]))
    for member in dead:
        cluster.kill(member, how)
    survivors = [m for m in members if m not in dead]
    for member in survivors:
        cluster.ask(member, "failure")
    formation = cluster.settle()
    assert formation.reason == "failure" and formation.members == tuple(survivors)
    assert formation.applied_step == steps and formation.heal is None
    after = formation.ledger["in_flight"]
    assert list(after) == survivors
    assert union(after) == union(before), "the step must still train on every one of its positions"
    assert len(union(after)) == len(set(union(after))), "no position may be handed out twice"
    lost = sorted(p for m in dead for p in before[m])
    extra = sorted(p for m in survivors for p in after[m][len(before[m]) :])
    assert extra == lost
    for member in survivors:
        assert after[member][: len(before[member])] == before[member], "a survivor keeps its accumulated share"
    assert {f["member"] for f in cluster.state.failures} == set(dead)
    assert cluster.state.counts["recoveries"] == len(dead)


def test_a_member_one_step_ahead_raises_a_and_the_ledger_commits_through_it() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(3)
    cluster.run_steps(2)
    ahead, behind, dead = cluster.members
    cluster.processes[ahead].applied = 3
    cluster.kill(dead)
    cluster.ask(ahead, "failure")
    cluster.ask(behind, "failure")
    formation = cluster.settle()
    assert formation.applied_step == 3 and cluster.state.step == 3
    assert formation.heal == {"source_rank": 0, "targets": [behind], "checkpoint": None}
    assert sorted(cluster.log) == [0, 1, 2]
    assert sorted(cluster.log[2][1]) == list(range(24, 36)), "step 2 committed with all three members' positions"
    assert formation.reason == "failure" and formation.members == (ahead, behind)
    assert union(formation.ledger["in_flight"]) == list(range(36, 48))
    assert formation.ledger["members"] == [ahead, behind, dead]


def test_rollback_when_the_only_member_that_applied_a_step_dies() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(3)
    cluster.run_steps(2)
    first, second, third = cluster.members
    shares = cluster.current_shares()
    cluster.processes[first].applied = 3
    cluster.heartbeat([first])
    assert cluster.state.step == 3, "the ledger commits what a live member reports"
    cluster.kill(first)
    cluster.ask(second, "failure")
    cluster.ask(third, "failure")
    formation = cluster.settle()
    assert formation.rolled_back and cluster.state.step == 2 and formation.applied_step == 2
    assert cluster.state.counts["rollbacks"] == 1
    in_flight = formation.ledger["in_flight"]
    assert list(in_flight) == [second, third]
    assert union(in_flight) == union(shares)
    for member in (second, third):
        assert in_flight[member][: len(shares[member])] == shares[member]
    cluster.run_steps(1)
    assert cluster.state.step == 3 and sorted(cluster.log[2][1]) == union(shares)


def test_healing_targets_and_their_stale_heartbeats_do_not_commit() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    cluster.run_steps(5)
    joiner = cluster.spawn()
    cluster.ask(joiner, "join")
    assert cluster.state.reconfigure_pending and cluster.state.should_reconfigure(cluster.members[0])
    assert not cluster.state.should_reconfigure(joiner)
    for member in cluster.members:
        cluster.ask(member, "reconfigure")
    formation = cluster.state.tick(cluster.now)
    assert formation is not None and formation.reason == "boundary"
    assert formation.heal == {"source_rank": 0, "targets": [joiner], "checkpoint": None}
    assert formation.members[-1] == joiner and formation.applied_step == 5
    assert formation.ledger["in_flight"] == expected_shares(
        cluster.state.state_dict()["ledger"], list(formation.members)
    )
    assert not cluster.state.reconfigure_pending
    cluster.state.heartbeat(joiner, 0, cluster.now)
    assert cluster.state.step == 5 and cluster.state.to_status()["members"][-1]["healing"]
    cluster.state.heartbeat(joiner, 6, cluster.now)
    assert cluster.state.step == 6, "a healed member's reports count again"


def test_joiners_wait_during_a_failure_quorum_and_enter_at_the_next_boundary() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(3)
    cluster.run_steps(1)
    joiner = cluster.spawn()
    cluster.ask(joiner, "join")
    first, second, dead = cluster.members
    cluster.kill(dead)
    cluster.ask(first, "failure")
    cluster.ask(second, "failure")
    formation = cluster.settle()
    assert formation.reason == "failure" and formation.members == (first, second)
    assert joiner in cluster.state.pending and cluster.state.member_state(joiner) == "joining"
    assert cluster.state.should_reconfigure(first), "the flag stays raised while the joiner waits"
    cluster.run_steps(1)
    for member in (first, second):
        cluster.ask(member, "reconfigure")
    formation = cluster.settle()
    assert formation.reason == "boundary" and formation.members == (first, second, joiner)
    assert formation.heal == {"source_rank": 0, "targets": [joiner], "checkpoint": None}


def test_two_askers_of_four_form_within_the_join_timeout_without_the_two_that_never_ask() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(4)
    members = cluster.members
    cluster.ask(members[0], "failure")
    cluster.ask(members[1], "failure")
    asked_at = cluster.now
    cluster.now = asked_at + JOIN_TIMEOUT - 0.01
    cluster.heartbeat()
    assert cluster.state.tick(cluster.now) is None, "before the join timeout every live member may still ask"
    cluster.now = asked_at + JOIN_TIMEOUT
    cluster.heartbeat()
    formation = cluster.state.tick(cluster.now)
    assert formation is not None, "members that did not ask by the join timeout no longer count for the majority"
    assert formation.members == tuple(members[:2]) and formation.timed_out
    assert [(f["member"], f["reason"]) for f in cluster.state.failures[-2:]] == [
        (members[2], "excluded"),
        (members[3], "excluded"),
    ]


def test_a_quorum_member_whose_peers_wait_on_it_without_progress_is_hung() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(3)
    members = cluster.members
    hung = members[2]
    cluster.run_steps(2)
    for member in members[:2]:
        cluster.processes[member].applied += 1
    started = cluster.now
    while cluster.now < started + JOIN_TIMEOUT:
        cluster.now += 0.25
        cluster.heartbeat()
        assert cluster.state.tick(cluster.now) is None
        assert not cluster.state.quorum_broken, "a wait shorter than the join timeout is not a hang"
    cluster.now += 0.5
    cluster.heartbeat()
    assert cluster.state.tick(cluster.now) is None
    assert cluster.state.quorum_broken and cluster.state.should_reconfigure(members[0])
    assert cluster.state.broken_by == [hung], "the broken-quorum notice names it"
    assert cluster.state.failures[-1]["member"] == hung and cluster.state.failures[-1]["reason"] == "hung"
    assert cluster.state.member_state(hung) == "alive", "its heartbeat still lives"
    with pytest.raises(RequestError) as refused:
        cluster.ask(hung, "failure")
    assert refused.value.status == 409 and "ask again with reason 'join'" in refused.value.message
    for member in members[:2]:
        cluster.ask(member, "reconfigure")
    formation = cluster.state.tick(cluster.now)
    assert formation is not None and formation.members == tuple(members[:2]) and formation.applied_step == 3


def test_min_replicas_holds_back_the_first_quorum_but_a_failure_quorum_keeps_every_survivor() -> None:
    cluster = SimulatedFleet(PLAN, min_replicas=3)
    first, second = cluster.spawn(), cluster.spawn()
    cluster.ask(first, "join")
    cluster.ask(second, "join")
    cluster.now += 3 * JOIN_TIMEOUT
    cluster.heartbeat()
    assert cluster.state.tick(cluster.now) is None
    third = cluster.spawn()
    cluster.ask(third, "join")
    formation = cluster.state.tick(cluster.now)
    assert formation is not None and len(formation.members) == 3
    cluster.run_steps(2)
    in_flight = union(cluster.current_shares())
    cluster.kill(second)
    cluster.kill(third)
    restarted = [cluster.spawn(), cluster.spawn()]  # the two killed processes, started again, ask first
    for member in restarted:
        cluster.ask(member, "join")
    assert cluster.state.tick(cluster.now) is None, "the joiners wait for the survivor, who holds the state"
    cluster.ask(first, "failure")
    formation = cluster.state.tick(cluster.now)
    assert formation is not None, "the lone survivor forms a failure quorum at once, below min_replicas=3"
    assert formation.reason == "failure" and formation.members == (first,) and formation.heal is None
    assert union(formation.ledger["in_flight"]) == in_flight, "it takes the dead members' positions of the step"
    assert all(member in cluster.state.pending for member in restarted), "joiners wait for the next boundary"
    assert cluster.state.should_reconfigure(first)
    cluster.processes[first].applied += 1
    cluster.heartbeat()
    cluster.ask(first, "reconfigure")
    boundary = cluster.settle()
    assert boundary.reason == "boundary" and boundary.members == (first, *restarted)
    assert boundary.heal == {"source_rank": 0, "targets": restarted, "checkpoint": None}


def test_join_timeout_excludes_a_member_that_heartbeats_but_never_asks() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(3)
    hung = cluster.members[2]
    for member in cluster.members[:2]:
        cluster.ask(member, "reconfigure")
    asked_at = cluster.now
    cluster.now = asked_at + JOIN_TIMEOUT - 0.01
    cluster.heartbeat()
    assert cluster.state.tick(cluster.now) is None
    cluster.now = asked_at + JOIN_TIMEOUT
    cluster.heartbeat()
    formation = cluster.state.tick(cluster.now)
    assert formation is not None and formation.timed_out and hung not in formation.members
    with pytest.raises(RequestError) as refused:
        cluster.ask(hung, "reconfigure", 0)
    assert refused.value.status == 409 and refused.value.details["quorum_id"] == formation.quorum_id
    assert cluster.ask(hung, "join") is None


def test_heartbeat_timeout_and_leave_mark_members_dead_and_a_heartbeat_revives() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(3)
    stopped, leaving = cluster.members[1:]
    cluster.now += HEARTBEAT_TIMEOUT + 0.1
    cluster.heartbeat([cluster.members[0], leaving])
    assert cluster.state.tick(cluster.now) is None
    assert cluster.state.member_state(stopped) == "dead"
    assert cluster.state.failures[-1] == {
        "member": stopped,
        "time": cluster.now,
        "reason": "heartbeat timeout",
        "in_quorum": True,
    }
    assert cluster.state.reconfigure_pending
    cluster.heartbeat([stopped])
    assert cluster.state.member_state(stopped) == "alive" and not cluster.state.reconfigure_pending
    cluster.state.leave(leaving, cluster.now)
    assert cluster.state.member_state(leaving) == "left" and cluster.state.counts["departures"] == 1
    cluster.heartbeat([leaving])
    assert cluster.state.member_state(leaving) == "alive"
    with pytest.raises(RequestError) as refused:
        cluster.state.leave("nobody", cluster.now)
    assert refused.value.status == 404


def test_a_leaving_member_s_last_step_is_committed() -> None:
    """A short job can end between two heartbeats: the step reported on leaving still commits."""
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    assert cluster.state.step == 0
    for member in cluster.members:
        cluster.state.leave(member, cluster.now, applied_step=3)
    assert cluster.state.step == 3
    assert all(cluster.state.member_state(member) == "left" for member in cluster.members)


def test_a_retried_request_gets_the_same_answer_and_a_changed_one_waits() -> None:
    cluster = SimulatedFleet(PLAN)
    member = cluster.spawn()
    request = QuorumRequest(member, 0, None, "join")
    assert cluster.state.request(request, cluster.now) is None
    formation = cluster.state.tick(cluster.now)
    assert formation is not None
    assert cluster.state.request(request, cluster.now) == formation.answer(member)
    assert cluster.state.request(QuorumRequest(member, 0, 1, "reconfigure"), cluster.now) is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], None),
        ({"member": "w0", "applied_step": 0}, "reason"),
        ({"member": "", "applied_step": 0, "reason": "join"}, "member"),
        ({"member": "a b", "applied_step": 0, "reason": "join"}, "member"),
        ({"member": "w0", "applied_step": -1, "reason": "join"}, "applied_step"),
        ({"member": "w0", "applied_step": True, "reason": "join"}, "applied_step"),
        ({"member": "w0", "applied_step": 1.5, "reason": "join"}, "applied_step"),
        ({"member": "w0", "applied_step": 0, "reason": "leave"}, "reason"),
        ({"member": "w0", "applied_step": 0, "reason": "failure", "quorum_id": None}, "quorum_id"),
        ({"member": "w0", "applied_step": 0, "reason": "failure", "quorum_id": "1"}, "quorum_id"),
        ({"member": "w0", "applied_step": 0, "reason": "join", "extra": 1}, "extra"),
    ],
)
def test_malformed_requests_name_the_field(body: Any, field: str | None) -> None:
    with pytest.raises(RequestError) as refused:
        QuorumRequest.from_json(body)
    assert refused.value.status == 400
    assert refused.value.details.get("field") == field
    if field is not None:
        assert field in refused.value.message


def test_refused_requests_change_nothing() -> None:
    cluster = SimulatedFleet(PLAN)
    with pytest.raises(RequestError) as refused:
        cluster.state.request(QuorumRequest("w9", 0, 1, "failure"), cluster.now)
    assert refused.value.status == 409, "no quorum yet: a survivor's request is refused"
    with pytest.raises(RequestError):
        cluster.state.request(QuorumRequest("w9", 1, None, "join"), cluster.now)
    assert cluster.state.members == {} and cluster.state.pending == {}
    cluster.start(2)
    cluster.run_steps(3)
    before = json.dumps(cluster.state.state_dict(), sort_keys=True)
    member = cluster.members[0]
    bad = [
        QuorumRequest(member, 3, 7, "failure"),
        QuorumRequest("stranger", 3, 1, "reconfigure"),
        QuorumRequest("stranger", 5, None, "join"),
        QuorumRequest(member, 10**9, 1, "failure"),
    ]
    for request in bad:
        with pytest.raises(RequestError) as refused:
            cluster.state.request(request, cluster.now)
        assert refused.value.status in (409, 422)
    with pytest.raises(RequestError):
        cluster.state.heartbeat(member, 10**9, cluster.now)
    assert json.dumps(cluster.state.state_dict(), sort_keys=True) == before
    assert cluster.state.pending == {}
    assert cluster.ask("w0", "join", 4) is None, "one step past what is known is possible"


def test_state_dict_round_trip_resumes_identically() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(4)
    cluster.run_steps(2)
    cluster.kill(cluster.members[3])
    for member in cluster.members[:3]:
        cluster.ask(member, "failure")
    cluster.settle()
    state = json.loads(json.dumps(cluster.state.state_dict()))
    restored = LighthouseState.from_state_dict(
        state, now=cluster.now, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT
    )
    assert restored.quorum == cluster.state.quorum and restored.step == cluster.state.step
    assert restored.ledger_state() == cluster.state.ledger_state()
    assert restored.state_dict() == state
    assert all(restored.member_state(m) == "alive" for m in cluster.members)
    retried = QuorumRequest(cluster.members[0], 2, 1, "failure")
    assert restored.answer_for(retried) == cluster.state.answer_for(retried) is not None, "answers survive a restart"
    for lighthouse in (cluster.state, restored):
        for member in cluster.members:
            lighthouse.heartbeat(member, 4, cluster.now + 0.1)
        for member in cluster.members:
            lighthouse.request(QuorumRequest(member, 4, 2, "reconfigure"), cluster.now + 0.2)
    ours, theirs = cluster.state.tick(cluster.now + 0.3), restored.tick(cluster.now + 0.3)
    assert ours is not None and theirs is not None
    ours_answer, theirs_answer = ours.answer("w0"), theirs.answer("w0")
    assert ours_answer == theirs_answer
    assert restored.state_dict()["ledger"] == cluster.state.state_dict()["ledger"]


def test_restored_quorum_members_die_after_the_heartbeat_timeout_unless_they_reconnect() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    restored = LighthouseState.from_state_dict(
        cluster.state.state_dict(), now=10.0, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT
    )
    restored.connected("w0", 10.5)
    restored.tick(10.0 + HEARTBEAT_TIMEOUT + 0.1)
    assert restored.member_state("w0") == "alive" and restored.member_state("w1") == "dead"


@st.composite
def plans(draw: st.DrawFn) -> EpochPlan:
    batch = draw(st.integers(4, 24))
    multiple = draw(st.integers(1, min(batch // 2, 4)))
    return EpochPlan(draw(st.integers(batch, 160)), batch, seed=draw(st.integers(0, 3)), local_batch_multiple=multiple)


@settings(max_examples=60, deadline=None)
@given(plan=plans(), data=st.data())
def test_random_failures_and_joins_commit_every_position_of_the_epoch_once(plan: EpochPlan, data) -> None:
    cluster = SimulatedFleet(plan)
    cluster.start(data.draw(st.integers(1, 4), label="initial members"))
    for _ in range(300):
        ledger = cluster.state.to_status()["ledger"]
        if ledger["epoch_progress"] == 1.0 or ledger["epoch"] > 0:
            break
        check_partition(cluster.formations[-1])
        event = data.draw(st.sampled_from(["step", "step", "fail", "join", "lose-joiner"]), label="event")
        members = cluster.members
        if event == "fail" and len(members) > 1:
            fail(cluster, data)
        elif event == "join":
            cluster.ask(cluster.spawn(), "join")
        elif event == "lose-joiner":
            waiting = [m for m in cluster.state.pending if m not in members]
            if waiting:
                cluster.kill(waiting[0])
        cluster.run_steps(1)
        if cluster.state.reconfigure_pending:
            for member in cluster.members:
                cluster.ask(member, "reconfigure")
            cluster.settle()
    else:
        raise AssertionError("the epoch did not end")
    committed = [
        positions for step, (epoch, positions) in cluster.log.items() if epoch == 0 and step < cluster.state.step
    ]
    flat = sorted(p for positions in committed for p in positions)
    assert flat == list(range(plan.epoch_length)), "every position of the epoch committed exactly once"


def fail(cluster: SimulatedFleet, data) -> None:
    """Inside a step: some members may finish it (and report), some die, the rest ask with ``failure``."""
    members = cluster.members
    finished = data.draw(st.lists(st.sampled_from(members), unique=True), label="finished")
    for member in finished:
        cluster.processes[member].applied += 1
        if data.draw(st.booleans(), label="reported"):
            cluster.heartbeat([member])
    dead = data.draw(
        st.lists(st.sampled_from(members), min_size=1, max_size=len(members) - 1, unique=True), label="dead"
    )
    how = data.draw(st.sampled_from(["socket", "timeout"]), label="how")
    for member in dead:
        cluster.kill(member, how)
    survivors = [m for m in members if m not in dead]
    for member in survivors:
        cluster.ask(member, "failure")
    target = max(cluster.applied[m] for m in survivors)
    formation = cluster.settle()
    assert formation.members == tuple(survivors)
    assert formation.applied_step == target and cluster.state.step == target


def check_partition(formation: Formation) -> None:
    """A quorum's ledger hands each position of the step to exactly one live member."""
    in_flight = formation.ledger["in_flight"]
    assert set(in_flight) <= set(formation.members)
    flat = union(in_flight)
    assert len(flat) == len(set(flat))


def test_first_quorum_waits_for_start_replicas_up_to_the_join_timeout() -> None:
    state = LighthouseState(PLAN, min_replicas=1, heartbeat_timeout=5.0, join_timeout=3.0, start_replicas=3)
    for member in ("a", "b"):
        state.connected(member, 0.0)
        state.request(QuorumRequest(member, 0, None, "join"), 0.0)
    assert state.tick(1.0) is None, "two of the three the fleet starts with: wait"
    state.connected("c", 1.5)
    state.request(QuorumRequest("c", 0, None, "join"), 1.5)
    formation = state.tick(1.5)
    assert formation is not None and formation.members == ("a", "b", "c")
    late = LighthouseState(PLAN, min_replicas=1, heartbeat_timeout=5.0, join_timeout=3.0, start_replicas=3)
    late.connected("a", 0.0)
    late.request(QuorumRequest("a", 0, None, "join"), 0.0)
    assert late.tick(2.9) is None
    formation = late.tick(3.1)
    assert formation is not None and formation.members == ("a",), "after the join timeout, min_replicas is enough"
    with pytest.raises(ValueError, match=r"start_replicas must be in \[2, "):
        LighthouseState(PLAN, min_replicas=2, start_replicas=1)


INCARNATIONS = [f"{n:032x}" for n in range(1, 5)]


def test_a_new_incarnation_marks_the_old_one_dead_and_only_the_current_secret_works() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    state, member = cluster.state, cluster.members[1]
    old_secret = state.register(member, INCARNATIONS[0], cluster.now)
    state.authenticate(member, INCARNATIONS[0], old_secret)
    with pytest.raises(RequestError) as wrong:
        state.authenticate(member, INCARNATIONS[0], old_secret + "x")
    assert wrong.value.status == 403 and "wrong secret" in wrong.value.message
    with pytest.raises(RequestError) as other:
        state.authenticate(cluster.members[0], INCARNATIONS[0], old_secret)
    assert other.value.status == 403 and other.value.details["code"] == "unregistered", "no speaking for others"
    with pytest.raises(RequestError) as alive:
        state.register(member, INCARNATIONS[1], cluster.now + 1)
    assert alive.value.status == 409 and alive.value.details["code"] == "member_alive", "a live member is not evicted"
    assert state.member_state(member) == "alive" and not state.quorum_broken
    with pytest.raises(RequestError) as forged:
        state.register(member, INCARNATIONS[1], cluster.now + 1, current=(INCARNATIONS[0], old_secret + "x"))
    assert forged.value.status == 403 and state.member_state(member) == "alive"
    new_secret = state.register(member, INCARNATIONS[1], cluster.now + 1, current=(INCARNATIONS[0], old_secret))
    assert state.member_state(member) == "dead" and state.quorum_broken
    assert state.failures[-1] == {"member": member, "time": cluster.now + 1, "reason": "restarted", "in_quorum": True}
    with pytest.raises(RequestError) as superseded:
        state.authenticate(member, INCARNATIONS[0], old_secret)
    assert superseded.value.status == 403 and superseded.value.details["code"] == "superseded"
    state.authenticate(member, INCARNATIONS[1], new_secret)
    with pytest.raises(RequestError) as again:
        state.register(member, INCARNATIONS[0], cluster.now + 2)
    assert again.value.status == 409 and again.value.details["code"] == "superseded", "an old process cannot evict"
    restored = LighthouseState.from_state_dict(json.loads(json.dumps(state.state_dict())), now=cluster.now + 3)
    restored.authenticate(member, INCARNATIONS[1], new_secret)
    assert new_secret not in json.dumps(state.state_dict()), "only a hash of the secret is kept"


def test_max_members_caps_registrations_naming_the_cap() -> None:
    state = LighthouseState(PLAN, max_members=2)
    state.register("a", INCARNATIONS[0], 0.0)
    state.register("b", INCARNATIONS[1], 0.0)
    with pytest.raises(RequestError) as refused:
        state.register("c", INCARNATIONS[2], 0.0)
    assert refused.value.status == 429 and "max_members=2" in refused.value.message
    with pytest.raises(RequestError) as alive:
        state.register("a", INCARNATIONS[3], 0.0)
    assert alive.value.details["code"] == "member_alive"
    state.heartbeat("b", 0, 10.0)  # the lighthouse hears "b": its network works, so the silence of "a" counts
    state.tick(10.0)  # "a" is dead by heartbeat now: a new process may take its name
    state.register("a", INCARNATIONS[3], 10.0)
    with pytest.raises(RequestError, match="incarnation must be 32 lowercase hex"):
        state.register("d", "nope", 0.0)


# --- the job's state is never lost while a live member holds it ----------------------------------------------------


def test_a_member_disclaiming_its_state_waits_for_the_survivor_training_a_slow_step() -> None:
    """The quorum's other member asks to join afresh (its state diverged): no quorum forms without the live
    holder of the state, however long its step takes; the holder is not excluded, and heals the other."""
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    cluster.run_steps(3)
    holder, other = cluster.members
    assert disclaim(cluster, other) is None
    for _ in range(int(4 * JOIN_TIMEOUT / 0.25)):
        cluster.now += 0.25
        cluster.heartbeat()
        assert cluster.state.tick(cluster.now) is None, "a stateless quorum never forms while the holder lives"
    assert cluster.state.should_reconfigure(holder) and cluster.state.failures == []
    cluster.processes[holder].applied += 1
    cluster.heartbeat()
    cluster.ask(holder, "reconfigure")
    formation = cluster.settle()
    assert formation.members == (holder, other) and formation.applied_step == 4
    assert formation.heal == {"source_rank": 0, "targets": [other], "checkpoint": None}


def disclaim(cluster: SimulatedFleet, member: str) -> dict[str, Any] | None:
    """``member`` asks to join afresh, as a Manager whose state diverged does: ``join`` at step 0, naming its quorum."""
    quorum = cluster.state.quorum
    assert quorum is not None
    return cluster.state.request(QuorumRequest(member, 0, quorum.quorum_id, "join"), cluster.now)


def test_once_the_holder_is_gone_the_newcomers_form_and_learn_the_state_is_lost() -> None:
    cluster = SimulatedFleet(PLAN, min_replicas=2)
    cluster.start(2)
    cluster.run_steps(2)
    for member in cluster.members:
        cluster.kill(member)
    newcomers = [cluster.spawn(), cluster.spawn()]
    for member in newcomers:
        cluster.ask(member, "join")
    formation = cluster.settle()
    assert formation.members == tuple(newcomers) and formation.applied_step == 2
    assert formation.heal == {"source_rank": None, "targets": newcomers, "checkpoint": None}


@pytest.mark.parametrize("min_replicas", [1, 3])
def test_a_late_joiner_after_the_job_ended_is_answered_at_once_whatever_min_replicas(min_replicas: int) -> None:
    """Every member of the last quorum left cleanly: a joiner forms alone at the final step, with nobody to heal it
    from (the Manager's ``JobFinishedError``), at its first tick, and no failure is counted."""
    cluster = SimulatedFleet(PLAN, min_replicas=min_replicas)
    cluster.start(3)
    cluster.run_steps(4)
    finishers = cluster.members
    early = cluster.spawn()
    assert cluster.ask(early, "join", 0) is None
    for member in finishers[:-1]:
        cluster.state.leave(member, cluster.now, applied_step=4)
    assert cluster.state.tick(cluster.now) is None, "a member of the last quorum still trains: the joiner waits"
    cluster.state.leave(finishers[-1], cluster.now, applied_step=4)
    failures = cluster.state.counts["failures"]
    formation = cluster.tick()
    assert formation is not None and formation.members == (early,) and formation.applied_step == 4
    assert formation.heal == {"source_rank": None, "targets": [early], "checkpoint": None}
    cluster.state.leave(early, cluster.now, applied_step=0)  # JobFinishedError: it leaves cleanly
    late = cluster.spawn()
    assert cluster.ask(late, "join", 0) is None
    formation = cluster.tick()
    assert formation is not None and formation.members == (late,) and formation.applied_step == 4
    assert cluster.state.counts["failures"] == failures == 0 and cluster.state.step == 4


def test_a_lighthouse_restarted_after_the_job_ended_answers_a_late_joiner_at_once_and_counts_no_failure() -> None:
    cluster = SimulatedFleet(PLAN, min_replicas=3)
    cluster.start(3)
    for member, incarnation in zip(cluster.members, INCARNATIONS, strict=False):
        cluster.state.register(member, incarnation, cluster.now)
    cluster.run_steps(4)
    for member in cluster.members:
        cluster.state.leave(member, cluster.now, applied_step=4)
    saved = json.loads(json.dumps(cluster.state.state_dict()))
    state = LighthouseState.from_state_dict(saved, now=0.0, min_replicas=3, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    assert all(state.member_state(member) == "left" for member in cluster.members)
    assert state.tick(10 * HEARTBEAT_TIMEOUT) is None and state.counts["failures"] == 0, "nobody to time out"
    state.connected("late", 10 * HEARTBEAT_TIMEOUT)
    state.request(QuorumRequest("late", 0, None, "join"), 10 * HEARTBEAT_TIMEOUT)
    formation = state.tick(10 * HEARTBEAT_TIMEOUT)
    assert formation is not None and formation.members == ("late",) and formation.applied_step == 4


def test_newcomers_after_a_whole_fleet_failure_still_wait_for_min_replicas() -> None:
    """Only a clean end lifts ``min_replicas``: a fleet that died (a restart resumes from a checkpoint) is not done."""
    cluster = SimulatedFleet(PLAN, min_replicas=3)
    cluster.start(3)
    cluster.run_steps(4)
    for member in cluster.members[:-1]:
        cluster.state.leave(member, cluster.now, applied_step=4)
    cluster.kill(cluster.members[-1])
    newcomer = cluster.spawn()
    cluster.ask(newcomer, "join", 0)
    for _ in range(20):
        cluster.now += 1.0
        cluster.heartbeat()
        assert cluster.tick() is None, "one newcomer of the three min_replicas asks for"


def test_the_broken_quorum_notice_names_at_most_eight_down_members_leader_first_as_they_change() -> None:
    members = tuple(f"m{rank:02d}" for rank in range(20))
    roster = Roster(Quorum(1, members))
    assert roster.down == []
    for member in reversed(members[:12]):
        roster.died(member)
    assert roster.down == list(members[:NAMED_DOWN]), "rank order, capped: the leader m00 first"
    roster.revived("m00")
    assert roster.down == list(members[1 : NAMED_DOWN + 1])
    roster.evict("m00")
    assert roster.down == list(members[:NAMED_DOWN]), "an evicted member no longer counts, alive or not"


class CheckedFleet(SimulatedFleet):
    """Processes that follow the protocol on their own; every formation is checked against the processes that hold
    the job's state: the live members of the current quorum (each adopted the last answer and was healed at once)
    that did not ask to join afresh."""

    def tick(self) -> Formation | None:
        holders = self.holders()
        formation = super().tick()
        if formation is not None and holders:
            assert set(formation.members) & holders, f"quorum {formation.members} left out every holder {holders}"
            assert formation.heal is None or formation.heal["source_rank"] is not None, "the state is never lost"
        return formation


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 5), data=st.data())
def test_a_formed_quorum_always_holds_the_state_while_a_live_member_holds_it(size: int, data) -> None:
    """Random kills (one, several or all members at once, by socket or silence), restarts, slow steps and members
    that ask to join afresh, under any ``min_replicas``: the survivors of a failure form at once whatever their
    number, and no quorum forms without a holder of the state while one lives."""
    min_replicas = data.draw(st.integers(1, size), label="min_replicas")
    fleet = CheckedFleet(PLAN, min_replicas, HEARTBEAT_TIMEOUT, JOIN_TIMEOUT)
    fleet.start(size)
    for _ in range(data.draw(st.integers(1, 12), label="events")):
        event = data.draw(st.sampled_from(["step", "kill", "kill", "restart", "slow", "disclaim"]), label="event")
        members = [m for m in fleet.members if m in fleet.applied]
        if event == "step" and not fleet.state.reconfigure_pending:
            fleet.run_steps(1)
        elif event == "kill" and members and not fleet.state.pending:
            dead = data.draw(st.lists(st.sampled_from(members), min_size=1, unique=True), label="dead")
            how = data.draw(st.sampled_from(["socket", "timeout"]), label="how")
            for member in dead:
                fleet.kill(member, how)
            survivors = [m for m in members if m not in dead]
            formations = len(fleet.formations)
            fleet.run(int(3 * HEARTBEAT_TIMEOUT / 0.25))
            if survivors and not set(survivors) & fleet.disclaimed:
                assert len(fleet.formations) > formations, f"min_replicas={min_replicas}: no quorum for {survivors}"
                failure = fleet.formations[formations]
                assert failure.reason == "failure" and failure.members == tuple(survivors), (
                    f"the survivors of min_replicas={min_replicas} carry on"
                )
        elif event == "restart":
            for _ in range(data.draw(st.integers(1, 2), label="restarted")):
                fleet.spawn()
        elif event == "slow":
            fleet.run(int(3 * JOIN_TIMEOUT / 0.25), members_too=False)
        elif event == "disclaim" and len(members) > 1 and fleet.state.step > 0:  # at step 0 anyone holds it
            member = data.draw(st.sampled_from(members), label="disclaims")
            assert disclaim(fleet, member) is None
            fleet.disclaimed.add(member)
            fleet.run(int(3 * JOIN_TIMEOUT / 0.25), members_too=False)  # while the others train a slow step
        fleet.run(int(3 * JOIN_TIMEOUT / 0.25))


# --- reachability: members cut off from the others are left out, never the majority -----------------------------


def report(
    cluster: SimulatedFleet, member: str, reason: str, unreachable: list[str], last: int | None = None
) -> dict[str, Any] | None:
    """``member`` asks for a quorum, naming the members of its ``last`` quorum (the current one unless given) it
    could not reach."""
    quorum = cluster.state.quorum
    quorum_id = last if last is not None or quorum is None else quorum.quorum_id
    applied = cluster.processes[member].applied
    asked = QuorumRequest(member, applied, quorum_id, reason, unreachable=tuple(unreachable))
    return cluster.state.request(asked, cluster.now)


def wait_for(cluster: SimulatedFleet, seconds: float) -> Formation | None:
    """Let ``seconds`` pass in ticks (live processes heartbeating); the first quorum formed meanwhile, if any."""
    end = cluster.now + seconds
    while cluster.now < end:
        cluster.now += 0.25
        cluster.heartbeat()
        formation = cluster.tick()
        if formation is not None:
            return formation
    return None


def test_an_asymmetric_partition_leaves_out_the_member_cut_off_not_the_majority_that_is_slower_to_tell() -> None:
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    cluster.start(3)
    cluster.run_steps(2)
    w0, w1, w2 = cluster.members
    report(cluster, w2, "failure", [w0, w1])  # its rendezvous failed at once
    assert wait_for(cluster, JOIN_TIMEOUT * 4) is None, "w0 and w1 may still sit in the rendezvous w2 gave up on"
    assert cluster.state.member_state(w0) == "alive" and cluster.state.counts["failures"] == 0
    report(cluster, w0, "failure", [w2])
    assert cluster.tick() is None, "w1 reaches w0 and has not asked: the quorum waits for it"
    report(cluster, w1, "failure", [w2])
    formation = cluster.tick()
    assert formation is not None and formation.members == (w0, w1) and formation.reason == "failure"
    assert cluster.state.quorums[-1]["unreachable"] == [w2]
    assert cluster.state.counts["failures"] == 0, "a member cut off is left out, not failed"
    assert w2 in cluster.state.pending and not cluster.state.reconfigure_pending, (
        "a joiner cut from the quorum calls nobody to a boundary while its cuts last"
    )
    assert [cut["members"] for cut in cluster.state.to_status(cluster.now)["cuts"]] == [[w0, w2], [w1, w2]]


def test_a_peer_partition_reported_by_all_keeps_the_pair_that_reach_each_other() -> None:
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    cluster.start(3)
    cluster.run_steps(1)
    w0, w1, w2 = cluster.members
    report(cluster, w1, "failure", [w0, w2])
    assert cluster.tick() is None, "w0 and w2 reach each other: the quorum waits for them"
    report(cluster, w2, "failure", [w1])
    assert cluster.tick() is None, "w0 reaches w2 and has not asked"
    report(cluster, w0, "failure", [w1])
    formation = cluster.tick()
    assert formation is not None and formation.members == (w0, w2)
    assert formation.heal is None and cluster.state.quorums[-1]["unreachable"] == [w1]


def test_the_members_of_the_best_set_form_without_waiting_for_a_silent_member_cut_off_from_them() -> None:
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    cluster.start(3)
    w0, w1, w2 = cluster.members
    report(cluster, w0, "failure", [w2])
    report(cluster, w1, "failure", [w2])
    formation = cluster.tick()
    assert formation is not None and formation.members == (w0, w1), "w2 is cut from both: nobody waits for it"
    assert cluster.state.counts["failures"] == 0 and cluster.state.quorums[-1]["unreachable"] == [w2]
    assert cluster.state.left_out(w2), "its heartbeat tells it to join again"


def test_a_member_whose_cuts_expire_is_admitted_again_and_cut_longer_when_it_fails_again() -> None:
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    cluster.start(3)
    w0, w1, w2 = cluster.members
    for member, peers in ((w2, [w0, w1]), (w0, [w2]), (w1, [w2])):
        report(cluster, member, "failure", peers)
    assert cluster.tick() is not None
    left_at = cluster.now
    report(cluster, w2, "join", [w0, w1], last=1)  # the excluded member asks again with what its probe found
    while not cluster.state.reconfigure_pending:
        assert wait_for(cluster, 0.25) is None
        assert cluster.now - left_at <= JOIN_TIMEOUT + 0.5, "its cuts last one join timeout the first time"
    assert cluster.now - left_at >= JOIN_TIMEOUT
    assert cluster.state.to_status(cluster.now)["cuts"] == []
    for member in (w0, w1):
        report(cluster, member, "reconfigure", [])
    formation = cluster.tick()
    assert formation is not None and formation.members == (w0, w1, w2) and formation.reason == "boundary"
    # it still cannot reach them: it fails at once and is cut again, twice as long
    report(cluster, w2, "failure", [w0, w1])
    for member in (w0, w1):
        report(cluster, member, "failure", [w2])
    assert cluster.tick() is not None
    assert {cut["strikes"] for cut in cluster.state.to_status(cluster.now)["cuts"]} == {2}
    assert wait_for(cluster, JOIN_TIMEOUT * 1.5) is None and not cluster.state.reconfigure_pending


def test_a_left_out_member_told_to_join_again_is_not_counted_into_a_quorum_by_its_old_ask() -> None:
    """Its long poll ended (408) and its survivor ask stayed; its retry is refused (409): from then on the old ask
    no longer counts it into the quorum its cuts' end calls, which it would never hear of."""
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    cluster.start(3)
    w0, w1, w2 = cluster.members
    for member, peers in ((w2, [w0, w1]), (w0, [w2]), (w1, [w2])):
        report(cluster, member, "failure", peers)
    assert cluster.tick() is not None and w2 in cluster.state.pending
    with pytest.raises(RequestError) as refused:
        report(cluster, w2, "failure", [w0, w1], last=1)
    assert refused.value.status == 409 and w2 not in cluster.state.pending
    assert wait_for(cluster, JOIN_TIMEOUT * 2) is None and not cluster.state.reconfigure_pending
    report(cluster, w2, "join", [], last=1)
    assert cluster.tick() is None and cluster.state.reconfigure_pending, "its join, its cuts ended, calls the boundary"


def test_a_left_out_member_whose_probe_reaches_the_others_again_is_called_back_at_once() -> None:
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    cluster.start(3)
    w0, w1, w2 = cluster.members
    for member, peers in ((w2, [w0, w1]), (w0, [w2]), (w1, [w2])):
        report(cluster, member, "failure", peers)
    assert cluster.tick() is not None and not cluster.state.reconfigure_pending
    assert cluster.state.reached(w2, [w0], cluster.now) == 1 and not cluster.state.reconfigure_pending
    assert cluster.state.reached(w2, [w0, w1], cluster.now) == 1 and cluster.state.reconfigure_pending
    for member in (w0, w1):
        report(cluster, member, "reconfigure", [])
    formation = cluster.tick()
    assert formation is not None and formation.members == (w0, w1, w2) and formation.reason == "boundary"
    with pytest.raises(RequestError) as unknown:
        cluster.state.reached("stranger", [w0], cluster.now)
    assert unknown.value.status == 404


def test_a_member_back_from_the_dead_is_admitted_at_the_next_boundary() -> None:
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    cluster.start(3)
    w0, w1, w2 = cluster.members
    cluster.state.disconnected(w2, cluster.now)  # its link went down
    for member in (w0, w1):
        report(cluster, member, "failure", [w2])
    assert cluster.tick() is not None
    cluster.state.connected(w2, cluster.now)  # and came back
    report(cluster, w2, "join", [w0, w1], last=1)  # what its probe found while its link was down
    assert cluster.state.to_status(cluster.now)["cuts"] == [], "back from the dead, it is cut from nobody"
    assert cluster.state.reconfigure_pending
    for member in (w0, w1):
        report(cluster, member, "reconfigure", [])
    formation = cluster.tick()
    assert formation is not None and set(formation.members) == {w0, w1, w2}


def test_a_cut_off_member_forms_alone_only_once_the_others_stay_silent_past_the_bound() -> None:
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT, unreachable_wait=3.0)
    cluster.start(3)
    w0, w1, w2 = cluster.members
    asked_at = cluster.now
    report(cluster, w2, "failure", [w0, w1])
    formation = wait_for(cluster, JOIN_TIMEOUT + 4.0)
    assert formation is not None and formation.members == (w2,)
    assert cluster.now - asked_at >= JOIN_TIMEOUT + 3.0
    assert {f["member"] for f in cluster.state.failures} == {w0, w1}, "silent past the bound: excluded, as before"


def test_without_reports_nothing_changes_and_unreachable_is_validated() -> None:
    base = {"member": "w0", "applied_step": 0, "reason": "join"}
    for bad in ("w1", ["w1", "w1"], ["w0"], ["a b"], [1], ["w1"] * 5000):
        with pytest.raises(RequestError) as refused:
            QuorumRequest.from_json({**base, "unreachable": bad})
        assert refused.value.status == 400 and refused.value.details["field"] == "unreachable"
        assert "unreachable" in refused.value.message
    request = QuorumRequest.from_json({**base, "unreachable": ["w1", "w2"]})
    assert request.unreachable == ("w1", "w2") and request == QuorumRequest("w0", 0, None, "join")
    assert QuorumRequest.from_json(request.to_body()).unreachable == ("w1", "w2")
    assert "unreachable" not in QuorumRequest("w0", 0, None, "join").to_body()


@settings(max_examples=60, deadline=None)
@given(size=st.integers(3, 7), data=st.data())
def test_whatever_the_order_of_reports_a_cut_off_minority_never_forms_in_place_of_the_majority(size: int, data) -> None:
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    cluster.start(size)
    cluster.run_steps(1)
    members = cluster.members
    cut_off = data.draw(st.lists(st.sampled_from(members), min_size=1, max_size=(size - 1) // 2, unique=True))
    majority = [m for m in members if m not in cut_off]
    order = data.draw(st.permutations(members))
    formed, asked = None, set()
    for member in order:
        report(cluster, member, "failure", majority if member in cut_off else cut_off)
        asked.add(member)
        cluster.now += data.draw(st.sampled_from([0.0, 0.5, JOIN_TIMEOUT]))
        cluster.heartbeat()
        formed = cluster.tick()
        if formed is not None:
            break
    assert formed is not None, "once every member of the majority asked the quorum forms"
    assert formed.members == tuple(majority), "the members that reach one another, in their ranks"
    assert asked >= set(majority), "it formed only once every member of the majority had asked"
    assert cluster.state.counts["failures"] == 0


def test_a_heartbeat_heard_again_keeps_a_live_member_alive_and_nothing_else() -> None:
    cluster = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    cluster.start(2)
    w0, w1 = cluster.members
    before = cluster.state.to_status(cluster.now)
    later = cluster.now + 0.75 * HEARTBEAT_TIMEOUT
    assert cluster.state.heard_again(w0, later)
    assert cluster.state.members[w0].last_seen == later
    after = cluster.state.to_status(later)
    assert after["ledger"] == before["ledger"] and after["quorum"] == before["quorum"]
    assert not cluster.state.heard_again("stranger", later), "unknown: read in full"
    cluster.state.disconnected(w1, later)
    assert cluster.state.member_state(w1) == "dead" and not cluster.state.heard_again(w1, later), "dead: read in full"
    assert cluster.state.member_state(w1) == "dead"
