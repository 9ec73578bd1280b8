"""The feed behind ``ManagedDistributedSampler(manager, dataset)``, with real DataLoaders and worker processes.

The dataset's sample ``i`` is ``i`` itself, so every batch shows which
samples were actually loaded. A scripted driver stands in for the Manager's
ledger: its foresight of later steps may be wrong, and a step may need a
second part (a failure retry), as when a member dies mid-step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from stalwart.data.sampler import ManagedDistributedSampler
from stalwart.data.schedule import split_microbatches
from stalwart.runtime.feed import SamplerFeed

SIZE = 64
DATASET = TensorDataset(torch.arange(SIZE))


class ScriptedDriver:
    """Drives the sampler from a feed, as the Manager does; foresees later steps from a script."""

    def __init__(self, foreseen: list[list[int]], workers: int, max_microbatch: int, persistent: bool = False) -> None:
        self.foreseen = foreseen
        self.current = 0
        loader = DataLoader(
            DATASET,
            batch_sampler=ManagedDistributedSampler(self, DATASET),
            num_workers=workers,
            persistent_workers=persistent and workers > 0,
        )
        self.feed = SamplerFeed(loader, max_microbatch, self.foresee)

    def sampler_pass(self) -> Iterator[list[int]]:
        return self.feed.sampler_pass()

    def foresee(self) -> Iterator[tuple[int, list[int]]]:
        after = self.current + 1
        return iter([(step // 2, part) for step, part in enumerate(self.foreseen) if step >= after])

    def run(self, steps: list[list[list[int]]], max_microbatch: int) -> list[tuple[int, int]]:
        """Each step's parts through the feed; checks every batch; returns the produced keys."""
        for number, parts in enumerate(steps):
            self.current = number
            for part in parts:
                if not part:
                    continue  # the Manager asks for no micro-batches of an empty part
                batches = list(self.feed.microbatches(number // 2, part, max_microbatch))
                assert [batch[0].tolist() for batch in batches] == split_microbatches(part, max_microbatch)
        produced = self.feed.take_produced()
        self.feed.close()
        return produced


def keys(steps: list[list[list[int]]]) -> list[tuple[int, int]]:
    return [(number // 2, index) for number, parts in enumerate(steps) for part in parts for index in part]


@st.composite
def scripts(draw: st.DrawFn) -> tuple[list[list[list[int]]], list[list[int]], int]:
    """Steps (each a part, sometimes a retry part), the foresight of each step's first part, max_microbatch."""
    part = st.lists(st.integers(0, SIZE - 1), max_size=10, unique=True)
    steps = draw(st.lists(st.lists(part, min_size=1, max_size=2), min_size=1, max_size=6))
    foreseen = [parts[0] if draw(st.booleans()) else draw(part) for parts in steps]
    return steps, foreseen, draw(st.integers(1, 4))


Script = tuple[list[list[list[int]]], list[list[int]], int]


def check_script(script: Script, workers: int, persistent: bool) -> None:
    steps, foreseen, max_microbatch = script
    driver = ScriptedDriver(foreseen, workers, max_microbatch, persistent)
    assert driver.run(steps, max_microbatch) == keys(steps)


@settings(max_examples=40, deadline=None)
@given(script=scripts())
def test_every_step_gets_exactly_its_parts_whatever_was_foreseen(script: Script) -> None:
    check_script(script, workers=0, persistent=False)


@settings(max_examples=10, deadline=None)  # each example forks two DataLoader workers: the logic is the test above's
@given(script=scripts(), persistent=st.booleans())
def test_every_step_gets_exactly_its_parts_from_dataloader_workers(script: Script, persistent: bool) -> None:
    check_script(script, workers=2, persistent=persistent)


def test_a_retry_drops_the_micro_batches_prefetched_for_the_superseded_plan() -> None:
    """Two workers keep 4 micro-batches in flight: after step 0, steps 1 and 2's; a retry of step 0 drops them."""
    steps = [[[0, 1, 2, 3], [20, 21]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]]
    driver = ScriptedDriver([parts[0] for parts in steps], workers=2, max_microbatch=2)
    assert driver.run(steps, 2) == keys(steps)
    assert driver.feed.dropped == 4


def test_a_foresight_that_holds_drops_nothing_across_epochs() -> None:
    steps = [[[number * 6 + offset for offset in range(6)]] for number in range(8)]
    driver = ScriptedDriver([parts[0] for parts in steps], workers=2, max_microbatch=4)
    assert driver.run(steps, 4) == keys(steps)
    assert driver.feed.dropped == 0


def test_the_loader_iterated_outside_the_feed_says_how_to_iterate_it() -> None:
    driver = ScriptedDriver([[1, 2]], workers=0, max_microbatch=2)
    with pytest.raises(RuntimeError, match=r"iterate the steps, not the loader"):
        next(iter(driver.feed.loader))


def test_a_driven_sampler_has_no_length_epoch_or_state_and_takes_no_plan_arguments() -> None:
    driver = ScriptedDriver([], workers=0, max_microbatch=1)
    sampler = ManagedDistributedSampler(driver, DATASET)
    assert sampler.dataset_size == SIZE
    with pytest.raises(TypeError, match="no length"):
        len(sampler)
    calls: list[Any] = [sampler.set_epoch, lambda _: sampler.state_dict(), sampler.load_state_dict]
    for call in calls:
        with pytest.raises(RuntimeError, match="the Manager's ledger runs the epochs"):
            call(1)
    with pytest.raises(ValueError, match=r"from the lighthouse, got \{'seed': 3\}.*--seed"):
        ManagedDistributedSampler(driver, DATASET, seed=3)  # type: ignore[call-overload]
