"""How a step's samples are counted and split: pure integer rules.

Step boundaries
    With a global batch ``B`` and ``local_batch_multiple = m``, every local
    share must be a multiple of ``m``, so a step's total is a multiple of
    ``m``. Step ``t`` of an epoch covers positions ``[S(t), S(t + 1))`` of the
    epoch's order, where ``S(t)`` is the multiple of ``m`` closest to ``B * t``
    (ties go to the smaller). A step's total is therefore the multiple of ``m``
    closest to ``B`` plus what earlier steps left over, and over any number of
    steps the average total is exactly ``B``: what one step leaves over goes
    first into the next. With ``m = 1`` every step has exactly ``B`` samples.

Splitting a total among parts
    ``split_sizes(total, parts, m)`` cuts ``total`` into ``total // m`` chunks
    of ``m``, deals them out evenly (the first parts get one more when they do
    not divide), and adds the remainder ``total % m`` (non-zero only on an
    epoch's last step) to the next part in line. Every size is a multiple of
    ``m`` except at most that one, sizes differ by at most ``m``, and parts
    may be empty when there are more parts than chunks.

Micro-batches
    ``split_microbatches(share, max_microbatch)`` cuts one worker's share into
    the fewest micro-batches of at most ``max_microbatch`` samples, as equal as
    possible, so that gradient accumulation keeps memory bounded however large
    the share grows when the world shrinks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from stalwart._validate import check_int

T = TypeVar("T", bound=Sequence)


def step_boundary(step: int, global_batch_size: int, multiple: int = 1) -> int:
    """Return ``S(step)``: the first epoch position of step ``step``."""
    step = check_int("step", step, minimum=0)
    global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
    multiple = check_int("local_batch_multiple", multiple, minimum=1, maximum=global_batch_size)
    quotient, remainder = divmod(global_batch_size * step, multiple)
    if 2 * remainder > multiple:
        quotient += 1
    return quotient * multiple


def step_boundaries(
    steps: npt.ArrayLike, global_batch_size: int, multiple: int = 1, limit: int | None = None
) -> npt.NDArray[np.int64]:
    """:func:`step_boundary` of every step in ``steps`` at once (int64), clamped to ``limit`` when given."""
    global_batch_size = check_int("global_batch_size", global_batch_size, minimum=1)
    multiple = check_int("local_batch_multiple", multiple, minimum=1, maximum=global_batch_size)
    quotient, remainder = np.divmod(np.asarray(steps, dtype=np.int64) * global_batch_size, multiple)
    boundaries = (quotient + (2 * remainder > multiple)) * multiple
    return boundaries if limit is None else np.minimum(boundaries, limit)


def step_total(step: int, global_batch_size: int, multiple: int = 1) -> int:
    """Return how many samples step ``step`` of an epoch trains on (before the epoch's end)."""
    return step_boundary(step + 1, global_batch_size, multiple) - step_boundary(step, global_batch_size, multiple)


def split_sizes(total: int, parts: int, multiple: int = 1) -> list[int]:
    """Split ``total`` samples into ``parts`` sizes in multiples of ``multiple`` (see module doc)."""
    total = check_int("total", total, minimum=0)
    parts = check_int("parts", parts, minimum=1)
    multiple = check_int("local_batch_multiple", multiple, minimum=1)
    chunks, remainder = divmod(total, multiple)
    per_part, extra = divmod(chunks, parts)
    sizes = [(per_part + (1 if part < extra else 0)) * multiple for part in range(parts)]
    sizes[extra] += remainder
    return sizes


def split_microbatches(share: T, max_microbatch: int) -> list[T]:
    """Cut ``share`` into the fewest slices of at most ``max_microbatch`` items, sizes differing by at most one.

    An empty share gives no micro-batches.
    """
    max_microbatch = check_int("max_microbatch", max_microbatch, minimum=1)
    count = -(-len(share) // max_microbatch)
    if count == 0:
        return []
    base, extra = divmod(len(share), count)
    slices = []
    start = 0
    for index in range(count):
        stop = start + base + (1 if index < extra else 0)
        slices.append(share[start:stop])
        start = stop
    return slices  # type: ignore[return-value]
