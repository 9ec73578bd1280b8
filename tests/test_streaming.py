"""Sharded streams: the epoch order, the split over ranks and workers, resuming and re-splitting, Parquet shards."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from stalwart.data.audit import audit_directory, coverage
from stalwart.data.schedule import split_sizes, step_boundary
from stalwart.data.shards import InMemoryShard, ParquetShard
from stalwart.data.streaming import ShardedStream, StreamBatch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rank_seeded_shuffle_overlap.py"


def memory_shards(sizes: list[int]) -> list[InMemoryShard]:
    """Shards whose rows are their global row ids, so a row says where it came from."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [InMemoryShard(list(range(offsets[i], offsets[i + 1]))) for i in range(len(sizes))]


def streams(shards: list[Any], world_size: int, **kwargs: Any) -> list[ShardedStream]:
    return [ShardedStream(shards, rank=rank, world_size=world_size, **kwargs) for rank in range(world_size)]


def consume_steps(stream: ShardedStream, steps: int | None = None) -> list[StreamBatch]:
    """Consume up to ``steps`` batches of the stream's current epoch in this process."""
    return list(itertools.islice(stream.consume(iter(stream)), steps))


shard_sizes = st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda sizes: sum(sizes) > 0)


@st.composite
def stream_settings(draw: st.DrawFn) -> dict[str, Any]:
    batch = draw(st.integers(1, 30))
    return {
        "global_batch_size": batch,
        "local_batch_multiple": draw(st.integers(1, batch)),
        "block_size": draw(st.integers(1, 12)),
        "seed": draw(st.integers(0, 2**32)),
    }


# --- the epoch order: the plan's windowed block shuffle (tests/test_block_order.py) --------------------------------


@settings(max_examples=60, deadline=None)
@given(shard_sizes, stream_settings(), st.integers(0, 5))
def test_the_stream_follows_the_plan_and_reads_blocks_as_runs(
    sizes: list[int], kwargs: dict[str, Any], epoch: int
) -> None:
    stream = ShardedStream(memory_shards(sizes), rank=0, world_size=1, **kwargs)
    total = sum(sizes)
    plan = stream.plan
    assert (plan.dataset_size, plan.seed, plan.block_size) == (total, kwargs["seed"], min(kwargs["block_size"], total))
    ids = np.concatenate([stream.batch(epoch, step).indices for step in range(stream.steps_per_epoch)])
    assert ids.tolist() == plan.indices(epoch, 0, total).tolist()
    runs = [block for block, _ in itertools.groupby((ids // plan.block_size).tolist())]
    assert len(runs) == len(set(runs)), "each block is streamed in one run"


def test_the_default_window_holds_about_one_shard() -> None:
    assert ShardedStream(memory_shards([100, 100, 60]), 8, rank=0, world_size=1, block_size=10).plan.window == 9
    assert ShardedStream(memory_shards([5, 0, 7]), 8, rank=0, world_size=1, block_size=10).plan.window == 1
    assert ShardedStream(memory_shards([50]), 8, rank=0, world_size=1, block_size=10, window=2).plan.window == 2


# --- the split over ranks -----------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(shard_sizes, stream_settings(), st.integers(1, 6), st.integers(0, 3))
def test_ranks_split_every_step_and_cover_the_epoch_exactly_once(
    sizes: list[int], kwargs: dict[str, Any], world_size: int, epoch: int
) -> None:
    ranks = streams(memory_shards(sizes), world_size, **kwargs)
    total, batch, multiple = sum(sizes), kwargs["global_batch_size"], kwargs["local_batch_multiple"]
    consumed: list[np.ndarray] = []
    for step in range(ranks[0].steps_per_epoch):
        start, stop = (min(step_boundary(t, batch, multiple), total) for t in (step, step + 1))
        assert start < stop
        parts = [stream.batch(epoch, step) for stream in ranks]
        assert [len(part.indices) for part in parts] == split_sizes(stop - start, world_size, multiple)
        assert (
            np.concatenate([part.indices for part in parts]).tolist()
            == ranks[0].plan.indices(epoch, start, stop).tolist()
        )
        for part in parts:
            assert (part.epoch, part.step) == (epoch, step)
            assert part.rows == part.indices.tolist()
        consumed.extend(part.indices for part in parts)
    assert min(step_boundary(ranks[0].steps_per_epoch, batch, multiple), total) == total
    assert coverage(consumed, np.arange(total)).exactly_once


@settings(max_examples=40, deadline=None)
@given(shard_sizes, stream_settings(), st.integers(1, 4))
def test_iterating_a_rank_yields_its_batches_of_every_step_in_order(
    sizes: list[int], kwargs: dict[str, Any], world_size: int
) -> None:
    for stream in streams(memory_shards(sizes), world_size, **kwargs):
        stream.set_epoch(2)
        produced = list(stream)
        assert [batch.step for batch in produced] == list(range(stream.steps_per_epoch))
        for batch in produced:
            assert batch.indices.tolist() == stream.batch(2, batch.step).indices.tolist()


# --- resuming and re-splitting ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(shard_sizes, stream_settings(), st.integers(1, 6), st.integers(1, 6), st.data())
def test_resuming_with_another_world_size_keeps_the_epoch_exactly_once(
    sizes: list[int], kwargs: dict[str, Any], old_world: int, new_world: int, data: st.DataObject
) -> None:
    shards = memory_shards(sizes)
    old = streams(shards, old_world, **kwargs)
    done = data.draw(st.integers(0, old[0].steps_per_epoch - 1), label="steps before the change")
    for stream in old:
        stream.set_epoch(1)
    consumed = [batch.indices for stream in old for batch in consume_steps(stream, done)]
    states = [stream.state_dict() for stream in old]
    assert all(state == states[0] for state in states), "every rank agrees on the next step"
    assert (states[0]["epoch"], states[0]["step"]) == (1, done)
    new = streams(shards, new_world, **kwargs)
    for stream in new:
        stream.load_state_dict(states[0])
        remaining = consume_steps(stream)
        assert [batch.step for batch in remaining] == list(range(done, stream.steps_per_epoch))
        consumed.extend(batch.indices for batch in remaining)
        assert (stream.epoch, stream.step) == (2, 0), "after the last step the state is the next epoch's first"
    assert coverage(consumed, np.arange(sum(sizes))).exactly_once


@pytest.mark.parametrize(("old_world", "new_world"), [(4, 3), (2, 5)])
def test_world_size_change_mid_epoch_named_cases(old_world: int, new_world: int) -> None:
    shards = memory_shards([37, 0, 5, 64, 21])
    kwargs = {"global_batch_size": 24, "local_batch_multiple": 4, "block_size": 6, "seed": 3}
    old = streams(shards, old_world, **kwargs)
    consumed = [batch.indices for stream in old for batch in consume_steps(stream, 2)]
    state = old[0].state_dict()
    for stream in streams(shards, new_world, **kwargs):
        stream.load_state_dict(state)
        consumed.extend(batch.indices for batch in consume_steps(stream))
    assert coverage(consumed, np.arange(127)).exactly_once


def test_set_epoch_keeps_a_resumed_position_and_restarts_other_epochs() -> None:
    stream = ShardedStream(memory_shards([30]), 4, rank=0, world_size=2)
    stream.load_state_dict({**stream.state_dict(), "epoch": 3, "step": 5})
    stream.set_epoch(3)
    assert (stream.epoch, stream.step) == (3, 5)
    assert next(iter(stream)).step == 5
    stream.set_epoch(4)
    assert (stream.epoch, stream.step) == (4, 0)


def test_consumption_out_of_order_is_refused() -> None:
    stream = ShardedStream(memory_shards([30]), 4, rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="expected step 0 of epoch 0 next, got step 1"):
        stream.record_consumed(stream.batch(0, 1))


def test_state_of_another_stream_is_refused() -> None:
    stream = ShardedStream(memory_shards([30, 10]), 4, rank=0, world_size=2, seed=1, block_size=10)  # window 2
    state = stream.state_dict()
    for other in (
        ShardedStream(memory_shards([30, 10]), 4, rank=0, world_size=2, seed=2, block_size=10),
        ShardedStream(memory_shards([10, 30]), 4, rank=0, world_size=2, seed=1, block_size=10),
        ShardedStream(memory_shards([30, 10]), 5, rank=0, world_size=2, seed=1, block_size=10),
        ShardedStream(memory_shards([30, 10]), 4, rank=0, world_size=2, seed=1, block_size=10, window=1),
        ShardedStream(memory_shards([30, 10]), 4, rank=0, world_size=2, seed=1, block_size=5, window=2),
    ):
        with pytest.raises(ValueError, match="a stream resumes only over the same shards"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['step'\] must be in \[0, 9\]"):
        stream.load_state_dict({**state, "step": 10})
    with pytest.raises(ValueError, match="version"):
        stream.load_state_dict({"epoch": 0, "step": 0})


def test_collate_fn_receives_the_rows_of_a_step() -> None:
    stream = ShardedStream(memory_shards([12]), 6, rank=1, world_size=2, collate_fn=sum)
    batch = stream.batch(0, 0)
    assert batch.rows == sum(batch.indices.tolist())


# --- DataLoader workers, Parquet, audit ---------------------------------------------------------------------------


def write_parquet(path: Path, ids: range, row_group_size: int) -> None:
    pq.write_table(pa.table({"id": list(ids), "square": [i * i for i in ids]}), path, row_group_size=row_group_size)


def parquet_shards(directory: Path, sizes: list[int], row_group_size: int = 5) -> list[ParquetShard]:
    shards, start = [], 0
    for index, size in enumerate(sizes):
        write_parquet(directory / f"shard-{index}.parquet", range(start, start + size), row_group_size)
        shards.append(ParquetShard(directory / f"shard-{index}.parquet", columns=["id"]))
        start += size
    return shards


def test_dataloader_workers_cover_the_epoch_in_step_order_and_resume(tmp_path: Path) -> None:
    shards = parquet_shards(tmp_path, [23, 0, 4, 31])
    kwargs: dict[str, Any] = {"global_batch_size": 6, "block_size": 4, "seed": 5, "audit_dir": tmp_path / "audit"}
    consumed: list[list[int]] = []
    for stream in streams(shards, 2, **kwargs):
        loader = DataLoader(stream, batch_size=None, num_workers=2)
        first = list(itertools.islice(stream.consume(loader), 3))
        state = stream.state_dict()
        assert (state["epoch"], state["step"]) == (0, 3)
        resumed = ShardedStream(shards, rank=stream.rank, world_size=2, **kwargs)
        resumed.load_state_dict(state)
        rest = list(resumed.consume(DataLoader(resumed, batch_size=None, num_workers=2)))
        batches = first + rest
        assert [batch.step for batch in batches] == list(range(stream.steps_per_epoch))
        for batch in batches:
            assert [row["id"] for row in batch.rows] == batch.indices.tolist()
            assert batch.indices.tolist() == stream.batch(0, batch.step).indices.tolist()
            consumed.append(batch.indices.tolist())
        stream.close()
        resumed.close()
    assert coverage(consumed, np.arange(58)).exactly_once
    report = audit_directory(tmp_path / "audit")
    assert report.ok and [epoch.complete for epoch in report.epochs] == [True]
    assert report.epochs[0].rank_batches == {0: 10, 1: 10}


def test_parquet_shard_reads_ranges_across_row_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rows.parquet"
    write_parquet(path, range(100, 153), row_group_size=7)
    shard = ParquetShard(path)
    assert shard.num_rows == 53
    groups_read: list[list[int]] = []
    original = pq.ParquetFile.read_row_groups

    def recording(self: pq.ParquetFile, row_groups: list[int], *args: Any, **kwargs: Any) -> pa.Table:
        groups_read.append(list(row_groups))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", recording)
    for start, stop in [(0, 53), (6, 8), (7, 14), (13, 29), (52, 53), (20, 20)]:
        assert shard.read(start, stop) == [{"id": i, "square": i * i} for i in range(100 + start, 100 + stop)]
    assert groups_read == [list(range(8)), [0, 1], [1], [1, 2, 3, 4], [7]]
    assert ParquetShard(path, columns=["square"]).read(8, 10) == [{"square": 108 * 108}, {"square": 109 * 109}]
    with pytest.raises(ValueError, match=r"columns must be among \['id', 'square'\]"):
        ParquetShard(path, columns=["nope"])
    with pytest.raises(ValueError, match=r"stop must be in \[3, 53\], got 54"):
        shard.read(3, 54)


# --- arguments ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"shards": []}, ValueError, "shards must be a non-empty sequence"),
        ({"shards": [object()]}, TypeError, r"shards\[0\] must have num_rows and read"),
        ({"shards": [InMemoryShard([])]}, ValueError, "shards must hold at least one row"),
        ({"block_size": 0}, ValueError, r"block_size must be in \[1, inf\], got 0"),
        ({"window": 3}, ValueError, r"window must be in \[1, 1\], got 3"),
        ({"rank": 3}, ValueError, r"rank must be in \[0, 2\], got 3"),
        ({"rank": -1}, ValueError, r"rank must be in \[0, 2\], got -1"),
        ({"world_size": 0, "rank": 0}, ValueError, r"world_size must be in \[1, inf\], got 0"),
        ({"local_batch_multiple": 9}, ValueError, r"local_batch_multiple must be in \[1, 8\], got 9"),
        ({"global_batch_size": 0}, ValueError, r"global_batch_size must be in \[1, inf\], got 0"),
        ({"seed": -1}, ValueError, r"seed must be in \[0, inf\], got -1"),
        ({"collate_fn": 3}, TypeError, "collate_fn must be callable"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    arguments: dict[str, Any] = {"shards": memory_shards([10, 5]), "global_batch_size": 8, "rank": 0, "world_size": 3}
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        ShardedStream(arguments.pop("shards"), arguments.pop("global_batch_size"), **arguments)


# --- the example --------------------------------------------------------------------------------------------------


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
    assert stalwart.epochs[0].rank_samples == {0: 24, 1: 24, 2: 24}
