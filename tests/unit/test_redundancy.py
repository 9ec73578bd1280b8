"""Redundancy choice, node-aware placement and state bytes: invariants, brute force on small worlds, bad input."""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stalwart.redundancy import (
    Overlap,
    Parity,
    Placement,
    Redundancy,
    lost_shards,
    parse_parity,
    parse_redundancy,
    place,
    split_lengths,
    state_bytes,
    survived_patterns,
    survives,
)

PROPERTY = settings(max_examples=150, deadline=None)


@st.composite
def worlds(draw: st.DrawFn, max_nodes: int = 6, max_per_node: int = 5) -> tuple[str, ...]:
    """Node labels of a world: 1..max_nodes nodes of 1..max_per_node processes, ranks in any order."""
    sizes = draw(st.lists(st.integers(1, max_per_node), min_size=1, max_size=max_nodes))
    labels = [f"node{n}" for n, size in enumerate(sizes) for _ in range(size)]
    return tuple(draw(st.permutations(labels)))


@st.composite
def choices(draw: st.DrawFn, processes: int) -> Redundancy:
    """An overlap, or a parity whose group fits in ``processes``."""
    if processes < 2 or draw(st.booleans()):
        return Overlap(draw(st.floats(0, 1)))
    k = draw(st.integers(1, processes - 1))
    return Parity(k, draw(st.integers(1, processes - k)))


def units(redundancy: Redundancy, processes: int) -> tuple[int, int]:
    """(units of a stripe, how many of them may be lost)."""
    if isinstance(redundancy, Parity):
        return redundancy.k + redundancy.m, redundancy.m
    copies = redundancy.copies(processes)
    return 1 + copies, copies


def placeable(nodes: tuple[str, ...], redundancy: Redundancy) -> bool:
    """The counting bound: a node's processes hold ``c * w`` units over ``N`` stripes, at most ``t`` on each."""
    width, tolerance = units(redundancy, len(nodes))
    largest = max(Counter(nodes).values())
    return tolerance == 0 or len(set(nodes)) == 1 or largest * width <= len(nodes) * tolerance


# --- the choice -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "processes", "copies"),
    [(0, 8, 0), (0.125, 8, 1), (0.125, 64, 8), (0.25, 64, 16), (1, 64, 63), (0.5, 1, 0), (0.0625, 8, 1), (0.05, 8, 0)],
)
def test_copies_are_the_rounded_fraction_of_the_world_capped(fraction: float, processes: int, copies: int) -> None:
    assert Overlap(fraction).copies(processes) == copies  # 0.0625 x 8 = 0.5: halves round up


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Overlap(-0.1), ValueError, "overlap must be in [0, 1], got -0.1"),
        (lambda: Overlap(1.5), ValueError, "overlap must be in [0, 1], got 1.5"),
        (lambda: Overlap(math.nan), ValueError, "overlap must be in [0, 1], got nan"),
        (lambda: Overlap(True), TypeError, "overlap must be a number, got True (bool)"),
        (lambda: Overlap("0.5"), TypeError, "overlap must be a number, got '0.5' (str)"),
        (lambda: Parity(0, 1), ValueError, "parity k must be in [1, inf], got 0"),
        (lambda: Parity(7, 0), ValueError, "parity m must be in [1, inf], got 0"),
        (lambda: Parity(7, 1.0), TypeError, "parity m must be an int, got 1.0 (float)"),
        (lambda: parse_parity("7"), ValueError, "parity must be two integers K,M such as 7,1, got '7'"),
        (lambda: parse_parity("7,x"), ValueError, "parity must be two integers K,M such as 7,1, got '7,x'"),
        (lambda: parse_parity("7,1,1"), ValueError, "parity must be two integers K,M such as 7,1, got '7,1,1'"),
        (lambda: parse_parity("0,1"), ValueError, "parity k must be in [1, inf], got 0"),
        (lambda: place(Parity(7, 2), ["a"] * 8), ValueError, "parity k + m must be at most the number of processes"),
        (lambda: place(Overlap(0.5), []), ValueError, "processes (the number of node labels) must be in [1, inf]"),
        (lambda: lost_shards(place(Overlap(0), "ab"), [2]), ValueError, "failed process must be in [0, 1], got 2"),
    ],
)
def test_bad_choices_name_the_parameter_value_and_range(make: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as raised:
        make()  # type: ignore[operator]
    assert message in str(raised.value)


@given(fraction=st.floats(0, 1), k=st.integers(1, 64), m=st.integers(1, 8))
def test_redundancy_as_text_is_the_same_choice_as_its_object(fraction: float, k: int, m: int) -> None:
    assert parse_redundancy(f"overlap:{fraction!r}") == Overlap(fraction)
    assert parse_redundancy(f" Parity: {k}, {m} ") == Parity(k, m)
    assert parse_redundancy(Overlap(fraction)) == Overlap(fraction) and parse_redundancy(None) is None


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        ("overlap", ValueError, "redundancy must be 'overlap:F'"),
        ("zero:1", ValueError, "redundancy must be 'overlap:F'"),
        ("overlap:1.5", ValueError, "redundancy='overlap:1.5': "),
        ("overlap:x", ValueError, "redundancy='overlap:x': "),
        ("parity:7", ValueError, "redundancy='parity:7': parity must be two integers"),
        (0.5, TypeError, "redundancy must be Overlap"),
    ],
)
def test_redundancy_text_that_is_not_a_choice_is_refused_naming_it(text: object, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        parse_redundancy(text)  # type: ignore[arg-type]


def test_parse_parity_reads_k_and_m() -> None:
    assert parse_parity(" 7, 1") == Parity(7, 1)


# --- placement --------------------------------------------------------------------------------------------


@PROPERTY
@given(st.data())
def test_every_shard_has_exactly_the_required_distinct_holders(data: st.DataObject) -> None:
    nodes = data.draw(worlds())
    redundancy = data.draw(choices(len(nodes)))
    assume(placeable(nodes, redundancy))
    placement = place(redundancy, nodes)
    width, tolerance = units(redundancy, len(nodes))
    assert len(placement.stripes) == len(nodes)
    for stripe in placement.stripes:
        assert len(stripe.holders) == len(set(stripe.holders)) == width
        assert len(stripe.redundant) == tolerance
    cells = [cell for stripe in placement.stripes for cell in stripe.cells]
    expected = [(shard, index) for shard in range(len(nodes)) for index in range(placement.cells_per_shard)]
    assert sorted((cell.shard, cell.index) for cell in cells) == expected  # every cell in exactly one stripe
    if isinstance(redundancy, Overlap):
        assert [stripe.cells[0].shard for stripe in placement.stripes] == list(range(len(nodes)))


@PROPERTY
@given(st.data())
def test_holders_are_on_distinct_nodes_whenever_a_balanced_placement_allows(data: st.DataObject) -> None:
    nodes = data.draw(worlds())
    widest = len(nodes) // max(Counter(nodes).values())  # wider, and some stripe has two units on one node
    width = data.draw(st.integers(1, widest))
    if width == 1 or data.draw(st.booleans()):
        redundancy: Redundancy = Overlap((width - 1) / len(nodes))
    else:
        k = data.draw(st.integers(1, width - 1))
        redundancy = Parity(k, width - k)
    assert units(redundancy, len(nodes))[0] == width
    placement = place(redundancy, nodes)
    for stripe in placement.stripes:
        assert len({nodes[holder] for holder in stripe.holders}) == width


@PROPERTY
@given(st.data())
def test_refused_exactly_when_no_balanced_placement_survives_a_node(data: st.DataObject) -> None:
    nodes = data.draw(worlds())
    redundancy = data.draw(choices(len(nodes)))
    if placeable(nodes, redundancy):
        placement = place(redundancy, nodes)
        if units(redundancy, len(nodes))[1] and len(set(nodes)) > 1:
            assert survived_patterns(placement)[-1].nodes >= 1
    else:
        with pytest.raises(ValueError, match="so that one node's loss is survived: node 'node"):
            place(redundancy, nodes)


@PROPERTY
@given(st.data(), st.integers(1, 10**6), st.sampled_from([2, 3]))
def test_load_is_balanced(data: st.DataObject, parameters: int, elements: int) -> None:
    """Every process holds as many units; a unit is ``q`` or ``q + 1`` elements, so bytes differ by at most that."""
    nodes = data.draw(worlds())
    redundancy = data.draw(choices(len(nodes)))
    assume(placeable(nodes, redundancy))
    placement = place(redundancy, nodes)
    assert len({len(held) for held in placement.redundant_units}) == 1
    held = state_bytes(placement, parameters, state_elements=elements)
    width, _ = units(redundancy, len(nodes))
    assert max(held) - min(held) <= width * elements * 4  # one element per unit held
    shard = -(-parameters // len(nodes)) * elements * 4
    if parameters // len(nodes) >= width:
        assert max(held) - min(held) <= shard


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_survives_exactly_the_patterns_claimed_by_brute_force(data: st.DataObject) -> None:
    nodes = data.draw(worlds(max_nodes=4, max_per_node=3))
    redundancy = data.draw(choices(len(nodes)))
    assume(placeable(nodes, redundancy))
    placement = place(redundancy, nodes)
    processes = range(len(nodes))
    for size in range(len(nodes) + 1):
        for failed in itertools.combinations(processes, size):
            assert survives(placement, failed) == rebuildable(placement, set(failed))
    members = {node: {p for p in processes if nodes[p] == node} for node in sorted(set(nodes))}
    patterns = survived_patterns(placement)
    for pattern in patterns:
        assert all(survives(placement, failed) for failed in pattern_sets(members, pattern.nodes, pattern.processes))
        assert not all(survives(placement, f) for f in pattern_sets(members, pattern.nodes, pattern.processes + 1))
    assert not all(survives(placement, failed) for failed in pattern_sets(members, len(patterns), 0))


def rebuildable(placement: Placement, failed: set[int]) -> bool:
    """Independent of the module: every lost data cell lies in a stripe with at least k of its units alive."""
    for stripe in placement.stripes:
        alive = sum(holder not in failed for holder in stripe.holders)
        if any(cell.shard in failed for cell in stripe.cells) and alive < len(stripe.cells):
            return False
    return True


def pattern_sets(members: dict[str, set[int]], nodes: int, processes: int) -> list[set[int]]:
    """Every set of ``nodes`` whole nodes plus ``processes`` other processes (one set of all if too few are left)."""
    sets = []
    for chosen in itertools.combinations(members, nodes):
        down = set().union(*(members[node] for node in chosen))
        rest = sorted(set().union(*members.values()) - down)
        for more in itertools.combinations(rest, min(processes, len(rest))):
            sets.append(down | set(more))
    return sets


@pytest.mark.parametrize(
    ("redundancy", "expected"),
    [
        (Overlap(0), ["no failure"]),
        (Overlap(1 / 64), ["any 1 process", "any 1 node"]),
        (Parity(7, 1), ["any 1 process", "any 1 node"]),
        (Parity(6, 2), ["any 2 processes", "any 1 node and any 1 more process", "any 2 nodes"]),
        (  # 9 holders on 8 nodes: one node has two of them
            Overlap(0.125),
            [
                "any 8 processes",
                *(f"any {a} node{'s' * (a > 1)} and any {7 - a} more process{'es' * (a < 6)}" for a in range(1, 7)),
                "any 7 nodes",
            ],
        ),
    ],
)
def test_patterns_of_64_processes_on_8_nodes(redundancy: Redundancy, expected: list[str]) -> None:
    placement = place(redundancy, [f"n{p // 8}" for p in range(64)])
    assert [str(pattern) for pattern in survived_patterns(placement)] == expected


def test_lost_shards_name_the_shards_beyond_repair() -> None:
    nodes = ["a", "a", "b", "b"]
    zero = place(Overlap(0), nodes)
    assert lost_shards(zero, [3, 1]) == (1, 3)
    mirrored = place(Overlap(0.25), nodes)  # one copy each, on the other node
    assert survives(mirrored, [0, 1]) and survives(mirrored, [2, 3])
    assert lost_shards(mirrored, [0, 1, 2]) == (0, 2)  # shard 1's copy is on process 3
    raid5 = place(Parity(1, 1), nodes)
    assert survived_patterns(raid5)[-1].nodes == 1
    assert lost_shards(raid5, []) == ()


# --- state bytes ------------------------------------------------------------------------------------------


@given(st.integers(0, 10**6), st.integers(1, 100))
def test_split_lengths_cover_the_total_longest_first(total: int, parts: int) -> None:
    lengths = split_lengths(total, parts)
    assert sum(lengths) == total and len(lengths) == parts
    assert list(lengths) == sorted(lengths, reverse=True) and lengths[0] - lengths[-1] <= 1


def test_state_bytes_follow_the_formula() -> None:
    nodes = [f"n{p // 8}" for p in range(64)]
    parameters, adam = 21 * 2**30, 3  # divisible by 64 x 6 x 7: no rounding
    whole = parameters * adam * 4
    assert set(state_bytes(place(Overlap(0), nodes), parameters, state_elements=adam)) == {whole // 64}
    assert set(state_bytes(place(Overlap(0.125), nodes), parameters, state_elements=adam)) == {9 * whole // 64}
    assert set(state_bytes(place(Overlap(1), nodes), parameters, state_elements=adam)) == {whole}
    # parity units hold the moments, not the masters (the parameters): Adam's 2 rows of 3, SGD momentum's 1 of 2
    assert set(state_bytes(place(Parity(7, 1), nodes), parameters, state_elements=adam)) == {
        whole // 64 + whole * 2 // (3 * 64 * 7)
    }
    assert set(state_bytes(place(Parity(6, 2), nodes), parameters, state_elements=2, element_bytes=2)) == {
        parameters * 2 * 2 // 64 + 2 * parameters * 2 // (64 * 6)
    }


def test_parity_cells_are_padded_to_the_longest_in_their_stripe() -> None:
    placement = place(Parity(2, 1), ["a", "b", "c"])
    # 7 elements: shards 3, 2, 2; cells (2, 1), (1, 1), (1, 1); each stripe's parity as long as its longest cell,
    # one row (a master and one moment per element; parity holds the moment)
    held = state_bytes(placement, 7, state_elements=2, element_bytes=1)
    parity = [max(((2, 1), (1, 1), (1, 1))[c.shard][c.index] for c in stripe.cells) for stripe in placement.stripes]
    assert held == tuple(
        2 * length + sum(parity[s] for s, _ in units)
        for length, units in zip((3, 2, 2), placement.redundant_units, strict=True)
    )
