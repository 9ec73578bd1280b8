"""The quorum session: this process's link to the lighthouse and to the quorum's processes.

It asks for quorums (the group's leader asks the lighthouse and relays the
answer to the group's other processes, :mod:`stalwart.runtime.group`),
builds each quorum's communicators over the lighthouse's store, checks that
the peers train the same way (FSDP2 layout, dataset fingerprint), and runs the
quorum's heal plan: a broadcast from a live member
(:meth:`~stalwart.runtime.replica.Replica.transfer`) or a checkpoint to load.
It also carries what the heartbeat reports, the farewell that ends a job
together, and the wait while the leader runs work of its own
(:meth:`QuorumSession.wait_for_leader`).

After a failed rendezvous or collective, :meth:`QuorumSession.diagnose` probes
the quorum's peers (:mod:`stalwart.runtime.probe`: every process listens on
its transport host and publishes the address with its arrival; after a
deadline passed, each probe also carries a step's bytes, to find a link too
slow for the job) and says what each looked like
(:mod:`stalwart.runtime.diagnosis`). The members it could not reach go to
the lighthouse with the next quorum request; only the group's leader sends
that request, so only the leader's own probes are reported (a non-leader's
findings serve its error message: a member cut off from some processes of a
group and not from its leader is left to the collective's next failure).
While the leader's quorum request then waits (left out, it asks to join),
it probes those members again every :data:`REPROBE_INTERVAL` and tells the
lighthouse the ones it reaches again (``POST /v1/reach``): their cuts end at
once, and the member is back at the quorum's next boundary rather than when
the cuts' time to live runs out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
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
from stalwart.coord.protocol import MAX_STORE_KEYS_PER_REQUEST
from stalwart.coord.tls import client_context
from stalwart.data.plan import EpochPlan
from stalwart.data.shards import ShardIdentity, shard_difference
from stalwart.errors import JoinError, PlanMismatchError, ShardingMismatchError, StateLostError, StepContractError
from stalwart.runtime.comm import CollectiveError, Communicator, Failure, arrivals, quorum_store
from stalwart.runtime.config import ReplicaGroup, Transport
from stalwart.runtime.diagnosis import Diagnosis, LeaderLoss, Verdict, diagnose
from stalwart.runtime.group import GroupLink
from stalwart.runtime.probe import LinkNeed, ProbeListener, Reach, probe
from stalwart.runtime.replica import Replica
from stalwart.runtime.timeouts import Timeouts

log = logging.getLogger(__name__)
_T = TypeVar("_T")

REPLICATED = "replicated"
"""The layout a process of an unsharded model publishes (any group size is fine then)."""
_LEADER_POLL = 0.05
"""Seconds between two looks at the store while the leader runs its own work (at most)."""
_FIRST_LEADER_POLL = 0.002
"""The first look's delay, doubled at each look up to ``_LEADER_POLL``: a short evaluation (a few batches, tens of
milliseconds) is seen done within a few milliseconds instead of up to 50 ms later, in a handful of store requests."""
MAX_GROUP_SIZE = 1 << 16
"""Largest replica group a peer may announce (``group_size/MEMBER``)."""
MAX_PEER_TEXT = 4096
"""Longest layout or data fingerprint a peer may publish."""

STORE_LOOK_S = 2.0
"""Longest wait for the quorum's store while diagnosing a failure. It answers in milliseconds unless the lighthouse
is cut off from this process; then the diagnosis names no peer and the next quorum request, which the client
retries on fresh connections, is what waits. (A look on the store's kept-alive connection waited out its read
timeout, 12 s, and kept a worker whose NIC was down for 10 s out of the quorum 5 s after its link returned.)"""

REPROBE_INTERVAL = 1.0
"""Seconds between two probes of the members the last diagnosis could not reach, while a quorum request waits."""

PLAN_REFUSALS = ("plan_mismatch", "no_plan")
"""The ``code`` of a lighthouse's answer refusing a member's plan (docs/protocol.md)."""
Report = tuple[int, str | None, dict[str, Any] | None]
"""``(applied_step, ledger digest, weights record)``: what the heartbeat reports."""


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
        self.report: Report = (0, None, None)
        self.data_fingerprint = ""
        self.data_identities: list[ShardIdentity] = []
        """The loader's dataset's shards (a ShardedDataset's), named in the message when fingerprints differ."""
        self._heals = 0
        self._leader_calls = 0
        self._leader_asks = 0
        self._meetings = 0
        self._diverged = False
        self._view: tuple[dist.Store, list[int]] | None = None
        """The current quorum's store and group sizes, once known: what :meth:`diagnose` reads and probes."""
        self._unreachable: tuple[str, ...] = ()
        """The members the last diagnosis could not reach: sent with the next quorum request (the leader's)."""
        self._cut: dict[str, list[str]] = {}
        """The probe addresses of the members the last diagnosis could not reach (cut off or on a slow link), probed
        again while the leader's quorum request waits; empty once a quorum is adopted."""
        self._cut_need: LinkNeed | None = None
        """What those probes must carry (the last diagnosis's need)."""
        self._probe = ProbeListener(transport.host)
        self._client: LighthouseClient | None = None
        if self.group.is_leader:
            try:
                self._client = _connect_client(lighthouse, member, token, plan, transport, timeouts)
            except BaseException:
                self._probe.close()
                raise
            self._client.start_heartbeat(lambda: self.report)

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
        unreachable, self._unreachable = self._unreachable, ()
        try:
            with _Reprobe(self.member, self._client, dict(self._cut), self._cut_need):
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
        self._cut = {}

    def connect(self, answer: QuorumAnswer) -> None:
        """Build the quorum's process group over every process of every member group (and, for FSDP2, per shard)."""
        store = quorum_store(answer.store, self.timeouts.rendezvous_timeout, token=self._token, ssl_context=self._ssl)
        self._view = None
        try:
            if self.group.is_leader:
                store.set(f"group_size/{self.member}", str(self.group.size))
            store.set(f"layout/{self.member}/{self.group.rank}", self.layout)
            store.set(f"data/{self.member}/{self.group.rank}", self.data_fingerprint)
            shards = json.dumps([identity.to_list() for identity in self.data_identities])
            store.set(f"data-shards/{self.member}/{self.group.rank}", shards)
            self.group_sizes = _group_sizes(store, answer.members)
            self._view = (store, self.group_sizes)
            self._check_layout(answer, store)
            self._check_data(answer, store)
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
        }
        self.comm = self.grad_comm = Communicator(store, offset + self.group.rank, sum(self.group_sizes), **options)
        if self.sharded:
            shard_store = dist.PrefixStore(f"shard/{self.group.rank}/", store)
            self.grad_comm = Communicator(shard_store, answer.rank, len(answer.members), **options)
        self._heals = 0  # heal keys count from 0 in each quorum's store, the same on every member
        self._leader_calls = 0
        self._meetings = 0

    def diagnose(self, error: CollectiveError, *, need: LinkNeed | None = None) -> Diagnosis:
        """What each peer member of the current quorum looked like when ``error`` happened (probed now, bounded by
        :data:`~stalwart.runtime.probe.PROBE_TIMEOUT` and ``need.window``); the leader reports the unreachable ones
        with its next quorum request.

        Processes are read from the quorum's store: those that never wrote
        their arrival never came; the others are probed at the address they
        published, carrying ``need``'s bytes when the failure was a deadline
        (a peer on a link too slow for them is reported like a cut-off one).
        Nothing is known before the group sizes were read.
        """
        if self._view is None or self.answer is None or error.failure is Failure.ABANDONED:
            # abandoned: the lighthouse named a member dead and leaves it out itself; a probe of a peer whose NIC
            # died would hold the quorum request up to PROBE_TIMEOUT for nothing
            return Diagnosis(error.failure, {})
        store, sizes = self._view
        came = _within(STORE_LOOK_S, lambda: arrivals(store, sum(sizes)))
        if came is None:
            return Diagnosis(error.failure, {})
        owners = [member for member, size in zip(self.answer.members, sizes, strict=True) for _ in range(size)]
        peers = {rank: member for rank, member in enumerate(owners) if member != self.member}
        addresses = {rank: came[rank] for rank in peers if came.get(rank)}
        found = probe(addresses, need=need if error.failure is Failure.TIMEOUT else None)
        reached: dict[str, list[Reach | None]] = {member: [] for member in self.answer.members if member != self.member}
        for rank, member in peers.items():
            if rank not in came:
                reached[member].append(None)
            elif rank in found:
                reached[member].append(found[rank])
        diagnosis = diagnose(error.failure, reached)
        self._unreachable = diagnosis.unreachable
        self._cut = {
            member: [address for rank, address in addresses.items() if peers[rank] == member]
            for member, verdict in diagnosis.verdicts.items()
            if verdict in (Verdict.CUT_OFF, Verdict.SLOW_LINK)
        }
        self._cut_need = need
        return diagnosis

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
        assert self.comm is not None
        self._leader_calls += 1
        self._leader_asks = 0
        key = f"leader/{self._leader_calls}"
        store = self.comm.store
        if leads:
            result = run()
            if self.group.rank == 0:
                # a done-mark the waiters miss is covered by their broken-quorum watch
                with contextlib.suppress(RuntimeError, dist.DistError):
                    store.set(key, "done")
            return None, result
        assert self.answer is not None
        leader = self.answer.members[0]
        deadline = time.monotonic() + self.timeouts.leader_timeout
        served = 0
        delay = _FIRST_LEADER_POLL
        while time.monotonic() < deadline:
            try:
                if store.check([key]):  # a check, not a wait with a timeout: that would desync the store's client
                    return None, None
                asked = serve is not None and store.check([f"{key}/ask/{served + 1}/{self.group.rank}"])
            except (RuntimeError, dist.DistError):
                return LeaderLoss(leader, self.quorum_id, ()), None  # the store is gone: so is the quorum
            if asked:
                assert serve is not None
                try:
                    serve()
                except CollectiveError as error:
                    log.warning("%s: the leader's gather failed (%s)", self.member, error)
                    return LeaderLoss(leader, self.quorum_id, self.broken_by()), None
                served += 1
                continue
            if self.abandon():
                return LeaderLoss(leader, self.quorum_id, self.broken_by()), None
            time.sleep(delay)
            delay = min(2 * delay, _LEADER_POLL)
        raise JoinError(
            f"{self.member}: the quorum's leader {leader} did not finish its on_leader work within "
            f"{self.timeouts.describe('leader_timeout')}"
        )

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
                time.sleep(_LEADER_POLL)
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
        self._leader_asks += 1
        self.comm.store.set(f"leader/{self._leader_calls}/ask/{self._leader_asks}/{self.group.rank}", "1")

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

    # --- checks against the peers ----------------------------------------------------------------

    def _check_layout(self, answer: QuorumAnswer, store: dist.Store) -> None:
        """Refuse to train beside a group that shards differently (FSDP2), or shards when this one does not."""
        heal = answer.heal
        reference = 0 if heal is None or heal.source_rank is None else heal.source_rank
        if reference == answer.rank:
            return
        name = answer.members[reference]
        size = self.group_sizes[reference]
        theirs = _peer_text(store, f"layout/{name}/{min(self.group.rank, size - 1)}")
        if (theirs == REPLICATED) != (self.layout == REPLICATED):
            raise ShardingMismatchError(
                f"replica group {self.member!r} {'does not shard' if self.layout == REPLICATED else 'shards'} its "
                f"model with FSDP2 and group {name!r} {'does' if theirs != REPLICATED else 'does not'}: every group "
                "of a job must run the same training script"
            )
        if self.layout == REPLICATED:
            return
        if size != self.group.size:
            raise ShardingMismatchError(
                f"replica group {self.member!r} shards its model over {self.group.size} processes and group "
                f"{name!r} over {size}: every FSDP2 group of a job needs the same number of processes"
            )
        if theirs != self.layout:
            raise ShardingMismatchError(
                f"process {self.group.rank} of replica group {self.member!r} holds its shard with layout "
                f"{self.layout}, group {name!r}'s with {theirs}: every group must fully_shard the same model "
                "the same way (see stalwart.runtime.sharding.sharding_layout)"
            )

    def _check_data(self, answer: QuorumAnswer, store: dist.Store) -> None:
        """Refuse to train beside a member whose dataset has other shards: the same index would be another sample."""
        heal = answer.heal
        reference = 0 if heal is None or heal.source_rank is None else heal.source_rank
        if reference == answer.rank:
            return
        name = answer.members[reference]
        theirs = _peer_text(store, f"data/{name}/0")
        if theirs and self.data_fingerprint and theirs != self.data_fingerprint:
            difference = None
            try:
                listed = json.loads(store.get(f"data-shards/{name}/0"))
                their_shards = [ShardIdentity.from_list(item) for item in listed]
                difference = shard_difference(their_shards, self.data_identities, f"member {name!r}'s dataset")
            except (ValueError, TypeError):
                pass  # a peer's malformed list: the fingerprints' difference is the message
            raise PlanMismatchError(
                f"member {self.member!r} reads a dataset with fingerprint {self.data_fingerprint} and member "
                f"{name!r} one with {theirs}" + (f" ({difference})" if difference else "") + ": every member must "
                "read the same shards in the same order (the same row counts and contents; sort the file list)"
            )


def _peer_text(store: dist.Store, key: str) -> str:
    """A peer's text value (a layout, a fingerprint); malformed (not UTF-8, too long) is a failed collective."""
    return _decoded(key, bytes(store.get(key)))


def _decoded(key: str, raw: bytes) -> str:
    """The text a peer stored under ``key``; malformed (not UTF-8, too long) is a failed collective."""
    try:
        if len(raw) > MAX_PEER_TEXT:
            raise ValueError(f"{len(raw)} bytes, over {MAX_PEER_TEXT}")
        return raw.decode("utf-8")
    except ValueError as error:
        raise CollectiveError(f"a peer's {key!r} in the quorum's store is malformed ({error})") from None


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
        text = _decoded(key, raw)
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


class _Reprobe:
    """While a quorum request waits: probe the members ``cut`` (their addresses) every :data:`REPROBE_INTERVAL`,
    carrying ``need``'s bytes, and tell the lighthouse those every process of which answered (each round: the
    lighthouse ends only cuts that still stand, and a peer's report may come after the first).

    A context manager: the probing runs on a daemon thread from entry to exit.
    """

    def __init__(self, member: str, client: LighthouseClient, cut: dict[str, list[str]], need: LinkNeed | None) -> None:
        self._member = member
        self._client = client
        self._cut = {peer: addresses for peer, addresses in cut.items() if addresses}
        self._need = need
        self._stop = threading.Event()

    def __enter__(self) -> _Reprobe:
        if self._cut:
            threading.Thread(target=self._run, name="stalwart-reprobe", daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()  # not joined: a probe in flight ends by its own timeout and reports nothing after this

    def _run(self) -> None:
        told: set[str] = set()
        while not self._stop.wait(REPROBE_INTERVAL):
            addresses = {(peer, i): address for peer, listed in self._cut.items() for i, address in enumerate(listed)}
            found = probe(addresses, need=self._need)
            reached = [
                peer
                for peer in self._cut
                if all(found[(peer, i)] is Reach.REACHABLE for i in range(len(self._cut[peer])))
            ]
            if not reached or self._stop.is_set():
                continue
            try:
                ended = self._client.report_reached(reached)
            except (LighthouseError, LighthouseUnreachable, TimeoutError, RuntimeError) as error:  # closed: done
                log.info("%s: could not tell the lighthouse it reaches %s again: %s", self._member, reached, error)
                continue
            if set(reached) - told:
                log.warning("%s: reaches %s again (%d cut(s) ended)", self._member, ", ".join(reached), ended)
                told.update(reached)


def _within(seconds: float, call: Callable[[], _T]) -> _T | None:
    """``call()``'s result, or None when it did not return within ``seconds``.

    It runs on a daemon thread of its own, left to end by its own timeouts: a
    store client's connection is per thread, so the look goes out on a new
    connection, never on one a dead path left waiting.
    """
    results: list[_T] = []
    done = threading.Event()

    def run() -> None:
        try:
            results.append(call())
        finally:
            done.set()

    threading.Thread(target=run, name="stalwart-diagnosis", daemon=True).start()
    return results[0] if done.wait(seconds) and results else None
