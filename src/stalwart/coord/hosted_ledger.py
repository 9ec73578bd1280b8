"""The ledger of record the lighthouse hosts: committed steps, the step in progress, a one-deep snapshot.

Pure: no I/O. The hosted :class:`~stalwart.data.DataLedger` is committed
through the steps quorum members report, plus a :class:`StepRecord` of how the
step in progress began when a quorum formed in it (members, then failures and
reassigns), and a snapshot of the state before the last commit for the
rollback case (a member that applied a step died before any survivor did).
Catching up replays ``begin_step(members)`` and ``commit()``, exactly what
every member does on the fast path.

A balanced ledger's weights change at step boundaries the members decide
from their all-reduce, which the lighthouse does not see: each report that
commits steps carries the reporter's weights record ``{"step", "weights"}``,
and the catch-up records those weights when it reaches their step (the step
itself, and which positions a step commits, do not depend on the weights;
only the split, and the state's digest, do). The weights in effect between
where a catch-up began and that step are not known when a report reveals a
change there (the members may have changed them more than once), so the
digests of those steps are forgotten rather than guessed: a checkpoint of
such a step is not vouched for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from stalwart.coord.protocol import ledger_digest
from stalwart.coord.tracked import Tracked
from stalwart.data.ledger import DataLedger, Positions
from stalwart.data.plan import EpochPlan

DIGEST_HISTORY = 4096
"""How many recent commits' digests are kept (to vouch for checkpoint reports)."""


def adopt_weights(ledger: DataLedger, weights: Mapping[str, Any] | None) -> bool:
    """Record a reported weights record on ``ledger`` between steps if it is at their step and holds older ones.

    Returns whether it did (see the module doc).
    """
    if (
        weights is None
        or not ledger.balanced
        or ledger.in_step
        or weights["step"] != ledger.step
        or ledger.weights_step >= weights["step"]
    ):
        return False
    ledger.reweigh(weights["weights"])
    return True


@dataclass
class StepRecord:
    """How the ledger's step in progress began: its members, then ``(failed, reassigned_to)`` events."""

    members: list[str]
    failures: list[tuple[list[str], list[str]]] = field(default_factory=list)

    @property
    def live(self) -> list[str]:
        """The step's members that have not failed, in rank order."""
        failed = {member for event_failed, _ in self.failures for member in event_failed}
        return [member for member in self.members if member not in failed]

    def replay(self, ledger: DataLedger) -> list[int]:
        """Begin the step on ``ledger`` and apply the failures and reassigns; returns the positions each failure
        handed to the survivors, in order."""
        ledger.begin_step(self.members)
        lost = []
        for failed, survivors in self.failures:
            for member in failed:
                ledger.member_failed(member)
            lost.append(ledger.step_missing_size)  # each failure's reassign hands out every missing position
            ledger.reassign(survivors)
        return lost

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"members": list(self.members), "failures": [[list(f), list(s)] for f, s in self.failures]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepRecord:
        """Inverse of ``to_json``."""
        return cls(list(data["members"]), [(list(f), list(s)) for f, s in data["failures"]])


class HostedLedger(Tracked):
    """The committed :class:`DataLedger`, the record of the step in progress and the rollback snapshot.

    A persisted part (:mod:`~stalwart.coord.tracked`): the ledger, changed in
    place by a commit, is always followed by a new record or generation, which
    stamps the part.
    """

    UNTRACKED = frozenset({"_in_step", "_in_step_lost", "digests"})

    def __init__(self, plan: EpochPlan, balance_every: int = 0) -> None:
        self.ledger = DataLedger(plan, balance_every=balance_every)
        self._record: StepRecord | None = None
        self._in_step: DataLedger | None = None
        """The ledger with the record replayed (cached until the record or the ledger changes)."""
        self._in_step_lost: list[int] = []
        """The positions each of the record's failures handed to survivors, found by that replay."""
        self.snapshot: dict[str, Any] | None = None
        self.digests: dict[int, str] = {0: ledger_digest(self.ledger.state_dict())}
        """Digest of the ledger after each recent commit, by step (bounded; rebuilt from the members' reports)."""
        self.generation = 0
        """Grows with every change of the ledger or of the record (a catch-up's trial is valid for one generation)."""

    @property
    def record(self) -> StepRecord | None:
        """How the step in progress began, when a quorum formed in it (None otherwise)."""
        return self._record

    @record.setter
    def record(self, record: StepRecord | None) -> None:
        self._record = record
        self._in_step = None
        self.generation += 1

    def begin(self, members: list[str]) -> None:
        """A quorum of ``members`` forms at a step boundary: they begin the step in progress."""
        self.record = StepRecord(list(members))

    def fail(self, members: list[str], survivors: list[str]) -> list[str]:
        """The step in progress (begun by ``members`` unless a record says otherwise) goes on with ``survivors``.

        The others fail and their positions are reassigned to the survivors;
        returns the failed members. ``survivors`` keep the step's rank order.
        """
        record = self._record or StepRecord(list(members))
        kept = set(survivors)
        failed = [member for member in record.live if member not in kept]
        if [member for member in record.live if member in kept] != survivors:
            raise ValueError(f"survivors {survivors} must be live members of the step in its rank order")
        if failed:
            record.failures.append((failed, list(survivors)))
        self.record = record
        return failed

    def in_step(self) -> DataLedger:
        """The ledger in the step in progress when a record says how it began, else the committed one (cached)."""
        if self._in_step is None:
            ledger = self.ledger.copy()
            self._in_step_lost = [] if self._record is None else self._record.replay(ledger)
            self._in_step = ledger
        return self._in_step

    def lost_per_failure(self) -> tuple[int, list[int]]:
        """``(step, lost)``: the step in progress and the positions each of its failures handed to survivors.

        Read from the cached replay of the step (a failure quorum's formation made it): a second replay of the
        ledger at formation took some 20 ms of the lighthouse's loop at 4,096 members."""
        self.in_step()
        return self.ledger.step, list(self._in_step_lost)

    @property
    def step(self) -> int:
        """Steps committed."""
        return self.ledger.step

    def commit_one(self, members: list[str]) -> tuple[int, int, Positions]:
        """Commit the step in progress (begun by ``members`` if no record says otherwise).

        Returns ``(epoch, step, positions)`` of the committed step.
        """
        record = self._record or StepRecord(list(members))
        snapshot = {"ledger": self.ledger.state_dict(), "record": record.to_json()}
        if self._record is not None:
            self.ledger = self.in_step()
        else:
            record.replay(self.ledger)
        epoch, step = self.ledger.epoch, self.ledger.step
        positions = self.ledger.commit()
        self.snapshot = snapshot
        self.record = None
        self._remember_digest()
        return epoch, step, positions

    def catch_up(
        self, members: list[str], step: int, weights: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[int, int, Positions]]:
        """Commit through ``step`` (see ``commit_one``), yielding each ``(epoch, step, positions)`` as it commits.

        ``weights``: the reporter's weights record at ``step`` (balanced
        ledgers), recorded when the ledger reaches its step.
        """
        start = self.step
        if start >= step:
            return
        self._adopt(weights, start)
        while self.step < step:
            yield self.commit_one(members)
            self._adopt(weights, start)

    def _adopt(self, weights: Mapping[str, Any] | None, start: int) -> None:
        """Record the reported weights if the ledger is at their step and holds older ones (see the module doc)."""
        if self._record is not None or not adopt_weights(self.ledger, weights):
            return
        self._in_step = None
        self.generation += 1
        for unknown in range(start + 1, self.ledger.step):
            self.digests.pop(unknown, None)
        self._remember_digest()

    def _remember_digest(self) -> None:
        self.digests[self.ledger.step] = ledger_digest(self.ledger.state_dict())
        for old in [step for step in self.digests if step <= self.ledger.step - DIGEST_HISTORY]:
            del self.digests[old]

    def restore(self, state: Mapping[str, Any]) -> None:
        """Go back to a committed ledger ``state`` (a checkpoint's): no step in progress, no snapshot."""
        self.ledger = DataLedger.from_state_dict(state)
        self.record = None
        self.snapshot = None
        self.digests = {step: digest for step, digest in self.digests.items() if step < self.ledger.step}
        self._remember_digest()

    def adopt(
        self, ledger: DataLedger, snapshot: dict[str, Any], digests: Mapping[int, str], forgotten: set[int]
    ) -> None:
        """Take a verified catch-up's result (:mod:`~stalwart.coord.catch_up`): its ledger, committed between steps,
        the snapshot before its last commit and the digests of the steps it committed (less those it forgot)."""
        self.ledger = ledger
        self.record = None
        self.snapshot = snapshot
        for step in forgotten:
            self.digests.pop(step, None)
        self.digests.update(digests)
        for old in [step for step in self.digests if step <= self.ledger.step - DIGEST_HISTORY]:
            del self.digests[old]

    def rollback(self) -> None:
        """Return to the state before the last commit (its step is in progress again)."""
        assert self.snapshot is not None, "rollback needs a snapshot"
        self.ledger = DataLedger.from_state_dict(self.snapshot["ledger"])
        self.record = StepRecord.from_json(self.snapshot["record"])
        self.snapshot = None

    def ledger_state(self) -> dict[str, Any]:
        """The ledger as the members see it: in the step in progress when a quorum formed in it, else committed."""
        return self.in_step().state_dict()

    def to_json(self) -> dict[str, Any]:
        """The ``ledger``, ``record`` and ``snapshot`` entries of the lighthouse's state dict."""
        return {
            "ledger": self.ledger.state_dict(),
            "record": None if self.record is None else self.record.to_json(),
            "snapshot": self.snapshot,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HostedLedger:
        """Inverse of ``to_json``."""
        ledger = DataLedger.from_state_dict(data["ledger"])
        hosted = cls(ledger.plan)
        hosted.ledger = ledger
        hosted.record = None if data["record"] is None else StepRecord.from_json(data["record"])
        hosted.snapshot = data["snapshot"]
        hosted.digests = {ledger.step: ledger_digest(ledger.state_dict())} if hosted.record is None else {}
        return hosted
