"""Coverage audit: were an epoch's samples consumed exactly once, and were they the rows their indices name?

``coverage`` compares index lists in memory. The rest is the on-disk form a
training run leaves behind so that the claim can be checked afterwards (``stalwart
audit DIR``): each rank appends one JSON line per consumed batch to its own
file, ``audit.json`` says what an epoch should cover, and ``audit_directory``
reads both back into an :class:`AuditReport`.

Records name their rank with its world size (rank 0 of a 2-rank run and rank
0 of the 3-rank run that resumed it are two consumers) and may carry each
row's key (:mod:`stalwart.data.rowkeys`) beside its index. Positions alone
cannot see a rank that reads other rows than its indices say (a per-rank
shuffle of the source, a wrong shard): with keys the audit names rows
delivered twice, counts the rows of a complete epoch that never came, and
names every index that was delivered with two different keys. ``audit.json``
may record the dataset's shards (:class:`~stalwart.data.shards.ShardIdentity`):
a writer whose shards differ is refused at once, naming the first one.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from stalwart._validate import check_int
from stalwart.data.plan import EpochPlan
from stalwart.data.shards import ShardIdentity, shard_difference
from stalwart.errors import StalwartError


@dataclass(frozen=True)
class Coverage:
    """What a set of consumers took of an expected set of samples."""

    consumed: int
    duplicates: dict[int, int]
    missing: list[int]
    unexpected: list[int]

    @property
    def exactly_once(self) -> bool:
        """True when every expected sample was consumed once and nothing else was."""
        return not self.duplicates and not self.missing and not self.unexpected


def coverage(consumed: Iterable[npt.ArrayLike], expected: npt.ArrayLike) -> Coverage:
    """Compare the concatenation of ``consumed`` index lists with the ``expected`` indices.

    ``duplicates`` maps each index taken more than once to how often it was
    taken; ``missing`` lists expected indices never taken; ``unexpected`` those
    taken that were not expected (sorted).
    """
    parts = [np.asarray(part, dtype=np.int64).reshape(-1) for part in consumed]
    taken = np.concatenate([np.zeros(0, dtype=np.int64), *parts])
    wanted = np.unique(np.asarray(expected, dtype=np.int64))
    values, counts = np.unique(taken, return_counts=True)
    repeated = counts > 1
    return Coverage(
        consumed=int(taken.size),
        duplicates=dict(zip(values[repeated].tolist(), counts[repeated].tolist(), strict=True)),
        missing=np.setdiff1d(wanted, values, assume_unique=True).tolist(),
        unexpected=np.setdiff1d(values, wanted, assume_unique=True).tolist(),
    )


EXPECTED_FILE = "audit.json"
_RECORD_FILE = re.compile(r"^rank-(\d{5,})(?:-w(\d+))?\.jsonl$")
_SPEC_OPTIONS = ("shards", "key")


class AuditFileError(StalwartError, ValueError):
    """An audit directory holds a file that cannot be read as audit records or an expected spec."""


def audit_file_name(rank: int, worker: int | None = None) -> str:
    """File name of one writer's records: ``rank-00003.jsonl``, or ``rank-00003-w01.jsonl`` for a DataLoader worker."""
    rank = check_int("rank", rank, minimum=0)
    if worker is None:
        return f"rank-{rank:05d}.jsonl"
    return f"rank-{rank:05d}-w{check_int('worker', worker, minimum=0):02d}.jsonl"


class Consumer(NamedTuple):
    """Who consumed a batch: a rank, and the world size it ran in (None when the record does not say)."""

    rank: int
    world_size: int | None

    def __str__(self) -> str:
        return str(self.rank) if self.world_size is None else f"{self.rank} of {self.world_size}"


class AuditWriter:
    """Appends one JSON line per consumed batch to ``directory/rank-{rank:05d}.jsonl``.

    Each line is ``{"epoch": e, "step": s, "rank": r, "world_size": w,
    "indices": [...], "keys": [...]}`` (``world_size`` when given to the
    writer, ``keys`` when given to :meth:`write`) and goes to the file in a
    single ``write`` on a descriptor opened with ``O_APPEND``, so a killed
    process leaves whole lines (at worst a torn last one, which the reader
    skips and counts) and writers sharing a file do not interleave. A torn
    tail left by an earlier, killed writer is cut off when the file is
    reopened, so that the next record starts on a line of its own. One
    process at a time should write to a given file. ``expected``, when given,
    is passed to :func:`write_expected`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rank: int,
        *,
        worker: int | None = None,
        world_size: int | None = None,
        expected: Mapping[str, Any] | None = None,
    ) -> None:
        self.rank = check_int("rank", rank, minimum=0)
        self.world_size = None if world_size is None else check_int("world_size", world_size, minimum=self.rank + 1)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if expected is not None:
            write_expected(self.directory, expected)
        self.path = self.directory / audit_file_name(self.rank, worker)
        _cut_torn_tail(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, epoch: int, step: int, indices: npt.ArrayLike, *, keys: Sequence[Any] | None = None) -> None:
        """Record that this rank consumed the samples ``indices`` (rows with ``keys``) at step ``step`` of ``epoch``."""
        if self._fd is None:
            raise RuntimeError(f"AuditWriter for {self.path} is closed")
        record: dict[str, Any] = {
            "epoch": check_int("epoch", epoch, minimum=0),
            "step": check_int("step", step, minimum=0),
            "rank": self.rank,
        }
        if self.world_size is not None:
            record["world_size"] = self.world_size
        record["indices"] = np.asarray(indices, dtype=np.int64).reshape(-1).tolist()
        if keys is not None:
            record["keys"] = _check_keys("keys", list(keys), len(record["indices"]))
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        written = 0
        while written < len(data):
            written += os.write(self._fd, data[written:])

    def close(self) -> None:
        """Close the file; further writes raise."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> AuditWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def write_expected(directory: str | os.PathLike[str], spec: Mapping[str, Any]) -> dict[str, Any]:
    """Record in ``directory/audit.json`` what each epoch is expected to cover; return the normalised spec.

    ``spec`` is ``{"dataset_size": N}`` (every index in [0, N) once per epoch)
    or ``{"plan": EpochPlan.to_dict()}`` (the plan's ``indices(epoch, 0,
    epoch_length)``, so a ``drop_last`` tail is not expected), optionally with
    ``"shards"`` (``ShardIdentity.to_list()`` of each shard, in order) and
    ``"key"`` (the column the records' keys come from; None for content
    hashes). Every rank may call this with the same spec: the file is created
    atomically once, an equal spec is accepted (shards compare by rows and
    content, not name) and a different one raises ``ValueError``, naming the
    first shard that differs when the shards do.
    """
    normalised = _normalise_spec("spec", spec)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / EXPECTED_FILE
    staging = directory / f".{EXPECTED_FILE}.{os.getpid()}.{uuid.uuid4().hex}"
    staging.write_text(json.dumps(normalised, sort_keys=True) + "\n", encoding="utf-8")
    try:
        os.link(staging, target)
    except FileExistsError:
        existing = read_expected(directory)
        if _comparable(existing) != _comparable(normalised):
            raise ValueError(_conflict(normalised, existing, target)) from None
    finally:
        staging.unlink()
    return normalised


def read_expected(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The normalised spec recorded by :func:`write_expected` (``FileNotFoundError`` naming the file if absent)."""
    path = Path(directory) / EXPECTED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the expected coverage is written by write_expected()")
    try:
        return _normalise_spec(str(path), json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as error:
        raise AuditFileError(f"{path} does not hold a valid spec: {error}") from error


def expected_indices(spec: Mapping[str, Any], epoch: int) -> npt.NDArray[np.int64]:
    """The sample indices epoch ``epoch`` is expected to cover under a normalised ``spec``."""
    epoch = check_int("epoch", epoch, minimum=0)
    if "dataset_size" in spec:
        return np.arange(spec["dataset_size"], dtype=np.int64)
    plan = EpochPlan(**spec["plan"])
    return plan.indices(epoch, 0, plan.epoch_length)


@dataclass(frozen=True)
class Delivery:
    """Where one row was delivered: by whom, at which step of which epoch, under which index."""

    consumer: Consumer
    epoch: int
    step: int
    index: int

    def describe(self) -> str:
        """``index 17 (rank 0 of 2, epoch 0 step 3)``."""
        return f"index {self.index} (rank {self.consumer}, epoch {self.epoch} step {self.step})"


@dataclass(frozen=True)
class KeyCoverage:
    """What the rows' keys say about one epoch: ``keyed`` rows carried a key, ``distinct`` different ones.

    ``duplicates`` maps each key delivered more than once to every delivery of it.
    """

    keyed: int
    distinct: int
    duplicates: dict[Any, list[Delivery]]


@dataclass(frozen=True)
class EpochAudit:
    """What the ranks consumed of one epoch.

    ``complete`` is True when the epoch's consumption reached the expected
    count or a later epoch has records; an incomplete epoch is one still in
    progress. ``rank_samples`` and ``rank_batches`` count per
    :class:`Consumer` (files of one rank's DataLoader workers are added up).
    ``keys`` is None when no record of the epoch carried keys.
    """

    epoch: int
    expected: int
    rank_samples: dict[Consumer, int]
    rank_batches: dict[Consumer, int]
    coverage: Coverage
    complete: bool
    keys: KeyCoverage | None = None

    @property
    def missing_rows(self) -> int | None:
        """Rows no consumer delivered by key (expected minus distinct keys); None unless complete and all keyed."""
        if self.keys is None or not self.complete or self.keys.keyed != self.coverage.consumed:
            return None
        return max(0, self.expected - self.keys.distinct)

    @property
    def ok(self) -> bool:
        """Complete: exactly once, by index and by key. In progress: nothing consumed twice, nothing unexpected."""
        if self.keys is not None and self.keys.duplicates:
            return False
        if self.complete:
            return self.coverage.exactly_once and not self.missing_rows
        return not self.coverage.duplicates and not self.coverage.unexpected


@dataclass(frozen=True)
class KeyConflict:
    """An index delivered as different rows: each different key with its first delivery."""

    index: int
    deliveries: list[tuple[Any, Delivery]]


@dataclass(frozen=True)
class AuditReport:
    """The audit of a directory: one :class:`EpochAudit` per epoch with records, in epoch order.

    ``conflicts`` lists the indices delivered with different keys anywhere in
    the directory (other epochs, other ranks, other world sizes).
    """

    directory: Path
    spec: dict[str, Any]
    epochs: list[EpochAudit]
    torn_lines: int
    conflicts: list[KeyConflict]

    @property
    def empty(self) -> bool:
        """True when the directory holds no records: nothing was consumed through an audited loop."""
        return not self.epochs

    @property
    def ok(self) -> bool:
        """True when there are records, every complete epoch was consumed exactly once (by index and key), no
        epoch in progress repeats a sample, and no index was delivered as two different rows."""
        return not self.empty and not self.conflicts and all(epoch.ok for epoch in self.epochs)


@dataclass
class _Record:
    epoch: int
    step: int
    consumer: Consumer
    indices: list[int]
    keys: list[Any] | None


def audit_directory(directory: str | os.PathLike[str]) -> AuditReport:
    """Read every ``rank-*.jsonl`` file of ``directory`` and compare each epoch with ``audit.json``.

    Raises ``FileNotFoundError`` naming ``audit.json`` when it is missing and
    :class:`AuditFileError` for a malformed line (a torn last line is skipped
    and counted in ``torn_lines`` instead).
    """
    directory = Path(directory)
    spec = read_expected(directory)
    by_epoch: dict[int, list[_Record]] = defaultdict(list)
    torn_lines = 0
    for path in sorted(directory.iterdir()):
        match = _RECORD_FILE.match(path.name)
        if not match or not path.is_file():
            continue
        records, torn = _read_records(path, int(match.group(1)))
        torn_lines += torn
        for record in records:
            by_epoch[record.epoch].append(record)
    last_epoch = max(by_epoch, default=-1)
    epochs = []
    for epoch in sorted(by_epoch):
        records = by_epoch[epoch]
        expected = expected_indices(spec, epoch)
        result = coverage([record.indices for record in records], expected)
        samples: Counter[Consumer] = Counter()
        batches: Counter[Consumer] = Counter()
        for record in records:
            samples[record.consumer] += len(record.indices)
            batches[record.consumer] += 1
        epochs.append(
            EpochAudit(
                epoch=epoch,
                expected=int(expected.size),
                rank_samples=dict(sorted(samples.items(), key=_consumer_order)),
                rank_batches=dict(sorted(batches.items(), key=_consumer_order)),
                coverage=result,
                complete=epoch < last_epoch or result.consumed >= expected.size,
                keys=_key_coverage(records),
            )
        )
    every = [record for epoch in sorted(by_epoch) for record in by_epoch[epoch]]
    return AuditReport(directory, spec, epochs, torn_lines, _conflicts(every))


def _consumer_order(item: tuple[Consumer, int]) -> tuple[int, int]:
    consumer = item[0]
    return (-1 if consumer.world_size is None else consumer.world_size, consumer.rank)


def _deliveries(records: Iterable[_Record]) -> Iterable[tuple[Any, Delivery]]:
    for record in records:
        if record.keys is not None:
            for index, key in zip(record.indices, record.keys, strict=True):
                yield key, Delivery(record.consumer, record.epoch, record.step, index)


def _key_coverage(records: list[_Record]) -> KeyCoverage | None:
    if all(record.keys is None for record in records):
        return None
    counts = Counter(key for key, _ in _deliveries(records))
    repeated = {key for key, count in counts.items() if count > 1}
    duplicates: dict[Any, list[Delivery]] = defaultdict(list)
    for key, delivery in _deliveries(records):
        if key in repeated:
            duplicates[key].append(delivery)
    return KeyCoverage(keyed=sum(counts.values()), distinct=len(counts), duplicates=dict(duplicates))


def _conflicts(records: list[_Record]) -> list[KeyConflict]:
    """Indices delivered with more than one key, each key with its first delivery (in epoch, then file order)."""
    first: dict[int, dict[Any, Delivery]] = defaultdict(dict)
    for key, delivery in _deliveries(records):
        first[delivery.index].setdefault(key, delivery)
    return [KeyConflict(index, list(keys.items())) for index, keys in sorted(first.items()) if len(keys) > 1]


def _normalise_spec(name: str, spec: Any) -> dict[str, Any]:
    """Check ``spec`` and return it in the one form that is stored and compared."""
    if (
        not isinstance(spec, Mapping)
        or len({"dataset_size", "plan"} & set(spec)) != 1
        or not set(spec) <= {"dataset_size", "plan", *_SPEC_OPTIONS}
    ):
        raise ValueError(
            f"{name} must be {{'dataset_size': N}} or {{'plan': EpochPlan.to_dict()}}, optionally with 'shards' "
            f"and 'key', got {spec!r}"
        )
    if "dataset_size" in spec:
        normalised: dict[str, Any] = {
            "dataset_size": check_int(f"{name}['dataset_size']", spec["dataset_size"], minimum=1)
        }
    else:
        plan = spec["plan"]
        if not isinstance(plan, Mapping):
            raise ValueError(f"{name}['plan'] must be EpochPlan.to_dict(), got {plan!r}")
        try:
            normalised = {"plan": EpochPlan(**plan).to_dict()}
        except TypeError as error:
            raise ValueError(f"{name}['plan'] is not an EpochPlan.to_dict(): {error}") from error
    if "shards" in spec:
        shards = spec["shards"]
        if not isinstance(shards, list | tuple):
            raise ValueError(f"{name}['shards'] must be a list of [name, rows, digest], got {shards!r}")
        normalised["shards"] = [ShardIdentity.from_list(shard).to_list() for shard in shards]
    if "key" in spec:
        if spec["key"] is not None and not isinstance(spec["key"], str):
            raise ValueError(f"{name}['key'] must be a column name or None, got {spec['key']!r}")
        normalised["key"] = spec["key"]
    return normalised


def _comparable(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with the shards' names left out: the same data under another path is the same dataset."""
    if "shards" not in spec:
        return dict(spec)
    return {**spec, "shards": [[rows, digest] for _, rows, digest in spec["shards"]]}


def _conflict(mine: Mapping[str, Any], existing: Mapping[str, Any], target: Path) -> str:
    if "shards" in mine and "shards" in existing:
        ours = [ShardIdentity.from_list(shard) for shard in mine["shards"]]
        theirs = [ShardIdentity.from_list(shard) for shard in existing["shards"]]
        difference = shard_difference(theirs, ours, str(target))
        if difference is not None:
            return (
                f"{difference}: every rank, and every run resuming into this audit, must read the same shards in "
                "the same order (a per-rank shuffle or seed of the source gives each rank other rows)"
            )
    return f"spec {dict(mine)} conflicts with the spec already recorded in {target}: {dict(existing)}"


def _read_records(path: Path, rank: int) -> tuple[list[_Record], int]:
    """The records of one file and whether its last line was torn (0 or 1)."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    tail = lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            records.append(_parse_record(path, number, line, rank))
    if not tail:
        return records, 0
    try:
        records.append(_parse_record(path, len(lines) + 1, tail, rank))
    except AuditFileError:
        return records, 1
    return records, 0


def _parse_record(path: Path, number: int, line: str, rank: int) -> _Record:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise AuditFileError(f"{where}: not a JSON line ({error})") from error
    if not isinstance(record, dict) or not {"epoch", "step", "rank", "indices"} <= set(record):
        raise AuditFileError(f"{where}: a record must hold epoch, step, rank and indices, got {line[:80]!r}")
    for key in ("epoch", "step", "rank", "world_size"):
        value = record.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise AuditFileError(f"{where}: {key} must be an int >= 0, got {value!r}")
    if record["rank"] != rank:
        raise AuditFileError(f"{where}: rank {record['rank']} in a file of rank {rank}")
    world_size = record.get("world_size")
    if world_size is not None and world_size <= rank:
        raise AuditFileError(f"{where}: rank {rank} cannot run in a world of {world_size}")
    indices = record["indices"]
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise AuditFileError(f"{where}: indices must be a list of ints")
    keys = record.get("keys")
    if keys is not None:
        try:
            keys = _check_keys("keys", keys, len(indices))
        except (TypeError, ValueError) as error:
            raise AuditFileError(f"{where}: {error}") from error
    return _Record(record["epoch"], record["step"], Consumer(rank, world_size), indices, keys)


def _check_keys(name: str, keys: Any, count: int) -> list[Any]:
    """Keys must be one int or str per index (JSON-exact, hashable)."""
    if not isinstance(keys, list) or len(keys) != count:
        raise ValueError(f"{name} must be a list of one key per index ({count}), got {str(keys)[:80]}")
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, int | str):
            raise TypeError(f"{name} must be ints or strings, got {key!r} ({type(key).__name__})")
    return keys


def _cut_torn_tail(path: Path) -> None:
    """Truncate ``path`` after its last newline, dropping a line a killed writer left unfinished."""
    if not path.is_file():
        return
    with path.open("rb+") as file:
        size = file.seek(0, os.SEEK_END)
        if size == 0:
            return
        file.seek(size - 1)
        if file.read(1) == b"\n":
            return
        position = size
        while position > 0:
            chunk_start = max(0, position - 65536)
            file.seek(chunk_start)
            chunk = file.read(position - chunk_start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                file.truncate(chunk_start + newline + 1)
                return
            position = chunk_start
        file.truncate(0)
