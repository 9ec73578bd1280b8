"""Abandoned collectives: a process leaving a broken quorum is never held up by a collective it left pending.

Gloo's abort does not end a collective waiting on a live peer, and a group's
destructor joins it: every path that leaves a quorum must destroy its group
on a thread of its own (``Communicator.retire``). The redundancy benchmark
caught the quorum session not doing so: a survivor spent 60 s (the collective
timeout) in a step it retried after a failure, while its peers, done with
the retry's all-reduce, waited for it. Its first all-reduce had been
abandoned while it waited on a live peer; the session aborted the group and
dropped it, the last reference went with the failure's traceback in the
middle of the retried step, and the destructor waited there.
"""

from __future__ import annotations

import datetime
import gc
import threading
import uuid

import pytest
import torch
import torch.distributed as dist

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.runtime.comm import CollectiveError, Communicator
from stalwart.runtime.config import ReplicaGroup, Transport
from stalwart.runtime.peers import REPLICATED
from stalwart.runtime.session import QuorumSession
from stalwart.runtime.timeouts import Timeouts
from stalwart.testing.loopback import free_port
from stalwart.testing.waiting import wait_until

PLAN = EpochPlan(64, 8, seed=0)
COLLECTIVE_TIMEOUT = 600.0
"""The abandoned collective's timeout: what a caller waits if the group is destroyed on its thread."""
BOUND = 120.0
"""How long the test waits for the caller (a liveness bound far below the timeout, not a timing)."""


def connected_pair(timeout: float) -> tuple[dist.TCPStore, dict[int, Communicator]]:
    """Two Gloo communicators of one group in this process (each rank meets the other from a thread of its own),
    over a fresh store; the store is returned so that it outlives them."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    prefix = uuid.uuid4().hex
    comms: dict[int, Communicator] = {}

    def connect(rank: int) -> None:
        store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False))
        comms[rank] = Communicator(store, rank, 2, timeout=timeout, device=torch.device("cpu"))

    threads = [threading.Thread(target=connect, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(comms) == [0, 1]
    return master, comms


def test_a_retired_group_with_a_collective_pending_on_a_live_peer_holds_up_no_caller() -> None:
    """Rank 0 starts an all-reduce that rank 1 never joins, then retires its group (what a process does with
    its quorum's groups, and DiLoCo's rounds with an exchange's, when the quorum breaks). Gloo's abort does not
    end the collective, and the group's destructor waits for it: run on the caller's thread it would hold it for
    the collective's timeout (600 s here) while rank 1 lives. retire() returns at once, and once rank 1 retires
    too, rank 0's group is gone."""
    master, comms = connected_pair(COLLECTIVE_TIMEOUT)
    comms[0].start_all_reduce_sum(torch.ones(1000))  # rank 1 never joins
    retired = threading.Event()
    threading.Thread(target=lambda: (comms[0].retire(), retired.set()), daemon=True).start()
    assert retired.wait(60), "retire() waited for the collective pending on a live peer"

    def retiring() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread.name == "stalwart-retired-group"]

    assert retiring(), "rank 0's group is destroyed on a thread of its own, still waiting for its collective"
    comms[1].retire()
    wait_until(lambda: not retiring(), 60, "rank 0's group to go with its peer's")
    del master


def test_abort_holds_up_no_caller_while_a_live_peer_keeps_the_abandoned_collective() -> None:
    master, comms = connected_pair(COLLECTIVE_TIMEOUT)
    with Lighthouse(PLAN, min_replicas=1, start_replicas=1, heartbeat_timeout=30.0, join_timeout=30.0) as server:
        session = QuorumSession(
            server.url,
            "survivor",
            token=None,
            plan=PLAN,
            group=ReplicaGroup(),
            transport=Transport(),
            timeouts=Timeouts.resolve(collective_timeout=COLLECTIVE_TIMEOUT),
            device=torch.device("cpu"),
            layout=REPLICATED,
        )
        session.comm = session.grad_comm = comms.pop(0)
        # The caller's last references: the collective's wait (it holds the communicator) and the session's.
        held = [session.comm.start_all_reduce_sum(torch.ones(1000))]  # rank 1, alive, never joins it
        finished = threading.Event()

        def leave_the_quorum() -> None:
            session.abort()
            held.clear()
            gc.collect()
            finished.set()

        threading.Thread(target=leave_the_quorum, name="survivor", daemon=True).start()
        try:
            assert finished.wait(BOUND), "the session's abort left the group to be destroyed on the caller's thread"
            assert session.comm is None and session.grad_comm is None
        finally:
            comms[1].retire()
            session.close(0, leave=False)
    del master


def test_a_retired_communicator_refuses_collectives_and_retires_once() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60))
    comm = Communicator(dist.PrefixStore(uuid.uuid4().hex, store), 0, 1, timeout=60.0, device=torch.device("cpu"))
    comm.start_all_reduce_sum(torch.ones(4))()
    comm.retire()
    comm.retire()  # again: nothing to hand away
    comm.abort()
    with pytest.raises(CollectiveError, match=r"rank 0/1's communicator was retired"):
        comm.start_all_reduce_sum(torch.ones(4))
    with pytest.raises(CollectiveError, match=r"retired"):
        comm.all_gather(torch.ones(4))
    with pytest.raises(CollectiveError, match=r"retired"):
        comm.broadcast([torch.ones(4)], 0)
