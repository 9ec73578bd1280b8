"""Who the lighthouse has seen and whether each is alive. Pure: no I/O; time is passed as ``now``.

A member is alive while it sent something (a heartbeat or a request) within
``heartbeat_timeout`` and its socket did not close; a later heartbeat revives
it. Dead members outside the quorum are forgotten beyond ``HISTORY_LIMIT``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

from stalwart.coord.history import HISTORY_LIMIT


@dataclass
class MemberRecord:
    """What the lighthouse knows of one member."""

    name: str
    alive: bool = True
    connected: bool = False
    last_seen: float = 0.0
    applied_step: int | None = None
    left: bool = False
    """True once it left cleanly (``/v1/leave``) and until it is seen again."""
    waited_since: float | None = None
    """Since when live peers of its quorum are ahead of it (they wait on it); None while they are not."""

    def report(self, applied_step: int) -> None:
        """Record a reported ``applied_step``; progress ends any wait on this member."""
        if applied_step != self.applied_step:
            self.waited_since = None
        self.applied_step = applied_step


class Membership:
    """The :class:`MemberRecord` of every member seen, by id."""

    def __init__(self, heartbeat_timeout: float) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.records: dict[str, MemberRecord] = {}

    def __contains__(self, member: object) -> bool:
        return member in self.records

    def __getitem__(self, member: str) -> MemberRecord:
        return self.records[member]

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def get(self, member: str) -> MemberRecord | None:
        """The record of ``member``, or None if it was never seen (or forgotten)."""
        return self.records.get(member)

    def touch(self, member: str, now: float) -> MemberRecord:
        """``member`` said something at ``now``: it is alive (created if new)."""
        record = self.records.get(member)
        if record is None:
            record = self.records[member] = MemberRecord(member, last_seen=now)
        record.last_seen = max(record.last_seen, now)
        record.alive = True
        record.left = False
        return record

    def expect(self, member: str, now: float) -> None:
        """Count ``member`` alive as of ``now`` (a restarted lighthouse gives it a heartbeat timeout to reconnect)."""
        record = self.records.setdefault(member, MemberRecord(member))
        record.alive = True
        record.left = False
        record.last_seen = now

    def expired(self, now: float) -> list[str]:
        """Live members silent for more than ``heartbeat_timeout`` at ``now``."""
        timeout = self.heartbeat_timeout
        return [name for name, record in self.records.items() if record.alive and now - record.last_seen > timeout]

    def mark_dead(self, member: str) -> None:
        """``member`` is dead (until it speaks again)."""
        self.records[member].alive = False

    def alive(self, member: str) -> bool:
        """Whether ``member`` is known and alive."""
        record = self.records.get(member)
        return record is not None and record.alive

    def forget_dead(self, keep: Collection[str]) -> list[str]:
        """Forget all but the ``HISTORY_LIMIT`` latest-seen dead members not in ``keep``; returns the forgotten."""
        dead = [r for r in self.records.values() if not r.alive and r.name not in keep]
        if len(dead) <= HISTORY_LIMIT:
            return []
        forgotten = [record.name for record in sorted(dead, key=lambda r: r.last_seen)[: len(dead) - HISTORY_LIMIT]]
        for name in forgotten:
            del self.records[name]
        return forgotten
