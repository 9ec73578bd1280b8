"""The benchmarks' interleaved-rounds runner (``benchmarks._rounds``): every variant once a round, rotated."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks._rounds import fixed, interleaved_rounds, median_span, rotated, round_ratios, span


@given(st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=6, unique=True), st.integers(1, 12),
       st.integers(0, 3))  # fmt: skip
def test_every_variant_runs_once_a_round_and_takes_every_place_in_turn(
    variants: list[str], rounds: int, warmup: int
) -> None:
    calls: list[tuple[str, int]] = []
    results = interleaved_rounds(variants, rounds, lambda variant, number: calls.append((variant, number)) or number,
                                 warmup=warmup)  # fmt: skip
    assert results == {variant: list(range(rounds)) for variant in variants}, "warm-up dropped, rounds in order"
    assert len(calls) == (rounds + warmup) * len(variants)
    for number in range(-warmup, rounds):
        order = [variant for variant, called in calls if called == number]
        assert sorted(order) == sorted(variants) and order == rotated(variants, number)
    if rounds + warmup >= len(variants):  # over len(variants) rounds each variant stands first once
        firsts = [rotated(variants, number)[0] for number in range(len(variants))]
        assert sorted(firsts) == sorted(variants)


def test_ratios_pair_rounds_and_skip_missing_ones() -> None:
    assert round_ratios([2.0, None, 9.0], [1.0, 4.0, 3.0]) == [2.0, 3.0]
    assert span([], fixed(1)) == "-" and span([1.0, 3.25], fixed(2)) == "1.00-3.25"
    assert median_span([3.0, 1.0, 2.0], fixed(1, 1000, " ms")) == "2,000.0 ms (1,000.0 ms-3,000.0 ms)"
    assert median_span([0.5], fixed(3)) == "0.500" and median_span([], fixed(3)) == "-"


@pytest.mark.parametrize(
    ("variants", "rounds", "warmup", "message"),
    [(["a"], 0, 0, "rounds must be >= 1, got 0"), (["a"], 1, -1, "warmup must be >= 0, got -1"),
     (["a", "a"], 1, 0, "variants must be distinct"), ([], 1, 0, "variants must be distinct")],
)  # fmt: skip
def test_bad_arguments_are_refused_by_name(variants: list[str], rounds: int, warmup: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        interleaved_rounds(variants, rounds, lambda variant, number: None, warmup=warmup)
