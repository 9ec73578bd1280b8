"""Which samples a torchtitan run trained, and when, and a hold on its steps: the benchmark driver's view of and
hand on plain torchtitan and torchft runs.

With ``STALWART_TORCHTITAN_AUDIT`` naming a directory, the CPU launcher
(:mod:`stalwart.testing.torchtitan_cpu`) wraps ``Trainer.batch_generator``
(every trainer that inherits it: plain torchtitan's, torchft's
``FaultTolerantTrainer``) so each process appends one line per batch it takes
to ``DIR/<label>-<pid>.jsonl``: the trainer's step, the time, and a
fingerprint of each sample (a BLAKE2 digest of its input ids);
``STALWART_TORCHTITAN_AUDIT_LABEL`` names the replica group. When
``torchtitan.train.main`` returns, the launcher appends ``{"finished": true}``.
With ``STALWART_TORCHTITAN_HOLD`` naming a file too, a process takes no batch
of a step above the number the file holds while it exists (a driver keeps a
survivor from finishing the job before a restarted group is back; the wait
is bounded by :data:`HOLD_LIMIT`).

A batch counts as trained when its process took a batch of a later step or
finished (the step in flight when a process is killed is not); a step
torchft did not commit still counts (its log says which were not). Compared
with a failure-free run over the same data, a run's samples never trained
are *lost* and the extra trainings of a sample are *trained twice*.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AUDIT_DIR_ENV = "STALWART_TORCHTITAN_AUDIT"
AUDIT_LABEL_ENV = "STALWART_TORCHTITAN_AUDIT_LABEL"
HOLD_ENV = "STALWART_TORCHTITAN_HOLD"
HOLD_LIMIT = 600.0
"""Seconds a process waits at a hold before it gives up with an error."""


@dataclass(frozen=True)
class Batch:
    """One batch a process took: its group label, pid, the trainer's step, the time and the samples' fingerprints."""

    label: str
    pid: int
    step: int
    time: float
    samples: tuple[str, ...]


@dataclass(frozen=True)
class Audit:
    """Every batch of a run's processes, and which processes finished."""

    batches: tuple[Batch, ...]
    finished: frozenset[tuple[str, int]]

    def trained(self) -> list[Batch]:
        """The batches trained: a later step of the same process followed, or the process finished."""
        last_step: dict[tuple[str, int], int] = {}
        for batch in self.batches:
            key = (batch.label, batch.pid)
            last_step[key] = max(last_step.get(key, batch.step), batch.step)
        return [
            batch
            for batch in self.batches
            if (batch.label, batch.pid) in self.finished or batch.step < last_step[(batch.label, batch.pid)]
        ]

    def sample_counts(self) -> collections.Counter[str]:
        """How many times each sample was trained."""
        return collections.Counter(sample for batch in self.trained() for sample in batch.samples)


@dataclass(frozen=True)
class DataOutcome:
    """Samples of the failure-free run this run never trained, and extra trainings of a sample."""

    lost: int
    trained_twice: int


def fingerprint(row: Any) -> str:
    """A sample's identity: a BLAKE2 digest of its input ids (a CPU tensor)."""
    return hashlib.blake2b(row.contiguous().numpy().tobytes(), digest_size=8).hexdigest()


def audit_path(directory: Path) -> Path:
    """This process's audit file in ``directory``."""
    return Path(directory) / f"{os.environ.get(AUDIT_LABEL_ENV, 'job')}-{os.getpid()}.jsonl"


def _append(directory: Path, record: dict[str, Any]) -> None:
    with open(audit_path(directory), "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def held(hold: Path, step: int) -> bool:
    """Whether the hold file ``hold`` keeps a process from taking a batch of ``step``."""
    try:
        return step > int(hold.read_text().strip() or "0")
    except (FileNotFoundError, ValueError):
        return False


def wait_at_hold(hold: Path, step: int) -> None:
    """Wait while ``hold`` keeps ``step`` back (bounded by :data:`HOLD_LIMIT`)."""
    deadline = time.monotonic() + HOLD_LIMIT
    while held(hold, step):
        if time.monotonic() > deadline:
            raise TimeoutError(f"held before step {step} by {hold} for more than {HOLD_LIMIT} s")
        time.sleep(0.05)


def install(directory: Path, hold: Path | None = None) -> None:
    """Wrap ``torchtitan.trainer.Trainer.batch_generator`` to record each batch in ``directory`` (and, with
    ``hold``, wait at the hold before taking a batch)."""
    from torchtitan.trainer import Trainer

    original = Trainer.batch_generator
    if getattr(original, "stalwart_audit", False):
        return
    Path(directory).mkdir(parents=True, exist_ok=True)

    def batch_generator(self: Any, data_iterable: Iterable[Any]) -> Iterator[Any]:
        for input_dict, labels in original(self, data_iterable):
            if hold is not None:
                wait_at_hold(hold, self.step)
            rows = input_dict["input"]
            _append(
                directory,
                {"step": self.step, "time": time.time(), "samples": [fingerprint(row) for row in rows]},
            )
            yield input_dict, labels

    batch_generator.stalwart_audit = True  # type: ignore[attr-defined]
    Trainer.batch_generator = batch_generator


def finish(directory: Path) -> None:
    """Record that this process's training ended normally."""
    _append(directory, {"finished": True})


def read_audit(directory: Path) -> Audit:
    """Every audit file of ``directory``."""
    batches, finished = [], set()
    for path in sorted(Path(directory).glob("*.jsonl")):
        label, pid = path.stem.rsplit("-", 1)
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("finished"):
                finished.add((label, int(pid)))
            else:
                batches.append(Batch(label, int(pid), record["step"], record["time"], tuple(record["samples"])))
    return Audit(tuple(batches), frozenset(finished))


def data_outcome(reference: Audit, run: Audit) -> DataOutcome:
    """``run``'s samples lost and trained twice against the failure-free ``reference``."""
    expected, seen = reference.sample_counts(), run.sample_counts()
    return DataOutcome(
        lost=sum(1 for sample in expected if sample not in seen),
        trained_twice=sum(count - 1 for count in seen.values() if count > 1),
    )
