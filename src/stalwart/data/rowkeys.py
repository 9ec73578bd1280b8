"""Row keys: what identifies a row in the audit and the row checksum, a column's value or a hash of the row.

A *key* names a row independently of where it was read: the value of a
column the user names (``key="id"``), or, without one, a 64-bit hash of the
row's content. The audit records keys next to positions, so a row delivered
twice or a rank that reads other rows than its position says is caught even
when every position was delivered once.

Content hashes
    Arrow data (Parquet row groups, Hugging Face pieces) is hashed a column
    at a time (:mod:`stalwart.data.table_hashes`, apart so that a process
    that never reads Arrow data does not import pyarrow). Rows already in
    Python (in-memory shards, a dataset's samples) are hashed from a
    canonical byte encoding with BLAKE2b. The hash is
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

UInt64s = npt.NDArray[np.uint64]
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(values: npt.ArrayLike) -> UInt64s:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    mixed = np.asarray(values, dtype=np.uint64) + _GOLDEN
    mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return mixed ^ (mixed >> np.uint64(31))


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


def python_hashes(rows: Sequence[Any]) -> UInt64s:
    """A 64-bit hash of each Python value's content (canonical encoding, BLAKE2b)."""
    digests = [hashlib.blake2b(_canonical(row), digest_size=8).digest() for row in rows]
    return np.frombuffer(b"".join(digests), dtype="<u8").astype(np.uint64) if digests else np.zeros(0, np.uint64)


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
