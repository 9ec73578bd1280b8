"""Sharded sources as one map-style dataset: Parquet files, Hugging Face iterable datasets, rows in memory.

A sharded source is a list of shards, each a numbered run of rows. Sample
``i`` of :class:`ShardedDataset` is row ``i - offset[s]`` of shard ``s``, the
shards concatenated in order. ``dataset.__getitems__(indices)`` (what
``ElasticLoader`` and ``torch.utils.data.DataLoader`` call for a batch) groups
the indices by shard and by *piece* (a Parquet row group; an iterable shard
whole), reads each piece once, keeps the last pieces read and the last
shards opened in small LRU caches, and returns the rows in the order asked.

Training through failures takes the order from the lighthouse's plan: with
``EpochPlan(block_size=B, window=W)`` every block of ``B`` consecutive indices
is a run of consecutive positions, so a member's share of a step is a few
whole blocks. Reads stay local when ``B`` is a multiple of the row-group size
that divides the shards' sizes, and at most about a quarter of a member's
share of a step (a block cut by a share's edge is read by two members).

A Hugging Face map-style ``datasets.Dataset`` (memory-mapped Arrow) needs no
wrapper: it is a map-style dataset with ``__getitems__`` already. An
``IterableDataset`` reads only forwards, so :meth:`ShardedDataset.from_hf_iterable`
makes each of its shards a piece that is read whole on first use and cached;
every member that needs a row of it reads it whole, so keep such shards small
or use Parquet files (or a map-style dataset) for large ones.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from torch.utils.data import Dataset

from stalwart._validate import check_int

DEFAULT_CACHED_PIECES = 32
DEFAULT_OPEN_SHARDS = 16
DEFAULT_PIECE_ROWS = 1024
"""Rows per piece of a shard that does not say where its pieces begin (no ``piece_starts``)."""


class ShardError(RuntimeError):
    """A shard could not be read, or it no longer holds the rows it held when it was opened."""


@runtime_checkable
class Shard(Protocol):
    """A source of rows addressed by number: ``read(start, stop)`` returns rows ``start..stop-1``.

    Optional attributes that :class:`ShardedDataset` uses when present:
    ``piece_starts`` (ascending row numbers from 0 to ``num_rows`` where
    independent reads begin, e.g. Parquet row groups; by default every
    ``DEFAULT_PIECE_ROWS`` rows), ``read_arrow(start, stop)`` (the rows as
    a ``pyarrow.Table``: pieces are then cached as Arrow data and only the
    rows asked for become Python objects), ``name`` (what identifies the shard
    across machines, in the fingerprint and in errors) and ``close()``
    (release open files).
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

    @property
    def name(self) -> str:
        """The file's name (not its directory, which may differ between machines)."""
        return self.path.name

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
    """Shard ``index`` of a Hugging Face ``IterableDataset``, read forwards; one piece (read whole, then cached).

    ``num_rows`` is counted with one pass over the shard unless given.
    """

    def __init__(self, dataset: Any, index: int, num_rows: int | None = None) -> None:
        shards = check_int("dataset.num_shards", dataset.num_shards, minimum=1)
        self.index = check_int("index", index, minimum=0, maximum=shards - 1)
        self.name = f"shard {index} of {shards}"
        self._part = dataset.shard(num_shards=shards, index=index)
        if num_rows is None:
            num_rows = sum(table.num_rows for table in self._part.with_format("arrow").iter(batch_size=8192))
        self.num_rows: int = check_int("num_rows", num_rows, minimum=0)
        self.piece_starts = (0, self.num_rows)

    def read(self, start: int, stop: int) -> list[Any]:
        """Rows ``start..stop-1``, iterating the shard from its beginning."""
        start = check_int("start", start, minimum=0, maximum=self.num_rows)
        stop = check_int("stop", stop, minimum=start, maximum=self.num_rows)
        return list(itertools.islice(iter(self._part), start, stop))


class ShardedDataset(Dataset[Any]):
    """A map-style dataset over shards that reads each piece once for a batch of indices (see the module doc).

    ``cached_pieces`` pieces and ``open_shards`` shards are kept per process
    (each DataLoader worker has its own). A shard that fails to read, or
    returns another number of rows than it had, raises :class:`ShardError`
    naming the shard and the rows.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        *,
        cached_pieces: int = DEFAULT_CACHED_PIECES,
        open_shards: int = DEFAULT_OPEN_SHARDS,
    ) -> None:
        if isinstance(shards, str) or not isinstance(shards, Sequence) or not shards:
            raise ValueError(f"shards must be a non-empty sequence of shards, got {shards!r}")
        for index, shard in enumerate(shards):
            if not isinstance(shard, Shard):
                raise TypeError(f"shards[{index}] must have num_rows and read(start, stop), got {shard!r}")
        self.shards = list(shards)
        sizes = [check_int(f"shards[{index}].num_rows", s.num_rows, minimum=0) for index, s in enumerate(self.shards)]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        if self.offsets[-1] == 0:
            raise ValueError(f"shards must hold at least one row in total, got {len(self.shards)} empty shards")
        self.cached_pieces = check_int("cached_pieces", cached_pieces, minimum=1)
        self.open_shards = check_int("open_shards", open_shards, minimum=1)
        self._pieces: OrderedDict[tuple[int, int], list[Any] | pa.Table] = OrderedDict()
        self._opened: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_parquet(
        cls, paths: Iterable[str | os.PathLike[str]], columns: Sequence[str] | None = None, **options: int
    ) -> ShardedDataset:
        """One shard per Parquet file, in the order given (sort the file names: every member must list the same)."""
        return cls([_open_parquet(path, columns) for path in paths], **options)

    @classmethod
    def from_hf_iterable(cls, dataset: Any, num_rows: Sequence[int] | None = None, **options: int) -> ShardedDataset:
        """One shard per shard (data file) of a Hugging Face ``IterableDataset``; ``num_rows`` saves a counting pass.

        Give it unshuffled: the plan orders the samples, and a shuffle buffer only costs reads.
        """
        shards = dataset.num_shards
        if num_rows is not None and len(num_rows) != shards:
            raise ValueError(f"num_rows must give one count per shard ({shards}), got {len(num_rows)}")
        counts = [None] * shards if num_rows is None else list(num_rows)
        return cls([HFIterableShard(dataset, index, count) for index, count in enumerate(counts)], **options)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def fingerprint(self) -> str:
        """A digest of the shards' names and row counts: members must agree on it to train together."""
        layout = [[getattr(shard, "name", None), shard.num_rows] for shard in self.shards]
        return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int] | npt.NDArray[np.integer]) -> list[Any]:
        """The rows at ``indices``, in that order, reading each piece they fall in once."""
        array = np.asarray(indices, dtype=np.int64).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= len(self)):
            raise IndexError(f"indices must be in [0, {len(self) - 1}], got values in [{array.min()}, {array.max()}]")
        shard_of = np.searchsorted(self.offsets, array, side="right") - 1
        rows = array - self.offsets[shard_of]
        found: list[Any] = [None] * array.size
        with self._lock:
            for shard in np.unique(shard_of).tolist():
                where = np.flatnonzero(shard_of == shard)
                self._gather(shard, rows[where], where, found)
        return found

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

    def _gather(self, shard: int, rows: npt.NDArray[np.int64], where: npt.NDArray[np.int64], found: list[Any]) -> None:
        """Put ``shard``'s ``rows`` at ``where`` in ``found``, reading the pieces they fall in (cached)."""
        starts = getattr(self.shards[shard], "piece_starts", None)
        if starts is None:
            size = self.shards[shard].num_rows
            starts = [*range(0, size, DEFAULT_PIECE_ROWS), size]
        piece_of = np.searchsorted(starts, rows, side="right") - 1
        for piece in np.unique(piece_of).tolist():
            inside = piece_of == piece
            data = self._piece(shard, piece, starts[piece], starts[piece + 1])
            local = rows[inside] - starts[piece]
            if isinstance(data, pa.Table):
                values = pc.take(data, local).to_pylist()
            else:
                values = [data[row] for row in local.tolist()]
            for slot, value in zip(where[inside].tolist(), values, strict=True):
                found[slot] = value

    def _piece(self, shard: int, piece: int, start: int, stop: int) -> list[Any] | pa.Table:
        key = (shard, piece)
        if key in self._pieces:
            self._pieces.move_to_end(key)
            return self._pieces[key]
        data = self._read(shard, start, stop)
        self._pieces[key] = data
        if len(self._pieces) > self.cached_pieces:
            self._pieces.popitem(last=False)
        return data

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
        return rows

    def _touch(self, shard: int) -> None:
        """Record ``shard`` as the last opened; close the least recent beyond ``open_shards``."""
        self._opened[shard] = None
        self._opened.move_to_end(shard)
        if len(self._opened) > self.open_shards:
            oldest, _ = self._opened.popitem(last=False)
            _close(self.shards[oldest])


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
