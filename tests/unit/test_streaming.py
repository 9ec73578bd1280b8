"""Sharded streams: the split over ranks and DataLoader workers, resuming and re-splitting, keys, misuse, shards.

In-process tests (``stream.consume(stream)``) check the invariants over many
configurations; the DataLoader tests run real worker processes over Parquet
and Hugging Face JSON-lines shards and check exactly once by the row ids read
out of the rows, apart from the audit.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from stalwart.data.audit import coverage
from stalwart.data.rowkeys import python_hashes
from stalwart.data.schedule import split_sizes, step_boundary
from stalwart.data.shards import InMemoryShard, ParquetShard, ShardedDataset
from stalwart.data.streaming import ShardedStream, StreamBatch
from stalwart.testing.sources import hf_json_source, memory_shards, write_jsonl

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rank_seeded_shuffle_overlap.py"


def streams(shards: Any, world_size: int, **kwargs: Any) -> list[ShardedStream]:
    return [ShardedStream(shards, rank=rank, world_size=world_size, **kwargs) for rank in range(world_size)]


def consume_steps(stream: ShardedStream, steps: int | None = None) -> list[StreamBatch]:
    """Consume up to ``steps`` batches of the stream's current epoch in this process."""
    return list(itertools.islice(stream.consume(stream), steps))


shard_sizes = st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda sizes: sum(sizes) > 0)


@st.composite
def stream_settings(draw: st.DrawFn) -> dict[str, Any]:
    batch = draw(st.integers(1, 30))
    return {
        "global_batch_size": batch,
        "local_batch_multiple": draw(st.integers(1, batch)),
        "block_size": draw(st.integers(1, 12)),
        "interleave": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**32)),
    }


# --- the split over ranks -----------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(shard_sizes, stream_settings(), st.integers(1, 5), st.integers(0, 3))
def test_ranks_split_every_step_and_cover_the_epoch_exactly_once(
    sizes: list[int], kwargs: dict[str, Any], world_size: int, epoch: int
) -> None:
    ranks = streams(memory_shards(sizes), world_size, **kwargs)
    total, batch, multiple = sum(sizes), kwargs["global_batch_size"], kwargs["local_batch_multiple"]
    consumed: list[np.ndarray] = []
    for stream in ranks:
        stream.set_epoch(epoch)
        batches = consume_steps(stream)
        assert [part.step for part in batches] == list(range(stream.steps_per_epoch))
        for part in batches:
            start, stop = (min(step_boundary(t, batch, multiple), total) for t in (part.step, part.step + 1))
            assert len(part.indices) == split_sizes(stop - start, world_size, multiple)[stream.rank]
            assert part.epoch == epoch and part.rows == part.indices.tolist()
            assert part.keys == python_hashes(part.rows).tolist(), "without a key column: content hashes"
            consumed.append(part.indices)
        assert (stream.epoch, stream.step) == (epoch + 1, 0), "after the last step the state is the next epoch's first"
    assert coverage(consumed, np.arange(total)).exactly_once


def test_the_order_changes_with_the_epoch_and_keeps_blocks_together() -> None:
    (stream,) = streams(memory_shards([64, 64, 64, 64]), 1, global_batch_size=32, block_size=16, seed=3)
    first = np.concatenate([batch.indices for batch in consume_steps(stream)])
    second = np.concatenate([batch.indices for batch in consume_steps(stream)])
    assert first.tolist() != second.tolist() and sorted(first.tolist()) == sorted(second.tolist())
    for order in (first, second):
        blocks = [block for block, _ in itertools.groupby((order // 16).tolist())]
        assert len(blocks) == len(set(blocks)) == 16, "each block of 16 rows is streamed in one run"


# --- resuming and re-splitting ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(shard_sizes, stream_settings(), st.integers(1, 5), st.integers(1, 5), st.integers(1, 3), st.data())
def test_resuming_with_another_world_size_keeps_the_epoch_exactly_once(
    sizes: list[int],
    kwargs: dict[str, Any],
    old_world: int,
    new_world: int,
    new_interleave: int,
    data: st.DataObject,
) -> None:
    shards = memory_shards(sizes)
    old = streams(shards, old_world, **kwargs)
    done = data.draw(st.integers(0, old[0].steps_per_epoch - 1), label="steps before the change")
    for stream in old:
        stream.set_epoch(1)
    consumed = [batch.indices for stream in old for batch in consume_steps(stream, done)]
    states = [json.loads(json.dumps(stream.state_dict())) for stream in old]
    assert all(state == states[0] for state in states), "every rank agrees on the state"
    assert (states[0]["epoch"], states[0]["step"]) == (1, done)
    new = streams(shards, new_world, **{**kwargs, "interleave": new_interleave})
    for stream in new:
        stream.load_state_dict(states[0])
        remaining = consume_steps(stream)
        assert [batch.step for batch in remaining] == list(range(done, stream.steps_per_epoch))
        consumed.extend(batch.indices for batch in remaining)
    assert coverage(consumed, np.arange(sum(sizes))).exactly_once


def test_set_epoch_keeps_a_resumed_position_and_restarts_other_epochs() -> None:
    stream = ShardedStream(memory_shards([30]), 4, rank=0, world_size=2)
    consume_steps(stream, 5)
    state = {**stream.state_dict(), "epoch": 3}
    stream.load_state_dict(state)
    stream.set_epoch(3)
    assert (stream.epoch, stream.step) == (3, 5)
    assert next(stream.consume(stream)).step == 5
    stream.set_epoch(4)
    assert (stream.epoch, stream.step) == (4, 0) and stream.state_dict()["remaining"] == [[0, 30]]


def test_state_of_another_stream_is_refused_in_one_line() -> None:
    stream = ShardedStream(memory_shards([30, 10]), 4, rank=0, world_size=2, seed=1, block_size=10)
    state = stream.state_dict()
    for other, setting in (
        (ShardedStream(memory_shards([30, 10]), 4, rank=0, world_size=2, seed=2, block_size=10), "seed"),
        (ShardedStream(memory_shards([30, 10]), 5, rank=0, world_size=2, seed=1, block_size=10), "global_batch_size"),
        (ShardedStream(memory_shards([30, 10]), 4, rank=0, world_size=2, seed=1, block_size=5), "block_size"),
        (ShardedStream(memory_shards([30, 10]), 4, rank=0, world_size=2, seed=1, block_size=10, key="id"), "key"),
        (ShardedStream(memory_shards([30, 10]), 4, rank=0, world_size=2, seed=1, block_size=10, local_batch_multiple=2),
         "local_batch_multiple"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^state\['{setting}'\] is .* a stream resumes only over the same"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['step'\] must be in \[0, 9\]"):
        stream.load_state_dict({**state, "step": 10})
    with pytest.raises(ValueError, match=r"state\['remaining'\] holds 40 positions but step 2 leaves 32"):
        stream.load_state_dict({**state, "step": 2})
    with pytest.raises(ValueError, match=r"state\['remaining'\]\[0\]\[1\] must be in \[1, 40\], got 41"):
        stream.load_state_dict({**state, "remaining": [[0, 41]]})
    with pytest.raises(ValueError, match="version"):
        stream.load_state_dict({"epoch": 0, "step": 0})


def test_a_reordered_or_rewritten_shard_set_is_refused_naming_the_shard(tmp_path: Path) -> None:
    paths = [write_parquet(tmp_path / f"shard-{i}.parquet", range(i * 20, i * 20 + 20), 5) for i in range(3)]
    stream = ShardedStream([ParquetShard(path) for path in paths], 8, rank=0, world_size=1, key="id")
    consume_steps(stream, 2)
    state = json.loads(json.dumps(stream.state_dict()))
    order = [paths[1], paths[0], paths[2]]
    reordered = ShardedStream([ParquetShard(path) for path in order], 8, rank=0, world_size=1, key="id")
    with pytest.raises(ValueError, match=r"^shard 0 is 'shard-1.parquet' \(20 rows, content [0-9a-f]{16}\) here but "):
        reordered.load_state_dict(state)
    write_parquet(paths[2], range(100, 120), 5)  # rewritten: same rows count, other rows
    rewritten = ShardedStream([ParquetShard(path) for path in paths], 8, rank=0, world_size=1, key="id")
    message = (
        r"^shard 2 is 'shard-2.parquet' \(20 rows, content [0-9a-f]{16}\) here but 'shard-2.parquet' \(20 rows, "
        r"content [0-9a-f]{16}\) in the state: a stream resumes only over the same shards, in the same order$"
    )
    with pytest.raises(ValueError, match=message):
        rewritten.load_state_dict(state)
    consume_steps(rewritten, 2)
    moved = tmp_path / "moved"
    moved.mkdir()
    copies = [moved / path.name for path in paths]
    for path, copy in zip(paths, copies, strict=True):
        copy.write_bytes(path.read_bytes())
    resumed = ShardedStream([ParquetShard(copy) for copy in copies], 8, rank=0, world_size=1, key="id")
    resumed.load_state_dict(rewritten.state_dict())  # the same data under another path is accepted
    assert resumed.step == 2


def test_collate_fn_receives_the_rows_of_a_step_and_keys_come_from_the_column() -> None:
    shards = [InMemoryShard([{"id": i, "x": 2 * i} for i in range(12)])]
    stream = ShardedStream(
        shards, 6, rank=1, world_size=2, collate_fn=lambda rows: sum(row["x"] for row in rows), key="id"
    )
    batch = next(stream.consume(stream))
    assert batch.rows == 2 * sum(batch.indices.tolist()) and batch.keys == batch.indices.tolist()


def test_a_sharded_dataset_is_a_source_and_lends_its_key() -> None:
    dataset = ShardedDataset([InMemoryShard([{"id": i} for i in range(10)])], key="id")
    stream = ShardedStream(dataset, 4, rank=0, world_size=1)
    assert stream.shards == dataset.shards and stream.key == "id"
    assert ShardedStream(dataset, 4, rank=0, world_size=1, key=None).key == "id"


# --- no silent misuse ---------------------------------------------------------------------------------------------


def test_consume_refuses_a_loader_that_would_not_keep_the_steps_in_order() -> None:
    stream = ShardedStream(memory_shards([40]), 8, rank=0, world_size=1)
    other = ShardedStream(memory_shards([40]), 8, rank=0, world_size=1)
    for loader, error, message in (
        (DataLoader(stream, batch_size=2), ValueError, "batch_size=None"),
        (DataLoader(stream, batch_size=None, num_workers=1, persistent_workers=True), ValueError, "persistent"),
        (DataLoader(other, batch_size=None), TypeError, "a DataLoader over this stream"),
        ([stream], TypeError, "a DataLoader over this stream"),
    ):
        with pytest.raises(error, match=message):
            next(stream.consume(loader))  # type: ignore[arg-type]
    assert (stream.epoch, stream.step) == (0, 0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"shards": []}, ValueError, "shards must be a non-empty sequence"),
        ({"shards": [object()]}, TypeError, r"shards\[0\] must have num_rows and read"),
        ({"shards": [InMemoryShard([])]}, ValueError, "shards must hold at least one row"),
        ({"block_size": 0}, ValueError, r"block_size must be in \[1, inf\], got 0"),
        ({"interleave": 0}, ValueError, r"interleave must be in \[1, inf\], got 0"),
        ({"rank": 3}, ValueError, r"rank must be in \[0, 2\], got 3"),
        ({"rank": -1}, ValueError, r"rank must be in \[0, 2\], got -1"),
        ({"world_size": 0, "rank": 0}, ValueError, r"world_size must be in \[1, inf\], got 0"),
        ({"local_batch_multiple": 9}, ValueError, r"local_batch_multiple must be in \[1, 8\], got 9"),
        ({"global_batch_size": 0}, ValueError, r"global_batch_size must be in \[1, inf\], got 0"),
        ({"seed": -1}, ValueError, r"seed must be in \[0, inf\], got -1"),
        ({"collate_fn": 3}, TypeError, "collate_fn must be callable"),
        ({"key": 3}, TypeError, "key must be a column name or None"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    arguments: dict[str, Any] = {"shards": memory_shards([10, 5]), "global_batch_size": 8, "rank": 0, "world_size": 3}
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        ShardedStream(arguments.pop("shards"), arguments.pop("global_batch_size"), **arguments)


# --- DataLoader workers: Parquet, Hugging Face streams, audit ----------------------------------------------------


def write_parquet(path: Path, ids: range, row_group_size: int) -> Path:
    pq.write_table(pa.table({"id": list(ids), "square": [i * i for i in ids]}), path, row_group_size=row_group_size)
    return path


def test_a_per_rank_shuffle_of_the_source_is_refused_by_the_audit_naming_the_shard(tmp_path: Path) -> None:
    """The proposal's mistake carried over: each rank shuffles its file list with 42 + rank. Before: the audit
    saw every position once and said OK while rows were trained twice and others never."""
    files = write_jsonl(tmp_path / "data", [20, 20, 20, 20])
    sources = []
    for rank in range(2):
        mine = list(files)
        random.Random(42 + rank).shuffle(mine)
        sources.append(hf_json_source(mine))
    ShardedStream(sources[0], 8, rank=0, world_size=2, audit_dir=tmp_path / "audit")
    with pytest.raises(ValueError, match=r"^shard \d is 'shard \d of 4' \(20 rows, content [0-9a-f]+\) here but .*"
                       r"audit.json: every rank.*must read the same shards in the same order"):  # fmt: skip
        ShardedStream(sources[1], 8, rank=1, world_size=2, audit_dir=tmp_path / "audit")


# --- the example --------------------------------------------------------------------------------------------------
