"""LighthouseClient against a real embedded lighthouse: long-poll retries, errors, the reconfigure flag, reconnects."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from stalwart.coord.client import HealPlan, LighthouseClient, LighthouseError, LighthouseUnreachable, QuorumAnswer
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.testing.reports import remember, report
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(64, 8, seed=2)


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    server = Lighthouse(PLAN, min_replicas=2, heartbeat_timeout=1.0, join_timeout=0.3)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def clients(lighthouse: Lighthouse) -> Iterator[dict[str, LighthouseClient]]:
    made = {m: LighthouseClient(lighthouse.url, m, heartbeat_interval=0.05) for m in ("a", "b", "c")}
    yield made
    for client in made.values():
        client.close()


def test_quorum_retries_408s_until_enough_members_join(
    lighthouse: Lighthouse, clients: dict[str, LighthouseClient]
) -> None:
    first, second = clients["a"], clients["b"]
    first.start_heartbeat(lambda: 0)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(first.quorum, 0, None, "join", 20)
        time.sleep(1.0)
        assert not waiting.done(), "min_replicas=2: one member alone waits, across several 408s"
        second.start_heartbeat(lambda: 0)
        answer = second.quorum(0, None, "join", 20)
        assert waiting.result(timeout=20) == QuorumAnswer(
            quorum_id=1,
            members=("a", "b"),
            rank=0,
            world_size=2,
            store=answer.store,
            applied_step=0,
            heal=HealPlan(source_rank=0, targets=("b",)),
            ledger=answer.ledger,
        )
    assert answer.rank == 1 and answer.member == "b"


def test_quorum_times_out_when_nothing_forms_naming_the_setting(clients: dict[str, LighthouseClient]) -> None:
    """min_replicas=2 and one member: the lighthouse keeps it waiting (408 after 408); it gives up at its timeout,
    not before, with a message naming the Manager's setting and its environment variable."""
    clients["a"].start_heartbeat(lambda: 0)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as timed_out:
        clients["a"].quorum(0, None, "join", 1.5)
    assert time.monotonic() - started >= 1.5, "it waited out its whole timeout, across several long polls"
    message = str(timed_out.value)
    assert "no quorum formed for 'a' within 1.5 s" in message
    assert "quorum_timeout" in message and "STALWART_QUORUM_TIMEOUT" in message


def test_an_unreachable_lighthouse_names_connect_timeout() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with LighthouseClient(url, "a") as client, pytest.raises(LighthouseUnreachable) as unreachable:
        client.wait_reachable(0.5)
    message = str(unreachable.value)
    assert url in message and "gave up after 0.5 s" in message
    assert "connect_timeout" in message and "STALWART_CONNECT_TIMEOUT" in message


def test_a_quorum_wait_outlasts_a_lighthouse_restart(tmp_path: Path) -> None:
    """A member waiting for the quorum while the lighthouse restarts (503 at shutdown, refused connections, then
    a lighthouse that knows it from its state) gets the quorum when the second member comes, not an error."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options: dict[str, Any] = {"port": port, "state_path": tmp_path / "state.db", "min_replicas": 2}
    server = Lighthouse(PLAN, join_timeout=0.3, **options)
    server.start()
    with (
        LighthouseClient(server.url, "a", heartbeat_interval=0.05) as first,
        LighthouseClient(server.url, "b", heartbeat_interval=0.05) as second,
        ThreadPoolExecutor(1) as pool,
    ):
        try:
            first.start_heartbeat(lambda: 0)
            waiting = pool.submit(first.quorum, 0, None, "join", 120)
            asking = [{"member": "a", "asking": "join"}]
            wait_until(
                lambda: [{k: m[k] for k in ("member", "asking")} for m in server.status()["members"]] == asking,
                what="a to ask",
            )
        finally:
            server.stop()
        with Lighthouse(PLAN, join_timeout=0.3, **options) as restarted:
            assert not waiting.done()
            second.start_heartbeat(lambda: 0)
            answer = second.quorum(0, None, "join", 120)
            assert sorted(waiting.result(timeout=120).members) == sorted(answer.members) == ["a", "b"]
            assert restarted.status()["failures"] == []


def test_refused_requests_raise_lighthouse_error_with_the_body(clients: dict[str, LighthouseClient]) -> None:
    for client in clients.values():
        client.start_heartbeat(lambda: 0)
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda c: c.quorum(0, None, "join", 20), clients.values()))
    assert {answer.quorum_id for answer in answers} == {1}
    with pytest.raises(LighthouseError) as refused:
        clients["a"].quorum(0, 7, "failure", 5)
    assert refused.value.status == 409 and refused.value.body["quorum_id"] == 1
    assert "7" in refused.value.body["error"]
    with pytest.raises(ValueError, match="reason"):
        clients["a"].quorum(0, 1, "panic", 5)
    with pytest.raises(ValueError, match="quorum_id"):
        clients["a"].quorum(0, None, "failure", 5)


def test_reconfigure_flag_is_set_by_a_push_and_cleared_by_the_next_quorum(
    lighthouse: Lighthouse, clients: dict[str, LighthouseClient]
) -> None:
    a, b, c = clients["a"], clients["b"], clients["c"]
    a.start_heartbeat(lambda: 0)
    b.start_heartbeat(lambda: 0)
    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(lambda client: client.quorum(0, None, "join", 20), (a, b)))
    time.sleep(0.3)
    assert not a.reconfigure_requested and not b.reconfigure_requested
    c.start_heartbeat(lambda: 0)
    with ThreadPoolExecutor(3) as pool:
        joined = pool.submit(c.quorum, 0, None, "join", 20)
        wait_until(lambda: a.reconfigure_requested and b.reconfigure_requested, what="reconfigure pushes")
        answers = list(pool.map(lambda client: client.quorum(0, 1, "reconfigure", 20), (a, b)))
        assert joined.result(timeout=20).members == (*first[0].members, "c")
    assert [answer.quorum_id for answer in answers] == [2, 2]
    assert not a.reconfigure_requested and not b.reconfigure_requested
    time.sleep(0.3)
    assert not a.reconfigure_requested, "nothing is pending once the joiner is in"


def test_a_waiting_joiner_is_pushed_to_the_quorum_not_left_for_its_next_heartbeat() -> None:
    """The members heartbeat once a minute: only a push tells them of the joiner before their next beat."""
    with (
        Lighthouse(PLAN, min_replicas=1, heartbeat_timeout=300.0, join_timeout=30.0) as server,
        LighthouseClient(server.url, "a", heartbeat_interval=60.0) as member,
        LighthouseClient(server.url, "b") as joiner,
    ):
        member.start_heartbeat(lambda: 0)
        assert member.quorum(0, None, "join", 20).members == ("a",)
        joiner.start_heartbeat(lambda: 0)
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(joiner.quorum, 0, None, "join", 30)
            wait_until(lambda: member.reconfigure_requested, timeout=30.0, what="the joiner's push")
            assert member.quorum(0, 1, "reconfigure", 20).members == ("a", "b")
            assert joined.result(timeout=30).quorum_id == 2


def test_heartbeat_reconnects_after_the_lighthouse_restarts(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    state = tmp_path / "state.db"
    options: dict[str, Any] = {"port": port, "state_path": state, "heartbeat_timeout": 2.0, "join_timeout": 0.5}
    applied = {"a": 0}
    server = Lighthouse(PLAN, **options)
    server.start()
    with LighthouseClient(server.url, "a", heartbeat_interval=0.05) as client:
        try:
            client.start_heartbeat(lambda: report("a", applied["a"]))
            assert remember(client.quorum(0, None, "join", 20)).quorum_id == 1
            applied["a"] = 2
            wait_until(lambda: server.status()["ledger"]["step"] == 2, what="step 2")
        finally:
            server.stop()
        wait_until(lambda: not client.heartbeat_connected.is_set(), what="the socket to drop")
        applied["a"] = 4
        with Lighthouse(PLAN, **options) as restarted:
            wait_until(client.heartbeat_connected.is_set, what="the heartbeat to reconnect")
            wait_until(lambda: restarted.status()["ledger"]["step"] == 4, what="the restarted ledger to catch up")
            status = restarted.status()
            assert status["quorum"]["quorum_id"] == 1 and status["members"][0]["connected"]
            assert client.quorum(4, 1, "reconfigure", 20).quorum_id == 2


def test_a_restarted_lighthouse_refuses_a_different_plan(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    with Lighthouse(PLAN, state_path=state):
        pass
    with pytest.raises(ValueError, match="global_batch_size=16 \\(persisted 8\\)"):
        Lighthouse(EpochPlan(64, 16, seed=2), state_path=state)


def test_close_is_idempotent_and_later_calls_fail(lighthouse: Lighthouse) -> None:
    client = LighthouseClient(lighthouse.url, "z")
    client.start_heartbeat(lambda: 0)
    wait_until(client.heartbeat_connected.is_set, what="the heartbeat")
    client.close()
    client.close()
    wait_until(lambda: lighthouse.status()["members"][0]["state"] == "dead", what="a closed socket to count as dead")
    with pytest.raises(RuntimeError, match="closed"):
        client.status()


def _beat_times(client: LighthouseClient, beats: int) -> list[float]:
    """When ``client``'s first ``beats`` heartbeats were built (its report is read once per heartbeat)."""
    times: list[float] = []
    client.start_heartbeat(lambda: times.append(time.monotonic()) or 0)
    wait_until(lambda: len(times) >= beats, timeout=30.0, what=f"{beats} heartbeats")
    return times[:beats]


def test_the_default_heartbeat_is_a_quarter_of_the_lighthouse_timeout(lighthouse: Lighthouse) -> None:
    """The beats follow the lighthouse's timeout (1 s here: every 0.25 s), never faster; an explicit interval is
    kept. A load can only spread the beats, so only their least gap is asserted."""
    with (
        LighthouseClient(lighthouse.url, "x") as default,
        LighthouseClient(lighthouse.url, "y", heartbeat_interval=0.05) as given,
    ):
        assert default.heartbeat_interval is None
        times = _beat_times(default, 4)
        assert default.registration.heartbeat_timeout == 1.0
        assert default.effective_heartbeat_interval == 0.25
        assert min(later - earlier for earlier, later in itertools.pairwise(times)) >= 0.24
        _beat_times(given, 3)
        assert given.effective_heartbeat_interval == 0.05
        assert default.retry_cap == 0.1, "a slow default heartbeat does not slow the retries"
        assert given.retry_cap == 0.05


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": "ftp://x", "member": "a"}, "url"),
        ({"url": "http://x", "member": "a b"}, "member"),
        ({"url": "http://x", "member": "a", "heartbeat_interval": 0}, "heartbeat_interval"),
        ({"url": "http://x", "member": "a", "token": ""}, "token"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LighthouseClient(**kwargs)


def test_malformed_answers_are_refused() -> None:
    with pytest.raises(ValueError, match="malformed"):
        QuorumAnswer.from_json({"quorum_id": 1})
    good = {
        "quorum_id": 1,
        "members": ["a"],
        "rank": 3,
        "world_size": 1,
        "store": {"url": "http://h:1", "quorum_id": 1, "key": "k"},
        "applied_step": 0,
        "heal": None,
        "ledger": {},
    }
    with pytest.raises(ValueError, match="rank 3"):
        QuorumAnswer.from_json(good)
