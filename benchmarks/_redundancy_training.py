"""Section 2 of the redundancy benchmark: training runs with sharded Adam state, SIGKILLs and a checkpoint reload.

Runs :mod:`benchmarks._runtime_workers` (``ddp`` and ``stalwart`` loops with
``--optimizer adam`` and ``--overlap``/``--parity``) through the runtime
benchmark's :class:`~benchmarks.runtime.WorkerGroup`, against an embedded
lighthouse, and reads what the workers wrote.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks._runtime_workers import MODELS, build_model
from benchmarks.runtime import WorkerGroup
from stalwart.coord.server import Lighthouse
from stalwart.redundancy import Overlap, Parity
from stalwart.redundancy.config import Redundancy
from stalwart.redundancy.memory import OPTIMIZER_STATE_ELEMENTS, state_bytes
from stalwart.redundancy.placement import place, survives

RUN_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT_S = 60.0
HEARTBEAT_TIMEOUT_S = 2.0
START_TIMEOUT_S = 120.0
"""The lighthouse's join timeout: the first quorum waits this long for all workers (slow starts on 2 cores)."""


@dataclass(frozen=True)
class Config:
    """One row: DDP (``redundancy`` None) or stalwart with sharded state."""

    label: str
    redundancy: Redundancy | None

    def worker_args(self) -> list[str]:
        """The worker's loop and flags."""
        if self.redundancy is None:
            return ["ddp"]
        if isinstance(self.redundancy, Parity):
            return ["stalwart", "--parity", f"{self.redundancy.k},{self.redundancy.m}"]
        return ["stalwart", "--overlap", repr(self.redundancy.fraction)]


@dataclass(frozen=True)
class TrainingSettings:
    """Section 2's sizes: model, workers, steps, the step of the kills and the victims per failure count."""

    model: str
    workers: int
    steps: int
    warmup: int
    kill_at: int
    victims: dict[int, tuple[int, ...]]
    configs: tuple[Config, ...]
    checkpoint_every: int
    forked_workers: bool = False
    """Fork workers from one interpreter that imported torch (quick runs: start-ups are not a user's)."""


DDP = Config("DDP", None)
FULL_TRAINING = TrainingSettings(
    model="3m",
    workers=8,
    steps=24,
    warmup=3,
    kill_at=16,
    victims={1: (3,), 2: (3, 6)},
    configs=(
        DDP,
        Config("overlap 0", Overlap(0.0)),
        Config("overlap 1/8", Overlap(1 / 8)),
        Config("overlap 1/4", Overlap(1 / 4)),
        Config("overlap 1", Overlap(1.0)),
        Config("parity (7, 1)", Parity(7, 1)),
        Config("parity (6, 2)", Parity(6, 2)),
    ),
    checkpoint_every=10,
)
QUICK_TRAINING = TrainingSettings(
    model="tiny",
    workers=4,
    steps=10,
    warmup=2,
    kill_at=6,
    victims={1: (1,)},
    configs=(
        DDP,
        Config("overlap 0", Overlap(0.0)),
        Config("overlap 1/4", Overlap(1 / 4)),
        Config("parity (3, 1)", Parity(3, 1)),
    ),
    checkpoint_every=4,
    forked_workers=True,
)


@dataclass
class Failure:
    """What one SIGKILL run measured, or why it has no figures (``note``: "lost", or an error)."""

    victims: tuple[int, ...]
    positions: tuple[int, ...] = ()
    """The victims' ranks in the quorum they died in: their places in the placement (quorum ranks follow the
    order the workers first asked in, not their launch ranks)."""
    recovery_s: float | None = None
    reshard_s: float | None = None
    steps_lost: int | None = None
    note: str = ""

    @property
    def placed(self) -> tuple[int, ...]:
        """The placement positions that failed (the launch ranks if no quorum rank was recorded)."""
        return self.positions or self.victims


@dataclass
class ConfigResult:
    """One row's measurements: rank 0's step times per run, per-process state bytes, and each failure run."""

    config: Config
    step_ms: dict[int, list[float]] = field(default_factory=dict)
    cpu_ms: list[float] = field(default_factory=list)
    """Rank 0's CPU time (every thread) per step, the same steps as ``step_ms``, all runs pooled."""
    state_bytes: list[int] = field(default_factory=list)
    formula_bytes: list[int] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    """Peak memory of each process that finished a run (all runs pooled)."""
    failures: dict[int, Failure] = field(default_factory=dict)
    note: str = ""

    @property
    def step_median_ms(self) -> float | None:
        pooled = [value for values in self.step_ms.values() for value in values]
        return statistics.median(pooled) if pooled else None

    @property
    def cpu_median_ms(self) -> float | None:
        return statistics.median(self.cpu_ms) if self.cpu_ms else None

    def run_medians_ms(self) -> list[float]:
        """Each run's median step time (the spread)."""
        return [statistics.median(values) for _, values in sorted(self.step_ms.items()) if values]


def formula_state_bytes(config: Config, workers: int, parameters: int) -> list[int]:
    """What :func:`~stalwart.redundancy.memory.state_bytes` says each process holds; DDP: 3 x fp32 everywhere."""
    elements = OPTIMIZER_STATE_ELEMENTS["adam"]
    if config.redundancy is None:
        return [parameters * elements * 4] * workers
    nodes = [f"worker-{rank}" for rank in range(workers)]
    return list(state_bytes(place(config.redundancy, nodes), parameters, state_elements=elements))


def expected_to_survive(config: Config, workers: int, positions: Sequence[int]) -> bool:
    """Whether the placement covers the loss of the processes at ``positions`` (quorum ranks; the run tells)."""
    assert config.redundancy is not None
    return survives(place(config.redundancy, [f"worker-{rank}" for rank in range(workers)]), positions)


def run_training(
    settings: TrainingSettings, run_dir: Path, advance: Callable[[str], None], tick: Callable[[], None]
) -> tuple[list[ConfigResult], CheckpointRestart]:
    """Every configuration once per failure count, in an order that rotates each round; then checkpoint-restart."""
    spec = MODELS[settings.model]
    parameters = sum(param.numel() for param in build_model(spec).parameters())
    results = {config.label: ConfigResult(config) for config in settings.configs}
    for result in results.values():
        result.formula_bytes = formula_state_bytes(result.config, settings.workers, parameters)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    for round_number, failures in enumerate(sorted(settings.victims)):
        shift = round_number % len(settings.configs)
        for config in settings.configs[shift:] + settings.configs[:shift]:
            advance(f"{config.label}, {failures} failure(s)")
            _one_run(settings, results[config.label], failures, round_number, run_dir, store, tick)
    advance("checkpoint-restart")
    return list(results.values()), measure_checkpoint_restart(settings, run_dir, store, tick)


def _one_run(
    settings: TrainingSettings,
    result: ConfigResult,
    failures: int,
    round_number: int,
    run_dir: Path,
    store: dist.TCPStore,
    tick: Callable[[], None],
) -> None:
    config = result.config
    spec = MODELS[settings.model]
    name = f"{config.label.replace(' ', '_').replace('/', '-').replace('(', '').replace(')', '').replace(',', '')}"
    name = f"{name}-{round_number}"
    group = WorkerGroup(run_dir, name, settings.workers, forked=settings.forked_workers)
    victims = settings.victims[failures]
    extra = ["--optimizer", "adam", "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), *config.worker_args()[1:]]
    extra += ["--store-port", str(store.port), "--prefix", f"{name}/"]
    lighthouse: Lighthouse | None = None
    if config.redundancy is not None:
        lighthouse = Lighthouse(
            spec.plan(),
            min_replicas=1,
            start_replicas=settings.workers,
            heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
            join_timeout=START_TIMEOUT_S,
        )
        lighthouse.start()
        extra += ["--lighthouse", lighthouse.url, "--kill-at", str(settings.kill_at)]
        extra += ["--kill-ranks", *map(str, victims)]
    ledger_step = None
    try:
        for rank in range(settings.workers):
            group.start(config.worker_args()[0], spec.name, settings.steps, rank, extra)
        finished = group.wait(RUN_TIMEOUT_S, tick)
        if lighthouse is not None:
            ledger_step = int(lighthouse.status()["ledger"]["step"])
    finally:
        group.kill()
        if lighthouse is not None:
            lighthouse.stop()
    records = {rank: group.records(rank) for rank in range(settings.workers)}
    steps = [record for record in records[0] if "total" in record]
    timed = steps[settings.warmup : settings.kill_at - 1]
    result.step_ms[round_number] = [record["total"] * 1e3 for record in timed]
    result.cpu_ms += [record["cpu"] * 1e3 for record in timed]
    if not result.state_bytes:
        result.state_bytes = _state_bytes(group, records, settings)
    result.peak_bytes += group.peak_memory_bytes()
    if config.redundancy is None:
        if not finished or any(process.returncode for process in group.processes):
            result.note = f"DDP run failed: {group.log_tail(0)}"
        return
    result.failures[failures] = _failure(group, records, settings, victims, finished, ledger_step)


def _state_bytes(group: WorkerGroup, records: dict[int, list[dict[str, Any]]], settings: TrainingSettings) -> list[int]:
    """Each process's state bytes: from its step lines before the kill (stalwart) or its summary (DDP)."""
    measured = []
    for lines in records.values():
        before = [
            line["state_bytes"] for line in lines if "state_bytes" in line and line.get("step", 0) < settings.kill_at
        ]
        if before:
            measured.append(int(before[-1]))
    if len(measured) == settings.workers:
        return measured
    summaries = group.summaries()
    return [int(summary["state_bytes"]) for summary in summaries if "state_bytes" in summary]


def _failure(
    group: WorkerGroup,
    records: dict[int, list[dict[str, Any]]],
    settings: TrainingSettings,
    victims: tuple[int, ...],
    finished: bool,
    ledger_step: int | None,
) -> Failure:
    ranked = [[line["rank"] for line in records[rank] if "rank" in line] for rank in victims]
    failure = Failure(victims, tuple(sorted(ranks[-1] for ranks in ranked)) if all(ranked) else ())
    killed = [line["time"] for rank in victims for line in records[rank] if line.get("killed")]
    summaries = {summary["member"]: summary for summary in group.summaries()}
    survivors = [rank for rank in range(settings.workers) if rank not in victims]
    if any("shards_lost" in summary for summary in summaries.values()):
        failure.note = "lost"
        return failure
    codes = [group.processes[rank].returncode for rank in survivors]
    if not finished or any(codes) or len(killed) != len(victims):
        failure.note = f"run failed (exit codes {codes}, {len(killed)} kill(s) seen): {group.log_tail(survivors[0])}"
        return failure
    committed_at, reshard = [], []
    for rank in survivors:
        by_step = {line["committed"]: line for line in records[rank] if "committed" in line}
        if settings.kill_at in by_step and settings.kill_at - 1 in by_step:
            committed_at.append(by_step[settings.kill_at]["committed_at"])
            reshard.append(
                by_step[settings.kill_at]["repair_seconds"] - by_step[settings.kill_at - 1]["repair_seconds"]
            )
    if len(committed_at) == len(survivors):
        failure.recovery_s = max(committed_at) - min(killed)
        failure.reshard_s = max(reshard)
    committed = {line["committed"] for line in records[0] if "committed" in line}
    expected = set(range(settings.steps if ledger_step is None else ledger_step))
    failure.steps_lost = len(expected - committed) + max(0, settings.steps - (ledger_step or 0))
    return failure


@dataclass
class CheckpointRestart:
    """The alternative to in-memory repair: DDP with DCP checkpoints every ``every`` steps, one SIGKILL, a relaunch.

    ``first_step_s``: SIGKILL to the relaunched world's first committed step
    (every process started again, the rendezvous, ``dcp.load`` on every
    process, that step); ``step_s``: a step's median before the failure.
    """

    every: int
    first_step_s: float | None = None
    step_s: float | None = None
    retrained: int | None = None
    """Steps this run trained twice (the failure's step back to the checkpoint)."""
    peak_bytes: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def average_s(self) -> float | None:
        """SIGKILL to the failed step committed again, averaged over where in the interval the failure falls.

        A failure in the interval's step ``j`` (0 to ``every - 1``, equally
        likely) trains ``j`` more steps after the first: ``first_step_s +
        step_s * (every - 1) / 2``.
        """
        if self.first_step_s is None or self.step_s is None:
            return None
        return self.first_step_s + self.step_s * (self.every - 1) / 2


def measure_checkpoint_restart(
    settings: TrainingSettings, run_dir: Path, store: dist.TCPStore, tick: Callable[[], None]
) -> CheckpointRestart:
    """The plain DDP loop with Adam and DCP checkpoints; the first failure count's victims SIGKILLed at ``kill_at``.

    As torchelastic does, the failure ends every process and the whole world
    is launched again (a new rendezvous prefix), loading the newest checkpoint.
    """
    result = CheckpointRestart(settings.checkpoint_every)
    victims = settings.victims[min(settings.victims)]
    group = WorkerGroup(run_dir, "checkpoint-restart", settings.workers, forked=settings.forked_workers)
    checkpoints = run_dir / "checkpoint-restart-checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    common = ["--optimizer", "adam", "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), "--store-port", str(store.port)]
    common += ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(settings.checkpoint_every)]
    first = [*common, "--prefix", "checkpoint-restart-0/", "--kill-at", str(settings.kill_at)]
    first += ["--kill-ranks", *map(str, victims)]
    try:
        for rank in range(settings.workers):
            group.start("plain", settings.model, settings.steps, rank, first)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and any(group.alive(rank) for rank in victims):  # they SIGKILL themselves
            tick()
            time.sleep(0.02)
        killed = [line["time"] for rank in victims for line in group.records(rank) if line.get("killed")]
        if not killed:
            result.note = f"no SIGKILL seen: {group.log_tail(0)}"
            return result
        group.kill()  # the agent ends the survivors, which would otherwise time out in their all-reduce
        relaunched_at = time.time()
        for rank in range(settings.workers):
            group.start("plain", settings.model, settings.steps, rank, [*common, "--prefix", "checkpoint-restart-1/"])
        if not group.wait(RUN_TIMEOUT_S, tick) or any(process.returncode for process in group.processes):
            result.note = f"the relaunched world failed: {group.log_tail(0)}"
            return result
    finally:
        group.kill()
    lines = [line for line in group.records(0) if "total" in line]
    before = [line for line in lines if line["time"] < relaunched_at]  # a step's line is written at the next's top
    after = [line for line in lines if line["time"] > relaunched_at]
    result.step_ms = [line["total"] * 1e3 for line in before[settings.warmup : settings.kill_at - 1]]
    if not after or not result.step_ms:
        result.note = "no step after the relaunch" if not after else "no step before the failure"
        return result
    result.first_step_s = after[0]["time"] - min(killed)
    result.step_s = statistics.median(result.step_ms) / 1e3
    result.retrained = settings.kill_at - int(after[0]["step"])
    result.peak_bytes = group.peak_memory_bytes()
    return result
