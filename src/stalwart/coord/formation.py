"""A quorum just formed, and its answer to each member, serialised once for all of them. Pure: no I/O.

The ledger a quorum starts from is the committed ledger at its step plus how
the step began (``begun_by``) and who failed in it since (``failed``); every
member rebuilds the ledger in the step from these (:func:`step_ledger`) and
checks it against ``digest``, the :meth:`~stalwart.data.ledger.DataLedger.binary_digest`
of the lighthouse's own replay. The answer comes in two wires
(``docs/protocol.md``):

- wire 1 (a request without ``known``): members and the ledger in the step,
  in full, as before;
- wire 2 (a request with ``known``, the quorum whose answer the member holds):
  the committed ledger and the step's events instead of the ledger in the
  step; and when ``known`` is the quorum this one formed from, the members as
  a :class:`MemberDelta` from it. Its size grows with what changed, not with
  the members.

Everything but ``rank`` and what the server adds (the quorum store's key) is the
same for every member, so each wire's shared part is serialised once per
formation and every answer is that byte string behind a small prefix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from stalwart.data.ledger import DataLedger


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def step_ledger(base: Mapping[str, Any], begun_by: Sequence[str], failed: Sequence[Sequence[str]]) -> DataLedger:
    """The ledger in its step: ``base`` (committed) begun by ``begun_by``, then each failure event in turn.

    Each event's members fail and their positions are reassigned to the
    step's members still live, in rank order (what the lighthouse's replay does).
    """
    ledger = DataLedger.from_state_dict(base)
    ledger.begin_step(list(begun_by))
    for event in failed:
        for member in event:
            ledger.member_failed(member)
        ledger.reassign(ledger.members)
    return ledger


@dataclass(frozen=True)
class MemberDelta:
    """The members of a quorum as a change from quorum ``source``'s: ``[kept of source's, in order] + added``."""

    source: int
    removed: tuple[str, ...]
    added: tuple[str, ...]
    begun_by_source: bool
    """Whether the step in progress began with ``source``'s members (then they need not be sent)."""

    @classmethod
    def between(
        cls, source: int, previous: Sequence[str], members: Sequence[str], begun_by: Sequence[str]
    ) -> MemberDelta:
        """The delta from ``previous`` (quorum ``source``'s members) to ``members``: linear in both."""
        index = {member: rank for rank, member in enumerate(previous)}
        kept, last = 0, -1
        while kept < len(members) and index.get(members[kept], -1) > last:
            last = index[members[kept]]
            kept += 1
        stays = set(members[:kept])
        removed = tuple(member for member in previous if member not in stays)
        return cls(source, removed, tuple(members[kept:]), tuple(begun_by) == tuple(previous))

    def apply(self, previous: Sequence[str]) -> tuple[str, ...]:
        """The members, from quorum ``source``'s."""
        removed = set(self.removed)
        return (*(member for member in previous if member not in removed), *self.added)

    def to_json(self) -> dict[str, Any]:
        """JSON form (also the wire's ``delta``, less ``begun_by_source``)."""
        return {
            "from": self.source,
            "removed": list(self.removed),
            "added": list(self.added),
            "begun_by_source": self.begun_by_source,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MemberDelta:
        """Inverse of ``to_json``."""
        return cls(int(data["from"]), tuple(data["removed"]), tuple(data["added"]), bool(data["begun_by_source"]))


@dataclass(frozen=True)
class Ahead:
    """What a failure quorum formed ahead of its survivors' requests presumed (``docs/protocol.md``, "Forming a
    failure quorum ahead"): the quorum its members' requests name, and the applied step of each member that had not
    asked, from its last counted report."""

    source: int
    """The quorum the survivors were in: their requests name it."""
    source_members: tuple[str, ...]
    """Its members: they began any step committed past the target (the quorum formed ahead never ran one)."""
    presumed: dict[str, int]
    """The members that had not asked, each at its last counted report's step."""

    def fits(self, member: str, applied_step: int, target: int) -> bool:
        """Whether ``member`` at ``applied_step`` is what the quorum presumed: at the target when presumed there,
        else from its presumed step up to below the target (a heal target: healed, as its request would have it)."""
        presumed = self.presumed[member]
        return applied_step == target if presumed == target else presumed <= applied_step < target

    def to_json(self) -> dict[str, Any]:
        """JSON form (persisted with the formation)."""
        return {"source": self.source, "source_members": list(self.source_members), "presumed": self.presumed}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Ahead:
        """Inverse of ``to_json``."""
        return cls(int(data["source"]), tuple(data["source_members"]), dict(data["presumed"]))


@dataclass(frozen=True)
class Formation:
    """A quorum just formed: what every member is told and why it formed."""

    quorum_id: int
    members: tuple[str, ...]
    applied_step: int
    heal: dict[str, Any] | None
    base: dict[str, Any]
    """The committed ledger at ``applied_step`` (or the last committed step before it)."""
    begun_by: tuple[str, ...]
    failed: tuple[tuple[str, ...], ...]
    digest: str
    """``DataLedger.binary_digest`` of the ledger in the step (``ledger``)."""
    reason: str
    time: float
    timed_out: bool
    rolled_back: bool
    delta: MemberDelta | None = None
    """The members as a change from the quorum this one formed from (None for the first)."""
    ahead: Ahead | None = None
    """Set when it formed ahead of its survivors' requests (what it presumed of them)."""

    @cached_property
    def ledger(self) -> dict[str, Any]:
        """The ledger in the step, as every member sees it (``DataLedger.state_dict()``)."""
        return step_ledger(self.base, self.begun_by, self.failed).state_dict()

    @cached_property
    def ranks(self) -> dict[str, int]:
        """Each member's rank."""
        return {member: rank for rank, member in enumerate(self.members)}

    def to_json(self) -> dict[str, Any]:
        """JSON form (for persistence): the ledger in its compact form only."""
        return {
            "quorum_id": self.quorum_id,
            "members": list(self.members),
            "applied_step": self.applied_step,
            "heal": self.heal,
            "base": self.base,
            "begun_by": list(self.begun_by),
            "failed": [list(event) for event in self.failed],
            "digest": self.digest,
            "reason": self.reason,
            "time": self.time,
            "timed_out": self.timed_out,
            "rolled_back": self.rolled_back,
            "delta": None if self.delta is None else self.delta.to_json(),
            "ahead": None if self.ahead is None else self.ahead.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Formation:
        """Inverse of ``to_json`` (a formation persisted with a TCPStore prefix, before the quorum store, drops it)."""
        delta, ahead = data["delta"], data.get("ahead")
        fields = {key: value for key, value in data.items() if key != "store_prefix"}
        return cls(
            **{
                **fields,
                "members": tuple(data["members"]),
                "begun_by": tuple(data["begun_by"]),
                "failed": tuple(tuple(event) for event in data["failed"]),
                "delta": None if delta is None else MemberDelta.from_json(delta),
                "ahead": None if ahead is None else Ahead.from_json(ahead),
            }
        )

    def answer(self, member: str) -> dict[str, Any]:
        """The wire-1 JSON answer for ``member`` (the server adds the store's address)."""
        return {
            "quorum_id": self.quorum_id,
            "members": list(self.members),
            "rank": self.ranks[member],
            "world_size": len(self.members),
            "applied_step": self.applied_step,
            "heal": self.heal,
            "ledger": self.ledger,
        }

    def render(self, member: str, extra: Mapping[str, Any], *, wire: int, known: int | None = None) -> bytes:
        """The JSON answer for ``member``, as bytes: ``rank`` and ``extra`` (the server's fields), then the shared part.

        Wire 2 sends the members as a delta when ``known`` is the quorum this one formed from.
        """
        if wire == 1:
            shared = self._wire1
        elif self.delta is not None and known == self.delta.source:
            shared = self._wire2_delta
        else:
            shared = self._wire2_full
        prefix = _dumps({"rank": self.ranks[member], **extra})
        return prefix[:-1] + b"," + shared[1:]

    def _common(self) -> dict[str, Any]:
        return {
            "quorum_id": self.quorum_id,
            "world_size": len(self.members),
            "applied_step": self.applied_step,
            "heal": self.heal,
        }

    @cached_property
    def _wire1(self) -> bytes:
        return _dumps({**self._common(), "members": list(self.members), "ledger": self.ledger})

    def _compact_ledger(self, begun_by: str | list[str]) -> dict[str, Any]:
        failed = [list(event) for event in self.failed]
        return {"base": self.base, "begun_by": begun_by, "failed": failed, "digest": self.digest}

    @cached_property
    def _wire2_full(self) -> bytes:
        begun_by: str | list[str] = "members" if self.begun_by == self.members else list(self.begun_by)
        return _dumps({**self._common(), "members": list(self.members), "ledger": self._compact_ledger(begun_by)})

    @cached_property
    def _wire2_delta(self) -> bytes:
        assert self.delta is not None
        if self.begun_by == self.members:
            begun_by: str | list[str] = "members"
        else:
            begun_by = "from" if self.delta.begun_by_source else list(self.begun_by)
        delta = {"from": self.delta.source, "removed": list(self.delta.removed), "added": list(self.delta.added)}
        return _dumps({**self._common(), "delta": delta, "ledger": self._compact_ledger(begun_by)})
