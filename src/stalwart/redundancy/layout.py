"""Where each element of the flat optimizer state lives, and how a new world gets it from an old one: pure.

The state is one flat run of ``parameters`` elements (the model's parameters
in order); every element has ``rows`` fp32 values (the master and the
optimizer's per-element state). :class:`ShardLayout` cuts the run into one
shard per process and each shard into cells (:mod:`~stalwart.redundancy.placement`)
and says which element ranges each process holds: its shard and, for an
overlap, the shards it copies; for parity, the parity units it holds.

:func:`plan_repair` turns an old layout, the old processes still valid (alive
and current) and a new layout into the moves that give every new process
its units: which lost cells are rebuilt from parity and where, and which
element ranges go from which process to which. It raises
:class:`ShardsLostError` naming the shards that nothing can rebuild.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from functools import cached_property

from stalwart._validate import check_int
from stalwart.errors import StalwartError
from stalwart.redundancy.config import Overlap, Parity, Redundancy
from stalwart.redundancy.memory import split_lengths
from stalwart.redundancy.placement import Placement, lost_shards, place

Range = tuple[int, int]
"""Elements ``[start, end)`` of the flat state."""


class ShardsLostError(StalwartError, RuntimeError):
    """More processes failed than the redundancy covers: ``shards`` cannot be rebuilt from the live ones."""

    def __init__(self, shards: Sequence[int], message: str) -> None:
        super().__init__(message)
        self.shards = tuple(shards)


@dataclass(frozen=True)
class ShardLayout:
    """The placement of ``redundancy`` over processes on ``nodes`` for a flat state of ``parameters`` elements."""

    placement: Placement
    parameters: int

    @cached_property
    def shard_ranges(self) -> tuple[Range, ...]:
        """Shard ``s``'s elements: consecutive runs, the first ``parameters mod N`` one longer."""
        return _runs(0, split_lengths(self.parameters, self.placement.processes))

    @cached_property
    def cell_ranges(self) -> tuple[tuple[Range, ...], ...]:
        """Cell ``c`` of shard ``s``: ``cell_ranges[s][c]``."""
        cells = self.placement.cells_per_shard
        return tuple(_runs(start, split_lengths(end - start, cells)) for start, end in self.shard_ranges)

    @property
    def processes(self) -> int:
        return self.placement.processes

    @property
    def parity(self) -> Parity | None:
        redundancy = self.placement.redundancy
        return redundancy if isinstance(redundancy, Parity) else None

    def held_shards(self, process: int) -> tuple[int, ...]:
        """The shards whose state ``process`` holds whole: its own, then (overlap) those it copies."""
        copies = () if self.parity else tuple(stripe for stripe, _ in self.placement.redundant_units[process])
        return (process, *copies)

    @cached_property
    def replicated(self) -> bool:
        """Whether every process holds every shard whole (overlap 1): each has all the parameters' masters."""
        return all(len(self.held_shards(process)) == self.processes for process in range(self.processes))

    def holders(self, shard: int) -> tuple[int, ...]:
        """The processes holding ``shard`` whole: its primary, then (overlap) its copies."""
        redundant = () if self.parity else self.placement.stripes[shard].redundant
        return (shard, *redundant)

    def parity_units(self, process: int) -> tuple[tuple[int, int], ...]:
        """The ``(stripe, slot)`` of each parity unit ``process`` holds (none for an overlap)."""
        return self.placement.redundant_units[process] if self.parity else ()

    def stripe_cells(self, stripe: int) -> tuple[Range, ...]:
        """The element ranges of a parity stripe's ``k`` data cells, in order."""
        return tuple(self.cell_ranges[cell.shard][cell.index] for cell in self.placement.stripes[stripe].cells)

    def unit_length(self, stripe: int) -> int:
        """Elements of a parity unit of ``stripe``: its longest data cell's."""
        return max(end - start for start, end in self.stripe_cells(stripe))

    def describe(self) -> dict[str, object]:
        """A JSON description that :func:`layout_from` turns back into this layout."""
        return {"redundancy": _redundancy_json(self.placement.redundancy), "nodes": list(self.placement.nodes)} | {
            "parameters": self.parameters
        }


def make_layout(redundancy: Redundancy, nodes: Sequence[str], parameters: int) -> ShardLayout:
    """``redundancy`` over ``len(nodes)`` processes for ``parameters`` elements; ``ValueError`` if unplaceable."""
    return ShardLayout(place(redundancy, nodes), check_int("parameters", parameters, minimum=1))


def layout_from(description: Mapping[str, object]) -> ShardLayout:
    """The layout :meth:`ShardLayout.describe` described; ``ValueError`` if malformed."""
    try:
        raw = description["redundancy"]
        nodes = description["nodes"]
        parameters = description["parameters"]
        if not isinstance(raw, dict) or not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise TypeError
        redundancy: Redundancy = Parity(raw["k"], raw["m"]) if "k" in raw else Overlap(raw["overlap"])
    except (KeyError, TypeError) as error:
        raise ValueError(f"malformed shard layout description {description!r}") from error
    return make_layout(redundancy, nodes, parameters)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Rebuild:
    """Lost cell ``cell`` (an element range), unit ``unit`` of ``stripe``'s code, rebuilt on new process ``rebuilder``.

    ``units`` pairs each unit of the stripe's code used (``0..k-1`` data cells,
    ``k..k+m-1`` parity) with the new process that sends it. Without parity
    (an overlap), ``stripe`` is the shard and the one unit is a copy held by a
    process one update behind.
    """

    stripe: int
    unit: int
    cell: Range
    rebuilder: int
    units: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Move:
    """Elements ``elements`` of the state go from new process ``source`` to new process ``target``."""

    source: int
    target: int
    elements: Range


@dataclass(frozen=True)
class RepairPlan:
    """Rebuilds first, then moves; ``rebuilt`` lists the old shards with no valid holder left."""

    rebuilds: tuple[Rebuild, ...]
    moves: tuple[Move, ...]
    rebuilt: tuple[int, ...]


def plan_repair(
    old: ShardLayout,
    valid: Mapping[int, int],
    new: ShardLayout,
    *,
    parity_valid: Set[int] | None = None,
    behind: Mapping[int, int] | None = None,
    rebuilders: Set[int] | None = None,
) -> RepairPlan:
    """How the new world gets its units from the old one.

    ``valid`` maps each old process whose units are current and alive to its
    rank in the new world; ``behind`` (default none) those alive one update
    behind (they missed the end of the last step); ``parity_valid`` (default:
    all of them) are those whose parity units are current too. Every element
    range a new process holds is sent by one valid old holder (itself if it
    held it: a move from a process to itself; else the lowest new rank), or by the valid process
    that rebuilt it: from parity, or from a holder that is behind (the
    rebuilder then applies the last update again). ``rebuilders`` (new
    ranks, default every valid one) are those that may rebuild: a parity
    rebuild takes the cell's master from the rebuilder's parameters, which
    only some processes hold current when a gather ended on some and not
    others. Raises :class:`ShardsLostError` when some shard cannot be rebuilt.
    """
    if old.parameters != new.parameters:
        raise ValueError(f"the new layout has {new.parameters} elements, the old one {old.parameters}")
    behind = dict(behind or {})
    usable = {**valid, **behind}
    for process, rank in usable.items():
        check_int("old process", process, minimum=0, maximum=old.processes - 1)
        check_int("new rank", rank, minimum=0, maximum=new.processes - 1)
    failed = [process for process in range(old.processes) if process not in usable]
    lost = lost_shards(old.placement, failed)
    if lost:
        raise ShardsLostError(
            lost,
            f"shards {list(lost)} of {old.processes} are lost: old processes {failed} failed, more than "
            f"{old.placement.redundancy} covers; resume from a checkpoint",
        )
    if not valid:
        raise ValueError("plan_repair needs at least one valid old process")
    allowed = set(valid.values()) if rebuilders is None else set(rebuilders)
    if not allowed or not allowed <= set(valid.values()):
        raise ValueError(f"rebuilders must be a non-empty set of valid processes' new ranks, got {sorted(allowed)}")
    parity_usable = set(usable) if parity_valid is None else set(parity_valid) | set(behind)
    sources: list[tuple[Range, tuple[int, ...]]] = []  # element range -> the new ranks holding it after the rebuilds
    rebuilds: list[Rebuild] = []
    rebuilt: list[int] = []
    for shard, shard_range in enumerate(old.shard_ranges):
        alive = sorted(valid[holder] for holder in old.holders(shard) if holder in valid)
        if alive:
            sources.append((shard_range, tuple(alive)))
            continue
        rebuilt.append(shard)
        for index, cell in enumerate(old.cell_ranges[shard]):
            if old.parity is None:  # a copy one update behind, updated again by a valid process
                holder = min(usable[h] for h in old.holders(shard) if h in usable)
                rebuild = Rebuild(shard, 0, cell, min(allowed), ((0, holder),))
            else:
                rebuild = _rebuild(old, usable, parity_usable, allowed, shard, index, cell)
            rebuilds.append(rebuild)
            sources.append((cell, (rebuild.rebuilder,)))
    moves = [
        Move(target if target in holders else holders[0], target, overlap)  # what a process holds stays put
        for target in range(new.processes)
        for shard in new.held_shards(target)
        for span, holders in sources
        if (overlap := _intersect(span, new.shard_ranges[shard])) is not None
    ]
    return RepairPlan(tuple(rebuilds), tuple(moves), tuple(rebuilt))


def _rebuild(
    old: ShardLayout,
    usable: Mapping[int, int],
    parity_usable: Set[int],
    rebuilders: Set[int],
    shard: int,
    index: int,
    cell: Range,
) -> Rebuild:
    """Cell ``index`` of ``shard`` rebuilt from the first ``k`` usable units of its stripe, on a valid process."""
    parity = old.parity
    assert parity is not None
    number, stripe = next(
        (number, stripe)
        for number, stripe in enumerate(old.placement.stripes)
        if any(c.shard == shard and c.index == index for c in stripe.cells)
    )
    data = [c.shard for c in stripe.cells]
    units = [(unit, usable[holder]) for unit, holder in enumerate(data) if holder in usable] + [
        (parity.k + slot, usable[holder])
        for slot, holder in enumerate(stripe.redundant)
        if holder in usable and holder in parity_usable
    ]
    if len(units) < parity.k:
        raise ShardsLostError(
            (shard,),
            f"shard {shard} is lost: its stripe {number} has {len(units)} current units left, {parity.k} are needed "
            "(a failure during a repair left parity incomplete); resume from a checkpoint",
        )
    chosen = tuple(units[: parity.k])
    senders = sorted(rank for _, rank in chosen if rank in rebuilders)
    return Rebuild(number, data.index(shard), cell, senders[0] if senders else min(rebuilders), chosen)


def _runs(start: int, lengths: Sequence[int]) -> tuple[Range, ...]:
    runs = []
    for length in lengths:
        runs.append((start, start + length))
        start += length
    return tuple(runs)


def _intersect(a: Range, b: Range) -> Range | None:
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


def _redundancy_json(redundancy: Redundancy) -> dict[str, float | int]:
    if isinstance(redundancy, Parity):
        return {"k": redundancy.k, "m": redundancy.m}
    return {"overlap": redundancy.fraction}
