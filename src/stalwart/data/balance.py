"""Shares that follow members' measured throughput (stragglers): pure rules, no I/O.

Weights
    A balanced ledger (``DataLedger(plan, balance_every=K)``) records one
    integer weight per member: its number of ``local_batch_multiple`` chunks in
    a step of ``resolution`` chunks (the first step's total divided by ``m``, or
    the member count when that is larger). :func:`weighted_split_sizes` deals a
    step's chunks in proportion to the weights by largest remainders (Hamilton's
    method, ties to the lower rank); a part left without a chunk while there
    are at least as many chunks as parts takes one from the part with the most
    (ties: the lower rank), so no member gets an empty share unless that is
    unavoidable; the step's remainder ``total % m`` (an epoch's last step only)
    goes to the part next in line. Every operation is on integers, so the
    lighthouse and every member compute the same sizes; with equal weights the
    sizes are exactly :func:`~stalwart.data.schedule.split_sizes`'.

Deciding the weights
    :func:`rebalance` takes each member's samples and compute seconds over a
    window (the same float32 numbers on every member: they come out of the
    step's all-reduce), apportions ``resolution`` chunks in proportion to
    throughput (samples per second) and proposes them only when the predicted
    step time, the slowest member's fraction of the step times its seconds per
    sample, is at least ``threshold`` shorter than with the current weights
    (hysteresis: measurement noise does not make the weights flap).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from stalwart._validate import check_int
from stalwart.data.plan import EpochPlan

BALANCE_THRESHOLD = 0.05
"""A proposal must shorten the predicted step by at least this fraction to replace the current weights."""
RATE_LEVELS = 1 << 16
"""Throughputs are quantised to integers in [1, RATE_LEVELS] (the fastest member's) before apportioning."""


def resolution(plan: EpochPlan, parts: int) -> int:
    """How many chunks the weights of ``parts`` members share: a full step's chunks, or ``parts`` if more."""
    parts = check_int("parts", parts, minimum=1)
    return max(parts, plan.step_total(0) // plan.local_batch_multiple)


def weighted_split_sizes(total: int, weights: Sequence[int], multiple: int = 1) -> list[int]:
    """Split ``total`` samples into one size per weight, in chunks of ``multiple``, in proportion to the weights."""
    total = check_int("total", total, minimum=0)
    multiple = check_int("local_batch_multiple", multiple, minimum=1)
    weights = _check_weights("weights", weights)
    chunks, remainder = divmod(total, multiple)
    counts, next_in_line = _apportion(chunks, weights)
    sizes = [count * multiple for count in counts]
    sizes[next_in_line] += remainder
    return sizes


def apportion(chunks: int, weights: Sequence[int]) -> list[int]:
    """Deal ``chunks`` among the weights: largest remainders, at least one each when ``chunks`` allows."""
    chunks = check_int("chunks", chunks, minimum=0)
    return list(_apportion(chunks, _check_weights("weights", weights))[0])


def rebalance(
    weights: Sequence[int],
    samples: Sequence[float],
    seconds: Sequence[float],
    chunks: int,
    threshold: float = BALANCE_THRESHOLD,
) -> list[int] | None:
    """New weights (``chunks`` apportioned by measured throughput), or None to keep ``weights``.

    ``samples[i]`` and ``seconds[i]`` are member ``i``'s work and compute time
    over the window; a member with no samples or no time is taken to run at
    the measured members' mean throughput. None when nobody was measured or
    the proposal would not shorten the predicted step by ``threshold``.
    """
    weights = _check_weights("weights", weights)
    chunks = check_int("chunks", chunks, minimum=len(weights))
    if len(samples) != len(weights) or len(seconds) != len(weights):
        raise ValueError(
            f"samples and seconds must have one value per weight ({len(weights)}), got {len(samples)} and "
            f"{len(seconds)}"
        )
    if not 0 <= threshold < 1:
        raise ValueError(f"threshold must be in [0, 1), got {threshold!r}")
    rates = [s / t if s > 0 and t > 0 and math.isfinite(s / t) else 0.0 for s, t in zip(samples, seconds, strict=True)]
    measured = [rate for rate in rates if rate > 0]
    if not measured:
        return None
    mean = math.fsum(measured) / len(measured)
    rates = [rate or mean for rate in rates]
    fastest = max(rates)
    levels = tuple(max(1, round(rate / fastest * RATE_LEVELS)) for rate in rates)
    proposal = list(_apportion(chunks, levels)[0])
    if predicted_step(proposal, rates) < (1 - threshold) * predicted_step(weights, rates):
        return proposal
    return None


def group_measurements(
    slots: Sequence[float], group_sizes: Sequence[int], per_process: int = 2
) -> tuple[list[float], list[float]]:
    """``(samples, seconds)`` per member from reduced per-process slots ``[seconds, samples, ...]``.

    Processes are numbered group by group (``group_sizes``, in the members'
    rank order); a replica group counts as the sum of its processes' samples
    and its slowest process's seconds.
    """
    samples, seconds, first = [], [], 0
    for size in group_sizes:
        group = slots[per_process * first : per_process * (first + check_int("group size", size, minimum=1))]
        seconds.append(max(group[0::per_process]))
        samples.append(math.fsum(group[1::per_process]))
        first += size
    if per_process * first != len(slots):
        raise ValueError(f"slots must hold {per_process} values per process ({per_process * first}), got {len(slots)}")
    return samples, seconds


def predicted_step(weights: Sequence[int], rates: Sequence[float]) -> float:
    """Seconds per sample of the whole step when member ``i`` takes ``weights[i]`` parts at ``rates[i]`` samples/s."""
    whole = sum(weights)
    return max(weight / whole / rate for weight, rate in zip(weights, rates, strict=True))


@functools.lru_cache(maxsize=256)
def _apportion(chunks: int, weights: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Chunks per part, and the part next in line for one more (see the module doc)."""
    whole = sum(weights)
    counts = [chunks * weight // whole for weight in weights]
    order = sorted(range(len(weights)), key=lambda part: (-(chunks * weights[part] % whole), part))
    left = chunks - sum(counts)  # < len(weights): the fractional parts sum to it, each below 1
    for part in order[:left]:
        counts[part] += 1
    if chunks >= len(weights):
        for part in range(len(counts)):
            if counts[part] == 0:
                donor = max(range(len(counts)), key=lambda other: (counts[other], -other))
                counts[donor] -= 1
                counts[part] = 1
    return tuple(counts), order[left]


def _check_weights(name: str, weights: Sequence[int]) -> tuple[int, ...]:
    if isinstance(weights, str) or not isinstance(weights, Sequence) or not weights:
        raise ValueError(f"{name} must be a non-empty sequence of ints >= 1, got {weights!r}")
    return tuple(check_int(f"{name}[{index}]", weight, minimum=1) for index, weight in enumerate(weights))
