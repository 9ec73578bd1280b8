"""The lighthouse's history: failures, departures, quorums, recoveries and checkpoint resumes, each capped at
``HISTORY_LIMIT``.

Pure: no I/O. A persisted part (:mod:`~stalwart.coord.tracked`): the counts
and the failures awaiting a recovery stamp it as they change; every appended
event is also queued in :attr:`History.journal` (``(kind, event)``) until the
persistence layer drains it, so that a save inserts only the new rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from stalwart.coord.tracked import Tracked

HISTORY_LIMIT = 1000
KINDS = ("failures", "departures", "quorums", "recoveries", "checkpoint_resumes")


class History(Tracked):
    """The capped event lists, their all-time counts, and the failures not yet followed by a quorum."""

    UNTRACKED = frozenset({*KINDS, "journal", "listener"})
    """The event lists are saved through the journal, row by row."""

    def __init__(self) -> None:
        self.failures: list[dict[str, Any]] = []
        self.departures: list[dict[str, Any]] = []
        self.quorums: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.checkpoint_resumes: list[dict[str, Any]] = []
        self.unrecovered: tuple[dict[str, Any], ...] = ()
        self.counts = {
            "failures": 0,
            "recoveries": 0,
            "quorums": 0,
            "departures": 0,
            "rollbacks": 0,
            "checkpoints": 0,
            "checkpoint_resumes": 0,
        }
        self.journal: list[tuple[str, dict[str, Any]]] = []
        """``(kind, event)`` appended since the last :meth:`drain`."""
        self.listener: Callable[[str, dict[str, Any]], None] | None = None
        """Called with ``(kind, event)`` for every event appended (the lighthouse's metrics)."""

    def _append(self, kind: str, event: dict[str, Any]) -> None:
        events: list[dict[str, Any]] = getattr(self, kind)
        events.append(event)
        del events[:-HISTORY_LIMIT]
        self.counts[kind] += 1
        self.journal.append((kind, event))
        if self.listener is not None:
            self.listener(kind, event)

    def failure(self, member: str, now: float, reason: str, *, in_quorum: bool) -> None:
        """Record that ``member`` failed (``reason``); a quorum member's failure awaits a recovery."""
        event = {"member": member, "time": now, "reason": reason, "in_quorum": in_quorum}
        self._append("failures", event)
        if in_quorum:
            self.unrecovered = (*self.unrecovered, event)

    def departure(self, member: str, now: float, *, in_quorum: bool) -> None:
        """Record a clean ``leave``."""
        self._append("departures", {"member": member, "time": now, "in_quorum": in_quorum})

    def rollback(self) -> None:
        """Count a ledger rollback."""
        self.counts["rollbacks"] += 1

    def checkpoint(self) -> None:
        """Count a newer checkpoint the lighthouse now vouches for."""
        self.counts["checkpoints"] += 1

    def checkpoint_resume(self, quorum_id: int, from_step: int, to_step: int, path: str, now: float) -> None:
        """Record that quorum ``quorum_id`` rolled the ledger back from ``from_step`` to the checkpoint at ``path``."""
        event = {"quorum_id": quorum_id, "from_step": from_step, "to_step": to_step, "path": path, "time": now}
        self._append("checkpoint_resumes", event)

    def quorum(
        self,
        quorum_id: int,
        members: list[str],
        reason: str,
        now: float,
        applied_step: int,
        *,
        timed_out: bool,
        unreachable: list[str] | None = None,
        ahead: bool = False,
    ) -> None:
        """Record a formed quorum; it is the recovery of every failure since the last one.

        ``unreachable``: the live members it left out because they are cut off from it (no failure of theirs);
        ``ahead``: it formed ahead of its survivors' requests.
        """
        for event in self.unrecovered:
            recovery = {"member": event["member"], "failed_at": event["time"], "recovered_at": now}
            self._append("recoveries", {**recovery, "quorum_id": quorum_id, "seconds": now - event["time"]})
        self.unrecovered = ()
        entry = {"quorum_id": quorum_id, "members": list(members), "reason": reason, "time": now}
        if unreachable:
            entry["unreachable"] = list(unreachable)
        if ahead:
            entry["ahead"] = True
        self._append("quorums", {**entry, "applied_step": applied_step, "timed_out": timed_out})

    def drain(self) -> list[tuple[str, dict[str, Any]]]:
        """The events appended since the last call, oldest first (the journal is emptied)."""
        journal, self.journal = self.journal, []
        return journal

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "failures": self.failures,
            "departures": self.departures,
            "quorums": self.quorums,
            "recoveries": self.recoveries,
            "checkpoint_resumes": self.checkpoint_resumes,
            "unrecovered": list(self.unrecovered),
            "counts": self.counts,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> History:
        """Inverse of ``to_json`` (the journal starts empty: these events are already persisted)."""
        history = cls()
        for kind in KINDS:
            setattr(history, kind, list(data[kind])[-HISTORY_LIMIT:])
        history.unrecovered = tuple(data["unrecovered"])
        history.counts.update(data["counts"])
        return history
