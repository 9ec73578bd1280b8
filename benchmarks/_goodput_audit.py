"""The goodput benchmark's pure logic: the failure trace and the audit of what a run trained.

No processes and no I/O here, so that both are property-tested
(``tests/unit/test_goodput_audit.py``).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Failure:
    """One failure of the trace: when the job has executed ``at`` steps, SIGKILL worker ``victim``."""

    at: int
    victim: int


def failure_trace(rate: float, workers: int, horizon: int, seed: int) -> list[Failure]:
    """Failures with exponential inter-failure times of mean ``1 / rate`` steps, up to ``horizon`` steps.

    Spot-like: memoryless, so failures cluster now and then. Each lands on a
    whole step (rounded up, at least one step after the one before) and picks
    its victim uniformly from ``workers``; the same seed gives the same trace,
    which is replayed against every system.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 failures per step, got {rate}")
    if workers < 1 or horizon < 0:
        raise ValueError(f"workers must be >= 1 and horizon >= 0, got workers={workers}, horizon={horizon}")
    rng = random.Random(seed)
    trace: list[Failure] = []
    clock = 0.0
    while True:
        clock += rng.expovariate(rate)
        at = max(math.ceil(clock), trace[-1].at + 1 if trace else 1)
        if at >= horizon:
            return trace
        trace.append(Failure(at, rng.randrange(workers)))


@dataclass(frozen=True)
class Audit:
    """What a run trained, counted against the plan's epochs (a sample is an ``(epoch, position)`` pair).

    ``useful``: distinct samples whose gradient went into a committed step;
    ``trained``: sample-gradients computed in committed steps, repeats
    included; ``lost``: samples of the steps up to the last one reached that
    were never trained; ``twice``: ``trained - useful``; ``progress``: steps
    executed (distinct steps of each incarnation of the job, committed or
    not); ``first_at`` and ``finished_at``: ``time.time()`` of the first
    committed step and of the line that brought ``useful`` to the target
    (None when it never got there). Lines after that one count only when
    they belong to the same step (the other members' shares of it).
    """

    useful: int
    trained: int
    lost: int
    twice: int
    progress: int
    first_at: float | None
    finished_at: float | None


def audit_samples(
    records: Iterable[Mapping[str, Any]], global_batch: int, target: int, *, quorum_records: bool
) -> Audit:
    """Count the samples of ``records`` (the workers' ``SampleLog`` lines) up to the moment ``target`` was reached.

    ``quorum_records``: every member writes the whole quorum's positions of
    a step (stalwart), so identical lines of one step count once; otherwise
    each line is one member's own share (torchft, checkpoint-restart). Every
    step of the plan has ``global_batch`` samples.
    """
    ordered = sorted(records, key=lambda record: record["time"])
    seen: Counter[tuple[int, int]] = Counter()
    counted_lines: set[tuple[Any, ...]] = set()
    executed: set[tuple[str, int]] = set()
    last_step = -1
    first_at = finished_at = None
    for record in ordered:
        if finished_at is not None and record["step"] != last_step:
            continue  # after the target, only the other members' lines of the step that reached it count
        executed.add((record["incarnation"], record["step"]))
        if not record["committed"]:
            continue
        if quorum_records:
            line = (record["step"], tuple(record["positions"]))
            if line in counted_lines:
                continue
            counted_lines.add(line)
        first_at = record["time"] if first_at is None else first_at
        last_step = max(last_step, record["step"])
        seen.update((record["epoch"], position) for position in record["positions"])
        if finished_at is None and len(seen) >= target:
            finished_at = record["time"]
    useful, trained = len(seen), sum(seen.values())
    planned = (last_step + 1) * global_batch
    return Audit(useful, trained, planned - useful, trained - useful, len(executed), first_at, finished_at)
