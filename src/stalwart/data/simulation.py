"""Run the ledger through whole epochs with random failures and joins, and audit the result (pure).

This is the ledger's promise made visible, without processes or a network:
members begin each step, some die mid-step, new ones join, and at the end
each epoch's committed samples are compared with the epoch's order.

Events, all drawn from one ``numpy`` generator seeded with ``seed``, so a run
is reproducible:

* **Failures.** ``failures`` steps are drawn uniformly (with repetition) from
  the run's planned steps. At each, a random live member dies mid-step. With
  ``reassign`` the survivors take its positions in the same step
  (:meth:`DataLedger.reassign`), so the step keeps its scheduled total;
  otherwise the step commits without them and they go first into the next
  step (the proposal's ``missing_indices``), which can add a step to the
  epoch. A failure never takes the last live member: it waits for a step
  with two (one that a join brings), and one still waiting when the run ends
  is counted as unapplied.
* **Joins.** ``joins`` steps are drawn the same way; at each, a new member
  joins before the step begins: it replaces one that died, or the world grows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stalwart._validate import check_bool, check_int
from stalwart.data.audit import Coverage, coverage
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan


@dataclass(frozen=True)
class SimulationConfig:
    """What to simulate: the plan's parameters, the world and the random events."""

    dataset_size: int
    global_batch_size: int
    workers: int
    local_batch_multiple: int = 1
    failures: int = 0
    joins: int = 0
    seed: int = 0
    reassign: bool = True
    drop_last: bool = False
    epochs: int = 1

    def __post_init__(self) -> None:
        check_int("workers", self.workers, minimum=1)
        check_int("failures", self.failures, minimum=0)
        check_int("joins", self.joins, minimum=0)
        check_int("epochs", self.epochs, minimum=1)
        check_bool("reassign", self.reassign)
        self.plan()

    def plan(self) -> EpochPlan:
        """The epoch order and step schedule of the run (shuffled with ``seed``)."""
        return EpochPlan(
            self.dataset_size,
            self.global_batch_size,
            seed=self.seed,
            drop_last=self.drop_last,
            local_batch_multiple=self.local_batch_multiple,
        )


@dataclass(frozen=True)
class StepRecord:
    """One committed step.

    ``members`` began the step and ``survivors`` committed it;
    ``share_sizes`` are the survivors' committed shares in rank order, adding
    up to ``total``; ``planned_total`` is the schedule's total for the step
    (0 for a step a re-queue added); ``missing`` is how many
    ``missing_indices`` were queued when the step began (they go first);
    ``lost`` is how many positions members that died in the step held
    (reassigned to the survivors or re-queued).
    """

    epoch: int
    step: int
    members: int
    survivors: int
    share_sizes: tuple[int, ...]
    total: int
    planned_total: int
    missing: int
    lost: int
    events: tuple[str, ...]


@dataclass(frozen=True)
class SimulationSummary:
    """The audit of a run: exactly once per epoch, and whether every step kept the schedule's total."""

    epochs: int
    steps: int
    failures: int
    failures_unapplied: int
    joins: int
    final_members: int
    reassign: bool
    exactly_once: bool
    duplicates: int
    missing: int
    unexpected: int
    min_step_total: int
    max_step_total: int
    off_schedule_steps: int

    @property
    def passed(self) -> bool:
        """Exactly once, and with ``reassign`` also every step at the schedule's total (re-queue shifts totals)."""
        return self.exactly_once and (not self.reassign or self.off_schedule_steps == 0)


@dataclass(frozen=True)
class SimulationResult:
    """Every step of the run, each epoch's coverage, and the summary."""

    config: SimulationConfig
    records: list[StepRecord]
    coverage: list[Coverage]
    summary: SimulationSummary


def planned_steps(config: SimulationConfig) -> int:
    """Steps the run takes without re-queues: events are drawn among these."""
    return config.epochs * config.plan().steps_per_epoch


def simulate(config: SimulationConfig, on_step: Callable[[StepRecord], None] | None = None) -> SimulationResult:
    """Run ``config.epochs`` epochs through the ledger with the configured events; call ``on_step`` per step."""
    if not isinstance(config, SimulationConfig):
        raise TypeError(f"config must be a SimulationConfig, got {type(config).__name__}")
    plan = config.plan()
    rng = np.random.default_rng(config.seed)
    horizon = planned_steps(config)
    failure_steps = Counter(rng.integers(0, horizon, size=config.failures).tolist())
    join_steps = Counter(rng.integers(0, horizon, size=config.joins).tolist())
    ledger = DataLedger(plan)
    members = [f"worker-{number}" for number in range(config.workers)]
    next_number = config.workers
    committed: list[list[npt.NDArray[np.int64]]] = [[] for _ in range(config.epochs)]
    records: list[StepRecord] = []
    waiting_failures = applied_failures = 0
    while not (ledger.epoch == config.epochs - 1 and ledger.epoch_complete):
        events = []
        for _ in range(join_steps[ledger.step]):
            members.append(f"worker-{next_number}")
            events.append(f"worker-{next_number} joined")
            next_number += 1
        missing = ledger.missing_indices.size
        began = len(members)
        ledger.begin_step(members)
        waiting_failures += failure_steps[ledger.step]
        lost = 0
        while waiting_failures and len(ledger.members) > 1:
            live = ledger.members
            victim = live[int(rng.integers(len(live)))]
            held = ledger.in_flight[victim].size
            ledger.member_failed(victim)
            members.remove(victim)
            if config.reassign:
                ledger.reassign(ledger.members)
            events.append(f"{victim} died: {held} {'reassigned' if config.reassign else 're-queued'}")
            lost += held
            waiting_failures -= 1
            applied_failures += 1
        epoch, step = ledger.epoch, ledger.epoch_step
        in_flight = ledger.in_flight
        share_sizes = tuple(int(in_flight[member].size) for member in ledger.members)
        positions = ledger.commit()
        committed[epoch].append(plan.indices_at(epoch, positions))
        record = StepRecord(
            epoch=epoch,
            step=step,
            members=began,
            survivors=len(share_sizes),
            share_sizes=share_sizes,
            total=int(positions.size),
            planned_total=plan.step_total(step),
            missing=missing,
            lost=lost,
            events=tuple(events),
        )
        records.append(record)
        if on_step is not None:
            on_step(record)
    audits = [coverage(parts, plan.indices(epoch, 0, plan.epoch_length)) for epoch, parts in enumerate(committed)]
    totals = [record.total for record in records]
    summary = SimulationSummary(
        epochs=config.epochs,
        steps=len(records),
        failures=applied_failures,
        failures_unapplied=waiting_failures,
        joins=config.joins,
        final_members=len(members),
        reassign=config.reassign,
        exactly_once=all(audit.exactly_once for audit in audits),
        duplicates=sum(len(audit.duplicates) for audit in audits),
        missing=sum(len(audit.missing) for audit in audits),
        unexpected=sum(len(audit.unexpected) for audit in audits),
        min_step_total=min(totals),
        max_step_total=max(totals),
        off_schedule_steps=sum(1 for record in records if record.total != record.planned_total),
    )
    return SimulationResult(config=config, records=records, coverage=audits, summary=summary)
