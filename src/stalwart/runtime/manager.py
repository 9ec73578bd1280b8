"""The Manager: one per worker process, running failure-transparent steps in the user's own training loop.

The loop stays the one a DDP script has::

    for step in manager.steps(loader, max_steps=1000):
        for inputs, targets in step:                      # this worker's share, in micro-batches
            step.backward(loss_fn(model(inputs), targets))   # a mean loss, as torch's losses give
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the quorum's reduced mean gradient
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

A step (see docs/protocol.md)::

    quorum (only when membership changed) -> share -> micro-batches, backward
      -> gradient buckets all-reduced while the last backward runs, the last
         one with the tail (stalwart.runtime.tail)
      -> divide by the step's summed weights -> the user's update window
         (clip, GradScaler, optimizer.step(), scheduler) -> commit

When a bucket's all-reduce fails (a peer died or hung), this member keeps its
gradient accumulator (buckets reduce copies: :mod:`stalwart.runtime.reducer`),
asks the lighthouse for a new quorum, computes the positions it was given on
top of what it has done (the dead member's share, split among the survivors),
and all-reduces again in the new group, all inside the iteration of the
step's micro-batches: the user's update sees the same reduced gradient as
without the failure. A member that is behind (it joined, restarted, or missed
the end of a step) is healed from a live peer before it takes part.

The parts, each with one job: :mod:`~stalwart.runtime.session` (join,
connect, heal), :mod:`~stalwart.runtime.planner` (shares and foresight),
:mod:`~stalwart.runtime.accumulation` (micro-batches and the reduction),
:mod:`~stalwart.runtime.tail` (the reduced tail's format),
:mod:`~stalwart.runtime.drift` and :mod:`~stalwart.runtime.consistency`
(replica check and data audit), :mod:`~stalwart.runtime.update` (the update
contract), :mod:`~stalwart.runtime.rebalance`, :mod:`~stalwart.runtime.checkpointing`,
and :mod:`~stalwart.runtime.zero` (sharded state and its repair).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import socket
import threading
from collections.abc import Callable, Collection, Generator, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from stalwart._validate import check_int
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.data.audit import StepAuditWriter
from stalwart.data.info import DataLoadingInfo
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.errors import JobFinishedError, JoinError, PlanMismatchError, StepContractError
from stalwart.redundancy.config import Redundancy, parse_redundancy
from stalwart.runtime.accumulation import Source, StepAccumulation
from stalwart.runtime.checkpointing import CheckpointPolicy
from stalwart.runtime.comm import CollectiveError, default_device
from stalwart.runtime.config import Checkpointing, Checks, Reduction, ReplicaGroup, Transport
from stalwart.runtime.consistency import check_loaded
from stalwart.runtime.diagnosis import LeaderLoss
from stalwart.runtime.diloco.config import DiLoCo, check_against
from stalwart.runtime.diloco.rounds import RoundLoop
from stalwart.runtime.drift import DriftCheck
from stalwart.runtime.events import Event, check_events
from stalwart.runtime.feed import SamplerFeed
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.patience import MAX_GROWTH, QUIET_STEPS, CollectivePatience, QuorumView
from stalwart.runtime.planner import StepPlanner
from stalwart.runtime.preemption import Departure, departing_members
from stalwart.runtime.probe import LinkNeed
from stalwart.runtime.rebalance import BalanceWindow
from stalwart.runtime.replica import Replica
from stalwart.runtime.session import REPLICATED, QuorumSession
from stalwart.runtime.sharding import is_sharded, prepare_fsdp, sharding_layout
from stalwart.runtime.state import Stateful
from stalwart.runtime.step import StepReport, TrainStep
from stalwart.runtime.tail import ReducedTail, TailHead, TailLayout
from stalwart.runtime.threads import apply_thread_default
from stalwart.runtime.timeouts import Timeouts
from stalwart.runtime.update import UpdateWindow
from stalwart.runtime.values import LoopValues
from stalwart.runtime.zero import RepairStats, ShardedOptimizer
from stalwart.runtime.zero.whole import WholeStateDict

log = logging.getLogger(__name__)
_CLOSE_WAIT = 120.0
"""Seconds ``close()`` waits for a checkpoint being written and reported."""


class Manager:
    """Keeps one worker (or one replica group's process) in the quorum and runs its steps.

    ``lighthouse`` is the lighthouse's URL (default: the
    ``STALWART_LIGHTHOUSE`` environment variable), ``member`` this worker's
    name there (default: ``STALWART_MEMBER``; its replica group's, when
    ``group`` says this process is one of several launched together: the
    group's share is then split among its processes by intra-group rank).
    ``token`` defaults to ``STALWART_LIGHTHOUSE_TOKEN``. ``plan`` (an
    :class:`~stalwart.data.plan.EpochPlan`: dataset size, global batch, seed,
    ``local_batch_multiple``) is offered to the lighthouse, which adopts it if
    it has none, and must equal the lighthouse's plan
    (:class:`~stalwart.errors.PlanMismatchError` otherwise). A step's share is
    cut into micro-batches of at most ``max_microbatch`` samples.

    The optimizer is the user's: call ``optimizer.step()`` in the loop body
    after iterating the step (:mod:`stalwart.runtime.update`; any number of
    parameter groups, on every path). With ``redundancy``
    (:class:`~stalwart.redundancy.config.Overlap` or
    :class:`~stalwart.redundancy.config.Parity`, or the text ``"overlap:0.5"``
    or ``"parity:2,1"`` a config system of literals can pass) its state and an fp32 master
    are sharded over the quorum's processes (ZeRO stage 1, SGD, Adam or
    AdamW; :mod:`stalwart.runtime.zero`); ``node`` labels this process's
    machine (default: the host name), so that copies and parity go to other
    nodes. ``optimizer.state_dict()`` then gathers the whole state in torch's
    format, a collective: every process calls it at the same point of the
    loop body, or the leader inside :meth:`on_leader`; ``load_state_dict()``
    of a whole state keeps each process's shards of it, at any number of
    processes (:mod:`stalwart.runtime.zero.whole`). In FSDP2 groups
    (``fully_shard`` over a mesh of the group's own
    processes; build the Manager after ``fully_shard``) it runs as
    fault-tolerant HSDP, and with ``redundancy`` the processes holding the same
    FSDP shard split that shard's optimizer state.

    The rest is grouped: ``checkpoint`` (:class:`~stalwart.runtime.config.Checkpointing`:
    durable checkpoints that a whole-fleet restart resumes from), ``reduction``
    (bucket size, reduce dtype), ``checks`` (replica consistency, heal
    budget, an audit directory for ``stalwart audit``), ``transport`` (this process's address, heartbeat, join
    attempts), ``timeouts`` (:class:`~stalwart.runtime.timeouts.Timeouts`,
    default: from the environment), ``group`` (a replica group's place and
    store), ``device`` (default: the GPU of ``LOCAL_RANK`` when CUDA is
    available, else the CPU). ``on_event(event, step)`` is told each
    :class:`~stalwart.runtime.events.Event` (a ``str`` enum: ``joined``,
    ``healed``, ``reduce_started``, ``reduce_finished``, ``update_started``,
    ``gather_started`` and ``parity_started``; with ``sync`` also
    ``exchange_started`` and ``outer_started`` with the round, and
    ``quorum_broken`` when an inner step saw a group die), for tracing and for
    tests that kill a worker at those points; ``events`` (a collection of
    those, or of their names; default all) limits what it is told.

    ``sync``: :class:`~stalwart.runtime.diloco.config.DiLoCo` trains
    semi-synchronously across replica groups (DiLoCo, Streaming DiLoCo): the
    loop is the same, each step it yields is an *inner* step whose gradients
    reduce within the replica group only, and every ``inner_steps`` of them the
    groups average their pseudo-gradients and take the outer optimizer's step
    (:mod:`stalwart.runtime.diloco`). The plan's global batch is then the inner
    steps' (over every group), a step of the ledger is a round of
    ``inner_steps`` of them, and ``steps(max_steps=...)`` counts inner steps.

    ``sigterm``: SIGTERM (a preemption, a scheduler's stop) makes this worker
    leave at the next step boundary, announced, instead of dying mid-step
    (:meth:`request_departure` is the same for a cloud's preemption notice):
    ``steps()`` then ends and :attr:`departed` is True. None (the default)
    installs the handler when the Manager is built in the main thread and
    ``sync`` is unset; True requires it; False leaves SIGTERM alone. The
    handler chains to the one installed before, and ``close()`` puts that back.

    A member's state, healed as one, is the model, the optimizer, what
    :meth:`register_state` added (an LR scheduler, a GradScaler) and the
    random generators. Started outside torchrun with ``OMP_NUM_THREADS``
    unset, the process gets one thread, as torchrun gives it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        max_microbatch: int,
        lighthouse: str | None = None,
        member: str | None = None,
        token: str | None = None,
        plan: EpochPlan | None = None,
        redundancy: Redundancy | str | None = None,
        node: str | None = None,
        checkpoint: Checkpointing | None = None,
        reduction: Reduction | None = None,
        checks: Checks | None = None,
        transport: Transport | None = None,
        timeouts: Timeouts | None = None,
        group: ReplicaGroup | None = None,
        device: torch.device | None = None,
        on_event: Callable[[Event, int], None] | None = None,
        events: Collection[str] | None = None,
        sync: DiLoCo | None = None,
        sigterm: bool | None = None,
    ) -> None:
        lighthouse = _from_environment("lighthouse", lighthouse, "STALWART_LIGHTHOUSE")
        member = _from_environment("member", member, "STALWART_MEMBER")
        _check_arguments(model, optimizer, member, plan, checkpoint, reduction, checks, transport, timeouts, group)
        redundancy = parse_redundancy(redundancy)
        wanted_events = check_events(events)
        _check_sync(sync, model, redundancy, checkpoint)
        install_sigterm = _check_sigterm(sigterm, sync)
        if sync is not None and plan is not None:  # the ledger's step is a round of inner steps
            plan = dataclasses.replace(plan, global_batch_size=plan.global_batch_size * sync.inner_steps)
        apply_thread_default()
        self.timeouts = timeouts or Timeouts.resolve()
        self.max_microbatch = check_int("max_microbatch", max_microbatch, minimum=1)
        self.member = member
        self.model = model
        self.optimizer = optimizer
        self.device = device or default_device()
        self.checks = checks or Checks()
        self.recoveries = 0
        self.last_report: StepReport | None = None
        self.joined_after_end = False
        """True when this worker joined after the job's last step and loaded its final checkpoint."""
        self.departed = False
        """True once this worker left the quorum at a step boundary on request (SIGTERM, ``request_departure``)."""
        group = group or ReplicaGroup()
        transport = transport or Transport()
        fsdp = is_sharded(model)
        if fsdp:
            prepare_fsdp(model)
        params = [param for param in model.parameters() if param.requires_grad]
        self._replica = Replica(model, optimizer)
        self._zero = (
            None
            if redundancy is None
            else ShardedOptimizer(params, optimizer, redundancy, node=node or socket.gethostname())
        )
        self._session = QuorumSession(
            lighthouse,
            member,
            token=token if token is not None else os.environ.get("STALWART_LIGHTHOUSE_TOKEN") or None,
            plan=plan,
            group=group,
            transport=transport,
            timeouts=self.timeouts,
            device=self.device,
            layout=sharding_layout(model) if fsdp else REPLICATED,
            leaving=lambda: self._departure.requested,
        )
        self._transport = transport
        self._plan = plan
        self._planner = StepPlanner(
            member, group.world.rank, group.world.world_size, self.max_microbatch, lockstep=fsdp
        )
        self._accumulation = StepAccumulation(
            model,
            params,
            device=self.device,
            reduction=reduction or Reduction(),
            max_microbatch=self.max_microbatch,
            lockstep=fsdp,
        )
        self._window = UpdateWindow(optimizer, sharded=self._zero, notify=self._notify, sync=self._sync_shards)
        self._leading = False
        """Inside ``on_leader``'s work on the leader: a gather of the sharded state asks the waiting processes."""
        self._whole = None if self._zero is None else WholeStateDict(optimizer, self._zero, self._gather_whole_state)
        self._drift = DriftCheck(
            params,
            self.checks.every,
            enabled=sync is None,
            group_size=group.world.world_size if fsdp else 1,
        )
        self._balance = BalanceWindow()
        audit_dir = self.checks.audit_dir
        self._step_audit = None if audit_dir is None or group.world.rank else StepAuditWriter(audit_dir, member)
        self._checkpoints = (
            None
            if checkpoint is None
            else CheckpointPolicy(checkpoint, self._session, self._replica, self._zero, fsdp_group=fsdp)
        )
        self._on_event = on_event
        self._events = wanted_events
        self._reconfigure = True
        self._leader_loss: LeaderLoss | None = None
        """The current quorum broke while its leader ran on_leader() work: its failures' messages say so."""
        self._max_steps: int | None = None
        self._started = False
        self._feed: SamplerFeed | None = None
        self._reduced: ReducedTail | None = None
        self._warned_no_update = False
        self._finished = False
        """The job's end was reached here (its last step, or a late join): ``close()`` then leaves cleanly."""
        self._untrained_late_join = False
        self._stepping = False
        """A step was yielded and has not committed: a rejoin now is a mid-step one."""
        self._rounds = None if sync is None else RoundLoop(self, sync, params)
        self._departure = Departure()
        self._patience = CollectivePatience(self.timeouts.collective_timeout)
        self._leaving: tuple[int, ...] = ()
        """The quorum ranks whose processes leave at the boundary of the step just committed."""
        if install_sigterm:
            self._departure.install()

    # --- what the training loop reads ---------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True for the quorum's first process (rank 0): where to log and write outputs."""
        return self._session.rank == 0

    @property
    def rank(self) -> int:
        """This process's rank among the quorum's processes (-1 before the first quorum)."""
        return self._session.rank

    @property
    def num_processes(self) -> int:
        """How many processes the quorum has (every process of every replica group)."""
        return self._session.processes

    @property
    def world_size(self) -> int:
        """How many members (replica groups) the current quorum has."""
        return len(self._session.members)

    @property
    def quorum_id(self) -> int:
        """The id of the quorum this member runs steps in (-1 before the first)."""
        return self._session.quorum_id

    @property
    def step(self) -> int:
        """The step being trained (before it commits), or the next one between steps."""
        return self.ledger.step

    @property
    def applied_step(self) -> int:
        """Steps this replica holds applied."""
        return self._replica.applied_step

    @property
    def ledger(self) -> DataLedger:
        """This member's replica of the lighthouse's ledger."""
        return self._planner.ledger

    @property
    def drift_heals(self) -> int:
        """Replicas healed because their parameters drifted from the majority (over the Manager's life)."""
        return self._drift.heals

    @property
    def boundary_wanted(self) -> bool:
        """True while the lighthouse asks this member's quorum to come to a step boundary (a join, a failure)."""
        return self._session.boundary_wanted

    @property
    def departing(self) -> bool:
        """True once a departure was requested (SIGTERM, :meth:`request_departure`), before and after it happens."""
        return self._departure.requested

    def request_departure(self, reason: str = "preemption notice") -> None:
        """Leave the quorum at the next step boundary, announced: the hook for a cloud's preemption notice.

        Safe from any thread (a poller of the instance metadata, say) and from
        a signal handler; SIGTERM does the same when the Manager installed its
        handler (``sigterm``). The step in progress (or the next one) ends as
        usual, every member learns of the departure from its reduction, and
        after it commits this worker leaves (``/v1/leave``): ``steps()`` ends,
        :attr:`departed` is True, and the others go on without it, retraining
        nothing and waiting for no timeout (docs/design.md, "Preemption").
        """
        if self._rounds is not None:
            raise RuntimeError("request_departure() is not supported with sync=DiLoCo(...) yet")
        self._departure.request(reason)

    @property
    def redundancy_stats(self) -> tuple[int, RepairStats] | None:
        """With ``redundancy``: this process's sharded state bytes and what its reshards did; else None."""
        return None if self._zero is None else (self._zero.state_bytes, self._zero.stats)

    @property
    def dropped_microbatches(self) -> int:
        """Micro-batches the DataLoader of ``steps()`` prefetched for a superseded share and that were dropped."""
        return 0 if self._feed is None else self._feed.dropped

    @property
    def last_round(self) -> StepReport | None:
        """DiLoCo: what the last committed round did (``step``: the round, ``positions``: all its samples)."""
        return None if self._rounds is None else self._rounds.last_round

    @property
    def diloco(self) -> RoundLoop | None:
        """DiLoCo's round loop (its outer state and its traffic), or None in the every-step mode."""
        return self._rounds

    @property
    def states(self) -> dict[str, Stateful]:
        """Everything a heal copies, in order: model, optimizer, registered states, random generators."""
        return self._replica.states

    def register_state(self, name: str, obj: Stateful) -> None:
        """Make ``obj`` part of this member's state, healed with the model and optimizer under ``name``.

        ``obj`` needs ``state_dict()`` and ``load_state_dict()`` (an LR
        scheduler, a ``GradScaler``, an EMA module, a counters object); its state
        may hold nested dicts, lists, tuples, JSON scalars and tensors. Every
        member must register the same names in the same order, before
        ``manager.steps()`` starts.
        """
        if self._started:
            raise RuntimeError(f"register_state({name!r}) must be called before manager.steps() starts")
        self._replica.register(name, obj)

    def register_values(self, name: str, **values: Any) -> LoopValues:
        """Plain loop values (``best_val_loss=1e9, iter_num=0``) healed with the model under ``name``.

        Returns a :class:`~stalwart.runtime.values.LoopValues`: read and set
        the values as its attributes (``loop.best_val_loss = ...``). Values
        are numbers, strings, booleans, None, and lists and dicts of them;
        they travel as JSON, never pickled. As with :meth:`register_state`,
        every member registers the same names before ``manager.steps()``.
        """
        loop_values = LoopValues(**values)
        self.register_state(name, loop_values)
        return loop_values

    def get_data_loading_info(self) -> DataLoadingInfo:
        """Where this process's samples of the current step come from (the proposal's ``DataLoadingInfo``).

        Valid inside a step. ``base_index`` and ``missing_indices`` are the
        ledger's as the step began, also after a failure retry; ``indices`` are
        this process's part of its group's share as it stands now.
        """
        if self._session.answer is None:
            raise RuntimeError("get_data_loading_info() needs a step in progress: call it inside manager.steps()")
        return self._planner.data_loading_info(self._session.group_sizes)

    def on_leader(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the leading replica group only (evaluation, saving); the others wait.

        Every process of the quorum calls it at the same point of the loop
        body. The others wait without a collective (watching the lighthouse
        for the leader's death, bounded by ``leader_timeout``), so nothing
        times out while the leader evaluates. Returns ``fn``'s result on the
        leading group's processes and None elsewhere; if the leader dies
        meanwhile, the quorum re-forms before the next step. With sharded
        optimizer state, ``optimizer.state_dict()`` inside ``fn`` gathers the
        whole state onto the leader: the waiting processes send their shards
        when asked (a script's own checkpoint saved here holds every moment).
        """
        if self._session.answer is None or self._session.comm is None:
            raise RuntimeError("on_leader() needs a quorum: call it inside the manager.steps() loop")
        if self._rounds is not None:  # groups are not in lockstep within a round: the others go on
            return fn(*args, **kwargs) if self._session.answer.rank == 0 else None
        leads = self._session.answer.rank == 0
        serve = None if self._zero is None else self._serve_leader_gather
        self._leading = leads
        try:
            loss, result = self._session.wait_for_leader(leads, lambda: fn(*args, **kwargs), serve)
        except CollectiveError as error:  # only the gather of optimizer.state_dict() runs collectives in there
            log.warning(
                "%s: on_leader's work stopped: gathering the optimizer state failed (%s); the quorum re-forms "
                "before the next step",
                self.member,
                error,
            )
            self._reconfigure = True
            return None
        finally:
            self._leading = False
        if loss is not None:
            self._reconfigure = True
            self._leader_loss = loss
            log.warning("%s: %s; the quorum re-forms before the next step", self.member, loss.describe())
        return result

    def _gather_whole_state(self) -> dict[int, dict[str, Any]]:
        """The user's ``optimizer.state_dict()`` under sharded state: the whole state, gathered (a collective).

        On the leader inside :meth:`on_leader`, the waiting processes are asked
        to send their shards; elsewhere every process calls it together.
        """
        zero, comm = self._zero, self._session.grad_comm
        assert zero is not None
        if comm is None:
            raise RuntimeError(
                "optimizer.state_dict() with sharded optimizer state (redundancy=) gathers the state from the "
                "quorum's processes: call it inside the manager.steps() loop, before manager.close()"
            )
        if self._leading:
            self._session.ask_waiters()
        else:
            self._session.meet("optimizer.state_dict()")
        moments = zero.gather_moments(comm, to_rank=0 if self._leading else None)
        assert moments is not None  # every rank receives, or this is the leader's: rank 0 of the communicator
        return moments

    def _serve_leader_gather(self) -> None:
        """A waiting process's part of the leader's :meth:`_gather_whole_state` (its shard to the leader)."""
        assert self._zero is not None and self._session.grad_comm is not None
        self._zero.gather_moments(self._session.grad_comm, to_rank=0)

    @contextlib.contextmanager
    def _internal(self) -> Iterator[None]:
        """The Manager's own use of the optimizer (heal, checkpoints): torch's calls, unguarded and not gathered."""
        with self._window.passthrough(), self._whole.internal() if self._whole else contextlib.nullcontext():
            yield

    # --- the step loop ---------------------------------------------------------------------------------

    def steps(self, loader: ElasticLoader | DataLoader[Any], *, max_steps: int) -> Iterator[TrainStep]:
        """Yield one :class:`TrainStep` per step until the job has committed ``max_steps`` steps.

        ``loader``: an :class:`ElasticLoader`, or a ``DataLoader`` whose
        ``batch_sampler`` is ``ManagedDistributedSampler(self, dataset)``.
        A step commits when the loop body after it ends. After a departure
        (SIGTERM, :meth:`request_departure`) the iteration ends at the next
        step boundary with :attr:`departed` True. Raises
        :class:`~stalwart.errors.PlanMismatchError` when the lighthouse's plan
        does not fit the loader's dataset or this worker's plan, and
        :class:`~stalwart.errors.JobFinishedError` when this worker joined
        after the job ended with no checkpoint to load the trained state from,
        or when a rejoin in the middle of a step (after a failed collective)
        finds the job ended (then from the step's iteration; with a
        checkpoint directory the final checkpoint is loaded first).

        With ``sync=DiLoCo(...)`` each step is an inner step and ``max_steps``
        counts them: a multiple of ``inner_steps`` (the job commits
        ``max_steps // inner_steps`` rounds); a survivor of a failure takes
        extra inner steps in that round.
        """
        self._max_steps = check_int("max_steps", max_steps, minimum=0)
        if self._rounds is not None:
            self._max_steps = self._rounds.rounds_for(self._max_steps)
        source = self._source(loader)
        self._session.data_fingerprint = str(getattr(loader.dataset, "fingerprint", ""))
        self._session.data_identities = list(getattr(loader.dataset, "identities", []))
        self._started = True
        try:
            if self._rounds is not None:
                yield from self._rounds.steps(source, loader, self._max_steps)
                return
            while not self.departed:
                if self._departure.requested and not self._planner.joined and self._session.group.size == 1:
                    self._depart(whole_quorum=False)  # in no quorum yet: nobody waits on this worker
                    return
                if self._reconfigure or not self._planner.joined:
                    first = not self._planner.joined
                    self._join(reason="join" if first else "reconfigure")
                    if first:
                        self._check_plan(loader)
                    if self._untrained_late_join:
                        raise JobFinishedError(
                            f"the job had already committed its {self.ledger.step} steps when {self.member} joined, "
                            "and no checkpoint holds the trained state: this worker's parameters are untrained"
                        )
                self._between_steps()
                if self.ledger.step >= max_steps:
                    self._finish()
                    return
                self._planner.begin_step()
                source.take_produced()  # anything produced outside a step is not this step's
                step = TrainStep(
                    self.ledger.step,
                    self.ledger.epoch,
                    self._planner.ends_epoch,
                    self._accumulation,
                    self._train(source),
                )
                self._stepping = True
                yield step
                self._commit(step)
                self._stepping = False
                if self._leaving and self.ledger.step < max_steps and self._boundary_departures():
                    return
                if isinstance(source, ElasticLoader) and source.prefetching:
                    foreseen = self._planner.foresee_next(max_steps)
                    if foreseen is not None:
                        source.prefetch(*foreseen)
        finally:
            if self._feed is not None:
                self._feed.close()
                self._feed = None

    def _train(self, source: Source) -> Generator[Any, None, StepReport]:
        """The step's micro-batches until its reduction succeeds (retried on failure); returns the report."""
        while True:
            part = self._planner.next_part()
            self._balance.part_started()
            yield from self._accumulation.microbatches(
                source,
                self.ledger.epoch,
                part.indices,
                part.sizes,
                arm=self._arm,
                sample_batch=lambda: self._sample_batch(source),
            )
            failure: CollectiveError | None = None
            try:
                reduced = self._reduce()
                healed = self._heal_drift(reduced)
            except CollectiveError as error:
                failure = error
            if not self._session.group_agrees(failure is None) and failure is None:
                failure = CollectiveError("another process of this replica group failed it")
            if failure is not None:
                diagnosis = self._session.diagnose(failure, need=self._link_need())
                if self._leader_loss is not None:
                    hint = f" ({self._leader_loss.describe()})"
                elif diagnosis.busy_hint:
                    hint = (
                        " (a peer that is alive but busy, e.g. evaluating, needs manager.on_leader() or a larger "
                        f"{self.timeouts.describe('collective_timeout')})"
                    )
                else:
                    hint = ""
                log.warning(
                    "%s: step %d all-reduce failed (%s); peers: %s; asking for a new quorum%s",
                    self.member,
                    self.ledger.step,
                    failure,
                    diagnosis.describe(),
                    hint,
                )
                self._join(reason="failure")
                self.recoveries += 1
                continue
            if healed:
                continue
            return self._reduced_step(reduced)

    def _reduced_step(self, reduced: ReducedTail) -> StepReport:
        """Check the reduced step (sample count, audit), put the mean gradients in place, open the update window."""
        ledger = self.ledger
        positions = self._planner.step_positions()
        if reduced.samples != positions.size:
            raise RuntimeError(
                f"step {ledger.step}: the quorum reduced {reduced.samples} samples, the ledger holds {positions.size}"
            )
        where = f"step {ledger.step}"
        check_loaded(reduced.loaded_checksum, ledger.plan, ledger.epoch, positions, where, "the quorum", "the ledger's")
        if reduced.samples:
            if not reduced.weight > 0 or not math.isfinite(reduced.weight):
                raise ValueError(
                    f"step {ledger.step}: the micro-batches' weights sum to {reduced.weight} over {reduced.samples} "
                    "samples: step.backward(loss, weight=...) takes counts >= 0 that are not all 0"
                )
            self._accumulation.apply(reduced.weight)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self._reduced = reduced
        self._window.open(ledger.step)
        self.last_report = StepReport(
            step=ledger.step,
            epoch=ledger.epoch,
            samples=reduced.samples,
            loss=reduced.mean_loss,
            world_size=self.world_size,
            quorum_id=self.quorum_id,
            recoveries=self.recoveries,
            positions=positions,
            drift_heals=self._drift.heals,
            loaded_checksum=reduced.loaded_checksum,
        )
        return self.last_report

    def _commit(self, step: TrainStep) -> None:
        """The loop body after the step ended: the step commits (its update ran, or every member skipped it)."""
        if self._reduced is None:
            raise StepContractError(
                f"step {step.number} was not iterated to its end: iterate every step's micro-batches before the next"
            )
        reduced, self._reduced = self._reduced, None
        if not self._window.close() and reduced.samples and not self._warned_no_update:
            self._warned_no_update = True
            log.warning("%s: step %d committed without optimizer.step() (a GradScaler skip?)", self.member, step.number)
        ledger = self.ledger
        epoch, ends_epoch = ledger.epoch, self._planner.ends_epoch
        self._audit_committed(epoch, step.number, ledger.commit())
        self._replica.row_digest.add(epoch, reduced.row_checksum)
        if ends_epoch and not ledger.plan.drop_last:  # every row once: each epoch must sum the same
            self._replica.row_digest.close_epoch(epoch)
        self._replica.applied_step += 1
        self._replica.trained_step = self._replica.applied_step
        self._drift.step_committed()
        if ledger.balanced:
            members, sizes = self._session.members, self._session.group_sizes
            self._balance.after_commit(ledger, reduced.balance, members, sizes, self._planner.samples, self.member)
        self._session.report = (self._replica.applied_step, ledger_digest(ledger.state_dict()), ledger.weights_record())
        self._reconfigure = self._reconfigure or reduced.reconfigure
        self._leaving = reduced.departing
        if self._patience.committed():
            self._relax_patience()
        self._reset_step()
        self.optimizer.zero_grad(set_to_none=True)

    def _audit_committed(self, epoch: int, step: int, positions: np.ndarray) -> None:
        """``Checks(audit_dir=...)``: the group's leading process records the committed step's samples."""
        if self._step_audit is not None:
            self._step_audit.write(self.ledger.plan, epoch, step, positions)

    def _arm(self) -> None:
        """Start this round's reduction; the tail's values known before the last backward go in now."""
        session = self._session
        comm, grad_comm = session.comm, session.grad_comm
        assert comm is not None and grad_comm is not None
        layout = self._tail_layout()
        client = session.client
        head = TailHead(
            drift=self._drift.slots(self.ledger.step, comm.rank, comm.world_size, self._replica.applied_step),
            loaded_checksum=self._accumulation.loaded_checksum,
            row_checksum=self._accumulation.row_checksum,
            samples=self._planner.samples,
            reconfigure=client is not None and client.reconfigure_requested,
            departures=layout.departure_slots(comm.rank, self._departure.requested),
        )
        self._accumulation.arm(
            grad_comm,
            None if grad_comm is comm else comm,
            layout,
            head,
            lambda: self._balance.slots(layout, comm.rank, self._planner.samples),
        )

    def _reduce(self) -> ReducedTail:
        """Finish the round's reduction and wait for it (an empty part arms it here)."""
        if not self._accumulation.armed:
            self._arm()
        self._notify(Event.REDUCE_STARTED)
        reduced = self._accumulation.reduce(self._tail_layout())
        self._notify(Event.REDUCE_FINISHED)
        return reduced

    def _tail_layout(self) -> TailLayout:
        assert self._session.comm is not None
        return TailLayout(self._session.comm.world_size, self.ledger.balanced)

    def _heal_drift(self, reduced: ReducedTail) -> bool:
        """If the replicas' checksums differ, heal the odd ones out from the majority and return True.

        FSDP2 groups are healed whole, shard by shard, over the communicators
        of the processes that hold the same shard (where a group's index is its rank).
        """
        comm = self._session.comm
        assert comm is not None
        plan = self._drift.plan(self.ledger.step, reduced.drift, comm.world_size)
        if plan is None:
            return False
        heal_comm = self._session.grad_comm if self._session.sharded else comm  # FSDP2 groups: by shard
        assert heal_comm is not None
        is_target = heal_comm.rank in plan.targets
        units, unit = self._drift.replica_names
        log.warning(
            "%s: step %d replicas drifted: healing %s %s from %s %d%s",
            self.member,
            self.ledger.step,
            units,
            list(plan.targets),
            unit,
            plan.source,
            " (this one)" if is_target else "",
        )
        with self._internal():
            applied = self._session.transfer(
                self._replica, plan.source, is_target=is_target, budget=self.checks.max_heal_bytes, comm=heal_comm
            )
        if is_target:
            self._replica.applied_step = applied
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_step()  # recompute this process's whole part with the healed parameters
        return True

    def _sync_shards(self) -> None:
        """After the sharded update: gather the parameters, re-encode parity; a failure re-forms the quorum.

        The step commits anyway: every survivor holds its updated shards (and,
        for parity, its shard as before the update), so the next quorum's
        reshard finishes the update without training anything again.
        """
        zero, grad_comm = self._zero, self._session.grad_comm
        assert zero is not None and grad_comm is not None
        step = self.ledger.step
        failed = False
        try:
            zero.sync(grad_comm, lambda event: self._notify(event, step), check=step % self._drift.every == 0)
        except CollectiveError as error:
            log.warning("%s: step %d's parameter gather failed (%s); asking for a new quorum", self.member, step, error)
            failed = True
        # A replica group's processes must all ask for the next quorum, or none (the gather can end differently
        # on them): they vote in the group's store, as after each reduction. Other groups find out at their next
        # collective.
        if not self._session.group_agrees(not failed):
            self._reconfigure = True

    # --- quorums ---------------------------------------------------------------------------------------

    def _join(self, reason: str) -> None:
        """Ask for a quorum until this member is in one, its group is up and it is healed (bounded attempts)."""
        session = self._session
        last_failure = "none"
        attempts = self._transport.max_join_attempts
        for attempt in range(1, attempts + 1):
            session.abort()
            answer = session.next_answer(reason, self._replica.applied_step)
            if answer is None:
                reason, last_failure = "join", "excluded from the quorum"
                continue
            session.adopt(answer)
            self._planner.adopt(answer.ledger, answer.members)
            self._grow_patience(answer.quorum_id, answer.members)
            try:
                session.connect(answer)
                if answer.heal is not None:
                    self._heal(answer)
                if self._zero is not None:
                    assert session.grad_comm is not None  # FSDP2 groups: the processes holding this process's shard
                    self._zero.reshard(session.grad_comm, self._replica.applied_step)
            except CollectiveError as error:
                log.warning(
                    "%s: quorum %d could not start (%s); peers: %s; asking again (attempt %d of %d)",
                    self.member,
                    answer.quorum_id,
                    error,
                    session.diagnose(error, need=self._link_need()).describe(),
                    attempt,
                    attempts,
                )
                reason = "failure" if self._planner.covered else "reconfigure"
                session.abort()
                last_failure = str(error)
                continue
            self._reconfigure = False
            self._leader_loss = None
            self._notify(Event.JOINED)
            return
        raise JoinError(
            f"{self.member}: no working quorum after {attempts} attempts "
            f"(Transport.max_join_attempts={attempts}); last failure: {last_failure}"
        )

    def _link_need(self) -> LinkNeed:
        """What each link must carry: one step's all-reduce within the configured collective timeout (not the one
        patience grew: a link that needs the growth is a straggler's, see :mod:`stalwart.runtime.probe`)."""
        return LinkNeed(max(1, self._accumulation.reducer.step_bytes), self.timeouts.collective_timeout)

    def _grow_patience(self, quorum_id: int, members: tuple[str, ...]) -> None:
        """The adopted quorum's collective timeout (:mod:`stalwart.runtime.patience`), logged when it changes."""
        before = self._patience.timeout
        timeout = self._patience.adopt(QuorumView(quorum_id, members))
        self._session.timeouts = dataclasses.replace(self.timeouts, collective_timeout=timeout)
        if timeout > before:
            log.warning(
                "%s: quorum %d has the members of the last one, which broke: collective timeout "
                "%g s -> %g s (x%d of %s; at most x%d)",
                self.member,
                quorum_id,
                before,
                timeout,
                self._patience.growth,
                self.timeouts.describe("collective_timeout"),
                MAX_GROWTH,
            )
        elif timeout < before:
            log.info("%s: quorum %d has new members: collective timeout back to %g s", self.member, quorum_id, timeout)

    def _relax_patience(self) -> None:
        """Quiet steps halved the collective timeout: every member of the quorum at this same step, from now on."""
        timeout = self._patience.timeout
        self._session.timeouts = dataclasses.replace(self.timeouts, collective_timeout=timeout)
        for comm in (self._session.comm, self._session.grad_comm):  # one object twice without FSDP2 groups
            if comm is not None:
                comm.timeout = timeout
        log.info("%s: %d quiet steps: collective timeout down to %g s", self.member, QUIET_STEPS, timeout)

    def _heal(self, answer: Any) -> None:
        """Take part in the quorum's heal: from a live member, or (a target) from the announced checkpoint."""
        with self._internal():
            outcome = self._session.heal(
                answer, self._replica, max_steps=self._max_steps, max_bytes=self.checks.max_heal_bytes
            )
        if outcome.checkpoint is not None:
            if self._checkpoints is None:
                raise JobFinishedError(
                    f"{self.member}: the job resumes from checkpoint {outcome.checkpoint.path}, but this worker has "
                    "no checkpoint directory (Manager(checkpoint=Checkpointing(...))) to load it from"
                )
            with self._internal():
                step = self._checkpoints.load(outcome.checkpoint)
            self._replica.applied_step = step
            self._session.report = (step, outcome.checkpoint.digest, self.ledger.weights_record())
            self.joined_after_end = outcome.job_finished
            if self.joined_after_end:
                log.warning(
                    "%s: joined after the job committed its %d steps: loaded the final checkpoint, nothing to train",
                    self.member,
                    step,
                )
        elif outcome.job_finished:
            self._finished = True
            self._untrained_late_join = True
        if outcome.loaded or outcome.checkpoint is not None:
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_step()
            if self._rounds is not None:
                self._rounds.healed()
            self._notify(Event.HEALED)
        if outcome.job_finished and self._stepping:
            self._stop_mid_step()

    def _stop_mid_step(self) -> None:
        """A mid-step rejoin found the job past its last step: stop as a late joiner does, never train on.

        The step in progress is not the ledger's any more (the ledger is
        finished), so training it would reduce samples the ledger does not
        hold. With a checkpoint directory the final checkpoint is loaded
        (``joined_after_end``); either way the loop ends with
        :class:`~stalwart.errors.JobFinishedError` (raised from the step's
        iteration, where the loop body cannot be skipped) and ``close()``
        leaves cleanly.
        """
        self._finished = True
        state = (
            "its final checkpoint is loaded (manager.joined_after_end)"
            if self.joined_after_end
            else "no checkpoint holds the trained state: this worker's parameters are not the job's"
        )
        raise JobFinishedError(
            f"the job committed its {self.ledger.step} steps while {self.member} was rejoining in the middle of a "
            f"step; {state}"
        )

    def _check_plan(self, loader: ElasticLoader | DataLoader[Any]) -> None:
        """The lighthouse's plan against this worker's (``plan=``) and its loader's dataset (first join)."""
        theirs = self.ledger.plan
        if self._plan is not None and self._plan != theirs:
            raise PlanMismatchError(
                f"{self.member}: the lighthouse trains on {theirs} but this worker's plan is {self._plan}: give both "
                "the same plan"
            )
        try:
            length: int | None = len(loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            length = None
        self._planner.check_dataset(length)

    # --- between steps ---------------------------------------------------------------------------------

    def _between_steps(self) -> None:
        if self._checkpoints is None:
            return
        with self._internal():
            if not self._checkpoints.between_steps(self.ledger):
                self._reconfigure = True

    def _finish(self) -> None:
        """The job's last step is committed: the final checkpoint, then the farewell all-reduce."""
        self._finished = True
        if self._checkpoints is not None:
            with self._internal():
                self._checkpoints.final(self.ledger)
        self._session.farewell()

    def _boundary_departures(self) -> bool:
        """Members leave at the boundary of the step just committed: True if this process's group is one of them.

        Every member read the same departures from the step's reduction, so
        all of them are here: one last tiny all-reduce (the farewell) makes
        sure no member still waits on a collective of a departing one, then
        the departing groups leave announced and the others form the next
        quorum without them (a boundary, not a failure).
        """
        session = self._session
        leaving = departing_members(self._leaving, session.members, session.group_sizes)
        self._leaving = ()
        session.farewell()
        if self.member not in leaving:
            log.warning(
                "%s: %s leave(s) the quorum after step %d; re-forming without them",
                self.member,
                ", ".join(leaving),
                self.ledger.step - 1,
            )
            self._reconfigure = True
            return False
        whole_quorum = len(leaving) == len(session.members)
        if whole_quorum and self._checkpoints is not None:  # nobody keeps the state: it goes to a checkpoint
            with self._internal():
                self._checkpoints.final(self.ledger)
        self._depart(whole_quorum=whole_quorum)
        return True

    def _depart(self, *, whole_quorum: bool) -> None:
        """Leave at a step boundary: after a checkpoint being written is reported, announced (``/v1/leave``).

        When the whole quorum departs, no survivor holds the job's state: it
        was checkpointed at this boundary (with a checkpoint directory), and the
        members leave unannounced (failures), so that the restarted job resumes
        from that checkpoint instead of taking the job for ended.
        """
        self.departed = True
        self._departure.uninstall()  # from here SIGTERM takes its previous action
        log.warning(
            "%s: departing (%s) %s%s",
            self.member,
            self._departure.reason or "another process of its replica group was asked",
            f"after step {self.ledger.step - 1}" if self._planner.joined else "before its first quorum",
            "; the whole quorum departs: a restart resumes from the last checkpoint" if whole_quorum else "",
        )
        if self._checkpoints is not None and not self._checkpoints.wait(_CLOSE_WAIT):
            log.warning("%s: a checkpoint was still being written after %g s; leaving anyway", self.member, _CLOSE_WAIT)
        self._session.close(self.applied_step, leave=not whole_quorum)

    def _reset_step(self) -> None:
        self._planner.reset_step()
        self._accumulation.reset()
        self._balance.reset_step()

    def _sample_batch(self, source: Source) -> Any:
        """A one-sample batch (any sample of the epoch), for the shape of a zero-sample batch; not audited."""
        if not isinstance(source, ElasticLoader):
            raise RuntimeError(
                "an FSDP2 group's process got no samples before its first step with a DataLoader: use an "
                "ElasticLoader, or a plan whose steps give every process samples"
            )
        index = int(self.ledger.plan.indices_at(self.ledger.epoch, np.zeros(1, dtype=np.int64))[0])
        return source.collate_fn([source.load(self.ledger.epoch, index)])

    def _notify(self, event: Event, step: int | None = None) -> None:
        """Tell the ``on_event`` hook (tracing, chaos tests) that ``event`` happened in ``step`` (default: current)."""
        if self._on_event is not None and (self._events is None or event in self._events):
            self._on_event(event, self.ledger.step if step is None else step)

    def _source(self, loader: ElasticLoader | DataLoader[Any]) -> Source:
        """The loader itself, or the feed of a DataLoader driven by this Manager's sampler (checked)."""
        if isinstance(loader, ElasticLoader):
            return loader
        assert self._max_steps is not None
        max_steps = self._max_steps
        rounds = self._rounds
        self._feed = SamplerFeed.of(
            loader,
            self,
            self.max_microbatch,
            lambda: (rounds or self._planner).foreseen_parts(max_steps),  # DiLoCo: inner steps of rounds
        )
        return self._feed

    def sampler_pass(self) -> Iterator[list[int]]:
        """The micro-batches a ``ManagedDistributedSampler(manager, dataset)`` hands its DataLoader (for its use)."""
        if self._feed is None:
            raise RuntimeError(
                "a DataLoader over ManagedDistributedSampler(manager, dataset) is iterated by manager.steps(loader) "
                "only: iterate the steps, not the loader"
            )
        return self._feed.sampler_pass()

    # --- saving and leaving ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This member's whole state: applied step, ledger and every state (model, optimizer, registered, RNGs).

        For a user's own saving; the Manager's durable checkpoints
        (``checkpoint``) write the same content through
        ``torch.distributed.checkpoint``.
        """
        return {
            "applied_step": self.applied_step,
            "ledger": self.ledger.state_dict(),
            "states": self._replica.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (before ``steps()`` starts, or between steps)."""
        if not isinstance(state, dict) or set(state) != {"applied_step", "ledger", "states"}:
            raise ValueError("state must be a Manager.state_dict() with applied_step, ledger and states")
        self._replica.load_state_dict(state["states"])
        ledger = DataLedger.from_state_dict(state["ledger"])
        self._planner.restore(ledger)
        self._replica.applied_step = check_int("state['applied_step']", state["applied_step"], minimum=0)
        self._session.report = (self.applied_step, ledger_digest(ledger.state_dict()), ledger.weights_record())

    def close(self) -> None:
        """Stop the heartbeat, after a checkpoint being written is reported.

        After the job's end (``steps()`` ran to ``max_steps``) this member
        leaves the quorum cleanly; before it (an error, a loop left early) the
        lighthouse counts it as failed, and the others recover its share.
        """
        if self._checkpoints is not None and not self._checkpoints.wait(_CLOSE_WAIT):
            log.warning("%s: a checkpoint was still being written after %g s; leaving anyway", self.member, _CLOSE_WAIT)
        if self._rounds is not None:
            self._rounds.close()
        self._accumulation.close()
        if self._step_audit is not None:
            self._step_audit.close()
        self._window.remove()  # the whole-state hooks stay: after close, state_dict() says it is too late
        self._departure.uninstall()
        self._session.close(self.applied_step, leave=self._finished and not self.departed)


def _from_environment(name: str, value: str | None, variable: str) -> str:
    """``value``, else the environment variable's (a launcher sets it), else an error naming both."""
    if value is not None:
        return value
    found = os.environ.get(variable)
    if not found:
        raise ValueError(f"{name} must be given, or the environment variable {variable} set (neither is)")
    return found


def _check_sync(sync: Any, model: torch.nn.Module, redundancy: Any, checkpoint: Any) -> None:
    """Refuse a ``sync`` that is not a DiLoCo, or that does not fit the model or the other options, before training."""
    if sync is None:
        return
    if not isinstance(sync, DiLoCo):
        raise TypeError(f"sync must be a DiLoCo(...) or None, got {type(sync).__name__}")
    if redundancy is not None:
        raise ValueError(
            f"sync=DiLoCo(...) with redundancy={redundancy}: each replica group keeps its own inner optimizer state, "
            "which is not sharded across groups; leave redundancy unset"
        )
    if checkpoint is not None:
        raise ValueError(
            f"sync=DiLoCo(...) with checkpoint={checkpoint}: durable checkpoints of the outer state are not supported "
            "yet; leave checkpoint unset (a joining group is healed with the global parameters and outer state)"
        )
    if is_sharded(model):
        raise ValueError("sync=DiLoCo(...) with an FSDP2-sharded model is not supported yet: use replicated groups")
    check_against(sync, [param for param in model.parameters() if param.requires_grad])


def _check_sigterm(sigterm: Any, sync: Any) -> bool:
    """Whether to install the SIGTERM handler: ``sigterm`` True (checked), False, or None (where it can run)."""
    if sigterm is not None and not isinstance(sigterm, bool):
        raise TypeError(f"sigterm must be True, False or None, got {sigterm!r}")
    if sigterm and sync is not None:
        raise ValueError(
            "sigterm=True with sync=DiLoCo(...): a departure at a step boundary is not supported in DiLoCo's rounds "
            "yet; pass sigterm=False (a SIGTERM then ends the worker as a failure the others recover from)"
        )
    if sigterm is None:
        return sync is None and threading.current_thread() is threading.main_thread()
    return sigterm


def _check_arguments(
    model: Any,
    optimizer: Any,
    member: Any,
    plan: Any,
    checkpoint: Any,
    reduction: Any,
    checks: Any,
    transport: Any,
    timeouts: Any,
    group: Any,
) -> None:
    """Type checks of the Manager's arguments, naming the argument and what it takes."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(member, str) or not member:
        raise ValueError(f"member must be a non-empty string, got {member!r}")
    expected = {
        "plan": (plan, EpochPlan),
        "checkpoint": (checkpoint, Checkpointing),
        "reduction": (reduction, Reduction),
        "checks": (checks, Checks),
        "transport": (transport, Transport),
        "timeouts": (timeouts, Timeouts),
        "group": (group, ReplicaGroup),
    }
    for name, (value, kind) in expected.items():
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__} or None, got {type(value).__name__}")
