"""The collective timeout of each quorum: grown while the same members keep failing, so a slow link never livelocks.

A link that is slow but alive (a congested NIC, a far region: 128 kbit/s)
makes every all-reduce pass a collective timeout sized for a healthy
network. The probe that follows a timeout finds a link too slow to carry a
step's bytes in the collective timeout, and the lighthouse leaves its member
out as a straggler (:mod:`stalwart.runtime.probe`). What the probe cannot
see (a member busy elsewhere, a link fast for the probe and slow for the
collective) makes the lighthouse form a *failure* quorum of the very same
members, whose all-reduce times out again: without a rule, nothing ever
commits. The rule (docs/design.md, "Network faults"):

- a quorum whose members are those of the quorum just before it (the next
  ``quorum_id``: nobody died, nobody joined, yet the quorum broke) doubles the
  collective timeout: the last one was too short for these members' links
  (or for a straggler that reaches every all-reduce late);
- up to ``MAX_GROWTH`` times the configured ``collective_timeout``;
- any other membership starts again from the configured value (a member that
  left or joined explains the failure, or changes the links);
- every ``QUIET_STEPS`` steps the quorum commits without breaking halve it
  again (towards the configured value), so a link that was slow for a while
  does not slow the verdict on a hung peer for the rest of the job; a link
  that stays slow costs one break per ``QUIET_STEPS`` steps.

The inputs are the lighthouse's answers (``quorum_id``, ``members``) and the
steps committed since the last one, the same for every member of a quorum,
so every member that held the previous answer derives the same timeout, and
they all halve it at the same step. A member that joined since held another
previous answer and starts lower: it times out first and the next failure
quorum grows it too, so the members agree within ``log2(MAX_GROWTH)``
quorums. A grown timeout costs only a slower verdict on a peer that hangs
while its heartbeat goes on: a dead peer is reported by the lighthouse and
abandons the collective at once.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_GROWTH = 16
"""The largest factor the collective timeout grows by (four doublings)."""
QUIET_STEPS = 100
"""Steps a quorum commits without breaking after which a grown timeout halves."""


@dataclass(frozen=True)
class QuorumView:
    """What an answer says that the rule reads: the quorum's id and its members in rank order."""

    quorum_id: int
    members: tuple[str, ...]


def next_growth(previous: QuorumView | None, current: QuorumView, growth: int) -> int:
    """The factor (a power of two in ``[1, MAX_GROWTH]``) for ``current``, given ``previous`` and its ``growth``."""
    if previous is None or current.members != previous.members:
        return 1
    if current.quorum_id == previous.quorum_id + 1:
        return min(2 * growth, MAX_GROWTH)
    return growth


class CollectivePatience:
    """This member's collective timeout for each quorum it adopts (``base``: the configured ``collective_timeout``)."""

    def __init__(self, base: float) -> None:
        if not base > 0:
            raise ValueError(f"base must be a positive number of seconds, got {base!r}")
        self.base = base
        self.growth = 1
        self._previous: QuorumView | None = None
        self._quiet = 0

    @property
    def timeout(self) -> float:
        """The collective timeout of the latest quorum adopted."""
        return self.base * self.growth

    def adopt(self, current: QuorumView) -> float:
        """The collective timeout for ``current`` (the next quorum this member is in)."""
        self.growth = next_growth(self._previous, current, self.growth)
        self._previous = current
        self._quiet = 0
        return self.timeout

    def committed(self) -> bool:
        """One more step committed in the adopted quorum; True when that halved the timeout."""
        self._quiet += 1
        if self._quiet < QUIET_STEPS:
            return False
        self._quiet = 0
        if self.growth == 1:
            return False
        self.growth //= 2
        return True
