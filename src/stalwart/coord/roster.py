"""The current quorum and which of its members still count for it. Pure: no I/O, no clock.

Every question the lighthouse asks of the quorum on a heartbeat (is this
member in it, is it broken, how many members still count) is answered in
constant time: the ranks are a dict and the members that no longer count
(dead, or evicted as hung or restarted) are kept as a set, updated as they die,
revive or are evicted.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

NAMED_DOWN = 8
"""The most members a broken-quorum notice names (rank order: the leader first when it is one of them), so that a
notice to each of thousands of survivors stays small when hundreds die at once."""


@dataclass(frozen=True)
class Quorum:
    """The members that run the current steps together, in rank order."""

    quorum_id: int
    members: tuple[str, ...]


class Roster:
    """The current quorum (None before the first), each member's rank, and the members that no longer count."""

    def __init__(self, quorum: Quorum | None = None, dead: Iterable[str] = ()) -> None:
        self.quorum = quorum
        self.ranks: dict[str, int] = {} if quorum is None else {m: r for r, m in enumerate(quorum.members)}
        self.evicted: set[str] = set()
        """Members that no longer count though they may live (``hung``, ``restarted``), until the next quorum."""
        self._dead = {member for member in dead if member in self.ranks}
        self._down = set(self._dead)
        self._named: list[str] | None = None
        self.down_at = float("-inf")
        """When a member last stopped counting (the state sets it): a quorum formed ahead waits for deaths to settle."""
        self.withdrawn = False
        """A quorum formed ahead whose presumption a member contradicted: broken, though every member still counts
        (``docs/protocol.md``, "Forming a failure quorum ahead")."""

    def __contains__(self, member: object) -> bool:
        return member in self.ranks

    def counts(self, member: str) -> bool:
        """Whether ``member`` is in the quorum and still counts for it (alive, not evicted)."""
        return member in self.ranks and member not in self._down

    @property
    def broken(self) -> bool:
        """True while a member no longer counts, or the quorum was withdrawn: its collectives cannot complete."""
        return bool(self._down) or self.withdrawn

    @property
    def down(self) -> list[str]:
        """The first :data:`NAMED_DOWN` members that no longer count (dead, or evicted), in rank order: whom the
        broken-quorum notice names. Cached until a member dies, revives or is evicted: every survivor's notice
        reads it, so a failure of many members costs one walk of them per change, not one per survivor."""
        if self._named is None:
            self._named = heapq.nsmallest(NAMED_DOWN, self._down, key=self.ranks.__getitem__)
        return self._named

    @property
    def counting(self) -> int:
        """How many members still count."""
        return len(self.ranks) - len(self._down)

    def died(self, member: str) -> None:
        """``member`` is dead."""
        if member in self.ranks:
            self._dead.add(member)
            self._down.add(member)
            self._named = None

    def revived(self, member: str) -> None:
        """``member`` is alive again (it counts again unless it was evicted)."""
        self._dead.discard(member)
        if member not in self.evicted and member in self._down:
            self._down.discard(member)
            self._named = None

    def withdraw(self) -> None:
        """This quorum, formed ahead, will not run: its members ask again (see ``withdrawn``)."""
        self.withdrawn = True

    def evict(self, member: str) -> None:
        """``member`` no longer counts for this quorum, alive or not."""
        self.evicted.add(member)
        self._down.add(member)
        self._named = None
