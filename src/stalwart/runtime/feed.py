"""A user's own DataLoader under the Manager: ``ManagedDistributedSampler(manager, dataset)`` as its batch sampler.

The loop::

    sampler = ManagedDistributedSampler(manager, dataset)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=4, pin_memory=True)
    for step in manager.steps(loader, max_steps=10_000):
        for inputs, targets in step:           # this process's part of the step, in micro-batches
            step.backward(loss_fn(model(inputs), targets))

The problem (the proposal's review)
    A DataLoader draws index lists from its batch sampler ahead of training
    (``prefetch_factor * num_workers`` of them in flight), so when a member
    dies mid-step the micro-batches already in flight were cut for a share
    that no longer holds, while the survivors must now load the positions
    they took over. The step must still train on exactly the ledger's
    samples: none twice, none lost.

The protocol
    The sampler does not decide anything: each micro-batch it hands the
    DataLoader comes from this feed's *plan*, the micro-batches this process
    will need in order: the current step's part, then the part of each later
    step as it will be if the quorum holds (replayed on a copy of the ledger,
    up to ``max_steps``). Every micro-batch handed out is recorded, in order,
    with the plan's *generation*. A DataLoader returns batches in the order
    its sampler yielded them (``in_order=True``, the default), so the n-th
    batch received is the n-th recorded micro-batch: its tag.

    When the Manager needs a part (a step begins, or a failure retry hands
    this process more positions), the feed checks that the plan's next
    micro-batches are exactly that part's. If they are not (the quorum
    changed, a retry), it *replans*: a new generation whose plan is the part
    needed now, then the later steps as foreseen from the ledger as it is
    now. Batches received with an older generation's tag are loaded for a
    superseded plan: they are dropped, never given to the training loop, and
    each one received lets the DataLoader draw one micro-batch of the new
    plan. A batch of the current generation must be the part's next
    micro-batch, else the feed raises (it cannot happen while the DataLoader
    keeps its order). Only batches given to the loop count as produced:
    their ``(epoch, index)`` keys feed the Manager's audit checksum, which
    must match the ledger's positions of the step.

    Prefetch therefore crosses step and epoch boundaries as the DataLoader
    allows, and costs nothing while the quorum holds; a change drops at most
    the micro-batches in flight. When the plan ends (``max_steps`` reached, or
    several foreseen steps in a row give this process nothing), the sampler's
    pass ends; a later need opens a new pass with ``iter(loader)``.

Requirements
    Iterate the DataLoader only through ``manager.steps(loader)`` (a pass
    opened elsewhere raises), keep ``in_order=True``, and make a sample's
    loading deterministic in ``(epoch, index)`` (random augmentation seeded by
    them, as :func:`~stalwart.runtime.loader.sample_generator` does), since a
    survivor loads positions another member would have loaded. The DataLoader's
    workers start inside ``manager.steps()``, after the Manager's heartbeat
    thread: with the ``fork`` start method they run only the dataset's code,
    so a dataset that takes locks other threads may hold should use
    ``multiprocessing_context="forkserver"``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader

from stalwart.data.sampler import ManagedDistributedSampler
from stalwart.data.schedule import split_microbatches

log = logging.getLogger(__name__)

Load = tuple[int, tuple[int, ...]]
"""One micro-batch to load: (epoch, dataset indices)."""
Key = tuple[int, int]
"""A sample: (epoch, dataset index)."""
Foresight = Callable[[], Iterator[tuple[int, list[int]]]]
"""Returns this process's part of each step after the current one, as (epoch, indices), if the quorum holds."""

MAX_EMPTY_LOOKAHEAD = 8
"""Foreseen steps in a row with nothing for this process after which the plan (and the pass) ends."""


class SamplerFeed:
    """The Manager's side of a Manager-driven sampler: plans what the DataLoader loads, checks what it returns."""

    def __init__(self, loader: DataLoader[Any], max_microbatch: int, foresee: Foresight) -> None:
        self.loader = loader
        self.max_microbatch = max_microbatch
        self.dropped = 0
        """Micro-batches received for a superseded plan and dropped (over the feed's life)."""
        self._foresee = foresee
        self._generation = 0
        self._handed: deque[tuple[int, Load]] = deque()
        self._pending: deque[Load] = deque()
        self._future: Iterator[tuple[int, list[int]]] = iter(())
        self._iterator: Iterator[Any] | None = None
        self._opening = False
        self._produced: list[Key] = []

    @classmethod
    def of(cls, loader: Any, driver: object, max_microbatch: int, foresee: Foresight) -> SamplerFeed:
        """The feed of ``loader``, a DataLoader whose batch sampler ``driver`` (the Manager) drives; checked."""
        if not isinstance(loader, DataLoader):
            raise TypeError(f"loader must be an ElasticLoader or a torch DataLoader, got {type(loader).__name__}")
        sampler = loader.batch_sampler
        if not isinstance(sampler, ManagedDistributedSampler) or sampler.driver is not driver:
            raise ValueError(
                f"loader's batch_sampler must be ManagedDistributedSampler(manager, dataset) of this Manager, got "
                f"{type(sampler).__name__}: build it as DataLoader(dataset, batch_sampler=ManagedDistributedSampler("
                "manager, dataset), ...)"
            )
        if not getattr(loader, "in_order", True):
            raise ValueError("loader must have in_order=True: each batch is matched with its micro-batch by order")
        size = len(loader.dataset)  # type: ignore[arg-type]
        if size != sampler.dataset_size:
            raise ValueError(
                f"loader's dataset has {size} samples but its ManagedDistributedSampler was built for "
                f"{sampler.dataset_size}: give both the same dataset"
            )
        return cls(loader, max_microbatch, foresee)

    def sampler_pass(self) -> Iterator[list[int]]:
        """A pass of the sampler: yields each planned micro-batch's indices, recording it as handed out."""
        if not self._opening:
            raise RuntimeError(
                "a DataLoader over ManagedDistributedSampler(manager, dataset) is iterated by manager.steps(loader) "
                "only: iterate the steps, not the loader"
            )
        return self._hand_out()

    def microbatches(self, epoch: int, indices: Sequence[int], max_microbatch: int) -> Iterator[Any]:
        """The user's batches of ``indices`` of ``epoch``, in micro-batches of at most ``max_microbatch``."""
        wanted = [(epoch, tuple(chunk)) for chunk in split_microbatches(list(indices), max_microbatch)]
        if wanted and not self._planned(wanted):
            self._replan(wanted)
        for load in wanted:
            yield self._receive(load)

    def take_produced(self) -> list[Key]:
        """The ``(epoch, index)`` of every sample in the batches given out since the last call (then forgotten)."""
        produced, self._produced = self._produced, []
        return produced

    def take_row_checksum(self) -> int:
        """0: the DataLoader hands out collated batches, so their rows are not seen here, only their positions."""
        return 0

    def close(self) -> None:
        """End the DataLoader's pass, and with it its worker processes (persistent ones too)."""
        self._iterator = None
        self._handed.clear()
        if getattr(self.loader, "_iterator", None) is not None:
            self.loader._iterator = None  # the iterator a persistent_workers DataLoader keeps for its next pass

    def _hand_out(self) -> Iterator[list[int]]:
        while self._pending or self._extend():
            load = self._pending.popleft()
            self._handed.append((self._generation, load))
            yield list(load[1])

    def _extend(self) -> bool:
        """Plan the next foreseen step that gives this process something; False when the plan ends."""
        for _, (epoch, indices) in zip(range(MAX_EMPTY_LOOKAHEAD), self._future, strict=False):
            if indices:
                chunks = split_microbatches(indices, self.max_microbatch)
                self._pending.extend((epoch, tuple(chunk)) for chunk in chunks)
                return True
        self._future = iter(())
        return False

    def _planned(self, wanted: list[Load]) -> bool:
        """Whether the plan's next micro-batches (handed out or not) are exactly ``wanted``."""
        handed = [load for generation, load in self._handed if generation == self._generation]
        while len(handed) + len(self._pending) < len(wanted) and self._extend():
            pass
        upcoming = handed + list(self._pending)
        return upcoming[: len(wanted)] == wanted

    def _replan(self, wanted: list[Load]) -> None:
        stale = sum(1 for generation, _ in self._handed if generation == self._generation)
        self._generation += 1
        self._pending = deque(wanted)
        self._future = self._foresee()
        if stale:
            log.info("dropping %d prefetched micro-batches of a superseded share", stale)

    def _receive(self, load: Load) -> Any:
        """The next batch of the current plan, which must be ``load``; superseded ones are dropped on the way."""
        while True:
            batch = self._next_batch()
            generation, handed = self._handed.popleft()
            if generation != self._generation:
                self.dropped += 1
                continue
            if handed != load:
                raise RuntimeError(
                    f"the DataLoader returned the micro-batch of epoch {handed[0]} indices {list(handed[1])} where "
                    f"the step needs epoch {load[0]} indices {list(load[1])}: is it iterated elsewhere?"
                )
            self._produced.extend((load[0], index) for index in load[1])
            return batch

    def _next_batch(self) -> Any:
        """The DataLoader's next batch, opening a new pass when the last one ended (its plan had ended)."""
        for _ in range(2):
            if self._iterator is None:
                self._opening = True
                try:
                    self._iterator = iter(self.loader)
                finally:
                    self._opening = False
            try:
                return next(self._iterator)
            except StopIteration:
                self._iterator = None
        raise RuntimeError("the DataLoader's new pass yielded nothing though the step needs micro-batches")
