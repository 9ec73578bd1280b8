"""The cross-group link as a model: bytes and collectives a run issued, timed on a link of given bandwidth and RTT.

No traffic shaping runs here (no root, one machine): the workers train on
127.0.0.1, each records what it sent to other groups (its exchanges' bytes as
a ring algorithm moves them, and how many collectives), and this model adds
what those collectives would cost on a wide-area link. A collective of
``hops`` sequential messages, each waiting one one-way latency (``RTT / 2``),
with ``nbytes`` sent by one process: ``hops * RTT / 2 + nbytes / bandwidth``.

- a ring all-reduce among ``n``: ``2 (n - 1)`` hops (float32 and bfloat16
  exchanges, the rounds' tails, the every-step mode's gradient buckets);
- an int8 exchange: an all-to-all (one hop: every process sends to every
  other at once) then a ring all-gather (``n - 1`` hops): ``n`` hops.

What is on the critical path: the every-step mode's last gradient bucket
(the earlier ones go while backward runs, as DDP overlaps them) and its
tail, every step; a round's end (its exchanges, one after the other, and the
tail beside them; a tail alone when no exchange ends the round); and of an
overlapped exchange what its ``overlap`` inner steps of compute do not hide.
Pure: numbers in, seconds out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Link:
    """A cross-group link: ``bandwidth`` bytes per second each way, ``rtt`` seconds round trip."""

    bandwidth: float = 1e9 / 8
    rtt: float = 0.1

    def seconds(self, hops: int, nbytes: float) -> float:
        """One collective of ``hops`` sequential messages moving ``nbytes`` from this process."""
        return hops * self.rtt / 2 + nbytes / self.bandwidth


def exchange_hops(codec: str, members: int) -> int:
    """Sequential messages of one exchange among ``members`` groups."""
    if members <= 1:
        return 0
    return members if codec == "int8" else 2 * (members - 1)


def ring_bytes(nbytes: float, members: int) -> float:
    """Bytes one process sends in a ring all-reduce of ``nbytes``."""
    return 0.0 if members <= 1 else 2 * (members - 1) / members * nbytes


def every_step_stall(link: Link, last_bucket_bytes: float, members: int) -> float:
    """Seconds a step of the every-step mode waits on the link: its last bucket (with the tail), after backward."""
    return link.seconds(2 * (members - 1), ring_bytes(last_bucket_bytes, members)) if members > 1 else 0.0


def diloco_stalls(link: Link, log: Iterable[Mapping[str, Any]], codec: str, members: int, step_seconds: float) -> float:
    """Seconds a DiLoCo run's exchanges and tails add on the link (see the module docstring)."""
    total = 0.0
    for entry in log:
        if entry["kind"] == "tail":
            if entry["alone"]:
                total += link.seconds(2 * (members - 1), entry["bytes"])
            continue
        seconds = link.seconds(exchange_hops(codec, members), entry["bytes"])
        total += max(0.0, seconds - entry["overlap"] * step_seconds)
    return total


def peak_rate(intervals: Iterable[tuple[float, float, float]], window: float = 1.0, resolution: float = 0.01) -> float:
    """The most bytes per second over any ``window`` of a timeline of ``(start, end, bytes)`` sends.

    Each send's bytes are spread evenly over its interval.
    """
    buckets: dict[int, float] = {}
    for start, end, nbytes in intervals:
        first, last = int(start / resolution), max(int(start / resolution) + 1, int(end / resolution))
        share = nbytes / (last - first)
        for slot in range(first, last):
            buckets[slot] = buckets.get(slot, 0.0) + share
    if not buckets:
        return 0.0
    width = max(1, round(window / resolution))
    slots = sorted(buckets)
    best = 0.0
    for start_slot in slots:
        best = max(best, sum(buckets.get(slot, 0.0) for slot in range(start_slot, start_slot + width)))
    return best / window


def every_step_timeline(
    link: Link, steps: int, step_seconds: float, step_bytes: float, last_bucket_bytes: float, members: int
) -> list[tuple[float, float, float]]:
    """The sends of a failure-free every-step run: each step's gradients, from its backward to its last bucket."""
    stall = every_step_stall(link, last_bucket_bytes, members)
    intervals = []
    clock = 0.0
    for _ in range(steps):
        start = clock + step_seconds / 3  # backward: the buckets before the last go while it runs
        clock += step_seconds + stall
        intervals.append((start, clock, ring_bytes(step_bytes, members)))
    return intervals


def rounds_timeline(
    link: Link,
    rounds: int,
    inner_steps: int,
    launches: list[int],
    overlap: int,
    fragment_bytes: list[float],
    codec: str,
    members: int,
    step_seconds: float,
    tail_bytes: float,
) -> list[tuple[float, float, float]]:
    """The sends of a failure-free DiLoCo run: mid-round exchanges behind compute, the round's end after it.

    ``launches[f]``: the inner step after which fragment ``f`` is launched
    (``inner_steps - 1`` with no overlap: at the round's end); the last round
    ends with every fragment exchanged once more.
    """
    hops = exchange_hops(codec, members)
    intervals: list[tuple[float, float, float]] = []
    clock = 0.0
    for round_ in range(rounds):
        pending: tuple[float, int] | None = None
        for step in range(inner_steps):
            clock += step_seconds
            if pending is not None and pending[1] == step:
                clock = max(clock, pending[0])
                pending = None
            for fragment, launch in enumerate(launches):
                if launch == step and launch < inner_steps - 1:
                    end = clock + link.seconds(hops, fragment_bytes[fragment])
                    intervals.append((clock, end, fragment_bytes[fragment]))
                    if overlap == 0:
                        clock = end
                    else:
                        pending = (end, step + overlap)
        ending = [f for f, launch in enumerate(launches) if launch >= inner_steps - 1 or round_ == rounds - 1]
        start = clock
        for fragment in ending:
            end = clock + link.seconds(hops, fragment_bytes[fragment])
            intervals.append((clock, end, fragment_bytes[fragment]))
            clock = end
        tail_end = start + link.seconds(2 * (members - 1), tail_bytes)
        intervals.append((start, tail_end, tail_bytes))
        clock = max(clock, tail_end)
    return intervals
