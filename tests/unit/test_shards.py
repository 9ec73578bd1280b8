"""ShardedDataset: sharded sources (Parquet, Hugging Face iterable datasets, memory) read piece by piece."""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.plan import EpochPlan
from stalwart.data.rowkeys import python_hashes
from stalwart.data.schedule import split_sizes
from stalwart.data.shard_identity import ShardError, shard_difference
from stalwart.data.shards import InMemoryShard, ShardedDataset
from stalwart.data.table_hashes import table_hashes
from stalwart.testing.sources import hf_json_stream, write_jsonl, write_parquet


class CountingShard(InMemoryShard):
    """Rows in memory, with row groups of ``group`` rows, that records every read."""

    def __init__(self, rows: list[Any], group: int) -> None:
        super().__init__(rows)
        self.piece_starts = (*range(0, len(rows), group), len(rows))
        self.reads: list[tuple[int, int]] = []

    def read(self, start: int, stop: int) -> list[Any]:
        self.reads.append((start, stop))
        return super().read(start, stop)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda sizes: sum(sizes) > 0),
    data=st.data(),
)
def test_rows_come_back_in_the_order_asked(sizes: list[int], data: st.DataObject) -> None:
    rows = list(range(sum(sizes)))
    bounds = np.cumsum([0, *sizes])
    dataset = ShardedDataset(
        [CountingShard(rows[a:b], group=3) for a, b in itertools.pairwise(bounds)], cached_pieces=2
    )
    indices = data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=60))
    assert dataset.__getitems__(indices) == indices
    assert len(dataset) == len(rows)


def test_parquet_shards_are_read_one_row_group_at_a_time_and_once_per_share(tmp_path: Path) -> None:
    paths = write_parquet(tmp_path, [64, 64, 64, 40], row_group=16)
    dataset = ShardedDataset.from_parquet(paths)
    assert len(dataset) == 232 and dataset[70] == {"id": 70, "square": 4900}
    plan = EpochPlan(232, 64, block_size=16, window=4, seed=3)
    counting = ShardedDataset([CountingShard(list(range(a, a + n)), 16) for a, n in ((0, 64), (64, 64), (128, 104))])
    for step in range(plan.steps_per_epoch):
        start = plan.step_start(step)
        for size in split_sizes(plan.step_total(step), 4):  # four members' shares of the step
            indices = plan.indices(0, start, start + size).tolist()
            assert [row["id"] for row in dataset.__getitems__(indices)] == indices
            assert counting.__getitems__(indices) == indices
            start += size
    reads = [read for shard in counting.shards for read in shard.reads]  # type: ignore[attr-defined]
    assert all(stop - start == 16 or stop == 232 - 128 for start, stop in reads)
    assert len(reads) <= 232 // 16 + 2 * plan.steps_per_epoch * 4  # each group once, plus shares' cut edges


def test_a_shard_that_changed_or_fails_to_read_is_named(tmp_path: Path) -> None:
    paths = write_parquet(tmp_path, [32, 32], row_group=8)
    dataset = ShardedDataset.from_parquet(paths)
    assert dataset.__getitems__([40])[0]["id"] == 40
    dataset.close()
    write_parquet(tmp_path, [32, 48], row_group=8)  # the second file grows
    with pytest.raises(ShardError, match=r"part-001.parquet changed since it was opened: it now holds 48 rows"):
        dataset.__getitems__([33])
    paths[0].write_bytes(paths[0].read_bytes()[:100])  # truncated
    with pytest.raises(ShardError, match=r"shard 0 \(part-000.parquet\) failed to read rows 0..7: "):
        dataset.__getitems__([1])


def test_a_shard_returning_fewer_rows_than_it_had_is_refused() -> None:
    shard = InMemoryShard(list(range(10)))
    dataset = ShardedDataset([shard])
    shard.rows = list(range(5))
    with pytest.raises(ShardError, match=r"shard 0 \(InMemoryShard\) returned 5 rows for rows 0..9: it held 10 rows"):
        dataset[3]


def test_open_shards_are_closed_beyond_the_limit_and_the_dataset_pickles(tmp_path: Path) -> None:
    dataset = ShardedDataset.from_parquet(write_parquet(tmp_path, [10] * 5, row_group=5), open_shards=2)
    dataset.__getitems__([0, 10, 20, 30, 40])
    # private on purpose: which shards hold an open file is the limit under test
    assert [shard._file is not None for shard in dataset.shards] == [False, False, False, True, True]  # type: ignore[attr-defined]
    copy = pickle.loads(pickle.dumps(dataset))
    assert [row["id"] for row in copy.__getitems__([49, 0])] == [49, 0]
    assert copy.fingerprint == dataset.fingerprint
    dataset.close()
    assert all(shard._file is None for shard in dataset.shards)  # type: ignore[attr-defined]


def test_fingerprint_follows_the_content_and_order_not_the_paths(tmp_path: Path) -> None:
    paths = write_parquet(tmp_path / "a", [10, 10, 12], row_group=5)
    original = ShardedDataset.from_parquet(paths)
    same = ShardedDataset.from_parquet(write_parquet(tmp_path / "copy", [10, 10, 12], row_group=5))
    assert original.fingerprint == same.fingerprint
    assert shard_difference(original.identities, same.identities, "the copy") is None
    reordered = ShardedDataset.from_parquet([paths[1], paths[0], paths[2]])
    assert reordered.fingerprint != same.fingerprint
    assert shard_difference(original.identities, reordered.identities, "the state") == (
        f"shard 0 is {reordered.identities[0].describe()} here but {original.identities[0].describe()} in the state"
    )
    renamed = tmp_path / "a" / "renamed.parquet"  # other rows under a name that sorts the same, same size
    pq.write_table(pa.table({"id": list(range(10, 20)), "square": [0] * 10}), renamed, row_group_size=5)
    rewritten = ShardedDataset.from_parquet([renamed, paths[1], paths[2]])
    assert rewritten.identities[0].rows == original.identities[0].rows
    assert shard_difference(original.identities, rewritten.identities, "x").startswith("shard 0 is 'renamed.parquet'")
    assert shard_difference(original.identities, original.identities[:2], "x") == "there are 2 shards here but 3 in x"


def test_a_large_parquet_file_is_identified_from_samples_of_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "big.parquet"
    ids = list(range(200_000))
    pq.write_table(pa.table({"id": ids, "text": [f"row {i:07d}" for i in ids]}), path, row_group_size=50_000)
    digest = ShardedDataset.from_parquet([path]).identities[0].digest
    ids[123_456] = -1  # one value changes: the column statistics in the footer move
    pq.write_table(pa.table({"id": ids, "text": [f"row {i:07d}" for i in range(200_000)]}), path, row_group_size=50_000)
    assert ShardedDataset.from_parquet([path]).identities[0].digest != digest


def test_rows_come_with_keys_a_column_or_a_content_hash(tmp_path: Path) -> None:
    paths = write_parquet(tmp_path, [30, 20], row_group=8)
    indices = [49, 3, 17, 33, 3]
    keyed = ShardedDataset.from_parquet(paths, key="square")
    rows, keys = keyed.gather(indices)
    assert [row["id"] for row in rows] == indices and keys == [i * i for i in indices]
    hashed = ShardedDataset.from_parquet(paths)
    expected = table_hashes(pa.table({"id": indices, "square": [i * i for i in indices]})).tolist()
    assert hashed.row_keys(indices) == expected
    memory = ShardedDataset([InMemoryShard([{"id": i} for i in range(5)])], key="id")
    assert memory.gather([4, 0]) == ([{"id": 4}, {"id": 0}], [4, 0])
    assert ShardedDataset([InMemoryShard(["x", "y"])]).row_keys([1]) == python_hashes(["y"]).tolist()
    with pytest.raises(KeyError, match="key 'nope' is not a column of the rows"):
        ShardedDataset.from_parquet(paths, key="nope").row_keys([0])


def test_hugging_face_iterable_dataset_over_json_files(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    files = []
    for number, (start, size) in enumerate([(0, 7), (7, 5), (12, 9)]):
        path = tmp_path / f"part-{number}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "text": f"row {i}"}) + "\n" for i in range(start, start + size)))
        files.append(str(path))
    stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    dataset = ShardedDataset.from_hf_iterable(stream)
    assert len(dataset) == 21 and [shard.num_rows for shard in dataset.shards] == [7, 5, 9]
    order = EpochPlan(21, 4, block_size=3, window=2).indices(0, 0, 21).tolist()
    assert [row["id"] for row in dataset.__getitems__(order)] == order
    assert ShardedDataset.from_hf_iterable(stream, num_rows=[7, 5, 9]).fingerprint == dataset.fingerprint
    with pytest.raises(ValueError, match=r"num_rows must give one count per shard \(3\), got 2"):
        ShardedDataset.from_hf_iterable(stream, num_rows=[7, 5])


def test_a_forwards_only_shard_decodes_each_piece_once_in_order_and_again_after_a_jump(tmp_path: Path) -> None:
    dataset = ShardedDataset.from_hf_iterable(hf_json_stream(write_jsonl(tmp_path, [50])), num_rows=[50], piece_rows=8)
    (shard,) = dataset.shards
    assert [row["id"] for row in dataset.__getitems__(list(range(0, 50, 3)))] == list(range(0, 50, 3))
    assert dataset.rows_decoded == 50 and shard.position == 50  # type: ignore[attr-defined]
    assert dataset.__getitems__([9])[0]["id"] == 9 and dataset.rows_decoded == 50, "cached on the way"
    dataset.close()
    assert dataset.__getitems__([45])[0]["id"] == 45
    assert dataset.rows_decoded == 50 + 48, "a restart reads (and caches) every piece up to the one asked for"
    assert dataset.__getitems__([1, 20])[0]["id"] == 1 and dataset.rows_decoded == 98
    small = ShardedDataset(dataset.shards, cached_pieces=1)
    small.__getitems__([41])  # the shared cursor stands at row 48: pieces 0..5 again
    small.__getitems__([2])  # piece 0 fell out of the one-piece cache: the shard starts again
    assert small.rows_decoded == 48 + 8


def test_hugging_face_shards_are_identified_by_content(tmp_path: Path) -> None:
    files = write_jsonl(tmp_path, [20, 20])
    stream = hf_json_stream(files)
    counted = ShardedDataset.from_hf_iterable(stream)
    given = ShardedDataset.from_hf_iterable(stream, num_rows=[20, 20])
    assert counted.fingerprint == given.fingerprint
    assert [identity.name for identity in counted.identities] == ["shard 0 of 2", "shard 1 of 2"]
    shuffled = ShardedDataset.from_hf_iterable(stream.shuffle(seed=43, buffer_size=8))  # a per-rank seed, say
    difference = shard_difference(counted.identities, shuffled.identities, "the state")
    assert difference is not None and difference.startswith("shard 0 is 'shard 0 of 2' (20 rows, content ")
    swapped = ShardedDataset.from_hf_iterable(hf_json_stream(files[::-1]))
    assert shard_difference(counted.identities, swapped.identities, "x") is not None


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"shards": []}, ValueError, "shards must be a non-empty sequence of shards"),
        ({"shards": [object()]}, TypeError, r"shards\[0\] must have num_rows and read"),
        ({"shards": [InMemoryShard([])]}, ValueError, "at least one row in total"),
        ({"shards": [InMemoryShard([1])], "cached_pieces": 0}, ValueError, r"cached_pieces must be in \[1, inf\]"),
        ({"shards": [InMemoryShard([1])], "open_shards": 0}, ValueError, r"open_shards must be in \[1, inf\], got 0"),
        ({"shards": [InMemoryShard([1])], "key": 3}, TypeError, "key must be a column name or None"),
    ],
)
def test_bad_arguments_are_refused(arguments: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ShardedDataset(**arguments)


def test_indices_outside_the_dataset_are_refused() -> None:
    with pytest.raises(IndexError, match=r"indices must be in \[0, 2\], got values in \[0, 3\]"):
        ShardedDataset([InMemoryShard([1, 2, 3])]).__getitems__([0, 3])
