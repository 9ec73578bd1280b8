"""A replica group's vote on each step's reduction: the group applies a step together or retries it together.

The processes of one group share a store (torchrun's agent store); here they
are threads sharing an in-process ``HashStore``, which is the same interface.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.world import WorldInfo
from stalwart.runtime.group import GroupLink
from stalwart.runtime.preemption import Departure


def links(size: int) -> tuple[dist.Store, list[GroupLink]]:
    store = dist.HashStore()
    return store, [GroupLink(WorldInfo(rank, size), store, timeout=30.0) for rank in range(size)]


def vote(group: list[GroupLink], outcomes: list[bool]) -> list[bool]:
    with ThreadPoolExecutor(len(group)) as pool:
        return list(pool.map(GroupLink.agree, group, outcomes))


def outcomes_of(size: int) -> st.SearchStrategy[tuple[int, list[list[bool]]]]:
    """Up to six attempts of a group of ``size``: each process's outcome of each reduction."""
    attempt = st.lists(st.booleans(), min_size=size, max_size=size)
    return st.tuples(st.just(size), st.lists(attempt, max_size=6))


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4).flatmap(outcomes_of))
def test_every_process_applies_a_step_only_if_every_process_reduced_it(case: tuple[int, list[list[bool]]]) -> None:
    size, attempts = case
    store, group = links(size)
    for outcomes in attempts:
        assert vote(group, outcomes) == [all(outcomes)] * size
    if attempts:  # only the last vote's keys remain: one per process
        last = len(attempts) - 1
        assert store.num_keys() == size
        kept = dist.PrefixStore("stalwart/0/", store)
        assert kept.check([f"vote/{last}/{rank}" for rank in range(size)])


def test_a_single_process_group_needs_no_store() -> None:
    link = GroupLink(WorldInfo(0, 1))
    assert link.agree(True) and not link.agree(False)


def test_a_vote_that_never_comes_ends_at_the_timeout_naming_it() -> None:
    _, (leader, _peer) = links(2)
    leader.timeout = 0.2
    with pytest.raises(RuntimeError, match=r"the group's votes on collective 0 did not come within 0.2 s"):
        leader.agree(True)


def test_sigterm_while_a_peers_vote_is_missing_ends_the_wait_after_the_departure_grace() -> None:
    """torchrun stops a group whose process died with SIGTERM to the others: a process waiting for the dead one's
    vote hears it (a real signal, the Manager's own handler) and gives up after the grace, not at the timeout."""
    store = dist.HashStore()
    departure = Departure()
    departure.install()
    try:
        leader = GroupLink(
            WorldInfo(0, 2), store, timeout=3600.0, leaving=lambda: departure.requested, departure_grace=0.2
        )
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(RuntimeError, match=r"asked to depart \(SIGTERM\): its group is being stopped"):
            leader.agree(True)
        assert departure.requested
    finally:
        departure.uninstall()


def test_a_peer_that_votes_within_the_grace_is_agreed_with_after_a_departure_request() -> None:
    """A departure asked while the group is healthy (a spot notice) still finishes the step's vote."""
    store = dist.HashStore()
    leader = GroupLink(WorldInfo(0, 2), store, timeout=3600.0, leaving=lambda: True, departure_grace=3600.0)
    peer = GroupLink(WorldInfo(1, 2), store, timeout=3600.0)
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(lambda: (time.sleep(0.2), peer.agree(True))[1])
        assert leader.agree(True) and late.result(timeout=60)


def test_the_leader_relays_a_broken_quorum_with_the_members_the_lighthouse_named() -> None:
    _, (leader, other) = links(2)
    assert other.broken_by(4) == ()
    leader.mark_broken(4, ("w0", "w2"))
    assert other.broken_by(4) == ("w0", "w2") and other.broken_by(5) == ()
    leader.mark_broken(5)
    assert other.broken(5) and other.broken_by(5) == (), "a quorum broken with nobody named is still broken"
