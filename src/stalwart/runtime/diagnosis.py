"""What a failed collective or rendezvous says about each peer: dead, cut off, on a slow link, never came, silent or
alive. Pure.

The facts come from the failure itself (:class:`~stalwart.runtime.comm.Failure`:
a socket error, a deadline passed, or the lighthouse reporting a member dead)
and from probing each peer process (:mod:`stalwart.runtime.probe`; None for a
process that never came to the rendezvous). A member is as bad as its worst
process: cut off, then dead, then on a slow link, then never came; a member
all of whose processes were reachable is silent when the failure was a
deadline (alive, reachable, and busy elsewhere), else alive. Only silent
peers earn the hint about busy peers (``manager.on_leader()``, a larger
``collective_timeout``); a member cut off, dead or on a link too slow for a
step is what the leader reports to the lighthouse as unreachable. A quorum
that broke while its leader ran ``manager.on_leader()`` work
(:class:`LeaderLoss`) says so instead: who died, inside ``on_leader``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stalwart.runtime.comm import Failure
from stalwart.runtime.probe import Reach


class Verdict(enum.Enum):
    """What one peer member looked like when a collective or rendezvous failed."""

    CUT_OFF = "cut off (unreachable from here: the connect timed out or found no route)"
    DEAD = "dead (nothing listens at its address: its process is gone)"
    SLOW_LINK = "on a slow link (reachable, but too slow to carry a step's all-reduce within the collective timeout)"
    ABSENT = "never came to the rendezvous (dead, or cut off from the lighthouse)"
    SILENT = "silent (reachable, and its link is fast enough, but it sent nothing until the deadline)"
    ALIVE = "alive (reachable)"


_WORST_FIRST = (Verdict.CUT_OFF, Verdict.DEAD, Verdict.SLOW_LINK, Verdict.ABSENT)
_OF_REACH = {Reach.CUT_OFF: Verdict.CUT_OFF, Reach.REFUSED: Verdict.DEAD, Reach.SLOW: Verdict.SLOW_LINK}
_UNREACHABLE = (Verdict.CUT_OFF, Verdict.DEAD, Verdict.SLOW_LINK)


@dataclass(frozen=True)
class Diagnosis:
    """Each peer member's verdict after one failure, in the quorum's order."""

    failure: Failure
    verdicts: Mapping[str, Verdict]

    @property
    def unreachable(self) -> tuple[str, ...]:
        """The members this process could not reach (cut off, dead, or on a link too slow for a step): what its next
        quorum request reports."""
        return tuple(member for member, verdict in self.verdicts.items() if verdict in _UNREACHABLE)

    @property
    def busy_hint(self) -> bool:
        """True when the deadline passed with every peer alive and reachable: a peer busy elsewhere (evaluating)."""
        return bool(self.verdicts) and all(verdict is Verdict.SILENT for verdict in self.verdicts.values())

    def describe(self) -> str:
        """One line naming each peer and its verdict."""
        if not self.verdicts and self.failure is Failure.ABANDONED:
            return "not probed: the lighthouse reported a member of this quorum dead"
        if not self.verdicts:
            return "no peer could be examined (the quorum's store did not answer)"
        return "; ".join(f"{member} {verdict.value}" for member, verdict in self.verdicts.items())


@dataclass(frozen=True)
class LeaderLoss:
    """The quorum broke while its leader ran ``manager.on_leader()`` work and this process waited for it.

    ``down``: the members the lighthouse named when it reported the quorum
    broken (empty when it named none). It replaces the hint about busy peers
    in the messages of that quorum's failures: the leader was in
    ``on_leader``, and dead, not busy.
    """

    leader: str
    quorum_id: int
    down: tuple[str, ...]

    def describe(self) -> str:
        """One line saying who died, and that it was (or the leader was) inside ``manager.on_leader()``."""
        if self.leader in self.down:
            others = [member for member in self.down if member != self.leader]
            also = f" (and {', '.join(others)} with it)" if others else ""
            return (
                f"the leader {self.leader} died inside manager.on_leader(){also}: the lighthouse reported it gone "
                f"from quorum {self.quorum_id} while the others waited for its work, whose result is lost"
            )
        if self.down:
            return (
                f"{', '.join(self.down)} died while the leader {self.leader} ran manager.on_leader() (the lighthouse "
                f"reported quorum {self.quorum_id} broken)"
            )
        return (
            f"quorum {self.quorum_id} broke while the leader {self.leader} ran manager.on_leader(): a member is "
            "gone, the lighthouse did not say which"
        )


def diagnose(failure: Failure, peers: Mapping[str, Sequence[Reach | None]]) -> Diagnosis:
    """The diagnosis of ``failure`` from what probing each peer member's processes found (None: never came).

    A member with no process examined is left out.
    """
    verdicts: dict[str, Verdict] = {}
    for member, found in peers.items():
        if not found:
            continue
        seen = {Verdict.ABSENT if reach is None else _OF_REACH.get(reach) for reach in found}
        worst = next((verdict for verdict in _WORST_FIRST if verdict in seen), None)
        verdicts[member] = worst or (Verdict.SILENT if failure is Failure.TIMEOUT else Verdict.ALIVE)
    return Diagnosis(failure, verdicts)
