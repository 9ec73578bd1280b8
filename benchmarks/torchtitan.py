"""torchtitan benchmark: plain torchtitan, torchtitan with torchft's integration and with stalwart's, on
the same model, data and seeds: step time, and one SIGKILL of a replica group and its restart.

Run from the repository root, with the virtual environment active (the ``torchtitan`` extra installed)::

    python -m benchmarks.torchtitan              # 2 rounds of 16 steps, then the failure runs: ~10 min on 2 cores
    python -m benchmarks.torchtitan --quick      # 1 round of 10 steps, then the failure runs: ~5 min
    python -m benchmarks.torchtitan --legs torchft --skip-step-time --run-dir /tmp/tt   # one leg's failure run
    python -m benchmarks.torchtitan --legs torchtitan torchtitan-fsdp stalwart --failure-runs 0   # step time only

Every leg trains torchtitan 0.3.0's llama3 debug model on CPU through the
tests' launcher (:mod:`stalwart.testing.torchtitan_cpu`: Gloo, eager
attention), on the generated corpus and tokenizer
(:mod:`stalwart.testing.torchtitan_assets`), sequence length 128, 2 samples
per process per step, seed 7, two processes in all:

- ``torchtitan``: plain torchtitan, one ``torchrun`` job of 2 processes
  replicating the whole model (``--parallelism.data-parallel-replicate-degree
  2 --parallelism.data-parallel-shard-degree 1``: torchtitan's HSDP with
  shards of one, an all-reduce of the gradients), no fault tolerance: the
  baseline of every ratio, the layout the fault-tolerant legs train in (each
  replica group one process holding the whole model);
- ``torchtitan-fsdp``: plain torchtitan sharding the model over the 2
  processes (FSDP2, torchtitan's default): a different layout, for reference;
- ``torchft``: torchtitan's ``torchft`` experiment (``FaultTolerantTrainer``,
  ``--module torchft.llama3``), two replica groups of one process each (one
  ``torchrun`` per group) against torchft's lighthouse on 127.0.0.1, Gloo
  between groups, a step's all-reduce across groups (no semi-sync), its
  per-replica dataloader checkpoints every :data:`CHECKPOINT_INTERVAL` steps
  (which its live recovery needs enabled);
- ``stalwart``: stalwart's torchtitan trainer
  (:mod:`stalwart.integrations.torchtitan`, ``--module
  stalwart.integrations.torchtitan``), two replica groups of one process
  each (one ``torchrun`` per group) against stalwart's lighthouse on
  127.0.0.1, the global batch of the plain job (2 processes x 2 samples)
  kept constant across the groups, the step's reduction across groups over
  Gloo; further legs register in :data:`LEGS`.

Two measurements, each a table:

1. **Step time without failures**: the median time between a process's
   batches (top of one step to the next, from the launcher's audit) after the
   first :data:`WARMUP_STEPS`, legs in an order rotating each round; the ratio
   to plain torchtitan's of the same round, median and spread.
2. **One SIGKILL of a replica group and its restart** (fault-tolerant legs):
   group B's processes are SIGKILLed when it takes the batch of a step drawn
   from ``--seed`` (the same step for every leg), and relaunched once group A
   has trained on without it (``--failure-runs N``: N runs, seeds ``--seed``
   and on); A is held two steps after the kill (the
   launcher's hold file) until the relaunched B's trainer is built, so the
   job cannot end before B is back, however slow its restart. Reported: **recovery** (SIGKILL -> A's
   first step committed after it), **rejoin** (relaunch -> B's first committed
   step) and whether B **rejoined** (it committed a step, and A committed one
   after that: both trained on together), samples **lost** (trained by the
   leg's failure-free run, never by this one) and **trained twice**, from the
   launcher's audit of every batch a process took (a step in flight at the
   kill is not trained), the **final loss** against the leg's failure-free
   run's, each group's exit status, and the first error a group logged.

Every wait is bounded (:data:`WAIT_LIMIT`); a leg whose processes fail is
reported as measured. The benchmark reports; it never fails because a goal
is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.markup import escape

from benchmarks._measure import (
    Goal,
    add_rounds,
    machine_line,
    make_console,
    print_goals,
    print_table,
    progress_display,
    run_directory,
)
from benchmarks._rounds import fixed, interleaved_rounds, median_span, round_ratios
from benchmarks._workers import TorchftLighthouse, torchft_missing
from stalwart.coord.server import Lighthouse
from stalwart.testing import torchtitan_audit, torchtitan_cpu
from stalwart.testing.torchrun import TorchrunGroup
from stalwart.testing.torchtitan_assets import TorchtitanAssets, write_assets
from stalwart.testing.torchtitan_log import step_records
from stalwart.testing.waiting import wait_until

SEQ_LEN = 128
LOCAL_BATCH = 2
SEED = 7
DOCUMENTS = 1000
"""Corpus documents (~100k tokens): no run reaches the end of a process's share, so every sample is trained once."""
CHECKPOINT_INTERVAL = 4
WARMUP_STEPS = 3
WAIT_LIMIT = 300.0
"""Seconds any single wait may take (a bound, not an expectation: a leg that overstays it is reported so)."""
STEP_GOAL = 1.03


@dataclass(frozen=True)
class Setup:
    """What every leg shares: the data, the steps, the seed; and where this run writes."""

    assets: TorchtitanAssets
    steps: int
    run_dir: Path
    hold: Path | None = None
    """A hold file the groups' processes obey (:mod:`stalwart.testing.torchtitan_audit`), for failure runs."""

    def torchtitan_flags(self, dump: Path) -> list[str]:
        """The flags common to every leg (model and config come from the leg)."""
        return [
            *self.assets.flags(),
            "--training.seq-len", str(SEQ_LEN),
            "--training.local-batch-size", str(LOCAL_BATCH),
            "--training.steps", str(self.steps),
            "--debug.seed", str(SEED),
            "--metrics.disable-color-printing",
            "--profiler.no-enable-profiling",
            "--dump-folder", str(dump),
        ]  # fmt: skip


GroupLauncher = Callable[[str, Path], TorchrunGroup]
"""Launch (or relaunch) replica group ``label`` writing under a run directory; its torchrun launch."""


@dataclass(frozen=True)
class Leg:
    """One way of training the same job. ``groups``: the replica groups' labels (the first is A, the second, if
    any, the one SIGKILLed). ``session(setup)``: a context (a lighthouse, ...) yielding the group launcher.
    ``commit_times(log)``: when each step was committed, from a group's log. ``missing()``: why it cannot run."""

    name: str
    groups: tuple[str, ...]
    session: Callable[[Setup], contextlib.AbstractContextManager[GroupLauncher]]
    commit_times: Callable[[str], list[float]]
    missing: Callable[[], str | None] = lambda: None

    @property
    def fault_tolerant(self) -> bool:
        return len(self.groups) > 1


def _log_time(stamp: str) -> float:
    """A torchtitan log stamp (``2026-12-06 10:23:40,534``, local time) as ``time.time()``."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


_STEP_LINE = re.compile(r"^\[titan\] (\S+ \S+) - root - INFO - step:\s*\d+\s+loss:", re.MULTILINE)
_TORCHFT_COMMIT = re.compile(r"^\[titan\] (\S+ \S+) - torchft\.manager - INFO - .*should_commit=True", re.MULTILINE)
_FATAL_LINE = re.compile(r"^\[rank\d+\]: (\w*(?:Error|Exception)\b.*)$", re.MULTILINE)
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(\w*(?:Error|Exception)\b.*)$", re.MULTILINE)


def step_line_times(log: str) -> list[float]:
    """When torchtitan logged each step (after its optimizer step): plain torchtitan's commits."""
    return [_log_time(stamp) for stamp in _STEP_LINE.findall(log)]


def torchft_commit_times(log: str) -> list[float]:
    """When torchft's Manager decided to commit a step (``should_commit=True``)."""
    return [_log_time(stamp) for stamp in _TORCHFT_COMMIT.findall(log)]


def first_error(log: str) -> str:
    """The error that ended a group (the last a rank's traceback names), else the first exception line it logged
    (empty if none)."""
    fatal = _FATAL_LINE.findall(log)
    match = _ERROR_LINE.search(log)
    return (fatal[-1] if fatal else match.group(1) if match else "")[:160]


def group_environment(setup: Setup, label: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment for group ``label``, auditing into the run directory."""
    env = torchtitan_cpu.environment(setup.run_dir)
    env[torchtitan_audit.AUDIT_DIR_ENV] = str(setup.run_dir / "audit")
    env[torchtitan_audit.AUDIT_LABEL_ENV] = label
    if setup.hold is not None:
        env[torchtitan_audit.HOLD_ENV] = str(setup.hold)
    env.setdefault("RUST_LOG", "warn")
    return {**env, **(extra or {})}


REPLICATED = ("--parallelism.data-parallel-replicate-degree", "2", "--parallelism.data-parallel-shard-degree", "1")
"""Plain torchtitan's layout of the fault-tolerant legs: the whole model on each of the 2 processes."""
SHARDED = ("--parallelism.data-parallel-replicate-degree", "1", "--parallelism.data-parallel-shard-degree", "2")
"""Plain torchtitan's default layout on 2 processes: FSDP2 shards the model over both."""


def plain_session(layout: Sequence[str]) -> Callable[[Setup], contextlib.AbstractContextManager[GroupLauncher]]:
    """Plain torchtitan: one torchrun job of two processes in data-parallel ``layout`` (torchtitan's flags)."""

    @contextlib.contextmanager
    def session(setup: Setup) -> Iterator[GroupLauncher]:
        def launch(label: str, run_dir: Path) -> TorchrunGroup:
            args = ["--module", "llama3", "--config", "llama3_debugmodel", *setup.torchtitan_flags(run_dir / label)]
            return TorchrunGroup(
                torchtitan_cpu.torchrun_command(2, [*args, *layout]),
                run_dir / f"{label}.log",
                group_environment(setup, label),
            )

        yield launch

    return session


@contextlib.contextmanager
def torchft_session(setup: Setup) -> Iterator[GroupLauncher]:
    """torchtitan's torchft experiment: replica groups ``A`` (replica 0) and ``B`` (1) of one process each, against
    torchft's lighthouse (min 1 replica; it waits up to 10 s for both at the start, drops a silent one after 2 s)."""
    lighthouse = TorchftLighthouse(min_replicas=1, heartbeat_timeout_ms=2000, join_timeout_ms=10000)
    try:

        def launch(label: str, run_dir: Path) -> TorchrunGroup:
            replica = "AB".index(label)
            dump = run_dir / label
            args = [
                "--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel",
                *setup.torchtitan_flags(dump),
                "--fault-tolerance.enable",
                "--fault-tolerance.replica-id", str(replica),
                "--fault-tolerance.group-size", "2",
                "--fault-tolerance.min-replica-size", "1",
                "--fault-tolerance.process-group", "gloo",
                "--fault-tolerance.semi-sync-method", "None",
                "--checkpoint.enable",
                "--checkpoint.interval", str(CHECKPOINT_INTERVAL),
                "--checkpoint.folder", str(run_dir / "checkpoints"),
                "--comm.train-timeout-seconds", "60",
            ]  # fmt: skip
            env = group_environment(setup, label, {"TORCHFT_LIGHTHOUSE": lighthouse.address})
            return TorchrunGroup(torchtitan_cpu.torchrun_command(1, args), run_dir / f"{label}.log", env)

        yield launch
    finally:
        lighthouse.stop()


@contextlib.contextmanager
def stalwart_session(setup: Setup) -> Iterator[GroupLauncher]:
    """stalwart's torchtitan trainer: replica groups ``A`` (replica 0) and ``B`` (1) of one process each, against
    an embedded lighthouse (the plan the trainers offer; both awaited at the start; a silent member dropped after
    2 s, as torchft's leg)."""
    options = {"min_replicas": 1, "start_replicas": 2, "heartbeat_timeout": 2.0, "join_timeout": 60.0}
    with Lighthouse(None, **options) as lighthouse:

        def launch(label: str, run_dir: Path) -> TorchrunGroup:
            args = [
                "--module", "stalwart.integrations.torchtitan", "--config", "llama3_debugmodel",
                *setup.torchtitan_flags(run_dir / label),
                "--training.global-batch-size", str(2 * LOCAL_BATCH),
                "--fault-tolerance.replica-id", str("AB".index(label)),
            ]  # fmt: skip
            env = group_environment(setup, label, {"STALWART_LIGHTHOUSE": lighthouse.url})
            return TorchrunGroup(torchtitan_cpu.torchrun_command(1, args), run_dir / f"{label}.log", env)

        yield launch


LEGS: dict[str, Leg] = {
    "torchtitan": Leg("torchtitan", ("job",), plain_session(REPLICATED), step_line_times),
    "torchtitan-fsdp": Leg("torchtitan-fsdp", ("job",), plain_session(SHARDED), step_line_times),
    "torchft": Leg("torchft", ("A", "B"), torchft_session, torchft_commit_times, torchft_missing),
    "stalwart": Leg("stalwart", ("A", "B"), stalwart_session, step_line_times),
}
"""The legs, in table order; the first is every ratio's baseline."""


@dataclass
class RunResult:
    """One run of a leg: its audit, each group's log and exit status, and what the failure run measured."""

    audit: torchtitan_audit.Audit
    logs: dict[str, str]
    exit_codes: dict[str, int | None]
    note: str = ""
    measured: dict[str, float | None] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every group ended with 0 and nothing was noted."""
        return not self.note and all(code == 0 for code in self.exit_codes.values())

    def trouble(self) -> str:
        """The run's note, or the first error its groups logged if one failed (empty when all went well)."""
        if self.note:
            return self.note
        if any(code != 0 for code in self.exit_codes.values()):
            return first_error("".join(self.logs.values()))
        return ""

    def step_time(self) -> float | None:
        """Median seconds between a process's batches after the warm-up steps (every process of the run); None
        for a run that did not end well (a group that trained alone is not the job measured)."""
        if not self.ok:
            return None
        gaps: list[float] = []
        by_process: dict[tuple[str, int], list[torchtitan_audit.Batch]] = {}
        for batch in self.audit.batches:
            by_process.setdefault((batch.label, batch.pid), []).append(batch)
        for batches in by_process.values():
            kept = [batch for batch in batches if batch.step > WARMUP_STEPS]
            gaps.extend(later.time - earlier.time for earlier, later in itertools.pairwise(kept))
        return statistics.median(gaps) if gaps else None

    def final_loss(self, groups: Sequence[str]) -> float | None:
        """The mean of the losses the groups logged at the last step any logged (torchft logs each group's own loss,
        plain torchtitan the global one)."""
        last = [records[-1] for label in groups if (records := step_records(self.logs.get(label, "")))]
        if not last:
            return None
        final_step = max(record.step for record in last)
        return statistics.mean(record.loss for record in last if record.step == final_step)


def audit_steps(run_dir: Path, label: str) -> list[torchtitan_audit.Batch]:
    """The batches group ``label``'s processes took so far."""
    return [batch for batch in torchtitan_audit.read_audit(run_dir / "audit").batches if batch.label == label]


def finish_groups(groups: dict[str, TorchrunGroup]) -> tuple[dict[str, int | None], str]:
    """Wait (bounded) for every group to end; SIGKILL those that overstay. Exit statuses and a note."""
    note = ""
    deadline = time.monotonic() + WAIT_LIMIT
    for label, group in groups.items():
        try:
            group.wait(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            note += f"{label} overstayed {WAIT_LIMIT:.0f} s and was killed; "
            group.kill()
            group.wait(timeout=30)
    return {label: group.poll() for label, group in groups.items()}, note


def collect(run_dir: Path, groups: Sequence[str], exit_codes: dict[str, int | None], note: str) -> RunResult:
    """The run's audit and logs once its groups ended."""
    logs = {label: (run_dir / f"{label}.log").read_text(errors="replace") for label in groups}
    return RunResult(torchtitan_audit.read_audit(run_dir / "audit"), logs, exit_codes, note)


def run_failure_free(leg: Leg, setup: Setup) -> RunResult:
    """Every group of ``leg`` trains ``setup.steps`` steps."""
    setup.run_dir.mkdir(parents=True, exist_ok=True)
    with leg.session(setup) as launch:
        groups = {label: launch(label, setup.run_dir) for label in leg.groups}
        try:
            exit_codes, note = finish_groups(groups)
        finally:
            for group in groups.values():
                group.kill()
    return collect(setup.run_dir, leg.groups, exit_codes, note)


def kill_step(seed: int, steps: int) -> int:
    """The step during which group B is SIGKILLed: drawn from ``seed`` in the first half after the warm-up."""
    return random.Random(seed).randint(WARMUP_STEPS + 1, max(WARMUP_STEPS + 1, steps // 2))


def run_with_failure(leg: Leg, setup: Setup, seed: int) -> RunResult:
    """Group B is SIGKILLed at :func:`kill_step`; group A trains on alone for two steps and is then held (the job
    must not end before B is back) until the relaunched B's trainer is built."""
    first, victim = leg.groups[0], leg.groups[1]
    run_dir = setup.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    at_step = kill_step(seed, setup.steps)
    hold = run_dir / "hold"
    hold.write_text(str(at_step + 2))
    setup = dataclasses.replace(setup, hold=hold)
    measured: dict[str, float | None] = {"kill_step": float(at_step)}
    note = ""
    killed_at = relaunched_at = None
    with leg.session(setup) as launch:
        groups = {label: launch(label, run_dir) for label in leg.groups}
        try:

            def reached() -> bool:
                return groups[victim].poll() is not None or any(
                    batch.step >= at_step for batch in audit_steps(run_dir, victim)
                )

            wait_until(reached, WAIT_LIMIT, f"group {victim} to reach step {at_step}")
            killed_at = time.time()
            if (code := groups[first].poll()) is not None:
                note += f"{first} had ended (exit {code}) before the SIGKILL; "
            groups[victim].kill()
            groups[victim].wait(timeout=30)

            def trained_on_alone() -> bool:
                after = [batch for batch in audit_steps(run_dir, first) if batch.time > (killed_at or 0.0)]
                return groups[first].poll() is not None or len(after) >= 2

            wait_until(trained_on_alone, WAIT_LIMIT, f"group {first} to train on without {victim}")
            (run_dir / f"{victim}.log").rename(run_dir / f"{victim}-killed.log")  # the relaunched group's log alone
            relaunched_at = time.time()
            groups[victim] = launch(victim, run_dir)
            joiner_log = run_dir / f"{victim}.log"
            wait_until(
                lambda: groups[victim].poll() is not None or "Training starts at step" in joiner_log.read_text(),
                WAIT_LIMIT,
                f"the relaunched group {victim}'s trainer",
            )
            hold.unlink()
            exit_codes, finish_note = finish_groups(groups)
            note += finish_note
        except AssertionError as error:
            note += f"{error}; "
            exit_codes = {label: group.poll() for label, group in groups.items()}
        finally:
            hold.unlink(missing_ok=True)
            for group in groups.values():
                group.kill()
    result = collect(run_dir, leg.groups, exit_codes, note)
    killed_log = run_dir / f"{victim}-killed.log"
    if killed_log.exists():
        result.logs[f"{victim} (killed)"] = killed_log.read_text(errors="replace")
    survivor_commits = leg.commit_times(result.logs[first])
    joiner_commits = leg.commit_times(result.logs[victim]) if relaunched_at is not None else []
    recovered = next((moment for moment in survivor_commits if moment > (killed_at or float("inf"))), None)
    rejoin = next((moment for moment in joiner_commits if moment > (relaunched_at or float("inf"))), None)
    measured["recovery_s"] = None if recovered is None or killed_at is None else recovered - killed_at
    measured["rejoin_s"] = None if rejoin is None or relaunched_at is None else rejoin - relaunched_at
    measured["rejoined"] = float(rejoin is not None and any(moment > rejoin for moment in survivor_commits))
    result.measured = measured
    return result


def ratio_rows(legs: Sequence[Leg], runs: dict[str, list[RunResult]]) -> list[list[str]]:
    """Table 1's rows: each leg's median step time and its per-round ratio to the baseline's."""
    baseline = [run.step_time() for run in runs[legs[0].name]]
    rows = []
    for leg in legs:
        times = [run.step_time() for run in runs[leg.name]]
        kept = [value for value in times if value is not None]
        ratios = round_ratios(times, baseline)
        ok = sum(1 for run in runs[leg.name] if run.ok)
        rows.append(
            [
                leg.name,
                median_span(kept, fixed(3)),
                median_span(ratios, fixed(3, suffix="x")),
                f"{ok}/{len(runs[leg.name])}",
                escape(next((note for run in runs[leg.name] if (note := run.trouble())), "")),
            ]
        )  # fmt: skip
    return rows


def reference(runs: Sequence[RunResult]) -> RunResult:
    """The failure-free run failure runs are compared with: the first that ended well (else the first)."""
    return next((run for run in runs if run.ok), runs[0])


def failure_row(leg: Leg, failure: RunResult, reference: RunResult) -> list[str]:
    """Table 2's row for one leg."""
    outcome = torchtitan_audit.data_outcome(reference.audit, failure.audit)
    final, expected = failure.final_loss(leg.groups), reference.final_loss(leg.groups)
    measured = failure.measured

    def seconds(key: str) -> str:
        value = measured.get(key)
        return "-" if value is None else f"{value:.2f}"

    errors = "; ".join(f"{label}: {first_error(log)}" for label, log in failure.logs.items() if first_error(log))
    return [
        leg.name,
        f"{measured['kill_step']:.0f}",
        seconds("recovery_s"),
        seconds("rejoin_s"),
        "yes" if measured.get("rejoined") else "no",
        str(outcome.lost),
        str(outcome.trained_twice),
        "-" if final is None else f"{final:.4f}",
        "-" if expected is None else f"{expected:.4f}",
        " ".join(f"{label}={code}" for label, code in failure.exit_codes.items()),
        escape((failure.note + errors)[:200]),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the legs, print the tables and the goals."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torchtitan", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 10 steps (indicative only)")
    add_rounds(parser, "interleaved rounds of the failure-free runs (default 2, --quick 1)")
    parser.add_argument("--steps", type=int, choices=range(8, 201), metavar="N", help="training steps (8-200)")
    parser.add_argument("--legs", nargs="+", choices=list(LEGS), default=list(LEGS), help="legs to run")
    parser.add_argument("--seed", type=int, default=0, help="draws the step at which group B is SIGKILLed")
    parser.add_argument(
        "--failure-runs", type=int, choices=range(11), metavar="N", default=1, help="SIGKILL runs per leg (0-10)"
    )
    parser.add_argument("--skip-step-time", action="store_true", help="one failure-free run per leg, no rounds")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep logs, audits and checkpoints here")
    args = parser.parse_args(argv)
    steps = args.steps or (10 if args.quick else 16)
    rounds = 1 if args.skip_step_time else args.rounds or (1 if args.quick else 2)
    console = make_console()
    import torch
    import torchtitan

    machine_line(console, args.quick, f"torch {torch.__version__}", f"torchtitan {torchtitan.__version__}")
    legs = [LEGS[name] for name in args.legs]
    skipped = {leg.name: why for leg in legs if (why := leg.missing())}
    for name, why in skipped.items():
        console.print(f"{name}: {why}", highlight=False)
    legs = [leg for leg in legs if leg.name not in skipped]
    if not legs:
        return 0
    with run_directory(args.run_dir, "stalwart-torchtitan-") as run_dir, progress_display(console) as progress:
        assets = write_assets(run_dir / "assets", documents=DOCUMENTS, seed=SEED)
        fault_tolerant = [leg for leg in legs if leg.fault_tolerant]
        task = progress.add_task("torchtitan runs", total=rounds * len(legs) + args.failure_runs * len(fault_tolerant))

        def measure(name: str, number: int) -> RunResult:
            progress.update(task, description=f"{name}, round {number + 1}")
            result = run_failure_free(LEGS[name], Setup(assets, steps, run_dir / f"{name}-round-{number}"))
            progress.advance(task)
            return result

        runs = interleaved_rounds([leg.name for leg in legs], rounds, measure)
        failures: dict[str, list[RunResult]] = {leg.name: [] for leg in fault_tolerant if args.failure_runs}
        for number in range(args.failure_runs):
            for leg in fault_tolerant:
                progress.update(task, description=f"{leg.name}, SIGKILL of group {leg.groups[1]} and restart")
                setup = Setup(assets, steps, run_dir / f"{leg.name}-failure-{number}")
                failures[leg.name].append(run_with_failure(leg, setup, args.seed + number))
                progress.advance(task)
    print_table(
        console,
        f"1. Step time without failures: llama3 debug model, 2 CPU processes, {steps} steps, {rounds} round(s)",
        ["leg", "step (s)", f"vs {legs[0].name}", "runs ok", "note"],
        ratio_rows(legs, runs),
        caption=f"step = median time between a process's batches after step {WARMUP_STEPS}; ratio = per-round "
        f"ratio to {legs[0].name}'s, median (min-max).",
    )
    if failures:
        print_table(
            console,
            "2. A SIGKILL of replica group B and its restart, per run (vs the first failure-free run that ended well)",
            ["leg", "kill at step", "recovery (s)", "rejoin (s)", "rejoined", "samples lost", "trained twice",
             "final loss", "failure-free", "exit", "errors"],
            [failure_row(leg, run, reference(runs[leg.name])) for leg in fault_tolerant for run in failures[leg.name]],
            caption="recovery = SIGKILL -> A's first committed step after it; rejoin = relaunch -> B's first "
            "committed step; rejoined = B committed and A committed after it; lost/twice: samples against the "
            "leg's failure-free run (audit of every batch taken; a step in flight at the kill is not trained).",
        )  # fmt: skip
    goals = []
    baseline = [run.step_time() for run in runs[legs[0].name]]
    for leg in fault_tolerant:  # the goal compares layouts alike: by default legs[0] is plain torchtitan replicated
        ratios = round_ratios([run.step_time() for run in runs[leg.name]], baseline)
        worst = statistics.median(ratios) if ratios else None
        goals.append(
            Goal(
                f"{leg.name}'s step at most {STEP_GOAL}x {legs[0].name}'s",
                None if worst is None else worst <= STEP_GOAL,
                "not measured" if worst is None else f"median ratio {worst:.3f}x",
            )
        )
    for name, failed in failures.items():
        outcomes = [torchtitan_audit.data_outcome(reference(runs[name]).audit, failure.audit) for failure in failed]
        lost, twice = sum(o.lost for o in outcomes), sum(o.trained_twice for o in outcomes)
        rejoined = sum(1 for failure in failed if failure.measured.get("rejoined"))
        goals.append(
            Goal(
                f"{name}: 0 samples lost or trained twice, rejoined every time",
                lost == 0 and twice == 0 and rejoined == len(failed),
                f"over {len(failed)} failure run(s): lost {lost}, twice {twice}, rejoined {rejoined}",
            )
        )
    print_goals(console, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
