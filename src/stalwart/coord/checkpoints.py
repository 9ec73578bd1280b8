"""The checkpoint of record: the newest durable checkpoint a member reported, checked against the ledger.

A member that finished writing a checkpoint reports ``{step, path, ledger,
digest}`` (``POST /v1/checkpoint``). The lighthouse keeps the newest one whose
ledger it can vouch for: the ledger state must be the one the lighthouse
committed at that step (same digest as its own, kept for the last
``DIGEST_HISTORY`` commits), so a report cannot rewind the job to a state that
never was. When no live member holds the job's state any more (the whole
fleet restarted, or the lighthouse is ahead of every member), the next quorum
rolls the ledger back to this checkpoint and tells its members to load it:
every sample after the checkpoint is trained again, once, in the model.

Pure: no I/O; the path is only a name the members resolve on their own
(shared) file system.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.coord.hosted_ledger import DIGEST_HISTORY, ledger_digest
from stalwart.coord.wire import RequestError, parse_member, parse_step
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan

MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class CheckpointRecord:
    """A durable checkpoint at ``step`` (the ledger as committed there), written under ``path``."""

    step: int
    path: str
    ledger: dict[str, Any]
    digest: str
    member: str
    time: float

    def to_json(self) -> dict[str, Any]:
        """JSON form (persisted with the lighthouse's state)."""
        return {
            "step": self.step,
            "path": self.path,
            "ledger": self.ledger,
            "digest": self.digest,
            "member": self.member,
            "time": self.time,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointRecord:
        """Inverse of ``to_json``."""
        return cls(
            int(data["step"]), str(data["path"]), dict(data["ledger"]), str(data["digest"]), str(data["member"]),
            float(data["time"]),
        )  # fmt: skip

    def announcement(self) -> dict[str, Any]:
        """What a quorum answer tells its members to load."""
        return {"step": self.step, "path": self.path, "digest": self.digest}


def parse_checkpoint_report(body: Any, plan: EpochPlan, now: float) -> CheckpointRecord:
    """Validate a ``POST /v1/checkpoint`` body; ``RequestError`` 400 names the bad field and value."""
    if not isinstance(body, Mapping):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    expected = {"member", "step", "path", "ledger", "digest"}
    unknown = sorted(set(body) - expected)
    if unknown:
        raise RequestError(400, f"unknown fields {unknown}", field=unknown[0])
    missing = sorted(expected - set(body))
    if missing:
        raise RequestError(400, f"{missing[0]} is required", field=missing[0])
    member = parse_member(body["member"])
    step = parse_step(body["step"], "step")
    path = body["path"]
    if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH_CHARS:
        raise RequestError(
            400, f"path must be a string of 1-{MAX_PATH_CHARS} characters, got {path!r:.80}", field="path"
        )
    digest = body["digest"]
    if not isinstance(digest, str):
        raise RequestError(400, f"digest must be a string, got {digest!r:.80}", field="digest")
    state = body["ledger"]
    try:
        ledger = DataLedger.from_state_dict(state)
    except Exception as error:  # any malformed state: the message says why
        raise RequestError(400, f"ledger is not a ledger state_dict: {error}", field="ledger") from None
    if ledger.plan != plan:
        raise RequestError(422, "ledger's plan differs from the lighthouse's plan", field="ledger")
    if ledger.step != step or ledger.in_step:
        raise RequestError(422, f"ledger must be committed through step {step}, got step {ledger.step}", field="ledger")
    if ledger_digest(state) != digest:
        raise RequestError(422, "digest does not match the ledger", field="digest")
    return CheckpointRecord(step, path, ledger.state_dict(), digest, member, now)


def vouch(record: CheckpointRecord, committed_step: int, digests: Mapping[int, str]) -> None:
    """Refuse a checkpoint whose ledger is not the one committed at its step (409 when not committed yet)."""
    if record.step > committed_step:
        raise RequestError(
            409,
            f"step {record.step} is not committed yet (the ledger is at step {committed_step}): report it again later",
            field="step",
        )
    known = digests.get(record.step)
    if known is None:
        raise RequestError(
            422,
            f"step {record.step} is older than the {DIGEST_HISTORY} commits the lighthouse vouches for",
            field="step",
        )
    if known != record.digest:
        raise RequestError(422, f"the ledger reported for step {record.step} is not the one committed", field="digest")
