"""The lighthouse at scale: answers that do not grow with the members, events that walk no member list, one quorum
for a mass failure, saves of what changed, the garbage collector kept quiet, and wire 2 over real HTTP."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import json
import sqlite3
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.coord.client import LighthouseClient, QuorumAnswer, StaleAnswer, StoreAddress
from stalwart.coord.collector import QuietCollector
from stalwart.coord.formation import Formation
from stalwart.coord.history import HISTORY_LIMIT
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.coord.membership import Membership
from stalwart.coord.persist import StateStore
from stalwart.coord.quorum import LighthouseState, QuorumRequest
from stalwart.coord.roster import Quorum
from stalwart.coord.server import Lighthouse, recommended_heartbeat_interval
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.testing.waiting import wait_until

STORE = {"store": {"url": "http://127.0.0.1:1", "key": "k"}}


def fleet(members: int, *, register: bool = False) -> tuple[LighthouseState, list[str], str]:
    """A state whose ``members`` members formed quorum 1 and committed one step; returns it, the names and the
    digest of the ledger after that step."""
    state = LighthouseState(EpochPlan(1 << 30, 8 * members, seed=0), 1, 2.0, 30.0, start_replicas=members)
    names = [f"member-{n:05d}" for n in range(members)]
    for name in names:
        if register:
            state.register(name, uuid.uuid4().hex, 0.0)
        state.ask(QuorumRequest(name, 0, None, "join"), 0.0)
    formation = state.try_form(0.0)
    assert formation is not None and len(formation.members) == members
    ledger = DataLedger.from_state_dict(formation.ledger)
    ledger.commit()
    digest = ledger_digest(ledger.state_dict())
    for name in names:
        state.heartbeat(name, 1, 0.1, digest)
    assert state.step == 1
    return state, names, digest


def held(formation: Formation) -> QuorumAnswer:
    """The answer a member of ``formation`` holds (for decoding the next one's delta)."""
    store = StoreAddress("http://h:1", formation.quorum_id, "k")
    return QuorumAnswer(
        formation.quorum_id, formation.members, 0, len(formation.members), store, 0, None, formation.ledger
    )


def fail(state: LighthouseState, names: list[str], dead: list[str], digest: str) -> Formation:
    """``dead`` close their sockets; the others ask as survivors (wire 2, holding quorum 1); the quorum forms."""
    for name in dead:
        state.disconnected(name, 1.0)
    survivors = [name for name in names if name not in set(dead)]
    formations = []
    for name in survivors:
        state.ask(QuorumRequest(name, 1, 1, "failure", digest, wire=2, known=1), 1.0)
        formations.append(state.try_form(1.0))  # what the server does after every request
    formed = [formation for formation in formations if formation is not None]
    assert len(formed) == 1 and formations[-1] is formed[0], "one quorum, formed by the last survivor's request"
    return formed[0]


@pytest.mark.parametrize("members", [64, 512, 2048])
def test_a_survivors_answer_does_not_grow_with_the_members(members: int) -> None:
    state, names, digest = fleet(members)
    before = state.formation_for(QuorumRequest(names[0], 0, None, "join"))
    assert before is not None
    formation = fail(state, names, [names[members // 2]], digest)
    survivor = names[-1]
    answer = formation.render(survivor, STORE, wire=2, known=1)
    assert len(answer) < 1200, f"{len(answer)} bytes for {members} members"
    whole = json.loads(formation.render(survivor, STORE, wire=1))
    decoded = QuorumAnswer.from_json(json.loads(answer), held(before))
    assert decoded.members == tuple(whole["members"]) and decoded.rank == whole["rank"] == members - 2
    assert decoded.ledger == whole["ledger"], "wire 2 rebuilds the ledger of wire 1"
    assert len(json.dumps(whole)) > 8 * members, "wire 1 carries every member's positions"


def test_answers_share_one_serialisation_per_quorum() -> None:
    state, names, digest = fleet(32)
    formation = fail(state, names, names[:8], digest)
    first, second = (formation.render(name, STORE, wire=2, known=1) for name in names[8:10])
    assert first.split(b",", 2)[2] == second.split(b",", 2)[2], "only the rank and the store differ"
    assert json.loads(first)["delta"] == {"from": 1, "removed": names[:8], "added": []}


class CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts the walks over it."""

    walks = 0

    def __iter__(self) -> Iterator[Any]:
        CountingDict.walks += 1
        return super().__iter__()

    def values(self) -> Any:
        CountingDict.walks += 1
        return super().values()

    def items(self) -> Any:
        CountingDict.walks += 1
        return super().items()


class CountingTuple(tuple):  # type: ignore[type-arg]
    """A tuple that counts the walks over it."""

    walks = 0

    def __iter__(self) -> Iterator[Any]:
        CountingTuple.walks += 1
        return super().__iter__()


def test_heartbeats_requests_and_deaths_walk_no_member_list() -> None:
    state, names, digest = fleet(256)
    quorum = state.quorum
    assert quorum is not None
    state.membership.records = CountingDict(state.membership.records)
    state.roster.quorum = Quorum(quorum.quorum_id, CountingTuple(quorum.members))
    CountingDict.walks = CountingTuple.walks = 0
    for name in names:
        state.heartbeat(name, 1, 0.2, digest)
        assert not state.should_reconfigure(name) and not state.left_out(name) and not state.quorum_broken
    state.disconnected(names[0], 0.3)
    for name in names[1:-1]:
        state.heartbeat(name, 1, 0.4, digest)
        assert state.should_reconfigure(name) and state.reconfigure_pending
        state.ask(QuorumRequest(name, 1, 1, "failure", digest), 0.4)
        assert state.try_form(0.4) is None and not state.should_reconfigure(name), "asking: no reconfigure reply"
    assert (CountingDict.walks, CountingTuple.walks) == (0, 0)
    state.ask(QuorumRequest(names[-1], 1, 1, "failure", digest), 0.5)
    assert state.try_form(0.5) is not None


def test_a_quarter_of_the_members_failing_at_once_forms_one_quorum() -> None:
    state, names, digest = fleet(1024)
    dead = names[::4]
    formation = fail(state, names, dead, digest)
    survivors = [name for name in names if name not in set(dead)]
    assert formation.members == tuple(survivors) and formation.reason == "failure"
    assert state.counts["quorums"] == 2 and state.counts["recoveries"] == len(dead)
    assert formation.delta is not None and formation.delta.removed == tuple(dead)
    positions = sorted(p for share in formation.ledger["in_flight"].values() for p in share)
    assert positions == list(range(8 * 1024, 16 * 1024)), "the step still trains on each of its positions once"


def test_a_member_seen_twice_at_the_same_instant_expires_once() -> None:
    members = Membership(heartbeat_timeout=1.0)
    members.touch("a", 0.0)
    members.touch("a", 0.0)
    members.touch("b", 1.1)  # heard after a's deadline: a is silent, the lighthouse is not cut off
    assert members.expired(1.2) == ["a"]
    members.mark_dead("a")
    members.touch("c", 2.2)
    assert members.expired(2.3) == ["b"] and members.live == 2


def test_silence_while_the_lighthouse_could_not_listen_is_excused() -> None:
    members = Membership(heartbeat_timeout=1.0)
    members.touch("a", 0.0)
    members.excuse(1.5, 0.9)  # the loop was blocked from -0.6 to 0.9
    members.touch("b", 2.4)  # others are heard: the silent one is judged
    assert members.expired(2.4) == [], "1 s timeout plus the 1.5 s the lighthouse was deaf"
    members.touch("c", 2.55)
    assert members.expired(2.6) == ["a"]
    members.touch("c", 3.9)
    assert members.expired(4.0) == ["b"], "the excuse lasts one timeout past the pause"


def test_many_short_pauses_excuse_the_longest_not_their_sum() -> None:
    """A busy machine: the loop comes 0.2 s late every 0.25 s for 2.5 s and hears b meanwhile; a, silent since 0,
    is dead past the timeout plus one pause (their sum, 2 s, would keep it alive)."""
    members = Membership(heartbeat_timeout=1.0)
    members.touch("a", 0.0)
    for tick in range(1, 11):
        now = 0.25 * tick
        members.excuse(0.2, now)
        members.touch("b", now)
        if now <= 1.2:
            assert members.expired(now) == [], now
    assert members.expired(2.5) == ["a"]


def test_dead_members_are_forgotten_oldest_death_first_never_the_quorums() -> None:
    members = Membership(heartbeat_timeout=1.0)
    extra = 5
    names = [f"m{n}" for n in range(HISTORY_LIMIT + extra)]
    for n, name in enumerate(names):
        members.touch(name, float(n))
    for name in reversed(names):  # the last seen die first
        members.mark_dead(name)
    kept = {names[-1]}  # still in the quorum
    forgotten = members.forget_dead(kept)
    assert forgotten == [names[-2], names[-3], names[-4], names[-5]], "the first to die are forgotten first"
    assert names[-1] in members and len(members) == HISTORY_LIMIT + 1


def test_a_save_writes_only_what_changed_and_loads_back(tmp_path: Path) -> None:
    state, names, _ = fleet(64, register=True)
    store = StateStore(tmp_path / "state.db")
    try:
        first = state.changes()
        assert first.formation is not None and set(first.members) == set(names)
        store.save(first, 0.0)
        ledger = DataLedger.from_state_dict(state.ledger_state())
        ledger.begin_step(names)
        ledger.commit()
        state.heartbeat(names[0], 2, 0.3, ledger_digest(ledger.state_dict()))
        committed = state.changes()
        assert committed.formation is None and committed.members == {}, "a commit rewrites the core row only"
        assert committed.core["ledger"]["step"] == 2
        store.save(committed, 0.3)
        state.register("late", uuid.uuid4().hex, 0.4)
        joined = state.changes()
        assert joined.formation is None and list(joined.members) == ["late"]
        store.save(joined, 0.4)
        loaded = store.load()
    finally:
        store.close()
    assert loaded is not None
    expected = json.loads(json.dumps(state.state_dict()))
    expected["members"] = dict.fromkeys(expected["members"])  # applied steps are reported again, not saved
    assert loaded == expected
    restored = LighthouseState.from_state_dict(loaded, now=1.0)
    assert restored.quorum == state.quorum and restored.step == 2
    retried = QuorumRequest(names[1], 0, None, "join")
    assert restored.formation_for(retried) == state.formation_for(retried) is not None


@pytest.mark.parametrize("version", [1, 2])
def test_a_state_file_of_an_older_version_resumes_without_its_last_formation(tmp_path: Path, version: int) -> None:
    state, names, _ = fleet(8, register=True)
    legacy = json.loads(json.dumps(state.state_dict()))
    legacy["version"] = version  # 1: the ledger in full; 2: compact, with the JSON digest of the ledger in its step
    legacy["formation"] = {"ledger": {"no": "longer read"}}
    history = legacy.pop("history")
    legacy["history"] = {key: value for key, value in history.items() if key in ("unrecovered", "counts")}
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as connection:  # the layout before parts and member rows: one row
        connection.execute("CREATE TABLE lighthouse_state (id INTEGER PRIMARY KEY, revision, saved_at, state TEXT)")
        connection.execute("INSERT INTO lighthouse_state VALUES (0, 1, 0.0, ?)", (json.dumps(legacy),))
    store = StateStore(path)
    try:
        loaded = store.load()
    finally:
        store.close()
    assert loaded is not None
    restored = LighthouseState.from_state_dict(loaded, now=1.0)
    assert restored.quorum == state.quorum and restored.step == 1
    assert restored.formation_for(QuorumRequest(names[0], 0, None, "join")) is None
    assert restored.incarnation(names[3]) == state.incarnation(names[3]), "registrations survive"


class Node:
    """Something to build a reference cycle from."""

    partner: Node | None = None


def _frozen_garbage() -> weakref.ref[Node]:
    """A reference cycle, dead and frozen (as if frozen by an earlier collection): only a full collection that
    unfreezes reclaims it."""
    node = Node()
    node.partner = node
    dead = weakref.ref(node)
    del node
    gc.freeze()
    return dead


def test_quiet_collector_pauses_collection_while_busy_and_collects_when_quiet() -> None:
    collector = QuietCollector(delay=1.0, max_busy=10.0)
    try:
        collector.start()
        collector.update(0.0, busy=True, formed=False, gone=0, live=4)
        assert not gc.isenabled(), "no collection while requests wait"
        dead = _frozen_garbage()
        collector.update(0.5, busy=True, formed=True, gone=0, live=4)
        collector.update(1.0, busy=False, formed=False, gone=0, live=4)
        assert gc.isenabled() and dead() is not None, "quiet, but the full collection is not due yet"
        collector.update(1.6, busy=False, formed=False, gone=0, live=4)
        assert dead() is None and gc.get_freeze_count() > 0, "the fleet started: collected while quiet, then frozen"
        dead = _frozen_garbage()
        collector.update(2.0, busy=False, formed=True, gone=0, live=4)
        collector.update(3.1, busy=False, formed=False, gone=0, live=4)
        assert dead() is not None, "the fleet did not change: nothing frozen to reclaim"
        collector.update(3.5, busy=True, formed=True, gone=1, live=3)
        collector.update(4.6, busy=True, formed=False, gone=1, live=3)
        assert dead() is not None, "a member died, but requests wait"
        collector.update(4.7, busy=False, formed=False, gone=1, live=3)
        assert dead() is None, "collected once quiet"
        collector.update(5.0, busy=True, formed=False, gone=1, live=3)
        collector.update(15.5, busy=True, formed=False, gone=1, live=3)
        assert gc.isenabled(), "busy for longer than max_busy: collection resumes"
    finally:
        gc.unfreeze()
        gc.enable()


def test_quiet_collector_collects_once_a_quarter_of_the_fleet_changed() -> None:
    collector = QuietCollector(delay=1.0, max_busy=10.0)
    try:
        collector.start()
        collector.update(0.0, busy=False, formed=True, gone=0, live=400)
        collector.update(1.5, busy=False, formed=False, gone=0, live=400)
        dead = _frozen_garbage()
        collector.update(2.0, busy=False, formed=True, gone=2, live=398)
        collector.update(3.5, busy=False, formed=False, gone=2, live=398)
        assert dead() is not None, "two of 400 members lost: not worth a full collection yet"
        collector.update(4.0, busy=False, formed=True, gone=2, live=497)
        collector.update(5.5, busy=False, formed=False, gone=2, live=497)
        assert dead() is not None, "97 joined: under a quarter of 400"
        collector.update(6.0, busy=False, formed=True, gone=2, live=500)
        collector.update(7.5, busy=False, formed=False, gone=2, live=500)
        assert dead() is None, "100 joined: their state frozen"
        dead = _frozen_garbage()
        collector.update(8.0, busy=False, formed=True, gone=126, live=376)
        collector.update(9.5, busy=False, formed=False, gone=126, live=376)
        assert dead() is None, "124 lost, over a quarter of the 376 alive"
    finally:
        gc.unfreeze()
        gc.enable()


def test_the_recommended_heartbeat_interval_grows_with_the_fleet_up_to_a_quarter_of_the_timeout() -> None:
    assert recommended_heartbeat_interval(819, 2.0) < 0.1 <= recommended_heartbeat_interval(820, 2.0)
    assert recommended_heartbeat_interval(4096, 2.0) == 0.5
    assert recommended_heartbeat_interval(8192, 2.0) == 0.5 and recommended_heartbeat_interval(8192, 8.0) == 1.0


def test_wire_2_over_http_deltas_a_stale_member_and_bad_input(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plan = EpochPlan(400, 12, seed=3)
    with Lighthouse(plan, min_replicas=1, start_replicas=3, join_timeout=5.0, state_path=tmp_path / "s.db") as server:
        clients = {name: LighthouseClient(server.url, name, heartbeat_interval=0.05) for name in ("a", "b", "c")}
        try:
            for client in clients.values():
                client.start_heartbeat(lambda: 0)
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                first = list(pool.map(lambda c: c.quorum(0, None, "join", 20), clients.values()))
            assert {answer.quorum_id for answer in first} == {1}
            registered = json.loads(
                _post(server.url + "/v1/register", {"member": "d", "incarnation": uuid.uuid4().hex})[1]
            )
            assert registered["heartbeat_interval"] == recommended_heartbeat_interval(4, 2.0)  # a, b, c and d
            clients.pop("c").close()
            wait_until(lambda: clients["a"].quorum_broken and clients["b"].quorum_broken, what="the push")
            assert clients["a"].quorum_down == clients["b"].quorum_down == ("c",), "the push names the dead"
            # "b" holds a doctored answer: the delta does not fit it, so it asks again for the whole answer
            clients["b"]._answer = dataclasses.replace(first[1], members=first[1].members[::-1])
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                second = list(pool.map(lambda c: c.quorum(0, 1, "failure", 20), clients.values()))
            assert second[0].members == second[1].members  # one quorum, in the order the requests came
            assert clients["a"].quorum_down == (), "a new quorum forgets whom the last one lost"
            assert sorted(second[0].members) == ["a", "b"]
            assert "b: the ledger rebuilt from the answer does not match its digest" in caplog.text
            assert second[0].ledger == second[1].ledger and second[0].data_ledger().in_step
            headers = clients["a"].identity_headers()
            for known in ("x", -1, 1.5, True):
                body = {"member": "a", "applied_step": 0, "quorum_id": 2, "reason": "reconfigure", "known": known}
                status, text = _post(server.url + "/v1/quorum", body, headers)
                assert status == 400 and "known" in text
            assert _get(server.url + "/healthz") == 200, "it keeps serving"
        finally:
            for client in clients.values():
                client.close()


def test_a_delta_from_a_quorum_the_member_does_not_hold_is_stale() -> None:
    state, names, digest = fleet(16)
    formation = fail(state, names, names[:1], digest)
    data = json.loads(formation.render(names[2], {"store": {"url": "http://h:1", "key": "k"}}, wire=2, known=1))
    with pytest.raises(StaleAnswer):
        QuorumAnswer.from_json(data, None)
    whole = json.loads(formation.render(names[2], {"store": {"url": "http://h:1", "key": "k"}}, wire=2))
    assert QuorumAnswer.from_json(whole).ledger == formation.ledger
    with pytest.raises(ValueError, match="malformed"):
        QuorumAnswer.from_json({**whole, "ledger": {**whole["ledger"], "base": {"version": 99}}})


def _post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as response:
        return int(response.status)
