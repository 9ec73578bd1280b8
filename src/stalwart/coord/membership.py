"""Who the lighthouse has seen and whether each is alive. Pure: no I/O; time is passed as ``now``.

A member is alive while it sent something (a heartbeat or a request) within
``heartbeat_timeout`` and its socket did not close; a later heartbeat revives
it. Every sighting costs O(log M) (a deadline heap) and finding the expired
members costs what expired, so heartbeats stay cheap with thousands of
members. Dead members outside the quorum are forgotten beyond
``HISTORY_LIMIT``, those that died longest ago first. A live member whose
peers wait on it without progress is found hung (:meth:`Membership.hung`).

Silence is evidence of death only while the lighthouse can hear (a lighthouse
outage is not a failure):

- a member silent past its deadline (its last sighting plus
  ``heartbeat_timeout``) is dead once the lighthouse *heard another member
  after that deadline*: its own network works, so the silent one is cut off,
  hung or gone (judged at each tick, with that tick's timeout: a lighthouse
  whose own loop stood still reads what waited in its sockets first, see
  :meth:`Membership.excuse`);
- when a tick finds nobody heard for more than ``heartbeat_timeout`` (every
  member silent together), the lighthouse is the one cut off: nobody expires
  while it hears nothing, and when it hears again every deadline counts from
  that moment (the members get ``heartbeat_timeout`` to come back, so the
  first to reconnect does not condemn the others);
- whatever it hears, a member silent for more than ``outage_timeout`` (60 s by
  default) is dead: the bound on how long a cut-off lighthouse waits;
- a member a restarted lighthouse only expects (:meth:`Membership.expect`) and
  never heard is dead ``heartbeat_timeout`` after the restart, as before.

A closed socket is a death at once, whatever the lighthouse hears (a killed
process closes its sockets).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass

from stalwart.coord.history import HISTORY_LIMIT
from stalwart.coord.tracked import TrackedDict

DEFAULT_OUTAGE_TIMEOUT = 60.0
"""How long (seconds) a lighthouse that hears nobody waits before silent members count as dead (at least
``heartbeat_timeout``): it tolerates its own network outages that long."""


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
    """The :class:`MemberRecord` of every member seen, by id, and how many are alive."""

    def __init__(self, heartbeat_timeout: float, outage_timeout: float = DEFAULT_OUTAGE_TIMEOUT) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.outage_timeout = max(outage_timeout, heartbeat_timeout)
        """The longest a member's silence is excused while the lighthouse hears nobody."""
        self.records: TrackedDict[str, MemberRecord] = TrackedDict(keys=True)
        """Saved one row per member (its identity): the records say which members appeared or were forgotten; what
        a record holds is not persisted (the members report it again)."""
        self.live = 0
        """How many members are alive."""
        self._sightings: list[tuple[float, str]] = []
        """``(last_seen, member)`` for every sighting not yet older than the timeout (a heap; stale ones skipped)."""
        self._dead: dict[str, None] = {}
        """Dead members, those that died first first."""
        self._excuse = 0.0
        self._excused_until = float("-inf")
        self.last_heard = float("-inf")
        """When the lighthouse last heard any member."""
        self.heard_since = float("-inf")
        """Since when it hears again after it found itself cut off (every deadline counts from here at the least)."""
        self.cut_off_since: float | None = None
        """Set (to when it last heard anyone) while a tick found nobody heard for more than the timeout."""
        self._expected: dict[str, None] = {}
        """Members a restarted lighthouse expects and has not heard since (they expire by the plain timeout)."""

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
            record = self.records[member] = MemberRecord(member, alive=False, last_seen=now)
        record.last_seen = max(record.last_seen, now)
        self._expected.pop(member, None)
        self._revive(record)
        self.heard(now)
        return record

    def expect(self, member: str, now: float) -> None:
        """Count ``member`` alive as of ``now`` (a restarted lighthouse gives it a heartbeat timeout to reconnect)."""
        record = self.records.setdefault(member, MemberRecord(member, alive=False))
        record.last_seen = now
        self._expected[member] = None
        self._revive(record)

    def restore(self, member: str, applied_step: int | None, now: float) -> MemberRecord:
        """A member of a persisted state: dead (as of ``now``) until it is seen or expected."""
        record = self.records[member] = MemberRecord(member, alive=False, last_seen=now, applied_step=applied_step)
        self._dead[member] = None
        return record

    def _revive(self, record: MemberRecord) -> None:
        heapq.heappush(self._sightings, (record.last_seen, record.name))
        record.left = False
        if not record.alive:
            record.alive = True
            self.live += 1
            self._dead.pop(record.name, None)

    def excuse(self, seconds: float, now: float) -> None:
        """The lighthouse was not listening for ``seconds`` before ``now`` (its loop was blocked): for the next
        ``heartbeat_timeout`` a member may be silent that much longer before it expires.

        The longest such pause counts, not their sum: between pauses the lighthouse reads what waited in its
        sockets, so a live member's heartbeats are late by one pause at most. (A sum grew without bound on a busy
        machine, where most ticks come a little late, and members killed there were never found dead by silence.)
        """
        if now >= self._excused_until:
            self._excuse = 0.0
        self._excuse = max(self._excuse, seconds)
        self._excused_until = max(self._excused_until, now + self.heartbeat_timeout + self._excuse)

    def _timeout(self, now: float) -> float:
        return self.heartbeat_timeout + (self._excuse if now < self._excused_until else 0.0)

    def _current(self, name: str, seen: float) -> bool:
        """Whether ``seen`` is still the last sighting of ``name``, a live member."""
        record = self.records.get(name)
        return record is not None and record.alive and record.last_seen == seen

    def heard(self, now: float) -> None:
        """A member (or a process registering as one) was heard at ``now``: a lighthouse that found itself cut off
        hears again, and every deadline counts from ``now`` at the least."""
        if self.cut_off_since is not None:
            self.cut_off_since = None
            self.heard_since = max(self.heard_since, now)
        self.last_heard = max(self.last_heard, now)

    def expired(self, now: float) -> list[str]:
        """Live members dead by silence at ``now`` (the rules of the module's doc); costs what expired (and the
        members a restarted lighthouse still expects).

        Judged at ``now``, with the timeout of ``now``: a lighthouse whose loop was blocked (:meth:`excuse`) reads
        the heartbeats that waited in its sockets before it judges. Finding nobody heard for more than the timeout
        marks the lighthouse cut off (:attr:`cut_off_since`).
        """
        timeout = self._timeout(now)
        if self.cut_off_since is None and self.live and now - self.last_heard > timeout:
            self.cut_off_since = self.last_heard
        # heard after the deadline: the last sighting (of another member) is past max(seen, heard_since) + timeout
        heard = self.last_heard if self.last_heard - self.heard_since > timeout else float("-inf")
        expired: dict[str, None] = {}
        sightings = self._sightings
        while sightings and (heard - sightings[0][0] > timeout or now - sightings[0][0] > self.outage_timeout):
            seen, name = heapq.heappop(sightings)
            if self._current(name, seen):
                expired[name] = None  # a member seen twice at the same instant has two equal sightings
        for name in list(self._expected):
            record = self.records.get(name)
            if record is None or not record.alive:
                del self._expected[name]
            elif now - record.last_seen > timeout:
                expired[name] = None
                del self._expected[name]
        return list(expired)

    def mark_dead(self, member: str) -> None:
        """``member`` is dead (until it speaks again)."""
        record = self.records[member]
        if record.alive:
            record.alive = False
            self.live -= 1
            self._dead[member] = None

    def hung(
        self,
        members: Iterable[str],
        compared: Callable[[str], bool],
        at_boundary: Callable[[str], bool],
        now: float,
        patience: float,
    ) -> list[str]:
        """Members whose peers have waited on them for more than ``patience`` seconds at ``now``.

        Among ``members`` (a quorum's) that are ``compared`` and reported a
        step, those behind the furthest one are waited on since the first time
        seen behind (unless ``at_boundary``: they are not known to be behind);
        progress ends a wait. Linear in the members. Nobody is found hung
        while the lighthouse is cut off, and a member not heard since it
        hears again is not known to be behind (its reports are on their way).
        """
        if self.cut_off_since is not None:
            return []
        records = self.records
        steps = {m: records[m].applied_step for m in members if records[m].applied_step is not None and compared(m)}
        if not steps:
            return []
        ahead = max(step for step in steps.values() if step is not None)
        found = []
        for member, step in steps.items():
            record = records[member]
            if step is None or step >= ahead or at_boundary(member) or record.last_seen < self.heard_since:
                record.waited_since = None
            elif record.waited_since is None:
                record.waited_since = now
            elif now - record.waited_since > patience:
                found.append(member)
        return found

    def alive(self, member: str) -> bool:
        """Whether ``member`` is known and alive."""
        record = self.records.get(member)
        return record is not None and record.alive

    def forget_dead(self, keep: Container[str]) -> list[str]:
        """Forget the dead members not in ``keep`` beyond the ``HISTORY_LIMIT`` latest to die; returns them.

        Linear in the dead members, and only when there are more than the limit.
        """
        if len(self._dead) <= HISTORY_LIMIT:
            return []
        candidates = [name for name in self._dead if name not in keep]
        forgotten = candidates[: max(0, len(candidates) - HISTORY_LIMIT)]
        for name in forgotten:
            del self.records[name]
            del self._dead[name]
        return forgotten
