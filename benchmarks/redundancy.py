"""Redundancy benchmark: what sharded optimizer state with copies or parity costs.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.redundancy           # full run, about 10 minutes on 2 cores
    python -m benchmarks.redundancy --quick   # small sizes, about 2 minutes (numbers indicative only)
    python -m benchmarks.redundancy --sections 1   # only the codec table
    python -m benchmarks.redundancy --sections 2 --run-dir out/redundancy   # keep the workers' logs and records

Sections, each printed as a table:

1. **Parity codec throughput.** ``ParityCode.encode`` and ``decode`` on ``k``
   random buffers of one cell each: XOR for ``(7, 1)``, and Reed-Solomon for
   ``(6, 2)`` on pyeclib's ISA-L Cauchy backend (the default) and its
   Vandermonde one, on the CPU; XOR on the GPU too when CUDA is there.
   Throughput counts the ``k`` data buffers' bytes per second (MB/s, 10^6);
   decode rebuilds one lost data buffer, then ``m`` of them. Medians over
   repeats, in this process, with torch's default threads.

2. **Partial redundancy in training.** 8 worker processes (Gloo,
   127.0.0.1) train an MLP of 2.6M parameters with Adam, whose state (fp32
   master and two moments, 3 x 4 bytes a parameter) dominates memory: torch's
   DistributedDataParallel (the baseline, Adam replicated) and stalwart with
   the state sharded at overlap 0, 1/8, 1/4, 1 and parity (7, 1), (6, 2).
   Each stalwart configuration runs twice: SIGKILL of one worker (rank 3)
   and of two (ranks 3 and 6) at the top of the same step; DDP runs twice
   without failures. Runs are interleaved (the order rotates every round) and
   step times are rank 0's steps before the kill, pooled over both runs:
   medians, with each run's median as the spread. Columns: state bytes per
   process (``ShardedOptimizer.state_bytes``; DDP: Adam's state plus the
   parameters) and their ratio to :func:`stalwart.redundancy.memory.state_bytes`,
   step time against overlap 0 and DDP, CPU time per step against DDP's
   (with more processes than cores, wall time follows how the scheduler
   shares them; CPU time does not), and for each failure count the
   recovery (SIGKILL to the survivors' commit of the step the victims died
   in, re-run included), the in-memory reshard (``RepairStats.seconds``) and
   the steps lost (steps of the lighthouse's ledger that the survivors did
   not commit: must be 0). A configuration that cannot survive the failure
   shows "lost" (``ShardsLostError`` in the survivors). Peak memory is each
   finished process's resident set above its imports. The
   checkpoint-restart row is what a user without redundancy runs instead:
   the DDP loop with the same model, data and Adam, saving with
   ``torch.distributed.checkpoint`` every K steps; the same victims are
   SIGKILLed at the same step, the whole world is launched again (new
   rendezvous), every process loads the newest checkpoint and the steps since
   it are trained again. Its recovery is SIGKILL to the failed step committed
   again, averaged over where in the interval the failure falls (the first
   step after the reload, measured, plus (K - 1) / 2 median steps); "vs
   checkpoint-restart" is that average over a row's recovery.

``--sections 1,2`` picks sections (default: both); ``--quick`` runs section 2
with 4 workers on a tiny model and one failure (numbers indicative only).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from benchmarks._measure import (
    Goal,
    machine_line,
    make_console,
    median_of_repeats,
    print_goals,
    print_table,
    progress_display,
)
from benchmarks._redundancy_training import (
    FULL_TRAINING,
    QUICK_TRAINING,
    CheckpointRestart,
    ConfigResult,
    Failure,
    TrainingSettings,
    expected_to_survive,
    run_training,
)
from stalwart.redundancy import Parity
from stalwart.redundancy.parity import RS_BACKEND, ParityCode

MIB = 1 << 20
CODEC_TITLE = "1. Parity codec throughput"
TRAINING_TITLE = "2. Partial redundancy in training"
OVERLAP_STEP_GOAL = 1.10
PARITY_EXTRA_GOAL = 1 / 7
RECOVERY_GOAL = 20.0
STEP_VS_DDP_GOALS = {"overlap 0": 1.02, "overlap 1/8": 1.08, "parity (7, 1)": 1.15, "parity (6, 2)": 1.25}
"""Most step time against DDP with replicated Adam, by configuration."""


@dataclass(frozen=True)
class Settings:
    """Sizes and repeat counts of one run (full or ``--quick``)."""

    cell_bytes: int
    repeats: int


FULL = Settings(cell_bytes=32 * MIB, repeats=5)
QUICK = Settings(cell_bytes=1 * MIB, repeats=2)


@dataclass(frozen=True)
class CodecCase:
    """One row of table 1: a code, its backend and the device its buffers live on."""

    parity: Parity
    backend: str
    device: str

    @property
    def label(self) -> str:
        return "XOR" if self.parity.m == 1 else f"Reed-Solomon, pyeclib {self.backend}"


@dataclass(frozen=True)
class CodecRow:
    """Table 1's measurements for one case, in data bytes per second."""

    case: CodecCase
    cell_bytes: int
    encode: float
    decode_one: float
    decode_all: float


def codec_cases() -> list[CodecCase]:
    """XOR (7, 1) and Reed-Solomon (6, 2) on both ISA-L backends on the CPU; XOR on CUDA when there is a GPU."""
    cases = [
        CodecCase(Parity(7, 1), RS_BACKEND, "cpu"),
        CodecCase(Parity(6, 2), RS_BACKEND, "cpu"),
        CodecCase(Parity(6, 2), "isa_l_rs_vand", "cpu"),
    ]
    if torch.cuda.is_available():
        cases.append(CodecCase(Parity(7, 1), RS_BACKEND, "cuda"))
    return cases


def measure_codec(case: CodecCase, settings: Settings) -> CodecRow:
    """Encode, decode one lost data buffer and decode ``m`` of them, each a median over repeats."""
    k, m = case.parity.k, case.parity.m
    code = ParityCode(case.parity, backend=case.backend)
    generator = torch.Generator().manual_seed(0)
    data = [
        torch.randint(0, 256, (settings.cell_bytes,), dtype=torch.uint8, generator=generator).to(case.device)
        for _ in range(k)
    ]
    units = dict(enumerate([*data, *code.encode(data)]))
    lengths = [settings.cell_bytes] * k

    def rate(work: Callable[[], object]) -> float:
        def once() -> float:
            start = time.perf_counter()
            work()
            if case.device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        return k * settings.cell_bytes / median_of_repeats(once, settings.repeats)

    def without(*lost: int) -> dict[int, torch.Tensor]:
        return {index: unit for index, unit in units.items() if index not in lost}

    return CodecRow(
        case=case,
        cell_bytes=settings.cell_bytes,
        encode=rate(lambda: code.encode(data)),
        decode_one=rate(lambda: code.decode(without(0), lengths)),
        decode_all=rate(lambda: code.decode(without(*range(m)), lengths)),
    )


def print_codec(console: Console, rows: Sequence[CodecRow]) -> None:
    """Table 1."""
    print_table(
        console,
        f"{CODEC_TITLE}: ParityCode.encode and decode",
        ["(k, m)", "code", "device", "cell (MiB)", "encode (MB/s)", "decode 1 lost (MB/s)", "decode m lost (MB/s)"],
        [
            [
                f"({row.case.parity.k}, {row.case.parity.m})",
                row.case.label,
                row.case.device,
                f"{row.cell_bytes / MIB:g}",
                f"{row.encode / 1e6:,.0f}",
                f"{row.decode_one / 1e6:,.0f}",
                f"{row.decode_all / 1e6:,.0f}",
            ]
            for row in rows
        ],
        caption=(
            "MB/s of the k data buffers (10^6 bytes). Reed-Solomon runs on the CPU in 1 MiB chunks; "
            f"{RS_BACKEND} is ParityCode's default. Medians over repeats, torch threads: {torch.get_num_threads()}."
        ),
    )


def print_training(
    console: Console, settings: TrainingSettings, results: Sequence[ConfigResult], restart: CheckpointRestart
) -> None:
    """Table 2: every configuration side by side, and checkpoint-restart through the same failure."""
    by_label = {result.config.label: result for result in results}
    zero = by_label.get("overlap 0")
    ddp = next(result for result in results if result.config.redundancy is None)
    failure_counts = sorted(settings.victims)
    columns = [
        "configuration",
        "state/process (MiB)",
        "vs formula",
        "step (ms)",
        "by run (ms)",
        "vs overlap 0",
        "vs DDP",
        "CPU vs DDP",
        "peak/process (MiB)",
    ]
    for count in failure_counts:
        columns += [
            f"{count} failed: recovery (s)",
            f"{count}: reshard (s)",
            f"{count}: steps lost",
            f"{count}: vs checkpoint-restart",
        ]
    rows = []
    for result in results:
        median = result.step_median_ms
        row = [
            result.config.label,
            _mib(result.state_bytes),
            _formula_ratio(result),
            "-" if median is None else f"{median:.1f}",
            " ".join(f"{value:.0f}" for value in result.run_medians_ms()),
            _ratio(median, zero.step_median_ms if zero else None),
            _ratio(median, ddp.step_median_ms),
            _ratio(result.cpu_median_ms, ddp.cpu_median_ms),
            _mib(result.peak_bytes),
        ]
        for count in failure_counts:
            row += _failure_cells(result, count, restart)
        rows.append(row)
    rows.append(_restart_row(restart, ddp, len(failure_counts)))
    victims = "; ".join(f"{count}: rank(s) {', '.join(map(str, ranks))}" for count, ranks in settings.victims.items())
    print_table(
        console,
        f"{TRAINING_TITLE}: {settings.workers} processes, model {settings.model}, Adam, "
        f"SIGKILL at step {settings.kill_at}",
        columns,
        rows,
        caption=(
            "State: max per process (MiB); vs formula: measured / stalwart.redundancy.memory.state_bytes, summed "
            f"over processes. Step: median of rank 0's steps {settings.warmup}..{settings.kill_at - 2} over both "
            "runs; 'by run' gives each run's median (the spread). CPU: rank 0's CPU time per step (every thread), "
            "median, against DDP's: with more processes than cores the steadier figure. Peak: max resident set "
            f"above the imports over the processes that finished. Victims {victims}. Recovery: SIGKILL to the "
            "survivors' commit of that step (detection, quorum, reshard and the step's re-run); reshard: "
            "RepairStats.seconds of that repair (max over survivors); steps lost: ledger steps the survivors did "
            "not commit. lost: ShardsLostError (more failures than the redundancy covers). checkpoint-restart "
            f"(DDP, DCP every {restart.every} steps, the first failure count's victims): recovery averaged over "
            "the interval; its reshard cell is SIGKILL to the relaunched world's first step (relaunch, "
            "rendezvous, dcp.load on every process, one step); steps lost: trained twice in this run (samples are "
            "not lost, they are redone)."
        ),
    )


def _restart_row(restart: CheckpointRestart, ddp: ConfigResult, failure_counts: int) -> list[str]:
    label = f"checkpoint-restart, K={restart.every}"
    if restart.note:
        return [label, "-", "-", "-", "-", "-", "-", "-", "-", f"failed: {restart.note[:60]}"] + ["-"] * (
            4 * failure_counts - 1
        )
    median = statistics.median(restart.step_ms) if restart.step_ms else None
    cells = [
        label,
        "-",
        "-",
        "-" if median is None else f"{median:.1f}",
        "-" if median is None else f"{median:.0f}",
        "-",
        _ratio(median, ddp.step_median_ms),
        "-",
        _mib(restart.peak_bytes),
        _seconds(restart.average_s),
        f"first step {_seconds(restart.first_step_s)}",
        f"0 ({restart.retrained} trained twice)",
        "1.000x",
    ]
    return cells + ["-"] * (4 * (failure_counts - 1))


def _failure_cells(result: ConfigResult, count: int, restart: CheckpointRestart) -> list[str]:
    failure: Failure | None = result.failures.get(count)
    if failure is None:
        return ["-"] * 4
    if failure.note == "lost":
        return ["lost", "lost", "-", "-"]
    if failure.note:
        return [f"failed: {failure.note[:60]}", "-", "-", "-"]
    average = restart.average_s
    ratio = "-" if not failure.recovery_s or average is None else f"{average / failure.recovery_s:.1f}x"
    return [_seconds(failure.recovery_s), _seconds(failure.reshard_s), str(failure.steps_lost), ratio]


def training_goals(
    settings: TrainingSettings, results: Sequence[ConfigResult], restart: CheckpointRestart
) -> list[Goal]:
    """The goals, judged on this run's figures."""
    by_label = {result.config.label: result for result in results}
    goals = []
    zero, eighth = by_label.get("overlap 0"), by_label.get("overlap 1/8")
    if zero and eighth and zero.step_median_ms and eighth.step_median_ms:
        ratio = eighth.step_median_ms / zero.step_median_ms
        goals.append(
            Goal("overlap 1/8 step time at most 1.10x overlap 0's", ratio <= OVERLAP_STEP_GOAL, f"{ratio:.3f}x")
        )
    else:
        goals.append(Goal("overlap 1/8 step time at most 1.10x overlap 0's", None, "not in this run"))
    ddp = by_label.get("DDP")
    for label, most in STEP_VS_DDP_GOALS.items():
        title = f"{label} step time at most {most:.2f}x DDP's"
        result = by_label.get(label)
        if ddp and result and ddp.step_median_ms and result.step_median_ms:
            ratio = result.step_median_ms / ddp.step_median_ms
            goals.append(Goal(title, ratio <= most, f"{ratio:.3f}x"))
        else:
            goals.append(Goal(title, None, "not in this run"))
    parity = by_label.get("parity (7, 1)")
    if zero and parity and zero.state_bytes and parity.state_bytes:
        extra = max(p - z for p, z in zip(parity.state_bytes, zero.state_bytes, strict=True)) / max(zero.state_bytes)
        goals.append(
            Goal(
                "parity (7, 1) holds at most 1/7 of a shard extra",
                extra <= PARITY_EXTRA_GOAL + 1e-3,
                f"{extra:.4f} of a shard",
            )
        )
    else:
        goals.append(Goal("parity (7, 1) holds at most 1/7 of a shard extra", None, "not in this run"))
    survivable = [
        (result.config.label, count, failure)
        for result in results
        if result.config.redundancy is not None
        for count, failure in result.failures.items()
        if expected_to_survive(result.config, settings.workers, failure.placed)
    ]
    title = "in-memory recovery at least 20x faster than checkpoint-restart's, 0 steps lost"
    recoveries = [(label, count, failure.recovery_s) for label, count, failure in survivable if failure.recovery_s]
    average = restart.average_s
    if recoveries and average is not None:
        label, count, slowest = max(recoveries, key=lambda item: item[2])
        ratio = average / slowest
        lost = sum(failure.steps_lost or 0 for _, _, failure in survivable)
        detail = (
            f"checkpoint-restart {average:.2f} s on average over the slowest recovery {slowest:.3f} s "
            f"({label}, {count} failed): {ratio:.1f}x; {lost} steps lost"
        )
        goals.append(Goal(title, ratio >= RECOVERY_GOAL and lost == 0, detail))
    else:
        goals.append(Goal(title, None, restart.note or "no recovery measured"))
    lost = sum(failure.steps_lost or 0 for _, _, failure in survivable)
    measured = all(failure.steps_lost is not None for _, _, failure in survivable) and bool(survivable)
    goals.append(
        Goal(
            "training continues through every survivable repair with no step lost",
            (lost == 0) if measured else None if not survivable else False,
            f"{len(survivable)} survivable failure runs, {lost} steps lost"
            + ("" if measured else "; some runs gave no figures"),
        )
    )
    return goals


def _mib(values: Sequence[int]) -> str:
    return "-" if not values else f"{max(values) / MIB:.2f}"


def _formula_ratio(result: ConfigResult) -> str:
    if len(result.state_bytes) != len(result.formula_bytes):
        return "-"
    return f"{sum(result.state_bytes) / sum(result.formula_bytes):.3f}"


def _ratio(value: float | None, baseline: float | None) -> str:
    return "-" if value is None or not baseline else f"{value / baseline:.3f}x"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _sections(text: str) -> tuple[int, ...]:
    try:
        sections = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        sections = ()
    if not sections or not set(sections) <= {1, 2}:
        raise argparse.ArgumentTypeError(f"--sections must be a comma-separated subset of 1,2, got {text!r}")
    return sections


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its tables; return the exit status (0 unless it crashed)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.redundancy", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: about 2 minutes")
    parser.add_argument("--sections", type=_sections, default=(1, 2), help="comma-separated sections to run: 1,2")
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="a new or empty folder: keep section 2's logs and records there"
    )
    args = parser.parse_args(argv)
    if args.run_dir is not None and args.run_dir.exists() and any(args.run_dir.iterdir()):
        parser.error(f"--run-dir must be a new or empty folder (records are appended), got {str(args.run_dir)!r}")
    settings = QUICK if args.quick else FULL
    training = QUICK_TRAINING if args.quick else FULL_TRAINING
    console = make_console()
    forked = training.forked_workers and 2 in args.sections
    machine_line(console, args.quick, f"torch {torch.__version__}", forked=forked)
    if 1 in args.sections:
        cases = codec_cases()
        rows = []
        with progress_display(console) as progress:
            task = progress.add_task("parity codec", total=len(cases))
            for case in cases:
                rows.append(measure_codec(case, settings))
                progress.advance(task)
        print_codec(console, rows)
    if 2 in args.sections:
        with progress_display(console) as progress, contextlib.ExitStack() as stack:
            run_dir = args.run_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stalwart-red-")))
            run_dir.mkdir(parents=True, exist_ok=True)
            task = progress.add_task("training", total=len(training.configs) * len(training.victims) + 1)

            def advance(label: str) -> None:
                progress.update(task, description=label)
                progress.advance(task)

            results, restart = run_training(training, run_dir, advance, progress.refresh)
        print_training(console, training, results, restart)
        print_goals(console, training_goals(training, results, restart))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
