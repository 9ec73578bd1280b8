"""The lighthouse's turnstile: at most ``per_iteration`` tasks go on per loop iteration, in the order they came."""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.coord.turnstile import Turnstile, release


class CountingSelector(selectors.DefaultSelector):
    """Counts the loop's iterations: asyncio selects once at the start of each."""

    def __init__(self) -> None:
        super().__init__()
        self.iterations = 0

    def select(self, timeout: float | None = None) -> Any:
        self.iterations += 1
        return super().select(timeout)


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    per_iteration=st.integers(1, 12),
    cancelled=st.sets(st.integers(0, 100), max_size=5),
)
def test_tasks_pass_in_order_at_most_per_iteration_each_iteration(
    arrivals: list[int], per_iteration: int, cancelled: set[int]
) -> None:
    """Bursts of tasks arrive in consecutive iterations (some cancelled while they wait): every other task passes,
    in arrival order, never more than ``per_iteration`` going on in one iteration."""
    turnstile = Turnstile(per_iteration)
    counter = CountingSelector()
    passed: list[tuple[int, int]] = []
    """(iteration, task number) as each task went on."""

    async def task(number: int) -> None:
        await turnstile.passage()
        passed.append((counter.iterations, number))

    async def scenario() -> set[int]:
        tasks: list[asyncio.Task[None]] = []
        for burst in arrivals:
            tasks.extend(asyncio.create_task(task(len(tasks))) for _ in range(burst))
            await asyncio.sleep(0)
        for number in cancelled & set(range(len(tasks))):
            tasks[number].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return {number for number, t in enumerate(tasks) if t.cancelled()}

    loop = asyncio.SelectorEventLoop(counter)
    try:
        dropped = loop.run_until_complete(scenario())
    finally:
        loop.close()
    numbers = [number for _, number in passed]
    assert numbers == sorted(numbers), "in the order they came"
    assert set(numbers) == set(range(sum(arrivals))) - dropped
    for moment in {when for when, _ in passed}:
        assert sum(1 for when, _ in passed if when == moment) <= per_iteration
    assert turnstile.waiting == 0


@settings(max_examples=40, deadline=None)
@given(waiters=st.integers(0, 40), per_iteration=st.integers(1, 12), done=st.sets(st.integers(0, 40), max_size=6))
def test_release_wakes_every_waiter_in_order_at_most_per_iteration_each_iteration(
    waiters: int, per_iteration: int, done: set[int]
) -> None:
    counter = CountingSelector()
    woken: list[tuple[int, int]] = []

    async def wait(number: int, turn: asyncio.Future[str]) -> None:
        assert await turn == "formed"
        woken.append((counter.iterations, number))

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        turns: list[asyncio.Future[str]] = [loop.create_future() for _ in range(waiters)]
        tasks = [asyncio.create_task(wait(number, turn)) for number, turn in enumerate(turns)]
        await asyncio.sleep(0)
        for number in done & set(range(waiters)):
            turns[number].set_result("formed")  # answered already (refused, in the lighthouse)
        release(turns, "formed", per_iteration)
        await asyncio.gather(*tasks)

    loop = asyncio.SelectorEventLoop(counter)
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert sorted(number for _, number in woken) == list(range(waiters))
    released = [number for _, number in woken if number not in done]
    assert released == sorted(released), "in order"
    for moment in {when for when, number in woken if number not in done}:
        assert sum(1 for when, number in woken if when == moment and number not in done) <= per_iteration


def test_a_bad_rate_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"per_iteration must be in \[1, inf\], got 0"):
        Turnstile(0)
