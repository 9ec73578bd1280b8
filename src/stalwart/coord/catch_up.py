"""Verified catch-up of the ledger of record, in slices of bounded work. Pure: no I/O, no clock.

A quorum member reports ``applied_step`` with its ledger's digest; the
lighthouse commits the steps up to it only when its own replay reaches the
same digest. Replaying costs about ``40 + 0.45 M`` microseconds a step with
``M`` members, so a report far ahead (after a lighthouse restart the members
may be thousands of steps on) must not be replayed in one go: no request or
heartbeat may hold the event loop for more than a few milliseconds.

A :class:`Trial` is a copy of the hosted ledger replayed towards a claim,
:func:`replay_budget` steps per event: the report that makes the claim, and
then each tick of the lighthouse. When it reaches the claim's step its digest
decides: the same, and the hosted ledger adopts the trial (every step
between is then committed at once, without a second replay); another, and
the claim is refused and nothing changes. A claim that arrives meanwhile
further ahead is the next one (the trial goes on towards it after the first
is decided); the same wrong claim again is refused at once. Any change of
the hosted ledger (a quorum forms, a rollback) drops the trial.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stalwart.coord.hosted_ledger import DIGEST_HISTORY, HostedLedger, StepRecord, adopt_weights
from stalwart.coord.protocol import ledger_digest
from stalwart.data.ledger import DataLedger, Positions

REPLAY_WORK = 6000
"""Work one event may do, in member-steps plus a fixed 90 per step (about 3 ms on the development machine)."""


def replay_budget(members: int) -> int:
    """How many ledger steps one event replays with ``members`` members (at least one)."""
    return max(1, REPLAY_WORK // (90 + members))


@dataclass(frozen=True)
class Claim:
    """A member's report that its ledger reached ``step`` with ``digest`` (and ``weights``, balanced ledgers)."""

    member: str
    step: int
    digest: str
    weights: Mapping[str, Any] | None = None


@dataclass
class Trial:
    """A copy of the hosted ledger being replayed towards ``claim`` with the quorum's ``members``."""

    claim: Claim
    members: list[str]
    generation: int
    """The hosted ledger's generation it started from: any other change of it drops the trial."""
    ledger: DataLedger
    start: int
    snapshot: dict[str, Any]
    """The state before the trial's last commit (the hosted ledger's one-deep rollback snapshot)."""
    digests: dict[int, str] = field(default_factory=dict)
    forgotten: set[int] = field(default_factory=set)
    commits: list[tuple[int, int, Positions]] | None = None
    """Each commit's ``(epoch, step, positions)``, kept only for a commit listener."""
    _state: dict[str, Any] | None = None

    @classmethod
    def start_from(cls, hosted: HostedLedger, claim: Claim, members: list[str], keep_commits: bool) -> Trial:
        """A trial from the hosted ledger as it is (in the step in progress when a record says so)."""
        record = hosted.record or StepRecord(list(members))
        snapshot = {"ledger": hosted.ledger.state_dict(), "record": record.to_json()}
        return cls(
            claim, list(members), hosted.generation, hosted.in_step().copy(), hosted.step, snapshot,
            commits=[] if keep_commits else None,
        )  # fmt: skip

    @property
    def reached(self) -> bool:
        """Whether the trial is at the claim's step."""
        return self.ledger.step >= self.claim.step and not self.ledger.in_step

    def advance(self, budget: int) -> None:
        """Replay up to ``budget`` steps towards the claim (committing each on the copy, as the members do)."""
        ledger, weights = self.ledger, self.claim.weights
        for _ in range(budget):
            if ledger.step >= self.claim.step:
                break
            if not ledger.in_step:
                self._adopt(weights)
                self.snapshot = {"ledger": self._committed_state(), "record": StepRecord(self.members).to_json()}
                ledger.begin_step(self.members)
            epoch, step = ledger.epoch, ledger.step
            positions = ledger.commit()
            if self.commits is not None:
                self.commits.append((epoch, step, positions))
            self._state = ledger.state_dict()
            self._remember(ledger.step, ledger_digest(self._state))
        if ledger.step >= self.claim.step:
            self._adopt(weights)

    def matches(self) -> bool:
        """Whether the trial, at the claim's step, has the claim's digest."""
        return hmac.compare_digest(ledger_digest(self._committed_state()), self.claim.digest)

    def _committed_state(self) -> dict[str, Any]:
        if self._state is None:
            self._state = self.ledger.state_dict()
        return self._state

    def _adopt(self, weights: Mapping[str, Any] | None) -> None:
        """Record the claim's weights at their step (balanced ledgers), as ``HostedLedger.catch_up`` does."""
        if not adopt_weights(self.ledger, weights):
            return
        for unknown in range(self.start + 1, self.ledger.step):
            self.digests.pop(unknown, None)
            self.forgotten.add(unknown)
        self._state = self.ledger.state_dict()
        self._remember(self.ledger.step, ledger_digest(self._state))

    def _remember(self, step: int, digest: str) -> None:
        self.digests[step] = digest
        self.forgotten.discard(step)
        self.digests.pop(step - DIGEST_HISTORY, None)


@dataclass(frozen=True)
class Verdict:
    """What became of a claim: ``verified`` (``trial`` to adopt), ``refused`` (``reason``) or ``pending``."""

    outcome: str
    claim: Claim
    trial: Trial | None = None
    reason: str = ""


class CatchUp:
    """The trial in progress, the next claim to verify, and the last claim refused."""

    def __init__(self) -> None:
        self.trial: Trial | None = None
        self.next: Claim | None = None
        self._refused: Claim | None = None

    def claimants(self) -> frozenset[str]:
        """The members whose claims wait to be verified (at most two: the one in trial and the next)."""
        return frozenset(claim.member for claim in (self._current, self.next) if claim is not None)

    @property
    def _current(self) -> Claim | None:
        return None if self.trial is None else self.trial.claim

    def offer(self, claim: Claim, hosted: HostedLedger, members: list[str], keep_commits: bool) -> Verdict | None:
        """Take a new claim: the trial's claim when none runs, else the next one when it is further ahead.

        A claim refused before is refused again at once; else None (:meth:`work` decides it, now or later).
        """
        if claim == self._refused:
            return Verdict("refused", claim, reason="the same report was refused before")
        self._drop_stale(hosted)
        trial = self.trial
        if trial is None:
            self.trial = Trial.start_from(hosted, claim, members, keep_commits)
        elif claim.step > trial.claim.step and (self.next is None or claim.step >= self.next.step):
            self.next = claim
        return None

    def work(self, hosted: HostedLedger, budget: int) -> Verdict | None:
        """Advance the trial by ``budget`` steps; its verdict once it reaches its claim's step (None before).

        After a verdict, apply it (a verified trial is adopted by the hosted
        ledger), then :meth:`start_next`.
        """
        self._drop_stale(hosted)
        trial = self.trial
        if trial is None:
            return None
        trial.advance(budget)
        if not trial.reached:
            return None
        self.trial = None
        if trial.matches():
            return Verdict("verified", trial.claim, trial)
        self._refused = trial.claim
        return Verdict("refused", trial.claim, reason="the lighthouse's replay reaches another digest")

    def start_next(self, hosted: HostedLedger, members: list[str], keep_commits: bool) -> None:
        """After a verdict was applied, start the trial of the next claim (if any)."""
        if self.trial is None and self.next is not None:
            claim, self.next = self.next, None
            if claim.step > hosted.step:
                self.trial = Trial.start_from(hosted, claim, members, keep_commits)

    def drop(self) -> None:
        """Forget the trial and the next claim (the hosted ledger changed, or a quorum formed)."""
        self.trial = None
        self.next = None

    def _drop_stale(self, hosted: HostedLedger) -> None:
        if self.trial is not None and self.trial.generation != hosted.generation:
            self.drop()
