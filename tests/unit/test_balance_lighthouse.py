"""A balanced ledger at the lighthouse: reports carry the weights, digests match its replay, failures split by them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.coord.quorum import Formation, LighthouseState, QuorumRequest, RequestError, parse_weights
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.testing.fleet import SimulatedFleet

PLAN = EpochPlan(480, 12, seed=1, local_batch_multiple=2)
EVERY = 3


class Member:
    """A simulated member: adopts the quorum's ledger, runs steps, reweighs where the runtime would."""

    def __init__(self, state: LighthouseState, name: str) -> None:
        self.state, self.name = state, name
        self.ledger: DataLedger | None = None
        state.connected(name, 0.0)

    def ask(self, reason: str, applied_step: int = 0) -> None:
        quorum = self.state.quorum
        quorum_id = None if reason == "join" or quorum is None else quorum.quorum_id
        request = QuorumRequest(self.name, applied_step, quorum_id, reason, *self.reported(applied_step))
        self.state.request(request, 0.0)

    def adopt(self, formation: Formation) -> None:
        self.ledger = DataLedger.from_state_dict(formation.ledger)

    def run(self, steps: int, weights: dict[int, dict[str, int]]) -> None:
        """Run ``steps`` steps with the quorum; after committing step s, reweigh with ``weights[s]`` if given."""
        assert self.ledger is not None and self.state.quorum is not None
        for _ in range(steps):
            if not self.ledger.in_step:
                self.ledger.begin_step(list(self.state.quorum.members))
            self.ledger.commit()
            if self.ledger.step in weights:
                self.ledger.reweigh(weights[self.ledger.step])

    def reported(self, step: int) -> tuple[str | None, dict[str, Any] | None]:
        if self.ledger is None or self.ledger.step != step or self.ledger.in_step:
            return None, None
        return ledger_digest(self.ledger.state_dict()), self.ledger.weights_record()

    def heartbeat(self) -> None:
        assert self.ledger is not None
        self.state.heartbeat(self.name, self.ledger.step, 0.0, *self.reported(self.ledger.step))


def start(names: list[str]) -> tuple[LighthouseState, list[Member]]:
    state = LighthouseState(PLAN, min_replicas=1, start_replicas=len(names), require_digest=True, balance_every=EVERY)
    members = [Member(state, name) for name in names]
    for member in members:
        member.ask("join")
    formation = state.tick(0.0)
    assert formation is not None
    for member in members:
        member.adopt(formation)
    return state, members


def test_reports_carry_the_weights_and_the_lighthouse_replays_them() -> None:
    state, (a, b) = start(["a", "b"])
    changes = {3: {"a": 4, "b": 2}, 6: {"a": 5, "b": 1}}
    for member in (a, b):
        member.run(4, changes)
    a.heartbeat()  # commits 4 steps across the change at step 3
    assert state.step == 4 and state.to_status()["ledger"]["balance"] == {"every": 3, "step": 3, "weights": changes[3]}
    assert state.ledger_state() == a.ledger.state_dict()  # type: ignore[union-attr]
    for member in (a, b):
        member.run(4, changes)
    b.heartbeat()
    assert state.step == 8 and state.ledger_state() == b.ledger.state_dict()  # type: ignore[union-attr]
    # which digests the hosted ledger keeps is the invariant under test
    assert set(state.hosted.digests) >= {3, 4, 6, 7, 8}, "steps whose weights are known keep their digests"


def test_a_report_whose_weights_differ_from_the_replay_commits_nothing() -> None:
    state, (a, _) = start(["a", "b"])
    a.run(3, {3: {"a": 4, "b": 2}})
    digest, weights = a.reported(3)
    assert weights is not None
    before = state.state_dict()
    with pytest.raises(RequestError, match="does not match") as refused:
        state.heartbeat("a", 3, 0.0, digest, {"step": 3, "weights": {"a": 3, "b": 3}})
    assert refused.value.status == 422 and state.state_dict() == before
    with pytest.raises(RequestError, match="does not match"):
        state.heartbeat("a", 3, 0.0, digest, None)  # the weights left out: the replay keeps the old ones
    state.heartbeat("a", 3, 0.0, digest, weights)
    assert state.step == 3


def test_two_changes_between_reports_forget_the_digests_whose_weights_are_unknown() -> None:
    state, (a, _) = start(["a", "b"])
    a.run(7, {3: {"a": 4, "b": 2}, 6: {"a": 2, "b": 4}})
    a.heartbeat()
    assert state.step == 7 and state.ledger_state() == a.ledger.state_dict()  # type: ignore[union-attr]
    digests = state.hosted.digests
    assert 0 in digests and {6, 7} <= set(digests) and not {1, 2, 3, 4, 5} & set(digests)


def test_a_failure_reassigns_by_weight_on_every_member_and_at_the_lighthouse() -> None:
    state, (a, b, c) = start(["a", "b", "c"])
    for member in (a, b, c):
        member.run(3, {3: {"a": 3, "b": 2, "c": 1}})
    shares = {m: s.size for m, s in a.ledger.begin_step(["a", "b", "c"]).items()}  # type: ignore[union-attr]
    assert shares == {"a": 6, "b": 4, "c": 2}
    a.ledger.commit()  # type: ignore[union-attr]
    a.ledger = DataLedger.from_state_dict(b.ledger.state_dict())  # type: ignore[union-attr]
    state.disconnected("a", 0.0)  # a dies in step 3; b and c ask with failure
    for member in (b, c):
        member.ask("failure", 3)
    formation = state.tick(0.0)
    assert formation is not None and formation.members == ("b", "c")
    in_flight = {m: len(p) for m, p in formation.ledger["in_flight"].items()}
    assert in_flight == {"b": 8, "c": 4}, "a's 6 positions go 4 to b (weight 2) and 2 to c (weight 1)"
    ledger = DataLedger.from_state_dict(formation.ledger)
    ledger.commit()
    state.heartbeat("b", 4, 0.0, ledger_digest(ledger.state_dict()), ledger.weights_record())
    assert state.step == 4


def test_a_persisted_balanced_state_resumes_balanced() -> None:
    state, (a, _) = start(["a", "b"])
    a.run(3, {3: {"a": 4, "b": 2}})
    a.heartbeat()
    restored = LighthouseState.from_state_dict(state.state_dict(), now=0.0)
    assert restored.balance_every == EVERY and restored.ledger_state() == state.ledger_state()


def test_weights_on_the_wire_are_checked() -> None:
    assert parse_weights(None) is None
    assert parse_weights({"step": 2, "weights": {"a": 3}}) == {"step": 2, "weights": {"a": 3}}
    for bad, match in (
        ({"step": 2}, "weights must be"),
        ({"step": -1, "weights": {}}, r"weights\['step'\] must be an int in \[0, 2\*\*62\], got -1"),
        ({"step": 1, "weights": {"a": 0}}, r"weights\['weights'\]\['a'\] must be an int in \[1, 2\*\*62\], got 0"),
        ({"step": 1, "weights": {"a b": 1}}, r"weights\['weights'\] must be 1-128 characters"),
    ):
        with pytest.raises(RequestError, match=match) as refused:
            parse_weights(bad)
        assert refused.value.status == 400
    with pytest.raises(ValueError, match=r"balance_every must be in \[0, inf\], got -1"):
        LighthouseState(PLAN, balance_every=-1)


@settings(max_examples=60, deadline=None)
@given(plan=st.builds(
    lambda size, batch, multiple: EpochPlan(max(size, batch), batch, local_batch_multiple=min(multiple, batch)),
    st.integers(8, 160), st.integers(4, 24), st.integers(1, 4),
), data=st.data())  # fmt: skip
def test_random_failures_joins_and_re_weighings_keep_the_lighthouse_in_step_exactly_once(
    plan: EpochPlan, data: st.DataObject
) -> None:
    fleet = SimulatedFleet(plan, 1, 1.0, 2.0, replay_ledgers=True, require_digest=True, balance_every=EVERY)

    def finish(member: str, weights: dict[str, int]) -> None:
        fleet.finish(member, weights, reweigh_every=EVERY)
        if data.draw(st.integers(0, 3), label="reports now") == 0:
            fleet.heartbeat([member])

    names = [fleet.spawn() for _ in range(data.draw(st.integers(1, 4), label="initial members"))]
    for name in names:
        fleet.ask(name, "join")
    fleet.settle()
    for _ in range(300):
        if fleet.state.step and (fleet.state.to_status()["ledger"]["epoch"] > 0 or fleet.state.step > 40):
            break
        fleet.begin()
        members = fleet.members
        chosen = data.draw(st.lists(st.sampled_from(members), unique=True), label="weighed")
        weights = {member: data.draw(st.integers(1, 9), label="weight") for member in chosen}
        event = data.draw(st.sampled_from(["step", "step", "fail", "join"]), label="event")
        if event == "fail" and len(members) > 1:
            in_step = {m: fleet.processes[m].ledger.in_flight for m in members}  # type: ignore[union-attr]
            finished = data.draw(st.lists(st.sampled_from(members), unique=True), label="finished")
            for member in finished:
                finish(member, weights)
            dead = data.draw(
                st.lists(st.sampled_from(members), min_size=1, max_size=len(members) - 1, unique=True), label="dead"
            )
            for member in dead:
                fleet.kill(member, data.draw(st.sampled_from(["socket", "timeout"]), label="how"))
            survivors = [m for m in members if m not in dead]
            for member in survivors:
                fleet.ask(member, "failure")
            formation = fleet.settle()
            if not set(finished) & set(survivors):  # the step is still in progress: survivors keep their work
                for member in survivors:
                    kept = set(in_step[member][member].tolist())
                    assert kept <= set(formation.ledger["in_flight"][member]), "the replay split by the weights"
            continue
        if event == "join":
            fleet.ask(fleet.spawn(), "join")
        for member in members:
            finish(member, weights)
        if fleet.state.reconfigure_pending:
            for member in fleet.members:
                fleet.ask(member, "reconfigure")
            fleet.settle()
    fleet.heartbeat()
    assert fleet.state.step == max(fleet.applied.values())
    for member in fleet.members:
        ledger = fleet.processes[member].ledger
        assert ledger is not None
        assert fleet.state.ledger_state() == ledger.state_dict(), "the lighthouse holds the members' ledger"
    committed = sorted(p for step, (epoch, positions) in fleet.log.items() if epoch == 0 for p in positions)
    assert len(committed) == len(set(committed)), "no position of the epoch committed twice"
    if fleet.state.to_status()["ledger"]["epoch"] > 0:
        assert committed == list(range(plan.epoch_length)), "every position of the epoch committed once"
