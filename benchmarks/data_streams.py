"""Stream benchmark: a Hugging Face stream read by ranks and DataLoader workers, against ``split_dataset_by_node``.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.data_streams           # 8 JSON-lines shards of 5000 rows, 5 rounds: a few minutes
    python -m benchmarks.data_streams --quick   # small shards, one round, in one process (indicative only)

The data is ``SHARDS`` JSON-lines files of rows ``{"id", "text"}`` written to
a temporary directory and read as one Hugging Face ``IterableDataset``
(``load_dataset("json", streaming=True)``); every contender gets the same
files and the same collate function (ids, and each text's first bytes, as
tensors), for a global batch of ``GLOBAL_BATCH`` rows per step:

* ``split_dataset_by_node``: ``datasets.distributed.split_dataset_by_node``
  then ``DataLoader(batch_size=per rank, num_workers=K, collate_fn=collate)``
  (Hugging Face gives each rank whole files when their number divides, else
  every rank reads every row and keeps one in ``world``);
* the same after ``.shuffle(seed, buffer_size=1000)``, the mixing a user adds;
* ``ShardedStream`` over ``ShardedDataset.from_hf_iterable(stream, key="id")``
  through ``DataLoader(batch_size=None, num_workers=K)``, collating in the stream;
* the same with ``interleave=4`` (each worker mixes four runs of the data);
* the same keyed by a content hash of each row (``key=None``), to show its cost.

Each case runs in a fresh process (``--quick``: all in the driver's) that
builds the dataset, then reads one epoch rank by rank (each rank's loader as
it would run in its own process) and reports the rows, the seconds spent in
the loaders, the CPU seconds of the process and its DataLoader workers (less
disturbed by other load on the machine than the seconds), the rows decoded
(``StreamBatch.rows_decoded``; for Hugging Face, counted in a second,
untimed pass through a ``map``) and every batch's row ids. Rounds run the
cases in turn, in an order that rotates each round, so that all meet the
same load; rates are medians over the rounds with their range, and each
ratio is the median of the rounds' ratios.
Mixing: for every step, the number of shards and the span of ids (largest
minus smallest) in the global batch (all ranks' parts), median and 90th
percentile. Goals at 2 ranks x 2 workers: at most 1.05 rows decoded per row
delivered, at least 0.95x the rows per second of ``split_dataset_by_node``.
The benchmark reports; it never fails because a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks._measure import Goal, make_console, print_goals, print_table, progress_display, run_isolated
from benchmarks._rounds import fixed, interleaved_rounds, median_span, round_ratios

GLOBAL_BATCH = 64
TEXT_BYTES = 32
SHUFFLE_BUFFER = 1000
INTERLEAVE = 4
DECODE_GOAL = 1.05
THROUGHPUT_GOAL = 0.95
GOAL_WORLD = (2, 2)
_MODULE = "benchmarks.data_streams"
CASES = ("split_dataset_by_node", "split_dataset_by_node + shuffle", "ShardedStream", "interleave=4", "content keys")


@dataclass(frozen=True)
class Settings:
    """Sizes of one run (full or ``--quick``)."""

    shards: int
    rows_per_shard: int
    worlds: tuple[tuple[int, int], ...]
    rounds: int
    isolated: bool = True
    """Each case in a fresh process (the CPU seconds are its own); ``--quick`` runs them all in this one."""


FULL = Settings(shards=8, rows_per_shard=5000, worlds=((2, 2), (3, 2)), rounds=5)
QUICK = Settings(shards=8, rows_per_shard=120, worlds=((2, 2), (3, 2)), rounds=1, isolated=False)


def write_shards(directory: Path, settings: Settings) -> list[str]:
    """``settings.shards`` JSON-lines files whose rows are ``{"id": global id, "text": ...}``."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for shard in range(settings.shards):
        ids = range(shard * settings.rows_per_shard, (shard + 1) * settings.rows_per_shard)
        path = directory / f"part-{shard:05d}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "text": f"sample {i} " * (1 + i % 5)}) + "\n" for i in ids))
        files.append(str(path))
    return files


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Ids and the first ``TEXT_BYTES`` bytes of each text, zero-padded: the same for every contender."""
    data = torch.zeros(len(rows), TEXT_BYTES, dtype=torch.long)
    for row, text in enumerate(row["text"].encode()[:TEXT_BYTES] for row in rows):
        data[row, : len(text)] = torch.tensor(list(text))
    return {"id": torch.tensor([row["id"] for row in rows]), "text": data}


def _stream(files: list[str]) -> Any:
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset("json", data_files=files, split="train", streaming=True)


def _hf_loader(case: str, files: list[str], rank: int, world: int, workers: int, count_dir: str | None) -> Any:
    from datasets.distributed import split_dataset_by_node

    stream = _stream(files)
    if case == "split_dataset_by_node + shuffle":
        stream = stream.shuffle(seed=0, buffer_size=SHUFFLE_BUFFER)
    if count_dir is not None:
        stream = stream.map(_Counter(count_dir), batched=True, batch_size=256)
    part = split_dataset_by_node(stream, rank=rank, world_size=world)
    return DataLoader(part, batch_size=GLOBAL_BATCH // world, num_workers=workers, collate_fn=collate)


class _Counter:
    """A batched ``map`` that counts the rows it sees (every row the iteration decodes), one file per process."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        with Path(self.directory, f"{os.getpid()}.count").open("a") as file:
            file.write(f"{len(batch['id'])}\n")
        return batch


def loader_epoch(case: str, files: list[str], world: int, workers: int, rows_per_shard: int) -> dict[str, Any]:
    """One epoch of ``case`` read rank by rank: rows, loader seconds, rows decoded, each batch's ids by rank."""
    from stalwart.data import ShardedDataset, ShardedStream

    ids: list[list[list[int]]] = []
    seconds = 0.0
    decoded = 0
    cpu = -_cpu_seconds()
    for rank in range(world):
        if case.startswith("split_dataset_by_node"):
            loader = _hf_loader(case, files, rank, world, workers, None)
            start = time.perf_counter()
            batches = [batch["id"].tolist() for batch in loader]
            seconds += time.perf_counter() - start
        else:
            key = None if case == "content keys" else "id"
            source = ShardedDataset.from_hf_iterable(_stream(files), num_rows=[rows_per_shard] * len(files), key=key)
            interleave = INTERLEAVE if case == "interleave=4" else 1
            stream = ShardedStream(source, GLOBAL_BATCH, rank=rank, world_size=world, interleave=interleave)
            stream.collate_fn = collate
            loader = DataLoader(stream, batch_size=None, num_workers=workers)
            start = time.perf_counter()
            batches = []
            for batch in stream.consume(loader):
                batches.append(batch.rows["id"].tolist())
                decoded += batch.rows_decoded
            seconds += time.perf_counter() - start
        ids.append(batches)
    cpu += _cpu_seconds()
    if case.startswith("split_dataset_by_node"):
        decoded = _hf_decoded(case, files, world, workers)
    rows = sum(len(batch) for rank in ids for batch in rank)
    return {"rows": rows, "seconds": seconds, "cpu_seconds": cpu, "decoded": decoded, "ids": ids}


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that ended (the DataLoader workers, once joined)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _hf_decoded(case: str, files: list[str], world: int, workers: int) -> int:
    """Rows the Hugging Face iteration decodes over all ranks, counted by a ``map`` (untimed)."""
    with tempfile.TemporaryDirectory(prefix="stalwart-count-") as count_dir:
        for rank in range(world):
            for _ in _hf_loader(case, files, rank, world, workers, count_dir):
                pass
        return sum(int(line) for path in Path(count_dir).glob("*.count") for line in path.read_text().split())


@dataclass(frozen=True)
class Mixing:
    """Shards and id span of a global batch: medians and 90th percentiles over the steps."""

    shards_median: float
    shards_p90: float
    span_median: float
    span_p90: float


def mixing(ids: list[list[list[int]]], rows_per_shard: int) -> Mixing:
    """Each step's global batch is the union of the ranks' ``t``-th batches."""
    shards, spans = [], []
    for step in range(min(len(rank) for rank in ids)):
        batch = np.asarray([i for rank in ids for i in rank[step]])
        shards.append(np.unique(batch // rows_per_shard).size)
        spans.append(int(batch.max() - batch.min()))
    return Mixing(
        float(np.median(shards)),
        float(np.percentile(shards, 90)),
        float(np.median(spans)),
        float(np.percentile(spans, 90)),
    )


@dataclass(frozen=True)
class Row:
    """One case at one world size, over the rounds."""

    case: str
    world: tuple[int, int]
    rates: list[float]
    ratios: list[float]
    cpu_per_thousand: list[float]
    decoded_per_row: float
    exactly_once: bool
    mix: Mixing


def measure(settings: Settings, console: Any) -> list[Row]:
    """Every case at every world size in ``settings.rounds`` interleaved rounds, each run in a fresh process."""
    variants = [(case, world) for world in settings.worlds for case in CASES]
    with tempfile.TemporaryDirectory(prefix="stalwart-streams-") as temporary:
        files = write_shards(Path(temporary), settings)
        total = settings.shards * settings.rows_per_shard
        with progress_display(console) as progress:
            task = progress.add_task("streams", total=settings.rounds * len(variants))

            def epoch(variant: tuple[str, tuple[int, int]], round_number: int) -> dict[str, Any]:
                case, (world, workers) = variant
                progress.update(task, description=f"round {round_number + 1}: {case}, {world}x{workers}")
                if not settings.isolated:
                    result = loader_epoch(case, files, world, workers, settings.rows_per_shard)
                else:
                    kwargs = {"case": case, "files": files, "world": world, "workers": workers}
                    target = f"{_MODULE}:loader_epoch"
                    result = run_isolated(target, {**kwargs, "rows_per_shard": settings.rows_per_shard}).result
                progress.advance(task)
                return result

            results = interleaved_rounds(variants, settings.rounds, epoch)
    rows = []
    for (case, world), runs in results.items():
        baseline = results[(CASES[0], world)]
        rates = [run["rows"] / run["seconds"] for run in runs]
        ratios = round_ratios(rates, [base["rows"] / base["seconds"] for base in baseline])
        ids = runs[0]["ids"]
        flat = sorted(i for rank in ids for batch in rank for i in batch)
        rows.append(
            Row(
                case,
                world,
                rates,
                ratios,
                [1e6 * run["cpu_seconds"] / run["rows"] for run in runs],
                runs[0]["decoded"] / runs[0]["rows"],
                flat == list(range(total)),
                mixing(ids, settings.rows_per_shard),
            )
        )
    return rows


def print_rows(console: Any, rows: Sequence[Row], settings: Settings) -> None:
    columns = ["world x workers", "rows/s", "vs split_dataset_by_node", "CPU ms per 1k rows", "decoded per delivered"]
    columns += ["exactly once"]
    columns += ["shards per batch (median, p90)", "id span (median, p90)"]
    table_rows = [
        [
            row.case,
            f"{row.world[0]} x {row.world[1]}",
            median_span(row.rates, fixed(0)),
            median_span(row.ratios, fixed(2)) + "x",
            median_span(row.cpu_per_thousand, fixed(0)),
            f"{row.decoded_per_row:.3f}",
            "yes" if row.exactly_once else "NO",
            f"{row.mix.shards_median:.0f}, {row.mix.shards_p90:.0f}",
            f"{row.mix.span_median:,.0f}, {row.mix.span_p90:,.0f}",
        ]
        for row in sorted(rows, key=lambda row: (row.world, CASES.index(row.case)))
    ]
    print_table(
        console,
        f"Hugging Face stream, {settings.shards} JSON-lines shards of {settings.rows_per_shard} rows, global batch "
        f"{GLOBAL_BATCH}, {settings.rounds} round(s)",
        ["case", *columns],
        table_rows,
        caption="rows/s: all ranks' rows over the seconds in their loaders; CPU: of the loaders' main process and "
        "workers; median (range) over rounds",
    )


def goals(rows: Sequence[Row]) -> list[Goal]:
    stalwart = next((row for row in rows if row.case == "ShardedStream" and row.world == GOAL_WORLD), None)
    if stalwart is None:
        return [Goal("rows decoded per row delivered", None, "not run"), Goal("throughput", None, "not run")]
    ratio = statistics.median(stalwart.ratios)
    return [
        Goal(
            f"at {GOAL_WORLD[0]} ranks x {GOAL_WORLD[1]} workers, at most {DECODE_GOAL} rows decoded per row delivered",
            stalwart.decoded_per_row <= DECODE_GOAL,
            f"{stalwart.decoded_per_row:.3f}",
        ),
        Goal(
            f"at {GOAL_WORLD[0]} ranks x {GOAL_WORLD[1]} workers, at least {THROUGHPUT_GOAL}x split_dataset_by_node",
            ratio >= THROUGHPUT_GOAL,
            f"{ratio:.2f}x, rounds {', '.join(f'{value:.2f}' for value in stalwart.ratios)}",
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shards, one round, in this process")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    console = make_console()
    rows = measure(settings, console)
    print_rows(console, rows, settings)
    print_goals(console, goals(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
