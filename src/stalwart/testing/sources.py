"""Small sharded sources on disk for tests and benchmarks: JSON-lines and Parquet shards with global row ids."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from stalwart.data.shards import InMemoryShard, ShardedDataset


def write_jsonl(directory: Path, sizes: list[int]) -> list[str]:
    """JSON-lines shards ``part-K.jsonl`` of ``sizes`` rows, ``{"id": global id, "text": "row ID"}``; their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    files, start = [], 0
    for number, size in enumerate(sizes):
        path = directory / f"part-{number}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "text": f"row {i}"}) + "\n" for i in range(start, start + size)))
        files.append(str(path))
        start += size
    return files


def write_parquet(directory: Path, sizes: list[int], row_group: int) -> list[Path]:
    """Parquet shards ``part-KKK.parquet`` of ``sizes`` rows, ``{"id": global id, "square": id * id}``, in row groups
    of ``row_group`` rows; their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for number, size in enumerate(sizes):
        ids = list(range(start, start + size))
        path = directory / f"part-{number:03d}.parquet"
        pq.write_table(pa.table({"id": ids, "square": [i * i for i in ids]}), path, row_group_size=row_group)
        paths.append(path)
        start += size
    return paths


def hf_json_stream(files: list[str], **options: Any) -> Any:
    """A Hugging Face streaming dataset over JSON-lines ``files`` (``options`` go to ``datasets.load_dataset``)."""
    import datasets

    return datasets.load_dataset("json", data_files=files, split="train", streaming=True, **options)


def hf_json_source(files: list[str], piece_rows: int = 8) -> ShardedDataset:
    """:func:`hf_json_stream` as a ``ShardedDataset`` keyed by the rows' ``id``, in pieces of ``piece_rows`` rows."""
    return ShardedDataset.from_hf_iterable(hf_json_stream(files), key="id", piece_rows=piece_rows)


def memory_shards(sizes: list[int]) -> list[InMemoryShard]:
    """In-memory shards of ``sizes`` rows whose rows are their global row ids, so a row says where it came from."""
    offsets = [0, *itertools.accumulate(sizes)]
    return [InMemoryShard(list(range(offsets[i], offsets[i + 1]))) for i in range(len(sizes))]
