"""Row keys: what identifies a row in the audit and the row checksum, a column's value or a hash of the row.

A *key* names a row independently of where it was read: the value of a
column the user names (``key="id"``), or, without one, a 64-bit hash of the
row's content. The audit records keys next to positions, so a row delivered
twice or a rank that reads other rows than its position says is caught even
when every position was delivered once.

Content hashes
    Arrow data (Parquet row groups, Hugging Face pieces) is hashed a column
    at a time with numpy: fixed-width values by their bits, strings and
    binaries byte by byte (each byte mixed with its position in the value,
    summed per value), other types (lists, structs) through their Python
    values. Rows already in Python (in-memory shards, a dataset's samples)
    are hashed from a canonical byte encoding with BLAKE2b. The hash is
    splitmix64-mixed, the same in every process and on every platform; it
    is a checksum, not a cryptographic digest.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

UInt64s = npt.NDArray[np.uint64]
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_NULL = np.uint64(0x5BD1E9955BD1E995)
_BYTES_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)


def mix64(values: npt.ArrayLike) -> UInt64s:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    mixed = np.asarray(values, dtype=np.uint64) + _GOLDEN
    mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return mixed ^ (mixed >> np.uint64(31))


_POSITION_MULTIPLIERS = mix64(np.arange(1 << 16, dtype=np.uint64)) | np.uint64(1)
"""Odd multipliers by a byte's position in its value (positions wrap at 65536)."""


def row_keys(rows: Sequence[Any], key: str | None) -> list[Any]:
    """The key of each Python row: ``row[key]`` (rows are mappings), or content hashes when ``key`` is None."""
    if key is None:
        return python_hashes(rows).tolist()
    values = []
    for row in rows:
        if not isinstance(row, Mapping) or key not in row:
            raise KeyError(f"key {key!r} must name a field of every row, got a row {_shorten(row)}")
        values.append(row[key])
    return values


def key_hashes(keys: Sequence[Any]) -> UInt64s:
    """Keys as uint64 for checksums: ints by their 64-bit pattern, anything else by its content hash."""
    if all(isinstance(value, int) and not isinstance(value, bool) for value in keys):
        return mix64(np.asarray([value & 0xFFFFFFFFFFFFFFFF for value in keys], dtype=np.uint64))
    return python_hashes(keys)


def table_hashes(table: pa.Table) -> UInt64s:
    """A 64-bit hash of each row's content (every column, in order)."""
    hashes = np.zeros(table.num_rows, dtype=np.uint64)
    for number, column in enumerate(table.columns):
        values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        hashes = mix64(hashes * np.uint64(31) + _column_hashes(values) + np.uint64(number))
    return hashes


def python_hashes(rows: Sequence[Any]) -> UInt64s:
    """A 64-bit hash of each Python value's content (canonical encoding, BLAKE2b)."""
    digests = [hashlib.blake2b(_canonical(row), digest_size=8).digest() for row in rows]
    return np.frombuffer(b"".join(digests), dtype="<u8").astype(np.uint64) if digests else np.zeros(0, np.uint64)


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


def _canonical(value: Any) -> bytes:
    """A byte encoding of ``value`` that equal values share (tagged, length-prefixed, recursive)."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        return b"i" + str(value).encode()
    if isinstance(value, float):
        return b"f" + struct.pack("<d", math.nan if math.isnan(value) else value + 0.0)  # one NaN, one zero
    if isinstance(value, str):
        encoded = value.encode()
        return b"s" + len(encoded).to_bytes(8, "little") + encoded
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        return b"b" + len(raw).to_bytes(8, "little") + raw
    if isinstance(value, Mapping):
        items = sorted((str(name), _canonical(item)) for name, item in value.items())
        return b"d" + len(items).to_bytes(8, "little") + b"".join(_canonical(name) + item for name, item in items)
    if isinstance(value, list | tuple):
        return b"l" + len(value).to_bytes(8, "little") + b"".join(_canonical(item) for item in value)
    if isinstance(value, np.generic):
        return _canonical(value.item())
    array = _as_array(value)
    if array is not None:
        contiguous = np.ascontiguousarray(array)
        header = f"{contiguous.dtype.str}{contiguous.shape}".encode()
        return b"a" + len(header).to_bytes(8, "little") + header + contiguous.tobytes()
    return b"r" + repr(value).encode()


def _as_array(value: Any) -> np.ndarray | None:
    """``value`` as a numpy array when it is one, or a tensor (moved to the CPU), else None."""
    if isinstance(value, np.ndarray):
        return value
    detach = getattr(value, "detach", None)
    if callable(detach) and hasattr(value, "numpy"):
        return detach().cpu().numpy()
    return None


def _shorten(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
