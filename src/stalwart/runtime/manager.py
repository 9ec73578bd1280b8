"""The Manager: one per worker process, running failure-transparent steps in the user's own training loop.

The loop stays the one a DDP script has::

    for step in manager.steps(loader, max_steps=1000):
        for inputs, targets in step:                      # this worker's share, in micro-batches
            step.backward(loss_fn(model(inputs), targets))   # a mean loss, as torch's losses give
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the quorum's reduced mean gradient
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

The Manager holds the configuration and what the loop reads; the work is
done by parts with one job each (docs/design.md, "One step engine, two sync
modes"): the :class:`~stalwart.runtime.keeper.QuorumKeeper` (join, heal,
plan check, the boundary flag, the job's end), the
:class:`~stalwart.runtime.engine.StepEngine` (accumulation, the update
window, the commit, events) and one sync mode built from both:
:class:`~stalwart.runtime.every_step.EveryStep` (a step's gradients reduce
over the quorum, a failure is retried inside the step) or DiLoCo's
:class:`~stalwart.runtime.diloco.rounds.RoundLoop`. Below them:
:mod:`~stalwart.runtime.session` (join, connect, heal),
:mod:`~stalwart.runtime.planner` (shares and foresight),
:mod:`~stalwart.runtime.accumulation` (micro-batches and the reduction),
:mod:`~stalwart.runtime.tail` (the reduced tail's format),
:mod:`~stalwart.runtime.drift` and :mod:`~stalwart.runtime.consistency`
(replica check and data audit), :mod:`~stalwart.runtime.update` (the update
contract), :mod:`~stalwart.runtime.rebalance`, :mod:`~stalwart.runtime.checkpointing`,
and :mod:`~stalwart.runtime.zero` (sharded state and its repair).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from stalwart._validate import check_int
from stalwart.data.audit import StepAuditWriter
from stalwart.data.info import DataLoadingInfo
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.redundancy.config import Redundancy, parse_redundancy
from stalwart.runtime.accumulation import Source, StepAccumulation
from stalwart.runtime.comm import default_device
from stalwart.runtime.config import Checkpointing, Checks, Reduction, ReplicaGroup, Transport
from stalwart.runtime.diloco.config import DiLoCo, check_against
from stalwart.runtime.diloco.rounds import RoundLoop
from stalwart.runtime.drift import DriftCheck
from stalwart.runtime.engine import StepEngine, SyncMode
from stalwart.runtime.events import Event, EventHook, check_events
from stalwart.runtime.every_step import EveryStep
from stalwart.runtime.feed import SamplerFeed
from stalwart.runtime.keeper import QuorumKeeper
from stalwart.runtime.leader import LeaderWork
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.peers import REPLICATED
from stalwart.runtime.planner import StepPlanner
from stalwart.runtime.preemption import Departure
from stalwart.runtime.replica import Replica
from stalwart.runtime.session import QuorumSession
from stalwart.runtime.sharding import is_sharded, prepare_fsdp, sharding_layout
from stalwart.runtime.state import Stateful
from stalwart.runtime.step import StepReport, TrainStep
from stalwart.runtime.threads import apply_thread_default
from stalwart.runtime.timeouts import Timeouts
from stalwart.runtime.values import LoopValues
from stalwart.runtime.zero import RepairStats, ShardedOptimizer
from stalwart.runtime.zero.whole import WholeStateDict

log = logging.getLogger(__name__)


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
        _check_sync(sync, model, redundancy)
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
        self._departure = Departure()
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
        self._planner = planner = StepPlanner(
            member, group.world.rank, group.world.world_size, self.max_microbatch, lockstep=fsdp
        )
        events_hook = EventHook(on_event, wanted_events, lambda: planner.ledger.step)
        accumulation = StepAccumulation(
            model,
            params,
            device=self.device,
            reduction=reduction or Reduction(),
            max_microbatch=self.max_microbatch,
            lockstep=fsdp,
        )
        self._keeper = QuorumKeeper(
            member,
            session=self._session,
            planner=self._planner,
            replica=self._replica,
            transport=transport,
            timeouts=self.timeouts,
            checks=self.checks,
            plan=plan,
            checkpoint=checkpoint,
            sharded=self._zero,
            fsdp=fsdp,
            events=events_hook,
            internal=lambda: self._engine.internal(),
            link_bytes=lambda: accumulation.reducer.step_bytes,
        )
        self._leader = leader = LeaderWork(self._keeper, self._zero, lockstep=sync is None)
        audit_dir = self.checks.audit_dir
        self._engine = StepEngine(
            self._keeper,
            optimizer,
            accumulation,
            drift=DriftCheck(
                params, self.checks.every, enabled=sync is None, group_size=group.world.world_size if fsdp else 1
            ),
            sharded=self._zero,
            whole=None if self._zero is None else WholeStateDict(optimizer, self._zero, leader.gather_whole_state),
            step_audit=None if audit_dir is None or group.world.rank else StepAuditWriter(audit_dir, member),
            events=events_hook,
            max_microbatch=self.max_microbatch,
            device=self.device,
        )
        self._started = False
        self._feed: SamplerFeed | None = None
        self._dropped = 0
        """Micro-batches dropped by the feeds of ``steps()`` calls that ended."""
        self._rounds = None if sync is None else RoundLoop(self._keeper, self._engine, sync, params)
        self._mode: SyncMode = self._rounds or EveryStep(self._keeper, self._engine, self._departure)
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
    def recoveries(self) -> int:
        """Failures this member recovered from (a new quorum in the middle of a step or a round)."""
        return self._keeper.recoveries

    @property
    def last_report(self) -> StepReport | None:
        """What the last reduced step (DiLoCo: inner step) did."""
        return self._engine.last_report

    @property
    def joined_after_end(self) -> bool:
        """True when this worker joined after the job's last step and loaded its final checkpoint."""
        return self._keeper.joined_after_end

    @property
    def departed(self) -> bool:
        """True once this worker left the quorum at a step boundary on request (SIGTERM, ``request_departure``)."""
        return self._mode.departed

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
        return self._engine.drift.heals

    @property
    def boundary_wanted(self) -> bool:
        """True while the lighthouse asks this member's quorum to come to a step boundary (a join, a failure)."""
        return self._session.boundary_wanted

    def lighthouse_status(self) -> dict[str, Any] | None:
        """The lighthouse's ``/v1/status`` JSON, asked now; None in a group's other processes (not its leader)."""
        client = self._session.client
        return None if client is None else client.status()

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
        self._mode.request_departure(reason)

    @property
    def redundancy_stats(self) -> tuple[int, RepairStats] | None:
        """With ``redundancy``: this process's sharded state bytes and what its reshards did; else None."""
        return None if self._zero is None else (self._zero.state_bytes, self._zero.stats)

    @property
    def dropped_microbatches(self) -> int:
        """Micro-batches a DataLoader of ``steps()`` prefetched for a superseded share and dropped (over the
        Manager's life: readable after ``steps()`` ended)."""
        return self._dropped + (0 if self._feed is None else self._feed.dropped)

    @property
    def last_round(self) -> StepReport | None:
        """DiLoCo: what the last committed round did (``step``: the round, ``positions``: all its samples)."""
        return self._mode.last_round

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
        """Run ``fn(*args, **kwargs)`` on the leading replica group only (evaluation, saving); the others go on.

        Every process of the quorum calls it at the same point of the loop
        body. The others train on, as DDP's ranks do while rank 0 evaluates,
        and wait for the leader before their next collective with none
        pending (watching the lighthouse for its death, up to
        ``leader_timeout``): nothing times out. Returns ``fn``'s result on the
        leading group and None elsewhere; a step trained while the leader
        died is recovered as after any failure. With sharded optimizer state
        the others wait in here, to send their shards when
        ``optimizer.state_dict()`` inside ``fn`` gathers the whole state.
        """
        return self._leader.run(lambda: fn(*args, **kwargs))

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
        commits = self._mode.commits_for(check_int("max_steps", max_steps, minimum=0))
        self._keeper.max_steps = commits
        source = self._source(loader, commits)
        self._session.data_fingerprint = str(getattr(loader.dataset, "fingerprint", ""))
        self._session.data_identities = list(getattr(loader.dataset, "identities", []))
        self._started = True
        try:
            yield from self._mode.steps(source, loader, commits)
        finally:
            if self._feed is not None:
                self._feed.close()
                self._dropped += self._feed.dropped
                self._feed = None

    def _source(self, loader: ElasticLoader | DataLoader[Any], max_steps: int) -> Source:
        """The loader itself, or the feed of a DataLoader driven by this Manager's sampler (checked)."""
        if isinstance(loader, ElasticLoader):
            return loader
        mode = self._mode
        self._feed = SamplerFeed.of(
            loader,
            self,
            self.max_microbatch,
            lambda: mode.foreseen_parts(max_steps),  # DiLoCo: inner steps of rounds
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

        For a user's own saving; the Manager's durable checkpoints (``checkpoint``)
        write the same content through ``torch.distributed.checkpoint``.
        """
        return self._keeper.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (before ``steps()`` starts, or between steps)."""
        self._keeper.load_state_dict(state)

    def close(self) -> None:
        """Stop the heartbeat, after a checkpoint being written is reported.

        After the job's end (``steps()`` ran to ``max_steps``) this member
        leaves the quorum cleanly; before it (an error, a loop left early) the
        lighthouse counts it as failed, and the others recover its share.
        """
        self._keeper.wait_for_checkpoint()
        self._mode.close()
        self._engine.close()
        self._departure.uninstall()
        self._session.close(self.applied_step, leave=self._keeper.finished and not self.departed)


def _from_environment(name: str, value: str | None, variable: str) -> str:
    """``value``, else the environment variable's (a launcher sets it), else an error naming both."""
    if value is not None:
        return value
    found = os.environ.get(variable)
    if not found:
        raise ValueError(f"{name} must be given, or the environment variable {variable} set (neither is)")
    return found


def _check_sync(sync: Any, model: torch.nn.Module, redundancy: Any) -> None:
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
