"""What commits the ledger of record: members' reports, verified by replay in bounded slices, and healing.

A report of ``applied_step`` counts towards commits when its member is in the
current quorum, counts for it, and is not being healed to another step; one
that would commit steps needs the member's ledger digest, which the
lighthouse's own replay must reach (:mod:`~stalwart.coord.catch_up`, a
few milliseconds of work per event whatever the step). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.coord.catch_up import CatchUp, Claim, Verdict, replay_budget
from stalwart.coord.hosted_ledger import HostedLedger
from stalwart.coord.roster import Roster
from stalwart.coord.tracked import Tracked
from stalwart.coord.wire import RequestError
from stalwart.data.ledger import Positions

MAX_CATCH_UP = 100_000
"""How far a quorum member's ``applied_step`` may run ahead of the ledger (refused at once beyond)."""

CommitListener = Callable[[int, int, Positions], None]


@dataclass(frozen=True)
class Counted:
    """A report that now counts: ``member`` reached ``step`` (verified, or nothing to commit)."""

    member: str
    step: int
    weights: Mapping[str, Any] | None


class Commits(Tracked):
    """The hosted ledger, its verified catch-up, and who is being healed (whose reports do not count yet).

    A persisted part (:mod:`~stalwart.coord.tracked`): the ledger, healing and the heal step; the verification
    in progress and its verdicts are not persisted.
    """

    UNTRACKED = frozenset({"require_digest", "on_commit", "catch_up", "refusals", "counted"})

    def __init__(self, hosted: HostedLedger | None, *, require_digest: bool) -> None:
        self.hosted = hosted
        self.require_digest = require_digest
        self.on_commit: CommitListener | None = None
        self.healing: dict[str, bool] = {}
        """Heal targets of the current quorum: whether each was ahead of the heal step (it must report it exactly)."""
        self.heal_step = 0
        self.catch_up = CatchUp()
        self.refusals: list[tuple[str, str]] = []
        """``(member, message)`` for each report refused after the event that made it (the server tells them)."""
        self.counted: list[Counted] = []
        """Reports verified after the event that made them: the state records their members' steps."""

    # --- questions -------------------------------------------------------------------------------

    def heal(self, targets: Mapping[str, bool], step: int) -> None:
        """A new quorum heals ``targets`` (whether each was ahead of ``step``) to ``step``."""
        self.healing = dict(targets)
        self.heal_step = step

    def counts(self, roster: Roster, member: str, applied_step: int) -> bool:
        """Whether ``member``'s report of ``applied_step`` counts towards commits."""
        if member not in roster or member in roster.evicted:
            return False
        if member in self.healing:
            ahead = self.healing[member]
            return applied_step == self.heal_step if ahead else applied_step >= self.heal_step
        return True

    def would_commit(self, roster: Roster, member: str, applied_step: int) -> bool:
        """Whether ``member``'s report of ``applied_step`` would commit steps."""
        assert self.hosted is not None
        return applied_step > self.hosted.step and self.counts(roster, member, applied_step)

    def verifying(self) -> frozenset[str]:
        """The members whose reports wait to be verified (at most two)."""
        return self.catch_up.claimants()

    # --- reports ---------------------------------------------------------------------------------

    def check_ahead(self, roster: Roster, member: str, applied_step: int) -> None:
        """422 for a quorum member's step more than ``MAX_CATCH_UP`` ahead of the ledger (checked without replay)."""
        assert self.hosted is not None
        if member in roster and applied_step > self.hosted.step + MAX_CATCH_UP:
            raise RequestError(
                422,
                f"applied_step {applied_step} is impossible: more than {MAX_CATCH_UP} steps ahead of "
                f"the ledger's step {self.hosted.step}",
                field="applied_step",
            )

    def verify(
        self, roster: Roster, member: str, applied_step: int, digest: str | None, weights: Mapping[str, Any] | None
    ) -> bool:
        """Whether the report counts now (True: nothing to commit, or verified and committed); False while its
        replay goes on (later events finish it). ``RequestError`` 422 (nothing changes) when it is refused."""
        assert self.hosted is not None
        self.check_ahead(roster, member, applied_step)
        if not self.would_commit(roster, member, applied_step):
            return True
        committed = self.hosted.step
        if digest is None:
            if self.require_digest:
                raise RequestError(
                    422,
                    f"applied_step {applied_step} is ahead of the ledger's step {committed}: a digest of the "
                    "member's ledger is required to commit it",
                    field="digest",
                )
            return True
        claim = Claim(member, applied_step, digest, weights)
        members = self._members(roster)
        verdict = self.catch_up.offer(claim, self.hosted, members, self.on_commit is not None)
        if verdict is None:
            verdict = self._work(roster, replay_budget(len(members)))
        if verdict is None or verdict.claim != claim:
            return False
        if verdict.outcome == "refused":
            self.refusals = [(who, text) for who, text in self.refusals if who != member or claim != verdict.claim]
            raise RequestError(422, _refusal(claim, committed), field="digest")
        self.counted = [counted for counted in self.counted if counted.member != member]
        return True

    def work(self, roster: Roster) -> None:
        """A tick's slice of the verification in progress (its verdict lands in ``counted`` or ``refusals``)."""
        if self.hosted is not None and self.catch_up.trial is not None:
            self._work(roster, replay_budget(len(self._members(roster))))

    def progress(self, roster: Roster, member: str, applied_step: int, weights: Mapping[str, Any] | None) -> None:
        """A report that counts: its member's heal ends, and an unverified report (no digest required) commits."""
        if not self.counts(roster, member, applied_step):
            return
        if member in self.healing:
            del self.healing[member]
        self.catch_up_to(roster, applied_step, weights)

    def catch_up_to(self, roster: Roster, step: int, weights: Mapping[str, Any] | None) -> None:
        """Commit through ``step`` with the quorum's members, replaying (a formation's target: verified reports)."""
        assert self.hosted is not None
        if step <= self.hosted.step:
            return
        for epoch, committed, positions in self.hosted.catch_up(self._members(roster), step, weights):
            if self.on_commit is not None:
                self.on_commit(epoch, committed, positions)

    # --- verdicts --------------------------------------------------------------------------------

    def _work(self, roster: Roster, budget: int) -> Verdict | None:
        assert self.hosted is not None
        verdict = self.catch_up.work(self.hosted, budget)
        if verdict is None:
            return None
        trial = verdict.trial
        if verdict.outcome == "verified" and trial is not None:
            if trial.generation == self.hosted.generation:
                self.hosted.adopt(trial.ledger, trial.snapshot, trial.digests, trial.forgotten)
                for epoch, step, positions in trial.commits or ():
                    if self.on_commit is not None:
                        self.on_commit(epoch, step, positions)
                self.counted.append(Counted(verdict.claim.member, verdict.claim.step, verdict.claim.weights))
        elif verdict.outcome == "refused":
            self.refusals.append((verdict.claim.member, _refusal(verdict.claim, self.hosted.step)))
        self.catch_up.start_next(self.hosted, self._members(roster), self.on_commit is not None)
        return verdict

    def _members(self, roster: Roster) -> list[str]:
        return [] if roster.quorum is None else list(roster.quorum.members)

    def take_counted(self) -> list[Counted]:
        """The reports verified since the last call, after the events that made them."""
        if not self.counted:
            return []  # every heartbeat asks: no assignment (a part's assignments cost a call, see ``Tracked``)
        counted, self.counted = self.counted, []
        return counted

    def take_refusals(self) -> list[tuple[str, str]]:
        """``(member, message)`` of the reports refused since the last call, after the events that made them."""
        if not self.refusals:
            return []
        refusals, self.refusals = self.refusals, []
        return refusals


def _refusal(claim: Claim, committed: int) -> str:
    return (
        f"digest {claim.digest} of member {claim.member!r} at applied_step {claim.step} does not match the "
        f"lighthouse's replay: the steps are not committed; the ledger stays at step {committed}"
    )
