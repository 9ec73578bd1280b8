"""The quorum requests waiting for the next quorum. Pure: no I/O; time is passed as ``now``.

Requests are kept in arrival order (a member that asks anew moves to the
end), and those of members that count for the current quorum are also counted
apart, so the formation rule's checks (has every member of the quorum asked,
is any a failure, since when do they wait) take constant time per event; only
forming the quorum walks the requests.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView
from dataclasses import dataclass

from stalwart.coord.protocol import QuorumRequest


@dataclass(frozen=True)
class Ask:
    """One waiting request, when it arrived and whether it came from a member that counts for the quorum."""

    request: QuorumRequest
    time: float
    ours: bool


class Pending:
    """The waiting requests by member, in arrival order."""

    def __init__(self) -> None:
        self._asks: dict[str, Ask] = {}
        self._ours: dict[str, None] = {}
        self.survivors = 0
        """Requests of counting quorum members with reason ``failure`` or ``reconfigure``."""
        self.failures = 0
        """Requests of counting quorum members with reason ``failure``."""

    def __len__(self) -> int:
        return len(self._asks)

    def __contains__(self, member: object) -> bool:
        return member in self._asks

    def __getitem__(self, member: str) -> Ask:
        return self._asks[member]

    def get(self, member: str) -> Ask | None:
        """The request of ``member``, or None."""
        return self._asks.get(member)

    def items(self) -> ItemsView[str, Ask]:
        """``(member, ask)`` in arrival order."""
        return self._asks.items()

    @property
    def ours(self) -> int:
        """How many requests come from members that count for the current quorum."""
        return len(self._ours)

    def add(self, request: QuorumRequest, now: float, ours: bool) -> None:
        """Keep ``request`` (arrived at ``now``); the same request again changes nothing."""
        previous = self._asks.get(request.member)
        if previous is not None and previous.request == request:
            return
        self.pop(request.member)
        self._asks[request.member] = Ask(request, now, ours)
        if ours:
            self._ours[request.member] = None
            self._count(request, 1)

    def pop(self, member: str) -> Ask | None:
        """Drop the request of ``member`` (None if it had none)."""
        ask = self._asks.pop(member, None)
        if ask is not None and ask.ours:
            del self._ours[member]
            self._count(ask.request, -1)
        return ask

    def first_time(self) -> float:
        """When the first request still waiting arrived: among counting quorum members when any asked."""
        first = next(iter(self._ours)) if self._ours else next(iter(self._asks))
        return self._asks[first].time

    def regroup(self, counts: Callable[[str], bool]) -> None:
        """A new quorum formed: re-sort the requests left by whether their member ``counts`` for it."""
        asks = list(self._asks.values())
        self._asks, self._ours = {}, {}
        self.survivors = self.failures = 0
        for ask in asks:
            self.add(ask.request, ask.time, counts(ask.request.member))

    def _count(self, request: QuorumRequest, sign: int) -> None:
        if request.reason != "join":
            self.survivors += sign
        if request.reason == "failure":
            self.failures += sign
