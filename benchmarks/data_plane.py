"""Data-plane benchmark: how fast and how small stalwart's epoch order and ledger are.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.data_plane           # full run, a few minutes
    python -m benchmarks.data_plane --quick   # small sizes, table 4 in this process (numbers indicative only)

Four measurements, each printed as a table, then a summary of the goals:

1. **First batch of an epoch.** Time and peak memory from nothing to the first
   global batch of ``B = 1024`` samples: stalwart's ``EpochPlan(N, B).indices(0, 0, B)``
   against ``torch.utils.data.DistributedSampler(range(N), num_replicas=8, rank=0,
   shuffle=True)`` taking ``B`` indices from its iterator (whose ``__iter__``
   runs ``torch.randperm(N).tolist()`` before yielding anything). Every case
   runs in a fresh process; its peak RSS minus that of a process that only
   imports torch and stalwart is the memory it needed. Times and memory are
   medians over repeats, torch's and stalwart's interleaved. torch is measured up to ``N = 10^8``; at ``10^9`` and
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
4. **Member reads from shards.** Rows per second that one member of a
   ``world``-member job delivers over an epoch of the windowed block order
   (``EpochPlan(block_size=row group, window=...)``), through ``ElasticLoader``
   in micro-batches, next to a sequential read of the same shards into the
   same Python rows, each in a fresh process pinned to one core (``--quick``:
   in this process, one case per source): Parquet files
   (``ShardedDataset``), a Hugging Face ``Dataset`` (memory-mapped Arrow) and
   a Hugging Face ``IterableDataset`` over the same files
   (``ShardedDataset.from_hf_iterable``), and the global shuffle for contrast;
   both sides first warm pyarrow's compute kernels up (a one-time ~0.5 s).
   Goal: at 4 members, Parquet and the ``Dataset`` at least 80% of the
   sequential rate. An ``IterableDataset`` shard reads only forwards (in
   pieces, through a cursor that starts again for a piece behind it), so a
   member decodes the pieces before the ones it needs too: shown, not a goal.

The benchmark reports; it never fails because a goal is missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Column
from torch.utils.data import DistributedSampler

from benchmarks._measure import (
    Goal,
    IsolatedRun,
    machine_line,
    make_console,
    median_of_repeats,
    print_goals,
    print_table,
    progress_display,
    run_isolated,
)
from benchmarks._rounds import interleaved_rounds
from stalwart.data import DataLedger, EpochPlan, FeistelPermutation, ShardedDataset, split_sizes

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
READ_GOAL_RATIO = 0.8
READ_GOAL_WORLD = 4
READ_MICROBATCH = 256
READ_FEATURES = 64
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
    read_files: int
    read_rows_per_file: int
    read_row_group: int
    read_global_batch: int
    read_window: int
    read_repeats: int
    read_cases: tuple[tuple[str, str, int], ...]
    """(source, order, members) of table 4's rows; the global order reads so slowly that it runs two steps only."""
    read_isolated: bool = True
    """Table 4's reads each in a fresh single-core process; ``--quick`` reads in this process."""


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
    read_files=16,
    read_rows_per_file=8192,
    read_row_group=512,
    read_global_batch=4096,
    read_window=8,
    read_repeats=4,
    read_cases=(
        ("parquet", "block", 1),
        ("parquet", "block", READ_GOAL_WORLD),
        ("parquet", "global", READ_GOAL_WORLD),
        ("hf", "block", READ_GOAL_WORLD),
        ("hf-iterable", "block", READ_GOAL_WORLD),
    ),
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
    read_files=4,
    read_rows_per_file=2048,
    read_row_group=256,
    read_global_batch=2048,
    read_window=4,
    read_repeats=1,
    read_cases=tuple((source, "block", READ_GOAL_WORLD) for source in ("parquet", "hf", "hf-iterable")),
    read_isolated=False,
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


def _isolated_rounds(
    label: str, targets: Sequence[str], kwargs: dict[str, Any], repeats: int, progress: Progress, task: TaskID
) -> dict[str, tuple[float, list[int]]]:
    """Per target, the median seconds and every peak RSS (bytes) of ``repeats`` fresh processes, targets interleaved."""

    def measure(target: str, repeat: int) -> IsolatedRun:
        progress.update(task, description=f"{label}: {target} (run {repeat + 1}/{repeats})")
        run = run_isolated(f"{_MODULE}:{target}", kwargs)
        if "distinct" in run.result and run.result["distinct"] != kwargs["batch_size"]:
            raise RuntimeError(f"{target}(**{kwargs}) returned a batch with repeated indices: {run.result}")
        progress.advance(task)
        return run

    results = interleaved_rounds(targets, repeats, measure)
    seconds = {
        target: statistics.median(run.result.get("seconds", 0.0) for run in runs) for target, runs in results.items()
    }
    return {target: (seconds[target], [run.peak_rss_bytes for run in runs]) for target, runs in results.items()}


def measure_first_batch(settings: Settings, progress: Progress, task: TaskID) -> FirstBatchResult:
    """Time and memory to the first batch: torch and stalwart side by side (interleaved), then stalwart alone."""
    repeats = settings.process_repeats
    _, baseline_peaks = _isolated_rounds("first batch", ["idle"], {}, repeats, progress, task)["idle"]
    baseline = statistics.median(baseline_peaks)
    resolution = max(MIN_MEMORY_RESOLUTION_MIB, (max(baseline_peaks) - min(baseline_peaks)) / MIB)

    def extra_mib(peaks: list[int]) -> float:
        return max(0.0, (statistics.median(peaks) - baseline) / MIB)

    rows: list[FirstBatchRow] = []
    for size in (*settings.compared_sizes, *settings.stalwart_only_sizes):
        kwargs = {"dataset_size": size, "batch_size": FIRST_BATCH_SIZE}
        compared = size in settings.compared_sizes
        targets = ["stalwart_first_batch", "torch_first_batch"] if compared else ["stalwart_first_batch"]
        runs = _isolated_rounds(f"first batch at N={_size_label(size)}", targets, kwargs, repeats, progress, task)
        stalwart_s, stalwart_peaks = runs["stalwart_first_batch"]
        if compared:
            torch_s, torch_peaks = runs["torch_first_batch"]
            torch_ms, torch_mib, estimated = torch_s * 1e3, extra_mib(torch_peaks), False
        else:
            largest = max((row for row in rows if not row.torch_estimated), key=lambda row: row.dataset_size)
            scale = size / largest.dataset_size
            torch_ms, torch_mib, estimated = largest.torch_ms * scale, largest.torch_mib * scale, True
        rows.append(FirstBatchRow(size, torch_ms, torch_mib, estimated, stalwart_s * 1e3, extra_mib(stalwart_peaks)))
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


def _read_source(kind: str, directory: str) -> Any:
    """The dataset a member reads: ``parquet`` and ``hf-iterable`` as ShardedDataset, ``hf`` a datasets.Dataset."""
    files = sorted(str(path) for path in Path(directory, "parquet").glob("*.parquet"))
    if kind == "parquet":
        return ShardedDataset.from_parquet(files)
    import datasets

    if kind == "hf":
        return datasets.load_from_disk(str(Path(directory, "hf")))
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    return ShardedDataset.from_hf_iterable(stream, num_rows=[pq.read_metadata(file).num_rows for file in files])


def _warm_up_arrow() -> None:
    """Run pyarrow's take kernel once on a one-row table: its first call in a process takes ~0.5 s of set-up."""
    pc.take(pa.table({"x": [0]}), pa.array([0])).to_pylist()


def member_read(kind: str, directory: str, plan: dict[str, Any], world: int, steps: int) -> dict[str, Any]:
    """Seconds member 0 of ``world`` takes to load its shares of the first ``steps`` steps in micro-batches."""
    from stalwart.runtime.loader import ElasticLoader

    epoch_plan = EpochPlan(**plan)
    loader = ElasticLoader(_read_source(kind, directory), collate_fn=list)
    _warm_up_arrow()
    rows = 0
    start_time = time.perf_counter()
    for step in range(steps):
        start = epoch_plan.step_start(step)
        share = epoch_plan.indices(0, start, start + split_sizes(epoch_plan.step_total(step), world)[0])
        for batch in loader.microbatches(0, share.tolist(), READ_MICROBATCH):
            rows += len(batch)
    seconds = time.perf_counter() - start_time
    loader.close()
    return {"rows": rows, "seconds": seconds}


def sequential_read(kind: str, directory: str) -> dict[str, Any]:
    """Seconds to read every row of the shards in order into Python rows (what a member's reads turn into).

    Parquet: pyarrow's row groups in file order; HF Dataset: its ``__getitems__``
    over consecutive indices; HF IterableDataset: its own iteration.
    """
    files = sorted(Path(directory, "parquet").glob("*.parquet"))
    _warm_up_arrow()
    rows = 0
    start_time = time.perf_counter()
    if kind == "parquet":
        for file in files:
            with pq.ParquetFile(file) as parquet:
                for group in range(parquet.num_row_groups):
                    rows += len(parquet.read_row_group(group).to_pylist())
    elif kind == "hf":
        import datasets

        dataset = datasets.load_from_disk(str(Path(directory, "hf")))
        batch = pq.read_metadata(files[0]).row_group(0).num_rows
        for first in range(0, len(dataset), batch):
            rows += len(dataset.__getitems__(list(range(first, min(first + batch, len(dataset))))))
    else:
        import datasets

        stream = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train", streaming=True)
        rows = sum(1 for _ in stream)
    return {"rows": rows, "seconds": time.perf_counter() - start_time}


@dataclass(frozen=True)
class ReadRow:
    """One member's read rate and the sequential rate of the same shards (rows per second)."""

    source: str
    order: str
    world: int
    shards_per_step: float
    member_rows_per_second: float
    sequential_rows_per_second: float

    @property
    def ratio(self) -> float:
        return self.member_rows_per_second / self.sequential_rows_per_second


_SOURCE_LABELS = {"parquet": "Parquet files", "hf": "HF Dataset", "hf-iterable": "HF IterableDataset"}


def write_read_data(settings: Settings, directory: Path) -> EpochPlan:
    """Parquet shards (and the same rows as a saved HF Dataset) under ``directory``; the block plan over them."""
    rng = np.random.default_rng(0)
    (directory / "parquet").mkdir(parents=True)
    for number in range(settings.read_files):
        first = number * settings.read_rows_per_file
        ids = np.arange(first, first + settings.read_rows_per_file)
        features = rng.random((ids.size, READ_FEATURES), dtype=np.float32)
        table = pa.table(
            {
                "id": ids,
                "label": ids % 10,
                "text": [f"sample {i} of shard {number}" for i in ids.tolist()],
                "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), READ_FEATURES),
            }
        )
        path = directory / "parquet" / f"part-{number:03d}.parquet"
        pq.write_table(table, path, row_group_size=settings.read_row_group)
    try:
        import datasets
    except ImportError:
        pass
    else:
        files = sorted(str(path) for path in (directory / "parquet").glob("*.parquet"))
        datasets.disable_progress_bars()
        hf = datasets.Dataset.from_parquet(files, cache_dir=str(directory / "cache"))
        hf.save_to_disk(str(directory / "hf"))
    size = settings.read_files * settings.read_rows_per_file
    return EpochPlan(size, settings.read_global_batch, block_size=settings.read_row_group, window=settings.read_window)


def measure_reads(settings: Settings, progress: Progress, task: TaskID) -> list[ReadRow]:
    """Table 4: each case's member rate and its source's sequential rate, medians of fresh single-core processes."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="stalwart-reads-") as temporary:
        directory = Path(temporary)
        progress.update(task, description="member reads: writing shards")
        block_plan = write_read_data(settings, directory)
        has_hf = (directory / "hf").exists()
        offsets = np.arange(settings.read_files + 1) * settings.read_rows_per_file
        sequential: dict[str, float] = {}
        for source, order, world in settings.read_cases:
            progress.update(task, description=f"member reads: {source}, {order} order, {world} members")
            if source != "parquet" and not has_hf:
                progress.advance(task)
                continue
            plan = block_plan if order == "block" else dataclasses.replace(block_plan, block_size=1, window=1)
            steps = plan.steps_per_epoch if order == "block" else 2
            member = {"kind": source, "directory": temporary, "plan": plan.to_dict(), "world": world, "steps": steps}
            reading = {"kind": source, "directory": temporary}
            rate, baseline = _best_rates(member, reading, settings.read_repeats, settings.read_isolated)
            sequential[source] = max(baseline, sequential.get(source, 0.0))
            touched = [
                np.unique(np.searchsorted(offsets, share, side="right")).size
                for share in (
                    plan.indices(0, plan.step_start(s), plan.step_start(s) + split_sizes(plan.step_total(s), world)[0])
                    for s in range(steps)
                )
            ]
            rows.append(ReadRow(source, order, world, float(np.mean(touched)), rate, sequential[source]))
            progress.advance(task)
    return rows


def _best_rates(member: dict[str, Any], reading: dict[str, Any], repeats: int, isolated: bool) -> tuple[float, float]:
    """Best rows per second of the member and of the sequential read, each ``repeats`` times (``isolated``: in
    fresh single-core processes), in interleaved rounds so that both meet the same load (the best run is the least
    disturbed one)."""
    reads = {member_read: member, sequential_read: reading}

    def rate(read: Callable[..., dict[str, Any]], _: int) -> float:
        if isolated:
            result = run_isolated(f"{_MODULE}:{read.__name__}", reads[read], single_core=True).result
        else:
            result = read(**reads[read])
        return float(result["rows"] / result["seconds"])

    rates = interleaved_rounds(tuple(reads), repeats, rate)
    return max(rates[member_read]), max(rates[sequential_read])


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


def read_goal(rows: Sequence[ReadRow]) -> Goal:
    """Goal 4, judged on the block order at ``READ_GOAL_WORLD`` members for Parquet and the HF Dataset."""
    description = (
        f"a member's reads >= {READ_GOAL_RATIO:.0%} of a sequential read of the same shards "
        f"({READ_GOAL_WORLD} members, Parquet and HF Dataset)"
    )
    judged = [r for r in rows if r.order == "block" and r.world == READ_GOAL_WORLD and r.source in {"parquet", "hf"}]
    if not judged:
        return Goal(description, None, "not measured")
    worst = min(judged, key=lambda row: row.ratio)
    detail = ", ".join(f"{_SOURCE_LABELS[row.source]} {row.ratio:.2f}" for row in judged)
    return Goal(description, worst.ratio >= READ_GOAL_RATIO, detail)


def print_reads(console: Console, rows: Sequence[ReadRow], settings: Settings) -> None:
    """Table 4."""
    print_table(
        console,
        "4. A member's reads from shards against a sequential read of the same shards",
        [
            Column("source", justify="left"),
            Column("order", justify="left"),
            *("members", "shards per share", "member rows/s", "sequential rows/s", "ratio"),
        ],
        [
            [
                _SOURCE_LABELS[row.source],
                row.order,
                str(row.world),
                f"{row.shards_per_step:.1f}",
                _number(row.member_rows_per_second),
                _number(row.sequential_rows_per_second),
                f"{row.ratio:.2f}",
            ]
            for row in rows
        ],
        caption=(
            f"{settings.read_files} Parquet files of {settings.read_rows_per_file:,} rows (id, label, text, "
            f"{READ_FEATURES} float32), row groups of {settings.read_row_group}; global batch "
            f"{settings.read_global_batch:,}; block order: block_size={settings.read_row_group}, "
            f"window={settings.read_window}; member 0's shares of an epoch (global order: 2 steps) in micro-batches "
            f"of {READ_MICROBATCH}; sequential: pyarrow row groups in file order (Parquet), __getitems__ over "
            f"consecutive indices (HF Dataset), iteration (HF IterableDataset); "
            f"{'one core per process' if settings.read_isolated else 'in this process'}, best of "
            f"{settings.read_repeats} runs taken in turns (the sequential rate: best over the source's rows)."
        ),
    )


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
    machine_line(console, args.quick, f"torch {torch.__version__}", f"numpy {np.__version__}")

    repeats = settings.process_repeats
    first_batch_units = repeats * (1 + 2 * len(settings.compared_sizes) + len(settings.stalwart_only_sizes))
    ledger_units = len(settings.ledger_members) * len(settings.ledger_batches)
    throughput_units = len(settings.throughput_sizes) * len(settings.throughput_chunks)
    total = first_batch_units + ledger_units + throughput_units + len(settings.read_cases)
    with progress_display(console) as progress:
        task = progress.add_task("starting", total=total)
        first_batch = measure_first_batch(settings, progress, task)
        ledger = measure_ledger(settings, progress, task)
        throughput = measure_throughput(settings, progress, task)
        reads = measure_reads(settings, progress, task)

    print_first_batch(console, first_batch)
    print_ledger(console, ledger)
    print_throughput(console, throughput)
    print_reads(console, reads, settings)
    goals = [first_batch_goal(first_batch), ledger_goal(ledger), throughput_goal(throughput), read_goal(reads)]
    print_goals(console, goals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
