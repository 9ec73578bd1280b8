"""A replica group's vote on each step's reduction: the group applies a step together or retries it together.

The processes of one group share a store (torchrun's agent store); here they
are threads sharing an in-process ``HashStore``, which is the same interface.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.world import WorldInfo
from stalwart.runtime.group import GroupLink


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
