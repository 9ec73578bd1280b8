"""Goodput benchmark: one spot-like failure trace replayed against stalwart, torchft and checkpoint-restart.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.goodput                  # 3 workers, 90 steps, 1 failure per 30 steps: a few minutes
    python -m benchmarks.goodput --quick          # 2 workers, 8 steps, one failure (at step 6)
    python -m benchmarks.goodput --rounds 3 --step-seconds 1.0 --rate 0.02

torchft 0.2.0 is optional (``pip install -e .[bench]``); without it its row
says why it was not run. Every system trains the same MLP (the runtime
benchmark's ``tiny`` model and synthetic data, :mod:`benchmarks._runtime_workers`)
with the same workers on 127.0.0.1, until it has trained the same fixed number
of distinct samples (``--steps`` steps of the global batch). Each worker's
step sleeps ``--step-seconds`` x its share of the global batch (the
accelerator's compute: a survivor carrying a larger share takes longer).

- **stalwart**: its Manager and ElasticLoader against an embedded lighthouse
  (heartbeat and collective timeouts of 1 s): constant global batch,
  exactly-once data; a relaunched worker joins and heals from its peers.
- **torchft**: torchft 0.2.0's Manager and all-reduce against its own
  lighthouse (min 1 replica, 1 s heartbeat timeout), each worker a replica
  group of one taking its fixed split of each step; the data step follows
  torchft's step, so a relaunched replica heals and resumes with the others.
  A dead replica's share of a step is not trained (lost) and the global batch
  shrinks while it is gone; it runs on until it has trained the target.
- **checkpoint-restart**: plain torch.distributed (Gloo, a static world
  through a TCPStore rendezvous) with ``torch.distributed.checkpoint`` saves every
  ``--checkpoint-every`` steps; a failure ends every worker (torchelastic
  style) and the whole world restarts from the last checkpoint once the
  replacement is there: the steps since it are trained twice.

The failure trace (:func:`benchmarks._goodput_audit.failure_trace`) has
seeded exponential inter-failure times of mean ``1 / --rate`` steps; at each,
once the job has executed that many steps, one worker (chosen by the seed) is
SIGKILLed and a replacement is launched ``--replace-delay`` seconds later
(a spot instance arriving). Every system also runs without failures, in the
same round, in an order that rotates each round. What was trained is counted
from the workers' per-step sample records (``--record-samples``), not from
what the systems claim: goodput = distinct samples trained per second from
the first committed step to the one that reached the target, as a fraction of
the same system's failure-free run. The benchmark reports; it never fails
because a goal is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from rich.console import Console
from rich.table import Column

from benchmarks._goodput_audit import Audit, Failure, audit_samples, failure_trace
from benchmarks._measure import (
    Goal,
    add_rounds,
    machine_line,
    make_console,
    positive,
    print_goals,
    print_table,
    progress_display,
    run_directory,
)
from benchmarks._rounds import fixed, interleaved_rounds, span
from benchmarks._runtime_workers import MODELS
from benchmarks._workers import TorchftLighthouse, WorkerGroup, torchft_missing
from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import read_records

MODEL = MODELS["tiny"]
HEARTBEAT_TIMEOUT = 1.0
COLLECTIVE_TIMEOUT = 1.0
POLL_S = 0.1
RUN_TIMEOUT_S = 600.0
"""A run's bound: a run still short of its target then is ended and reported as not finished."""
GOODPUT_GOAL = 0.97
SYSTEMS = ("stalwart", "torchft", "checkpoint-restart")
_PERCENT = fixed(1, 100, "%")


@dataclass(frozen=True)
class Settings:
    """One benchmark run's sizes (full or ``--quick``)."""

    workers: int
    steps: int
    rate: float
    replace_delay: float
    step_seconds: float
    checkpoint_every: int
    rounds: int
    seed: int
    forked_workers: bool = False
    """Fork workers from one interpreter that imported torch (quick runs: relaunches cost less than a user's)."""

    @property
    def target(self) -> int:
        """Distinct samples every system trains: ``steps`` steps of the global batch."""
        return self.steps * MODEL.global_batch

    @property
    def sample_seconds(self) -> float:
        """A worker's sleep per sample: its share of a step at full strength takes ``step_seconds``."""
        return self.step_seconds * self.workers / MODEL.global_batch


@dataclass(frozen=True)
class RunResult:
    """One run of one system: the failures it got, its audit and an error note ('' if it went well)."""

    system: str
    failures: int
    audit: Audit
    vacant: list[tuple[float, float]] = field(default_factory=list)
    """``time.time()`` spans in which a victim's slot was empty: its SIGKILL to its replacement's launch."""
    error: str = ""

    @property
    def seconds(self) -> float | None:
        """First committed step to the step that reached the target (None when it never did)."""
        if self.audit.first_at is None or self.audit.finished_at is None:
            return None
        return self.audit.finished_at - self.audit.first_at

    @property
    def goodput(self) -> float | None:
        """Distinct samples trained per second."""
        seconds = self.seconds
        return None if seconds is None or seconds <= 0 else self.audit.useful / seconds

    def goodput_per_worker(self, workers: int) -> float | None:
        """Distinct samples per worker-second of the machines there: the system's own loss, without the vacancy.

        A victim's slot is empty from its SIGKILL until its replacement is
        launched; the replacement's start-up, its join and a whole-world
        restart count as time the machines were there.
        """
        first, finished = self.audit.first_at, self.audit.finished_at
        if first is None or finished is None or finished <= first:
            return None
        vacant = sum(max(0.0, min(end, finished) - max(start, first)) for start, end in self.vacant)
        return self.audit.useful / (workers * (finished - first) - vacant)


@dataclass
class Row:
    """A system's runs over the rounds: ``(failure-free, with failures)`` per round."""

    system: str
    rounds: list[tuple[RunResult, RunResult]] = field(default_factory=list)
    note: str = ""

    def fractions(self) -> list[float]:
        """Each round's goodput with failures as a fraction of the failure-free run's."""
        return [
            faulty.goodput / free.goodput
            for free, faulty in self.rounds
            if free.goodput is not None and faulty.goodput is not None
        ]

    def worker_fractions(self, workers: int) -> list[float]:
        """The same per worker-second of the machines there (:meth:`RunResult.goodput_per_worker`)."""
        pairs = [(free.goodput_per_worker(workers), faulty.goodput_per_worker(workers)) for free, faulty in self.rounds]
        return [faulty / free for free, faulty in pairs if free is not None and faulty is not None]


class Job:
    """One system's workers under the replay: launch, SIGKILL, relaunch, and what they recorded."""

    def __init__(self, system: str, settings: Settings, run_dir: Path, name: str, store: dist.TCPStore) -> None:
        self.system = system
        self.settings = settings
        self.group = WorkerGroup(run_dir, name, settings.workers, forked=settings.forked_workers)
        self.incarnation = 0
        self._servers: list[Callable[[], None]] = []
        steps = settings.steps
        self.extra = [
            "--record-samples", "--sample-seconds", repr(settings.sample_seconds),
            "--collective-timeout", str(COLLECTIVE_TIMEOUT), "--store-port", str(store.port),
        ]  # fmt: skip
        if system == "stalwart":
            self.loop = "stalwart"
            lighthouse = Lighthouse(
                MODEL.plan(),
                min_replicas=1,
                start_replicas=settings.workers,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
                join_timeout=5.0,
            )
            lighthouse.start()
            self._servers.append(lighthouse.stop)
            self.extra += ["--lighthouse", lighthouse.url]
        elif system == "torchft":
            self.loop = "torchft"
            theirs = TorchftLighthouse(1, heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT * 1000), join_timeout_ms=1000)
            self._servers.append(theirs.stop)
            self.extra += ["--lighthouse", theirs.address, "--min-replicas", "1", "--elastic"]
            steps = 3 * settings.steps  # it runs on until the driver has seen the target trained
        else:
            self.loop = "plain"
            checkpoints = run_dir / f"{name}-checkpoints"
            checkpoints.mkdir(parents=True, exist_ok=True)
            self.extra += ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(settings.checkpoint_every)]
        self.steps = steps

    @property
    def restarts_all(self) -> bool:
        """Whether a failure ends the whole world (checkpoint-restart)."""
        return self.system == "checkpoint-restart"

    def launch(self, rank: int) -> None:
        """Start (or relaunch) worker ``rank``; checkpoint-restart's incarnations rendezvous under their own prefix."""
        prefix = f"{self.group.name}-{self.incarnation}/"
        self.group.start(self.loop, MODEL.name, self.steps, rank, [*self.extra, "--prefix", prefix])

    def audit(self) -> Audit:
        """What the workers recorded so far, counted against the target."""
        records = [
            record
            for rank in range(self.settings.workers)
            for record in read_records(self.group.run_dir / f"{self.group.name}-worker-{rank}.samples.jsonl")
        ]
        return audit_samples(
            records, MODEL.global_batch, self.settings.target, quorum_records=self.system == "stalwart"
        )

    def close(self) -> None:
        """End every worker and the coordination servers."""
        self.group.kill()
        for stop in self._servers:
            with contextlib.suppress(Exception):
                stop()


def replay(job: Job, trace: Sequence[Failure], tick: Callable[[], None]) -> RunResult:
    """Run ``job`` until it has trained the target, injecting ``trace``'s failures as it goes (bounded in time)."""
    workers = job.settings.workers
    upcoming = list(trace)
    relaunch_at: dict[int, float] = {}
    vacant_since: dict[int, float] = {}
    vacant: list[tuple[float, float]] = []
    injected = 0
    error = ""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for rank in range(workers):
            job.launch(rank)
        while True:
            exited = not any(job.group.alive(rank) for rank in range(workers))
            audit = job.audit()
            if audit.finished_at is not None:
                break
            now = time.monotonic()
            if now > deadline:
                error = f"not finished after {RUN_TIMEOUT_S:.0f} s: {job.group.log_tail(0)}"
                break
            if exited and not relaunch_at:
                error = f"the workers exited short of the target: {job.group.log_tail(0)}"
                break
            if upcoming and audit.progress >= upcoming[0].at:
                victim = _victim(job, upcoming.pop(0).victim, relaunch_at)
                if victim is not None:
                    job.group.kill_one(victim)
                    vacant_since[victim] = time.time()
                    injected += 1
                    doomed = range(workers) if job.restarts_all else [victim]
                    for rank in doomed:
                        job.group.kill_one(rank)
                        relaunch_at[rank] = now + job.settings.replace_delay
            due = [rank for rank, moment in relaunch_at.items() if moment <= now]
            if due and job.restarts_all:
                if len(due) < len(relaunch_at):
                    due = []  # the whole world restarts together, once the last replacement is there
                else:
                    job.incarnation += 1
            for rank in due:
                del relaunch_at[rank]
                job.launch(rank)
                if rank in vacant_since:
                    vacant.append((vacant_since.pop(rank), time.time()))
            tick()
            time.sleep(POLL_S)
    finally:
        job.close()
    vacant += [(since, time.time()) for since in vacant_since.values()]
    return RunResult(job.system, injected, audit, vacant, error)


def _victim(job: Job, chosen: int, relaunching: dict[int, float]) -> int | None:
    """``chosen`` if it runs and is not the last worker running; None otherwise (the failure is skipped).

    A reclaim of a machine that is already gone changes nothing; sparing the
    last worker keeps every system out of a whole-fleet loss, which none of
    them survives without a checkpoint of its own (stalwart and torchft here
    have none).
    """
    running = [rank for rank in range(job.settings.workers) if job.group.alive(rank) and rank not in relaunching]
    return chosen if chosen in running and len(running) > 1 else None


def measure(
    settings: Settings, run_dir: Path, systems: Sequence[str], console: Console
) -> tuple[list[Row], list[Failure]]:
    """Every system without and with the trace's failures, ``rounds`` times, in an order that rotates each round."""
    trace = failure_trace(settings.rate, settings.workers, 3 * settings.steps, settings.seed)
    rows = {system: Row(system) for system in systems}
    missing = torchft_missing()
    if missing and "torchft" in rows:
        rows["torchft"].note = missing
    runnable = [system for system in systems if not rows[system].note]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    with progress_display(console) as progress:
        task = progress.add_task("starting", total=2 * settings.rounds * len(runnable))

        def measure(system: str, round_number: int) -> tuple[RunResult, RunResult]:
            results = []
            for label, failures in (("failure-free", []), ("with failures", trace)):
                progress.update(task, description=f"round {round_number + 1}: {system}, {label}")
                name = f"{system}-{round_number}-{'free' if not failures else 'faulty'}"
                results.append(replay(Job(system, settings, run_dir, name, store), failures, progress.refresh))
                progress.advance(task)
            return results[0], results[1]

        if runnable:
            for system, pairs in interleaved_rounds(runnable, settings.rounds, measure).items():
                rows[system].rounds = pairs
    return list(rows.values()), trace


def print_results(console: Console, rows: Sequence[Row], trace: Sequence[Failure], settings: Settings) -> None:
    """The systems side by side: time to the target, goodput against their own failure-free run, lost, twice."""
    stalwart = next((row for row in rows if row.system == "stalwart" and row.rounds), None)
    lines = []
    for row in rows:
        if not row.rounds:
            lines.append([row.system, *["-"] * 9, row.note])
            continue
        free = [r.seconds for r, _ in row.rounds if r.seconds is not None]
        faulty = [r.seconds for _, r in row.rounds if r.seconds is not None]
        fractions = row.fractions()
        errors = "; ".join(r.error for pair in row.rounds for r in pair if r.error)
        versus = "-"
        if stalwart is not None and faulty:
            ours = [r.seconds for _, r in stalwart.rounds if r.seconds is not None]
            versus = f"{statistics.median(faulty) / statistics.median(ours):.2f}x" if ours else "-"
        lines.append(
            [
                row.system,
                ", ".join(str(faulty_run.failures) for _, faulty_run in row.rounds),
                _median_s(free),
                _median_s(faulty),
                versus,
                _percent(fractions),
                span(fractions, _PERCENT),
                _percent(row.worker_fractions(settings.workers)),
                ", ".join(str(faulty_run.audit.lost) for _, faulty_run in row.rounds),
                ", ".join(str(faulty_run.audit.twice) for _, faulty_run in row.rounds),
                errors or _free_note(row),
            ]
        )
    failures = ", ".join(f"step {f.at} (worker {f.victim})" for f in trace[:12])
    print_table(
        console,
        f"Goodput under one failure trace: {settings.workers} workers, {settings.steps} steps of "
        f"{MODEL.global_batch} samples, 1 failure per {1 / settings.rate:g} steps",
        [
            Column("system", justify="left"),
            "failures",
            "failure-free (s)",
            "with failures (s)",
            "vs stalwart",
            "goodput",
            "by round",
            "per worker-second",
            "samples lost",
            "trained twice",
            Column("note", justify="left", max_width=60),
        ],
        lines,
        caption=(
            f"Trace (seed {settings.seed}): {failures or 'none'}{' ...' if len(trace) > 12 else ''}; each SIGKILLs "
            "the worker once the job has executed that many steps (skipped when it is down or the last one "
            f"running); its replacement starts {settings.replace_delay:g} s later. Times: first committed step to "
            f"the step that completed the {settings.target} distinct samples, median over {settings.rounds} "
            "round(s); 'vs stalwart' = ratio of the times with failures. goodput = distinct samples per second "
            "with failures / failure-free, median and range over rounds; 'per worker-second': the same per "
            "second of the workers' machines that were there (a victim's slot is empty from its SIGKILL to its "
            "replacement's launch), the system's own loss without the missing machine's. Lost and twice: each "
            "round's run with failures, counted from the workers' sample records. Simulated accelerator compute: "
            f"{settings.step_seconds:g} s per step at full strength; checkpoint-restart saves every "
            f"{settings.checkpoint_every} steps."
        ),
    )


def _percent(values: Sequence[float]) -> str:
    return _PERCENT(statistics.median(values)) if values else "-"


def _median_s(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "-"


def _free_note(row: Row) -> str:
    """What the failure-free runs lost or repeated, if anything (torchft: replicas that joined late)."""
    lost = [free.audit.lost for free, _ in row.rounds]
    twice = [free.audit.twice for free, _ in row.rounds]
    if not any(lost) and not any(twice):
        return ""
    return f"failure-free runs: lost {', '.join(map(str, lost))}; twice {', '.join(map(str, twice))}"


def goals(rows: Sequence[Row], settings: Settings) -> list[Goal]:
    """The issue's goal: stalwart keeps >= 97% goodput with 0 lost and 0 twice, and beats both others."""
    by_system = {row.system: row for row in rows}
    stalwart = by_system.get("stalwart")
    if stalwart is None or not stalwart.fractions():
        return [Goal("stalwart's goodput under failures", None, "stalwart was not measured")]
    fractions = stalwart.fractions()
    worst = min(fractions)
    lost = max(faulty.audit.lost for _, faulty in stalwart.rounds)
    twice = max(faulty.audit.twice for _, faulty in stalwart.rounds)
    result = [
        Goal(
            f"stalwart keeps at least {GOODPUT_GOAL:.0%} of its failure-free goodput at 1 failure per "
            f"{1 / settings.rate:g} steps",
            worst >= GOODPUT_GOAL,
            f"worst round {worst:.1%}, median {statistics.median(fractions):.1%}",
        ),
        Goal("stalwart loses no sample and trains none twice", lost == 0 and twice == 0, f"lost {lost}, twice {twice}"),
    ]
    others = [by_system[name] for name in SYSTEMS[1:] if name in by_system]
    measured = [row for row in others if row.fractions()]
    if len(measured) < len(others) or not others:
        detail = "; ".join(f"{row.system}: {row.note or 'not measured'}" for row in others if not row.fractions())
        result.append(Goal("stalwart's goodput beats torchft's and checkpoint-restart's", None, detail or "-"))
    else:
        ours = statistics.median(fractions)
        detail = "; ".join(f"{row.system} {statistics.median(row.fractions()):.1%}" for row in measured)
        met = all(ours > statistics.median(row.fractions()) for row in measured)
        result.append(
            Goal("stalwart's goodput beats torchft's and checkpoint-restart's", met, f"stalwart {ours:.1%}; {detail}")
        )
    return result


FULL = Settings(
    workers=3, steps=90, rate=1 / 30, replace_delay=3.0, step_seconds=0.4, checkpoint_every=10, rounds=1, seed=0
)
QUICK = Settings(
    workers=2,
    steps=8,
    rate=1 / 6,
    replace_delay=0.5,
    step_seconds=0.05,
    checkpoint_every=4,
    rounds=1,
    seed=5,
    forked_workers=True,
)
"""The smallest run that fails every system once: seed 5's trace fails worker 1 at step 6, next at step 16."""


def parse_settings(argv: Sequence[str] | None) -> tuple[Settings, argparse.Namespace]:
    """The run's settings: full or ``--quick``, with the command line's changes."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 workers, 8 steps, one failure (at step 6)")
    parser.add_argument("--workers", type=positive(int), help=f"worker processes (default {FULL.workers})")
    parser.add_argument("--steps", type=positive(int), help=f"steps of the target (default {FULL.steps})")
    parser.add_argument("--rate", type=positive(float), help="failures per step (default 1/30)")
    parser.add_argument("--replace-delay", type=positive(float), help="seconds until a replacement starts")
    parser.add_argument("--step-seconds", type=positive(float), help="simulated compute of a step (s)")
    parser.add_argument("--checkpoint-every", type=positive(int), help="checkpoint-restart's K (steps)")
    add_rounds(parser)
    parser.add_argument("--seed", type=int, help="seed of the failure trace")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep worker logs and sample records here")
    args = parser.parse_args(argv)
    systems = tuple(name.strip() for name in args.systems.split(",") if name.strip())
    if not systems or any(name not in SYSTEMS for name in systems):
        parser.error(f"--systems: expected a comma-separated list of {', '.join(SYSTEMS)}, got {args.systems!r}")
    if args.workers is not None and args.workers < 2:
        parser.error(f"--workers: expected at least 2, got {args.workers}")
    args.systems = systems
    base = QUICK if args.quick else FULL
    changes = {
        name: getattr(args, name)
        for name in ("workers", "steps", "rate", "replace_delay", "step_seconds", "checkpoint_every", "rounds", "seed")
        if getattr(args, name) is not None
    }
    return Settings(**{**base.__dict__, **changes}), args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its table and goals; return 0 unless it crashed."""
    settings, args = parse_settings(argv)
    console = make_console()
    machine_line(console, args.quick, forked=settings.forked_workers)
    with run_directory(args.run_dir, "stalwart-bench-goodput-") as run_dir:
        rows, trace = measure(settings, run_dir, args.systems, console)
    print_results(console, rows, trace, settings)
    print_goals(console, goals(rows, settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
