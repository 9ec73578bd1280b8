"""The lighthouse's state machine: the quorum formation policy, composing parts with one job each.

:class:`LighthouseState` holds the policy (when a quorum forms, whom it keeps,
which step it starts at, who is healed) and the events that drive it; its
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
from stalwart.coord.checkpoints import CheckpointRecord, parse_checkpoint_report, vouch
from stalwart.coord.commits import MAX_CATCH_UP, CommitListener, Commits
from stalwart.coord.formation import Formation, MemberDelta
from stalwart.coord.history import HISTORY_LIMIT, History
from stalwart.coord.hosted_ledger import HostedLedger, StepRecord
from stalwart.coord.identity import parse_incarnation
from stalwart.coord.membership import DEFAULT_OUTAGE_TIMEOUT, MemberRecord, Membership
from stalwart.coord.pending import Pending
from stalwart.coord.protocol import QuorumRequest, ledger_digest
from stalwart.coord.reachability import Reachability, choose
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
HUNG_CHECK_S = 0.5
"""How often, at most, :meth:`LighthouseState.tick` looks for hung members (a walk of the quorum); at least ten
times per ``join_timeout``, so a hang is found within 110% of it."""


class LighthouseState(Tracked):
    """Membership, liveness, pending quorum requests, the current quorum and the hosted ledger.

    ``on_commit(epoch, step, positions)`` is called for every step the hosted
    ledger commits (a rolled-back step is committed again later). A persisted
    part itself (:mod:`~stalwart.coord.tracked`): assigning the quorum, its
    answers or the checkpoint stamps it.
    """

    UNTRACKED = frozenset({"_held", "_hung_checked", "saver"})

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
        self._held: tuple[tuple[int, int], frozenset[str]] = ((-1, -1), frozenset())
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
        self.answered: TrackedDict[str, QuorumRequest] = TrackedDict()
        """The requests the current quorum answered."""
        self.history = History()
        self._hung_checked = float("-inf")

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
    def _hosted(self) -> HostedLedger:
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
        return self._hosted.step

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
        return self.roster.broken or len(self.asks) - self.asks.survivors > self._held_out_asking()

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
        return self._hosted.ledger_state()

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
        """Register ``incarnation`` of ``member`` and return its new secret.

        A first registration counts as a sign of life (the process heartbeats
        next). A new incarnation of a member still alive needs ``current``,
        the live incarnation and its secret: it then marks the old one dead at
        once (failure reason ``restarted``) and the old secret stops working;
        without them the answer is 409 ``member_alive`` (``retry_after``: when
        the old one is dead by heartbeat, if it stays silent), so that nobody
        holding only the token can evict a live member. ``plan`` is the plan
        the member trains with: a lighthouse without one adopts it; one with a
        plan refuses a different one. ``RequestError`` (nothing changes) 429
        when ``max_members`` live members are already registered or
        registrations come faster than their rate limit, 409 for a replaced or
        already registered incarnation, 409 ``plan_mismatch`` (``differences``
        names each differing field with both values) or ``no_plan`` (neither
        side has one).
        """
        member = parse_member(member)
        incarnation = parse_incarnation(incarnation)
        self.membership.heard(now)  # its network works: the silence of an old incarnation counts
        self.registry.admit(member, incarnation, now, self.membership, (self.plan, plan), current)
        secret, replaced = self.registry.identities.register(member, incarnation)
        if self.commits.hosted is None:
            assert plan is not None  # the registry refused a registration without one
            self.commits.hosted = HostedLedger(plan, self._balance_every)
        if replaced is not None and self.membership.alive(member):
            self._mark_dead(member, now, "restarted")
        if replaced is not None and member in self.roster:
            self.roster.evict(member)
        elif replaced is None:
            self._touch(member, now)
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
        """``member`` opened its heartbeat socket; back from the dead (its link is up again), it is cut from nobody."""
        member = parse_member(member)
        came_back = member in self.membership and not self.membership.alive(member)
        self._touch(member, now).connected = True
        if came_back:
            quorum = self.roster.quorum
            self.reach.reconnected(member, None if quorum is None else quorum.quorum_id, now)

    def disconnected(self, member: str, now: float, *, reconnecting: bool = False) -> None:
        """``member``'s heartbeat socket closed: it is dead at once (a killed process closes its sockets), unless
        ``reconnecting`` (its member closed it to open another, or it carried no heartbeat) or the socket was
        stale: its member silent for longer than ``heartbeat_timeout``. Then its silence is judged by the
        heartbeat timeout and the outage rule (``docs/protocol.md``).

        A stale socket's close tells nothing new: after an outage of the lighthouse's link, the reset of a socket
        its member gave up meanwhile arrives when the link returns, often before the member's new socket.
        """
        record = self.membership.get(member)
        if record is None:
            return
        record.connected = False
        stale = now - record.last_seen > self.heartbeat_timeout
        if record.alive and not reconnecting and not stale:
            self._mark_dead(member, now, "socket closed")

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
        counts = self.commits.verify(self.roster, member, applied_step, digest, weights)
        record = self._touch(member, now)
        if counts:  # else its replay goes on: the step is recorded once verified
            record.report(applied_step)
            self.commits.progress(self.roster, member, applied_step, weights)
        self._take_verdicts()
        return counts

    def heard_again(self, member: str, now: float) -> bool:
        """``member`` sent again the report :meth:`heartbeat` counted last, within the same quorum: it is alive at
        ``now`` and nothing else changes. False (nothing done) unless it is a live member: then the report is read in
        full. Most heartbeats repeat the last one (a member heartbeats several times per step, and not at all
        differently while it waits for a quorum): reading them in full held the loop from quorum requests."""
        record = self.membership.get(member)
        if record is None or not record.alive:
            return False
        self._touch(member, now)
        self._take_verdicts()
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
        record = self.membership.get(parse_member(member))
        if record is None:
            raise RequestError(404, f"member {member!r} is not known to the lighthouse", field="member")
        if applied_step is not None and record.alive:
            self.heartbeat(member, applied_step, now, digest, weights)
        record.connected = False
        if record.alive:
            self._mark_dead(member, now, "left")
            record.left = True
        self.registry.identities.leave(member)  # this incarnation has no more say (its late heartbeats are refused)

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
        record = parse_checkpoint_report(body, self._hosted.ledger.plan, now)
        quorum = self.roster.quorum
        writer = None if quorum is None else quorum.members[0]
        if record.member != writer or not self.roster.counts(record.member):
            raise RequestError(
                403,
                f"member {record.member!r} is not the checkpoint writer of the current quorum (its rank 0, "
                f"{writer!r}): only the writer reports checkpoints",
                field="member",
                code="not_writer",
            )
        vouch(record, self._hosted.step, self._hosted.digests)
        if self.checkpoint is None or record.step > self.checkpoint.step:
            self.checkpoint = record
            self.history.checkpoint()
        return self.checkpoint

    def request(self, request: QuorumRequest, now: float) -> dict[str, Any] | None:
        """:meth:`ask`, with the (wire 1) answer as a dict."""
        formation = self.ask(request, now)
        return None if formation is None else formation.answer(request.member)

    def ask(self, request: QuorumRequest, now: float) -> Formation | None:
        """Register a quorum request; returns the quorum at once if this very request was already answered.

        Raises ``RequestError`` (and changes nothing) for a stale quorum id, a
        member not in the quorum asking as a survivor, or an impossible step;
        the survivor also loses its own older survivor ask, told to join
        (:meth:`_drop_stale_ask`).
        """
        formation = self.formation_for(request)
        if formation is not None:
            self._touch(request.member, now)
            return formation
        try:
            self._check_request(request)
        except RequestError as error:
            if error.status == 409:
                self._drop_stale_ask(request.member)
            raise
        record = self._touch(request.member, now)
        if request.reason != "join":
            record.report(request.applied_step)
            self.commits.progress(self.roster, request.member, request.applied_step, request.weights)
        self.asks.add(request, now, self.roster.counts(request.member))
        self.reach.report(request.member, request.quorum_id, request.unreachable, now)
        self._take_verdicts()
        return None

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
        self._take_verdicts()

    def _take_verdicts(self) -> None:
        """Record the steps of reports verified after the events that made them (their replay took slices)."""
        for report in self.commits.take_counted():
            record = self.membership.get(report.member)
            if record is not None and (record.applied_step is None or record.applied_step < report.step):
                record.report(report.step)
            self.commits.progress(self.roster, report.member, report.step, report.weights)

    def tick(self, now: float) -> Formation | None:
        """Expire heartbeats and join timeouts, forget long-dead members, verify a slice of a report's replay; form
        the next quorum when the rules allow."""
        self.commits.work(self.roster)
        self._take_verdicts()
        for name in self.membership.expired(now):
            self._mark_dead(name, now, "heartbeat timeout")
        for forgotten in self.membership.forget_dead(self.roster):
            self.registry.identities.forget(forgotten)
        if now - self._hung_checked >= min(HUNG_CHECK_S, self.join_timeout / 10) or now < self._hung_checked:
            self._hung_checked = now
            self._detect_hung(now)
        return self.try_form(now)

    def _detect_hung(self, now: float) -> None:
        """Evict quorum members that live peers wait on (they are ahead) with no progress for ``join_timeout``.

        The member's heartbeat lives but its main loop does not: its peers are
        blocked in a collective on it. Evicting it breaks the quorum, so the
        peers are told at once and re-form without it (failure reason ``hung``).
        A member being healed is not compared; one at a boundary (asking) or
        whose report is being verified is not known to be behind.
        """
        quorum = self.roster.quorum
        if quorum is None:
            return
        for member in self.membership.hung(
            quorum.members,
            lambda m: self.roster.counts(m) and m not in self.commits.healing,
            lambda m: m in self.asks or self.commits.pending(m),
            now,
            self.join_timeout,
        ):
            self.roster.evict(member)
            self._record_failure(member, now, "hung", in_quorum=True)

    # --- quorum formation ------------------------------------------------------------------------

    def try_form(self, now: float) -> Formation | None:
        """Form the next quorum if the rules allow at ``now``; constant time unless it forms (or a failure waits, or
        cuts touch the candidates: then what they touch)."""
        pending, roster = self.asks, self.roster
        if not len(pending):
            return None
        if not pending.ours:
            self.reach.expire(now)  # never while a quorum waits for its members (the cuts decide whom it waits for)
        # Some member of the quorum must ask (only joiners wait: nothing forms, whatever the cuts).
        if roster.counting and not pending.ours:
            return None
        since = pending.first_time()
        patient = now - since < self.join_timeout + self.unreachable_wait
        left_out = self._left_out(patient)
        cut_off_silent = sum(1 for m in left_out if roster.counts(m) and m not in pending)
        unaccounted = roster.counting - pending.ours - cut_off_silent
        timed_out = now - since >= self.join_timeout
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
        if not self.reach.cuts:
            return frozenset()
        pending, roster, healing = self.asks, self.roster, self.commits.healing

        def holder(member: str) -> bool:
            ask = pending.get(member)
            return roster.counts(member) and member not in healing and (ask is None or ask.request.reason != "join")

        return choose(
            self.reach.peers,
            lambda m: m in pending or (patient and roster.counts(m)),
            holder,
            lambda m: (roster.ranks.get(m, len(roster.ranks)), m),
        ).left_out

    def _held_out_asking(self) -> int:
        """How many waiting joiners are cut from a member of the current quorum (cached per cut set and quorum)."""
        if not self.reach.cuts:
            return 0
        quorum = self.roster.quorum
        key = (self.reach.version, 0 if quorum is None else quorum.quorum_id)
        if self._held[0] != key:
            held = frozenset(
                m for m, peers in self.reach.peers.items() if m not in self.roster and peers & self.roster.ranks.keys()
            )
            self._held = (key, held)
        pending = self.asks
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
        if size < self.min_replicas and not carries_on and not self._finished_cleanly():
            return False
        if self.roster.quorum is None and size < self.start_replicas and not timed_out:
            return False
        return failure or timed_out or not self._yet_to_ask(cut_off)

    def _yet_to_ask(self, cut_off: int = 0) -> bool:
        """Whether a live member that counts (not evicted, not ``cut_off``) has not asked: a boundary quorum waits."""
        pending, alive = self.asks, self.membership.alive
        evicted_silent = sum(1 for m in self.roster.evicted if alive(m) and m not in pending)
        return self.membership.live - len(pending) - evicted_silent - cut_off > 0  # every waiting member is alive

    def _form_from_pending(
        self, now: float, timed_out: bool, since: float, left_out: frozenset[str]
    ) -> Formation | None:
        pending, roster = self.asks, self.roster
        quorum_members = roster.quorum.members if roster.quorum else ()
        asked = [m for m in quorum_members if roster.counts(m) and m in pending and m not in left_out]
        unaccounted = [m for m in quorum_members if roster.counts(m) and m not in pending]
        survivors = [m for m in asked if pending[m].request.reason != "join"]
        chosen = set(survivors)
        joiners = [m for m, _ in pending.items() if m not in chosen and m not in left_out]
        # a restarted or hung member of the quorum may come back only as a joiner
        trusted = [m for m in survivors if m not in self.commits.healing]
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
        if stateless and any(m not in self.commits.healing for m in unaccounted):
            # no member of this quorum holds the job's state at the target step: never form it (and exclude the
            # members that do) while one of them lives; the joiners wait for it (a survivor alone in a slow step)
            return None
        excluded = [m for m in unaccounted if m not in left_out]
        unreachable = cut_off + [m for m, _ in pending.items() if m in left_out]
        return self._form(now, members, target, mode, failure, timed_out, excluded, since, unreachable)

    def _target_step(self, trusted: list[str]) -> tuple[int, str]:
        """``A`` and how the ledger reaches it: ``catch-up``, ``rollback`` or ``keep`` (no survivor holds more)."""
        committed = self._hosted.step
        if trusted:
            target = max(self.asks[m].request.applied_step for m in trusted)
            if target >= committed:
                return target, "catch-up"
            if target == committed - 1 and self._hosted.snapshot is not None:
                return target, "rollback"
        return committed, "keep"

    def _form(
        self,
        now: float,
        members: list[str],
        target: int,
        mode: str,
        failure: bool,
        timed_out: bool,
        excluded: list[str],
        since: float,
        unreachable: list[str],
    ) -> Formation:
        """Form the quorum; members of the old one that did not ask by the timeout are excluded as of ``since``;
        ``unreachable`` members are left out because cuts keep them from it (no failure: they may ask again)."""
        previous = self.roster.quorum
        if mode == "catch-up":
            asked = [self.asks[m].request for m in members if m not in self.commits.healing]
            reports = [r.weights for r in asked if r.reason != "join" and r.applied_step == target]
            self.commits.catch_up_to(self.roster, target, reports[0] if reports else None)
        elif mode == "rollback":
            self._hosted.rollback()
            self.history.rollback()
        checkpoint = self._resume_point(members, target, failure)
        if checkpoint is not None:
            self._resume(checkpoint, now, previous.quorum_id + 1 if previous else 1)
            target = checkpoint.step
        if failure:
            assert previous is not None
            self._hosted.fail(list(previous.members), members)
        else:
            self._hosted.begin(members)
        requests = {}
        for m in members:
            ask = self.asks.pop(m)
            assert ask is not None
            requests[m] = ask.request
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
        self.commits.heal({m: applied[m] > target for m in targets}, target)
        self._hosted.snapshot = None
        quorum_id = previous.quorum_id + 1 if previous else 1
        for member in previous.members if previous else ():
            self.membership[member].waited_since = None
        self.roster = Roster(Quorum(quorum_id, tuple(members)))
        self.asks.regroup(self.roster.counts)
        for member in excluded:
            self._record_failure(member, since, "excluded", in_quorum=True)
        record = self._hosted.record
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
            self._hosted.ledger.state_dict(),
            tuple(record.members),
            tuple(tuple(failed) for failed, _ in record.failures),
            ledger_digest(self._hosted.ledger_state()),
            reason,
            now,
            timed_out,
            mode == "rollback",
            delta,
        )
        self.formation = formation
        self.answered = TrackedDict(requests)
        self.history.quorum(quorum_id, list(members), reason, now, target, timed_out=timed_out, unreachable=unreachable)
        for member in unreachable:
            self.reach.renew(member, now)  # it stays out a time to live from now
        self.reach.prune(self.membership.__contains__, now)
        return formation

    def _resume_point(self, members: list[str], target: int, failure: bool) -> CheckpointRecord | None:
        """The checkpoint to resume from when no member of the new quorum holds the job's state at ``target``."""
        checkpoint = self.checkpoint
        if failure or checkpoint is None or checkpoint.step > self._hosted.step:
            return None
        if any(self.asks[m].request.applied_step == target for m in members):
            return None
        if checkpoint.step < self._hosted.step and self._finished_cleanly():
            return None  # the job ended: its members left with the state; nothing to roll back for
        return checkpoint

    def _finished_cleanly(self) -> bool:
        """Whether every member of the last quorum left cleanly (``/v1/leave``) rather than failing: the job ended
        (a whole quorum departing at a boundary leaves unannounced, as failures). Constant time unless every member
        of the quorum is gone."""
        quorum = self.roster.quorum
        if quorum is None or self.roster.counting:
            return False
        records = [self.membership.get(member) for member in quorum.members]
        return all(record is not None and record.left for record in records)

    def _resume(self, checkpoint: CheckpointRecord, now: float, quorum_id: int) -> None:
        """Roll the ledger back to ``checkpoint``: every step after it is trained again, once."""
        self.history.checkpoint_resume(quorum_id, self._hosted.step, checkpoint.step, checkpoint.path, now)
        self._hosted.restore(checkpoint.ledger)

    # --- checks ----------------------------------------------------------------------------------

    def _drop_stale_ask(self, member: str) -> None:
        """Forget ``member``'s pending survivor ask once it is told to join again (409).

        Its long poll ended (408) and the ask stayed, matching a retry of the
        same request; a left-out member's retry is refused instead, and until
        its join arrives the old ask would count it into a quorum formed
        meanwhile (its cuts ended), a quorum it would never hear of: the
        others would wait for it in the quorum's store (10 s, then a failed
        start).
        """
        ask = self.asks.get(member)
        if (
            ask is not None
            and ask.request.reason != "join"
            and (member not in self.roster or member in self.roster.evicted)
        ):
            self.asks.pop(member)

    def _check_request(self, request: QuorumRequest) -> None:
        quorum = self.roster.quorum
        if request.reason == "join":
            # every report a quorum member makes commits at once, so nothing known is past the ledger's step
            limit = self._hosted.step + (1 if quorum is not None else 0)
            if request.applied_step > limit:
                raise RequestError(
                    422,
                    f"applied_step {request.applied_step} is impossible for a join: the ledger is at step "
                    f"{self._hosted.step} and nothing known is past it (was the lighthouse "
                    "restarted without its --state file? restart it on that file to go on)",
                    field="applied_step",
                )
            return
        if quorum is None:
            raise RequestError(
                409, f"no quorum has formed yet: ask with reason 'join', not {request.reason!r}", field="reason"
            )
        if request.member not in self.roster or request.member in self.roster.evicted:
            raise RequestError(
                409,
                f"member {request.member!r} is not (or no longer) in quorum {quorum.quorum_id}: "
                "ask again with reason 'join'",
                field="member",
                quorum_id=quorum.quorum_id,
                members=list(quorum.members),
            )
        if request.quorum_id != quorum.quorum_id:
            raise RequestError(
                409,
                f"quorum_id {request.quorum_id} is stale: the current quorum is {quorum.quorum_id}",
                field="quorum_id",
                quorum_id=quorum.quorum_id,
                members=list(quorum.members),
            )
        if not self.commits.verify(self.roster, request.member, request.applied_step, request.digest, request.weights):
            raise RequestError(
                503,
                f"the lighthouse is verifying the ledger up to applied_step {request.applied_step} (its replay "
                "goes on in slices); ask again",
                code="catching_up",
                retry=True,
            )

    # --- liveness and history --------------------------------------------------------------------

    def _touch(self, member: str, now: float) -> MemberRecord:
        record = self.membership.touch(member, now)
        self.roster.revived(member)
        return record

    def _mark_dead(self, member: str, now: float, reason: str) -> None:
        self.membership.mark_dead(member)
        self.roster.died(member)
        self.asks.pop(member)
        self.answered.pop(member, None)
        in_quorum = member in self.roster
        if reason == "left":
            self.history.departure(member, now, in_quorum=in_quorum)
        else:
            self._record_failure(member, now, reason, in_quorum=in_quorum)

    def _record_failure(self, member: str, now: float, reason: str, *, in_quorum: bool) -> None:
        self.history.failure(member, now, reason, in_quorum=in_quorum)

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
    ) -> LighthouseState:
        """Resume from ``state_dict()``: the quorum's members count as alive (seen at ``now``) unless they left
        cleanly, others as dead; no
        member is cut from another (cuts are not persisted: a cut-off member is reported again at its next failure).

        A version 1 state resumes without its last formation: a member whose answer was lost asks again and is
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
        self.answered = TrackedDict(saved.answered)
        self.commits.heal(saved.healing, saved.heal_step)
        self.history = saved.history
        self.checkpoint = saved.checkpoint
        self.saver = Saver()
