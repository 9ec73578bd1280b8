"""Row keys: content hashes of Arrow and Python rows, and keys as 64-bit values for checksums."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.data.rowkeys import key_hashes, python_hashes, row_keys
from stalwart.data.table_hashes import table_hashes

values = st.one_of(st.none(), st.integers(-(2**62), 2**62), st.text(max_size=12), st.booleans())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-(2**40), 2**40), st.text(max_size=20), st.floats(allow_nan=False)), max_size=40))
def test_a_row_hash_depends_on_the_row_alone(rows: list[tuple[int, str, float]]) -> None:
    table = pa.table({"id": [r[0] for r in rows], "text": [r[1] for r in rows], "x": [r[2] for r in rows]})
    hashes = table_hashes(table)
    for start in range(0, len(rows), 7):  # any slice and any chunking of the same rows
        part = table.slice(start, 7)
        assert table_hashes(part).tolist() == hashes[start : start + 7].tolist()
    chunked = pa.concat_tables([table.slice(0, len(rows) // 2), table.slice(len(rows) // 2)])
    assert table_hashes(chunked).tolist() == hashes.tolist()
    distinct = {(r[0], r[1], r[2] + 0.0) for r in rows}
    assert len(set(hashes.tolist())) == len(distinct), "different rows, different hashes (64 bits: no collision here)"


def test_a_row_hash_sees_every_column_its_order_nulls_and_bytes() -> None:
    base = table_hashes(pa.table({"a": ["ab", "ba", "", None], "b": [1, 1, 1, 1]}))
    assert len(set(base.tolist())) == 4
    assert table_hashes(pa.table({"b": [1], "a": ["ab"]}))[0] != base[0], "column order counts"
    large = table_hashes(pa.table({"a": pa.array(["ab", "ba", "", None], pa.large_string()), "b": [1, 1, 1, 1]}))
    assert large.tolist() == base.tolist()
    dictionary = pa.table({"a": pa.array(["ab", "ba", "", None]).dictionary_encode(), "b": [1, 1, 1, 1]})
    assert table_hashes(dictionary).tolist() == base.tolist()
    nested = table_hashes(pa.table({"l": [[1, 2], [2, 1], None], "s": [{"x": 1}, {"x": 1}, {"x": 2}]}))
    assert len(set(nested.tolist())) == 3


def test_python_rows_hash_canonically() -> None:
    same = [{"a": 1, "b": [1.5, "x"]}, {"b": [1.5, "x"], "a": 1}]
    assert python_hashes(same)[0] == python_hashes(same)[1]
    assert python_hashes([0.0])[0] == python_hashes([-0.0])[0]
    assert python_hashes([1])[0] != python_hashes([True])[0] != python_hashes(["1"])[0]
    assert python_hashes([(np.arange(4), 3)])[0] == python_hashes([(torch.arange(4), 3)])[0]
    assert python_hashes([torch.zeros(3)])[0] != python_hashes([torch.zeros(4)])[0]
    assert python_hashes([]).dtype == np.uint64 and python_hashes([]).size == 0


def test_keys_from_a_column_and_as_checksum_values() -> None:
    assert row_keys([{"id": 4}, {"id": 7}], "id") == [4, 7]
    with pytest.raises(KeyError, match="key 'id' must name a field of every row, got a row 3"):
        row_keys([3], "id")
    assert key_hashes([1, 2]).tolist() != key_hashes([2, 1]).tolist()
    assert key_hashes([-1]).dtype == np.uint64
    assert key_hashes(["a", "b"]).tolist() == python_hashes(["a", "b"]).tolist()
