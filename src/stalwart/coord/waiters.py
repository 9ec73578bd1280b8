"""The quorum long polls the lighthouse holds: one per member's incarnation, answered when a quorum forms.

A newer request of the same member replaces an older one (its client gave up
on it, 409 ``replaced``), so one identity cannot fill ``max_waiters``; a
member that leaves or is replaced has its polls refused; every poll is
answered (or refused) when the lighthouse shuts down.
"""

from __future__ import annotations

import asyncio

from stalwart.coord.formation import Formation
from stalwart.coord.turnstile import release
from stalwart.coord.wire import RequestError

Outcome = Formation | RequestError


class QuorumWaiters:
    """The waiting long polls by member; ``waiting`` counts them (at most ``max_waiters``)."""

    def __init__(self, max_waiters: int) -> None:
        self.max_waiters = max_waiters
        self.waiting = 0
        """How many quorum long polls wait."""
        self._by_member: dict[str, list[asyncio.Future[Outcome]]] = {}

    def check_room(self) -> None:
        """503 naming the cap when ``max_waiters`` polls wait already."""
        if self.waiting >= self.max_waiters:
            raise RequestError(
                503,
                f"max_waiters={self.max_waiters} quorum requests are already pending; ask again later",
                cap="max_waiters",
            )

    async def wait(self, member: str, timeout: float) -> Outcome | None:
        """Wait up to ``timeout`` seconds for ``member``'s quorum (None: none came), replacing its older polls."""
        self.refuse(
            member,
            RequestError(
                409, f"replaced by a newer quorum request of member {member!r}", member=member, code="replaced"
            ),
        )
        waiter: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._by_member.setdefault(member, []).append(waiter)
        self.waiting += 1
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        finally:
            self.waiting -= 1
            self._by_member[member].remove(waiter)
            if not self._by_member[member]:
                del self._by_member[member]
        return waiter.result() if waiter.done() else None

    def answer(self, formation: Formation) -> None:
        """Wake the polls of the members of the quorum just formed, a batch per loop iteration (thousands wait at
        once after a failure: :func:`~stalwart.coord.turnstile.release`)."""
        release([waiter for member in formation.members for waiter in self._by_member.get(member, ())], formation)

    def refuse(self, member: str, error: RequestError) -> None:
        """Answer ``member``'s waiting polls with ``error``."""
        for waiter in self._by_member.get(member, ()):
            if not waiter.done():
                waiter.set_result(error)

    def refuse_all(self, error: RequestError) -> None:
        """Answer every waiting poll with ``error`` (the lighthouse shuts down)."""
        for member in self._by_member:
            self.refuse(member, error)
