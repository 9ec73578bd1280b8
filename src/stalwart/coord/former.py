"""The quorum formation policy: when the next quorum forms, whom it keeps, at which step, and who is healed. Pure.

The rules are ``docs/protocol.md``'s and :mod:`~stalwart.coord.quorum`'s
("Quorums", "Reachability", "Healing"): a quorum forms once every member of
the current one asked or is dead (or ``join_timeout`` passed: the others are
excluded), ``min_replicas`` and ``start_replicas`` hold back a quorum that
carries no state on, cuts leave out the members that cannot reach the rest,
and no quorum forms that would lose the state while a member holding it lives.
A broken quorum's failure quorum may form ahead of its survivors' requests,
from their last counted reports (``docs/protocol.md``, "Forming a failure
quorum ahead"); a request that does not fit what it presumed withdraws it.

:class:`Former` reads the lighthouse state's parts (:class:`FormingState`,
what :class:`~stalwart.coord.quorum.LighthouseState` holds) and, when a
quorum forms, puts the new roster, formation and answers in place.
"""

from __future__ import annotations

from typing import Any, Protocol

from stalwart.coord.checkpoints import CheckpointRecord
from stalwart.coord.commits import Commits
from stalwart.coord.formation import Ahead, Formation, MemberDelta
from stalwart.coord.history import History
from stalwart.coord.hosted_ledger import HostedLedger
from stalwart.coord.membership import Membership
from stalwart.coord.pending import Pending
from stalwart.coord.protocol import QuorumRequest
from stalwart.coord.reachability import Reachability, choose
from stalwart.coord.roster import Quorum, Roster
from stalwart.coord.tracked import TrackedDict


class FormingState(Protocol):
    """The parts of the lighthouse's state the formation policy reads, and those a formation replaces."""

    min_replicas: int
    start_replicas: int
    join_timeout: float
    unreachable_wait: float
    asks: Pending
    roster: Roster
    commits: Commits
    membership: Membership
    reach: Reachability
    history: History
    checkpoint: CheckpointRecord | None
    formation: Formation | None
    answered: TrackedDict[str, QuorumRequest]

    @property
    def hosted(self) -> HostedLedger: ...


class Former:
    """Forms the next quorum of ``state`` when the rules allow (:meth:`try_form`).

    ``ahead_settle``: seconds after the last member of a broken quorum stopped
    counting before its failure quorum forms ahead of the survivors' requests
    (None: never ahead; ``docs/protocol.md``, "Forming a failure quorum ahead").
    """

    def __init__(self, state: FormingState, ahead_settle: float | None = None) -> None:
        self.state = state
        self.ahead_settle = ahead_settle
        self._held: tuple[tuple[int, int], frozenset[str]] = ((-1, -1), frozenset())
        self._presumed: tuple[int, int] = (-1, -1)
        """The broken quorum (its id, how many members counted) a formation ahead was last tried for."""
        self._confirming: tuple[Formation | None, set[str]] = (None, set())
        """The members of the quorum formed ahead that have not confirmed what it presumed (cached per formation)."""

    def try_form(self, now: float) -> Formation | None:
        """Form the next quorum if the rules allow at ``now``; constant time unless it forms (or a failure waits, or
        cuts touch the candidates: then what they touch)."""
        pending, roster = self.state.asks, self.state.roster
        ahead = self._form_ahead(now)
        if ahead is not None or not len(pending):
            return ahead
        if not pending.ours:
            self.state.reach.expire(
                now
            )  # never while a quorum waits for its members (the cuts decide whom it waits for)
        # Some member of the quorum must ask (only joiners wait: nothing forms, whatever the cuts).
        if roster.counting and not pending.ours:
            return None
        since = pending.first_time()
        patient = now - since < self.state.join_timeout + self.state.unreachable_wait
        left_out = self._left_out(patient)
        cut_off_silent = sum(1 for m in left_out if roster.counts(m) and m not in pending)
        unaccounted = roster.counting - pending.ours - cut_off_silent
        timed_out = now - since >= self.state.join_timeout
        # After the join timeout the members that did not ask are excluded: they no longer count for the
        # majority rule, so the askers are the majority of what counts. While a member of the quorum is cut off the
        # others may sit in the rendezvous it gave up on: the silent members of the best set are waited for longer.
        if unaccounted and (not timed_out or (patient and any(m in roster for m in left_out))):
            return None
        carries_on = pending.survivors > 0  # at most: the walk below tells whether one of them holds the state
        size = len(pending) - (len(left_out) - cut_off_silent)
        if not pending.failures and not self._may_form(size, False, timed_out, carries_on, cut_off_silent):
            return None  # without a failure every asker joins the quorum: the counts decide, no walk needed
        return self._form_from_pending(now, timed_out, since, left_out)

    # --- forming a failure quorum ahead of its survivors' requests (docs/protocol.md) ----------------------------

    def _form_ahead(self, now: float) -> Formation | None:
        """The failure quorum of a broken quorum's survivors, formed from their last counted reports without waiting
        for their requests, or None (the requests decide, as without it).

        It forms once the deaths settled (``ahead_settle`` after the last),
        when the state of every survivor is known and consistent: no cuts, no
        report being verified, no survivor being healed, none asking to join
        or naming peers it could not reach, no member that left cleanly (a
        departure: its peers come to a boundary), and the largest step among
        them is the ledger's (else the rollback rule needs their requests). A
        survivor that asked already is kept with its request. Tried once per
        broken quorum and count of members: constant time otherwise.
        """
        roster, quorum = self.state.roster, self.state.roster.quorum
        if self.ahead_settle is None or quorum is None or not roster.broken or roster.withdrawn:
            return None
        if now - roster.down_at < self.ahead_settle or self._presumed == (quorum.quorum_id, roster.counting):
            return None
        self._presumed = (quorum.quorum_id, roster.counting)
        if self.unconfirmed() or self.state.reach.cuts or self.state.commits.catch_up.trial is not None:
            return None  # a quorum formed ahead and not confirmed never ran: its members' requests decide
        pending, records, healing = self.state.asks, self.state.membership, self.state.commits.healing
        verifying = self.state.commits.verifying()
        requests: dict[str, QuorumRequest] = {}
        presumed: dict[str, int] = {}
        for member in quorum.members:
            ask, record = pending.get(member), records.get(member)
            if not roster.counts(member):
                if record is not None and record.left:
                    return None  # a departure, not a failure: its peers come to a boundary (docs/protocol.md)
                continue
            if member in healing or member in verifying or record is None:
                return None
            if ask is not None:
                if ask.request.reason == "join" or ask.request.unreachable:
                    return None
                requests[member] = ask.request
            elif record.applied_step is None:
                return None
            else:
                presumed[member] = record.applied_step
                requests[member] = QuorumRequest(member, record.applied_step, quorum.quorum_id, "failure")
        if not requests or max(r.applied_step for r in requests.values()) != self.state.hosted.step:
            return None
        ahead = Ahead(quorum.quorum_id, quorum.members, presumed)
        return self._form(now, requests, self.state.hosted.step, "keep", True, False, [], now, [], ahead)

    def unconfirmed(self) -> set[str]:
        """The members of the current quorum, formed ahead, that have not confirmed what it presumed of them (empty
        for any other quorum). While any has not, the quorum never ran a step: each of its collectives needs them
        all. Cached per formation."""
        formation = self.state.formation
        if formation is None or formation.ahead is None:
            return set()
        if self._confirming[0] is not formation:
            answered = self.state.answered
            self._confirming = (formation, {m for m in formation.ahead.presumed if m not in answered})
        return self._confirming[1]

    def from_source(self, request: QuorumRequest) -> bool:
        """Whether ``request`` is an unconfirmed member's, naming the quorum the current one formed ahead from (a
        survivor's request of the current quorum, then)."""
        formation = self.state.formation
        return (
            formation is not None
            and formation.ahead is not None
            and request.quorum_id == formation.ahead.source
            and request.member in self.unconfirmed()
        )

    def confirm(self, request: QuorumRequest) -> Formation | None:
        """The current quorum, formed ahead, for a survivor's ``request`` that fits what it presumed of its member
        (which confirms it); None otherwise (a request that does not fit withdraws the quorum: :meth:`withdraw`).

        Peers the request names unreachable fit when the quorum left them all
        out (dead or evicted): a survivor whose collective timed out before the
        broken-quorum push reached it probes the dead member and names it.
        """
        formation = self.state.formation
        if request.reason == "join" or self.state.roster.broken:
            return None
        if formation is None or formation.ahead is None or not self.from_source(request):
            return None
        if not set(request.unreachable).isdisjoint(formation.members):
            return None  # a cut inside the quorum formed ahead is reachability's; one to a member left out is moot
        if not formation.ahead.fits(request.member, request.applied_step, formation.applied_step):
            return None
        self.unconfirmed().discard(request.member)
        self.state.answered[request.member] = request
        return formation

    def contradicts(self, member: str, applied_step: int) -> bool:
        """Whether ``member``'s report of ``applied_step`` shows the current quorum, formed ahead, presumed it wrong
        (it applied a step past the quorum's target that its last report before the failure did not show)."""
        formation = self.state.formation
        return formation is not None and applied_step > formation.applied_step and member in self.unconfirmed()

    def withdraw(self) -> None:
        """A survivor's request or report did not fit the quorum formed ahead: the quorum is broken (its members are
        told at once) and the next one forms from the survivors' requests, an unconfirmed survivor asking as a member
        of the quorum it was in."""
        if not self.state.roster.withdrawn:
            self.state.roster.withdraw()

    def _left_out(self, patient: bool) -> frozenset[str]:
        """The askers and silent members of the quorum that cuts leave out of the next quorum.

        The candidates are the askers and, while ``patient`` (until
        ``unreachable_wait`` past the join timeout), the members of the current
        quorum that count and have not asked;
        :func:`~stalwart.coord.reachability.choose` keeps the largest set of
        them that reach one another, holders of the state first. While it
        leaves out a member of the quorum, the quorum waits for the silent
        members it keeps (they may sit in the rendezvous the cut-off member
        gave up on), so a member cut off from the others never forms a
        quorum alone in place of them. Costs what the cuts touch (nothing
        without cuts).
        """
        if not self.state.reach.cuts:
            return frozenset()
        pending, roster, healing = self.state.asks, self.state.roster, self.state.commits.healing

        def holder(member: str) -> bool:
            ask = pending.get(member)
            return roster.counts(member) and member not in healing and (ask is None or ask.request.reason != "join")

        return choose(
            self.state.reach.peers,
            lambda m: m in pending or (patient and roster.counts(m)),
            holder,
            lambda m: (roster.ranks.get(m, len(roster.ranks)), m),
        ).left_out

    def held_out_asking(self) -> int:
        """How many waiting joiners are cut from a member of the current quorum (cached per cut set and quorum)."""
        if not self.state.reach.cuts:
            return 0
        quorum = self.state.roster.quorum
        key = (self.state.reach.version, 0 if quorum is None else quorum.quorum_id)
        if self._held[0] != key:
            held = frozenset(
                m
                for m, peers in self.state.reach.peers.items()
                if m not in self.state.roster and peers & self.state.roster.ranks.keys()
            )
            self._held = (key, held)
        pending = self.state.asks
        return sum(1 for m in self._held[1] if (ask := pending.get(m)) is not None and not ask.ours)

    def _may_form(self, size: int, failure: bool, timed_out: bool, carries_on: bool, cut_off: int = 0) -> bool:
        """Whether a quorum of ``size`` members may form now (``min_replicas``, ``start_replicas``, stragglers).

        ``min_replicas`` does not hold back a quorum that ``carries_on``: one
        that keeps a member of the current quorum holding the job's state. The
        survivors of a failure train on below ``min_replicas`` rather than wait
        (and lose the state if they die waiting); restarted members join them
        at the next step boundary. It gates the first quorum, and a quorum of
        newcomers only (a fleet restarted from a checkpoint). Once the job
        ended (every member of the last quorum left cleanly) neither holds a
        quorum back: nobody else is coming to train, so a late joiner is
        answered at once, alone at the final step, and finds the job finished.
        ``cut_off``: live members of the quorum that have not asked and are cut
        off (nobody waits for them).
        """
        if not size:
            return False
        if size < self.state.min_replicas and not carries_on and not self.finished_cleanly():
            return False
        if self.state.roster.quorum is None and size < self.state.start_replicas and not timed_out:
            return False
        return failure or timed_out or not self._yet_to_ask(cut_off)

    def _yet_to_ask(self, cut_off: int = 0) -> bool:
        """Whether a live member that counts (not evicted, not ``cut_off``) has not asked: a boundary quorum waits."""
        pending, alive = self.state.asks, self.state.membership.alive
        evicted_silent = sum(1 for m in self.state.roster.evicted if alive(m) and m not in pending)
        return self.state.membership.live - len(pending) - evicted_silent - cut_off > 0  # every waiting member is alive

    def _form_from_pending(
        self, now: float, timed_out: bool, since: float, left_out: frozenset[str]
    ) -> Formation | None:
        pending, roster = self.state.asks, self.state.roster
        quorum_members = roster.quorum.members if roster.quorum else ()
        asked = [m for m in quorum_members if roster.counts(m) and m in pending and m not in left_out]
        unaccounted = [m for m in quorum_members if roster.counts(m) and m not in pending]
        survivors = [m for m in asked if pending[m].request.reason != "join"]
        chosen = set(survivors)
        joiners = [m for m, _ in pending.items() if m not in chosen and m not in left_out]
        # a restarted or hung member of the quorum may come back only as a joiner; a heal target only presumed (the
        # quorum formed ahead was not confirmed) holds what it asks with
        unconfirmed = self.unconfirmed()
        trusted = [m for m in survivors if m not in self.state.commits.healing or m in unconfirmed]
        target, mode = self._target_step(trusted)
        failure = any(
            pending[m].request.reason == "failure" and pending[m].request.applied_step == target for m in trusted
        )
        members = survivors if failure else survivors + joiners
        carries_on = any(pending[m].request.applied_step == target for m in trusted)
        cut_off = [m for m in unaccounted if m in left_out]
        if not self._may_form(len(members), failure, timed_out, carries_on, len(cut_off)):
            return None
        stateless = roster.quorum is not None and not any(pending[m].request.applied_step == target for m in members)
        if stateless and any(m not in self.state.commits.healing for m in unaccounted):
            # no member of this quorum holds the job's state at the target step: never form it (and exclude the
            # members that do) while one of them lives; the joiners wait for it (a survivor alone in a slow step)
            return None
        excluded = [m for m in unaccounted if m not in left_out]
        unreachable = cut_off + [m for m, _ in pending.items() if m in left_out]
        requests = {m: pending[m].request for m in members}
        return self._form(now, requests, target, mode, failure, timed_out, excluded, since, unreachable)

    def _target_step(self, trusted: list[str]) -> tuple[int, str]:
        """``A`` and how the ledger reaches it: ``catch-up``, ``rollback`` or ``keep`` (no survivor holds more)."""
        committed = self.state.hosted.step
        if trusted:
            target = max(self.state.asks[m].request.applied_step for m in trusted)
            if target >= committed:
                return target, "catch-up"
            if target == committed - 1 and self.state.hosted.snapshot is not None:
                return target, "rollback"
        return committed, "keep"

    def _form(
        self,
        now: float,
        requests: dict[str, QuorumRequest],
        target: int,
        mode: str,
        failure: bool,
        timed_out: bool,
        excluded: list[str],
        since: float,
        unreachable: list[str],
        ahead: Ahead | None = None,
    ) -> Formation:
        """Form the quorum of ``requests``' members, in their order; members of the old one that did not ask by the
        timeout are excluded as of ``since``; ``unreachable`` members are left out because cuts keep them from it
        (no failure: they may ask again). ``ahead``: formed ahead, with the members' presumed requests."""
        previous = self.state.roster.quorum
        members = list(requests)
        # the step past a quorum formed ahead and never confirmed was begun by the quorum it formed from
        begun = previous.members if previous is not None else ()
        if self.unconfirmed() and self.state.formation is not None and self.state.formation.ahead is not None:
            begun = self.state.formation.ahead.source_members
        if mode == "catch-up":
            asked = [requests[m] for m in members if m not in self.state.commits.healing]
            reports = [r.weights for r in asked if r.reason != "join" and r.applied_step == target]
            self.state.commits.catch_up_to(self.state.roster, target, reports[0] if reports else None)
        elif mode == "rollback":
            self.state.hosted.rollback()
            self.state.history.rollback()
        checkpoint = self._resume_point(requests, target, failure)
        if checkpoint is not None:
            self._resume(checkpoint, now, previous.quorum_id + 1 if previous else 1)
            target = checkpoint.step
        if failure:
            assert previous is not None
            self.state.hosted.fail(list(begun), members)
        else:
            self.state.hosted.begin(members)
        for m in members:
            self.state.asks.pop(m)
        applied = {m: requests[m].applied_step for m in members}
        targets = [m for m in members if applied[m] != target]
        if previous is None:
            targets = [m for m in members[1:] if applied[m] == target] + targets
        at_target = [rank for rank, m in enumerate(members) if applied[m] == target]
        heal: dict[str, Any] | None = None
        if checkpoint is not None:
            heal = {"source_rank": None, "targets": targets, "checkpoint": checkpoint.announcement()}
        elif targets:
            heal = {"source_rank": at_target[0] if at_target else None, "targets": targets, "checkpoint": None}
        self.state.commits.heal({m: applied[m] > target for m in targets}, target)
        self.state.hosted.snapshot = None
        quorum_id = previous.quorum_id + 1 if previous else 1
        for member in previous.members if previous else ():
            self.state.membership[member].waited_since = None
        self.state.roster = Roster(Quorum(quorum_id, tuple(members)))
        self.state.asks.regroup(self.state.roster.counts)
        for member in excluded:
            self.state.history.failure(member, since, "excluded", in_quorum=True)
        record = self.state.hosted.record
        assert record is not None
        reason = "start-up" if previous is None else "failure" if failure else "boundary"
        delta = None
        if previous is not None:
            delta = MemberDelta.between(previous.quorum_id, previous.members, members, record.members)
        formation = Formation(
            quorum_id,
            tuple(members),
            target,
            heal,
            self.state.hosted.ledger.state_dict(),
            tuple(record.members),
            tuple(tuple(failed) for failed, _ in record.failures),
            self.state.hosted.in_step().binary_digest(),
            reason,
            now,
            timed_out,
            mode == "rollback",
            delta,
            ahead,
        )
        self.state.formation = formation
        self.state.answered = TrackedDict(
            {m: r for m, r in requests.items() if ahead is None or m not in ahead.presumed}, keys=True
        )  # what it presumed is answered once its member confirms it (:meth:`confirm`)
        self.state.history.quorum(
            quorum_id, list(members), reason, now, target, timed_out=timed_out, unreachable=unreachable,
            ahead=ahead is not None,
        )  # fmt: skip
        for member in unreachable:
            self.state.reach.renew(member, now)  # it stays out a time to live from now
        self.state.reach.prune(self.state.membership.__contains__, now)
        return formation

    def _resume_point(self, requests: dict[str, QuorumRequest], target: int, failure: bool) -> CheckpointRecord | None:
        """The checkpoint to resume from when no member of the new quorum holds the job's state at ``target``."""
        checkpoint = self.state.checkpoint
        if failure or checkpoint is None or checkpoint.step > self.state.hosted.step:
            return None
        if any(request.applied_step == target for request in requests.values()):
            return None
        if checkpoint.step < self.state.hosted.step and self.finished_cleanly():
            return None  # the job ended: its members left with the state; nothing to roll back for
        return checkpoint

    def finished_cleanly(self) -> bool:
        """Whether every member of the last quorum left cleanly (``/v1/leave``) rather than failing: the job ended
        (a whole quorum departing at a boundary leaves unannounced, as failures). Constant time unless every member
        of the quorum is gone."""
        quorum = self.state.roster.quorum
        if quorum is None or self.state.roster.counting:
            return False
        records = [self.state.membership.get(member) for member in quorum.members]
        return all(record is not None and record.left for record in records)

    def _resume(self, checkpoint: CheckpointRecord, now: float, quorum_id: int) -> None:
        """Roll the ledger back to ``checkpoint``: every step after it is trained again, once."""
        self.state.history.checkpoint_resume(quorum_id, self.state.hosted.step, checkpoint.step, checkpoint.path, now)
        self.state.hosted.restore(checkpoint.ledger)
