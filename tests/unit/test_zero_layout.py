"""The layout and repair plan of sharded state (pure): property tests over worlds, redundancies and failures.

A reference executor carries out a plan on real bytes (random rows per
element, parity encoded with the real code): after the rebuilds and moves,
every process of the new world must hold exactly the old state's values of
the shards its new layout gives it, whatever failed, as long as the
redundancy covers it; and :class:`ShardsLostError` must name exactly the
shards that nothing can rebuild.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.redundancy.config import Overlap, Parity, Redundancy
from stalwart.redundancy.layout import ShardLayout, ShardsLostError, layout_from, make_layout, plan_repair
from stalwart.redundancy.memory import state_bytes
from stalwart.redundancy.parity import ParityCode, byte_view
from stalwart.redundancy.placement import lost_shards

ROWS = 3


@st.composite
def worlds(draw: st.DrawFn) -> tuple[Redundancy, list[str], int, set[int], list[str]]:
    processes = draw(st.integers(2, 9))
    labels = draw(st.lists(st.sampled_from("abc"), min_size=processes, max_size=processes))
    if draw(st.booleans()):
        redundancy: Redundancy = Overlap(draw(st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0])))
    else:
        m = draw(st.integers(1, min(2, processes - 1)))
        redundancy = Parity(draw(st.integers(1, processes - m)), m)
    parameters = draw(st.integers(processes, 300))
    failed = set(draw(st.lists(st.integers(0, processes - 1), max_size=3)))
    joiners = draw(st.lists(st.sampled_from("abcd"), max_size=2))
    return redundancy, labels, parameters, failed, joiners


def placeable(redundancy: Redundancy, labels: list[str], parameters: int) -> ShardLayout | None:
    try:
        return make_layout(redundancy, labels, parameters)
    except ValueError:
        return None


def parity_units(layout: ShardLayout, state: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """Every parity unit of ``layout`` over the whole ``state`` (rows x elements), as the runtime encodes it."""
    assert layout.parity is not None
    code = ParityCode(layout.parity)
    units = {}
    for number, _stripe in enumerate(layout.placement.stripes):
        cells = [byte_view(state[:, start:end].contiguous()) for start, end in layout.stripe_cells(number)]
        for slot, unit in enumerate(code.encode(cells)):
            units[(number, slot)] = unit
    return units


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.data())
def test_a_plan_gives_every_new_process_exactly_its_old_values(world: tuple, data: st.DataObject) -> None:
    """Also with only some valid processes allowed to rebuild (those whose parameters are current)."""
    redundancy, labels, parameters, failed, joiners = world
    old = placeable(redundancy, labels, parameters)
    if old is None:
        return
    survivors = [p for p in range(old.processes) if p not in failed]
    new_labels = [labels[p] for p in survivors] + joiners
    if not new_labels:
        return
    new_redundancy = redundancy
    if isinstance(redundancy, Parity) and redundancy.k + redundancy.m > len(new_labels):
        if len(new_labels) == 1:
            new_redundancy = Overlap(0.0)
        else:
            m = min(redundancy.m, len(new_labels) - 1)
            new_redundancy = Parity(min(redundancy.k, len(new_labels) - m), m)
    new = make_layout(new_redundancy, ["x"] * len(new_labels), parameters)
    valid = {process: rank for rank, process in enumerate(survivors)}
    lost = lost_shards(old.placement, failed)
    if lost:
        with pytest.raises(ShardsLostError) as error:
            plan_repair(old, valid, new)
        assert error.value.shards == lost
        return
    rebuilders = data.draw(st.none() | st.sets(st.sampled_from(sorted(valid.values())), min_size=1))
    plan = plan_repair(old, valid, new, rebuilders=rebuilders)
    allowed = set(valid.values()) if rebuilders is None else rebuilders
    assert all(rebuild.rebuilder in allowed for rebuild in plan.rebuilds)
    state = torch.randn(ROWS, parameters)
    parity = parity_units(old, state) if old.parity else {}
    # What each new rank holds before the moves: the old shards it held (if valid), and the cells it rebuilds.
    sources: dict[int, list[tuple[int, int]]] = {rank: [] for rank in range(new.processes)}
    for process, rank in valid.items():
        sources[rank] += [old.shard_ranges[shard] for shard in old.held_shards(process)]
    for rebuild in plan.rebuilds:
        assert len({unit for unit, _ in rebuild.units}) == old.parity.k  # type: ignore[union-attr]
        stripe = old.placement.stripes[rebuild.stripe]
        assert stripe.cells[rebuild.unit].shard not in valid
        units = {}
        for unit, sender in rebuild.units:
            k = len(stripe.cells)
            holder = stripe.cells[unit].shard if unit < k else stripe.redundant[unit - k]
            assert valid.get(holder) == sender  # the sender holds that unit
            if unit < k:
                start, end = old.stripe_cells(rebuild.stripe)[unit]
                units[unit] = byte_view(state[:, start:end].contiguous())
            else:
                units[unit] = parity[(rebuild.stripe, unit - k)]
        lengths = [(end - start) * ROWS * 4 for start, end in old.stripe_cells(rebuild.stripe)]
        cell = ParityCode(old.parity).decode(units, lengths)[rebuild.unit]  # type: ignore[arg-type]
        start, end = rebuild.cell
        assert torch.equal(cell.view(torch.float32).reshape(ROWS, end - start), state[:, start:end])
        sources[rebuild.rebuilder].append(rebuild.cell)
    assert sorted(plan.rebuilt) == sorted(s for s in range(old.processes) if not set(old.holders(s)) & set(valid))
    for rank in range(new.processes):
        wanted = sorted(new.shard_ranges[shard] for shard in new.held_shards(rank))
        got = sorted(move.elements for move in plan.moves if move.target == rank)
        covered = [element for start, end in got for element in range(start, end)]
        assert covered == [element for start, end in wanted for element in range(start, end)]  # exactly once
    for move in plan.moves:
        assert any(start <= move.elements[0] and move.elements[1] <= end for start, end in sources[move.source])


@given(worlds())
@settings(max_examples=100, deadline=None)
def test_layout_round_trips_and_holds_what_the_formula_says(world: tuple) -> None:
    redundancy, labels, parameters, _, _ = world
    layout = placeable(redundancy, labels, parameters)
    if layout is None:
        return
    assert layout_from(layout.describe()) == layout
    held = []
    for process in range(layout.processes):
        elements = sum(end - start for s in layout.held_shards(process) for start, end in [layout.shard_ranges[s]])
        parity = sum(layout.unit_length(stripe) for stripe, _ in layout.parity_units(process))
        held.append((elements * ROWS + parity * (ROWS - 1)) * 4)  # parity units hold no master row
    assert tuple(held) == state_bytes(layout.placement, parameters, state_elements=ROWS)
    # replicated (the sharded step's gather is skipped): exactly when every process holds every shard.
    everywhere = all(set(layout.held_shards(p)) == set(range(layout.processes)) for p in range(layout.processes))
    assert layout.replicated == everywhere
    if isinstance(redundancy, Overlap) and redundancy.fraction == 1.0:
        assert layout.replicated


def test_malformed_descriptions_are_refused() -> None:
    for description in ({}, {"redundancy": 3, "nodes": ["a"], "parameters": 4}, {"redundancy": {}, "nodes": "a"}):
        with pytest.raises(ValueError, match="malformed shard layout"):
            layout_from(description)
    with pytest.raises(ValueError, match="overlap must be in"):
        layout_from({"redundancy": {"overlap": 2.0}, "nodes": ["a", "b"], "parameters": 4})


def test_plan_refuses_rebuilders_that_are_not_valid_processes() -> None:
    old = make_layout(Parity(2, 1), ["a", "b", "c"], 12)
    new = make_layout(Parity(1, 1), ["a", "b"], 12)
    for rebuilders in (set(), {2}):
        with pytest.raises(ValueError, match=r"rebuilders must be a non-empty set of valid processes' new ranks"):
            plan_repair(old, {0: 0, 1: 1}, new, rebuilders=rebuilders)


def test_plan_refuses_a_new_world_of_other_parameters() -> None:
    old = make_layout(Overlap(0.5), ["a", "b"], 10)
    with pytest.raises(ValueError, match="11 elements"):
        plan_repair(old, {0: 0, 1: 1}, make_layout(Overlap(0.5), ["a", "b"], 11))
