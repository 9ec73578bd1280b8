"""A failure quorum formed ahead and withdrawn, over real HTTP: its store ends, so the survivor that confirmed it and
waits there for its peers asks again at once instead of being excluded (docs/protocol.md, "Forming a failure quorum
ahead of the survivors' requests")."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from stalwart.coord.client import LighthouseClient
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.runtime.comm import quorum_store
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(64, 8, seed=3)
BOUND = 60.0
"""Seconds any wait of the test may take (events come in milliseconds; a busy machine is slow)."""


def test_a_withdrawn_quorum_ends_its_store_and_the_survivor_that_confirmed_it_is_kept() -> None:
    # worker-1 cut off (its heartbeat socket gone): the lighthouse forms worker-0's and worker-2's quorum ahead;
    # worker-0 confirms it and waits in its store for worker-2's keys; worker-2's collective timed out on its own
    # first, so it names the cut-off worker-1 unreachable, which withdraws the quorum (the network fault test's
    # failure: worker-0 waited there for its rendezvous timeout, past the join timeout, and was excluded)
    with Lighthouse(PLAN, min_replicas=2, start_replicas=3, heartbeat_timeout=30.0, join_timeout=BOUND) as server:
        clients = [LighthouseClient(server.url, f"worker-{n}", heartbeat_interval=0.05) for n in range(3)]
        first, cut_off, last = clients
        try:
            for client in clients:
                client.start_heartbeat(lambda: 0)
            with ThreadPoolExecutor(3) as pool:
                joined = list(pool.map(lambda c: c.quorum(0, None, "join", BOUND), clients))
            assert {answer.quorum_id for answer in joined} == {1} and len(joined[0].members) == 3
            cut_off.close()  # its socket closes: dead at once
            wait_until(lambda: len(server.status()["quorums"]) == 2, BOUND, "the survivors' quorum formed ahead")
            assert server.status()["quorums"][-1]["ahead"] is True
            confirmed = first.quorum(0, 1, "failure", BOUND)  # it fits what was presumed: answered at once
            assert (confirmed.quorum_id, confirmed.members) == (2, ("worker-0", "worker-2"))
            store = quorum_store(confirmed.store, BOUND, token=None)
            store.set("group_size/worker-0", "1")
            with ThreadPoolExecutor(2) as pool:
                # what Session.connect does first: read every member's group size (worker-2 never writes its own)
                waiting = pool.submit(store.multi_get, ["group_size/worker-0", "group_size/worker-2"])
                withdrawing = pool.submit(last.quorum, 0, 1, "failure", BOUND, unreachable=["worker-1"])
                with pytest.raises(RuntimeError, match="410: quorum 2's store is gone"):
                    waiting.result(BOUND)  # at once, not at the store's timeout
                assert server.status()["reconfigure_pending"], "withdrawn: its members are told to ask again"
                again = first.quorum(0, 2, "failure", BOUND)
                answer = withdrawing.result(BOUND)
            assert again.quorum_id == answer.quorum_id == 3
            assert again.members == answer.members == ("worker-0", "worker-2"), "both survivors kept"
            assert not [f for f in server.status()["failures"] if f["member"] != "worker-1"], "nobody excluded"
        finally:
            for client in clients:
                client.close()
