"""The lighthouse's state as JSON, and what changed since the last save: its persistence part. Pure: no I/O.

It reads and builds the persisted parts (:class:`Parts`, :class:`Restored`),
never the state that holds them. :func:`state_dict` is the whole state;
:func:`parse` reads one back (``LighthouseState.from_state_dict`` resumes
from it). :class:`Saver` takes what changed since the last save, each part
only when it changed (:class:`Changes`, which :mod:`stalwart.coord.persist`
writes to SQLite), so a save costs what changed, not the number of members.

Nothing marks itself as changed: every persisted part is
:class:`~stalwart.coord.tracked.Tracked` (or immutable), so its stamp moves
with every change, and the saver compares each part's stamps (and, for the
immutable ones, their identity) with those it took last, in constant time.
The members' rows, and the answered requests' rows, are the keys their maps
record as changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stalwart._validate import check_int
from stalwart.coord.checkpoints import CheckpointRecord
from stalwart.coord.commits import Commits
from stalwart.coord.formation import Formation
from stalwart.coord.history import KINDS as HISTORY_KINDS
from stalwart.coord.history import History
from stalwart.coord.hosted_ledger import HostedLedger
from stalwart.coord.identity import Identities
from stalwart.coord.membership import MemberRecord
from stalwart.coord.protocol import QuorumRequest
from stalwart.coord.roster import Quorum
from stalwart.coord.tracked import TrackedDict
from stalwart.coord.wire import parse_member, parse_step

STATE_VERSION = 3
"""Version 2 persists each formation's ledger in its compact form, version 3 with its binary digest
(``DataLedger.binary_digest``); an older state resumes without its formation (a member whose answer was lost asks
again and is told to join)."""


@dataclass(slots=True)
class Parts:
    """The lighthouse's persisted parts, as the state holds them now (built anew for every save: cheap)."""

    stamp: int
    """The state's own stamp: it moves when the state assigns a part (a quorum, its answers, a checkpoint)."""
    commits: Commits
    history: History
    identities: Identities
    members: TrackedDict[str, MemberRecord]
    quorum: Quorum | None
    formation: Formation | None
    answered: TrackedDict[str, QuorumRequest]
    checkpoint: CheckpointRecord | None


@dataclass(frozen=True)
class Changes:
    """What changed since the last save, each part only if it changed (see :mod:`stalwart.coord.persist`)."""

    revision: int
    core: dict[str, Any]
    """The small part rewritten on every change: the ledger, healing, history counts, the checkpoint."""
    formation: dict[str, Any] | None
    """The quorum and its formation; None when unchanged."""
    members: dict[str, dict[str, Any] | None]
    """One row per member whose identity changed or that appeared (None: forgotten)."""
    events: list[tuple[str, dict[str, Any]]]
    """New history events."""
    every_member: bool = False
    """``members`` holds every member's row: the rows of any other member go (the first save of a state)."""
    answered: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """One row per request the quorum answered since the last save (None: withdrawn)."""
    every_answer: bool = False
    """``answered`` holds every row of a new quorum's answers: any other row goes."""


@dataclass(frozen=True)
class Restored:
    """A ``state_dict`` read back into parts (:func:`parse`); the state puts them in place."""

    hosted: HostedLedger
    members: dict[str, int | None]
    """Every member seen, with its last applied step (None when not persisted)."""
    quorum: Quorum | None
    identities: Identities | None
    formation: Formation | None
    """None for a version 1 state: a member whose answer was lost asks again and is told to join."""
    answered: dict[str, QuorumRequest]
    healing: dict[str, bool]
    heal_step: int
    history: History
    checkpoint: CheckpointRecord | None


def revision(parts: Parts) -> int:
    """Grows with every change that must be persisted: the latest stamp of any part."""
    hosted = parts.commits.hosted
    return max(
        parts.stamp,
        parts.commits.stamp,
        0 if hosted is None else hosted.stamp,
        parts.history.stamp,
        parts.identities.stamp,
        parts.members.stamp,
    )


def state_dict(parts: Parts) -> dict[str, Any]:
    """The whole state, JSON-serialisable."""
    return {
        **core_state(parts),
        **formation_state(parts),
        "answered": {member: request.to_json() for member, request in parts.answered.items()},
        "history": parts.history.to_json(),
        "members": {name: record.applied_step for name, record in parts.members.items()},
        "identities": parts.identities.to_json(),
    }


def core_state(parts: Parts) -> dict[str, Any]:
    """The small part rewritten on every change."""
    history = parts.history.to_json()
    kept = {key: value for key, value in history.items() if key not in HISTORY_KINDS}
    hosted = parts.commits.hosted
    assert hosted is not None, "a state is saved once it has a plan"
    checkpoint = parts.checkpoint
    return {
        "version": STATE_VERSION,
        **hosted.to_json(),
        "healing": dict(parts.commits.healing),
        "heal_step": parts.commits.heal_step,
        "history": json.loads(json.dumps(kept)),  # a copy: the save thread reads it while the loop goes on
        "checkpoint": None if checkpoint is None else checkpoint.to_json(),
    }


def formation_state(parts: Parts) -> dict[str, Any]:
    """The quorum and its formation (the requests it answered are rows of their own: :class:`Changes`)."""
    quorum = parts.quorum
    return {
        "quorum": None if quorum is None else {"quorum_id": quorum.quorum_id, "members": list(quorum.members)},
        "formation": None if parts.formation is None else parts.formation.to_json(),
    }


Fingerprint = tuple[int, ...]
"""The stamps of a group of parts and the ids of the objects (the saver keeps those alive, so an id is not reused)."""


class Saver:
    """What changed since the last save, found by comparing each part's stamps with those taken last.

    Costs what changed: the core is small, the formation part is built once
    per quorum, a member's row only when it appears, registers or is
    forgotten (its applied step is not persisted: members report it again),
    and an answered request's row once (a quorum formed ahead is confirmed
    by thousands of survivors over many saves: rewriting every answer with
    each was most of a failure's save work at 4,096 members). The first save
    of a state writes every part.
    """

    def __init__(self) -> None:
        self._core: Fingerprint | None = None
        self._formation: Fingerprint | None = None
        self._rows: Fingerprint | None = None
        """The maps whose changed keys the last save took (another map: every member's row is written)."""
        self._answers: Fingerprint | None = None
        """The answered map whose changed keys the last save took (another map: every row is written)."""
        self._requeued: set[str] = set()
        self._requeued_answers: set[str] = set()
        self._taken: Parts | None = None
        """The parts the fingerprints name, kept alive so that their ids are not reused."""

    @staticmethod
    def _fingerprints(parts: Parts) -> tuple[Fingerprint, Fingerprint, Fingerprint, Fingerprint]:
        commits, hosted, history, identities = parts.commits, parts.commits.hosted, parts.history, parts.identities
        hosted_stamp = 0 if hosted is None else hosted.stamp
        objects = (commits, hosted, history, parts.checkpoint)
        core = (parts.stamp, commits.stamp, hosted_stamp, history.stamp, *map(id, objects))
        formation = (id(parts.quorum), id(parts.formation))
        rows = (id(parts.members), id(identities.current), id(identities.retired))
        return core, formation, rows, (id(parts.answered),)

    def unsaved(self, parts: Parts) -> bool:
        """Whether anything changed since the last :meth:`take` (constant time)."""
        core, formation, rows, answers = self._fingerprints(parts)
        identities = parts.identities
        return bool(
            core != self._core
            or formation != self._formation
            or rows != self._rows
            or answers != self._answers
            or self._requeued
            or self._requeued_answers
            or parts.answered.keys_changed
            or parts.members.keys_changed
            or identities.current.keys_changed
            or identities.retired.keys_changed
            or parts.history.journal
        )

    def take(self, parts: Parts) -> Changes:
        """What changed since the last call; hand it back to :meth:`requeue` if it was not saved."""
        core, formation, rows, answers = self._fingerprints(parts)
        every_member = rows != self._rows
        names = parts.members.take_keys() | parts.identities.take_changed() | self._requeued
        if every_member:
            names = set(parts.members)
        self._requeued = set()
        members = parts.members
        changed_rows = {name: parts.identities.member_json(name) if name in members else None for name in names}
        every_answer = answers != self._answers
        answered = parts.answered
        keys = answered.take_keys() | self._requeued_answers
        if every_answer:
            keys = set(answered)
        self._requeued_answers = set()
        taken = Changes(
            revision(parts),
            core_state(parts),
            None if formation == self._formation else formation_state(parts),
            changed_rows,
            parts.history.drain(),
            every_member,
            {key: answered[key].to_json() if key in answered else None for key in keys},
            every_answer,
        )
        self._core, self._formation, self._rows, self._answers = core, formation, rows, answers
        self._taken = parts
        return taken

    def requeue(self, parts: Parts, taken: Changes) -> None:
        """``taken`` could not be saved: the next :meth:`take` includes it again."""
        self._core = None
        if taken.formation is not None:
            self._formation = None
        if taken.every_member:
            self._rows = None
        if taken.every_answer:
            self._answers = None
        self._requeued.update(taken.members)
        self._requeued_answers.update(taken.answered)
        parts.history.journal[:0] = taken.events


def parse(saved: Mapping[str, Any]) -> Restored:
    """Read the parts of ``saved`` (a ``state_dict``); ``ValueError`` for one of another version."""
    if not isinstance(saved, Mapping) or saved.get("version") not in (1, 2, STATE_VERSION):
        raise ValueError(f"state must be a lighthouse state_dict of version {STATE_VERSION}")
    members = {}
    for name, applied_step in saved["members"].items():
        step = None if applied_step is None else parse_step(applied_step, f"state['members'][{name!r}]")
        members[parse_member(name, "state['members']")] = step
    quorum = None
    if saved["quorum"] is not None:
        quorum_members = tuple(parse_member(m, "state['quorum']['members']") for m in saved["quorum"]["members"])
        quorum = Quorum(check_int("state['quorum']['quorum_id']", saved["quorum"]["quorum_id"]), quorum_members)
    formation, answered = None, {}
    if saved["formation"] is not None and saved["version"] == STATE_VERSION:
        formation = Formation.from_json(saved["formation"])
        answered = {member: QuorumRequest(**request) for member, request in saved["answered"].items()}
    identities = saved.get("identities")
    checkpoint = saved.get("checkpoint")
    return Restored(
        HostedLedger.from_json(saved),
        members,
        quorum,
        None if identities is None else Identities.from_json(identities),
        formation,
        answered,
        {name: bool(ahead) for name, ahead in saved["healing"].items()},
        check_int("state['heal_step']", saved["heal_step"], minimum=0),
        History.from_json(saved["history"]),
        None if checkpoint is None else CheckpointRecord.from_json(checkpoint),
    )
