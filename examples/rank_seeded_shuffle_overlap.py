"""What ``shuffle(seed=42 + global_rank)`` does to a sharded stream, next to stalwart's ``ShardedStream``.

The mistake: every rank shuffles the *whole* stream with its own seed and takes
its first rows. The ranks draw from the same pool independently, so some rows
are trained on by several ranks in the same epoch and others by none. A
``ShardedStream`` gives every rank the same order and a disjoint, contiguous
part of each step, so the ranks together take each row exactly once.

Both runs write audit files (one JSON line per consumed batch) and the audit
of each is printed side by side. Run it with ``python
examples/rank_seeded_shuffle_overlap.py``; ``--help`` lists the sizes.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from stalwart.data.audit import AuditReport, AuditWriter, audit_directory
from stalwart.data.shards import ParquetShard
from stalwart.data.streaming import ShardedStream

ROW_GROUP_SIZE = 16


@dataclass(frozen=True)
class Comparison:
    """The audits of one epoch of both runs over the same shards."""

    rank_seeded: AuditReport
    stalwart: AuditReport


def write_shards(directory: Path, total_rows: int, num_shards: int) -> list[ParquetShard]:
    """Write ``total_rows`` rows with global ids ``0..total_rows-1`` into ``num_shards`` Parquet files."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for index, ids in enumerate(np.array_split(np.arange(total_rows), num_shards)):
        path = directory / f"shard-{index:03d}.parquet"
        table = pa.table({"id": ids, "text": [f"sample {i}" for i in ids]})
        pq.write_table(table, path, row_group_size=ROW_GROUP_SIZE)
        shards.append(ParquetShard(path))
    return shards


def run_rank_seeded(
    shards: Sequence[ParquetShard], audit_dir: Path, *, ranks: int, steps: int, per_rank_batch: int, seed: int
) -> None:
    """Each rank shuffles the whole stream with ``seed + rank`` and takes ``steps * per_rank_batch`` rows."""
    total_rows = sum(shard.num_rows for shard in shards)
    for rank in range(ranks):
        rng = np.random.default_rng(seed + rank)
        stream: list[int] = []
        for shard_index in rng.permutation(len(shards)):
            rows = shards[shard_index].read(0, shards[shard_index].num_rows)
            stream.extend(rows[i]["id"] for i in rng.permutation(len(rows)))
        with AuditWriter(audit_dir, rank, expected={"dataset_size": total_rows}) as writer:
            for step in range(steps):
                writer.write(0, step, stream[step * per_rank_batch : (step + 1) * per_rank_batch])


def run_stalwart(
    shards: Sequence[ParquetShard], audit_dir: Path, *, ranks: int, workers: int, steps: int, per_rank_batch: int
) -> None:
    """Each rank reads ``steps`` steps of its ``ShardedStream`` through a DataLoader with ``workers`` workers."""
    for rank in range(ranks):
        stream = ShardedStream(
            shards,
            ranks * per_rank_batch,
            rank=rank,
            world_size=ranks,
            block_size=per_rank_batch,
            audit_dir=audit_dir,
        )
        loader = DataLoader(stream, batch_size=None, num_workers=workers)
        for batch in itertools.islice(stream.consume(loader), steps):
            if [row["id"] for row in batch.rows] != batch.indices.tolist():
                raise AssertionError(f"rank {rank} step {batch.step}: rows do not match their global ids")
        stream.close()


def compare(
    directory: Path, *, ranks: int, workers: int, steps: int, per_rank_batch: int, num_shards: int, seed: int
) -> Comparison:
    """Write the shards under ``directory``, run both ways for one epoch and audit both."""
    shards = write_shards(directory / "shards", ranks * steps * per_rank_batch, num_shards)
    run_rank_seeded(
        shards, directory / "rank-seeded", ranks=ranks, steps=steps, per_rank_batch=per_rank_batch, seed=seed
    )
    run_stalwart(
        shards, directory / "stalwart", ranks=ranks, workers=workers, steps=steps, per_rank_batch=per_rank_batch
    )
    return Comparison(audit_directory(directory / "rank-seeded"), audit_directory(directory / "stalwart"))


def print_comparison(comparison: Comparison, console: Console) -> None:
    """Print the two audits side by side."""
    table = Table(title="one epoch, audited", title_justify="left")
    table.add_column("")
    table.add_column("shuffle(42 + rank)", justify="right")
    table.add_column("ShardedStream", justify="right")
    mistake, stalwart = comparison.rank_seeded.epochs[0], comparison.stalwart.epochs[0]
    table.add_row("samples consumed", str(mistake.coverage.consumed), str(stalwart.coverage.consumed))
    table.add_row("expected", str(mistake.expected), str(stalwart.expected))
    table.add_row("duplicated samples", str(len(mistake.coverage.duplicates)), str(len(stalwart.coverage.duplicates)))
    table.add_row("missing samples", str(len(mistake.coverage.missing)), str(len(stalwart.coverage.missing)))
    table.add_row("exactly once", str(mistake.coverage.exactly_once), str(stalwart.coverage.exactly_once))
    console.print(table)


def main(argv: Sequence[str] | None = None) -> Comparison:
    """Parse the sizes, run the comparison in a temporary directory (or ``--directory``) and print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="data-parallel ranks (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="steps in the epoch (default 5)")
    parser.add_argument("--per-rank-batch", type=int, default=8, help="rows per rank per step (default 8)")
    parser.add_argument("--shards", type=int, default=4, help="Parquet shards (default 4)")
    parser.add_argument("--seed", type=int, default=42, help="base seed of the mistake (default 42)")
    parser.add_argument("--directory", type=Path, help="keep shards and audit files here instead of a temp dir")
    args = parser.parse_args(argv)
    for name in ("ranks", "steps", "per_rank_batch", "shards"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.workers < 0:
        parser.error(f"--workers must be at least 0, got {args.workers}")
    if args.directory is not None and args.directory.exists() and any(args.directory.iterdir()):
        parser.error(f"--directory must be empty or new (audit files are appended to), got {args.directory}")
    sizes = {
        "ranks": args.ranks,
        "workers": args.workers,
        "steps": args.steps,
        "per_rank_batch": args.per_rank_batch,
        "num_shards": args.shards,
        "seed": args.seed,
    }
    if args.directory is not None:
        comparison = compare(args.directory, **sizes)
    else:
        with tempfile.TemporaryDirectory() as temporary:
            comparison = compare(Path(temporary), **sizes)
    print_comparison(comparison, Console())
    return comparison


if __name__ == "__main__":
    main()
