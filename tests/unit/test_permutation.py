"""The epoch order: a keyed bijection, deterministic, different per epoch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.permutation import FeistelPermutation
from stalwart.data.plan import EpochPlan


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 5000), key=st.integers(0, 2**63))
def test_is_a_bijection_of_the_range(size: int, key: int) -> None:
    image = FeistelPermutation(size, key)(np.arange(size))
    assert np.array_equal(np.sort(image), np.arange(size))


@settings(max_examples=20, deadline=None)
@given(size=st.integers(2**32 - 5, 2**40), key=st.integers(0, 2**32))
def test_large_domains_use_64_bit_words_and_stay_in_range(size: int, key: int) -> None:
    positions = np.array([0, 1, size // 2, size - 2, size - 1])
    image = FeistelPermutation(size, key)(positions)
    assert image.min() >= 0 and image.max() < size
    assert len(set(image.tolist())) == len(positions)


def test_same_key_same_order_and_keys_differ() -> None:
    first = FeistelPermutation(10_000, 7)(np.arange(10_000))
    again = FeistelPermutation(10_000, 7)(np.arange(10_000))
    other = FeistelPermutation(10_000, 8)(np.arange(10_000))
    assert np.array_equal(first, again)
    assert (first != other).mean() > 0.9


def test_order_looks_shuffled() -> None:
    size = 100_000
    image = FeistelPermutation(size, 123)(np.arange(size))
    displacement = np.abs(image - np.arange(size)).mean()
    assert displacement > size / 4
    correlation = np.corrcoef(np.arange(size), image)[0, 1]
    assert abs(correlation) < 0.02
    first_half_share = (image[: size // 2] < size // 2).mean()
    assert 0.48 < first_half_share < 0.52


def test_slices_agree_with_the_whole() -> None:
    plan = EpochPlan(1_000_003, 64, seed=5)
    whole = plan.indices(3, 0, 1_000_003)
    assert np.array_equal(plan.indices(3, 1000, 2000), whole[1000:2000])
    assert np.array_equal(plan.indices_at(3, [5, 999_999, 17]), whole[[5, 999_999, 17]])


def test_epochs_differ_and_no_shuffle_is_identity() -> None:
    plan = EpochPlan(5000, 10, seed=1)
    assert not np.array_equal(plan.indices(0, 0, 5000), plan.indices(1, 0, 5000))
    identity = EpochPlan(5000, 10, shuffle=False)
    assert np.array_equal(identity.indices(4, 100, 200), np.arange(100, 200))


def test_huge_dataset_first_batch_without_materialising() -> None:
    plan = EpochPlan(10**10, 1024, seed=3)
    batch = plan.indices(0, 0, 1024)
    assert batch.dtype == np.int64 and len(set(batch.tolist())) == 1024
    assert batch.min() >= 0 and batch.max() < 10**10


@pytest.mark.parametrize(
    ("size", "key", "message"),
    [(0, 1, "size must be in"), (-3, 1, "size must be in"), (10, -1, "key must be in")],
)
def test_bad_arguments_name_the_parameter(size: int, key: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FeistelPermutation(size, key)


def test_positions_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match=r"positions must be in \[0, 9\]"):
        FeistelPermutation(10, 1)([3, 10])
