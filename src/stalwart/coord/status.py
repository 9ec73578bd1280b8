"""What ``GET /v1/status`` shows of the lighthouse's state: members, quorum, ledger, checkpoint, history.

The lighthouse's status part: one JSON-able dict that the dashboard, the
metrics and ``/v1/status`` all read (``plan`` null and the ledger at zero
before a plan is adopted). Pure: no I/O; read-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stalwart.coord.hosted_ledger import HostedLedger

if TYPE_CHECKING:
    from stalwart.coord.quorum import LighthouseState


def member_state(state: LighthouseState, member: str) -> str:
    """``alive`` (in the quorum), ``joining`` (alive, not in it), ``left`` (it finished cleanly) or ``dead``."""
    record = state.membership[member]
    if not record.alive:
        return "left" if record.left else "dead"
    return "alive" if member in state.roster else "joining"


def status(state: LighthouseState, now: float | None = None) -> dict[str, Any]:
    """Everything a dashboard shows (``seconds_since_seen`` when ``now`` is given)."""
    members = []
    for name, record in state.membership.records.items():
        ask = state.asks.get(name)
        members.append(
            {
                "member": name,
                "state": member_state(state, name),
                "applied_step": record.applied_step,
                "connected": record.connected,
                "last_seen": record.last_seen,
                "seconds_since_seen": None if now is None else max(0.0, now - record.last_seen),
                "asking": None if ask is None else ask.request.reason,
                "healing": name in state.commits.healing,
            }
        )
    quorum = state.roster.quorum
    plan = state.plan
    checkpoint = state.checkpoint
    history = state.history
    return {
        "members": members,
        "quorum": None if quorum is None else {"quorum_id": quorum.quorum_id, "members": list(quorum.members)},
        "checkpoint": None
        if checkpoint is None
        else {**checkpoint.announcement(), "time": checkpoint.time, "member": checkpoint.member},
        "resumed_from_checkpoint": list(history.checkpoint_resumes),
        "min_replicas": state.min_replicas,
        "reconfigure_pending": state.reconfigure_pending,
        "ledger": ledger_status(state.commits.hosted),
        "plan": None if plan is None else plan.to_dict(),
        "counts": dict(history.counts),
        "failures": list(history.failures),
        "recoveries": list(history.recoveries),
        "departures": list(history.departures),
        "quorums": list(history.quorums),
        "cuts": state.reach.to_status(now),
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
