"""A failure quorum formed ahead and withdrawn, over real HTTP: its store ends, so the survivor that confirmed it and
waits there for its peers asks again at once instead of being excluded (docs/protocol.md, "Forming a failure quorum
ahead of the survivors' requests")."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from stalwart.coord.client import LighthouseClient
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.runtime.comm import quorum_store
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(64, 8, seed=3)
BOUND = 60.0
"""Seconds any wait of the test may take (events come in milliseconds; a busy machine is slow)."""


def survivors_quorum_formed_ahead(
    server: Lighthouse, clients: list[LighthouseClient]
) -> tuple[dist.Store, tuple[str, ...]]:
    """Three members join; worker-1's socket closes (dead at once); the lighthouse forms worker-0's and worker-2's
    quorum ahead and worker-0 confirms it: the store of quorum 2, where worker-0 has written its group size, and
    the survivors in their ranks' order (quorum 1's, which the order of the joins decided)."""
    for client in clients:
        client.start_heartbeat(lambda: 0)
    with ThreadPoolExecutor(3) as pool:
        joined = list(pool.map(lambda c: c.quorum(0, None, "join", BOUND), clients))
    assert {answer.quorum_id for answer in joined} == {1} and len(joined[0].members) == 3
    survivors = tuple(member for member in joined[0].members if member != "worker-1")
    clients[1].close()
    wait_until(lambda: len(server.status()["quorums"]) == 2, BOUND, "the survivors' quorum formed ahead")
    assert server.status()["quorums"][-1]["ahead"] is True
    confirmed = clients[0].quorum(0, 1, "failure", BOUND)  # it fits what was presumed: answered at once
    assert (confirmed.quorum_id, confirmed.members) == (2, survivors)
    store = quorum_store(confirmed.store, BOUND, token=None)
    store.set("group_size/worker-0", "1")
    return store, survivors


def test_a_survivor_naming_the_dead_member_unreachable_confirms_the_quorum_formed_ahead() -> None:
    # worker-2's collective timed out before the push reached it: it probed its peers and names the dead worker-1,
    # which is no cut inside the quorum formed ahead (the network fault test's race: it used to withdraw it)
    with Lighthouse(PLAN, min_replicas=2, start_replicas=3, heartbeat_timeout=30.0, join_timeout=BOUND) as server:
        clients = [LighthouseClient(server.url, f"worker-{n}", heartbeat_interval=0.05) for n in range(3)]
        try:
            store, survivors = survivors_quorum_formed_ahead(server, clients)
            with ThreadPoolExecutor(1) as pool:
                # what Session.connect does first: read every member's group size
                waiting = pool.submit(store.multi_get, ["group_size/worker-0", "group_size/worker-2"])
                answer = clients[2].quorum(0, 1, "failure", BOUND, unreachable=["worker-1"])
                assert (answer.quorum_id, answer.members) == (2, survivors), "confirmed, not withdrawn"
                quorum_store(answer.store, BOUND, token=None).set("group_size/worker-2", "1")
                assert waiting.result(BOUND) == [b"1", b"1"]
            assert not server.status()["reconfigure_pending"]
            assert not [f for f in server.status()["failures"] if f["member"] != "worker-1"], "nobody excluded"
        finally:
            for client in clients:
                client.close()


def test_a_withdrawn_quorum_ends_its_store_so_the_survivor_waiting_there_asks_again_at_once() -> None:
    # worker-2 names worker-0 unreachable: a cut inside the quorum formed ahead withdraws it; worker-0, waiting in
    # its store for worker-2's keys, must hear at once (it waited for its rendezvous timeout, past the join timeout,
    # and was excluded: the network fault test's failure)
    with Lighthouse(PLAN, min_replicas=2, start_replicas=3, heartbeat_timeout=30.0, join_timeout=BOUND) as server:
        clients = [LighthouseClient(server.url, f"worker-{n}", heartbeat_interval=0.05) for n in range(3)]
        pool = ThreadPoolExecutor(2)
        try:
            store, survivors = survivors_quorum_formed_ahead(server, clients)
            waiting = pool.submit(store.multi_get, ["group_size/worker-0", "group_size/worker-2"])
            long_poll = pool.submit(clients[2].quorum, 0, 1, "failure", BOUND, unreachable=["worker-0"])
            with pytest.raises(RuntimeError, match="410: quorum 2's store is gone"):
                waiting.result(BOUND)  # at once, not at the store's timeout
            status = server.status()
            if survivors[0] == "worker-0":  # the cut keeps the first-ranked: worker-2 waits, the quorum withdrawn
                assert status["reconfigure_pending"], "withdrawn: its members are told to ask again"
                clients[2].close()
                with pytest.raises(RuntimeError, match="worker-2 was closed while this call waited"):
                    long_poll.result(BOUND / 2)  # closing the client ends its long poll, not the poll's own timeout
            else:  # worker-2 ranks first: the cut leaves the silent worker-0 out, and worker-2 goes on alone
                assert [(q["quorum_id"], q["members"]) for q in status["quorums"][2:]] == [(3, ["worker-2"])]
                assert long_poll.result(BOUND).quorum_id == 3
        finally:
            for client in clients:
                client.close()
            pool.shutdown(wait=True)
