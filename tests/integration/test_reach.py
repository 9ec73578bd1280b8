"""Reachability: a rendezvous that ends at its deadline naming who never came, the peer probe, and the members a
failure could not reach reported to a real lighthouse with the next quorum request.

The rendezvous and the sessions run their ranks on threads of this process
(real Gloo groups over loopback sockets, a real lighthouse); the bounds are
liveness bounds several times the timeouts, never expectations.
"""

from __future__ import annotations

import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.runtime.comm import CollectiveError, Communicator, Failure
from stalwart.runtime.config import ReplicaGroup, Transport
from stalwart.runtime.diagnosis import Verdict
from stalwart.runtime.peers import REPLICATED
from stalwart.runtime.probe import MAX_PAYLOAD, MAX_PROBE_BYTES, MIN_WINDOW, LinkNeed, ProbeListener, Reach, probe
from stalwart.runtime.session import QuorumSession
from stalwart.runtime.timeouts import Timeouts
from stalwart.testing.loopback import HOST

PLAN = EpochPlan(64, 8, seed=0)
RENDEZVOUS_TIMEOUT = 2.0
BOUND = 60.0
"""A liveness bound on a busy machine, not an expectation."""


def on_threads(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each call on a thread of its own; what each returned or raised, by name."""
    outcomes: dict[str, Any] = {}

    def run(name: str, call: Callable[[], Any]) -> None:
        try:
            outcomes[name] = call()
        except Exception as error:  # the test looks at it
            outcomes[name] = error

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND)
    assert set(outcomes) == set(calls), f"{sorted(set(calls) - set(outcomes))} still running after {BOUND} s"
    return outcomes


def test_a_rendezvous_one_rank_never_comes_to_ends_at_its_deadline_naming_that_rank(store: dist.TCPStore) -> None:
    prefix = f"lonely-{uuid.uuid4().hex}/"

    def rank(number: int) -> Callable[[], Communicator]:
        def connect() -> Communicator:
            return Communicator(
                dist.PrefixStore(prefix, store),
                number,
                3,
                timeout=BOUND,
                device=torch.device("cpu"),
                rendezvous_timeout=RENDEZVOUS_TIMEOUT,
                reach=f"{HOST}:{number + 1}",
            )

        return connect

    started = time.monotonic()
    outcomes = on_threads({"0": rank(0), "1": rank(1)})  # rank 2 never comes
    assert time.monotonic() - started < 10 * RENDEZVOUS_TIMEOUT
    for number, error in outcomes.items():
        assert isinstance(error, CollectiveError), error
        assert error.missing == (2,)
        assert f"rendezvous of rank {number}/3" in str(error) and "ranks [2] never came" in str(error)
    assert dist.PrefixStore(prefix, store).get("arrived/1") == f"{HOST}:2".encode()  # the probe address it published


def test_the_probe_tells_a_listening_peer_from_a_closed_port_and_a_malformed_address() -> None:
    listener = ProbeListener(HOST)
    with socket.socket() as closed:
        closed.bind((HOST, 0))
        closed_port = closed.getsockname()[1]  # bound, never listening: connects are refused
        found = probe({"live": listener.address, "closed": f"{HOST}:{closed_port}", "junk": "no-port"}, timeout=5.0)
    assert found == {"live": Reach.REACHABLE, "closed": Reach.REFUSED, "junk": Reach.CUT_OFF}
    assert [reach.unreachable for reach in found.values()] == [False, True, True]
    listener.close()
    assert probe({"gone": listener.address}, timeout=5.0) == {"gone": Reach.REFUSED}  # its process's port closed


def test_a_probe_carrying_a_steps_bytes_tells_a_peer_that_takes_them_from_one_that_does_not() -> None:
    """A listener reads the bytes and acknowledges them; a socket whose process never reads them (a link that
    cannot carry them in time looks the same to the prober) is slow. Without bytes, both are reachable."""
    listener = ProbeListener(HOST)
    with socket.socket() as deaf:
        deaf.bind((HOST, 0))
        deaf.listen(1)  # the kernel accepts the connection; nothing ever reads from it
        addresses = {"listener": listener.address, "deaf": f"{HOST}:{deaf.getsockname()[1]}"}
        need = LinkNeed(step_bytes=1 << 20, seconds=MIN_WINDOW)  # 2 MiB: more than the socket buffers take
        assert probe(addresses, timeout=5.0, need=need) == {"listener": Reach.REACHABLE, "deaf": Reach.SLOW}
        assert probe(addresses, timeout=5.0) == {"listener": Reach.REACHABLE, "deaf": Reach.REACHABLE}
    assert Reach.SLOW.unreachable
    listener.close()


def test_a_probe_sends_a_steps_two_link_bytes_capped_and_allows_them_the_timeouts_share() -> None:
    assert (LinkNeed(100, 1.0).payload, LinkNeed(100, 1.0).window) == (200, 1.0)
    big = LinkNeed(10 * MAX_PAYLOAD, 60.0)
    assert (big.payload, big.window) == (MAX_PAYLOAD, 3.0)
    assert LinkNeed(10 * MAX_PAYLOAD, 1.0).window == MIN_WINDOW
    crowd = LinkNeed(10 * MAX_PAYLOAD, 60.0, peers=4095)  # thousands of peers share the diagnosis's bytes
    assert crowd.payload * 4095 <= MAX_PROBE_BYTES and crowd.window == MIN_WINDOW
    with pytest.raises(ValueError, match="step_bytes must be a positive int, got 0"):
        LinkNeed(0, 1.0)
    with pytest.raises(ValueError, match="seconds must be a finite number of seconds > 0, got 0"):
        LinkNeed(1, 0)
    with pytest.raises(ValueError, match="peers must be a positive int, got 0"):
        LinkNeed(1, 1.0, peers=0)
    with pytest.raises(TypeError, match="need must be a LinkNeed or None"):
        probe({"a": f"{HOST}:1"}, need=1024)  # type: ignore[arg-type]


def test_a_listener_refuses_a_probe_longer_than_its_cap_and_keeps_answering() -> None:
    listener = ProbeListener(HOST)
    host, port = listener.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=BOUND) as rogue:
        rogue.sendall((MAX_PAYLOAD + 1).to_bytes(4, "big"))
        assert rogue.recv(1) == b"", "closed unread, unacknowledged"
    assert probe({"peer": listener.address}, need=LinkNeed(1024, BOUND)) == {"peer": Reach.REACHABLE}
    listener.close()


def test_the_probe_refuses_bad_arguments_naming_them(store: dist.TCPStore) -> None:
    with pytest.raises(ValueError, match="reach must be a host:port of at most 300 characters"):
        Communicator(store, 0, 1, timeout=1.0, device=torch.device("cpu"), reach="h" * 301)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        probe({"a": f"{HOST}:1"}, timeout=0)
    with pytest.raises(ValueError, match="host must be a non-empty address"):
        ProbeListener("")


def session(url: str, member: str) -> QuorumSession:
    timeouts = Timeouts.resolve(rendezvous_timeout=30.0, collective_timeout=30.0, quorum_timeout=BOUND)
    return QuorumSession(
        url,
        member,
        token=None,
        plan=PLAN,
        group=ReplicaGroup(),
        transport=Transport(host=HOST),
        timeouts=timeouts,
        device=torch.device("cpu"),
        layout=REPLICATED,
    )


def join(member: QuorumSession) -> None:
    answer = member.next_answer("join", 0)
    assert answer is not None
    member.adopt(answer)
    member.connect(answer)


def test_a_peer_found_dead_after_a_failure_is_reported_unreachable_with_the_next_quorum_request() -> None:
    """Two members form a quorum; a timed-out collective with the peer alive and reachable is "slow" (the busy hint,
    nothing reported); once the peer's process is gone its probe is refused, and the survivor's next quorum request
    carries it in ``unreachable`` to the lighthouse."""
    with Lighthouse(PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=BOUND) as server:
        survivor, peer = session(server.url, "survivor"), session(server.url, "peer")
        try:
            outcomes = on_threads({"survivor": lambda: join(survivor), "peer": lambda: join(peer)})
            assert outcomes == {"survivor": None, "peer": None}
            slow = survivor.peers.diagnose(CollectiveError("all-reduce passed its deadline", failure=Failure.TIMEOUT))
            assert slow.verdicts == {"peer": Verdict.SILENT} and slow.busy_hint and slow.unreachable == ()
            # the lighthouse named a member dead: nothing to probe (a dead NIC's peer would cost the probe's timeout)
            abandoned = survivor.peers.diagnose(
                CollectiveError("a member of this quorum is dead", failure=Failure.ABANDONED)
            )
            assert abandoned.verdicts == {} and "lighthouse reported" in abandoned.describe()

            peer.close(0, leave=False)  # its probe listener closes, its heartbeat socket too
            dead = survivor.peers.diagnose(CollectiveError("all-reduce failed: connection closed by peer"))
            assert dead.verdicts == {"peer": Verdict.DEAD} and not dead.busy_hint and dead.unreachable == ("peer",)

            answer = survivor.next_answer("failure", 0)
            assert answer is not None and answer.members == ("survivor",)
            assert server.state.answered["survivor"].unreachable == ("peer",)
            assert server.state.answered["survivor"].reason == "failure"
        finally:
            peer.close(0, leave=False)
            survivor.close(0, leave=False)


def test_a_collective_error_keeps_how_it_ended_and_who_never_came_when_pickled() -> None:
    """Errors cross process boundaries (queues of spawned peers): their keyword arguments must come back."""
    error = pickle.loads(pickle.dumps(CollectiveError("gave up", failure=Failure.TIMEOUT, missing=[2, 5])))
    assert (str(error), error.failure, error.missing) == ("gave up", Failure.TIMEOUT, (2, 5))
