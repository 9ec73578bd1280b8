"""The lighthouse's persistence follows its changes: after every operation, what SQLite holds is the live state.

No mutation marks itself as changed (``stalwart.coord.tracked``): random
sequences of every kind of operation, with restarts from the file at random
points, check that nothing a change made is left out of the save.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.coord.history import HISTORY_LIMIT
from stalwart.coord.persist import StateStore
from stalwart.coord.protocol import ledger_digest
from stalwart.coord.quorum import LighthouseState, QuorumRequest, RequestError
from stalwart.coord.tracked import Tracked, TrackedDict
from stalwart.data.plan import EpochPlan
from stalwart.testing.fleet import SimulatedFleet, SimulatedMember

PLAN = EpochPlan(96, 8, seed=1)
HEARTBEAT_TIMEOUT = 1.0
JOIN_TIMEOUT = 2.0
OPERATIONS = (
    "spawn",
    "spawn",
    "steps",
    "steps",
    "protocol",
    "protocol",
    "kill",
    "silence",
    "leave",
    "replace",
    "checkpoint",
    "ahead-dies",
    "fleet-dies",
    "restart",
)


def persisted(state: LighthouseState) -> dict[str, Any]:
    """What the file must hold of ``state``: its state dict (applied steps are reported again, not saved)."""
    expected = json.loads(json.dumps(state.state_dict()))
    expected["members"] = dict.fromkeys(expected["members"])
    return expected


class Run:
    """A simulated fleet whose lighthouse saves after every operation, as the server does, and may restart."""

    def __init__(self, folder: Path, ahead_settle: float | None = None) -> None:
        self.path = folder / "state.db"
        self.ahead_settle = ahead_settle
        self.fleet = SimulatedFleet(
            PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT, ahead_settle=ahead_settle
        )
        self.store = StateStore(self.path, synchronous="NORMAL")
        self.secrets: dict[str, tuple[str, str]] = {}
        self.checkpoints = 0

    @property
    def state(self) -> LighthouseState:
        return self.fleet.state

    def save(self) -> None:
        if self.state.unsaved:
            self.store.save(self.state.changes(), self.fleet.now)
        assert not self.state.unsaved, "a save takes every change"

    def register(self, member: str) -> None:
        incarnation = uuid.uuid4().hex
        current = self.secrets.get(member)
        self.secrets[member] = (incarnation, self.state.register(member, incarnation, self.fleet.now, current=current))

    def act(self, operation: str, data: st.DataObject) -> None:
        fleet = self.fleet
        live = sorted(fleet.processes)
        if operation == "spawn":
            member = fleet.spawn()
            self.register(member)
        elif operation == "steps":
            fleet.run_steps(data.draw(st.integers(1, 3), label="steps"))
        elif operation == "protocol":
            fleet.run(data.draw(st.integers(1, 6), label="rounds"))
        elif operation == "kill" and live:
            how = data.draw(st.sampled_from(["socket", "timeout"]), label="how")
            fleet.kill(data.draw(st.sampled_from(live), label="killed"), how)
        elif operation == "silence":
            fleet.now += HEARTBEAT_TIMEOUT * 1.5
            fleet.tick()
        elif operation == "leave" and live:
            member = data.draw(st.sampled_from(live), label="leaving")
            self.state.leave(member, fleet.now, fleet.processes.pop(member).applied)
        elif operation == "replace" and self.secrets:
            member = data.draw(st.sampled_from(sorted(self.secrets)), label="replaced")
            self.register(member)  # a restarted process of the member: the old incarnation is retired
            fleet.processes[member] = SimulatedMember(0)
            fleet.disclaimed.add(member)  # it joins afresh
        elif operation == "checkpoint" and fleet.members:
            self.checkpoint()
        elif operation == "ahead-dies" and len([m for m in fleet.members if m in fleet.processes]) > 1:
            member = next(m for m in fleet.members if m in fleet.processes)
            fleet.finish(member)
            fleet.heartbeat([member])  # the step commits, then its only holder dies: the others roll it back
            fleet.kill(member)
        elif operation == "fleet-dies":
            if fleet.members:
                self.checkpoint()
            for member in live:
                fleet.kill(member)
            for member in [fleet.spawn() for _ in range(data.draw(st.integers(1, 3), label="new fleet"))]:
                self.register(member)  # a new fleet: it resumes from the checkpoint
        elif operation == "restart":
            self.restart()
        fleet.now += 0.05

    def checkpoint(self) -> None:
        ledger = self.state.state_dict()["ledger"]
        self.checkpoints += 1
        body = {
            "member": self.fleet.members[0],
            "step": ledger["step"],
            "path": f"/checkpoints/{self.checkpoints}",
            "ledger": ledger,
            "digest": ledger_digest(ledger),
        }
        with contextlib.suppress(RequestError):  # not the writer now, or not newer: refused, nothing changes
            self.state.record_checkpoint(body, self.fleet.now)

    def restart(self) -> None:
        """The lighthouse is killed after its last save and restarted on its file."""
        self.store.close()
        self.store = StateStore(self.path, synchronous="NORMAL")
        loaded = self.store.load()
        assert loaded is not None
        self.fleet.state = LighthouseState.from_state_dict(
            loaded,
            now=self.fleet.now,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            join_timeout=JOIN_TIMEOUT,
            on_commit=self.state.on_commit,
            ahead_settle=self.ahead_settle,
        )


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_the_saved_state_equals_the_live_state_after_every_operation(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as folder:
        ahead = data.draw(st.sampled_from([None, 0.01]), label="ahead_settle")  # confirmations: a row each
        run = Run(Path(folder), ahead)
        try:
            for member in [run.fleet.spawn() for _ in range(data.draw(st.integers(1, 3), label="fleet"))]:
                run.register(member)
                run.fleet.ask(member, "join")
            run.fleet.tick()
            run.save()
            for _ in range(data.draw(st.integers(5, 30), label="operations")):
                operation = data.draw(st.sampled_from(OPERATIONS), label="operation")
                with contextlib.suppress(RequestError):  # a simulated member out of date: refused, nothing changes
                    run.act(operation, data)
                run.save()
                loaded = run.store.load()
                assert loaded == persisted(run.state), f"after {operation}"
                restored = LighthouseState.from_state_dict(loaded, now=run.fleet.now)
                assert persisted(restored) == loaded, f"the file resumes the state after {operation}"
        finally:
            run.store.close()


class Part(Tracked):
    UNTRACKED = frozenset({"cache"})

    def __init__(self) -> None:
        self.value = 0
        self.table: dict[str, int] = {}
        self.cache: list[int] = []


def test_every_change_of_a_tracked_part_stamps_it_and_nothing_else_does() -> None:
    part = Part()
    assert part.stamp == 0 and isinstance(part.table, TrackedDict), "construction is no change; a dict is tracked"
    stamps = [part.stamp]
    for change in (
        lambda: setattr(part, "value", 1),
        lambda: part.table.__setitem__("a", 1),
        lambda: part.table.setdefault("b", 2),
        lambda: part.table.update(c=3),
        lambda: part.table.pop("a"),
        lambda: part.table.__delitem__("b"),
        lambda: part.table.popitem(),
        lambda: part.table.__ior__({"d": 4}),
        lambda: part.table.clear(),
        lambda: setattr(part, "table", {"e": 5}),
        lambda: part.table.__setitem__("e", 6),  # the new dict is tracked too
    ):
        change()
        assert part.stamp > stamps[-1]
        stamps.append(part.stamp)
    for no_change in (
        lambda: part.table.pop("absent", None),
        lambda: part.table.setdefault("e", 0),
        lambda: part.cache.append(1),
        lambda: setattr(part, "cache", [2]),
    ):
        no_change()
        assert part.stamp == stamps[-1]


def test_a_persisted_list_is_refused_naming_the_attribute() -> None:
    part = Part()
    with pytest.raises(TypeError, match=r"Part\.items is persisted: a list"):
        part.items = [1]  # type: ignore[attr-defined]


def test_a_keyed_dict_names_the_keys_that_changed() -> None:
    rows: TrackedDict[str, int] = TrackedDict({"a": 1, "b": 2}, keys=True)
    assert rows.take_keys() == set(), "what it was built with is no change"
    rows["c"] = 3
    del rows["a"]
    rows.pop("b")
    assert rows.take_keys() == {"a", "b", "c"} and rows.take_keys() == set()


def test_members_forgotten_as_long_dead_lose_their_rows(tmp_path: Path) -> None:
    state = LighthouseState(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    store = StateStore(tmp_path / "state.db", synchronous="NORMAL")
    try:
        names = [f"m{n}" for n in range(HISTORY_LIMIT + 3)]
        for n, name in enumerate(names):
            state.register(name, uuid.uuid4().hex, float(n))
            state.disconnected(name, float(n))
        store.save(state.changes(), 0.0)
        state.tick(float(len(names)))
        assert [name for name in names if name not in state.members] == names[:3], "the first to die go first"
        assert state.unsaved
        store.save(state.changes(), 1.0)
        loaded = store.load()
    finally:
        store.close()
    assert loaded == persisted(state)
    assert not {"m0", "m1", "m2"} & set(loaded["members"]) and "m3" in loaded["identities"]["current"]


def test_changes_that_could_not_be_saved_come_back_with_the_next_ones() -> None:
    fleet = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT)
    fleet.start(2)
    state = fleet.state
    state.changes()
    fleet.kill("w1")  # its answered request is withdrawn and the history changes
    joiner = fleet.spawn()
    failed = state.changes()
    assert failed.answered == {"w1": None} and set(failed.members) == {joiner} and failed.events
    state.requeue(failed)
    assert state.unsaved
    again = state.changes()
    assert again.answered == {"w1": None} and set(again.members) == {joiner}
    state.requeue(again)
    fleet.run_steps(1)
    retried = state.changes()
    assert retried.answered == {"w1": None} and set(retried.members) == {joiner}
    assert retried.events[: len(failed.events)] == failed.events
    assert not state.unsaved and state.changes().formation is None


def test_each_save_of_a_quorum_formed_ahead_writes_only_the_answers_confirmed_since(tmp_path: Path) -> None:
    fleet = SimulatedFleet(PLAN, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=JOIN_TIMEOUT, ahead_settle=0.01)
    fleet.start(6)
    fleet.run_steps(2)
    state = fleet.state
    store = StateStore(tmp_path / "state.db", synchronous="NORMAL")
    try:
        store.save(state.changes(), fleet.now)
        dead, *survivors = fleet.members
        fleet.kill(dead)
        fleet.now += 0.02
        formation = state.tick(fleet.now)
        assert formation is not None and formation.ahead is not None and dict(state.answered) == {}
        formed = state.changes()
        assert formed.formation is not None and formed.every_answer and formed.answered == {}
        store.save(formed, fleet.now)
        for member in survivors:
            process = fleet.processes[member]
            request = QuorumRequest(member, process.applied, 1, "failure", process.digest, process.weights)
            assert state.request(request, fleet.now) is not None
            confirmed = state.changes()
            assert confirmed.formation is None and not confirmed.every_answer
            assert confirmed.answered == {member: request.to_json()}, "one row per confirmation, not every answer"
            store.save(confirmed, fleet.now)
        loaded = store.load()
    finally:
        store.close()
    assert loaded == persisted(state) and set(loaded["answered"]) == set(survivors)
