"""What ``GET /v1/status`` shows of the lighthouse's state: members, quorum, ledger, checkpoint, history.

The lighthouse's status part: one JSON-able dict that the dashboard, the
metrics and ``/v1/status`` all read (``plan`` null and the ledger at zero
before a plan is adopted). Pure: no I/O; read-only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.coord.checkpoints import CheckpointRecord
from stalwart.coord.history import History
from stalwart.coord.hosted_ledger import HostedLedger
from stalwart.coord.membership import MemberRecord, Membership
from stalwart.coord.pending import Pending
from stalwart.coord.reachability import Reachability
from stalwart.coord.roster import Roster
from stalwart.data.plan import EpochPlan


@dataclass(frozen=True)
class StatusParts:
    """What the status reads of the lighthouse's state (built by ``LighthouseState.to_status``)."""

    membership: Membership
    roster: Roster
    asks: Pending
    healing: Mapping[str, bool]
    hosted: HostedLedger | None
    plan: EpochPlan | None
    checkpoint: CheckpointRecord | None
    history: History
    reach: Reachability
    min_replicas: int
    reconfigure_pending: bool


def member_state(record: MemberRecord, in_quorum: bool) -> str:
    """``alive`` (in the quorum), ``joining`` (alive, not in it), ``left`` (it finished cleanly) or ``dead``."""
    if not record.alive:
        return "left" if record.left else "dead"
    return "alive" if in_quorum else "joining"


def status(parts: StatusParts, now: float | None = None) -> dict[str, Any]:
    """Everything a dashboard shows (``seconds_since_seen`` when ``now`` is given)."""
    members = []
    roster = parts.roster
    for name, record in parts.membership.records.items():
        ask = parts.asks.get(name)
        members.append(
            {
                "member": name,
                "state": member_state(record, name in roster),
                "applied_step": record.applied_step,
                "connected": record.connected,
                "last_seen": record.last_seen,
                "seconds_since_seen": None if now is None else max(0.0, now - record.last_seen),
                "asking": None if ask is None else ask.request.reason,
                "healing": name in parts.healing,
            }
        )
    quorum = roster.quorum
    plan = parts.plan
    checkpoint = parts.checkpoint
    history = parts.history
    return {
        "members": members,
        "quorum": None if quorum is None else {"quorum_id": quorum.quorum_id, "members": list(quorum.members)},
        "checkpoint": None
        if checkpoint is None
        else {**checkpoint.announcement(), "time": checkpoint.time, "member": checkpoint.member},
        "resumed_from_checkpoint": list(history.checkpoint_resumes),
        "min_replicas": parts.min_replicas,
        "reconfigure_pending": parts.reconfigure_pending,
        "ledger": ledger_status(parts.hosted),
        "plan": None if plan is None else plan.to_dict(),
        "counts": dict(history.counts),
        "failures": list(history.failures),
        "recoveries": list(history.recoveries),
        "departures": list(history.departures),
        "quorums": list(history.quorums),
        "cuts": parts.reach.to_status(now),
    }


def ledger_status(hosted: HostedLedger | None) -> dict[str, Any]:
    """The ledger of record's progress (zeros before a plan is adopted)."""
    if hosted is None:
        zero = {"step": 0, "epoch": 0, "epoch_step": 0, "base_index": 0, "missing": 0, "epoch_length": 0}
        return {**zero, "epoch_progress": 0.0, "step_in_progress": False, "balance": None}
    ledger = hosted.ledger
    missing = int(ledger.missing_indices.size)
    length = ledger.plan.epoch_length
    return {
        "step": ledger.step,
        "epoch": ledger.epoch,
        "epoch_step": ledger.epoch_step,
        "base_index": ledger.base_index,
        "missing": missing,
        "epoch_length": length,
        "epoch_progress": 1.0 if ledger.epoch_complete else (ledger.base_index - missing) / length,
        "step_in_progress": hosted.record is not None,
        "balance": None
        if not ledger.balanced
        else {"every": ledger.balance_every, "step": ledger.weights_step, "weights": ledger.weights},
    }
