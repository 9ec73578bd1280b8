"""The quorum session: this process's link to the lighthouse and to the quorum's processes.

It asks for quorums (the group's leader asks the lighthouse and relays the
answer to the group's other processes, :mod:`stalwart.runtime.group`),
builds each quorum's communicators over the lighthouse's store, checks that
the peers train the same way (FSDP2 layout, dataset fingerprint), and runs the
quorum's heal plan: a broadcast from a live member
(:meth:`~stalwart.runtime.replica.Replica.transfer`) or a checkpoint to load.
It also carries what the heartbeat reports, the farewell that ends a job
together, and the wait while the leader runs work of its own
(:meth:`QuorumSession.wait_for_leader`, or deferred to the next collective:
:meth:`QuorumSession.defer_leader`).

After a failed rendezvous or collective, ``session.peers.diagnose``
(:class:`~stalwart.runtime.peers.PeerProbes`) probes the quorum's peers
(:mod:`stalwart.runtime.probe`: every process listens on its transport host
and publishes the address with its arrival; after a deadline passed, each
probe also carries a step's bytes, to find a link too slow for the job) and
says what each looked like (:mod:`stalwart.runtime.diagnosis`). The members
it could not reach go to the lighthouse with the next quorum request; only
the group's leader sends that request, so only the leader's own probes are
reported (a non-leader's findings serve its error message: a member cut off
from some processes of a group and not from its leader is left to the
collective's next failure). While the leader's quorum request then waits
(left out, it asks to join), it probes those members again and tells the
lighthouse the ones it reaches again (``POST /v1/reach``): their cuts end at
once, and the member is back at the quorum's next boundary rather than when
the cuts' time to live runs out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from stalwart.coord.client import (
    CheckpointAnnouncement,
    LighthouseClient,
    LighthouseError,
    LighthouseUnreachable,
    QuorumAnswer,
)
from stalwart.coord.protocol import MAX_STORE_KEYS_PER_REQUEST, ledger_digest
from stalwart.coord.tls import client_context
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.data.shard_identity import ShardIdentity
from stalwart.errors import JoinError, PlanMismatchError, StateLostError, StepContractError
from stalwart.runtime.comm import CollectiveError, Communicator, quorum_store
from stalwart.runtime.config import ReplicaGroup, Transport
from stalwart.runtime.diagnosis import LeaderLoss
from stalwart.runtime.group import GroupLink
from stalwart.runtime.leader_wait import LEADER_POLL, LeaderWaits, QuorumView
from stalwart.runtime.peers import REPLICATED, PeerProbes, check_data, check_layout, decoded
from stalwart.runtime.probe import ProbeListener
from stalwart.runtime.replica import Replica
from stalwart.runtime.store import LighthouseStore
from stalwart.runtime.timeouts import Timeouts

log = logging.getLogger(__name__)
_T = TypeVar("_T")

MAX_GROUP_SIZE = 1 << 16
"""Largest replica group a peer may announce (``group_size/MEMBER``)."""
PLAN_REFUSALS = ("plan_mismatch", "no_plan")
"""The ``code`` of a lighthouse's answer refusing a member's plan (docs/protocol.md)."""
Report = tuple[int, str | None, dict[str, Any] | None]
"""``(applied_step, ledger digest, weights record)``: what the heartbeat reports."""


@dataclass
class CommittedReport:
    """A committed step's :data:`Report`, the ledger's digest computed when first read.

    The heartbeat reads the report once a beat (every 0.5 s by default) while
    steps commit several times a second: hashing the ledger's canonical JSON at
    every commit put some 0.2 ms on the training loop's path for a digest the
    lighthouse mostly never saw. ``ledger``: a copy taken at the commit (cheap,
    since a ledger never writes into its position arrays).
    """

    applied_step: int
    ledger: DataLedger
    weights: dict[str, Any] | None
    digest: str | None = None

    def resolved(self) -> Report:
        """``(applied_step, digest, weights)``; the digest is computed once, on whichever thread asks first."""
        if self.digest is None:
            self.digest = ledger_digest(self.ledger.state_dict())
        return self.applied_step, self.digest, self.weights


@dataclass(frozen=True)
class HealOutcome:
    """What the quorum's heal did for this process."""

    loaded: bool = False
    """This process loaded a peer's state or a checkpoint."""
    job_finished: bool = False
    """The quorum is past the job's last step and this process holds nothing of it (a late joiner)."""
    checkpoint: CheckpointAnnouncement | None = None
    """The checkpoint this process must load (it is a heal target and no live member holds the state)."""


class QuorumSession:
    """One process's membership: lighthouse client (group leader only), group link, the quorum's communicators.

    ``layout``: this process's FSDP2 layout string (:data:`REPLICATED` for an
    unsharded model); ``sharded``: gradients reduce per FSDP2 shard, over a
    communicator of the processes holding the same shard in every group.
    ``leaving()``: whether this process was asked to depart (its waits on
    group peers then end soon, see :data:`~stalwart.runtime.group.DEPARTURE_GRACE`).
    """

    def __init__(
        self,
        lighthouse: str,
        member: str,
        *,
        token: str | None,
        plan: EpochPlan | None,
        group: ReplicaGroup,
        transport: Transport,
        timeouts: Timeouts,
        device: torch.device,
        layout: str,
        leaving: Callable[[], bool] = lambda: False,
    ) -> None:
        self.member = member
        self._token = token
        self._ssl = client_context(lighthouse, None)
        """What verifies the lighthouse's certificate for the quorum's store (None over plain HTTP)."""
        self.timeouts = timeouts
        self.transport = transport
        self.device = device
        self.layout = layout
        self.sharded = layout != REPLICATED
        self.plan = plan
        self.group = GroupLink(group.world, group.store, timeout=timeouts.quorum_timeout, leaving=leaving)
        self.answer: QuorumAnswer | None = None
        self.comm: Communicator | None = None
        self.grad_comm: Communicator | None = None
        """Where gradients are reduced: ``comm`` itself, or (FSDP2 groups) the processes holding this shard."""
        self.group_sizes: list[int] = []
        self.report: Report | CommittedReport = (0, None, None)
        """What the heartbeat reports: this process's applied step, with its ledger's digest and weights."""
        self.data_fingerprint = ""
        self.data_identities: list[ShardIdentity] = []
        """The loader's dataset's shards (a ShardedDataset's), named in the message when fingerprints differ."""
        self._heals = 0
        self._leader_waits = LeaderWaits(member, timeouts.leader_timeout, timeouts.describe("leader_timeout"))
        self._meetings = 0
        self._diverged = False
        self.peers = PeerProbes(member)
        """Which peers this process could not reach when a collective failed (:meth:`PeerProbes.diagnose`)."""
        self._probe = ProbeListener(transport.host)
        self._client: LighthouseClient | None = None
        if self.group.is_leader:
            try:
                self._client = _connect_client(lighthouse, member, token, plan, transport, timeouts)
            except BaseException:
                self._probe.close()
                raise
            self._client.start_heartbeat(self.reported)

    def reported(self) -> Report:
        """The :attr:`report` as the heartbeat sends it (on the lighthouse client's thread)."""
        held = self._leader_waits.held_report  # ahead of a leader still in on_leader: the step as it was
        report = self.report if held is None else held
        return report.resolved() if isinstance(report, CommittedReport) else report

    # --- the quorum as this process sees it --------------------------------------------------------

    @property
    def quorum_id(self) -> int:
        """The id of the quorum this process runs steps in (-1 before the first)."""
        return -1 if self.answer is None else self.answer.quorum_id

    @property
    def members(self) -> tuple[str, ...]:
        """The quorum's members (replica groups), in rank order."""
        return () if self.answer is None else self.answer.members

    @property
    def rank(self) -> int:
        """This process's rank among the quorum's processes (every process of every member)."""
        return -1 if self.comm is None else self.comm.rank

    @property
    def processes(self) -> int:
        """How many processes the quorum has."""
        return 0 if self.comm is None else self.comm.world_size

    @property
    def leads_group(self) -> bool:
        """True for the process that talks to the lighthouse (its group's rank 0)."""
        return self.group.is_leader

    @property
    def client(self) -> LighthouseClient | None:
        """The lighthouse client (the group's leader only)."""
        return self._client

    @property
    def boundary_wanted(self) -> bool:
        """True while the lighthouse asks this quorum to come to a step boundary (a join, a failure).

        The group's leader hears it from the lighthouse and relays it to the
        group's other processes, so that all of them see it by their next call.
        """
        if self._client is None:
            return self.group.boundary(self.quorum_id)
        wanted = self._client.reconfigure_requested
        if wanted:
            self.group.mark_boundary(self.quorum_id)
        return wanted

    def abandon(self) -> bool:
        """Whether the current quorum is known broken (polled while a collective runs)."""
        if self._client is None:
            return self.group.broken(self.quorum_id)
        if self._client.quorum_broken:
            self.group.mark_broken(self.quorum_id, self._client.quorum_down)
            return True
        return False

    def broken_by(self) -> tuple[str, ...]:
        """The members the lighthouse named when it reported the current quorum broken (empty: it named none)."""
        if self._client is None:
            return self.group.broken_by(self.quorum_id)
        return self._client.quorum_down

    def group_agrees(self, succeeded: bool) -> bool:
        """Whether every process of this replica group says the step's collective ``succeeded`` (one vote each).

        Voted after each reduction attempt and, with sharded state, after each parameter gather.
        """
        try:
            return self.group.agree(succeeded)
        except (RuntimeError, dist.DistError) as error:
            raise JoinError(
                f"{self.member}: a process of this replica group cast no vote on the step's collective within "
                f"{self.timeouts.describe('quorum_timeout')}: {error}"
            ) from error

    # --- joining ---------------------------------------------------------------------------------

    def next_answer(self, reason: str, applied_step: int) -> QuorumAnswer | None:
        """The next quorum this member is in (asked by the leader, relayed to the group); None if excluded."""
        if self._client is None:
            try:
                return QuorumAnswer.from_json(self.group.receive())
            except (RuntimeError, dist.DistError) as error:
                raise JoinError(
                    f"{self.member}: the group's leader relayed no quorum answer within "
                    f"{self.timeouts.describe('quorum_timeout')}: {error}"
                ) from error
        unreachable = self.peers.take_unreachable()
        try:
            with self.peers.reprobing(self._client):
                answer = self._client.quorum(
                    applied_step=0 if self._diverged and reason == "join" else applied_step,
                    quorum_id=self.quorum_id if self.answer else None,
                    reason=reason,
                    timeout=self.timeouts.quorum_timeout,
                    unreachable=unreachable,
                )
        except TimeoutError as error:
            raise JoinError(
                f"{self.member}: no quorum formed within {self.timeouts.describe('quorum_timeout')}: {error}"
            ) from error
        except LighthouseError as error:
            if error.body.get("code") in PLAN_REFUSALS:
                raise PlanMismatchError(f"{self.member}: the lighthouse refused this worker's plan: {error}") from None
            if error.status != 409:
                raise
            # Excluded from a quorum that went on without it: whatever this member trained since is not the
            # job's (the quorum may have rolled back), so it rejoins as a newcomer and is healed.
            self._diverged = self._diverged or error.body.get("quorum_id") is not None
            log.warning("%s: excluded from the quorum (%s); joining again", self.member, error)
            return None
        self.group.publish(dataclasses.asdict(answer))
        return answer

    def adopt(self, answer: QuorumAnswer) -> None:
        """Make ``answer`` the quorum this process is in (its communicators are built by :meth:`connect`)."""
        self.answer = answer
        self._diverged = False
        self.peers.adopted()

    def connect(self, answer: QuorumAnswer) -> None:
        """Build the quorum's process group over every process of every member group (and, for FSDP2, per shard)."""
        # a member asks for a quorum only once on_leader() returned: a leader's work deferred in the last one is over
        self._leader_waits.reset()
        store = quorum_store(answer.store, self.timeouts.rendezvous_timeout, token=self._token, ssl_context=self._ssl)
        self.peers.unwatch()
        try:
            if self.group.is_leader:
                store.set(f"group_size/{self.member}", str(self.group.size))
            store.set(f"layout/{self.member}/{self.group.rank}", self.layout)
            store.set(f"data/{self.member}/{self.group.rank}", self.data_fingerprint)
            shards = json.dumps([identity.to_list() for identity in self.data_identities])
            store.set(f"data-shards/{self.member}/{self.group.rank}", shards)
            self.group_sizes = _group_sizes(store, answer.members)
            self.peers.watch(answer, store, self.group_sizes)
            group_rank = self.group.rank
            check_layout(answer, store, member=self.member, layout=self.layout, group_rank=group_rank,
                         group_sizes=self.group_sizes)  # fmt: skip
            check_data(answer, store, member=self.member, fingerprint=self.data_fingerprint,
                       identities=self.data_identities)  # fmt: skip
        except (RuntimeError, dist.DistError) as error:  # a member that never wrote its keys: it died
            raise CollectiveError(f"quorum {answer.quorum_id}'s store did not answer: {error}") from error
        offset = sum(self.group_sizes[: answer.rank])
        options: dict[str, Any] = {
            "timeout": self.timeouts.collective_timeout,
            "rendezvous_timeout": self.timeouts.rendezvous_timeout,
            "device": self.device,
            "host": self.transport.host,
            "abandon": self.abandon,
            "reach": self._probe.address,
            "before_collective": self.settle_leader,
        }
        self.comm = self.grad_comm = Communicator(store, offset + self.group.rank, sum(self.group_sizes), **options)
        if self.sharded:
            shard_store = dist.PrefixStore(f"shard/{self.group.rank}/", store)
            self.grad_comm = Communicator(shard_store, answer.rank, len(answer.members), **options)
        self._heals = 0  # heal keys count from 0 in each quorum's store, the same on every member
        self._meetings = 0

    def abort(self) -> None:
        """Abandon the quorum's communicators: retired, so that no caller waits for a collective they left pending.

        Aborted and merely dropped, a Gloo group is destroyed wherever its
        last reference goes, often a failed collective's traceback dropped in
        the middle of the retried step; its destructor then waits for a
        collective still pending on a live peer until that collective's
        timeout (the redundancy benchmark saw a survivor stall 60 s there).
        """
        for comm in (self.comm, self.grad_comm):
            if comm is not None:
                comm.retire()  # a second retire of the same communicator (no FSDP2 groups) does nothing
        self.comm = self.grad_comm = None
        self._leader_waits.reset()  # a new quorum forms: the leader's work in this one is over, or lost with it

    def heal(
        self, answer: QuorumAnswer, replica: Replica, *, max_steps: int | None, max_bytes: int | None
    ) -> HealOutcome:
        """Take part in the quorum's heal plan: the broadcast of the source's state, loaded if this member is behind.

        A target told to load a checkpoint gets it back in the outcome (the
        Manager's checkpoint policy loads it). A quorum at or past
        ``max_steps`` whose state nobody live holds is the job's end for a late
        joiner; a quorum before it with no source is :class:`StateLostError`.
        """
        heal = answer.heal
        assert heal is not None and self.comm is not None
        is_target = self.member in heal.targets
        finished = max_steps is not None and answer.applied_step >= max_steps
        if heal.checkpoint is not None:
            if not is_target:
                return HealOutcome()
            return HealOutcome(job_finished=finished, checkpoint=heal.checkpoint)
        if heal.source_rank is None:
            if finished:
                return HealOutcome(job_finished=True)
            raise StateLostError(
                f"no live member holds step {answer.applied_step} and the lighthouse has no checkpoint to resume "
                "from: run the workers with a checkpoint directory (Manager(checkpoint=Checkpointing(dir, "
                "every_steps=...))) so that a whole-fleet restart resumes"
            )
        started = time.monotonic()
        if self.sharded:  # process r of the source group sends its shard to process r of the others
            applied = self.transfer(
                replica, heal.source_rank, is_target=is_target, comm=self.grad_comm, budget=max_bytes
            )
        else:
            source = sum(self.group_sizes[: heal.source_rank])
            applied = self.transfer(replica, source, is_target=is_target, budget=max_bytes)
        replica.applied_step = applied
        self.report = (applied, None, None)
        if is_target:
            self.report_heal(replica, time.monotonic() - started)
        return HealOutcome(loaded=is_target)

    def transfer(
        self,
        replica: Replica,
        source: int,
        *,
        is_target: bool,
        budget: int | None,
        comm: Communicator | None = None,
    ) -> int:
        """Broadcast the replica's state from rank ``source`` of ``comm`` (default: the quorum's); the source's step."""
        comm = comm or self.comm
        assert comm is not None
        self._heals += 1
        return replica.transfer(
            comm, source, is_target=is_target, key=f"heal/{self._heals}", max_bytes=budget, timeouts=self.timeouts
        )

    def report_heal(self, replica: Replica, seconds: float) -> None:
        """Count a heal this member loaded (its state's bytes, ``seconds``) in the heartbeats (a group's leader)."""
        if self._client is not None:
            self._client.report_heal(replica.state_bytes, seconds)

    # --- the leader's own work -------------------------------------------------------------------

    def wait_for_leader(
        self, leads: bool, run: Callable[[], Any], serve: Callable[[], None] | None = None
    ) -> tuple[LeaderLoss | None, Any]:
        """Run ``run`` on the leading group's processes while the others wait; ``(loss, result)``.

        The waiting processes watch the quorum's store for the leader's
        "done" and the lighthouse for a broken quorum (a dead leader), so no
        collective of theirs times out meanwhile; ``loss`` (None when the
        leader finished) says whom the lighthouse reported dead when the
        quorum broke first (the next step re-forms it). For each
        :meth:`ask_waiters` of the leader's ``run``, they run ``serve`` (their
        part of a collective the leader started, a gather of sharded state);
        one that fails (:class:`CollectiveError`) ends the wait with a loss.
        """
        view, waits = self._leader_view(), self._leader_waits
        key = waits.next_key()
        if leads:
            return None, waits.lead(view, key, run)
        return waits.wait(view, key, serve), None

    def defer_leader(self, lost: Callable[[LeaderLoss], None]) -> None:
        """(A waiting process with nothing to serve.) Go on without waiting: the wait for the leader's "done"
        happens before this process's next collective (:meth:`settle_leader`), as DDP's ranks meet a rank 0 that
        evaluated alone in their next all-reduce; ``lost(loss)`` if the quorum broke instead.

        Meanwhile the heartbeat keeps reporting the step as it was, so that
        this process does not look ahead of a leader busy in its work (the
        lighthouse evicts a member that peers ahead of it wait on).
        """
        try:
            self.settle_leader()  # a second on_leader() before a collective: the first one's wait comes first
        except CollectiveError:
            return  # lost and told: the next collective fails on the broken quorum
        self._leader_waits.defer(self._leader_waits.next_key(), lost, self.report)

    @property
    def leader_pending(self) -> bool:
        """Whether a leader's work this process went on from may still run (:meth:`defer_leader`)."""
        return self._leader_waits.pending

    def settle_leader(self) -> None:
        """Wait for the leader's work deferred by :meth:`defer_leader`, if any (each communicator runs this before
        a collective); :class:`CollectiveError` when the quorum broke instead (after ``lost`` was told)."""
        if self._leader_waits.pending:
            self._leader_waits.settle(self._leader_view())

    def _leader_view(self) -> QuorumView:
        if self.comm is None or self.answer is None:
            raise RuntimeError("on_leader() needs a quorum: call it inside the manager.steps() loop")
        store = self.comm.store
        assert isinstance(store, LighthouseStore)  # the quorum's store (connect)
        answer = self.answer
        return QuorumView(store, answer.members[0], answer.quorum_id, self.group.rank, self.abandon, self.broken_by)

    def meet(self, what: str) -> None:
        """Wait until every process of the shards' communicator made this quorum's same-numbered ``what`` call.

        A collective that every process must enter from its own code (the
        user's ``optimizer.state_dict()`` under sharded state) meets first on
        the quorum's store, so that a process calling it alone gets
        :class:`~stalwart.errors.StepContractError` naming the processes that
        did not come within ``rendezvous_timeout``, instead of entering a
        collective its peers never match; :class:`CollectiveError` if the
        quorum broke meanwhile.
        """
        comm = self.grad_comm
        assert comm is not None
        self._meetings += 1
        keys = [f"meet/{what}/{self._meetings}/{rank}" for rank in range(comm.world_size)]
        deadline = time.monotonic() + self.timeouts.rendezvous_timeout
        try:
            comm.store.set(keys[comm.rank], "1")
            while not comm.store.check(keys):
                if self.abandon():
                    raise CollectiveError(f"the quorum broke while its processes met for {what}")
                if time.monotonic() >= deadline:
                    missing = [rank for rank, key in enumerate(keys) if not comm.store.check([key])]
                    raise StepContractError(
                        f"{what} is a collective with sharded optimizer state (redundancy=): processes {missing} of "
                        f"the quorum did not call it within {self.timeouts.describe('rendezvous_timeout')}; call it "
                        "on every process at the same point of the loop body, or on the leader alone inside "
                        "manager.on_leader()"
                    )
                time.sleep(LEADER_POLL)
        except (RuntimeError, dist.DistError) as error:
            if isinstance(error, StepContractError | CollectiveError):
                raise
            raise CollectiveError(f"the quorum's store did not answer while its processes met for {what}") from error

    def ask_waiters(self) -> None:
        """(The leader, inside ``wait_for_leader``'s ``run``.) Make the waiting processes run their ``serve`` once.

        Each process of the leading group asks its counterparts (the same
        rank in the other groups), which then enter the collective with it.
        """
        assert self.comm is not None
        self.comm.store.set(self._leader_waits.next_ask(self.group.rank), "1")

    # --- leaving ---------------------------------------------------------------------------------

    def farewell(self) -> None:
        """One last tiny all-reduce, so that no member leaves while another still waits on the final step's.

        Without it a member that finished the last all-reduce first could leave,
        and the lighthouse's broken-quorum push would make a slower member give
        up a collective that was about to complete. A failure here is harmless:
        the last step is already applied.
        """
        if self.comm is None:
            return
        try:
            self.comm.start_all_reduce_sum(torch.zeros(1, device=self.device))()
        except CollectiveError as error:
            log.info("%s: farewell all-reduce ended early (%s); the last step is applied", self.member, error)

    def close(self, applied_step: int, *, leave: bool) -> None:
        """Stop the heartbeat; with ``leave``, first leave the quorum cleanly at ``applied_step``.

        Without it the lighthouse counts this member as failed when its socket
        closes: a worker that stops before the job's end (an error, a loop
        left early) is a failure the others recover from, never a job that
        ended cleanly (which would let a whole-fleet restart skip its
        checkpoint).
        """
        self.abort()
        self._probe.close()
        if self._client is not None:
            if leave:
                self._client.leave(applied_step)
            self._client.close()


def _group_sizes(store: dist.Store, members: Sequence[str]) -> list[int]:
    """Each member's group size from the store: an int in [1, MAX_GROUP_SIZE], else a failed collective.

    Read in one request per ``MAX_STORE_KEYS_PER_REQUEST`` members: a round trip per member took 13-16 ms of
    an 8-process recovery on a busy lighthouse.
    """
    keys = [f"group_size/{member}" for member in members]
    raws: list[bytes] = []
    for start in range(0, len(keys), MAX_STORE_KEYS_PER_REQUEST):
        raws += [bytes(raw) for raw in store.multi_get(keys[start : start + MAX_STORE_KEYS_PER_REQUEST])]
    sizes = []
    for member, key, raw in zip(members, keys, raws, strict=True):
        text = decoded(key, raw)
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_GROUP_SIZE:
            raise CollectiveError(
                f"member {member!r} announced group size {text[:40]!r} in the quorum's store: not an int in "
                f"[1, {MAX_GROUP_SIZE}]"
            )
        sizes.append(int(text))
    return sizes


def _connect_client(
    lighthouse: str,
    member: str,
    token: str | None,
    plan: EpochPlan | None,
    transport: Transport,
    timeouts: Timeouts,
) -> LighthouseClient:
    """A lighthouse client that has reached the lighthouse (within ``connect_timeout``)."""
    client = LighthouseClient(
        lighthouse, member, token=token, heartbeat_interval=transport.heartbeat_interval, plan=plan
    )
    try:
        client.wait_reachable(timeouts.connect_timeout)
    except LighthouseUnreachable as error:
        client.close()
        raise LighthouseUnreachable(f"{error} ({timeouts.describe('connect_timeout')})") from None
    except BaseException:
        client.close()
        raise
    return client
