"""What members tell the lighthouse, applied to its state: socket opens and closes, heartbeats, quorum requests,
departures, and the expiry of silent and hung members. Pure: every event carries the time ``now``.

:class:`Intake` reads and changes the parts of the lighthouse state
(:class:`IntakeState`, what :class:`~stalwart.coord.quorum.LighthouseState`
holds): liveness in ``membership``, the quorum's ``roster``, the waiting
``asks``, the reports the ``commits`` verify; the rules are
:mod:`~stalwart.coord.quorum`'s ("Liveness", "Refusals").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from stalwart.coord.checkpoints import CheckpointRecord, parse_checkpoint_report, vouch
from stalwart.coord.commits import Commits
from stalwart.coord.formation import Formation
from stalwart.coord.former import Former
from stalwart.coord.history import History
from stalwart.coord.hosted_ledger import HostedLedger
from stalwart.coord.identity import parse_incarnation
from stalwart.coord.membership import MemberRecord, Membership
from stalwart.coord.pending import Pending
from stalwart.coord.protocol import QuorumRequest
from stalwart.coord.reachability import Reachability
from stalwart.coord.registry import Registry
from stalwart.coord.roster import Roster
from stalwart.coord.tracked import TrackedDict
from stalwart.coord.wire import RequestError, parse_digest, parse_member, parse_step, parse_weights
from stalwart.data.plan import EpochPlan

HUNG_CHECK_S = 0.5
"""How often, at most, :meth:`Intake.tick` looks for hung members (a walk of the quorum); at least ten times per
``join_timeout``, so a hang is found within 110% of it."""


class IntakeState(Protocol):
    """The parts of the lighthouse's state that members' events read and change."""

    heartbeat_timeout: float
    join_timeout: float
    registry: Registry
    membership: Membership
    roster: Roster
    asks: Pending
    answered: TrackedDict[str, QuorumRequest]
    history: History
    commits: Commits
    reach: Reachability
    checkpoint: CheckpointRecord | None
    former: Former

    @property
    def plan(self) -> EpochPlan | None: ...

    @property
    def hosted(self) -> HostedLedger: ...

    def formation_for(self, request: QuorumRequest) -> Formation | None: ...

    def try_form(self, now: float) -> Formation | None: ...


class Intake:
    """Applies members' events to ``state`` (a heartbeat, a request, a death) and expires the silent (:meth:`tick`)."""

    def __init__(self, state: IntakeState) -> None:
        self.state = state
        self._hung_checked = float("-inf")

    def connected(self, member: str, now: float) -> None:
        """``member`` opened its heartbeat socket; back from the dead (its link is up again), it is cut from nobody."""
        member = parse_member(member)
        came_back = member in self.state.membership and not self.state.membership.alive(member)
        self.touch(member, now).connected = True
        if came_back:
            quorum = self.state.roster.quorum
            self.state.reach.reconnected(member, None if quorum is None else quorum.quorum_id, now)

    def disconnected(self, member: str, now: float, *, reconnecting: bool = False) -> None:
        """``member``'s heartbeat socket closed: it is dead at once (a killed process closes its sockets), unless
        ``reconnecting`` (its member closed it to open another, or it carried no heartbeat) or the socket was
        stale: its member silent for longer than ``heartbeat_timeout``. Then its silence is judged by the
        heartbeat timeout and the outage rule (``docs/protocol.md``).

        A stale socket's close tells nothing new: after an outage of the lighthouse's link, the reset of a socket
        its member gave up meanwhile arrives when the link returns, often before the member's new socket.
        """
        record = self.state.membership.get(member)
        if record is None:
            return
        record.connected = False
        stale = now - record.last_seen > self.state.heartbeat_timeout
        if record.alive and not reconnecting and not stale:
            self.mark_dead(member, now, "socket closed")

    def heartbeat(
        self,
        member: str,
        applied_step: int,
        now: float,
        digest: str | None = None,
        weights: Mapping[str, Any] | None = None,
    ) -> bool:
        """``member`` reports ``applied_step``; the ledger commits through the largest a quorum member reports.
        True when the report counted at once (False: its replay goes on, see :meth:`heard_again`).

        ``digest`` is the member's ``ledger_digest`` at ``applied_step``: a
        report that would commit steps is refused (``RequestError`` 422,
        nothing changes) when the lighthouse's replay disagrees, or when it is
        missing and ``require_digest`` is set. ``weights``: the member's
        weights record at ``applied_step`` (balanced ledgers; see
        :func:`~stalwart.coord.wire.parse_weights`).
        """
        member = parse_member(member)
        applied_step = parse_step(applied_step)
        digest = parse_digest(digest)
        weights = parse_weights(weights)
        if self.state.former.contradicts(member, applied_step):
            self.state.former.withdraw()
        counts = self.state.commits.verify(self.state.roster, member, applied_step, digest, weights)
        record = self.touch(member, now)
        if counts:  # else its replay goes on: the step is recorded once verified
            record.report(applied_step)
            self.state.commits.progress(self.state.roster, member, applied_step, weights)
        self.take_verdicts()
        return counts

    def heard_again(self, member: str, now: float) -> bool:
        """``member`` sent again the report :meth:`heartbeat` counted last, within the same quorum: it is alive at
        ``now`` and nothing else changes. False (nothing done) unless it is a live member: then the report is read in
        full. Most heartbeats repeat the last one (a member heartbeats several times per step, and not at all
        differently while it waits for a quorum): reading them in full held the loop from quorum requests."""
        record = self.state.membership.get(member)
        if record is None or not record.alive:
            return False
        self.touch(member, now)
        self.take_verdicts()
        return True

    def leave(
        self,
        member: str,
        now: float,
        applied_step: int | None = None,
        digest: str | None = None,
        weights: Mapping[str, Any] | None = None,
    ) -> None:
        """A clean exit: ``member`` is dead at once, after its last ``applied_step`` (with ``digest`` and
        ``weights``) counts as a heartbeat."""
        record = self.state.membership.get(parse_member(member))
        if record is None:
            raise RequestError(404, f"member {member!r} is not known to the lighthouse", field="member")
        if applied_step is not None and record.alive:
            self.heartbeat(member, applied_step, now, digest, weights)
        record.connected = False
        if record.alive:
            self.mark_dead(member, now, "left")
            record.left = True
        self.state.registry.identities.leave(
            member
        )  # this incarnation has no more say (its late heartbeats are refused)

    def ask(self, request: QuorumRequest, now: float) -> Formation | None:
        """Register a quorum request; returns the quorum at once if this very request was already answered.

        Raises ``RequestError`` (and changes nothing) for a stale quorum id, a
        member not in the quorum asking as a survivor, or an impossible step;
        the survivor also loses its own older survivor ask, told to join
        (:meth:`_drop_stale_ask`).
        """
        formation = self.state.formation_for(request) or self.state.former.confirm(request)
        if formation is not None:
            self.touch(request.member, now)
            return formation
        if self.state.former.from_source(request):
            self.state.former.withdraw()  # it does not fit what the quorum formed ahead presumed of it
        try:
            self._check_request(request)
        except RequestError as error:
            if error.status == 409:
                self._drop_stale_ask(request.member)
            raise
        record = self.touch(request.member, now)
        if request.reason != "join":
            record.report(request.applied_step)
            self.state.commits.progress(self.state.roster, request.member, request.applied_step, request.weights)
        self.state.asks.add(request, now, self.state.roster.counts(request.member))
        self.state.reach.report(request.member, request.quorum_id, request.unreachable, now)
        self.take_verdicts()
        return None

    def take_verdicts(self) -> None:
        """Record the steps of reports verified after the events that made them (their replay took slices)."""
        for report in self.state.commits.take_counted():
            record = self.state.membership.get(report.member)
            if record is not None and (record.applied_step is None or record.applied_step < report.step):
                record.report(report.step)
            self.state.commits.progress(self.state.roster, report.member, report.step, report.weights)

    def tick(self, now: float) -> Formation | None:
        """Expire heartbeats and join timeouts, forget long-dead members, verify a slice of a report's replay; form
        the next quorum when the rules allow."""
        self.state.commits.work(self.state.roster)
        self.take_verdicts()
        for name in self.state.membership.expired(now):
            self.mark_dead(name, now, "heartbeat timeout")
        for forgotten in self.state.membership.forget_dead(self.state.roster):
            self.state.registry.identities.forget(forgotten)
        if now - self._hung_checked >= min(HUNG_CHECK_S, self.state.join_timeout / 10) or now < self._hung_checked:
            self._hung_checked = now
            self._detect_hung(now)
        return self.state.try_form(now)

    def _detect_hung(self, now: float) -> None:
        """Evict quorum members that live peers wait on (they are ahead) with no progress for ``join_timeout``.

        The member's heartbeat lives but its main loop does not: its peers are
        blocked in a collective on it. Evicting it breaks the quorum, so the
        peers are told at once and re-form without it (failure reason ``hung``).
        A member being healed is not compared; one at a boundary (asking) or
        whose report is being verified is not known to be behind.
        """
        quorum = self.state.roster.quorum
        if quorum is None:
            return
        verifying = self.state.commits.verifying()
        for member in self.state.membership.hung(
            quorum.members,
            lambda m: self.state.roster.counts(m) and m not in self.state.commits.healing,
            lambda m: m in self.state.asks or m in verifying,
            now,
            self.state.join_timeout,
        ):
            self.state.roster.evict(member)
            self.state.roster.down_at = now
            self.state.history.failure(member, now, "hung", in_quorum=True)

    def _drop_stale_ask(self, member: str) -> None:
        """Forget ``member``'s pending survivor ask once it is told to join again (409).

        Its long poll ended (408) and the ask stayed, matching a retry of the
        same request; a left-out member's retry is refused instead, and until
        its join arrives the old ask would count it into a quorum formed
        meanwhile (its cuts ended), a quorum it would never hear of: the
        others would wait for it in the quorum's store (10 s, then a failed
        start).
        """
        ask = self.state.asks.get(member)
        if (
            ask is not None
            and ask.request.reason != "join"
            and (member not in self.state.roster or member in self.state.roster.evicted)
        ):
            self.state.asks.pop(member)

    def _check_request(self, request: QuorumRequest) -> None:
        quorum = self.state.roster.quorum
        if request.reason == "join":
            # every report a quorum member makes commits at once, so nothing known is past the ledger's step
            limit = self.state.hosted.step + (1 if quorum is not None else 0)
            if request.applied_step > limit:
                raise RequestError(
                    422,
                    f"applied_step {request.applied_step} is impossible for a join: the ledger is at step "
                    f"{self.state.hosted.step} and nothing known is past it (was the lighthouse "
                    "restarted without its --state file? restart it on that file to go on)",
                    field="applied_step",
                )
            return
        if quorum is None:
            raise RequestError(
                409, f"no quorum has formed yet: ask with reason 'join', not {request.reason!r}", field="reason"
            )
        if request.member not in self.state.roster or request.member in self.state.roster.evicted:
            raise RequestError(
                409,
                f"member {request.member!r} is not (or no longer) in quorum {quorum.quorum_id}: "
                "ask again with reason 'join'",
                field="member",
                quorum_id=quorum.quorum_id,
                members=list(quorum.members),
            )
        if request.quorum_id != quorum.quorum_id and not self.state.former.from_source(request):
            raise RequestError(
                409,
                f"quorum_id {request.quorum_id} is stale: the current quorum is {quorum.quorum_id}",
                field="quorum_id",
                quorum_id=quorum.quorum_id,
                members=list(quorum.members),
            )
        if not self.state.commits.verify(
            self.state.roster, request.member, request.applied_step, request.digest, request.weights
        ):
            raise RequestError(
                503,
                f"the lighthouse is verifying the ledger up to applied_step {request.applied_step} (its replay "
                "goes on in slices); ask again",
                code="catching_up",
                retry=True,
            )

    def touch(self, member: str, now: float) -> MemberRecord:
        record = self.state.membership.touch(member, now)
        self.state.roster.revived(member)
        return record

    def mark_dead(self, member: str, now: float, reason: str) -> None:
        self.state.membership.mark_dead(member)
        self.state.roster.died(member)
        self.state.roster.down_at = now
        self.state.asks.pop(member)
        self.state.answered.pop(member, None)
        in_quorum = member in self.state.roster
        if reason == "left":
            self.state.history.departure(member, now, in_quorum=in_quorum)
        else:
            self.state.history.failure(member, now, reason, in_quorum=in_quorum)

    def register(
        self,
        member: str,
        incarnation: str,
        now: float,
        plan: EpochPlan | None = None,
        current: tuple[object, object] | None = None,
    ) -> str:
        """Register ``incarnation`` of ``member`` and return its new secret.

        A first registration counts as a sign of life (the process heartbeats
        next). A new incarnation of a member still alive needs ``current``,
        the live incarnation and its secret: it then marks the old one dead at
        once (failure reason ``restarted``) and the old secret stops working;
        without them the answer is 409 ``member_alive`` (``retry_after``: when
        the old one is dead by heartbeat, if it stays silent), so that nobody
        holding only the token can evict a live member. ``plan`` is the plan
        the member trains with: a lighthouse without one adopts it (the state does); one with a
        plan refuses a different one. ``RequestError`` (nothing changes) 429
        when ``max_members`` live members are already registered or
        registrations come faster than their rate limit, 409 for a replaced or
        already registered incarnation, 409 ``plan_mismatch`` (``differences``
        names each differing field with both values) or ``no_plan`` (neither
        side has one).
        """
        member = parse_member(member)
        incarnation = parse_incarnation(incarnation)
        self.state.membership.heard(now)  # its network works: the silence of an old incarnation counts
        self.state.registry.admit(member, incarnation, now, self.state.membership, (self.state.plan, plan), current)
        secret, replaced = self.state.registry.identities.register(member, incarnation)
        if replaced is not None and self.state.membership.alive(member):
            self.mark_dead(member, now, "restarted")
        if replaced is not None and member in self.state.roster:
            self.state.roster.evict(member)
            self.state.roster.down_at = now
        elif replaced is None:
            self.touch(member, now)
        return secret

    def record_checkpoint(self, body: Any, now: float) -> CheckpointRecord:
        """A member wrote a durable checkpoint: keep it if it is newer and its ledger is the one committed.

        Only the current quorum's checkpoint writer (its rank 0, while it
        counts for the quorum) may report: a worker loads what the lighthouse
        announces, and DCP's metadata is pickled. Raises ``RequestError``
        (nothing changes) for a malformed report, a reporter that is not the
        writer (403 ``not_writer``), a ledger that differs from the one
        committed at that step (422) or a step not committed yet (409: report
        again later).
        """
        record = parse_checkpoint_report(body, self.state.hosted.ledger.plan, now)
        quorum = self.state.roster.quorum
        writer = None if quorum is None else quorum.members[0]
        if record.member != writer or not self.state.roster.counts(record.member):
            raise RequestError(
                403,
                f"member {record.member!r} is not the checkpoint writer of the current quorum (its rank 0, "
                f"{writer!r}): only the writer reports checkpoints",
                field="member",
                code="not_writer",
            )
        vouch(record, self.state.hosted.step, self.state.hosted.digests)
        if self.state.checkpoint is None or record.step > self.state.checkpoint.step:
            self.state.checkpoint = record
            self.state.history.checkpoint()
        return self.state.checkpoint
