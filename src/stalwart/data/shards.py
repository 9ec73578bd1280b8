"""Sharded sources as one map-style dataset: Parquet files, Hugging Face iterable datasets, rows in memory.

A sharded source is a list of shards, each a numbered run of rows. Sample
``i`` of :class:`ShardedDataset` is row ``i - offset[s]`` of shard ``s``, the
shards concatenated in order. ``dataset.__getitems__(indices)`` (what
``ElasticLoader`` and ``torch.utils.data.DataLoader`` call for a batch) groups
the indices by shard and by *piece* (a Parquet row group; ``piece_rows`` rows
of a Hugging Face shard), reads each piece once, keeps the last pieces read
and the last shards opened in small LRU caches, and returns the rows in the
order asked. :meth:`ShardedDataset.gather` returns each row's key with it
(:mod:`stalwart.data.rowkeys`).

Reading forwards
    A Hugging Face ``IterableDataset`` shard is read through one cursor per
    process (a DataLoader worker forked from a process that read ignores the
    parent's cursor and open file), in pieces of ``piece_rows`` rows, with the
    public ``iter(batch_size=...)`` in Arrow format, which (unlike
    ``__iter__``) does not split the shard among DataLoader workers. A piece
    after the cursor continues it, caching the pieces it passes; a piece
    before it starts the shard again. A reader that
    takes a shard's pieces in order (what :class:`~stalwart.data.streaming.ShardedStream`
    arranges) decodes every row once; a reader that jumps back pays for the
    rows before the piece (``rows_decoded`` counts them).

Identity
    Every shard has a :class:`ShardIdentity`: its name (for messages), row
    count and a content digest (Parquet: the file's size, footer and sampled
    bytes; Hugging Face: the first piece's rows; rows in memory: sampled rows).
    The names do not enter :attr:`ShardedDataset.fingerprint`, so the same data
    under another path is the same dataset, while a reordered, rewritten or
    other shard set is not: :func:`~stalwart.data.shard_identity.shard_difference` names the first shard
    that differs.

Training through failures takes the order from the lighthouse's plan: with
``EpochPlan(block_size=B, window=W)`` every block of ``B`` consecutive indices
is a run of consecutive positions, so a member's share of a step is a few
whole blocks. Reads stay local when ``B`` is a multiple of the row-group size
that divides the shards' sizes, and at most about a quarter of a member's
share of a step (a block cut by a share's edge is read by two members).
A Hugging Face map-style ``datasets.Dataset`` (memory-mapped Arrow) needs no
wrapper: it is a map-style dataset with ``__getitems__`` already.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from torch.utils.data import Dataset

from stalwart._validate import check_int
from stalwart.data.rowkeys import UInt64s, python_hashes, row_keys
from stalwart.data.shard_identity import ShardError, ShardIdentity, fingerprint_of
from stalwart.data.table_hashes import table_hashes

DEFAULT_CACHED_PIECES = 32
DEFAULT_OPEN_SHARDS = 16
DEFAULT_PIECE_ROWS = 1024
"""Rows per piece of a shard that does not say where its pieces begin (no ``piece_starts``)."""
DEFAULT_HF_PIECE_ROWS = 256
"""Rows per piece of a Hugging Face shard: where two readers split a shard, both decode the piece they share."""
SAMPLED_ROWS = 16
"""Rows at each end of a shard that its content digest covers, when the shard has no digest of its own."""
SAMPLED_WINDOWS = 4
SAMPLED_WINDOW_BYTES = 4096
"""A Parquet file's digest covers its size, its footer and this many windows of this many bytes."""


@runtime_checkable
class Shard(Protocol):
    """A source of rows addressed by number: ``read(start, stop)`` returns rows ``start..stop-1``.

    Optional attributes that :class:`ShardedDataset` uses when present:
    ``piece_starts`` (ascending row numbers from 0 to ``num_rows`` where
    independent reads begin, e.g. Parquet row groups; by default every
    ``DEFAULT_PIECE_ROWS`` rows), ``read_arrow(start, stop)`` (the rows as
    a ``pyarrow.Table``: pieces are then cached as Arrow data and only the
    rows asked for become Python objects), ``name`` (what the shard is called
    in errors), ``content_digest()`` (a digest of what it holds, for its
    :class:`ShardIdentity`; by default one of its first and last rows),
    ``sequential`` and ``position`` (it reads forwards: ``position`` is the row
    its next read continues from) and ``close()`` (release open files).
    """

    num_rows: int

    def read(self, start: int, stop: int) -> list[Any]: ...


class InMemoryShard:
    """A shard over a sequence already in memory (tests, small data, generated rows)."""

    def __init__(self, rows: Sequence[Any]) -> None:
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
            raise TypeError(f"rows must be a sequence of rows, got {type(rows).__name__}")
        self.rows = rows
        self.num_rows = len(rows)

    def read(self, start: int, stop: int) -> list[Any]:
        """Rows ``start..stop-1``."""
        start = check_int("start", start, minimum=0, maximum=self.num_rows)
        stop = check_int("stop", stop, minimum=start, maximum=self.num_rows)
        return list(self.rows[start:stop])


class ParquetShard:
    """One Parquet file as a shard; rows come back as dicts of the chosen ``columns`` (all by default).

    ``num_rows`` and the row groups (``piece_starts``) come from the file's
    metadata (no data is read); ``read`` reads only the row groups that hold
    the requested range. The file stays open between reads until
    :meth:`close`; opening it again checks that it still has the same row
    groups, else :class:`ShardError`.
    """

    def __init__(self, path: str | os.PathLike[str], columns: Sequence[str] | None = None) -> None:
        self.path = Path(path)
        metadata = pq.read_metadata(self.path)
        self.num_rows: int = metadata.num_rows
        self._group_rows = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
        self.piece_starts: tuple[int, ...] = tuple(np.concatenate([[0], np.cumsum(self._group_rows)]).tolist())
        if columns is not None:
            if isinstance(columns, str) or not isinstance(columns, Sequence):
                raise TypeError(f"columns must be a sequence of column names or None, got {columns!r}")
            available = pq.read_schema(self.path).names
            unknown = [name for name in columns if name not in available]
            if unknown:
                raise ValueError(f"columns must be among {available} of {self.path}, got unknown {unknown}")
            columns = list(columns)
        self.columns: list[str] | None = columns
        self._file: pq.ParquetFile | None = None
        self._owner = os.getpid()

    @property
    def name(self) -> str:
        """The file's name (not its directory, which may differ between machines)."""
        return self.path.name

    def content_digest(self) -> str:
        """A digest of the file's size, its footer (row groups, column statistics, offsets) and sampled bytes."""
        digest = hashlib.blake2b(digest_size=8)
        with self.path.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            digest.update(f"{size} {self.columns}".encode())
            footer = min(size, 8 + int.from_bytes(_read_at(file, size - 8, 4), "little")) if size >= 8 else size
            digest.update(_read_at(file, size - footer, footer))
            span = max(0, size - footer - SAMPLED_WINDOW_BYTES)
            for number in range(SAMPLED_WINDOWS):
                offset = span * number // max(1, SAMPLED_WINDOWS - 1)
                digest.update(_read_at(file, offset, min(SAMPLED_WINDOW_BYTES, size - offset)))
        return digest.hexdigest()

    def read(self, start: int, stop: int) -> list[Any]:
        """Rows ``start..stop-1`` as dicts, reading the row groups that cover them and no others."""
        return self.read_arrow(start, stop).to_pylist()

    def read_arrow(self, start: int, stop: int) -> pa.Table:
        """Rows ``start..stop-1`` as a table, reading the row groups that cover them and no others."""
        start = check_int("start", start, minimum=0, maximum=self.num_rows)
        stop = check_int("stop", stop, minimum=start, maximum=self.num_rows)
        if start == stop:
            empty = self._open().schema_arrow.empty_table()
            return empty if self.columns is None else empty.select(self.columns)
        first = int(np.searchsorted(self.piece_starts, start, side="right")) - 1
        last = int(np.searchsorted(self.piece_starts, stop - 1, side="right")) - 1
        table = self._open().read_row_groups(list(range(first, last + 1)), columns=self.columns)
        return table.slice(start - self.piece_starts[first], stop - start)

    def close(self) -> None:
        """Close the file (it is opened again on the next read)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self) -> pq.ParquetFile:
        if self._owner != os.getpid():  # inherited through fork (a DataLoader worker): open our own
            self._file, self._owner = None, os.getpid()
        if self._file is None:
            file = pq.ParquetFile(self.path)
            metadata = file.metadata
            groups = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
            if groups != self._group_rows:
                file.close()
                raise ShardError(
                    f"{self.path} changed since it was opened: it now holds {metadata.num_rows} rows in "
                    f"{len(groups)} row groups, it held {self.num_rows} in {len(self._group_rows)}; a dataset must "
                    "not change while a job trains on it"
                )
            self._file = file
        return self._file

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None}

    def __repr__(self) -> str:
        return f"ParquetShard({str(self.path)!r}, columns={self.columns!r})"


class HFIterableShard:
    """Shard ``index`` of a Hugging Face ``IterableDataset``, read forwards in pieces of ``piece_rows`` rows.

    ``num_rows`` is counted with one pass over the shard unless given (the
    pass also takes the content digest from the first piece). Each process
    reads through its own cursor (see the module doc); pickling (for a
    DataLoader worker) leaves the cursor behind.
    """

    sequential = True

    def __init__(
        self, dataset: Any, index: int, num_rows: int | None = None, piece_rows: int = DEFAULT_HF_PIECE_ROWS
    ) -> None:
        shards = check_int("dataset.num_shards", dataset.num_shards, minimum=1)
        self.index = check_int("index", index, minimum=0, maximum=shards - 1)
        self.name = f"shard {index} of {shards}"
        self.piece_rows = check_int("piece_rows", piece_rows, minimum=1)
        self._part = dataset.shard(num_shards=shards, index=index).with_format("arrow")
        self._digest: str | None = None
        if num_rows is None:
            num_rows = 0
            for table in self._tables():
                if self._digest is None:
                    self._digest = _table_digest(table)
                num_rows += table.num_rows
        self.num_rows: int = check_int("num_rows", num_rows, minimum=0)
        self.piece_starts = (*range(0, self.num_rows, self.piece_rows), self.num_rows)
        self._cursor: Iterator[pa.Table] | None = None
        self._held: pa.Table | None = None
        self._held_start = 0
        self._owner = os.getpid()

    @property
    def position(self) -> int:
        """The row this process's cursor continues from (0 when it has not started)."""
        self._own()
        return self._held_start + (0 if self._held is None else self._held.num_rows)

    def content_digest(self) -> str:
        """A digest of the row count, the schema and the first piece's rows."""
        if self._digest is None:
            first = next(self._tables(), None)
            self._digest = _table_digest(pa.table({}) if first is None else first)
        return hashlib.blake2b(f"{self.num_rows} {self._digest}".encode(), digest_size=8).hexdigest()

    def read(self, start: int, stop: int) -> list[Any]:
        """Rows ``start..stop-1`` as dicts."""
        return self.read_arrow(start, stop).to_pylist()

    def read_arrow(self, start: int, stop: int) -> pa.Table:
        """Rows ``start..stop-1`` as a table: the cursor continues when ``start`` is at or after it, else restarts."""
        start = check_int("start", start, minimum=0, maximum=self.num_rows)
        stop = check_int("stop", stop, minimum=start, maximum=self.num_rows)
        self._own()
        if start < self._held_start or self._cursor is None:
            self._cursor, self._held, self._held_start = self._tables(), None, 0
        parts = []
        while True:
            held_stop = self.position
            if self._held is not None and held_stop > start:
                low = max(start, self._held_start) - self._held_start
                parts.append(self._held.slice(low, min(stop, held_stop) - self._held_start - low))
                if held_stop >= stop:
                    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            table = next(self._cursor, None)
            if table is None:
                raise ShardError(f"{self.name} ended at row {held_stop} of the {self.num_rows} it held when opened")
            self._held, self._held_start = table, held_stop

    def close(self) -> None:
        """Drop the cursor (the next read starts the shard again)."""
        self._cursor, self._held, self._held_start = None, None, 0

    def _tables(self) -> Iterator[pa.Table]:
        return iter(self._part.iter(batch_size=self.piece_rows))

    def _own(self) -> None:
        """Drop a cursor inherited through ``fork`` (a DataLoader worker): its open file is the parent's."""
        if self._owner != os.getpid():
            self._cursor, self._held, self._held_start, self._owner = None, None, 0, os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cursor": None, "_held": None, "_held_start": 0}


@dataclass
class _Piece:
    """A decoded piece and, once asked for, its rows' content hashes."""

    data: list[Any] | pa.Table
    hashes: UInt64s | None = None


class ShardedDataset(Dataset[Any]):
    """A map-style dataset over shards that reads each piece once for a batch of indices (see the module doc).

    ``key`` names the column that identifies a row (``None``: a hash of its
    content) for :meth:`gather` and :meth:`row_keys`. ``cached_pieces``
    pieces and ``open_shards`` shards are kept per process (each DataLoader
    worker has its own). A shard that fails to read, or returns another
    number of rows than it had, raises :class:`ShardError` naming the shard
    and the rows. ``rows_decoded`` counts the rows this process decoded.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        *,
        key: str | None = None,
        cached_pieces: int = DEFAULT_CACHED_PIECES,
        open_shards: int = DEFAULT_OPEN_SHARDS,
    ) -> None:
        if isinstance(shards, str) or not isinstance(shards, Sequence) or not shards:
            raise ValueError(f"shards must be a non-empty sequence of shards, got {shards!r}")
        for index, shard in enumerate(shards):
            if not isinstance(shard, Shard):
                raise TypeError(f"shards[{index}] must have num_rows and read(start, stop), got {shard!r}")
        if key is not None and not isinstance(key, str):
            raise TypeError(f"key must be a column name or None (a hash of each row's content), got {key!r}")
        self.shards = list(shards)
        self.key = key
        sizes = [check_int(f"shards[{index}].num_rows", s.num_rows, minimum=0) for index, s in enumerate(self.shards)]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        if self.offsets[-1] == 0:
            raise ValueError(f"shards must hold at least one row in total, got {len(self.shards)} empty shards")
        self.cached_pieces = check_int("cached_pieces", cached_pieces, minimum=1)
        self.open_shards = check_int("open_shards", open_shards, minimum=1)
        self.rows_decoded = 0
        self._identities: list[ShardIdentity] | None = None
        self._pieces: OrderedDict[tuple[int, int], _Piece] = OrderedDict()
        self._opened: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_parquet(
        cls,
        paths: Iterable[str | os.PathLike[str]],
        columns: Sequence[str] | None = None,
        *,
        key: str | None = None,
        **options: int,
    ) -> ShardedDataset:
        """One shard per Parquet file, in the order given (sort the file names: every member must list the same)."""
        return cls([_open_parquet(path, columns) for path in paths], key=key, **options)

    @classmethod
    def from_hf_iterable(
        cls,
        dataset: Any,
        num_rows: Sequence[int] | None = None,
        *,
        key: str | None = None,
        piece_rows: int = DEFAULT_HF_PIECE_ROWS,
        **options: int,
    ) -> ShardedDataset:
        """One shard per shard (data file) of a Hugging Face ``IterableDataset``; ``num_rows`` saves a counting pass.

        Give it unshuffled: the stream or the plan orders the samples, and a
        shuffle buffer only costs reads (and a per-rank seed makes each rank's
        shards hold other rows, which the shards' identities then refuse).
        """
        shards = dataset.num_shards
        if num_rows is not None and len(num_rows) != shards:
            raise ValueError(f"num_rows must give one count per shard ({shards}), got {len(num_rows)}")
        counts = [None] * shards if num_rows is None else list(num_rows)
        parts = [HFIterableShard(dataset, index, count, piece_rows) for index, count in enumerate(counts)]
        return cls(parts, key=key, **options)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def identities(self) -> list[ShardIdentity]:
        """Each shard's :class:`ShardIdentity`, in order (computed once per process, on first use)."""
        if self._identities is None:
            self._identities = [_identity(shard) for shard in self.shards]
        return self._identities

    @property
    def fingerprint(self) -> str:
        """A digest of the shards' row counts and contents: members must agree on it to train together."""
        return fingerprint_of(self.identities)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int] | npt.NDArray[np.integer]) -> list[Any]:
        """The rows at ``indices``, in that order, reading each piece they fall in once."""
        return self._collect(indices, rows=True, keys=False)[0]

    def gather(self, indices: Sequence[int] | npt.NDArray[np.integer]) -> tuple[list[Any], list[Any]]:
        """The rows at ``indices`` and their keys (column ``key``'s values, or content hashes), in that order."""
        return self._collect(indices, rows=True, keys=True)

    def row_keys(self, indices: Sequence[int] | npt.NDArray[np.integer]) -> list[Any]:
        """The keys of the rows at ``indices`` (from the cached pieces when they are there)."""
        return self._collect(indices, rows=False, keys=True)[1]

    def close(self) -> None:
        """Close every open shard and drop the cached pieces."""
        with self._lock:
            for shard in self._opened:
                _close(self.shards[shard])
            self._opened.clear()
            self._pieces.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_pieces=OrderedDict(), _opened=OrderedDict(), _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def _collect(
        self, indices: Sequence[int] | npt.NDArray[np.integer], *, rows: bool, keys: bool
    ) -> tuple[list[Any], list[Any]]:
        array = np.asarray(indices, dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= len(self)):
            raise IndexError(f"indices must be in [0, {len(self) - 1}], got values in [{array.min()}, {array.max()}]")
        shard_of = np.searchsorted(self.offsets, array, side="right") - 1
        local = array - self.offsets[shard_of]
        found: list[Any] = [None] * array.size if rows else []
        found_keys: list[Any] = [None] * array.size if keys else []
        with self._lock:
            for shard in np.unique(shard_of).tolist():
                where = np.flatnonzero(shard_of == shard)
                self._gather(shard, local[where], where, found, found_keys)
        return found, found_keys

    def _gather(
        self,
        shard: int,
        rows: npt.NDArray[np.int64],
        where: npt.NDArray[np.int64],
        found: list[Any],
        found_keys: list[Any],
    ) -> None:
        """Put ``shard``'s ``rows`` (and keys) at ``where`` in ``found`` (``found_keys``), reading their pieces."""
        starts = self._piece_starts(shard)
        piece_of = np.searchsorted(starts, rows, side="right") - 1
        for piece in np.unique(piece_of).tolist():
            inside = piece_of == piece
            cached = self._piece(shard, piece, starts)
            local = rows[inside] - starts[piece]
            slots = where[inside].tolist()
            if found:
                values = _take(cached.data, local)
                for slot, value in zip(slots, values, strict=True):
                    found[slot] = value
            if found_keys:
                for slot, value in zip(slots, self._keys(cached, local), strict=True):
                    found_keys[slot] = value

    def _keys(self, piece: _Piece, local: npt.NDArray[np.int64]) -> list[Any]:
        if self.key is not None:
            if isinstance(piece.data, pa.Table):
                if self.key not in piece.data.column_names:
                    raise KeyError(f"key {self.key!r} is not a column of the rows; they have {piece.data.column_names}")
                return pc.take(piece.data.column(self.key), local).to_pylist()
            return row_keys([piece.data[row] for row in local.tolist()], self.key)
        if piece.hashes is None:
            data = piece.data
            piece.hashes = table_hashes(data) if isinstance(data, pa.Table) else python_hashes(data)
        return piece.hashes[local].tolist()

    def _piece_starts(self, shard: int) -> Sequence[int]:
        starts = getattr(self.shards[shard], "piece_starts", None)
        if starts is None:
            size = self.shards[shard].num_rows
            starts = [*range(0, size, DEFAULT_PIECE_ROWS), size]
        return starts

    def _piece(self, shard: int, piece: int, starts: Sequence[int]) -> _Piece:
        """Piece ``piece`` of ``shard``, from the cache or read; a forwards-only shard caches what its cursor passes."""
        key = (shard, piece)
        if key in self._pieces:
            self._pieces.move_to_end(key)
            return self._pieces[key]
        first = piece
        source = self.shards[shard]
        if getattr(source, "sequential", False):
            position = int(getattr(source, "position", 0))
            first = int(np.searchsorted(starts, position, side="right")) - 1 if position <= starts[piece] else 0
        for passed in range(first, piece + 1):
            self._pieces[(shard, passed)] = _Piece(self._read(shard, starts[passed], starts[passed + 1]))
            self._pieces.move_to_end((shard, passed))
            while len(self._pieces) > self.cached_pieces:
                self._pieces.popitem(last=False)
        return self._pieces[key]

    def _read(self, shard: int, start: int, stop: int) -> list[Any] | pa.Table:
        """Rows ``start..stop-1`` of ``shard`` (Arrow when it can), or :class:`ShardError` saying what failed."""
        source = self.shards[shard]
        where = f"shard {shard} ({getattr(source, 'name', type(source).__name__)})"
        try:
            read_arrow = getattr(source, "read_arrow", None)
            rows = source.read(start, stop) if read_arrow is None else read_arrow(start, stop)
        except ShardError:
            raise
        except Exception as error:
            raise ShardError(f"{where} failed to read rows {start}..{stop - 1}: {_one_line(error)}") from error
        finally:
            self._touch(shard)
        if len(rows) != stop - start:
            raise ShardError(
                f"{where} returned {len(rows)} rows for rows {start}..{stop - 1}: it held {source.num_rows} rows when "
                "it was opened; a dataset must not change while a job trains on it"
            )
        self.rows_decoded += stop - start
        return rows

    def _touch(self, shard: int) -> None:
        """Record ``shard`` as the last opened; close the least recent beyond ``open_shards``."""
        self._opened[shard] = None
        self._opened.move_to_end(shard)
        if len(self._opened) > self.open_shards:
            oldest, _ = self._opened.popitem(last=False)
            _close(self.shards[oldest])


def _take(data: list[Any] | pa.Table, local: npt.NDArray[np.int64]) -> list[Any]:
    if isinstance(data, pa.Table):
        return pc.take(data, local).to_pylist()
    return [data[row] for row in local.tolist()]


def _identity(shard: Shard) -> ShardIdentity:
    name = str(getattr(shard, "name", type(shard).__name__))
    digest = getattr(shard, "content_digest", None)
    if callable(digest):
        return ShardIdentity(name, shard.num_rows, str(digest()))
    return ShardIdentity(name, shard.num_rows, _sampled_digest(shard))


def _sampled_digest(shard: Shard) -> str:
    """A digest of the row count and of the first and last ``SAMPLED_ROWS`` rows (the first only, read forwards)."""
    size = shard.num_rows
    head = min(size, SAMPLED_ROWS)
    rows = list(shard.read(0, head))
    if not getattr(shard, "sequential", False) and size > head:
        rows += shard.read(max(head, size - SAMPLED_ROWS), size)
    return hashlib.blake2b(f"{size}".encode() + python_hashes(rows).tobytes(), digest_size=8).hexdigest()


def _table_digest(table: pa.Table) -> str:
    return hashlib.blake2b(str(table.schema).encode() + table_hashes(table).tobytes(), digest_size=8).hexdigest()


def _read_at(file: Any, offset: int, size: int) -> bytes:
    file.seek(max(0, offset))
    return bytes(file.read(max(0, size)))


def _open_parquet(path: str | os.PathLike[str], columns: Sequence[str] | None) -> ParquetShard:
    try:
        return ParquetShard(path, columns)
    except (OSError, pa.ArrowException) as error:
        raise ShardError(f"{path} cannot be opened as a Parquet shard: {_one_line(error)}") from error


def _one_line(error: BaseException) -> str:
    """``Type: message`` on one line (pyarrow's messages span several)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _close(shard: Shard) -> None:
    close = getattr(shard, "close", None)
    if callable(close):
        close()
