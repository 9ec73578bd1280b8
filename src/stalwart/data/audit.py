"""Coverage audit: were an epoch's samples consumed exactly once?

``coverage`` compares index lists in memory. The rest is the on-disk form a
training run leaves behind so that the claim can be checked afterwards (``stalwart
audit DIR``): each rank appends one JSON line per consumed batch to its own
file, ``audit.json`` says what an epoch should cover, and ``audit_directory``
reads both back into an :class:`AuditReport`.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from stalwart._validate import check_int
from stalwart.data.plan import EpochPlan


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


class AuditFileError(ValueError):
    """An audit directory holds a file that cannot be read as audit records or an expected spec."""


def audit_file_name(rank: int, worker: int | None = None) -> str:
    """File name of one writer's records: ``rank-00003.jsonl``, or ``rank-00003-w01.jsonl`` for a DataLoader worker."""
    rank = check_int("rank", rank, minimum=0)
    if worker is None:
        return f"rank-{rank:05d}.jsonl"
    return f"rank-{rank:05d}-w{check_int('worker', worker, minimum=0):02d}.jsonl"


class AuditWriter:
    """Appends one JSON line per consumed batch to ``directory/rank-{rank:05d}.jsonl``.

    Each line is ``{"epoch": e, "step": s, "rank": r, "indices": [...]}`` and
    goes to the file in a single ``write`` on a descriptor opened with
    ``O_APPEND``, so a killed process leaves whole lines (at worst a torn last
    one, which the reader skips and counts) and writers sharing a file do not
    interleave. A torn tail left by an earlier, killed writer is cut off when
    the file is reopened, so that the next record starts on a line of its own.
    One process at a time should write to a given file. ``expected``, when
    given, is passed to :func:`write_expected`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rank: int,
        *,
        worker: int | None = None,
        expected: Mapping[str, Any] | None = None,
    ) -> None:
        self.rank = check_int("rank", rank, minimum=0)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if expected is not None:
            write_expected(self.directory, expected)
        self.path = self.directory / audit_file_name(self.rank, worker)
        _cut_torn_tail(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, epoch: int, step: int, indices: npt.ArrayLike) -> None:
        """Record that this rank consumed the samples ``indices`` at step ``step`` of epoch ``epoch``."""
        if self._fd is None:
            raise RuntimeError(f"AuditWriter for {self.path} is closed")
        record = {
            "epoch": check_int("epoch", epoch, minimum=0),
            "step": check_int("step", step, minimum=0),
            "rank": self.rank,
            "indices": np.asarray(indices, dtype=np.int64).reshape(-1).tolist(),
        }
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
    epoch_length)``, so a ``drop_last`` tail is not expected). Every rank may
    call this with the same spec: the file is created atomically once, an equal
    spec is accepted and a different one raises ``ValueError``.
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
        if existing != normalised:
            raise ValueError(
                f"spec {normalised} conflicts with the spec already recorded in {target}: {existing}"
            ) from None
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
class EpochAudit:
    """What the ranks consumed of one epoch.

    ``complete`` is True when the epoch's consumption reached the expected
    count or a later epoch has records; an incomplete epoch is one still in
    progress. ``rank_samples`` and ``rank_batches`` count per rank (files of
    one rank's DataLoader workers are added up).
    """

    epoch: int
    expected: int
    rank_samples: dict[int, int]
    rank_batches: dict[int, int]
    coverage: Coverage
    complete: bool

    @property
    def ok(self) -> bool:
        """Complete: exactly once. In progress: nothing consumed twice and nothing unexpected."""
        if self.complete:
            return self.coverage.exactly_once
        return not self.coverage.duplicates and not self.coverage.unexpected


@dataclass(frozen=True)
class AuditReport:
    """The audit of a directory: one :class:`EpochAudit` per epoch with records, in epoch order."""

    directory: Path
    spec: dict[str, Any]
    epochs: list[EpochAudit]
    torn_lines: int

    @property
    def ok(self) -> bool:
        """True when every complete epoch was consumed exactly once and no epoch in progress repeats a sample."""
        return all(epoch.ok for epoch in self.epochs)


def audit_directory(directory: str | os.PathLike[str]) -> AuditReport:
    """Read every ``rank-*.jsonl`` file of ``directory`` and compare each epoch with ``audit.json``.

    Raises ``FileNotFoundError`` naming ``audit.json`` when it is missing and
    :class:`AuditFileError` for a malformed line (a torn last line is skipped
    and counted in ``torn_lines`` instead).
    """
    directory = Path(directory)
    spec = read_expected(directory)
    consumed: dict[int, list[list[int]]] = defaultdict(list)
    samples: dict[int, Counter[int]] = defaultdict(Counter)
    batches: dict[int, Counter[int]] = defaultdict(Counter)
    torn_lines = 0
    for path in sorted(directory.iterdir()):
        match = _RECORD_FILE.match(path.name)
        if not match or not path.is_file():
            continue
        records, torn = _read_records(path, int(match.group(1)))
        torn_lines += torn
        for epoch, rank, indices in records:
            consumed[epoch].append(indices)
            samples[epoch][rank] += len(indices)
            batches[epoch][rank] += 1
    last_epoch = max(consumed, default=-1)
    epochs = []
    for epoch in sorted(consumed):
        expected = expected_indices(spec, epoch)
        result = coverage(consumed[epoch], expected)
        epochs.append(
            EpochAudit(
                epoch=epoch,
                expected=int(expected.size),
                rank_samples=dict(sorted(samples[epoch].items())),
                rank_batches=dict(sorted(batches[epoch].items())),
                coverage=result,
                complete=epoch < last_epoch or result.consumed >= expected.size,
            )
        )
    return AuditReport(directory=directory, spec=spec, epochs=epochs, torn_lines=torn_lines)


def _normalise_spec(name: str, spec: Any) -> dict[str, Any]:
    """Check ``spec`` and return it in the one form that is stored and compared."""
    if not isinstance(spec, Mapping) or len(spec) != 1 or not {"dataset_size", "plan"} & set(spec):
        raise ValueError(f"{name} must be {{'dataset_size': N}} or {{'plan': EpochPlan.to_dict()}}, got {spec!r}")
    if "dataset_size" in spec:
        return {"dataset_size": check_int(f"{name}['dataset_size']", spec["dataset_size"], minimum=1)}
    plan = spec["plan"]
    if not isinstance(plan, Mapping):
        raise ValueError(f"{name}['plan'] must be EpochPlan.to_dict(), got {plan!r}")
    try:
        return {"plan": EpochPlan(**plan).to_dict()}
    except TypeError as error:
        raise ValueError(f"{name}['plan'] is not an EpochPlan.to_dict(): {error}") from error


def _read_records(path: Path, rank: int) -> tuple[list[tuple[int, int, list[int]]], int]:
    """The (epoch, rank, indices) records of one file and whether its last line was torn (0 or 1)."""
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


def _parse_record(path: Path, number: int, line: str, rank: int) -> tuple[int, int, list[int]]:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise AuditFileError(f"{where}: not a JSON line ({error})") from error
    if not isinstance(record, dict) or not {"epoch", "step", "rank", "indices"} <= set(record):
        raise AuditFileError(f"{where}: a record must hold epoch, step, rank and indices, got {line[:80]!r}")
    for key in ("epoch", "step", "rank"):
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise AuditFileError(f"{where}: {key} must be an int >= 0, got {value!r}")
    if record["rank"] != rank:
        raise AuditFileError(f"{where}: rank {record['rank']} in a file of rank {rank}")
    indices = record["indices"]
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise AuditFileError(f"{where}: indices must be a list of ints")
    return record["epoch"], rank, indices


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
