"""The lighthouse's state machine: the quorum formation policy, composing parts with one job each.

:class:`LighthouseState` is the entry point for the events that drive the
policy (when a quorum forms, whom it keeps, which step it starts at, who is
healed); ``intake`` (:mod:`~stalwart.coord.intake`) applies members' events
to the parts, ``former`` (:mod:`~stalwart.coord.former`) forms quorums. Its
parts are public attributes:

- ``registry`` (:mod:`~stalwart.coord.registry`): identities and the rules a
  registration must pass (the plan, ``max_members``, a live member's secret,
  the rate);
- ``membership`` (:mod:`~stalwart.coord.membership`): liveness, and hung
  members;
- ``commits`` (:mod:`~stalwart.coord.commits`, :mod:`~stalwart.coord.catch_up`):
  the ledger of record and what commits it, reports verified by replay in
  slices of bounded work, healing;
- ``roster`` (:mod:`~stalwart.coord.roster`): the current quorum and who still
  counts for it; ``asks`` (:mod:`~stalwart.coord.pending`): the waiting
  requests; ``formation`` (:mod:`~stalwart.coord.formation`): the last quorum
  formed and its answers; ``history`` (:mod:`~stalwart.coord.history`);
- status (:mod:`~stalwart.coord.status`) and persistence
  (:mod:`~stalwart.coord.snapshot`) read those parts, handed to them as plain
  dataclasses (:meth:`LighthouseState.parts`). What a save writes follows
  from what changed: the persisted parts, this state included, are
  :class:`~stalwart.coord.tracked.Tracked` (every change stamps them), and
  ``saver`` compares their stamps with those it saved last; no mutation
  marks itself.

The wire formats are :mod:`~stalwart.coord.protocol`'s (and the field
parsers :mod:`~stalwart.coord.wire`'s); the public names of the parts stay
importable from here.

Pure: no I/O and no clock. Every event carries the time ``now`` (seconds, any
origin), so the rules of ``docs/protocol.md`` run in microseconds in tests.

Cost, with M members: a heartbeat, a request that forms nothing, a death and
:meth:`LighthouseState.try_form` take constant time (commits aside: each
replays one step of the ledger); forming a quorum, :meth:`~LighthouseState.tick`
(hung members) and ``to_status`` are linear. So a failure of many members at
once is handled in time linear in M, and forms one quorum. While members are
cut from one another, :meth:`~LighthouseState.try_form` also costs what the
cuts touch.

Liveness
    A member is alive while its heartbeat socket is open and it sent something
    (a heartbeat or a quorum request) within ``heartbeat_timeout``. A closed
    socket, a timeout or a ``leave`` makes it dead; a later heartbeat or
    request revives it (a SIGSTOPped process that resumes), but a quorum
    formed without it stays formed. Silence is evidence only while the
    lighthouse hears others: when every member goes silent together the
    lighthouse is the one cut off, and waits up to ``outage_timeout`` for them
    to come back (the rules: :mod:`~stalwart.coord.membership`); members that
    come back are alive again, with no failure counted.

Quorums
    The next quorum forms when every member of the current quorum has asked or
    is dead (or ``join_timeout`` passed since the first of them asked: the
    others are *excluded*), the askers from the quorum are a majority of its
    members that are not dead, and the new quorum has ``min_replicas``
    members, unless it keeps a member of the current quorum that holds the
    job's state: then it forms whatever its size (survivors carry on below
    ``min_replicas``; it gates the first quorum and a quorum of newcomers
    only, and not once the job ended: when every member of the last quorum
    left cleanly a late joiner is answered at once, alone at the final step,
    and finds the job finished). The first quorum also waits for ``start_replicas`` members (the
    fleet being launched), up to ``join_timeout`` after the first request. A
    *failure* quorum (a survivor at the target step asked with ``failure``)
    keeps the survivors only: they take the dead members' in-flight positions
    of that step. A *boundary* quorum (and the first one)
    also admits joiners, in order of arrival, after waiting up to
    ``join_timeout`` for every live member to ask. A quorum none of whose
    members is at the target step (it would have to resume from a checkpoint,
    or lose the state) never forms while a live member of the current quorum
    that holds the state has not asked: nobody excludes it, the others wait.
    With ``ahead_settle`` a broken quorum's failure quorum forms from the
    survivors' last counted reports once the deaths settled, before they ask;
    a request that fits what it presumed is answered at once, one that does
    not withdraws it and the requests decide (:mod:`~stalwart.coord.former`).

Reachability
    Members name the peers they could not reach (``unreachable``); the
    quorum keeps the largest set of candidates that reach one another,
    holders of the state first, and leaves out the rest without counting a
    failure; while it leaves out a member of the current quorum it waits up
    to ``unreachable_wait`` past the join timeout for the silent members it
    keeps, so a member cut off from the others never forms a quorum alone in
    place of them (:mod:`~stalwart.coord.reachability`; ``reach``).

The ledger
    The hosted :class:`~stalwart.data.DataLedger` is kept committed through
    ``step`` (the number of steps any live quorum member applied), plus a
    :class:`StepRecord` of how the step in progress began when a quorum
    formed in it (members, then failures and reassigns), and a one-deep
    snapshot of the state before the last commit for the rollback case: a
    member that applied a step died before any survivor did, so the step is
    recomputed. Catching up replays ``begin_step(quorum.members)`` and
    ``commit()``, exactly what every member does on the fast path. With
    ``balance_every`` the ledger is balanced: reports that commit steps carry
    the reporter's weights record, which the catch-up records at its step
    (see :mod:`~stalwart.coord.hosted_ledger`).

Healing
    Members asking at a step below ``A`` (or joiners above it) are healed from
    the lowest-rank member at ``A``; at start-up every member but rank 0 is
    healed from rank 0, so that all begin from the same parameters however
    each process initialised its model (``source_rank`` is None when no member
    holds step ``A``: the state is lost and must come from a checkpoint).
    Until a target reports step ``A`` its heartbeats (sent before the heal)
    do not count towards commits.

Refusals (``RequestError``, nothing changes)
    A ``failure``/``reconfigure`` request from a member that is not in the
    current quorum, or with another ``quorum_id``, is stale (409; the body
    names the current quorum: ask again with ``join``). A ``join`` more than
    one step past anything known (the ledger or a live quorum member's
    report) is impossible (422). A quorum member's step may run ahead of the
    ledger (heartbeats lag fast steps) but not by more than ``MAX_CATCH_UP``;
    its digest is verified by a replay in slices (a request waiting on one is
    503 ``catching_up``, asked again).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stalwart._validate import check_bool, check_int
from stalwart.coord import snapshot, status
from stalwart.coord.checkpoints import CheckpointRecord
from stalwart.coord.commits import MAX_CATCH_UP, CommitListener, Commits
from stalwart.coord.formation import Formation
from stalwart.coord.former import Former
from stalwart.coord.history import HISTORY_LIMIT, History
from stalwart.coord.hosted_ledger import HostedLedger, StepRecord
from stalwart.coord.intake import Intake
from stalwart.coord.membership import DEFAULT_OUTAGE_TIMEOUT, MemberRecord, Membership
from stalwart.coord.pending import Pending
from stalwart.coord.protocol import QuorumRequest, ledger_digest
from stalwart.coord.reachability import Reachability
from stalwart.coord.registry import NO_PLAN, Registry
from stalwart.coord.roster import Quorum, Roster
from stalwart.coord.snapshot import Changes, Parts, Restored, Saver
from stalwart.coord.tracked import Tracked, TrackedDict
from stalwart.coord.wire import (
    REASONS,
    RequestError,
    check_seconds,
    parse_digest,
    parse_heartbeat,
    parse_member,
    parse_report,
    parse_step,
    parse_weights,
)
from stalwart.data.plan import EpochPlan

__all__ = [
    "HISTORY_LIMIT",
    "MAX_CATCH_UP",
    "REASONS",
    "Formation",
    "LighthouseState",
    "MemberRecord",
    "Quorum",
    "QuorumRequest",
    "RequestError",
    "StepRecord",
    "check_seconds",
    "ledger_digest",
    "parse_digest",
    "parse_heartbeat",
    "parse_member",
    "parse_report",
    "parse_step",
    "parse_weights",
]

MAX_MEMBERS = 4096
"""Default cap on live members (``max_members``)."""
UNREACHABLE_WAIT_S = 30.0
"""Default ``unreachable_wait``: three times the workers' default ``rendezvous_timeout`` (10 s)."""
CUT_MAX_TTL = 12
"""A cut's longest time to live, in join timeouts (its first is one join timeout; see ``reachability``)."""


class LighthouseState(Tracked):
    """Membership, liveness, pending quorum requests, the current quorum and the hosted ledger.

    ``on_commit(epoch, step, positions)`` is called for every step the hosted
    ledger commits (a rolled-back step is committed again later). A persisted
    part itself (:mod:`~stalwart.coord.tracked`): assigning the quorum, its
    answers or the checkpoint stamps it.
    """

    UNTRACKED = frozenset({"former", "intake", "saver"})

    def __init__(
        self,
        plan: EpochPlan | None,
        min_replicas: int = 1,
        heartbeat_timeout: float = 2.0,
        join_timeout: float = 5.0,
        *,
        start_replicas: int | None = None,
        on_commit: CommitListener | None = None,
        max_members: int = MAX_MEMBERS,
        require_digest: bool = False,
        balance_every: int = 0,
        unreachable_wait: float = UNREACHABLE_WAIT_S,
        outage_timeout: float = DEFAULT_OUTAGE_TIMEOUT,
        ahead_settle: float | None = None,
    ) -> None:
        if plan is not None and not isinstance(plan, EpochPlan):
            raise TypeError(f"plan must be an EpochPlan or None, got {type(plan).__name__}")
        self.min_replicas = check_int("min_replicas", min_replicas, minimum=1)
        self.start_replicas = check_int(
            "start_replicas", min_replicas if start_replicas is None else start_replicas, minimum=self.min_replicas
        )
        self.heartbeat_timeout = check_seconds("heartbeat_timeout", heartbeat_timeout)
        self.join_timeout = check_seconds("join_timeout", join_timeout)
        self.max_members = check_int("max_members", max_members, minimum=1)
        self.unreachable_wait = check_seconds("unreachable_wait", unreachable_wait)
        """How long past ``join_timeout`` a quorum that leaves out a member of the current quorum for its cuts waits
        for the silent members it keeps (they may still sit in the rendezvous the cut-off member gave up on)."""
        self.reach = Reachability(self.join_timeout, CUT_MAX_TTL * self.join_timeout)
        """The cuts members reported (``docs/protocol.md``, "Reachability"); not persisted."""
        self.registry = Registry(self.max_members, self.heartbeat_timeout)
        """The identities of every member and the rules new registrations must pass."""
        self.saver = Saver()
        """What changed since the last save (:meth:`changes`)."""
        self._balance_every = check_int("balance_every", balance_every, minimum=0)
        self.commits = Commits(
            None if plan is None else HostedLedger(plan, self._balance_every),
            require_digest=check_bool("require_digest", require_digest),
        )
        """The ledger of record and what commits it (reports verified by replay in bounded slices, healing)."""
        self.commits.on_commit = on_commit
        self.checkpoint: CheckpointRecord | None = None
        self.roster = Roster()
        self.membership = Membership(self.heartbeat_timeout, check_seconds("outage_timeout", outage_timeout))
        self.asks = Pending()
        self.formation: Formation | None = None
        self.answered: TrackedDict[str, QuorumRequest] = TrackedDict(keys=True)
        """The requests the current quorum answered (saved a row each, as they change)."""
        self.history = History()
        self.former = Former(self, None if ahead_settle is None else check_seconds("ahead_settle", ahead_settle))
        """The formation policy (:mod:`~stalwart.coord.former`): when the next quorum forms, whom it keeps."""
        self.intake = Intake(self)
        """Members' events applied to the parts (:mod:`~stalwart.coord.intake`)."""

    # --- read-only views -------------------------------------------------------------------------

    @property
    def revision(self) -> int:
        """Grows with every change that must be persisted (commits, quorums, history, registrations)."""
        return snapshot.revision(self.parts())

    @property
    def require_digest(self) -> bool:
        """Refuse reports that would commit steps without a ledger digest (the server sets it)."""
        return self.commits.require_digest

    @property
    def on_commit(self) -> CommitListener | None:
        """Called with ``(epoch, step, positions)`` for every step the hosted ledger commits."""
        return self.commits.on_commit

    @on_commit.setter
    def on_commit(self, listener: CommitListener | None) -> None:
        self.commits.on_commit = listener

    @property
    def plan(self) -> EpochPlan | None:
        """The job's plan: as configured, or adopted from the first member that offered one (None until then)."""
        return None if self.commits.hosted is None else self.commits.hosted.ledger.plan

    @property
    def hosted(self) -> HostedLedger:
        """The ledger of record; every request that needs it comes after a registration, which needs a plan."""
        if self.commits.hosted is None:
            raise RequestError(409, NO_PLAN, code="no_plan")
        return self.commits.hosted

    @property
    def quorum(self) -> Quorum | None:
        """The current quorum (None before the first one)."""
        return self.roster.quorum

    @property
    def step(self) -> int:
        """Steps the hosted ledger has committed."""
        return self.hosted.step

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The latest failures (``HISTORY_LIMIT`` at most)."""
        return self.history.failures

    @property
    def departures(self) -> list[dict[str, Any]]:
        """The latest clean departures."""
        return self.history.departures

    @property
    def quorums(self) -> list[dict[str, Any]]:
        """The latest quorums formed."""
        return self.history.quorums

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """The latest recoveries (a failure followed by a quorum)."""
        return self.history.recoveries

    @property
    def counts(self) -> dict[str, int]:
        """All-time counts of failures, recoveries, quorums, departures and rollbacks."""
        return self.history.counts

    @property
    def members(self) -> dict[str, MemberRecord]:
        """Every member seen, by id (read-only use)."""
        return self.membership.records

    @property
    def live_members(self) -> int:
        """How many members are alive."""
        return self.membership.live

    @property
    def asking(self) -> int:
        """How many quorum requests wait for the next quorum."""
        return len(self.asks)

    @property
    def pending(self) -> dict[str, QuorumRequest]:
        """The quorum requests waiting for the next quorum, by member."""
        return {member: ask.request for member, ask in self.asks.items()}

    @property
    def reconfigure_pending(self) -> bool:
        """True while a joiner waits or a member of the quorum is dead: its members should come to a boundary."""
        if self.roster.quorum is None:
            return False
        # every waiting request but the survivors' (failure or reconfigure from the quorum) is a joiner's; a joiner
        # cut from a member of the quorum would be left out again: it calls nobody to a boundary until its cuts end
        return self.roster.broken or len(self.asks) - self.asks.survivors > self.former.held_out_asking()

    @property
    def quorum_broken(self) -> bool:
        """True while a member of the current quorum is dead: its collectives cannot complete."""
        return self.roster.broken

    @property
    def broken_by(self) -> list[str]:
        """The members of the current quorum that no longer count (dead, hung or restarted), in rank order, at most
        ``NAMED_DOWN`` (the leader first when it is one): the broken-quorum notice names them, so that a survivor
        can say whom it lost."""
        return self.roster.down

    def should_reconfigure(self, member: str) -> bool:
        """Whether ``member``'s heartbeat should be answered with ``{"type": "reconfigure"}``.

        Not once it asks for the next quorum: it is at the boundary already.
        """
        return member in self.roster and member not in self.asks and self.reconfigure_pending

    def left_out(self, member: str) -> bool:
        """Whether ``member`` is alive but neither in the current quorum nor asking to join it.

        Its heartbeat is answered with ``{"type": "reconfigure", "left_out": true}`` so that a member the
        quorum went on without (excluded while it trained alone, say) stops and joins again.
        """
        return (
            self.roster.quorum is not None
            and member not in self.roster
            and member not in self.asks
            and self.membership.alive(member)
        )

    def ledger_state(self) -> dict[str, Any]:
        """The ledger as the members see it: in the step in progress when a quorum formed in it, else committed."""
        return self.hosted.ledger_state()

    def formation_for(self, request: QuorumRequest) -> Formation | None:
        """The current quorum if it was formed for exactly this request (a retried long poll)."""
        if self.formation is None or self.answered.get(request.member) != request:
            return None
        return self.formation

    def answer_for(self, request: QuorumRequest) -> dict[str, Any] | None:
        """The current quorum's (wire 1) answer if it was formed for exactly this request."""
        formation = self.formation_for(request)
        return None if formation is None else formation.answer(request.member)

    def expect_quorum(self, now: float) -> None:
        """Count the quorum's members as alive and seen at ``now``: after a restart they get
        ``heartbeat_timeout`` to reconnect their heartbeat sockets. A member that left cleanly stays gone (the
        job may have ended: no heartbeat timeout counts it as failed)."""
        quorum = self.roster.quorum
        for member in quorum.members if quorum else ():
            if self.registry.identities.has_left(member):
                self.membership[member].left = True
                continue
            self.membership.expect(member, now)
            self.roster.revived(member)

    # --- identity --------------------------------------------------------------------------------

    def register(
        self,
        member: str,
        incarnation: str,
        now: float,
        plan: EpochPlan | None = None,
        current: tuple[object, object] | None = None,
    ) -> str:
        """Register ``incarnation`` of ``member`` and return its new secret (the rules, and the refusals:
        :meth:`~stalwart.coord.intake.Intake.register`); a lighthouse without a plan adopts ``plan``."""
        secret = self.intake.register(member, incarnation, now, plan, current)
        if self.commits.hosted is None:
            assert plan is not None  # the registry refused a registration without one
            self.commits.hosted = HostedLedger(plan, self._balance_every)
        return secret

    def authenticate(self, member: str, incarnation: object, secret: object) -> None:
        """``RequestError`` 403 unless ``incarnation`` and ``secret`` are ``member``'s current ones; 410 ``left``
        once that incarnation left."""
        self.registry.identities.check(member, incarnation, secret)

    @property
    def balance_every(self) -> int:
        """Every how many steps the members rebalance their shares (0: shares are equal)."""
        hosted = self.commits.hosted
        return self._balance_every if hosted is None else hosted.ledger.balance_every

    def incarnation(self, member: str) -> str | None:
        """The registered incarnation of ``member`` (None if none)."""
        return self.registry.incarnation(member)

    # --- events ----------------------------------------------------------------------------------

    def connected(self, member: str, now: float) -> None:
        """``member`` opened its heartbeat socket (:meth:`~stalwart.coord.intake.Intake.connected`)."""
        self.intake.connected(member, now)

    def disconnected(self, member: str, now: float, *, reconnecting: bool = False) -> None:
        """``member``'s heartbeat socket closed (:meth:`~stalwart.coord.intake.Intake.disconnected`)."""
        self.intake.disconnected(member, now, reconnecting=reconnecting)

    def heartbeat(
        self,
        member: str,
        applied_step: int,
        now: float,
        digest: str | None = None,
        weights: Mapping[str, Any] | None = None,
    ) -> bool:
        """``member`` reports ``applied_step`` (:meth:`~stalwart.coord.intake.Intake.heartbeat`); True when the
        report counted at once."""
        return self.intake.heartbeat(member, applied_step, now, digest, weights)

    def heard_again(self, member: str, now: float) -> bool:
        """``member`` repeated its last counted report (:meth:`~stalwart.coord.intake.Intake.heard_again`)."""
        return self.intake.heard_again(member, now)

    def leave(
        self,
        member: str,
        now: float,
        applied_step: int | None = None,
        digest: str | None = None,
        weights: Mapping[str, Any] | None = None,
    ) -> None:
        """A clean exit (:meth:`~stalwart.coord.intake.Intake.leave`)."""
        self.intake.leave(member, now, applied_step, digest, weights)

    def record_checkpoint(self, body: Any, now: float) -> CheckpointRecord:
        """A member wrote a durable checkpoint: keep it if it is newer and its ledger is the one committed
        (:meth:`~stalwart.coord.intake.Intake.record_checkpoint`)."""
        return self.intake.record_checkpoint(body, now)

    def request(self, request: QuorumRequest, now: float) -> dict[str, Any] | None:
        """:meth:`ask`, with the (wire 1) answer as a dict."""
        formation = self.ask(request, now)
        return None if formation is None else formation.answer(request.member)

    def ask(self, request: QuorumRequest, now: float) -> Formation | None:
        """Register a quorum request (:meth:`~stalwart.coord.intake.Intake.ask`); the quorum at once if this very
        request was already answered."""
        return self.intake.ask(request, now)

    def reached(self, member: str, peers: Sequence[str], now: float) -> int:
        """``member``'s probe got through to ``peers`` again: the cuts between them end (``docs/protocol.md``,
        "Reachability"); how many ended. A joiner no longer cut from the quorum calls its boundary."""
        if self.membership.get(parse_member(member)) is None:
            raise RequestError(404, f"member {member!r} is not known to the lighthouse", field="member")
        return len(self.reach.reached(member, peers, now))

    def excuse_silence(self, seconds: float, now: float) -> None:
        """The lighthouse could not listen for ``seconds`` before ``now``: no member expires for that silence."""
        self.membership.excuse(seconds, now)

    def take_refusals(self) -> list[tuple[str, str]]:
        """``(member, message)`` for each report refused after the event that made it (its replay took slices)."""
        return self.commits.take_refusals()

    @property
    def catching_up(self) -> bool:
        """Whether a report's replay is in progress (:meth:`work_catch_up` advances it)."""
        return self.commits.catch_up.trial is not None

    def work_catch_up(self) -> None:
        """One more slice of the replay in progress (a few milliseconds; the server interleaves them)."""
        self.commits.work(self.roster)
        self.intake.take_verdicts()

    def tick(self, now: float) -> Formation | None:
        """Expire heartbeats and join timeouts, find hung members, verify a slice of a replay, form the next quorum
        when the rules allow (:meth:`~stalwart.coord.intake.Intake.tick`)."""
        return self.intake.tick(now)

    def try_form(self, now: float) -> Formation | None:
        """Form the next quorum if the rules allow at ``now`` (:meth:`~stalwart.coord.former.Former.try_form`)."""
        return self.former.try_form(now)

    # --- status and persistence (stalwart.coord.status, stalwart.coord.snapshot) ------------------

    def member_state(self, member: str) -> str:
        """``alive`` (in the quorum), ``joining`` (alive, not in it), ``left`` (it finished cleanly) or ``dead``."""
        return status.member_state(self.membership[member], member in self.roster)

    def to_status(self, now: float | None = None) -> dict[str, Any]:
        """One JSON-able dict of everything a dashboard shows (``plan`` null, the ledger at zero: none adopted yet)."""
        parts = status.StatusParts(
            self.membership,
            self.roster,
            self.asks,
            self.commits.healing,
            self.commits.hosted,
            self.plan,
            self.checkpoint,
            self.history,
            self.reach,
            self.min_replicas,
            self.reconfigure_pending,
        )
        return status.status(parts, now)

    def parts(self) -> Parts:
        """The persisted parts, for the save (:mod:`~stalwart.coord.snapshot`)."""
        return Parts(
            self.stamp,
            self.commits,
            self.history,
            self.registry.identities,
            self.membership.records,
            self.roster.quorum,
            self.formation,
            self.answered,
            self.checkpoint,
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; ``from_state_dict`` resumes it in a restarted lighthouse."""
        return snapshot.state_dict(self.parts())

    @property
    def unsaved(self) -> bool:
        """Whether anything changed since the last :meth:`changes` (constant time)."""
        return self.saver.unsaved(self.parts())

    def changes(self) -> Changes:
        """What changed since the last call, for the store; hand it back to :meth:`requeue` if it was not saved."""
        return self.saver.take(self.parts())

    def requeue(self, changes: Changes) -> None:
        """``changes`` could not be saved: the next :meth:`changes` includes them again."""
        self.saver.requeue(self.parts(), changes)

    @classmethod
    def from_state_dict(
        cls,
        state: Mapping[str, Any],
        *,
        now: float,
        min_replicas: int = 1,
        start_replicas: int | None = None,
        heartbeat_timeout: float = 2.0,
        join_timeout: float = 5.0,
        on_commit: CommitListener | None = None,
        max_members: int = MAX_MEMBERS,
        require_digest: bool = False,
        unreachable_wait: float = UNREACHABLE_WAIT_S,
        ahead_settle: float | None = None,
    ) -> LighthouseState:
        """Resume from ``state_dict()``: the quorum's members count as alive (seen at ``now``) unless they left
        cleanly, others as dead; no
        member is cut from another (cuts are not persisted: a cut-off member is reported again at its next failure).

        A state of version 1 or 2 resumes without its last formation: a member whose answer was lost asks again and is
        told to join.
        """
        saved = snapshot.parse(state)
        restored = cls(
            saved.hosted.ledger.plan,
            min_replicas,
            heartbeat_timeout,
            join_timeout,
            start_replicas=start_replicas,
            on_commit=on_commit,
            max_members=max_members,
            require_digest=require_digest,
            unreachable_wait=unreachable_wait,
            ahead_settle=ahead_settle,
        )
        restored.restore(saved, now)
        return restored

    def restore(self, saved: Restored, now: float) -> None:
        """Put the parts of a persisted state in place (a new state built with its plan); see :meth:`from_state_dict`.
        The next :meth:`changes` writes every part."""
        self.commits.hosted = saved.hosted
        for name, applied_step in saved.members.items():
            self.membership.restore(name, applied_step, now)
        if saved.quorum is not None:
            self.roster = Roster(saved.quorum, dead=saved.quorum.members)
        if saved.identities is not None:
            self.registry.identities = saved.identities
        self.expect_quorum(now)
        self.formation = saved.formation
        self.answered = TrackedDict(saved.answered, keys=True)
        self.commits.heal(saved.healing, saved.heal_step)
        self.history = saved.history
        self.checkpoint = saved.checkpoint
        self.saver = Saver()
