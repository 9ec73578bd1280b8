"""The Manager: one per worker process, running failure-transparent steps.

A step (see docs/protocol.md)::

    quorum (only when membership changed) -> share -> micro-batches, backward
      -> gradient buckets all-reduced while the last backward runs, the last
         one with the tail [checks, sample count, reconfigure flag, loss sum]
      -> divide by the step's sample count -> optimizer.step() -> commit

When a bucket's all-reduce fails (a peer died or hung), this member keeps its
gradient accumulator (buckets reduce copies: :mod:`stalwart.runtime.reducer`),
asks the lighthouse for a new quorum, computes the
positions it was given on top of what it has done (the dead member's share,
split among the survivors), and all-reduces again in the new group: the
committed step is the same step as without the failure. A member that is
behind (it joined, restarted, or missed the end of a step) is healed from a
live peer before it takes part.

Training code stays a plain loop::

    for step in manager.steps(loader, max_steps=1000):
        for inputs, targets in step:
            step.backward(loss_fn(model(inputs), targets))  # loss_fn(reduction="sum")

``loader`` is an :class:`~stalwart.runtime.loader.ElasticLoader`, or the
user's own ``DataLoader(dataset, batch_sampler=ManagedDistributedSampler(manager,
dataset), ...)`` (see :mod:`stalwart.runtime.feed`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from stalwart._validate import check_int
from stalwart.coord.client import CheckpointAnnouncement, LighthouseClient, LighthouseError, QuorumAnswer
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.data.balance import group_measurements, rebalance, resolution
from stalwart.data.info import DataLoadingInfo, split_group_share
from stalwart.data.ledger import DataLedger
from stalwart.data.sampler import ManagedDistributedSampler
from stalwart.data.world import WorldInfo
from stalwart.redundancy.config import Redundancy
from stalwart.runtime.checkpoint import Checkpointer, CheckpointError, CheckpointMeta, load_checkpoint
from stalwart.runtime.comm import CollectiveError, Communicator, default_device, device_rng_states, quorum_store
from stalwart.runtime.consistency import (
    AUDIT_PIECES,
    DRIFT_SLOTS,
    AuditError,
    ReplicaDriftError,
    audit_pieces,
    audit_value,
    default_check_every,
    drift_plan,
    drift_slots,
    index_checksum,
    parameter_checksum,
)
from stalwart.runtime.feed import SamplerFeed
from stalwart.runtime.group import GroupLink
from stalwart.runtime.heal import state_specs, transfer_state
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.reducer import DEFAULT_BUCKET_CAP_MB, GradientReducer
from stalwart.runtime.sharding import is_sharded, prepare_fsdp, set_gradient_sync, sharding_layout
from stalwart.runtime.state import Stateful, check_state_name, host_rng_states
from stalwart.runtime.timeouts import Timeouts
from stalwart.runtime.zero import RepairStats, ShardedOptimizer

log = logging.getLogger(__name__)
_ANNOUNCE_BACKOFF = 0.2
_ANNOUNCE_RETRIES = 50
"""A checkpoint is reported until the lighthouse has committed its step (heartbeats lag): ~10 s at most."""
_CLOSE_WAIT = 120.0
"""Seconds ``close()`` waits for a checkpoint being written and reported."""
BALANCE_SLOTS = 2
"""Tail slots per process on a balanced ledger: its compute seconds and samples since the last re-weighing."""


class JoinError(RuntimeError):
    """This member could not get into a working quorum within ``max_join_attempts`` attempts."""


_NO_POSITIONS = np.zeros(0, dtype=np.int64)
Source = ElasticLoader | SamplerFeed
"""Where a step's micro-batches come from: the elastic loader, or the feed of a user's DataLoader."""


class StateLostError(RuntimeError):
    """No live member holds the job's state and the lighthouse has no checkpoint to resume from."""


class PlanMismatchError(ValueError):
    """The lighthouse's plan does not fit this worker's data (for example another dataset length)."""


class ShardingMismatchError(ValueError):
    """This replica group shards its model differently from the group it must match (FSDP2 groups)."""


_REPLICATED = "replicated"
"""The layout a process of an unsharded model publishes (any group size is fine then)."""


@dataclass(frozen=True)
class StepReport:
    """What one committed step did, for progress displays and reports."""

    step: int
    epoch: int
    samples: int
    loss: float
    world_size: int
    quorum_id: int
    recoveries: int
    positions: np.ndarray
    drift_heals: int = 0
    loaded_checksum: int = 0
    """The quorum's reduced checksum of the samples its loaders produced (``consistency.index_checksum``)."""


class Manager:
    """Keeps one worker (or one replica group's worker) in the quorum and runs its steps.

    ``member`` names the lighthouse member: the worker, or its replica group
    when ``group`` says this process is one of several in a group launched
    together (see :mod:`stalwart.runtime.group`); the group's share is then
    split among its processes by intra-group rank. ``on_event(event, step)`` is
    called at ``"joined"`` (this member is in a new quorum, at ``step``),
    ``"healed"`` (it loaded a peer's state at ``step``), ``"reduce_started"``
    (every bucket is launched, backward is over) and ``"reduce_finished"``
    (reduced, not yet applied), for tracing and for tests that kill a worker
    at those points.

    Gradients are reduced in buckets of ``bucket_cap_mb`` (DDP's default
    25), in their own dtype or ``reduce_dtype`` (for example
    ``torch.bfloat16`` to halve the bytes on the wire); each micro-batch's
    loss goes through ``step.backward()`` once.

    A member that joins after the job committed its last step (every other
    member left) is not healed: ``steps()`` yields nothing and
    :attr:`joined_after_end` is True.

    With ``checkpoint_dir`` the quorum's rank 0 writes a durable checkpoint
    (:mod:`stalwart.runtime.checkpoint`) every ``checkpoint_every`` steps or
    ``checkpoint_seconds`` seconds, and of the last step, and reports it to
    the lighthouse. When no live member holds the job's state (the whole fleet
    restarted), the lighthouse rolls its ledger back to the newest one and the
    members load it; without a checkpoint that is :class:`StateLostError`.

    Rendezvous, collectives and heals have their own timeouts, each from the
    argument, else an environment variable, else a default (see
    :mod:`stalwart.runtime.timeouts`); a heal's deadline grows with the bytes
    it moves. Joining a quorum gives up after ``max_join_attempts`` quorums
    that could not start (or exclusions) in a row, with :class:`JoinError`.

    A member's state, healed as one, is the model, the optimizer, what
    :meth:`register_state` added and the random generators (see
    :mod:`stalwart.runtime.state`: torch's CPU generator, CUDA's when present,
    numpy's global and python ``random``'s). ``max_heal_bytes`` bounds what a
    heal may allocate (default: a few times this member's own state).

    A group that shards its model with FSDP2 (``fully_shard`` over a mesh of
    its own processes; build the Manager after ``fully_shard``) runs as
    fault-tolerant HSDP: FSDP2's reduce-scatter sums each gradient shard
    within the group (the Manager sets its divide factor to 1), and the
    Manager reduces each process's shard with the processes holding the same
    shard in the other groups, over a communicator of its own per shard; a
    joining group is healed shard by shard from a live group. Every group must
    have as many processes and shard the same way as the group it is checked
    against (the heal source, else the quorum's first member), else
    :class:`ShardingMismatchError`. FSDP2 groups do not take durable
    checkpoints yet, and their replicas are not checksummed (``check_every``
    applies to unsharded models).

    With ``redundancy`` (:class:`~stalwart.redundancy.config.Overlap` or
    :class:`~stalwart.redundancy.config.Parity`), the optimizer's state and an
    fp32 master are sharded over the quorum's processes (ZeRO stage 1, see
    :mod:`stalwart.runtime.zero`): ``optimizer`` (SGD, Adam or AdamW over the
    model's parameters) gives the update and its hyper-parameters, each
    process updates the shards it holds, and the parameters are all-gathered
    after each step. ``node`` labels this process's machine (default: the
    host name): copies and parity go to other nodes. Every change of the
    quorum reshards in memory; more failures than the redundancy covers raise
    :class:`~stalwart.redundancy.layout.ShardsLostError` (with
    ``checkpoint_dir`` and ``checkpoint_every``, the whole optimizer state is
    checkpointed, and a relaunched fleet resumes from it). In FSDP2 groups,
    the processes holding the same FSDP shard in the groups split that
    shard's optimizer state: HSDP with a partial replicate dimension.

    When the lighthouse balances the ledger (``stalwart lighthouse
    --balance-every K``), each process also puts its compute seconds and
    samples since the last re-weighing into the tail; every ``K`` steps every
    member derives the same new weights from the reduced values
    (:func:`~stalwart.data.balance.rebalance`) and records them in its ledger,
    so the next steps' shares follow the members' throughput.

    Every step's all-reduce also carries two checks (see
    :mod:`stalwart.runtime.consistency`): a checksum of each process's
    parameters and applied step every ``check_every`` steps (default: every
    step for models up to 2**20 parameters, less often for larger ones), after
    which replicas that drifted are healed from the majority before the step is
    applied; and a checksum of the samples each loader produced, which must
    match the ledger's positions for the step, else :class:`AuditError`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lighthouse: str,
        member: str,
        max_microbatch: int,
        token: str | None = None,
        group: WorldInfo | None = None,
        group_store: dist.Store | None = None,
        collective_timeout: float | None = None,
        rendezvous_timeout: float | None = None,
        heal_timeout: float | None = None,
        heal_min_bandwidth: float | None = None,
        max_join_attempts: int = 20,
        quorum_timeout: float = 120.0,
        connect_timeout: float = 60.0,
        heartbeat_interval: float = 0.1,
        host: str = "127.0.0.1",
        device: torch.device | None = None,
        on_event: Callable[[str, int], None] | None = None,
        max_heal_bytes: int | None = None,
        check_every: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        checkpoint_seconds: float | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        reduce_dtype: torch.dtype | None = None,
        redundancy: Redundancy | None = None,
        node: str | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(member, str) or not member:
            raise ValueError(f"member must be a non-empty string, got {member!r}")
        for name, value in (("quorum_timeout", quorum_timeout), ("connect_timeout", connect_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        self.timeouts = Timeouts.resolve(
            rendezvous_timeout=rendezvous_timeout,
            collective_timeout=collective_timeout,
            heal_timeout=heal_timeout,
            heal_min_bandwidth=heal_min_bandwidth,
        )
        self.max_join_attempts = check_int("max_join_attempts", max_join_attempts, minimum=1)
        self.model = model
        self.optimizer = optimizer
        self.member = member
        self.max_microbatch = check_int("max_microbatch", max_microbatch, minimum=1)
        self.collective_timeout = self.timeouts.collective_timeout
        self.quorum_timeout = quorum_timeout
        self.host = host
        self.device = device or default_device()
        self.applied_step = 0
        self.recoveries = 0
        self.last_report: StepReport | None = None
        self.joined_after_end = False
        self._max_steps: int | None = None
        self._group = GroupLink(group or WorldInfo(rank=0, world_size=1), group_store, timeout=quorum_timeout)
        self._params = [param for param in model.parameters() if param.requires_grad]
        self._sharded = is_sharded(model)
        if self._sharded and checkpoint_dir is not None:
            raise ValueError(
                f"checkpoint_dir={str(checkpoint_dir)!r}: durable checkpoints of an FSDP2-sharded model are not "
                "supported yet; leave checkpoint_dir unset (live groups heal a joining one)"
            )
        if self._sharded:
            prepare_fsdp(model)
        self._zero: ShardedOptimizer | None = None
        if redundancy is not None:
            if checkpoint_dir is not None and (checkpoint_every is None or checkpoint_seconds is not None):
                raise ValueError(
                    f"redundancy={redundancy} with checkpoint_dir takes checkpoint_every (steps) and not "
                    f"checkpoint_seconds (got checkpoint_every={checkpoint_every}, "
                    f"checkpoint_seconds={checkpoint_seconds}): every process gathers the state at the same step"
                )
            self._zero = ShardedOptimizer(self._params, optimizer, redundancy, node=node or socket.gethostname())
        self._layout = sharding_layout(model) if self._sharded else _REPLICATED
        self._client: LighthouseClient | None = None
        self._report: tuple[int, str | None, dict[str, Any] | None] = (0, None, None)
        """``(applied_step, ledger digest, weights record)`` for the heartbeat: the lighthouse commits only on a
        matching digest, replaying a balanced ledger's weights from the record."""
        if self._group.is_leader:
            self._client = LighthouseClient(lighthouse, member, token=token, heartbeat_interval=heartbeat_interval)
            try:
                self._client.wait_reachable(connect_timeout)
            except BaseException:
                self._client.close()
                raise
            self._client.start_heartbeat(lambda: self._report)
        self._comm: Communicator | None = None
        self._grad_comm: Communicator | None = None
        """Where gradients are reduced: ``_comm`` itself, or (FSDP2 groups) the processes holding this shard."""
        self._answer: QuorumAnswer | None = None
        self._ledger: DataLedger | None = None
        self._group_sizes: list[int] = []
        self._foreseen: tuple[int, np.ndarray, list[int]] | None = None
        self._feed: SamplerFeed | None = None
        self._group_done = _NO_POSITIONS
        self._samples = 0
        self._loss_sum = torch.zeros((), device=self.device)
        self._reconfigure = True
        self._on_event = on_event
        self.max_heal_bytes = None if max_heal_bytes is None else check_int("max_heal_bytes", max_heal_bytes, minimum=1)
        self._user_states: dict[str, Stateful] = {}
        self._rng_states: dict[str, Stateful] = {**host_rng_states(), **device_rng_states()}
        self._started = False
        self._data_fingerprint = ""
        """The loader's dataset's fingerprint ("" when it has none), compared with the quorum's at each join."""
        self._heals = 0
        self._trained_step = -1
        """The step this member reached by applying it itself (a heal to a step does not count)."""
        self._diverged = False
        self._checkpointer = (
            None
            if checkpoint_dir is None
            else Checkpointer(
                checkpoint_dir,
                every_steps=checkpoint_every,
                every_seconds=checkpoint_seconds,
                on_finished=self._announce,
            )
        )
        parameters = sum(param.numel() for param in self._params)
        self.check_every = (
            default_check_every(parameters) if check_every is None else check_int("check_every", check_every, minimum=1)
        )
        self.drift_heals = 0
        self._step_drift_heals = 0
        self._index_sum = 0
        self._part_started = 0.0
        self._step_seconds = 0.0
        self._window_seconds = 0.0
        self._window_samples = 0
        """This process's compute seconds and samples since the last re-weighing (balanced ledgers)."""
        self._template: Any = None
        """The last batch this process trained on: the shape of a zero-sample batch (FSDP2 groups)."""
        self._reducer = GradientReducer(
            self._params, device=self.device, bucket_cap_mb=bucket_cap_mb, reduce_dtype=reduce_dtype
        )

    @property
    def redundancy_stats(self) -> tuple[int, RepairStats] | None:
        """With ``redundancy``: this process's sharded state bytes and what its reshards did; else None."""
        return None if self._zero is None else (self._zero.state_bytes, self._zero.stats)

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
        name = check_state_name(name, set(self._user_states))
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"obj must have state_dict() and load_state_dict(), got {type(obj).__name__}")
        self._user_states[name] = obj

    @property
    def states(self) -> dict[str, Stateful]:
        """Everything a heal copies, in order: model, optimizer, registered states, random generators."""
        return {"model": self.model, "optimizer": self.optimizer, **self._user_states, **self._rng_states}

    @property
    def ledger(self) -> DataLedger:
        """This member's replica of the lighthouse's ledger."""
        if self._ledger is None:
            raise RuntimeError("the Manager has not joined a quorum yet; iterate manager.steps() first")
        return self._ledger

    @property
    def boundary_wanted(self) -> bool:
        """True while the lighthouse asks this member's quorum to come to a step boundary (a join, a failure).

        The group's leader hears it from the lighthouse and relays it to the
        group's other processes, so that all of them see it by their next call.
        """
        if self._client is None:
            return self._group.boundary(self.quorum_id)
        wanted = self._client.reconfigure_requested
        if wanted:
            self._group.mark_boundary(self.quorum_id)
        return wanted

    @property
    def quorum_id(self) -> int:
        """The id of the quorum this member runs steps in (-1 before the first)."""
        return -1 if self._answer is None else self._answer.quorum_id

    @property
    def world_size(self) -> int:
        """How many members (replica groups) the current quorum has."""
        return 0 if self._answer is None else len(self._answer.members)

    def get_data_loading_info(self) -> DataLoadingInfo:
        """Where this process's samples of the current step come from (the proposal's ``DataLoadingInfo``).

        Valid inside a step (between ``manager.steps()`` yielding it and its
        commit). ``base_index`` and ``missing_indices`` are the ledger's as
        the step began, also after a failure retry; ``indices`` are this
        process's part of its group's share as it stands now (after a
        failure, with the positions it took over).
        """
        if self._answer is None or not self.ledger.in_step:
            raise RuntimeError("get_data_loading_info() needs a step in progress: call it inside manager.steps()")
        ledger = self.ledger
        base_index, missing_indices = _step_began(ledger)
        return DataLoadingInfo.for_worker(
            ledger.plan,
            epoch=ledger.epoch,
            step=ledger.epoch_step,
            base_index=base_index,
            missing_indices=missing_indices,
            group_sizes=dict(zip(self._answer.members, self._group_sizes, strict=True)),
            member=self.member,
            group_share=ledger.in_flight.get(self.member, _NO_POSITIONS),
            intra_group_rank=self._group.rank,
        )

    def steps(self, loader: ElasticLoader | DataLoader[Any], *, max_steps: int) -> Iterator[TrainStep]:
        """Yield one :class:`TrainStep` per step until the job has committed ``max_steps`` steps.

        ``loader``: an :class:`ElasticLoader`, or a ``DataLoader`` whose
        ``batch_sampler`` is ``ManagedDistributedSampler(self, dataset)``.
        Raises :class:`PlanMismatchError` when the lighthouse's plan does not
        fit the loader's dataset (checked when this member first joins), or
        when the dataset's ``fingerprint`` (:class:`~stalwart.data.shards.ShardedDataset`)
        differs from the quorum's reference member's (checked at every join).
        """
        self._max_steps = check_int("max_steps", max_steps, minimum=0)
        source = self._source(loader)
        self._data_fingerprint = str(getattr(loader.dataset, "fingerprint", ""))
        self._started = True
        try:
            while True:
                if self._reconfigure or self._ledger is None:
                    first = self._ledger is None
                    self._join(reason="join" if first else "reconfigure")
                    if first:
                        _check_dataset(loader, self.ledger)
                self._maybe_checkpoint()
                if self.ledger.step >= max_steps:
                    self._final_checkpoint()
                    self._farewell()
                    return
                if not self.ledger.in_step:
                    self.ledger.begin_step(self._answer_members())
                source.take_produced()  # anything produced outside a step is not this step's
                step = TrainStep(self, source, epoch_end=_ends_epoch(self.ledger))
                yield step
                if not step.committed:
                    raise RuntimeError("a TrainStep must be iterated to its end before the next step starts")
                if isinstance(source, ElasticLoader):
                    self._prefetch_next(source)
        finally:
            if self._feed is not None:
                self._feed.close()
                self._feed = None

    @property
    def dropped_microbatches(self) -> int:
        """Micro-batches the DataLoader of ``steps()`` prefetched for a superseded share and that were dropped.

        Counted while ``steps()`` runs over a DataLoader driven by this
        Manager's sampler (0 otherwise); they were never trained on.
        """
        return 0 if self._feed is None else self._feed.dropped

    def sampler_pass(self) -> Iterator[list[int]]:
        """The micro-batches a ``ManagedDistributedSampler(manager, dataset)`` hands its DataLoader (for its use).

        Each is the dataset indices of one micro-batch this process will need,
        in order (see :mod:`stalwart.runtime.feed`).
        """
        if self._feed is None:
            raise RuntimeError(
                "a DataLoader over ManagedDistributedSampler(manager, dataset) is iterated by manager.steps(loader) "
                "only: iterate the steps, not the loader"
            )
        return self._feed.sampler_pass()

    def _source(self, loader: ElasticLoader | DataLoader[Any]) -> Source:
        """The loader itself, or the feed of a DataLoader driven by this Manager's sampler (checked)."""
        if isinstance(loader, ElasticLoader):
            return loader
        if not isinstance(loader, DataLoader):
            raise TypeError(f"loader must be an ElasticLoader or a torch DataLoader, got {type(loader).__name__}")
        sampler = loader.batch_sampler
        if not isinstance(sampler, ManagedDistributedSampler) or sampler.driver is not self:
            raise ValueError(
                f"loader's batch_sampler must be ManagedDistributedSampler(manager, dataset) of this Manager, got "
                f"{type(sampler).__name__}: build it as DataLoader(dataset, batch_sampler=ManagedDistributedSampler("
                "manager, dataset), ...)"
            )
        if not getattr(loader, "in_order", True):
            raise ValueError("loader must have in_order=True: each batch is matched with its micro-batch by order")
        size = len(loader.dataset)  # type: ignore[arg-type]
        if size != sampler.dataset_size:
            raise ValueError(
                f"loader's dataset has {size} samples but its ManagedDistributedSampler was built for "
                f"{sampler.dataset_size}: give both the same dataset"
            )
        self._feed = SamplerFeed(loader, self.max_microbatch, self._foreseen_parts)
        return self._feed

    def _farewell(self) -> None:
        """One last tiny all-reduce, so that no member leaves while another still waits on the final step's.

        Without it a member that finished the last all-reduce first could leave,
        and the lighthouse's broken-quorum push would make a slower member give
        up a collective that was about to complete. A failure here is harmless:
        the last step is already applied.
        """
        if self._comm is None:
            return
        try:
            self._comm.start_all_reduce_sum(torch.zeros(1, device=self.device))()
        except CollectiveError as error:
            log.info("%s: farewell all-reduce ended early (%s); the last step is applied", self.member, error)

    def close(self) -> None:
        """Leave the quorum cleanly (after a checkpoint being written is reported) and stop the heartbeat."""
        if self._checkpointer is not None and not self._checkpointer.wait(_CLOSE_WAIT):
            log.warning("%s: a checkpoint was still being written after %g s; leaving anyway", self.member, _CLOSE_WAIT)
        self._reducer.close()
        self._abort_comms()
        if self._client is not None:
            self._client.leave(self.applied_step)
            self._client.close()

    def _answer_members(self) -> list[str]:
        assert self._answer is not None
        return list(self._answer.members)

    def _next_part(self) -> tuple[np.ndarray, int]:
        """This process's part of the group's positions not yet covered in this step (marked covered).

        Also how many micro-batches this process runs on it: its own count, or
        in an FSDP2 group the largest count of the group's processes (every
        forward and backward is a collective over the group).
        """
        group_share = self.ledger.in_flight.get(self.member, _NO_POSITIONS)
        fresh = group_share[~np.isin(group_share, self._group_done)]
        self._group_done = np.concatenate([self._group_done, fresh])
        multiple = self.ledger.plan.local_batch_multiple
        part = split_group_share(fresh, self._group.size, self._group.rank, multiple)
        self._samples += part.size
        ranks = range(self._group.size) if self._sharded else (self._group.rank,)
        sizes = [split_group_share(fresh, self._group.size, rank, multiple).size for rank in ranks]
        return part, max(-(-size // self.max_microbatch) for size in sizes)

    def _microbatches(self, loader: Source) -> Iterator[object]:
        while True:
            part, count = self._next_part()
            self._part_started = time.perf_counter()
            batches = (
                loader.microbatches(self.ledger.epoch, self._indices(part), self.max_microbatch) if part.size else ()
            )
            for number, batch in enumerate(self._padded(batches, count, loader), start=1):
                if self._sharded:  # FSDP2 reduce-scatters in the group only on the part's last backward
                    set_gradient_sync(self.model, number == count)
                if number == count:
                    self._arm(loader)  # the last backward of this part launches the buckets as they fill
                yield batch
            try:
                reduced = self._reduce(loader)
                if self._heal_drift(reduced):
                    continue
            except CollectiveError as error:
                log.warning(
                    "%s: step %d all-reduce failed (%s); asking for a new quorum", self.member, self.ledger.step, error
                )
                self._join(reason="failure")
                self.recoveries += 1
                continue
            self._apply(reduced)
            return

    def _padded(self, batches: Iterable[Any], count: int, loader: Source) -> Iterator[Any]:
        """``batches``, then zero-sample batches up to ``count`` (FSDP2 groups: the group's processes run in step).

        A zero-sample batch is a real batch with every tensor cut to 0 rows: the
        model runs its collectives on it and its summed loss is 0.
        """
        produced = 0
        for batch in batches:
            self._template = batch
            produced += 1
            yield batch
        for _ in range(count - produced):
            yield _zero_rows(self._template if self._template is not None else self._sample_batch(loader))

    def _sample_batch(self, loader: Source) -> Any:
        """A one-sample batch (any sample of the epoch), for the shape of a zero-sample batch; not audited."""
        if not isinstance(loader, ElasticLoader):
            raise RuntimeError(
                "an FSDP2 group's process got no samples before its first step with a DataLoader: use an "
                "ElasticLoader, or a plan whose steps give every process samples"
            )
        index = int(self.ledger.plan.indices_at(self.ledger.epoch, np.zeros(1, dtype=np.int64))[0])
        return loader.collate_fn([loader.load(self.ledger.epoch, index)])

    def _arm(self, loader: Source) -> None:
        """Start this round's reduction; the tail's values that are known before the last backward go in now.

        The tail is ``[balance slots (balanced ledgers), drift slots, audit
        pieces, sample count, reconfigure flag, loss sum]``; the loss sum (and
        the compute time in the balance slots) is known only when the last
        backward is done, and the loss sum stays on the device (no host sync).
        """
        assert self._comm is not None and self._grad_comm is not None
        self._index_sum = (self._index_sum + _produced_checksum(loader)) % (1 << 64)
        world = self._comm.world_size
        if self._check_step():
            s1, s2 = parameter_checksum(self._params)
            drift = drift_slots(self._comm.rank, world, s1, s2, self.applied_step)
        else:
            drift = torch.zeros(DRIFT_SLOTS * world)
        flag = 1.0 if self._client is not None and self._client.reconfigure_requested else 0.0
        counts = torch.tensor([float(self._samples), flag])
        head = torch.cat([drift, audit_pieces(self._index_sum), counts]).to(self.device)
        balance = BALANCE_SLOTS * world if self.ledger.balanced else 0
        self._reducer.arm(
            self._grad_comm,
            lambda: torch.cat([*self._balance_slots(world), head, self._loss_sum.reshape(1).float()]),
            balance + head.numel() + 1,
            tail_comm=None if self._grad_comm is self._comm else self._comm,
        )

    def _balance_slots(self, world: int) -> list[torch.Tensor]:
        """Balanced ledgers: this process's compute seconds and samples over the window, in its own two slots.

        Called as the tail is launched: the part's compute ends there.
        """
        if not self.ledger.balanced:
            return []
        assert self._comm is not None
        self._step_seconds += time.perf_counter() - self._part_started
        slots = torch.zeros(BALANCE_SLOTS * world)
        slots[BALANCE_SLOTS * self._comm.rank] = self._window_seconds + self._step_seconds
        slots[BALANCE_SLOTS * self._comm.rank + 1] = float(self._window_samples + self._samples)
        return [slots.to(self.device)]

    def _rebalance(self, reduced: torch.Tensor) -> None:
        """Add the step to the window; every ``balance_every`` steps re-weigh the members by the reduced slots.

        Every member reads the same reduced values, so every member records the
        same weights (or none).
        """
        self._window_seconds += self._step_seconds
        self._window_samples += self._samples
        ledger = self.ledger
        if ledger.step % ledger.balance_every:
            return
        self._window_seconds, self._window_samples = 0.0, 0
        members = self._answer_members()
        slots = reduced[: BALANCE_SLOTS * sum(self._group_sizes)].tolist()
        samples, seconds = group_measurements(slots, self._group_sizes, BALANCE_SLOTS)
        current = ledger.effective_weights(members)
        weights = rebalance(current, samples, seconds, resolution(ledger.plan, len(members)))
        if weights is not None:
            ledger.reweigh(dict(zip(members, weights, strict=True)))
            log.info("%s: step %d re-weighed the shares %s -> %s", self.member, ledger.step, current, weights)

    def _reduce(self, loader: Source) -> torch.Tensor:
        """Finish the round's reduction (launch what backward did not, wait); the reduced tail on the CPU."""
        if not self._reducer.armed:
            self._arm(loader)
        self._reducer.launch_rest()
        self._notify("reduce_started")
        tail = self._reducer.wait().cpu()
        self._notify("reduce_finished")
        return tail

    def _check_step(self) -> bool:
        """Whether this step's all-reduce carries the replica-consistency check (the same on every member)."""
        return not self._sharded and self.ledger.step % self.check_every == 0

    def _heal_drift(self, reduced: torch.Tensor) -> bool:
        """If the replicas' checksums differ, heal the odd ones out from the majority and return True."""
        assert self._comm is not None
        if not self._check_step():
            return False
        world = self._comm.world_size
        end = -(AUDIT_PIECES + 3)
        plan = drift_plan(reduced[end - DRIFT_SLOTS * world : end].cpu(), world)
        if plan is None:
            return False
        if self._step_drift_heals >= 2:
            raise ReplicaDriftError(
                f"step {self.ledger.step}: processes {list(plan.targets)} still differ from process {plan.source} "
                "after two heals; is the training step deterministic across replicas?"
            )
        self._step_drift_heals += 1
        self.drift_heals += 1
        is_target = self._comm.rank in plan.targets
        log.warning(
            "%s: step %d replicas drifted: healing processes %s from process %d%s",
            self.member,
            self.ledger.step,
            list(plan.targets),
            plan.source,
            " (this one)" if is_target else "",
        )
        applied = self._transfer(plan.source, is_target=is_target)
        if is_target:
            self.applied_step = applied
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_step()  # recompute this process's whole part with the healed parameters
        return True

    def _audit(self, reduced: torch.Tensor) -> int:
        """Refuse the step unless the samples the quorum loaded are those of the ledger's positions.

        Returns the reduced checksum of the loaded samples (reports audit it against the plan).
        """
        ledger = self.ledger
        positions = [share for share in ledger.in_flight.values() if share.size]
        everything = np.concatenate(positions) if positions else _NO_POSITIONS
        expected = index_checksum(ledger.epoch, ledger.plan.indices_at(ledger.epoch, everything))
        loaded = audit_value(reduced[-(AUDIT_PIECES + 3) : -3].cpu())
        if loaded != expected:
            raise AuditError(
                f"step {ledger.step}: the samples the quorum loaded (checksum {loaded:#018x}) are not those of the "
                f"ledger's {everything.size} positions (checksum {expected:#018x}): a member's loader produced "
                "other samples than its share"
            )
        return loaded

    def _apply(self, reduced: torch.Tensor) -> None:
        samples = round(float(reduced[-3]))  # the tail: [..., samples, reconfigure flag, loss sum]
        expected = sum(positions.size for positions in self.ledger.in_flight.values())
        if samples != expected:
            raise RuntimeError(
                f"step {self.ledger.step}: the quorum reduced {samples} samples, the ledger holds {expected}"
            )
        loaded_checksum = self._audit(reduced)
        step, epoch = self.ledger.step, self.ledger.epoch
        if samples:
            self._reducer.apply(samples)
            if self._zero is None:
                self.optimizer.step()
            else:
                self._notify("update_started")
                self._zero.update()  # its sync, below, clears the gradients
        if self._zero is None or not samples:
            self.optimizer.zero_grad(set_to_none=True)
        committed = self.ledger.commit()
        self.last_report = StepReport(
            step=step,
            epoch=epoch,
            samples=samples,
            loss=float(reduced[-1]) / max(samples, 1),
            world_size=self.world_size,
            quorum_id=self.quorum_id,
            recoveries=self.recoveries,
            positions=committed,
            drift_heals=self.drift_heals,
            loaded_checksum=loaded_checksum,
        )
        self.applied_step += 1
        self._step_drift_heals = 0
        if self.ledger.balanced:
            self._rebalance(reduced)
        self._report = (self.applied_step, ledger_digest(self.ledger.state_dict()), self.ledger.weights_record())
        self._reset_step()
        self._reconfigure = float(reduced[-2]) > 0
        self._trained_step = self.applied_step
        if self._zero is not None and samples:
            self._sync_shards(step)

    def _sync_shards(self, step: int) -> None:
        """Gather the updated parameters and re-encode parity; a failure here is repaired when the quorum re-forms.

        The step is committed already: every survivor holds its updated
        shards (and, for parity, its shard as before the update), so the next
        quorum's reshard finishes the update without training anything again.
        """
        assert self._zero is not None and self._grad_comm is not None and self._comm is not None
        failed = False
        try:
            check = step % self.check_every == 0
            self._zero.sync(self._grad_comm, lambda event: self._notify(event, step), check=check)
        except CollectiveError as error:
            log.warning("%s: step %d's parameter gather failed (%s); asking for a new quorum", self.member, step, error)
            failed = True
        if self._grad_comm is not self._comm:  # FSDP2 groups: a group's processes must all ask, or none
            flag = torch.tensor([float(failed)], device=self.device)
            try:
                self._comm.start_all_reduce_sum(flag)()
                failed = failed or float(flag) > 0
            except CollectiveError:
                failed = True
        if failed:
            self._reconfigure = True

    # --- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This member's whole state: applied step, ledger and every state (model, optimizer, registered, RNGs).

        For a user's own saving; the Manager's durable checkpoints
        (``checkpoint_dir``) write the same content through
        ``torch.distributed.checkpoint``.
        """
        return {
            "applied_step": self.applied_step,
            "ledger": self.ledger.state_dict(),
            "states": {name: obj.state_dict() for name, obj in self.states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (before ``steps()`` starts, or between steps)."""
        if not isinstance(state, dict) or set(state) != {"applied_step", "ledger", "states"}:
            raise ValueError("state must be a Manager.state_dict() with applied_step, ledger and states")
        names = set(self.states)
        if set(state["states"]) != names:
            raise ValueError(f"state's states {sorted(state['states'])} differ from this Manager's {sorted(names)}")
        for name, obj in self.states.items():
            obj.load_state_dict(state["states"][name])
        self._ledger = DataLedger.from_state_dict(state["ledger"])
        self.applied_step = check_int("state['applied_step']", state["applied_step"], minimum=0)
        self._report = (self.applied_step, ledger_digest(self._ledger.state_dict()), self._ledger.weights_record())

    def _is_checkpoint_writer(self) -> bool:
        return self._checkpointer is not None and self._comm is not None and self._comm.rank == 0

    def _maybe_checkpoint(self, *, last: bool = False) -> None:
        """Start a checkpoint when one is due (rank 0 of the quorum); it is reported once written.

        Called between steps, after the training loop's body ran for the last
        one, so that what the loop steps there (an LR scheduler) is in the
        checkpoint as of the same step as the model. Only a member that
        applied that step in its quorum writes it: one that was healed to it
        does not, so that two quorums never write the same step. ``last``:
        the job's last step, checkpointed whatever the cadence.
        """
        checkpointer = self._checkpointer
        if self._zero is not None and checkpointer is not None:
            self._checkpoint_shards(checkpointer, last=last)
            return
        if checkpointer is None or self._trained_step != self.applied_step or not self._is_checkpoint_writer():
            return
        if checkpointer.due(self.applied_step, last=last):
            checkpointer.start(self.states, self._checkpoint_meta())

    def _checkpoint_shards(self, checkpointer: Checkpointer, *, last: bool) -> None:
        """Sharded state: every process sends its shard to the writer at the same steps; the writer saves it all.

        The whole optimizer state sits in the user's optimizer only while the
        checkpoint stages it, so the checkpoint loads at any world size.
        """
        assert self._zero is not None and self._comm is not None and checkpointer.every_steps is not None
        if self.applied_step == 0 or not (last or self.applied_step % checkpointer.every_steps == 0):
            return
        try:
            whole = self._zero.gather_state(self._comm)
        except CollectiveError as error:
            log.warning("%s: gathering step %d's checkpoint failed (%s)", self.member, self.applied_step, error)
            self._reconfigure = True
            return
        writes = self._is_checkpoint_writer() and self._trained_step == self.applied_step
        if whole is None or not writes or not checkpointer.due(self.applied_step, last=last):
            return
        self.optimizer.load_state_dict(whole)
        try:
            checkpointer.start(self.states, self._checkpoint_meta())
        finally:
            self.optimizer.state.clear()

    def _final_checkpoint(self) -> None:
        """At the end of the job the writer checkpoints the last step, so a late joiner finds the job done."""
        if self._checkpointer is None:
            return
        self._checkpointer.wait()
        self._maybe_checkpoint(last=True)
        self._checkpointer.wait()

    def _checkpoint_meta(self) -> CheckpointMeta:
        ledger = self.ledger.state_dict()
        return CheckpointMeta(self.applied_step, ledger, ledger_digest(ledger))

    def _announce(self, directory: Path, meta: CheckpointMeta) -> None:
        """Report a finished checkpoint to the lighthouse, again while its step is not committed there (409).

        Runs on the checkpoint writer's thread; the lighthouse client is thread-safe.
        """
        if self._client is None:
            return
        for attempt in range(_ANNOUNCE_RETRIES):
            try:
                self._client.report_checkpoint(meta.step, str(directory.resolve()), meta.ledger, meta.digest)
            except LighthouseError as error:
                if error.status == 409 and attempt + 1 < _ANNOUNCE_RETRIES:
                    time.sleep(_ANNOUNCE_BACKOFF)
                    continue
                log.warning("%s: the lighthouse refused checkpoint %s: %s", self.member, directory, error)
                return
            except (RuntimeError, OSError) as error:
                log.warning("%s: checkpoint %s not reported: %s", self.member, directory, error)
                return
            log.info("%s: checkpoint of step %d in %s", self.member, meta.step, directory)
            if self._checkpointer is not None:
                self._checkpointer.prune(meta.step)
            return

    def _load_checkpoint(self, announcement: CheckpointAnnouncement) -> None:
        """Load the checkpoint the quorum resumes from (every member holds the whole state: any world size)."""
        try:
            meta = load_checkpoint(announcement.path, self.states)
        except CheckpointError as error:
            raise StateLostError(f"the job resumes from checkpoint {announcement.path}, which fails: {error}") from None
        if meta.step != announcement.step or meta.digest != announcement.digest:
            raise StateLostError(
                f"checkpoint {announcement.path} holds step {meta.step} (digest {meta.digest}), "
                f"the lighthouse announced step {announcement.step} (digest {announcement.digest})"
            )
        self.applied_step = meta.step
        self._report = (meta.step, meta.digest, self.ledger.weights_record())
        log.info("%s: resumed from checkpoint %s at step %d", self.member, announcement.path, meta.step)

    def _reset_step(self) -> None:
        self._group_done = _NO_POSITIONS
        self._samples = 0
        self._step_seconds = 0.0
        self._loss_sum = torch.zeros((), device=self.device)
        self._index_sum = 0

    def _notify(self, event: str, step: int | None = None) -> None:
        """Tell the ``on_event`` hook (tracing, chaos tests) that ``event`` happened in ``step`` (default: current)."""
        if self._on_event is not None:
            self._on_event(event, self.ledger.step if step is None else step)

    def _abandon(self) -> bool:
        """Whether the current quorum is known broken (polled while a collective runs)."""
        if self._client is None:
            return self._group.broken(self.quorum_id)
        if self._client.quorum_broken:
            self._group.mark_broken(self.quorum_id)
            return True
        return False

    def _next_answer(self, reason: str) -> QuorumAnswer | None:
        """The next quorum this member is in (asked by the leader, relayed to the group); None if excluded."""
        if self._client is None:
            return QuorumAnswer.from_json(self._group.receive())
        try:
            answer = self._client.quorum(
                applied_step=0 if self._diverged and reason == "join" else self.applied_step,
                quorum_id=self.quorum_id if self._answer else None,
                reason=reason,
                timeout=self.quorum_timeout,
            )
        except LighthouseError as error:
            if error.status != 409:
                raise
            # Excluded from a quorum that went on without it: whatever this member trained since is not the
            # job's (the quorum may have rolled back), so it rejoins as a newcomer and is healed.
            self._diverged = self._diverged or error.body.get("quorum_id") is not None
            log.warning("%s: excluded from the quorum (%s); joining again", self.member, error)
            return None
        self._group.publish(dataclasses.asdict(answer))
        return answer

    def _join(self, reason: str) -> None:
        """Ask for a quorum until this member is in one, its group is up and it is healed (bounded attempts)."""
        last_failure = "none"
        for attempt in range(1, self.max_join_attempts + 1):
            self._abort_comms()
            answer = self._next_answer(reason)
            if answer is None:
                reason, last_failure = "join", "excluded from the quorum"
                continue
            self._answer = answer
            self._diverged = False
            self._ledger = DataLedger.from_state_dict(answer.ledger)
            try:
                self._connect(answer)
                self._heals = 0  # heal keys count from 0 in each quorum's store, the same on every member
                if answer.heal is not None:
                    self._heal(answer)
                if self._zero is not None:
                    assert self._grad_comm is not None  # FSDP2 groups: the processes holding this process's shard
                    self._zero.reshard(self._grad_comm, self.applied_step)
            except CollectiveError as error:
                log.warning(
                    "%s: quorum %d could not start (%s); asking again (attempt %d of %d)",
                    self.member,
                    answer.quorum_id,
                    error,
                    attempt,
                    self.max_join_attempts,
                )
                reason = "failure" if self._group_done.size else "reconfigure"
                self._abort_comms()
                last_failure = str(error)
                continue
            self._reconfigure = False
            self._notify("joined")
            return
        raise JoinError(
            f"{self.member}: no working quorum after {self.max_join_attempts} attempts "
            f"(max_join_attempts={self.max_join_attempts}); last failure: {last_failure}"
        )

    def _abort_comms(self) -> None:
        for comm in {id(comm): comm for comm in (self._comm, self._grad_comm) if comm is not None}.values():
            comm.abort()
        self._comm = self._grad_comm = None

    def _connect(self, answer: QuorumAnswer) -> None:
        """Build the quorum's process group over every process of every member group (and, for FSDP2, per shard)."""
        timeout = self.timeouts.rendezvous_timeout
        store = quorum_store(answer.store.host, answer.store.port, answer.store.prefix, timeout)
        try:
            if self._group.is_leader:
                store.set(f"group_size/{self.member}", str(self._group.size))
            store.set(f"layout/{self.member}/{self._group.rank}", self._layout)
            store.set(f"data/{self.member}/{self._group.rank}", self._data_fingerprint)
            self._group_sizes = [int(store.get(f"group_size/{member}")) for member in answer.members]
            self._check_layout(answer, store)
            self._check_data(answer, store)
        except (RuntimeError, dist.DistError) as error:  # a member that never wrote its keys: it died
            raise CollectiveError(f"quorum {answer.quorum_id}'s store did not answer: {error}") from error
        offset = sum(self._group_sizes[: answer.rank])
        options: dict[str, Any] = {
            "timeout": self.timeouts.collective_timeout,
            "rendezvous_timeout": self.timeouts.rendezvous_timeout,
            "device": self.device,
            "host": self.host,
            "abandon": self._abandon,
        }
        self._comm = self._grad_comm = Communicator(store, offset + self._group.rank, sum(self._group_sizes), **options)
        if self._sharded:
            shard_store = dist.PrefixStore(f"shard/{self._group.rank}/", store)
            self._grad_comm = Communicator(shard_store, answer.rank, len(answer.members), **options)

    def _check_layout(self, answer: QuorumAnswer, store: dist.Store) -> None:
        """Refuse to train beside a group that shards differently (FSDP2), or shards when this one does not."""
        heal = answer.heal
        reference = 0 if heal is None or heal.source_rank is None else heal.source_rank
        if reference == answer.rank:
            return
        name = answer.members[reference]
        size = self._group_sizes[reference]
        theirs = store.get(f"layout/{name}/{min(self._group.rank, size - 1)}").decode()
        if (theirs == _REPLICATED) != (self._layout == _REPLICATED):
            raise ShardingMismatchError(
                f"replica group {self.member!r} {'does not shard' if self._layout == _REPLICATED else 'shards'} its "
                f"model with FSDP2 and group {name!r} {'does' if theirs != _REPLICATED else 'does not'}: every group "
                "of a job must run the same training script"
            )
        if self._layout == _REPLICATED:
            return
        if size != self._group.size:
            raise ShardingMismatchError(
                f"replica group {self.member!r} shards its model over {self._group.size} processes and group "
                f"{name!r} over {size}: every FSDP2 group of a job needs the same number of processes"
            )
        if theirs != self._layout:
            raise ShardingMismatchError(
                f"process {self._group.rank} of replica group {self.member!r} holds its shard with layout "
                f"{self._layout}, group {name!r}'s with {theirs}: every group must fully_shard the same model "
                "the same way (see stalwart.runtime.sharding.sharding_layout)"
            )

    def _check_data(self, answer: QuorumAnswer, store: dist.Store) -> None:
        """Refuse to train beside a member whose dataset has other shards: the same index would be another sample."""
        heal = answer.heal
        reference = 0 if heal is None or heal.source_rank is None else heal.source_rank
        if reference == answer.rank:
            return
        name = answer.members[reference]
        theirs = store.get(f"data/{name}/0").decode()
        if theirs and self._data_fingerprint and theirs != self._data_fingerprint:
            raise PlanMismatchError(
                f"member {self.member!r} reads a dataset with fingerprint {self._data_fingerprint} and member "
                f"{name!r} one with {theirs}: every member must read the same shards in the same order (the same file "
                "names and row counts; sort the file list)"
            )

    def _heal(self, answer: QuorumAnswer) -> None:
        """Take part in the broadcast of the source's state; load it if this member is behind."""
        assert answer.heal is not None and self._comm is not None
        is_target = self.member in answer.heal.targets
        finished = self._max_steps is not None and answer.applied_step >= self._max_steps
        if answer.heal.checkpoint is not None:
            if is_target and finished:
                self.joined_after_end = True
            elif is_target:
                started = time.monotonic()
                self._load_checkpoint(answer.heal.checkpoint)
                self._report_heal(time.monotonic() - started)
                self._after_heal()
            return
        if answer.heal.source_rank is None:
            if finished:
                self.joined_after_end = True
                return
            raise StateLostError(
                f"no live member holds step {answer.applied_step} and the lighthouse has no checkpoint to resume "
                "from: run the workers with a checkpoint directory (Manager(checkpoint_dir=..., "
                "checkpoint_every=...)) so that a whole-fleet restart resumes"
            )
        started = time.monotonic()
        if self._sharded:  # process r of the source group sends its shard to process r of the others
            self.applied_step = self._transfer(answer.heal.source_rank, is_target=is_target, comm=self._grad_comm)
        else:
            source = sum(self._group_sizes[: answer.heal.source_rank])
            self.applied_step = self._transfer(source, is_target=is_target)
        self._report = (self.applied_step, None, None)
        if is_target:
            self._report_heal(time.monotonic() - started)
            self._after_heal()

    def _report_heal(self, seconds: float) -> None:
        """Count a heal this member loaded (its state's bytes, ``seconds``) in the heartbeats (a group's leader)."""
        if self._client is not None:
            self._client.report_heal(sum(spec.nbytes for spec in state_specs(self.states)), seconds)

    def _after_heal(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_step()
        self._notify("healed")

    def _transfer(self, source: int, *, is_target: bool, comm: Communicator | None = None) -> int:
        """Broadcast the state from rank ``source`` of ``comm`` (default: the quorum's); load it if ``is_target``."""
        comm = comm or self._comm
        assert comm is not None
        self._heals += 1
        return transfer_state(
            comm,
            source,
            self.states,
            self.applied_step,
            is_target=is_target,
            key=f"heal/{self._heals}",
            max_bytes=self.max_heal_bytes,
            timeout=self.timeouts.heal_timeout,
            min_bandwidth=self.timeouts.heal_min_bandwidth,
        )

    def _indices(self, part: np.ndarray) -> list[int]:
        """Sample indices of ``part``: the prefetched ones when the share is the one foreseen (the usual case)."""
        foreseen = self._foreseen
        if foreseen is not None and foreseen[0] == self.ledger.epoch and np.array_equal(foreseen[1], part):
            return foreseen[2]
        return self.ledger.plan.indices_at(self.ledger.epoch, part).tolist()

    def _prefetch_next(self, loader: ElasticLoader) -> None:
        """Foresee the next step's share assuming the quorum holds, and start loading it."""
        self._foreseen = next(self._foreseen_steps(), None)
        if self._foreseen is not None:
            loader.prefetch(self._foreseen[0], self._foreseen[2])

    def _foreseen_steps(self) -> Iterator[tuple[int, np.ndarray, list[int]]]:
        """``(epoch, part, indices)`` of this process in each step after the current one, up to ``max_steps``,
        as they will be if the quorum holds (replayed on a copy of the ledger as it is now)."""
        preview = copy.deepcopy(self.ledger)
        members = self._answer_members()
        multiple = preview.plan.local_batch_multiple

        def steps() -> Iterator[tuple[int, np.ndarray, list[int]]]:
            while True:
                if preview.in_step:
                    preview.commit()
                if self._max_steps is not None and preview.step >= self._max_steps:
                    return
                group_share = preview.begin_step(members).get(self.member, _NO_POSITIONS)
                part = split_group_share(group_share, self._group.size, self._group.rank, multiple)
                yield preview.epoch, part, preview.plan.indices_at(preview.epoch, part).tolist()

        return steps()

    def _foreseen_parts(self) -> Iterator[tuple[int, list[int]]]:
        """``(epoch, indices)`` of this process in each later step if the quorum holds (the feed's foresight)."""
        return ((epoch, indices) for epoch, _, indices in self._foreseen_steps())


def _step_began(ledger: DataLedger) -> tuple[int, np.ndarray]:
    """``(base_index, missing_indices)`` of ``ledger`` as its step in progress began.

    A step takes queued positions first, then fresh ones from ``base_index``
    on; after failures and reassigns the ledger no longer says which of its
    positions were which, so the fresh ones are read as the run of positions
    just below ``ledger.base_index`` (none while the queue is not empty).
    The lighthouse reassigns a failed member's positions within the step and
    never queues any, so for the Manager's ledgers this is exact; in a
    re-queue-mode ledger (loaded with ``load_state_dict``) a queued position
    right below the fresh ones would be read as fresh, and the queued ones
    are listed in ascending order.
    """
    positions = np.sort(np.concatenate([_NO_POSITIONS, *ledger.in_flight.values(), ledger.step_missing]))
    queued = ledger.missing_indices
    fresh = 0
    if not queued.size:
        below = ledger.base_index - 1 - np.arange(positions.size)
        mismatch = np.flatnonzero(positions[::-1] != below)
        fresh = int(mismatch[0]) if mismatch.size else positions.size
    return ledger.base_index - fresh, np.concatenate([positions[: positions.size - fresh], queued])


def _ends_epoch(ledger: DataLedger) -> bool:
    """Whether the step in progress holds the epoch's last positions (it completes the epoch when it commits)."""
    return ledger.base_index >= ledger.plan.epoch_length and not ledger.missing_indices.size


def _zero_rows(batch: Any) -> Any:
    """``batch`` with every tensor cut to its first 0 rows (tuples, lists and dicts followed)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0] if batch.dim() else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(_zero_rows(item) for item in batch)
    if isinstance(batch, dict):
        return {key: _zero_rows(value) for key, value in batch.items()}
    return batch


def _check_dataset(loader: ElasticLoader | DataLoader[Any], ledger: DataLedger) -> None:
    """Refuse a plan whose dataset size differs from the loader's dataset (it would index past its end)."""
    try:
        length = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return
    if length != ledger.plan.dataset_size:
        raise PlanMismatchError(
            f"the lighthouse's plan has dataset_size={ledger.plan.dataset_size} but this worker's dataset has "
            f"{length} samples: start the lighthouse with --dataset-size {length}, or give the worker that dataset"
        )


def _produced_checksum(loader: Source) -> int:
    """The audit checksum of the samples ``loader`` produced since it was last asked."""
    produced = loader.take_produced()
    if not produced:
        return 0
    keys = np.asarray(produced, dtype=np.int64)
    return index_checksum(keys[:, 0], keys[:, 1])


class TrainStep:
    """One step's micro-batches; iterating past the last one reduces, retries on failure, and commits."""

    def __init__(self, manager: Manager, loader: Source, *, epoch_end: bool) -> None:
        self._manager = manager
        self._loader = loader
        self.committed = False
        self.epoch_end = epoch_end
        """True on the last step of an epoch: once it commits, every sample of the epoch is trained on.

        Known when the step is yielded, so the loop body can plan for it (step
        an epoch-wise LR scheduler, evaluate, save) after iterating the step.
        """

    def __iter__(self) -> Iterator[object]:
        yield from self._manager._microbatches(self._loader)
        self.committed = True

    def backward(self, loss_sum: torch.Tensor) -> None:
        """Back-propagate a micro-batch's summed loss and count it towards the step's mean loss.

        The loss is counted first: the step's last backward launches the
        reduction, whose tail carries the loss sum.
        """
        self._manager._loss_sum += loss_sum.detach()  # a tensor: no host sync per micro-batch
        loss_sum.backward()

    @property
    def report(self) -> StepReport:
        """What the committed step did."""
        if not self.committed:
            raise RuntimeError("the step is not committed yet: iterate it to its end first")
        assert self._manager.last_report is not None
        return self._manager.last_report
