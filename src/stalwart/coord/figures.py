"""The figures the dashboard and ``/metrics`` show, derived from the lighthouse's status and state. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MEMBER_STATES = ("alive", "joining", "dead", "left")
"""What ``LighthouseState.member_state`` says of a member."""


def samples_committed(ledger: Mapping[str, Any]) -> int:
    """Samples in committed steps since the job began, from ``/v1/status``'s ``ledger``.

    Every earlier epoch committed its ``epoch_length`` positions; the current
    one has handed out ``base_index`` of which ``missing`` wait to be trained again.
    """
    return int(ledger["epoch"]) * int(ledger["epoch_length"]) + int(ledger["base_index"]) - int(ledger["missing"])


def member_counts(members: list[Mapping[str, Any]]) -> dict[str, int]:
    """How many members are in each state (every state of ``MEMBER_STATES`` present, 0 if none)."""
    counts = dict.fromkeys(MEMBER_STATES, 0)
    for member in members:
        counts[member["state"]] = counts.get(member["state"], 0) + 1
    return counts


def summary(status: Mapping[str, Any]) -> dict[str, Any]:
    """The headline figures of a ``/v1/status`` answer (what the dashboard's tiles show)."""
    ledger = status["ledger"]
    quorum = status["quorum"]
    counts = status["counts"]
    return {
        "members": member_counts(status["members"]),
        "quorum_id": None if quorum is None else quorum["quorum_id"],
        "quorum_size": 0 if quorum is None else len(quorum["members"]),
        "steps_committed": int(ledger["step"]),
        "epoch": int(ledger["epoch"]),
        "epoch_progress": float(ledger["epoch_progress"]),
        "samples_committed": samples_committed(ledger),
        "failures": int(counts["failures"]),
        "recoveries": int(counts["recoveries"]),
        "quorums": int(counts["quorums"]),
    }
