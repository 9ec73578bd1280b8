"""The lighthouse's state machine: the quorum formation policy, composing one-job parts.

The parts: :mod:`~stalwart.coord.wire` (request parsing), :mod:`~stalwart.coord.membership`
(liveness), :mod:`~stalwart.coord.hosted_ledger` (the ledger of record) and
:mod:`~stalwart.coord.history` (failures, departures, quorums, recoveries);
:class:`LighthouseState` ties them together and their public names stay
importable from here.

Pure: no I/O and no clock. Every event carries the time ``now`` (seconds, any
origin), so the rules of ``docs/protocol.md`` run in microseconds in tests.

Liveness
    A member is alive while its heartbeat socket is open and it sent something
    (a heartbeat or a quorum request) within ``heartbeat_timeout``. A closed
    socket, a timeout or a ``leave`` makes it dead; a later heartbeat or
    request revives it (a SIGSTOPped process that resumes), but a quorum
    formed without it stays formed.

Quorums
    The next quorum forms when every member of the current quorum has asked or
    is dead (or ``join_timeout`` passed since the first of them asked: the
    others are *excluded*), the askers from the quorum are a majority of its
    members that are not dead, and the new quorum has ``min_replicas``
    members. The first quorum also waits for ``start_replicas`` members (the
    fleet being launched), up to ``join_timeout`` after the first request. A
    *failure* quorum (a survivor at the target step asked with ``failure``)
    keeps the survivors only: they take the dead members' in-flight positions
    of that step. A *boundary* quorum (and the first one)
    also admits joiners, in order of arrival, after waiting up to
    ``join_timeout`` for every live member to ask.

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
    ledger (heartbeats lag fast steps) but not by more than ``MAX_CATCH_UP``.
"""

from __future__ import annotations

import dataclasses
import hmac
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stalwart._validate import check_bool, check_int
from stalwart.coord.checkpoints import CheckpointRecord, parse_checkpoint_report, vouch
from stalwart.coord.history import HISTORY_LIMIT, History
from stalwart.coord.history import KINDS as HISTORY_KINDS
from stalwart.coord.hosted_ledger import HostedLedger, StepRecord, ledger_digest
from stalwart.coord.identity import Identities, parse_incarnation
from stalwart.coord.membership import MemberRecord, Membership
from stalwart.coord.wire import (
    REASONS,
    QuorumRequest,
    RequestError,
    check_seconds,
    parse_digest,
    parse_heartbeat,
    parse_member,
    parse_report,
    parse_step,
    parse_weights,
)
from stalwart.data.ledger import Positions
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

STATE_VERSION = 1
MAX_MEMBERS = 4096
"""Default cap on live members (``max_members``)."""
MAX_CATCH_UP = 100_000
"""How far a quorum member's ``applied_step`` may run ahead of the ledger (a bound on catch-up work)."""

CommitListener = Callable[[int, int, Positions], None]


@dataclass(frozen=True)
class Quorum:
    """The members that run the current steps together, in rank order."""

    quorum_id: int
    members: tuple[str, ...]


@dataclass(frozen=True)
class Formation:
    """A quorum just formed: what every member is told (``answer``) and why it formed."""

    quorum_id: int
    members: tuple[str, ...]
    applied_step: int
    heal: dict[str, Any] | None
    ledger: dict[str, Any]
    reason: str
    time: float
    timed_out: bool
    rolled_back: bool
    store_prefix: str = ""
    """The quorum's TCPStore key prefix, ``q{quorum_id}-{128 random bits}/``: told only to its members."""

    def to_json(self) -> dict[str, Any]:
        """JSON form (for persistence)."""
        return {**dataclasses.asdict(self), "members": list(self.members)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Formation:
        """Inverse of ``to_json``."""
        return cls(**{**data, "members": tuple(data["members"])})

    def answer(self, member: str) -> dict[str, Any]:
        """The JSON answer for ``member`` (the server adds ``store``)."""
        return {
            "quorum_id": self.quorum_id,
            "members": list(self.members),
            "rank": self.members.index(member),
            "world_size": len(self.members),
            "applied_step": self.applied_step,
            "heal": self.heal,
            "ledger": self.ledger,
            "store": {"prefix": self.store_prefix or f"q{self.quorum_id}/"},
        }


@dataclass
class _Pending:
    request: QuorumRequest
    time: float
    order: int


class LighthouseState:
    """Membership, liveness, pending quorum requests, the current quorum and the hosted ledger.

    ``on_commit(epoch, step, positions)`` is called for every step the hosted
    ledger commits (a rolled-back step is committed again later).
    """

    def __init__(
        self,
        plan: EpochPlan,
        min_replicas: int = 1,
        heartbeat_timeout: float = 2.0,
        join_timeout: float = 5.0,
        *,
        start_replicas: int | None = None,
        on_commit: CommitListener | None = None,
        max_members: int = MAX_MEMBERS,
        require_digest: bool = False,
        balance_every: int = 0,
    ) -> None:
        if not isinstance(plan, EpochPlan):
            raise TypeError(f"plan must be an EpochPlan, got {type(plan).__name__}")
        self.plan = plan
        self.min_replicas = check_int("min_replicas", min_replicas, minimum=1)
        self.start_replicas = check_int(
            "start_replicas", min_replicas if start_replicas is None else start_replicas, minimum=self.min_replicas
        )
        self.heartbeat_timeout = check_seconds("heartbeat_timeout", heartbeat_timeout)
        self.join_timeout = check_seconds("join_timeout", join_timeout)
        self.on_commit = on_commit
        self.max_members = check_int("max_members", max_members, minimum=1)
        self.require_digest = check_bool("require_digest", require_digest)
        """Refuse reports that would commit steps without a ledger digest (the server sets it)."""
        self._identities = Identities()
        self._evicted: set[str] = set()
        """Members of the current quorum that no longer count for it (``hung``, ``restarted``) until the next one."""
        self.revision = 0
        """Grows with every change that must be persisted (commits, quorums, history)."""
        self._hosted = HostedLedger(plan, check_int("balance_every", balance_every, minimum=0))
        self._checkpoint: CheckpointRecord | None = None
        self._quorum: Quorum | None = None
        self._members = Membership(self.heartbeat_timeout)
        self._pending: dict[str, _Pending] = {}
        self._arrivals = 0
        self._healing: dict[str, bool] = {}
        self._heal_step = 0
        self._formation: Formation | None = None
        self._answered: dict[str, QuorumRequest] = {}
        self.history = History()

    # --- read-only views -------------------------------------------------------------------------

    @property
    def quorum(self) -> Quorum | None:
        """The current quorum (None before the first one)."""
        return self._quorum

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
        return self._members.records

    @property
    def pending(self) -> dict[str, QuorumRequest]:
        """The quorum requests waiting for the next quorum, by member."""
        return {member: pending.request for member, pending in self._pending.items()}

    @property
    def reconfigure_pending(self) -> bool:
        """True while a joiner waits or a member of the quorum is dead: its members should come to a boundary."""
        quorum = self._quorum
        if quorum is None:
            return False
        if self.quorum_broken:
            return True
        return any(m not in quorum.members or p.request.reason == "join" for m, p in self._pending.items())

    @property
    def quorum_broken(self) -> bool:
        """True while a member of the current quorum is dead: its collectives cannot complete."""
        quorum = self._quorum
        return quorum is not None and any(not self._counts(member) for member in quorum.members)

    def _counts(self, member: str) -> bool:
        """Whether a member of the current quorum still counts for it: alive and neither hung nor restarted."""
        return self._members[member].alive and member not in self._evicted

    def should_reconfigure(self, member: str) -> bool:
        """Whether ``member``'s heartbeat should be answered with ``{"type": "reconfigure"}``."""
        return self._quorum is not None and member in self._quorum.members and self.reconfigure_pending

    def left_out(self, member: str) -> bool:
        """Whether ``member`` is alive but neither in the current quorum nor asking to join it.

        Its heartbeat is answered with ``{"type": "reconfigure", "left_out": true}`` so that a member the
        quorum went on without (excluded while it trained alone, say) stops and joins again.
        """
        record = self._members.get(member)
        return (
            self._quorum is not None
            and member not in self._quorum.members
            and member not in self._pending
            and record is not None
            and record.alive
        )

    def ledger_state(self) -> dict[str, Any]:
        """The ledger as the members see it: in the step in progress when a quorum formed in it, else committed."""
        return self._hosted.ledger_state()

    def answer_for(self, request: QuorumRequest) -> dict[str, Any] | None:
        """The current quorum's answer if it was formed for exactly this request (a retried long poll)."""
        if self._formation is None or self._answered.get(request.member) != request:
            return None
        return self._formation.answer(request.member)

    def expect_quorum(self, now: float) -> None:
        """Count the quorum's members as alive and seen at ``now``: after a restart they get
        ``heartbeat_timeout`` to reconnect their heartbeat sockets."""
        for member in self._quorum.members if self._quorum else ():
            self._members.expect(member, now)

    # --- identity --------------------------------------------------------------------------------

    def register(self, member: str, incarnation: str, now: float) -> str:
        """Register ``incarnation`` of ``member`` and return its new secret.

        A first registration counts as a sign of life (the process heartbeats
        next). A new incarnation of a member still recorded alive marks the old
        one dead at once (failure reason ``restarted``); the old secret stops
        working. ``RequestError`` 429 when ``max_members`` live members are
        already registered, 409 for a replaced or already registered incarnation.
        """
        member = parse_member(member)
        incarnation = parse_incarnation(incarnation)
        if member not in self._identities:
            live = sum(record.alive for record in self._members.records.values())
            if not self._members.alive(member) and live >= self.max_members:
                raise RequestError(
                    429,
                    f"max_members={self.max_members} live members are registered: member {member!r} is refused",
                    field="member",
                    cap="max_members",
                )
        secret, replaced = self._identities.register(member, incarnation)
        self.revision += 1
        if replaced is not None and self._members.alive(member):
            self._mark_dead(member, now, "restarted")
        if replaced is not None and self._quorum is not None and member in self._quorum.members:
            self._evicted.add(member)
        elif replaced is None:
            self._touch(member, now)
        return secret

    def authenticate(self, member: str, incarnation: object, secret: object) -> None:
        """``RequestError`` 403 unless ``incarnation`` and ``secret`` are ``member``'s current ones."""
        self._identities.check(member, incarnation, secret)

    @property
    def balance_every(self) -> int:
        """Every how many steps the members rebalance their shares (0: shares are equal)."""
        return self._hosted.ledger.balance_every

    def incarnation(self, member: str) -> str | None:
        """The registered incarnation of ``member`` (None if none)."""
        identity = self._identities.current.get(member)
        return None if identity is None else identity.incarnation

    # --- events ----------------------------------------------------------------------------------

    def connected(self, member: str, now: float) -> None:
        """``member`` opened its heartbeat socket."""
        self._touch(parse_member(member), now).connected = True

    def disconnected(self, member: str, now: float) -> None:
        """``member``'s heartbeat socket closed: it is dead at once (a killed process closes its sockets)."""
        record = self._members.get(member)
        if record is None:
            return
        record.connected = False
        if record.alive:
            self._mark_dead(member, now, "socket closed")

    def heartbeat(
        self,
        member: str,
        applied_step: int,
        now: float,
        digest: str | None = None,
        weights: Mapping[str, Any] | None = None,
    ) -> None:
        """``member`` reports ``applied_step``; the ledger commits through the largest a quorum member reports.

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
        self._check_catch_up(member, applied_step)
        self._check_digest(member, applied_step, digest, weights)
        record = self._touch(member, now)
        record.report(applied_step)
        self._progress(member, applied_step, weights)

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
        record = self._members.get(parse_member(member))
        if record is None:
            raise RequestError(404, f"member {member!r} is not known to the lighthouse", field="member")
        if applied_step is not None and record.alive:
            self.heartbeat(member, applied_step, now, digest, weights)
        record.connected = False
        if record.alive:
            self._mark_dead(member, now, "left")
            record.left = True

    @property
    def checkpoint(self) -> CheckpointRecord | None:
        """The newest checkpoint the lighthouse vouches for (None before the first report)."""
        return self._checkpoint

    def record_checkpoint(self, body: Any, now: float) -> CheckpointRecord:
        """A member wrote a durable checkpoint: keep it if it is newer and its ledger is the one committed.

        Raises ``RequestError`` (nothing changes) for a malformed report, a
        ledger that differs from the one committed at that step (422) or a step
        not committed yet (409: report again later).
        """
        record = parse_checkpoint_report(body, self.plan, now)
        vouch(record, self._hosted.step, self._hosted.digests)
        if self._checkpoint is None or record.step > self._checkpoint.step:
            self._checkpoint = record
            self.history.checkpoint()
            self.revision += 1
        return self._checkpoint

    def request(self, request: QuorumRequest, now: float) -> dict[str, Any] | None:
        """Register a quorum request; returns the answer at once if this very request was already answered.

        Raises ``RequestError`` (and changes nothing) for a stale quorum id, a
        member not in the quorum asking as a survivor, or an impossible step.
        """
        answer = self.answer_for(request)
        if answer is not None:
            self._touch(request.member, now)
            return answer
        self._check_request(request)
        record = self._touch(request.member, now)
        if request.reason != "join":
            record.report(request.applied_step)
            self._progress(request.member, request.applied_step, request.weights)
        previous = self._pending.get(request.member)
        if previous is None or previous.request != request:
            self._arrivals += 1
            self._pending[request.member] = _Pending(request, now, self._arrivals)
        return None

    def tick(self, now: float) -> Formation | None:
        """Expire heartbeats and join timeouts; form the next quorum when the rules allow."""
        for name in self._members.expired(now):
            self._mark_dead(name, now, "heartbeat timeout")
        self._detect_hung(now)
        return self._try_form(now)

    def _detect_hung(self, now: float) -> None:
        """Evict quorum members that live peers wait on (they are ahead) with no progress for ``join_timeout``.

        The member's heartbeat lives but its main loop does not: its peers are
        blocked in a collective on it. Evicting it breaks the quorum, so the
        peers are told at once and re-form without it (failure reason ``hung``).
        """
        quorum = self._quorum
        if quorum is None:
            return
        steps = {
            m: self._members[m].applied_step
            for m in quorum.members
            if self._counts(m) and m not in self._healing and self._members[m].applied_step is not None
        }
        if not steps:
            return
        ahead = max(step for step in steps.values() if step is not None)
        for member, step in steps.items():
            record = self._members[member]
            if step is None or step >= ahead or member in self._pending:
                record.waited_since = None
                continue
            if record.waited_since is None:
                record.waited_since = now
            elif now - record.waited_since > self.join_timeout:
                self._evicted.add(member)
                self._record_failure(member, now, "hung", in_quorum=True)

    # --- quorum formation ------------------------------------------------------------------------

    def _try_form(self, now: float) -> Formation | None:
        pending = self._pending
        if not pending:
            return None
        quorum_members = list(self._quorum.members) if self._quorum else []
        not_dead = [m for m in quorum_members if self._counts(m)]
        asked = [m for m in not_dead if m in pending]
        unaccounted = [m for m in not_dead if m not in pending]
        clock = min(pending[m].time for m in (asked or pending))
        timed_out = now - clock >= self.join_timeout
        if unaccounted and not timed_out:
            return None
        # After the join timeout the members that did not ask are excluded: they no longer count for the
        # majority rule, so the askers are the majority of what counts; some member of the quorum must ask.
        if not_dead and not asked:
            return None
        survivors = [m for m in asked if pending[m].request.reason != "join"]
        joiners = sorted((m for m in pending if m not in survivors), key=lambda m: pending[m].order)
        # a restarted or hung member of the quorum may come back only as a joiner
        trusted = [m for m in survivors if m not in self._healing]
        target, mode = self._target_step(trusted)
        failure = any(
            pending[m].request.reason == "failure" and pending[m].request.applied_step == target for m in trusted
        )
        members = survivors if failure else survivors + joiners
        if not members or len(members) < self.min_replicas:
            return None
        if self._quorum is None and len(members) < self.start_replicas and not timed_out:
            return None
        if (
            not failure
            and not timed_out
            and any(r.alive and m not in pending and m not in self._evicted for m, r in self.members.items())
        ):
            return None
        return self._form(now, members, target, mode, failure, timed_out, unaccounted, clock)

    def _target_step(self, trusted: list[str]) -> tuple[int, str]:
        """``A`` and how the ledger reaches it: ``catch-up``, ``rollback`` or ``keep`` (no survivor holds more)."""
        committed = self._hosted.step
        if trusted:
            target = max(self._pending[m].request.applied_step for m in trusted)
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
    ) -> Formation:
        """Form the quorum; members of the old one that did not ask by the timeout are excluded as of ``since``."""
        previous = self._quorum
        if mode == "catch-up":
            asked = [self._pending[m].request for m in members if m not in self._healing]
            reports = [r.weights for r in asked if r.reason != "join" and r.applied_step == target]
            self._catch_up(target, reports[0] if reports else None)
        elif mode == "rollback":
            self._hosted.rollback()
            self.history.rollback()
        checkpoint = self._resume_point(members, target, failure)
        if checkpoint is not None:
            self._resume(checkpoint, now, previous.quorum_id + 1 if previous else 1)
            target = checkpoint.step
        if failure:
            assert previous is not None
            record = self._hosted.record or StepRecord(list(previous.members))
            failed = [m for m in record.live if m not in members]
            if failed:
                record.failures.append((failed, list(members)))
            self._hosted.record = record
        else:
            self._hosted.record = StepRecord(list(members))
        requests = {m: self._pending.pop(m).request for m in members}
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
        self._healing = {m: applied[m] > target for m in targets}
        self._heal_step = target
        self._hosted.snapshot = None
        quorum_id = previous.quorum_id + 1 if previous else 1
        self._quorum = Quorum(quorum_id, tuple(members))
        self._evicted = set()
        for seen in self._members.records.values():
            seen.waited_since = None
        for member in excluded:
            self._record_failure(member, since, "excluded", in_quorum=True)
        reason = "start-up" if previous is None else "failure" if failure else "boundary"
        formation = Formation(
            quorum_id,
            tuple(members),
            target,
            heal,
            self.ledger_state(),
            reason,
            now,
            timed_out,
            mode == "rollback",
            f"q{quorum_id}-{secrets.token_hex(16)}/",
        )
        self._formation = formation
        self._answered = requests
        self.history.quorum(quorum_id, list(members), reason, now, target, timed_out=timed_out)
        self.revision += 1
        return formation

    def _resume_point(self, members: list[str], target: int, failure: bool) -> CheckpointRecord | None:
        """The checkpoint to resume from when no member of the new quorum holds the job's state at ``target``."""
        checkpoint = self._checkpoint
        if failure or checkpoint is None or checkpoint.step > self._hosted.step:
            return None
        if any(self._pending[m].request.applied_step == target for m in members):
            return None
        if checkpoint.step < self._hosted.step and self._finished_cleanly():
            return None  # the job ended: its members left with the state; nothing to roll back for
        return checkpoint

    def _finished_cleanly(self) -> bool:
        """Whether every member of the last quorum left cleanly (``/v1/leave``) rather than failing."""
        quorum = self._quorum
        if quorum is None:
            return False
        records = [self._members.get(member) for member in quorum.members]
        return all(record is not None and record.left for record in records)

    def _resume(self, checkpoint: CheckpointRecord, now: float, quorum_id: int) -> None:
        """Roll the ledger back to ``checkpoint``: every step after it is trained again, once."""
        self.history.checkpoint_resume(quorum_id, self._hosted.step, checkpoint.step, checkpoint.path, now)
        self._hosted.restore(checkpoint.ledger)

    # --- the ledger ------------------------------------------------------------------------------

    def _catch_up(self, step: int, weights: Mapping[str, Any] | None) -> None:
        """Commit the hosted ledger through ``step`` with the quorum's members (``weights``: the report's)."""
        assert self._quorum is not None
        for epoch, committed, positions in self._hosted.catch_up(list(self._quorum.members), step, weights):
            self.revision += 1
            if self.on_commit is not None:
                self.on_commit(epoch, committed, positions)

    def _would_commit(self, member: str, applied_step: int) -> bool:
        """Whether ``member``'s report of ``applied_step`` would commit steps (see ``_progress``)."""
        if self._quorum is None or member not in self._quorum.members or member in self._evicted:
            return False
        if member in self._healing:
            ahead = self._healing[member]
            if not (applied_step == self._heal_step if ahead else applied_step >= self._heal_step):
                return False
        return applied_step > self._hosted.step

    def _check_digest(
        self, member: str, applied_step: int, digest: str | None, weights: Mapping[str, Any] | None
    ) -> None:
        """Refuse (422) a report that would commit steps the lighthouse's own replay does not reach."""
        if not self._would_commit(member, applied_step):
            return
        committed = self._hosted.step
        if digest is None:
            if self.require_digest:
                raise RequestError(
                    422,
                    f"applied_step {applied_step} is ahead of the ledger's step {committed}: a digest of the "
                    "member's ledger is required to commit it",
                    field="digest",
                )
            return
        assert self._quorum is not None
        ours = self._hosted.digest_after(list(self._quorum.members), applied_step, weights)
        if not hmac.compare_digest(ours, digest):
            raise RequestError(
                422,
                f"digest {digest} of member {member!r} at applied_step {applied_step} does not match the "
                f"lighthouse's replay ({ours}): the steps are not committed; the ledger stays at step {committed}",
                field="digest",
            )

    def _progress(self, member: str, applied_step: int, weights: Mapping[str, Any] | None) -> None:
        """Commit through ``applied_step`` if ``member`` is a quorum member whose reports count."""
        if self._quorum is None or member not in self._quorum.members or member in self._evicted:
            return
        if member in self._healing:
            ahead = self._healing[member]
            healed = applied_step == self._heal_step if ahead else applied_step >= self._heal_step
            if not healed:
                return
            del self._healing[member]
            self.revision += 1
        self._catch_up(applied_step, weights)

    def _known_step(self) -> int:
        """The furthest step the lighthouse knows of: its ledger or a report of a live quorum member."""
        known = self._hosted.step
        if self._quorum is not None:
            for member in self._quorum.members:
                record = self._members[member]
                if record.alive and record.applied_step is not None and member not in self._healing:
                    known = max(known, record.applied_step)
        return known

    # --- checks ----------------------------------------------------------------------------------

    def _check_catch_up(self, member: str, applied_step: int) -> None:
        quorum = self._quorum
        if quorum is not None and member in quorum.members and applied_step > self._hosted.step + MAX_CATCH_UP:
            raise RequestError(
                422,
                f"applied_step {applied_step} is impossible: more than {MAX_CATCH_UP} steps ahead of "
                f"the ledger's step {self._hosted.step}",
                field="applied_step",
            )

    def _check_request(self, request: QuorumRequest) -> None:
        quorum = self._quorum
        if request.reason == "join":
            limit = self._known_step() + (1 if quorum is not None else 0)
            if request.applied_step > limit:
                raise RequestError(
                    422,
                    f"applied_step {request.applied_step} is impossible for a join: the ledger is at step "
                    f"{self._hosted.step} and nothing known is past step {self._known_step()} (was the lighthouse "
                    "restarted without its --state file? restart it on that file to go on)",
                    field="applied_step",
                )
            return
        if quorum is None:
            raise RequestError(
                409, f"no quorum has formed yet: ask with reason 'join', not {request.reason!r}", field="reason"
            )
        if request.member not in quorum.members or request.member in self._evicted:
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
        self._check_catch_up(request.member, request.applied_step)
        self._check_digest(request.member, request.applied_step, request.digest, request.weights)

    # --- liveness and history --------------------------------------------------------------------

    def _touch(self, member: str, now: float) -> MemberRecord:
        return self._members.touch(member, now)

    def _mark_dead(self, member: str, now: float, reason: str) -> None:
        self._members.mark_dead(member)
        self._pending.pop(member, None)
        self._answered.pop(member, None)
        in_quorum = self._quorum is not None and member in self._quorum.members
        if reason == "left":
            self.history.departure(member, now, in_quorum=in_quorum)
            self.revision += 1
        else:
            self._record_failure(member, now, reason, in_quorum=in_quorum)
        for forgotten in self._members.forget_dead(self._quorum.members if self._quorum else ()):
            self._identities.forget(forgotten)

    def _record_failure(self, member: str, now: float, reason: str, *, in_quorum: bool) -> None:
        self.history.failure(member, now, reason, in_quorum=in_quorum)
        self.revision += 1

    # --- status and persistence ------------------------------------------------------------------

    def member_state(self, member: str) -> str:
        """``alive`` (in the quorum), ``joining`` (alive, not in it), ``left`` (it finished cleanly) or ``dead``."""
        record = self._members[member]
        if not record.alive:
            return "left" if record.left else "dead"
        return "alive" if self._quorum is not None and member in self._quorum.members else "joining"

    def to_status(self, now: float | None = None) -> dict[str, Any]:
        """One JSON-able dict of everything a dashboard shows."""
        ledger = self._hosted.ledger
        missing = int(ledger.missing_indices.size)
        length = self.plan.epoch_length
        members = []
        for name, record in self._members.records.items():
            pending = self._pending.get(name)
            members.append(
                {
                    "member": name,
                    "state": self.member_state(name),
                    "applied_step": record.applied_step,
                    "connected": record.connected,
                    "last_seen": record.last_seen,
                    "seconds_since_seen": None if now is None else max(0.0, now - record.last_seen),
                    "asking": None if pending is None else pending.request.reason,
                    "healing": name in self._healing,
                }
            )
        quorum = self._quorum
        return {
            "members": members,
            "quorum": None if quorum is None else {"quorum_id": quorum.quorum_id, "members": list(quorum.members)},
            "checkpoint": None
            if self._checkpoint is None
            else {**self._checkpoint.announcement(), "time": self._checkpoint.time, "member": self._checkpoint.member},
            "resumed_from_checkpoint": list(self.history.checkpoint_resumes),
            "min_replicas": self.min_replicas,
            "reconfigure_pending": self.reconfigure_pending,
            "ledger": {
                "step": ledger.step,
                "epoch": ledger.epoch,
                "epoch_step": ledger.epoch_step,
                "base_index": ledger.base_index,
                "missing": missing,
                "epoch_length": length,
                "epoch_progress": 1.0 if ledger.epoch_complete else (ledger.base_index - missing) / length,
                "step_in_progress": self._hosted.record is not None,
                "balance": None
                if not ledger.balanced
                else {"every": ledger.balance_every, "step": ledger.weights_step, "weights": ledger.weights},
            },
            "plan": self.plan.to_dict(),
            "counts": dict(self.counts),
            "failures": list(self.failures),
            "recoveries": list(self.recoveries),
            "departures": list(self.departures),
            "quorums": list(self.quorums),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; ``from_state_dict`` resumes it in a restarted lighthouse."""
        quorum = self._quorum
        return {
            "version": STATE_VERSION,
            **self._hosted.to_json(),
            "quorum": None if quorum is None else {"quorum_id": quorum.quorum_id, "members": list(quorum.members)},
            "members": {name: record.applied_step for name, record in self._members.records.items()},
            "formation": None if self._formation is None else self._formation.to_json(),
            "answered": {member: dataclasses.asdict(request) for member, request in self._answered.items()},
            "healing": dict(self._healing),
            "heal_step": self._heal_step,
            "history": self.history.to_json(),
            "identities": self._identities.to_json(),
            "checkpoint": None if self._checkpoint is None else self._checkpoint.to_json(),
        }

    def core_state_dict(self) -> dict[str, Any]:
        """``state_dict()`` without the history's event lists (kept as append-only rows by the store)."""
        state = self.state_dict()
        state["history"] = {key: value for key, value in state["history"].items() if key not in HISTORY_KINDS}
        return state

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
    ) -> LighthouseState:
        """Resume from ``state_dict()``: the quorum's members count as alive (seen at ``now``), others as dead."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"state must be a lighthouse state_dict of version {STATE_VERSION}")
        hosted = HostedLedger.from_json(state)
        restored = cls(
            hosted.ledger.plan,
            min_replicas,
            heartbeat_timeout,
            join_timeout,
            start_replicas=start_replicas,
            on_commit=on_commit,
            max_members=max_members,
            require_digest=require_digest,
        )
        restored._hosted = hosted
        if state["quorum"] is not None:
            members = tuple(parse_member(m, "state['quorum']['members']") for m in state["quorum"]["members"])
            restored._quorum = Quorum(check_int("state['quorum']['quorum_id']", state["quorum"]["quorum_id"]), members)
        for name, applied_step in state["members"].items():
            record = MemberRecord(parse_member(name, "state['members']"), alive=False, last_seen=now)
            record.applied_step = (
                None if applied_step is None else parse_step(applied_step, f"state['members'][{name!r}]")
            )
            restored._members.records[name] = record
        restored.expect_quorum(now)
        if state["formation"] is not None:
            restored._formation = Formation.from_json(state["formation"])
        restored._answered = {member: QuorumRequest(**request) for member, request in state["answered"].items()}
        restored._healing = {name: bool(ahead) for name, ahead in state["healing"].items()}
        restored._heal_step = check_int("state['heal_step']", state["heal_step"], minimum=0)
        restored.history = History.from_json(state["history"])
        if state.get("identities") is not None:
            restored._identities = Identities.from_json(state["identities"])
        if state.get("checkpoint") is not None:
            restored._checkpoint = CheckpointRecord.from_json(state["checkpoint"])
        return restored
