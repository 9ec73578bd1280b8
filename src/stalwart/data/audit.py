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
may record the dataset's shards (:class:`~stalwart.data.shard_identity.ShardIdentity`):
a writer whose shards differ is refused at once, naming the first one.

A Manager given ``Checks(audit_dir=DIR)`` writes *step records* instead
(:class:`StepAuditWriter`, ``steps-MEMBER.jsonl``): each member records every
committed step whole, so the records of one step from several members are one
consumption (consumer ``quorum``) when they agree and a
:class:`StepDisagreement` when they do not.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from stalwart._validate import check_int
from stalwart.data.plan import EpochPlan
from stalwart.data.shard_identity import ShardIdentity, shard_difference
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
QUORUM = "quorum"
"""The consumer of a committed step's records (:class:`StepAuditWriter`): the quorum that trained it."""
_RECORD_FILE = re.compile(r"^rank-(\d{5,})(?:-w(\d+))?\.jsonl$")
_STEP_FILE = re.compile(r"^steps-(.+)\.jsonl$")
_SPEC_OPTIONS = ("shards", "key")


class AuditFileError(StalwartError, ValueError):
    """An audit directory holds a file that cannot be read as audit records or an expected spec."""


def audit_file_name(rank: int, worker: int | None = None) -> str:
    """File name of one writer's records: ``rank-00003.jsonl``, or ``rank-00003-w01.jsonl`` for a DataLoader worker."""
    rank = check_int("rank", rank, minimum=0)
    if worker is None:
        return f"rank-{rank:05d}.jsonl"
    return f"rank-{rank:05d}-w{check_int('worker', worker, minimum=0):02d}.jsonl"


def step_file_name(member: str) -> str:
    """File name of one member's step records: ``steps-MEMBER.jsonl``."""
    if not isinstance(member, str) or not member or "/" in member or "\0" in member:
        raise ValueError(f"member must be a non-empty name without '/' (it names a file), got {member!r}")
    return f"steps-{member}.jsonl"


class Consumer(NamedTuple):
    """Who consumed a batch: a rank, and the world size it ran in (None when the record does not say).

    ``rank`` is :data:`QUORUM` for committed steps' records, which no one rank consumed.
    """

    rank: int | str
    world_size: int | None

    def __str__(self) -> str:
        return str(self.rank) if self.world_size is None else f"{self.rank} of {self.world_size}"


class _LineWriter:
    """Appends JSON lines to ``path``, each in one ``write`` to an ``O_APPEND`` descriptor.

    A killed writer leaves whole lines, at worst a torn last one, which is
    cut off when the file is reopened so that the next line starts on its own.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        _cut_torn_tail(path)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _append(self, record: Mapping[str, Any]) -> None:
        if self._fd is None:
            raise RuntimeError(f"{type(self).__name__} for {self.path} is closed")
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        written = 0
        while written < len(data):
            written += os.write(self._fd, data[written:])

    def close(self) -> None:
        """Close the file; further writes raise."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self: _Writer) -> _Writer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_Writer = TypeVar("_Writer", bound=_LineWriter)


class AuditWriter(_LineWriter):
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
        super().__init__(self.directory / audit_file_name(self.rank, worker))

    def write(self, epoch: int, step: int, indices: npt.ArrayLike, *, keys: Sequence[Any] | None = None) -> None:
        """Record that this rank consumed the samples ``indices`` (rows with ``keys``) at step ``step`` of ``epoch``."""
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
        self._append(record)


class StepAuditWriter(_LineWriter):
    """Appends one JSON line per committed step to ``directory/steps-{member}.jsonl``: the whole step's samples.

    Each line is ``{"epoch": e, "step": s, "member": m, "indices": [...]}``
    with the sorted indices of every sample the quorum trained at step ``s``
    (not only this member's share). Every member records the same step, so a
    member that dies after a step committed loses nothing of the record; the
    reader counts one step's agreeing lines once. The first record writes the
    plan to ``audit.json`` (:func:`write_expected`; the plan is known once the
    lighthouse gave it). Lines are appended as :class:`AuditWriter`'s are.
    """

    def __init__(self, directory: str | os.PathLike[str], member: str) -> None:
        self.member = member
        self.directory = Path(directory)
        name = step_file_name(member)
        self.directory.mkdir(parents=True, exist_ok=True)
        super().__init__(self.directory / name)
        self._plan: EpochPlan | None = None

    def write(self, plan: EpochPlan, epoch: int, step: int, positions: npt.ArrayLike) -> None:
        """Record that the quorum trained the samples at ``positions`` of ``plan``'s epoch ``epoch`` at ``step``."""
        if plan != self._plan:
            write_expected(self.directory, {"plan": plan.to_dict()})
            self._plan = plan
        indices = np.sort(plan.indices_at(epoch, np.asarray(positions, dtype=np.int64).reshape(-1)))
        record = {"epoch": epoch, "step": check_int("step", step, minimum=0), "member": self.member}
        self._append({**record, "indices": indices.tolist()})


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
class StepDisagreement:
    """Members whose records of one committed step name different samples: ``versions`` groups who agrees."""

    epoch: int
    step: int
    versions: list[tuple[str, ...]]

    def describe(self) -> str:
        """``epoch 0 step 3: members a, b | c recorded different samples`` (``|`` between disagreeing groups)."""
        groups = " | ".join(", ".join(members) for members in self.versions)
        return f"epoch {self.epoch} step {self.step}: members {groups} recorded different samples"


@dataclass(frozen=True)
class AuditReport:
    """The audit of a directory: one :class:`EpochAudit` per epoch with records, in epoch order.

    ``conflicts`` lists the indices delivered with different keys anywhere in
    the directory (other epochs, other ranks, other world sizes);
    ``disagreements`` the committed steps whose members' records differ.
    """

    directory: Path
    spec: dict[str, Any]
    epochs: list[EpochAudit]
    torn_lines: int
    conflicts: list[KeyConflict]
    disagreements: list[StepDisagreement] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """True when the directory holds no records: nothing was consumed through an audited loop."""
        return not self.epochs

    @property
    def ok(self) -> bool:
        """True when there are records, every complete epoch was consumed exactly once (by index and key), no
        epoch in progress repeats a sample, no index was delivered as two different rows and the members'
        records of each committed step agree."""
        return (
            not self.empty and not self.conflicts and not self.disagreements and all(epoch.ok for epoch in self.epochs)
        )


@dataclass
class _Record:
    epoch: int
    step: int
    consumer: Consumer
    indices: list[int]
    keys: list[Any] | None


def audit_directory(directory: str | os.PathLike[str]) -> AuditReport:
    """Read every ``rank-*.jsonl`` and ``steps-*.jsonl`` file of ``directory`` and compare each epoch with
    ``audit.json``.

    One committed step's records from several members count once when they
    agree, and are a :class:`StepDisagreement` when they do not. Raises
    ``FileNotFoundError`` naming ``audit.json`` when it is missing and
    :class:`AuditFileError` for a malformed line (a torn last line is skipped
    and counted in ``torn_lines`` instead).
    """
    directory = Path(directory)
    spec = read_expected(directory)
    by_epoch: dict[int, list[_Record]] = defaultdict(list)
    by_step: dict[tuple[int, int], list[_Record]] = defaultdict(list)
    torn_lines = 0
    for path in sorted(directory.iterdir()):
        rank_match, step_match = _RECORD_FILE.match(path.name), _STEP_FILE.match(path.name)
        if not (rank_match or step_match) or not path.is_file():
            continue
        if rank_match:
            records, torn = _read_records(path, partial(_parse_record, rank=int(rank_match.group(1))))
        else:
            assert step_match is not None
            records, torn = _read_records(path, partial(_parse_step_record, member=step_match.group(1)))
        torn_lines += torn
        for record in records:
            if rank_match:
                by_epoch[record.epoch].append(record)
            else:
                by_step[record.epoch, record.step].append(record)
    disagreements = []
    for (epoch, step), records in sorted(by_step.items()):
        merged, disagreement = _merge_step(epoch, step, records)
        by_epoch[epoch].append(merged)
        if disagreement is not None:
            disagreements.append(disagreement)
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
    return AuditReport(directory, spec, epochs, torn_lines, _conflicts(every), disagreements)


def _merge_step(epoch: int, step: int, records: list[_Record]) -> tuple[_Record, StepDisagreement | None]:
    """One committed step's records as one consumption by the quorum, and who disagrees if they differ.

    A disagreeing step counts the samples most members recorded (the first member's on a tie).
    """
    versions: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for record in records:
        versions[tuple(record.indices)].append(str(record.consumer.rank))
    ranked = sorted(versions.items(), key=lambda version: (-len(version[1]), min(version[1])))
    merged = _Record(epoch, step, Consumer(QUORUM, None), list(ranked[0][0]), None)
    if len(ranked) == 1:
        return merged, None
    return merged, StepDisagreement(epoch, step, [tuple(sorted(members)) for _, members in ranked])


def _consumer_order(item: tuple[Consumer, int]) -> tuple[bool, int, str | int]:
    consumer = item[0]
    return (isinstance(consumer.rank, str), -1 if consumer.world_size is None else consumer.world_size, consumer.rank)


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


def _read_records(path: Path, parse: Callable[[str, str], _Record]) -> tuple[list[_Record], int]:
    """The records of one file (``parse(where, line)`` each) and whether its last line was torn (0 or 1)."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    tail = lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            records.append(parse(f"{path}:{number}", line))
    if not tail:
        return records, 0
    try:
        records.append(parse(f"{path}:{len(lines) + 1}", tail))
    except AuditFileError:
        return records, 1
    return records, 0


def _load_record(where: str, line: str, fields: tuple[str, ...], numbers: tuple[str, ...]) -> dict[str, Any]:
    """One line's JSON object holding ``fields``, its ``numbers`` ints >= 0 and its indices a list of ints."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise AuditFileError(f"{where}: not a JSON line ({error})") from error
    if not isinstance(record, dict) or not set(fields) <= set(record):
        raise AuditFileError(f"{where}: a record must hold {', '.join(fields)}, got {line[:80]!r}")
    for key in numbers:
        value = record.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise AuditFileError(f"{where}: {key} must be an int >= 0, got {value!r}")
    indices = record["indices"]
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise AuditFileError(f"{where}: indices must be a list of ints")
    return record


def _parse_step_record(where: str, line: str, member: str) -> _Record:
    record = _load_record(where, line, ("epoch", "step", "member", "indices"), ("epoch", "step"))
    if record["member"] != member:
        raise AuditFileError(f"{where}: member {record['member']!r} in a file of member {member!r}")
    return _Record(record["epoch"], record["step"], Consumer(member, None), sorted(record["indices"]), None)


def _parse_record(where: str, line: str, rank: int) -> _Record:
    record = _load_record(where, line, ("epoch", "step", "rank", "indices"), ("epoch", "step", "rank", "world_size"))
    if record["rank"] != rank:
        raise AuditFileError(f"{where}: rank {record['rank']} in a file of rank {rank}")
    world_size = record.get("world_size")
    if world_size is not None and world_size <= rank:
        raise AuditFileError(f"{where}: rank {rank} cannot run in a world of {world_size}")
    indices = record["indices"]
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
