"""The step planner's parts: each process's positions and their sample indices, through failures mid-step.

The planner reads the step's and each part's sample indices from a window
of permuted positions (``IndexWindow``); whatever the step went through (failures
reassigning a dead member's positions, parts taken on top of what was
done), every part's indices must be the plan's own for its positions, and
the parts of the live processes must cover the step's positions exactly once.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.runtime.planner import StepPlanner

Run = tuple[EpochPlan, int, int, list[list[int]]]


@st.composite
def runs(draw: st.DrawFn) -> Run:
    """A plan, members, processes per member, and per step who dies in it, one after another (an index into the
    live members; the last one lives)."""
    batch = draw(st.integers(1, 48))
    multiple = draw(st.integers(1, min(batch, 4)))
    plan = EpochPlan(draw(st.integers(1, 300)), batch, seed=draw(st.integers(0, 3)), local_batch_multiple=multiple)
    members = draw(st.integers(1, 4))
    group_size = draw(st.integers(1, 2))
    deaths = draw(st.lists(st.lists(st.integers(0, members - 1), max_size=members - 1), min_size=1, max_size=6))
    return plan, members, group_size, deaths


def take_parts(
    processes: dict[tuple[str, int], StepPlanner], ledger: DataLedger, trained: dict[str, list[np.ndarray]]
) -> None:
    """Each live process takes its next part; its indices must be the plan's for its positions."""
    for (member, _), planner in processes.items():
        if member in trained:
            part = planner.next_part()
            assert part.indices == ledger.plan.indices_at(ledger.epoch, part.positions).tolist()
            trained[member].append(part.positions)


def check_step(planners: list[StepPlanner], ledger: DataLedger, trained: dict[str, list[np.ndarray]]) -> None:
    """Every live process's step indices are the plan's for the step's positions, which the parts cover once."""
    step = np.concatenate([np.zeros(0, dtype=np.int64), *ledger.in_flight.values()])
    for planner in planners:
        positions, indices = planner.step_indices()
        assert np.array_equal(np.sort(positions), np.sort(step))
        assert indices.tolist() == ledger.plan.indices_at(ledger.epoch, positions).tolist()
    covered = np.concatenate([np.zeros(0, dtype=np.int64), *(part for parts in trained.values() for part in parts)])
    assert np.array_equal(np.sort(covered), np.sort(step))


@settings(max_examples=200, deadline=None)
@given(runs())
def test_every_part_has_the_plans_indices_and_the_parts_cover_the_step_once(run: Run) -> None:
    plan, member_count, group_size, deaths = run
    lighthouse = DataLedger(plan)
    alive = [f"m{number}" for number in range(member_count)]
    for dying in deaths:
        lighthouse.begin_step(alive)
        processes = {
            (member, rank): StepPlanner(member, rank, group_size, max_microbatch=3, lockstep=False)
            for member in alive
            for rank in range(group_size)
        }
        for planner in processes.values():
            planner.adopt(lighthouse.state_dict(), alive)
            planner.begin_step()
        trained: dict[str, list[np.ndarray]] = {member: [] for member in alive}
        take_parts(processes, lighthouse, trained)
        for number in dying:
            if len(alive) == 1:
                break
            member = alive[number % len(alive)]
            lighthouse.member_failed(member)
            del trained[member]  # its work is lost with it
            alive = [name for name in alive if name != member]
            lighthouse.reassign(alive)
            for (name, _), planner in processes.items():
                if name in alive:
                    planner.adopt(lighthouse.state_dict(), alive)
            take_parts(processes, lighthouse, trained)
        check_step([planner for (member, _), planner in processes.items() if member in alive], lighthouse, trained)
        lighthouse.commit()


@settings(max_examples=150, deadline=None)
@given(runs())
def test_a_foreseen_step_is_the_one_that_comes_while_the_quorum_holds(run: Run) -> None:
    """Each process foresees the next step after a commit (to prefetch it): while nobody dies its first part is
    the one foreseen; after deaths the step's own positions win over what was foreseen for it."""
    plan, member_count, group_size, deaths = run
    lighthouse = DataLedger(plan)
    alive = [f"m{number}" for number in range(member_count)]
    processes = {
        (member, rank): StepPlanner(member, rank, group_size, max_microbatch=3, lockstep=False)
        for member in alive
        for rank in range(group_size)
    }
    max_steps = 2 * len(deaths)
    for dying in [*deaths, *([[]] * len(deaths))]:  # steps with deaths, then as many in which the quorum holds
        if lighthouse.step >= max_steps:
            break
        live = {key: planner for key, planner in processes.items() if key[0] in alive}
        foreseen = {}
        for key, planner in live.items():
            planner.adopt(lighthouse.state_dict(), alive)
            planner.reset_step()
            foreseen[key] = planner.foresee_next(max_steps)
        lighthouse.begin_step(alive)
        for planner in live.values():
            planner.begin_step()
        trained: dict[str, list[np.ndarray]] = {member: [] for member in alive}
        take_parts(live, lighthouse, trained)
        for member, rank in live:  # the first parts were taken in rank order
            first = trained[member][rank]
            assert foreseen[member, rank] == (lighthouse.epoch, plan.indices_at(lighthouse.epoch, first).tolist())
        for number in dying:
            if len(alive) == 1:
                break
            member = alive[number % len(alive)]
            lighthouse.member_failed(member)
            del trained[member]
            alive = [name for name in alive if name != member]
            lighthouse.reassign(alive)
            live = {key: planner for key, planner in live.items() if key[0] in alive}
            for planner in live.values():
                planner.adopt(lighthouse.state_dict(), alive)
            take_parts(live, lighthouse, trained)
        check_step(list(live.values()), lighthouse, trained)
        lighthouse.commit()
