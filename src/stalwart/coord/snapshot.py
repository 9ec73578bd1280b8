"""The lighthouse's state as JSON, and what changed since the last save: its persistence part. Pure: no I/O.

``state_dict`` is the whole state (``LighthouseState.from_state_dict`` resumes
it, see :func:`restore`); :func:`changes` is what changed since the last
save, each part only when it changed (:class:`Changes`, which
:mod:`stalwart.coord.persist` writes to SQLite), so a save costs what
changed, not the number of members. :class:`Dirty` is what the state marks
as it changes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stalwart._validate import check_int
from stalwart.coord.checkpoints import CheckpointRecord
from stalwart.coord.formation import Formation
from stalwart.coord.history import KINDS as HISTORY_KINDS
from stalwart.coord.history import History
from stalwart.coord.hosted_ledger import HostedLedger
from stalwart.coord.identity import Identities
from stalwart.coord.protocol import QuorumRequest
from stalwart.coord.roster import Quorum, Roster
from stalwart.coord.wire import parse_member, parse_step

if TYPE_CHECKING:
    from stalwart.coord.quorum import LighthouseState

STATE_VERSION = 2
"""Version 2 persists each formation's ledger in its compact form; a version 1 state resumes without its formation."""


@dataclass
class Dirty:
    """What changed since the last save: the revision, the formation part, the members whose row changed."""

    revision: int = 0
    """Grows with every change that must be persisted (quorums, history, registrations; commits count apart)."""
    formation: bool = False
    members: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Changes:
    """What changed since the last save, each part only if it changed (see :mod:`stalwart.coord.persist`)."""

    revision: int
    core: dict[str, Any]
    """The small part rewritten on every change: the ledger, healing, history counts, the checkpoint."""
    formation: dict[str, Any] | None
    """The quorum, its formation and the requests it answered; None when unchanged."""
    members: dict[str, dict[str, Any] | None]
    """One row per member whose identity changed or that appeared (None: forgotten)."""
    events: list[tuple[str, dict[str, Any]]]
    """New history events."""


def state_dict(state: LighthouseState) -> dict[str, Any]:
    """The whole state, JSON-serialisable."""
    return {
        **core_state(state),
        **formation_state(state),
        "history": state.history.to_json(),
        "members": {name: record.applied_step for name, record in state.membership.records.items()},
        "identities": state.registry.identities.to_json(),
    }


def core_state(state: LighthouseState) -> dict[str, Any]:
    """The small part rewritten on every change."""
    history = state.history.to_json()
    kept = {key: value for key, value in history.items() if key not in HISTORY_KINDS}
    hosted = state.commits.hosted
    assert hosted is not None, "a state is saved once it has a plan"
    checkpoint = state.checkpoint
    return {
        "version": STATE_VERSION,
        **hosted.to_json(),
        "healing": dict(state.commits.healing),
        "heal_step": state.commits.heal_step,
        "history": json.loads(json.dumps(kept)),  # a copy: the save thread reads it while the loop goes on
        "checkpoint": None if checkpoint is None else checkpoint.to_json(),
    }


def formation_state(state: LighthouseState) -> dict[str, Any]:
    """The quorum, its formation and the requests it answered."""
    quorum = state.roster.quorum
    return {
        "quorum": None if quorum is None else {"quorum_id": quorum.quorum_id, "members": list(quorum.members)},
        "formation": None if state.formation is None else state.formation.to_json(),
        "answered": {member: request.to_json() for member, request in state.answered.items()},
    }


def changes(state: LighthouseState) -> Changes:
    """What changed since the last call; hand it back to :func:`requeue` if it was not saved.

    Costs what changed: the core is small, the formation part is built once
    per quorum, and a member's row only when it appears, registers or is
    forgotten (its applied step is not persisted: members report it again).
    """
    dirty = state.dirty
    rows: dict[str, dict[str, Any] | None] = {}
    for name in dirty.members:
        rows[name] = state.registry.identities.member_json(name) if name in state.membership else None
    taken = Changes(
        state.revision,
        core_state(state),
        formation_state(state) if dirty.formation else None,
        rows,
        state.history.drain(),
    )
    dirty.formation = False
    dirty.members = set()
    return taken


def requeue(state: LighthouseState, taken: Changes) -> None:
    """``taken`` could not be saved: the next :func:`changes` includes it again."""
    state.dirty.formation = state.dirty.formation or taken.formation is not None
    state.dirty.members.update(taken.members)
    state.history.journal[:0] = taken.events


def restore(restored: LighthouseState, saved: Mapping[str, Any], now: float) -> None:
    """Fill a new ``restored`` state (built with ``saved``'s plan) from ``saved`` (a ``state_dict``).

    The quorum's members count as alive (seen at ``now``), but those that
    left cleanly (the job ended) stay gone; others are dead. A
    version 1 state resumes without its last formation: a member whose answer
    was lost asks again and is told to join.
    """
    restored.commits.hosted = HostedLedger.from_json(saved)
    for name, applied_step in saved["members"].items():
        step = None if applied_step is None else parse_step(applied_step, f"state['members'][{name!r}]")
        restored.membership.restore(parse_member(name, "state['members']"), step, now)
    if saved["quorum"] is not None:
        members = tuple(parse_member(m, "state['quorum']['members']") for m in saved["quorum"]["members"])
        quorum_id = check_int("state['quorum']['quorum_id']", saved["quorum"]["quorum_id"])
        restored.roster = Roster(Quorum(quorum_id, members), dead=members)
    if saved.get("identities") is not None:
        restored.registry.identities = Identities.from_json(saved["identities"])
    restored.expect_quorum(now)
    if saved["formation"] is not None and saved["version"] == STATE_VERSION:
        restored.formation = Formation.from_json(saved["formation"])
        restored.answered = {member: QuorumRequest(**request) for member, request in saved["answered"].items()}
    restored.commits.healing = {name: bool(ahead) for name, ahead in saved["healing"].items()}
    restored.commits.heal_step = check_int("state['heal_step']", saved["heal_step"], minimum=0)
    restored.history = History.from_json(saved["history"])
    if saved.get("checkpoint") is not None:
        restored.checkpoint = CheckpointRecord.from_json(saved["checkpoint"])
    restored.dirty.formation = True  # the first save writes every part (a version 1 state had one row)
    restored.dirty.members = set(restored.membership.records)
