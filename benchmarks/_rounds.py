"""Interleaved rounds, shared by the benchmarks: every variant once a round, in an order that rotates each round.

A benchmark compares variants (DDP and stalwart, two stores, equal and
balanced shares) on a machine whose load changes while it runs. Running each
variant once per round, the round's order shifted by one each time, makes the
load fall on all of them alike, and pairs each variant's result with the
baseline's of the same round: the spread of those per-round ratios is the
machine's noise, shown next to the ratio of the medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

V = TypeVar("V", bound=Hashable)
T = TypeVar("T")


def rotated(variants: Sequence[V], round_number: int) -> list[V]:
    """``variants`` in round ``round_number``'s order: shifted left by the round number."""
    if not variants:
        return []
    shift = round_number % len(variants)
    return [*variants[shift:], *variants[:shift]]


def interleaved_rounds(
    variants: Sequence[V], rounds: int, measure: Callable[[V, int], T], *, warmup: int = 0
) -> dict[V, list[T]]:
    """``measure(variant, round)`` for every variant in every round, rotated; each variant's results in round order.

    The first ``warmup`` rounds run the same way and are dropped (first
    imports, first connections); the rounds kept are numbered from 0.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not variants or len(set(variants)) != len(variants):
        raise ValueError(f"variants must be distinct and at least one, got {list(variants)}")
    results: dict[V, list[T]] = {variant: [] for variant in variants}
    for number in range(-warmup, rounds):
        for variant in rotated(variants, number):
            result = measure(variant, number)
            if number >= 0:
                results[variant].append(result)
    return results


def round_ratios(values: Sequence[float | None], baseline: Sequence[float | None]) -> list[float]:
    """Each round's value over the baseline's of the same round; rounds where either is missing are left out."""
    return [
        value / base for value, base in zip(values, baseline, strict=False) if value is not None and base is not None
    ]


def span(values: Sequence[float], form: Callable[[float], str]) -> str:
    """``min-max`` of ``values`` in ``form`` (``-`` when there are none): a spread column."""
    return f"{form(min(values))}-{form(max(values))}" if values else "-"


def median_span(values: Sequence[float], form: Callable[[float], str]) -> str:
    """``median (min-max)`` of ``values`` in ``form``; the median alone for one value, ``-`` for none."""
    if not values:
        return "-"
    middle = form(statistics.median(values))
    return middle if len(values) == 1 else f"{middle} ({span(values, form)})"


def fixed(digits: int, scale: float = 1.0, suffix: str = "") -> Callable[[float], str]:
    """A cell format: ``value * scale`` with ``digits`` decimals and thousands separated, then ``suffix``."""
    return lambda value: f"{value * scale:,.{digits}f}{suffix}"
