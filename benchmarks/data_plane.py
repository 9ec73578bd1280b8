"""Data-plane benchmark: how fast and how small stalwart's epoch order and ledger are.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.data_plane           # full run, a few minutes
    python -m benchmarks.data_plane --quick   # small sizes, a few seconds (numbers indicative only)

Three measurements, each printed as a table, then a summary of the goals:

1. **First batch of an epoch.** Time and peak memory from nothing to the first
   global batch of ``B = 1024`` samples: stalwart's ``EpochPlan(N, B).indices(0, 0, B)``
   against ``torch.utils.data.DistributedSampler(range(N), num_replicas=8, rank=0,
   shuffle=True)`` taking ``B`` indices from its iterator (whose ``__iter__``
   runs ``torch.randperm(N).tolist()`` before yielding anything). Every case
   runs in a fresh process; its peak RSS minus that of a process that only
   imports torch and stalwart is the memory it needed. Times and memory are
   medians over repeats. torch is measured up to ``N = 10^8``; at ``10^9`` and
   ``10^10`` stalwart runs alone and torch's needs are extrapolated linearly
   from its largest measured ``N`` (an estimate, marked as such).
   Goal: at ``N = 10^8`` at least 100x faster and 100x less memory.
2. **Ledger step cost.** Median microseconds of ``DataLedger.begin_step`` plus
   ``commit`` at 8 to 8192 members and global batches of 1024 and 65536, on a
   dataset of 10^9 samples. Goal: under 1 ms at 1024 members and batch 65536.
3. **Index throughput.** Millions of sample indices per second from
   ``plan.indices`` in a process pinned to one core with one-thread pools, for
   ``N = 10^8`` (uint32 arithmetic) and ``10^10`` (uint64), in chunks of 65536
   and 10^6. Goal: at least 10 million indices per second in every case.

The benchmark reports; it never fails because a goal is missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Column
from torch.utils.data import DistributedSampler

from benchmarks._measure import (
    Goal,
    make_console,
    median_of_repeats,
    print_goals,
    print_table,
    progress_display,
    run_isolated,
)
from stalwart.data import DataLedger, EpochPlan, FeistelPermutation

FIRST_BATCH_SIZE = 1024
TORCH_NUM_REPLICAS = 8
LEDGER_DATASET_SIZE = 10**9
LEDGER_WARMUP_STEPS = 5
MIB = 1 << 20
MIN_MEMORY_RESOLUTION_MIB = 1.0
FIRST_BATCH_GOAL_SIZE = 10**8
FIRST_BATCH_GOAL_RATIO = 100.0
LEDGER_GOAL = (1024, 65536, 1000.0)  # members, global batch, microseconds
THROUGHPUT_GOAL = 10e6  # indices per second
_MODULE = "benchmarks.data_plane"


@dataclass(frozen=True)
class Settings:
    """Sizes and repeat counts of one run (full or ``--quick``)."""

    compared_sizes: tuple[int, ...]
    stalwart_only_sizes: tuple[int, ...]
    process_repeats: int
    ledger_members: tuple[int, ...]
    ledger_batches: tuple[int, ...]
    ledger_steps: int
    throughput_sizes: tuple[int, ...]
    throughput_chunks: tuple[int, ...]
    throughput_indices: int
    throughput_repeats: int


FULL = Settings(
    compared_sizes=(10**6, 10**7, 10**8),
    stalwart_only_sizes=(10**9, 10**10),
    process_repeats=3,
    ledger_members=(8, 64, 1024, 8192),
    ledger_batches=(1024, 65536),
    ledger_steps=300,
    throughput_sizes=(10**8, 10**10),
    throughput_chunks=(65536, 10**6),
    throughput_indices=5 * 10**7,
    throughput_repeats=3,
)
QUICK = Settings(
    compared_sizes=(10**5,),
    stalwart_only_sizes=(10**10,),
    process_repeats=1,
    ledger_members=(8, 1024),
    ledger_batches=(65536,),
    ledger_steps=10,
    throughput_sizes=(10**8,),
    throughput_chunks=(65536,),
    throughput_indices=10**6,
    throughput_repeats=1,
)


# Bodies run in fresh processes by run_isolated; each returns a JSON-able dict.


def idle() -> dict[str, Any]:
    """Do nothing: the baseline process, whose peak RSS is that of the imports alone."""
    return {}


def torch_first_batch(dataset_size: int, batch_size: int) -> dict[str, Any]:
    """Seconds from a new DistributedSampler to ``batch_size`` indices from its iterator."""
    start = time.perf_counter()
    dataset: Any = range(dataset_size)  # Sized is all DistributedSampler needs
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=TORCH_NUM_REPLICAS, rank=0, shuffle=True, seed=0
    )
    iterator = iter(sampler)
    batch = [next(iterator) for _ in range(batch_size)]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "distinct": len(set(batch))}


def stalwart_first_batch(dataset_size: int, batch_size: int) -> dict[str, Any]:
    """Seconds from a new EpochPlan to the sample indices of its first global batch."""
    start = time.perf_counter()
    plan = EpochPlan(dataset_size, batch_size)
    batch = plan.indices(0, 0, batch_size)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "distinct": len(set(batch.tolist()))}


def index_throughput(dataset_size: int, chunk_size: int, total_indices: int, repeats: int) -> dict[str, Any]:
    """Median indices per second of ``plan.indices`` over consecutive chunks of one epoch."""
    chunks = -(-total_indices // chunk_size)
    if chunks * chunk_size > dataset_size:
        raise ValueError(f"total_indices must fit in dataset_size={dataset_size}, got {chunks * chunk_size}")
    plan = EpochPlan(dataset_size, chunk_size)
    plan.indices(0, 0, chunk_size)  # builds the epoch's permutation once, as a training loop would

    def rate() -> float:
        start = time.perf_counter()
        for chunk in range(chunks):
            plan.indices(0, chunk * chunk_size, (chunk + 1) * chunk_size)
        return chunks * chunk_size / (time.perf_counter() - start)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"indices_per_second": median_of_repeats(rate, repeats), "cores": cores}


# The three measurements.


@dataclass(frozen=True)
class FirstBatchRow:
    """Median first-batch time (ms) and extra peak memory (MiB) at one dataset size; torch's may be estimated."""

    dataset_size: int
    torch_ms: float
    torch_mib: float
    torch_estimated: bool
    stalwart_ms: float
    stalwart_mib: float


@dataclass(frozen=True)
class FirstBatchResult:
    """The first-batch rows, and the memory below which a difference is noise (MiB)."""

    rows: list[FirstBatchRow]
    memory_resolution_mib: float


@dataclass(frozen=True)
class LedgerRow:
    """Microseconds per ``begin_step`` + ``commit`` at one ledger size."""

    members: int
    global_batch_size: int
    median_us: float
    p90_us: float
    steps: int


@dataclass(frozen=True)
class ThroughputRow:
    """Indices per second of ``plan.indices`` at one dataset and chunk size, and the cores the process could use."""

    dataset_size: int
    chunk_size: int
    indices_per_second: float
    cores: int | None


def _isolated_medians(
    label: str, target: str, kwargs: dict[str, Any], repeats: int, progress: Progress, task: TaskID
) -> tuple[float, float, list[int]]:
    """Median seconds, median peak RSS (bytes) and every peak RSS of ``repeats`` fresh processes running ``target``."""
    seconds, peaks = [], []
    for repeat in range(repeats):
        progress.update(task, description=f"{label} (run {repeat + 1}/{repeats})")
        run = run_isolated(f"{_MODULE}:{target}", kwargs)
        if "distinct" in run.result and run.result["distinct"] != kwargs["batch_size"]:
            raise RuntimeError(f"{target}(**{kwargs}) returned a batch with repeated indices: {run.result}")
        seconds.append(run.result.get("seconds", 0.0))
        peaks.append(run.peak_rss_bytes)
        progress.advance(task)
    return statistics.median(seconds), statistics.median(peaks), peaks


def measure_first_batch(settings: Settings, progress: Progress, task: TaskID) -> FirstBatchResult:
    """Time and memory to the first batch: torch and stalwart side by side, then stalwart alone."""
    repeats = settings.process_repeats
    _, baseline, baseline_peaks = _isolated_medians("first batch: baseline", "idle", {}, repeats, progress, task)
    resolution = max(MIN_MEMORY_RESOLUTION_MIB, (max(baseline_peaks) - min(baseline_peaks)) / MIB)

    def extra_mib(peak: float) -> float:
        return max(0.0, (peak - baseline) / MIB)

    rows: list[FirstBatchRow] = []
    for size in (*settings.compared_sizes, *settings.stalwart_only_sizes):
        kwargs = {"dataset_size": size, "batch_size": FIRST_BATCH_SIZE}
        label = f"first batch at N={_size_label(size)}"
        stalwart_s, stalwart_peak, _ = _isolated_medians(
            f"{label}: stalwart", "stalwart_first_batch", kwargs, repeats, progress, task
        )
        if size in settings.compared_sizes:
            torch_s, torch_peak, _ = _isolated_medians(
                f"{label}: torch", "torch_first_batch", kwargs, repeats, progress, task
            )
            torch_ms, torch_mib, estimated = torch_s * 1e3, extra_mib(torch_peak), False
        else:
            largest = max((row for row in rows if not row.torch_estimated), key=lambda row: row.dataset_size)
            scale = size / largest.dataset_size
            torch_ms, torch_mib, estimated = largest.torch_ms * scale, largest.torch_mib * scale, True
        rows.append(FirstBatchRow(size, torch_ms, torch_mib, estimated, stalwart_s * 1e3, extra_mib(stalwart_peak)))
    return FirstBatchResult(rows, resolution)


def ledger_step_microseconds(members: int, global_batch_size: int, steps: int) -> list[float]:
    """Microseconds of each of ``steps`` ``begin_step`` + ``commit`` calls, after a short warm-up."""
    ledger = DataLedger(EpochPlan(LEDGER_DATASET_SIZE, global_batch_size))
    names = [f"worker-{rank}" for rank in range(members)]
    for _ in range(LEDGER_WARMUP_STEPS):
        ledger.begin_step(names)
        ledger.commit()
    timings = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        ledger.begin_step(names)
        ledger.commit()
        timings.append((time.perf_counter_ns() - start) / 1e3)
    return timings


def measure_ledger(settings: Settings, progress: Progress, task: TaskID) -> list[LedgerRow]:
    """Ledger step cost for every (members, global batch) pair, in this process."""
    rows = []
    for members in settings.ledger_members:
        for batch in settings.ledger_batches:
            progress.update(task, description=f"ledger: {members} members, global batch {batch}")
            timings = ledger_step_microseconds(members, batch, settings.ledger_steps)
            p90 = statistics.quantiles(timings, n=10)[-1] if len(timings) > 1 else timings[0]
            rows.append(LedgerRow(members, batch, statistics.median(timings), p90, len(timings)))
            progress.advance(task)
    return rows


def measure_throughput(settings: Settings, progress: Progress, task: TaskID) -> list[ThroughputRow]:
    """Index throughput for every (N, chunk) pair, each in a fresh single-core process."""
    rows = []
    for size in settings.throughput_sizes:
        for chunk in settings.throughput_chunks:
            progress.update(task, description=f"index throughput: N={_size_label(size)}, chunks of {chunk:,}")
            kwargs = {
                "dataset_size": size,
                "chunk_size": chunk,
                "total_indices": settings.throughput_indices,
                "repeats": settings.throughput_repeats,
            }
            result = run_isolated(f"{_MODULE}:index_throughput", kwargs, single_core=True).result
            rows.append(ThroughputRow(size, chunk, result["indices_per_second"], result["cores"]))
            progress.advance(task)
    return rows


# Goals and tables.


def first_batch_goal(result: FirstBatchResult) -> Goal:
    """Goal 1, judged on measured numbers only (never on torch estimates)."""
    description = f"first batch at N={_size_label(FIRST_BATCH_GOAL_SIZE)}: >= {FIRST_BATCH_GOAL_RATIO:.0f}x faster and"
    description += f" >= {FIRST_BATCH_GOAL_RATIO:.0f}x less memory than torch"
    row = next((r for r in result.rows if r.dataset_size == FIRST_BATCH_GOAL_SIZE and not r.torch_estimated), None)
    if row is None:
        return Goal(description, None, "--quick does not run torch at this size")
    speed = row.torch_ms / row.stalwart_ms
    memory = row.torch_mib / max(row.stalwart_mib, result.memory_resolution_mib)
    met = speed >= FIRST_BATCH_GOAL_RATIO and memory >= FIRST_BATCH_GOAL_RATIO
    return Goal(description, met, f"{_number(speed)}x faster, {_number(memory)}x less memory")


def ledger_goal(rows: Sequence[LedgerRow]) -> Goal:
    """Goal 2, judged on the median step at the goal's ledger size."""
    members, batch, budget_us = LEDGER_GOAL
    description = f"ledger begin_step + commit < {budget_us / 1e3:.0f} ms at {members} members, global batch {batch:,}"
    row = next((r for r in rows if (r.members, r.global_batch_size) == (members, batch)), None)
    if row is None:
        return Goal(description, None, "not measured in this run")
    detail = f"median {_number(row.median_us)} us per step, p90 {_number(row.p90_us)} us"
    return Goal(description, row.median_us < budget_us, detail)


def throughput_goal(rows: Sequence[ThroughputRow]) -> Goal:
    """Goal 3, judged on the slowest case."""
    description = f"index throughput >= {THROUGHPUT_GOAL / 1e6:.0f} M indices/s on one core, every case"
    slowest = min(rows, key=lambda row: row.indices_per_second)
    detail = (
        f"slowest {_number(slowest.indices_per_second / 1e6)} M/s "
        f"(N={_size_label(slowest.dataset_size)}, chunks of {slowest.chunk_size:,})"
    )
    return Goal(description, slowest.indices_per_second >= THROUGHPUT_GOAL, detail)


def print_first_batch(console: Console, result: FirstBatchResult) -> None:
    """Table 1; a stalwart memory below the resolution is shown as such and its ratio as a lower bound."""
    resolution = result.memory_resolution_mib
    rows = []
    for row in result.rows:
        mark = "~" if row.torch_estimated else ""
        memory_ratio = row.torch_mib / max(row.stalwart_mib, resolution)
        below = row.stalwart_mib < resolution
        note = f"torch not run: ~{row.torch_mib / 1024:,.0f} GiB (estimate)" if row.torch_estimated else "measured"
        rows.append(
            [
                _size_label(row.dataset_size),
                mark + _number(row.torch_ms),
                _number(row.stalwart_ms),
                mark + _number(row.torch_ms / row.stalwart_ms) + "x",
                mark + _number(row.torch_mib),
                f"< {_number(resolution)}" if below else _number(row.stalwart_mib),
                mark + (">= " if below else "") + _number(memory_ratio) + "x",
                note,
            ]
        )
    estimated = [row for row in result.rows if row.torch_estimated]
    caption = (
        f"Global batch B = {FIRST_BATCH_SIZE}; torch takes B indices from rank 0 of {TORCH_NUM_REPLICAS}. "
        f"Medians over fresh processes; memory is peak RSS above an import-only process "
        f"(resolution {_number(resolution)} MiB)."
    )
    if estimated:
        caption += (
            " ~ marks torch estimates, extrapolated linearly from its largest measured N "
            f"({_size_label(max(r.dataset_size for r in result.rows if not r.torch_estimated))})."
        )
    print_table(
        console,
        "1. First batch of an epoch: torch DistributedSampler vs stalwart EpochPlan",
        [
            "N",
            "torch first batch (ms)",
            "stalwart first batch (ms)",
            "speed ratio",
            "torch peak memory (MiB)",
            "stalwart peak memory (MiB)",
            "memory ratio",
            Column("note", justify="left", no_wrap=True),
        ],
        rows,
        caption=caption,
    )


def print_ledger(console: Console, rows: Sequence[LedgerRow]) -> None:
    """Table 2."""
    print_table(
        console,
        "2. Ledger cost per step: DataLedger.begin_step + commit",
        ["members", "global batch", "median (us)", "p90 (us)", "us per member", "steps"],
        [
            [
                f"{row.members:,}",
                f"{row.global_batch_size:,}",
                _number(row.median_us),
                _number(row.p90_us),
                _number(row.median_us / row.members),
                str(row.steps),
            ]
            for row in rows
        ],
        caption=f"Dataset of {_size_label(LEDGER_DATASET_SIZE)} samples, no failures; in this process.",
    )


def print_throughput(console: Console, rows: Sequence[ThroughputRow]) -> None:
    """Table 3."""
    print_table(
        console,
        "3. Index throughput of EpochPlan.indices on one core",
        ["N", "chunk", "arithmetic", "M indices/s", "ns per index", "cores"],
        [
            [
                _size_label(row.dataset_size),
                f"{row.chunk_size:,}",
                "uint32" if FeistelPermutation(row.dataset_size, 0).bits <= 32 else "uint64",
                _number(row.indices_per_second / 1e6),
                _number(1e9 / row.indices_per_second),
                "?" if row.cores is None else str(row.cores),
            ]
            for row in rows
        ],
        caption="A fresh process pinned to one CPU, thread pools limited to one thread; median over repeats.",
    )


def _number(value: float) -> str:
    """A number with about three significant digits, thousands separated."""
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _size_label(size: int) -> str:
    """``10^k`` for a power of ten, else the number with separators."""
    exponent = len(str(size)) - 1
    return f"10^{exponent}" if size == 10**exponent else f"{size:,}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its tables and the goals; return the exit status (0 unless it crashed)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_plane", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: a few seconds")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    console = make_console()
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    quick = " (quick run: indicative only)" if args.quick else ""
    console.print(f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs{load}{quick}")

    repeats = settings.process_repeats
    first_batch_units = repeats * (1 + 2 * len(settings.compared_sizes) + len(settings.stalwart_only_sizes))
    ledger_units = len(settings.ledger_members) * len(settings.ledger_batches)
    throughput_units = len(settings.throughput_sizes) * len(settings.throughput_chunks)
    with progress_display(console) as progress:
        task = progress.add_task("starting", total=first_batch_units + ledger_units + throughput_units)
        first_batch = measure_first_batch(settings, progress, task)
        ledger = measure_ledger(settings, progress, task)
        throughput = measure_throughput(settings, progress, task)

    print_first_batch(console, first_batch)
    print_ledger(console, ledger)
    print_throughput(console, throughput)
    print_goals(console, [first_batch_goal(first_batch), ledger_goal(ledger), throughput_goal(throughput)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
