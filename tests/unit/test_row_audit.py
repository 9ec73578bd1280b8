"""The row audit: loaders sum a hash of (index, row key) over the rows they hand out; epochs must agree."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.plan import EpochPlan
from stalwart.data.rowkeys import key_hashes
from stalwart.data.schedule import split_sizes
from stalwart.data.shards import InMemoryShard, ShardedDataset
from stalwart.runtime.consistency import AuditError, RowDigest, row_checksum
from stalwart.runtime.loader import ElasticLoader


def rows(count: int, seed: int | None = None) -> list[dict[str, Any]]:
    ids = list(range(count))
    if seed is not None:
        random.Random(seed).shuffle(ids)  # a member's own view of the rows
    return [{"id": i, "text": f"row {i}"} for i in ids]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 60), st.integers(1, 4), st.integers(0, 2**16))
def test_the_row_checksum_is_order_free_and_the_same_for_any_split(size: int, parts: int, seed: int) -> None:
    indices = np.random.default_rng(seed).permutation(size)
    hashes = key_hashes([f"key {i}" for i in indices])
    whole = row_checksum(indices, hashes)
    cuts = np.cumsum([0, *split_sizes(size, parts)])
    summed = sum(row_checksum(indices[a:b], hashes[a:b]) for a, b in itertools.pairwise(cuts))
    assert summed % (1 << 64) == whole
    assert row_checksum(indices[::-1], hashes[::-1]) == whole
    if size > 1:
        assert row_checksum(indices, np.roll(hashes, 1)) != whole, "the same rows under other indices differ"
    with pytest.raises(ValueError, match="row_hashes must give one hash per index"):
        row_checksum(indices, hashes[:-1] if size else [1])


def epoch_sum(datasets: list[ShardedDataset], plan: EpochPlan, epoch: int) -> int:
    """One epoch over ``len(datasets)`` members, member ``m`` loading share ``m`` of each step from its dataset."""
    loaders = [ElasticLoader(dataset, collate_fn=list) for dataset in datasets]
    total = 0
    for step in range(plan.steps_per_epoch):
        start = plan.step_start(step)
        for loader, size in zip(loaders, split_sizes(plan.step_total(step), len(loaders)), strict=True):
            list(loader.microbatches(epoch, plan.indices(epoch, start, start + size).tolist(), 8))
            total += loader.take_row_checksum()
            start += size
    for loader in loaders:
        loader.close()
    return total % (1 << 64)


def test_a_member_with_its_own_view_of_the_rows_is_caught_at_the_next_epochs_end() -> None:
    plan = EpochPlan(64, 16, seed=1)
    same = [ShardedDataset([InMemoryShard(rows(64, seed=7))], key="id") for _ in range(2)]
    digest = RowDigest()
    for epoch in range(3):
        digest.add(epoch, epoch_sum(same, plan, epoch))
        digest.close_epoch(epoch)
    skewed = [same[0], ShardedDataset([InMemoryShard(rows(64, seed=8))], key="id")]  # positions still fine
    digest.add(3, epoch_sum(skewed, plan, 3))
    with pytest.raises(AuditError, match=r"epoch 3: the rows the quorum trained on sum to 0x.*earlier epochs to 0x"):
        digest.close_epoch(3)


def test_the_row_digest_state_round_trips_and_is_checked() -> None:
    digest = RowDigest()
    digest.add(0, 5)
    digest.close_epoch(0)
    digest.add(1, (1 << 64) - 1)
    copy = RowDigest()
    copy.load_state_dict(digest.state_dict())
    assert (copy.reference, copy.epoch, copy.running) == (5, 1, (1 << 64) - 1)
    with pytest.raises(ValueError, match=r"value must be in \[0, 18446744073709551615\]"):
        copy.add(1, 1 << 64)
    with pytest.raises(ValueError, match=r"state must be a RowDigest\.state_dict\(\)"):
        copy.load_state_dict({"reference": None})
    with pytest.raises(ValueError, match="sums must be hex strings"):
        copy.load_state_dict({"reference": None, "epoch": 0, "running": 3})
