"""Node-aware placement of shards, copies and parity cells: pure, deterministic, balanced.

Process ``p`` is the primary of shard ``p``. Each shard is cut into
``cells_per_shard`` cells (1 for overlap, ``k`` for parity), and redundancy
comes in *stripes*: a stripe is ``k`` data cells, each held by its shard's
primary, plus ``t`` redundant units on other processes, and it survives the
loss of any ``t`` of its units. Overlap is the repetition code (one cell, the
whole shard, and ``r`` copies of it: stripe ``s`` is shard ``s``); parity is a
``(k, m)`` erasure code (``k`` cells from ``k`` shards and ``m`` parity cells).

All stripes are windows of one ring of the processes: stripe ``i`` takes the
``k`` processes at ring positions ``i .. i+k-1`` (their data cells) and the
next ``t`` ones (its redundant units). Every process is therefore in exactly
``k + t`` stripes and holds the same number of units: the load is balanced.
The ring deals the processes, grouped by node and largest node first, into
as many rows as the largest node has processes, spreads the longer rows
evenly and concatenates them. A node of ``c`` processes holds
``c * (k + t)`` units over ``N`` stripes, so some stripe has at least
``ceil(c * (k + t) / N)`` units on it. The ring meets that bound where it
matters: a stripe's units lie on distinct nodes whenever every node has
``c * (k + t) <= N``, and no stripe has more than ``t`` units on one node
whenever every node has ``c * (k + t) <= N * t`` (checked for every world of
2 to 5 nodes of up to 7 processes, every ``k + t`` and ``t``, and by the
property tests). So a placement is refused, with a :class:`ValueError`, only
when no balanced one survives the loss of a node (with two nodes or more).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from stalwart._validate import check_int
from stalwart.redundancy.config import Overlap, Parity, Redundancy


@dataclass(frozen=True)
class Cell:
    """Cell ``index`` of shard ``shard``, held by the shard's primary, process ``shard``."""

    shard: int
    index: int


@dataclass(frozen=True)
class Stripe:
    """``cells`` (data) and the processes holding the ``redundant`` units: copies, or parity cells ``0..m-1``."""

    cells: tuple[Cell, ...]
    redundant: tuple[int, ...]

    @property
    def holders(self) -> tuple[int, ...]:
        """Every unit's process: the data cells' primaries, then the redundant units'."""
        return tuple(cell.shard for cell in self.cells) + self.redundant


@dataclass(frozen=True)
class FailurePattern:
    """Any ``nodes`` whole nodes together with any ``processes`` further processes."""

    nodes: int
    processes: int

    def __str__(self) -> str:
        if not self.nodes and not self.processes:
            return "no failure"
        parts = []
        if self.nodes:
            parts.append(f"any {_plural(self.nodes, 'node')}")
        if self.processes:
            more = " more" if self.nodes else ""
            parts.append(f"any {self.processes}{more} {'process' if self.processes == 1 else 'processes'}")
        return " and ".join(parts)


@dataclass(frozen=True)
class Placement:
    """Who holds what, for ``redundancy`` over processes ``0..N-1`` with node labels ``nodes``.

    For :class:`Overlap`, ``stripes[s]`` is shard ``s`` and ``stripes[s].redundant``
    the processes holding its copies. For :class:`Parity`, ``stripes[i].redundant[j]``
    holds parity cell ``j`` of stripe ``i``, computed from ``stripes[i].cells``.
    """

    redundancy: Redundancy
    nodes: tuple[str, ...]
    stripes: tuple[Stripe, ...]

    @property
    def processes(self) -> int:
        """The world size ``N``."""
        return len(self.nodes)

    @property
    def cells_per_shard(self) -> int:
        """1 for overlap (a copy is a whole shard), ``k`` for parity."""
        return self.redundancy.k if isinstance(self.redundancy, Parity) else 1

    @cached_property
    def redundant_units(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per process, the ``(stripe, slot)`` of each redundant unit it holds, in stripe order."""
        units: list[list[tuple[int, int]]] = [[] for _ in range(self.processes)]
        for index, stripe in enumerate(self.stripes):
            for slot, process in enumerate(stripe.redundant):
                units[process].append((index, slot))
        return tuple(tuple(held) for held in units)


def place(redundancy: Redundancy, nodes: Sequence[str]) -> Placement:
    """Place ``redundancy`` over ``len(nodes)`` processes, process ``p`` on node ``nodes[p]``.

    Deterministic: the same arguments give the same placement on every
    process. Raises ``ValueError`` when the world is too small for the parity
    group or when, with two nodes or more, the loss of one node could not be
    survived (too many processes on one node).
    """
    labels = tuple(nodes)
    processes = check_int("processes (the number of node labels)", len(labels), minimum=1)
    ring = _ring(labels)
    if isinstance(redundancy, Parity):
        redundancy.check_processes(processes)
        data, redundant = redundancy.k, redundancy.m
    else:
        data, redundant = 1, redundancy.copies(processes)
    stripes = [
        Stripe(
            cells=tuple(Cell(ring[(i + d) % processes], d) for d in range(data)),
            redundant=tuple(ring[(i + data + e) % processes] for e in range(redundant)),
        )
        for i in range(processes)
    ]
    if isinstance(redundancy, Overlap):
        stripes.sort(key=lambda stripe: stripe.cells[0].shard)
    placement = Placement(redundancy, labels, tuple(stripes))
    if redundant and len(set(labels)) > 1 and not survived_patterns(placement)[-1].nodes:
        raise ValueError(_unplaceable(placement, data + redundant, redundant))
    return placement


def lost_shards(placement: Placement, failed: Iterable[int]) -> tuple[int, ...]:
    """The shards that cannot be rebuilt once the processes ``failed`` are gone, in order."""
    gone = {check_int("failed process", p, minimum=0, maximum=placement.processes - 1) for p in failed}
    lost: set[int] = set()
    for stripe in placement.stripes:
        if sum(holder in gone for holder in stripe.holders) > len(stripe.redundant):
            lost.update(cell.shard for cell in stripe.cells if cell.shard in gone)
    return tuple(sorted(lost))


def survives(placement: Placement, failed: Iterable[int]) -> bool:
    """Whether every shard can be rebuilt from the processes left when ``failed`` are gone."""
    return not lost_shards(placement, failed)


def survived_patterns(placement: Placement) -> tuple[FailurePattern, ...]:
    """For ``a = 0, 1, ...`` whole nodes lost, the most further processes that may be lost too; exact.

    A stripe with ``t`` redundant units loses, to the worst ``a`` nodes and
    ``b`` other processes, the units on its ``a`` most loaded nodes plus ``b``
    more (no process holds two units of one stripe), so it survives while that
    is at most ``t``. The list ends at the last ``a`` survived.
    """
    worst = [0] * (len(set(placement.nodes)) + 1)  # worst[a]: most units of one stripe on a nodes
    for stripe in placement.stripes:
        counts = sorted(Counter(placement.nodes[h] for h in stripe.holders).values(), reverse=True)
        running = 0
        for a, count in enumerate(counts, start=1):
            running += count
            worst[a] = max(worst[a], running)
        for a in range(len(counts) + 1, len(worst)):
            worst[a] = max(worst[a], running)
    tolerance = min(len(stripe.redundant) for stripe in placement.stripes)
    return tuple(FailurePattern(a, tolerance - units) for a, units in enumerate(worst) if units <= tolerance)


def _ring(nodes: tuple[str, ...]) -> tuple[int, ...]:
    """The processes in ring order: grouped by node, dealt into rows, the longer rows spread evenly, concatenated.

    Nodes go largest first (ties in order of first appearance), so each row
    holds at most one process of a node; the ``N mod rows`` rows that are one
    longer are spread evenly among the others.
    """
    groups: dict[str, list[int]] = {}
    for process, node in enumerate(nodes):
        groups.setdefault(node, []).append(process)
    line = [process for members in sorted(groups.values(), key=len, reverse=True) for process in members]
    count = max(map(len, groups.values()))
    rows = [line[row::count] for row in range(count)]
    longer = len(line) % count  # rows[:longer] are the longer ones
    spread = [(position + 1) * longer // count - position * longer // count for position in range(count)]
    longs, shorts = iter(rows[:longer]), iter(rows[longer:])
    return tuple(process for is_long in spread for process in next(longs if is_long else shorts))


def _unplaceable(placement: Placement, units: int, tolerance: int) -> str:
    """Why no balanced placement survives the loss of one node: the largest node and the most it may have."""
    node, count = Counter(placement.nodes).most_common(1)[0]
    most = math.floor(placement.processes * tolerance / units)
    what = "cells of a parity group" if isinstance(placement.redundancy, Parity) else "holders of a shard"
    return (
        f"cannot place {placement.redundancy} over {placement.processes} processes on "
        f"{_plural(len(set(placement.nodes)), 'node')} so that one node's loss is survived: node {node!r} has "
        f"{count} processes, but with {units} {what}, of which {tolerance} may be lost, a node may have at most {most}"
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
