"""Content hashes of Arrow tables' rows, a column at a time with numpy (see :mod:`stalwart.data.rowkeys`).

Fixed-width values are hashed by their bits, strings and binaries byte by
byte (each byte mixed with its position in the value, summed per value),
other types (lists, structs) through their Python values
(:func:`~stalwart.data.rowkeys.python_hashes`). Apart from the row keys so
that only the shards' readers import pyarrow.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stalwart.data.rowkeys import UInt64s, mix64, python_hashes

_NULL = np.uint64(0x5BD1E9955BD1E995)
_BYTES_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
_POSITION_MULTIPLIERS = mix64(np.arange(1 << 16, dtype=np.uint64)) | np.uint64(1)
"""Odd multipliers by a byte's position in its value (positions wrap at 65536)."""


def table_hashes(table: pa.Table) -> UInt64s:
    """A 64-bit hash of each row's content (every column, in order)."""
    hashes = np.zeros(table.num_rows, dtype=np.uint64)
    for number, column in enumerate(table.columns):
        values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        hashes = mix64(hashes * np.uint64(31) + _column_hashes(values) + np.uint64(number))
    return hashes


def _column_hashes(array: pa.Array) -> UInt64s:
    kind = array.type
    if pa.types.is_dictionary(kind):
        return _column_hashes(array.dictionary_decode())
    if pa.types.is_boolean(kind):
        hashes = mix64(np.asarray(array.fill_null(False), dtype=np.uint64))
    elif pa.types.is_integer(kind) or pa.types.is_temporal(kind):
        bits = pc.cast(array, pa.int64()).fill_null(0).to_numpy().view(np.uint64)
        hashes = mix64(bits)
    elif pa.types.is_floating(kind):
        bits = pc.cast(array, pa.float64()).fill_null(0.0).to_numpy().view(np.uint64)
        hashes = mix64(bits)
    elif any(test(kind) for test in _BYTES_TYPES):
        hashes = _bytes_hashes(array)
    else:
        return python_hashes(array.to_pylist())
    if array.null_count:
        hashes = np.where(np.asarray(array.is_null()), _NULL, hashes)
    return hashes


def _bytes_hashes(array: pa.Array) -> UInt64s:
    """Per value: the sum of its bytes, each times an odd multiplier chosen by its position, mixed with the length."""
    large = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
    array = array.cast(pa.large_binary() if large else pa.binary())
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64 if large else np.int32)
    offsets = offsets[array.offset : array.offset + len(array) + 1].astype(np.int64)
    lengths = np.diff(offsets)
    starts = offsets[:-1] - offsets[0]
    sums = np.zeros(len(array), dtype=np.uint64)
    if data_buffer is not None and offsets[-1] > offsets[0]:
        data = np.frombuffer(data_buffer, dtype=np.uint8)[offsets[0] : offsets[-1]]
        within = np.arange(data.size, dtype=np.int64) - np.repeat(starts, lengths)
        terms = data * _POSITION_MULTIPLIERS[within & (_POSITION_MULTIPLIERS.size - 1)]
        filled = lengths > 0
        sums[filled] = np.add.reduceat(terms, starts[filled])
    return mix64(sums ^ lengths.astype(np.uint64))
