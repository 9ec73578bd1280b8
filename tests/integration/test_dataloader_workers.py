"""Data sources under DataLoader worker processes: streams, shards, samplers and the row audit across forks.

The pure logic of each is tested in ``tests/unit`` (``test_streaming``, ``test_shards``, ``test_sampler``,
``test_row_audit``); here the same objects cross into forked DataLoader workers.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from stalwart.data.audit import audit_directory
from stalwart.data.plan import EpochPlan
from stalwart.data.rowkeys import key_hashes
from stalwart.data.sampler import ManagedDistributedSampler
from stalwart.data.shards import InMemoryShard, ParquetShard, ShardedDataset
from stalwart.data.streaming import ShardedStream
from stalwart.data.world import WorldInfo
from stalwart.runtime.consistency import row_checksum
from stalwart.runtime.loader import ElasticLoader
from stalwart.testing.sources import hf_json_source, hf_json_stream, memory_shards, write_jsonl, write_parquet

pytest.importorskip("datasets", reason="datasets is not installed (the dev set-up installs it)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rank_seeded_shuffle_overlap.py"


def streams(source: Any, world_size: int, **kwargs: Any) -> list[ShardedStream]:
    return [ShardedStream(source, rank=rank, world_size=world_size, **kwargs) for rank in range(world_size)]


@pytest.mark.parametrize("workers", [0, 1])
def test_iterating_the_dataloader_without_consume_fails_at_once(workers: int) -> None:
    """In the process and in a worker. (One worker: a loader whose workers raised in ``__iter__`` is shut down by
    torch only after ``MP_STATUS_CHECK_INTERVAL``, 5 s per worker, when the garbage collector finds it.)"""
    stream = ShardedStream(memory_shards([40]), 8, rank=0, world_size=1)
    with pytest.raises(RuntimeError, match=r"iterate a ShardedStream through stream.consume\(loader\)"):
        next(iter(DataLoader(stream, batch_size=None, num_workers=workers)))
    assert (stream.epoch, stream.step) == (0, 0)
    list(stream.consume(DataLoader(stream, batch_size=None, num_workers=workers)))
    with pytest.raises(RuntimeError, match="consume"):
        next(iter(DataLoader(stream, batch_size=None, num_workers=workers)))


def run_ranks(
    source: Any, world: int, workers: int, steps: int | None, state: dict[str, Any] | None, **kwargs: Any
) -> tuple[list[int], dict[str, Any], int]:
    """Each rank of a ``world`` consumes ``steps`` steps through a DataLoader with ``workers`` workers:
    the row ids read out of the rows, the (common) state afterwards and the rows decoded."""
    ids: list[int] = []
    states = []
    decoded = 0
    for stream in streams(source, world, **kwargs):
        if state is not None:
            stream.load_state_dict(state)
        loader = DataLoader(stream, batch_size=None, num_workers=workers)
        for batch in itertools.islice(stream.consume(loader), steps):
            ids.extend(row["id"] for row in batch.rows)
            assert batch.keys == [row["id"] for row in batch.rows] == batch.indices.tolist()
            decoded += batch.rows_decoded
        states.append(json.loads(json.dumps(stream.state_dict())))
        stream.close()
    assert all(other == states[0] for other in states)
    return ids, states[0], decoded


@pytest.mark.parametrize(
    ("before", "after"),
    [((1, 0), (2, 4)), ((2, 1), (3, 2)), ((2, 2), (3, 0)), ((3, 4), (1, 1)), ((2, 4), (2, 2))],
)
def test_hugging_face_streams_with_workers_are_exactly_once_across_a_world_size_change(
    tmp_path: Path, before: tuple[int, int], after: tuple[int, int]
) -> None:
    """Before: a Hugging Face shard read by DataLoader worker 1 of 2 held no rows (ShardError), and a state
    carried only the step. Row ids come out of the rows; the audit is checked apart."""
    source = hf_json_source(write_jsonl(tmp_path / "data", [40, 24, 40, 8, 40, 40]))
    kwargs: dict[str, Any] = {"global_batch_size": 12, "block_size": 4, "seed": 5, "audit_dir": tmp_path / "audit"}
    first, state, _ = run_ranks(source, *before, steps=7, state=None, **kwargs)
    assert (state["epoch"], state["step"]) == (0, 7)
    rest, state, _ = run_ranks(source, *after, steps=None, state=state, **kwargs)
    assert (state["epoch"], state["step"]) == (1, 0)
    counts = Counter(first + rest)
    assert sorted(counts) == list(range(192)) and set(counts.values()) == {1}
    report = audit_directory(tmp_path / "audit")
    assert report.ok and report.epochs[0].complete and report.epochs[0].keys is not None
    assert set(report.epochs[0].rank_samples) == {
        (rank, world) for world, _ in (before, after) for rank in range(world)
    }


def test_each_worker_decodes_only_the_rows_it_delivers(tmp_path: Path) -> None:
    """Eight shards, two ranks of two workers: each worker reads two whole shards. Before: every worker read
    every shard (four times the rows)."""
    source = hf_json_source(write_jsonl(tmp_path, [40] * 8))
    ids, _, decoded = run_ranks(source, 2, 2, steps=None, state=None, global_batch_size=8, block_size=8)
    assert sorted(ids) == list(range(320)) and decoded == 320


def test_parquet_shards_with_workers_started_in_any_order(tmp_path: Path) -> None:
    paths = write_parquet(tmp_path, [25, 25, 25, 25], 5)
    shards = [ParquetShard(path, columns=["id"]) for path in paths]

    def late_first_worker(worker: int) -> None:
        if worker == 0:
            time.sleep(0.2)  # worker 1 reads first; nothing may depend on it

    ids: list[int] = []
    for stream in streams(shards, 2, global_batch_size=10, block_size=5, key="id"):
        loader = DataLoader(stream, batch_size=None, num_workers=2, worker_init_fn=late_first_worker)
        ids.extend(row["id"] for batch in stream.consume(loader) for row in batch.rows)
    assert sorted(ids) == list(range(100))


def test_example_shows_overlap_for_rank_seeded_shuffle_and_none_for_stalwart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("rank_seeded_shuffle_overlap", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)
    spec.loader.exec_module(example)
    comparison = example.main(["--ranks", "3", "--steps", "4", "--per-rank-batch", "6", "--directory", str(tmp_path)])
    mistake, stalwart = comparison.rank_seeded, comparison.stalwart
    assert not mistake.ok and mistake.epochs[0].coverage.duplicates and mistake.epochs[0].coverage.missing
    assert stalwart.ok and stalwart.epochs[0].complete and stalwart.epochs[0].coverage.exactly_once
    assert stalwart.epochs[0].rank_samples == {(0, 3): 24, (1, 3): 24, (2, 3): 24}


@pytest.mark.parametrize("workers", [0, 1, 2, 4])
def test_hugging_face_shards_read_right_in_dataloader_workers(tmp_path: Path, workers: int) -> None:
    """Before: a one-file shard read in worker k > 0 held no rows (Hugging Face split it across the workers)."""
    dataset = ShardedDataset.from_hf_iterable(hf_json_stream(write_jsonl(tmp_path, [23, 5, 40, 12])), piece_rows=8)
    order = EpochPlan(80, 10, seed=1).indices(0, 0, 80).tolist()
    loader = DataLoader(dataset, batch_size=10, sampler=order, num_workers=workers, collate_fn=list)
    assert [row["id"] for batch in loader for row in batch] == order


def test_workers_forked_after_the_main_process_read_open_cursors_of_their_own(tmp_path: Path) -> None:
    """The main process reads a shard's first piece, then two forked DataLoader workers read on from there.
    Small JSON chunks keep the cursor reading its file: continuing the cursor they inherited, the workers would
    read through one shared file offset, each getting the other's bytes."""
    datasets = pytest.importorskip("datasets")
    files = write_jsonl(tmp_path, [2000])
    stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True, chunksize=256)
    dataset = ShardedDataset.from_hf_iterable(stream, num_rows=[2000], piece_rows=8)
    assert dataset[0]["id"] == 0
    loader = DataLoader(dataset, batch_size=8, sampler=range(8, 2000), num_workers=2, collate_fn=list)
    assert [row["id"] for batch in loader for row in batch] == list(range(8, 2000))


def collate_values(batch: list[tuple[torch.Tensor]]) -> list[int]:
    return [int(item[0]) for item in batch]


@pytest.mark.parametrize(("size", "batch", "world_size", "multiple"), [(61, 12, 3, 2), (40, 8, 2, 1)])
def test_works_as_batch_sampler_of_a_dataloader_with_workers(
    size: int, batch: int, world_size: int, multiple: int
) -> None:
    values = torch.arange(size) * 7 + 3
    dataset = TensorDataset(values)
    received = []
    for rank in range(world_size):
        sampler = ManagedDistributedSampler(
            dataset,
            batch,
            world=WorldInfo(rank, world_size),
            local_batch_multiple=multiple,
            seed=11,
            allow_empty_shares=True,  # (61, 12, 3, 2): the last step's 1 sample leaves two ranks an empty list
        )
        sampler.set_epoch(1)
        expected = list(sampler)
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2, collate_fn=collate_values)
        assert len(loader) == len(expected)
        batches = list(loader)
        assert batches == [[int(values[index]) for index in share] for share in expected]
        received.extend(batches)
    assert sorted(value for batch in received for value in batch) == sorted(values.tolist())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_sums_the_rows_it_hands_out(num_workers: int) -> None:
    rows = [{"id": i, "text": f"row {i}"} for i in range(40)]
    dataset = ShardedDataset([InMemoryShard(rows[:25]), InMemoryShard(rows[25:])], key="id")
    loader = ElasticLoader(dataset, collate_fn=list, num_workers=num_workers, prefetch=True)
    plan = EpochPlan(40, 10, seed=3)
    try:
        total = 0
        for step in range(plan.steps_per_epoch):
            share = plan.indices(0, plan.step_start(step), plan.step_start(step + 1)).tolist()
            loader.prefetch(0, share)
            assert [row["id"] for batch in loader.microbatches(0, share, 4) for row in batch] == share
            total += loader.take_row_checksum()
        assert loader.take_row_checksum() == 0, "taken, then reset"
    finally:
        loader.close()
    assert total % (1 << 64) == row_checksum(np.arange(40), key_hashes(list(range(40))))
    plain = ElasticLoader(list(range(5)), collate_fn=list)  # no row keys: nothing to sum
    list(plain.microbatches(0, [1, 2], 2))
    assert plain.take_row_checksum() == 0
    plain.close()
