"""``ManagedDistributedSampler``: a DataLoader ``batch_sampler`` with exactly-once shares and a constant global batch.

Driven by the fault-tolerant runtime's Manager (the proposal's signature), it
feeds the user's own DataLoader through failures::

    sampler = ManagedDistributedSampler(manager, dataset)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=4, pin_memory=True)
    for step in manager.steps(loader, max_steps=10_000):
        for inputs, targets in step:   # this process's part of the step, in micro-batches of max_microbatch
            step.backward(loss_fn(model(inputs), targets))

The plan (dataset size, global batch, seed, ``local_batch_multiple``) is then
the lighthouse's; the sampler yields what the Manager plans, and the Manager
drops micro-batches that DataLoader workers prefetched for a share that a
failure superseded (see :mod:`stalwart.runtime.feed`). Anything with a
``sampler_pass()`` method (:class:`SamplerDriver`) can drive it, which keeps
this package free of the runtime.

Without a Manager, for a fixed world (torchrun, DDP), it replaces
``DistributedSampler`` as a batch sampler of whole steps::

    sampler = ManagedDistributedSampler(dataset, global_batch_size=256)   # rank and world from torchrun
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=4)

or as a drop-in with ``DistributedSampler``'s arguments and the DataLoader's
``batch_size`` (it then yields sample indices, and each batch of
``batch_size`` is one step's share)::

    sampler = ManagedDistributedSampler(dataset, batch_size=32, num_replicas=world_size, rank=rank,
                                        shuffle=True, seed=0, drop_last=False)
    loader = DataLoader(dataset, sampler=sampler, batch_size=32, num_workers=2)
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for step, (inputs, targets) in sampler.steps(loader):
            loss = loss_fn(ddp_model(inputs), targets)       # reduction="sum"
            (loss * step.loss_scale).backward()              # DDP's mean becomes the mean over the step's samples
            ...
            checkpoint = {"sampler": sampler.state_dict(), ...}  # resumes after this batch, workers or not

Unlike ``DistributedSampler``, no rank is padded with repeated samples and
the tail is trained on unless ``drop_last``: each step's samples are the
plan's (``global_batch_size``, or ``batch_size * num_replicas``, adjusted to
``local_batch_multiple``), split among the ranks with
:func:`~stalwart.data.schedule.split_sizes`, and every sample of the epoch is
handed out exactly once. Shares can differ (the epoch's last step, or chunks
of ``local_batch_multiple`` that do not divide evenly): DDP averages the
ranks' gradients, so a loop weights each rank's summed loss by
``world_size / step samples`` (:attr:`SamplerStep.loss_scale`) to train on the
mean over the step's samples.

No rank may get an empty share: it would have no batch for that step and a
DDP loop would hang in the step's collective, so a plan that gives one (too
few chunks of ``local_batch_multiple`` per step for the ranks, or an epoch
tail too short to reach every rank) is refused at construction with the fix
(``drop_last=True``, a larger batch, a smaller multiple).
``allow_empty_shares=True`` (batch sampler of whole steps only) yields empty
lists instead, for a loop that takes part in a step without samples and a
``collate_fn`` that accepts them.

Where the shares come from is a :class:`~stalwart.data.info.DataLoadingInfoSource`:
by default :class:`~stalwart.data.info.LocalLedgerSource`, the fixed world
of torchrun, which needs no communication.

Prefetching: a DataLoader runs its sampler in the main process, so the shares
are right with worker processes too, but it draws them ahead of training
(``prefetch_factor * num_workers`` batches). :meth:`~ManagedDistributedSampler.steps`
counts what the loop took, torchdata ``StatefulDataLoader``'s convention: with
it, ``state_dict()`` resumes right after the last batch the loop received and
the audit (``audit_dir``) records the steps the loop received. Iterating the
loader directly, both follow what was handed to the DataLoader (exact with
``num_workers=0`` only). After ``load_state_dict`` the next iteration yields
exactly the steps not yet consumed; otherwise every iteration runs the current
epoch from its first step, as ``DistributedSampler`` does.
"""

from __future__ import annotations

import copy
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, overload, runtime_checkable

from stalwart._validate import check_bool, check_int
from stalwart.data.audit import AuditWriter, write_expected
from stalwart.data.info import DataLoadingInfo, DataLoadingInfoSource, LocalLedgerSource
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_microbatches, split_sizes
from stalwart.data.world import WorldInfo

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = ["ManagedDistributedSampler", "SamplerDriver", "SamplerStep", "split_microbatches"]

_STATE_KEYS = {"epoch", "source"}


@runtime_checkable
class SamplerDriver(Protocol):
    """What drives a :class:`ManagedDistributedSampler` from outside: the runtime's ``Manager``."""

    def sampler_pass(self) -> Iterator[list[int]]:
        """Begin a pass of the DataLoader: the dataset indices of each micro-batch to load, in order."""
        ...


@dataclass(frozen=True)
class SamplerStep:
    """A step of a fixed-world epoch, as :meth:`ManagedDistributedSampler.steps` hands it to the loop with its batch."""

    epoch: int
    step: int
    """The step within the epoch, from 0."""
    samples: int
    """The step's samples on all ranks together."""
    loss_scale: float
    """``world_size / samples``: a rank's summed loss times this, averaged by DDP, is the mean over the step."""


class ManagedDistributedSampler:
    """Yields this rank's share of each step (or its indices), or the Manager's micro-batches.

    ``ManagedDistributedSampler(manager, dataset)``: driven by ``manager``
    (a :class:`SamplerDriver`), for a DataLoader iterated by
    ``manager.steps(loader)``; the plan is the lighthouse's, so no other
    argument is taken, and the sampler has no length, epoch or state of its
    own (the Manager's ledger holds them).

    ``ManagedDistributedSampler(dataset, global_batch_size, ...)``: the fixed
    world, as a ``batch_sampler`` yielding each step's share (a list of
    dataset indices). ``ManagedDistributedSampler(dataset, batch_size=b,
    ...)``: as a ``sampler`` of a ``DataLoader(..., batch_size=b)``, yielding
    the shares' indices one by one; the global batch is ``b`` times the world
    size, so every share of a full step is one batch of ``b`` (``b`` must be
    a multiple of ``local_batch_multiple``). ``dataset`` is a sized dataset or
    its size. The world is ``world``, or ``num_replicas`` and ``rank``
    (``DistributedSampler``'s names), else :meth:`WorldInfo.from_env`;
    ``source`` (batch sampler only) overrides the fixed-world
    :class:`LocalLedgerSource` and must follow the same plan. A plan giving a
    rank an empty share is refused (see the module docstring) unless
    ``allow_empty_shares``. With ``audit_dir``, every share is recorded with
    :class:`~stalwart.data.audit.AuditWriter` for ``stalwart audit``.
    """

    @overload
    def __init__(self, dataset: SamplerDriver, global_batch_size: Sized | int, /) -> None: ...

    @overload
    def __init__(
        self,
        dataset: Sized | int,
        global_batch_size: int | None = None,
        *,
        batch_size: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        world: WorldInfo | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        local_batch_multiple: int = 1,
        allow_empty_shares: bool = False,
        source: DataLoadingInfoSource | None = None,
        audit_dir: str | os.PathLike[str] | None = None,
    ) -> None: ...

    def __init__(
        self,
        dataset: SamplerDriver | Sized | int,
        global_batch_size: Sized | int | None = None,
        *,
        batch_size: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        world: WorldInfo | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        local_batch_multiple: int = 1,
        allow_empty_shares: bool = False,
        source: DataLoadingInfoSource | None = None,
        audit_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.driver: SamplerDriver | None = None
        if isinstance(dataset, SamplerDriver):
            given = {
                name: value
                for name, value, default in (
                    ("batch_size", batch_size, None),
                    ("num_replicas", num_replicas, None),
                    ("rank", rank, None),
                    ("world", world, None),
                    ("seed", seed, 0),
                    ("shuffle", shuffle, True),
                    ("drop_last", drop_last, False),
                    ("local_batch_multiple", local_batch_multiple, 1),
                    ("allow_empty_shares", allow_empty_shares, False),
                    ("source", source, None),
                    ("audit_dir", audit_dir, None),
                )
                if value != default
            }
            if given:
                raise ValueError(
                    f"ManagedDistributedSampler(manager, dataset) takes its plan from the lighthouse, got {given}: "
                    "set them on the lighthouse (stalwart lighthouse --global-batch, --seed, --multiple, --drop-last, "
                    "--no-shuffle)"
                )
            if global_batch_size is None:
                raise TypeError("ManagedDistributedSampler(manager, dataset) needs the dataset (or its size)")
            self.driver = dataset
            self.dataset_size = _dataset_size(global_batch_size)
            return
        if isinstance(global_batch_size, Sized):
            raise TypeError(f"global_batch_size must be an int, got {type(global_batch_size).__name__}")
        self.dataset_size = _dataset_size(dataset)
        self.world = _world(world, num_replicas, rank)
        multiple = check_int("local_batch_multiple", local_batch_multiple, minimum=1)
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, minimum=1)
        if (global_batch_size is None) == (self.batch_size is None):
            raise ValueError(
                f"pass exactly one of global_batch_size (each step's samples, for batch_sampler=) and batch_size "
                f"(each rank's, for sampler= with DataLoader(batch_size=)), got global_batch_size={global_batch_size} "
                f"and batch_size={batch_size}"
            )
        if self.batch_size is not None:
            if self.batch_size % multiple:
                raise ValueError(
                    f"batch_size must be a multiple of local_batch_multiple={multiple} for every share of a full step "
                    f"to be one batch, got {self.batch_size}"
                )
            if source is not None or check_bool("allow_empty_shares", allow_empty_shares):
                raise ValueError(
                    "source and allow_empty_shares=True are for a batch sampler of whole steps (global_batch_size=); "
                    "with batch_size= every rank needs a batch in every step"
                )
            global_batch_size = self.batch_size * self.world.world_size
        assert global_batch_size is not None
        self.plan = EpochPlan(
            self.dataset_size,
            global_batch_size,
            seed=seed,
            shuffle=check_bool("shuffle", shuffle),
            drop_last=check_bool("drop_last", drop_last),
            local_batch_multiple=multiple,
        )
        if source is None:
            source = LocalLedgerSource(self.plan, self.world)
        elif not isinstance(source, DataLoadingInfoSource):
            raise TypeError(f"source must implement DataLoadingInfoSource, got {type(source).__name__}")
        elif source.plan != self.plan:
            raise ValueError(f"source must follow this sampler's plan {self.plan}, but it follows {source.plan}")
        if isinstance(source, LocalLedgerSource) and not check_bool("allow_empty_shares", allow_empty_shares):
            _refuse_empty_shares(self.plan, list(source.group_sizes.values()), self.batch_size is None)
        self.source = source
        self.audit_dir = None if audit_dir is None else os.fspath(audit_dir)
        if self.audit_dir is not None:
            write_expected(self.audit_dir, {"plan": self.plan.to_dict()})
        self._epoch = 0
        self._resume: dict[str, Any] | None = None
        """The source state ``load_state_dict`` gave, until the iteration it resumes draws a share."""
        self._tracking = False
        self._consumed: dict[str, Any] | None = None
        self._handed: deque[tuple[DataLoadingInfo, dict[str, Any]]] = deque()
        self._audit: AuditWriter | None = None
        self.source.set_epoch(0)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration runs."""
        self._check_fixed("epoch")
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Run epoch ``epoch`` next (every rank must use the same); a pending resume of another epoch is dropped."""
        self._check_fixed("set_epoch()")
        epoch = check_int("epoch", epoch, minimum=0)
        if self._resume is not None and epoch == self._epoch:
            return
        self._resume = None
        self._consumed = None
        self._epoch = epoch
        self.source.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches a full iteration yields (steps in the epoch), or with ``batch_size`` this rank's samples."""
        if self.driver is not None:
            raise TypeError("a Manager-driven ManagedDistributedSampler has no length: manager.steps() runs the steps")
        if self.batch_size is None:
            return len(self.source)
        steps = self.plan.steps_per_epoch
        last = split_sizes(self.plan.step_total(steps - 1), self.world.world_size, self.plan.local_batch_multiple)
        return (steps - 1) * self.batch_size + last[self.world.rank]

    def __iter__(self) -> Iterator[Any]:
        """Begin an iteration: the Manager's pass, or where ``load_state_dict`` left off, else the epoch's start.

        A resume holds until a share is drawn: a multi-process DataLoader
        makes and drops one iterator before the one it draws from.
        """
        if self.driver is not None:
            return self.driver.sampler_pass()
        if self._resume is None:
            self.source.set_epoch(self._epoch)
        else:
            self.source.load_state_dict(self._resume)
        self._consumed = self.source.state_dict() if self._tracking else None
        self._handed.clear()
        self._close_audit()
        if self.audit_dir is not None:
            self._audit = AuditWriter(self.audit_dir, self.world.rank, world_size=self.world.world_size)
        shares = self._shares()
        return shares if self.batch_size is None else (index for share in shares for index in share)

    def steps(self, loader: DataLoader[Any]) -> Iterator[tuple[SamplerStep, Any]]:
        """Iterate ``loader``, a DataLoader over this sampler, through the epoch: each batch with its step.

        Counts the batches the loop takes, so that ``state_dict()`` resumes
        right after the last one received (however far DataLoader workers
        prefetched) and the audit records what the loop received.
        """
        self._check_fixed("steps()")
        self._check_loader(loader)
        self._tracking = True
        try:
            batches = iter(loader)
            for batch in batches:
                info, state = self._handed.popleft()
                self._consumed = state
                if self._audit is not None:
                    self._audit.write(info.epoch, info.step, info.indices)
                total = self.plan.step_total(info.step)
                yield SamplerStep(info.epoch, info.step, total, self.world.world_size / total), batch
        finally:
            self._tracking = False
            self._handed.clear()
            self._close_audit()

    def _shares(self) -> Iterator[list[int]]:
        try:
            while (info := self.source.next_step()) is not None:
                self._resume = None
                if self._tracking:
                    self._handed.append((info, self.source.state_dict()))
                elif self._audit is not None:
                    self._audit.write(info.epoch, info.step, info.indices)
                yield list(info.indices)
            self._resume = None  # a resume at the epoch's end is done too
        finally:
            if not self._tracking:
                self._close_audit()

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the epoch and the source's state after the steps consumed (JSON-serialisable).

        Consumed: received by the loop from :meth:`steps`; iterating the
        loader directly, handed to the DataLoader.
        """
        self._check_fixed("state_dict()")
        source = self.source.state_dict() if self._consumed is None else copy.deepcopy(self._consumed)
        return {"epoch": self._epoch, "source": source}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` output: the next iteration yields exactly the steps not yet consumed."""
        self._check_fixed("load_state_dict()")
        if not isinstance(state, Mapping) or set(state) != _STATE_KEYS:
            raise ValueError(f"state must be a ManagedDistributedSampler state_dict with keys {sorted(_STATE_KEYS)}")
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        self.source.load_state_dict(state["source"])
        if self.source.epoch != epoch:
            self.source.set_epoch(self._epoch)
            self._resume = None
            raise ValueError(f"state['epoch'] is {epoch} but state['source'] is at epoch {self.source.epoch}")
        self._epoch = epoch
        self._resume = self.source.state_dict()
        self._consumed = None

    def _check_loader(self, loader: Any) -> None:
        """``loader`` must draw from this sampler so that each batch it yields is one step's share."""
        if self.batch_size is None:
            fits = getattr(loader, "batch_sampler", None) is self
            wanted = "DataLoader(dataset, batch_sampler=sampler, ...)"
        else:
            fits = (
                getattr(loader, "sampler", None) is self
                and getattr(loader, "batch_size", None) == self.batch_size
                and not getattr(loader, "drop_last", True)
            )
            wanted = f"DataLoader(dataset, sampler=sampler, batch_size={self.batch_size}, drop_last=False, ...)"
        if not fits or not getattr(loader, "in_order", True):
            raise ValueError(f"loader must be {wanted} with in_order=True, so that each batch is one step's share")

    def _close_audit(self) -> None:
        if self._audit is not None:
            self._audit.close()
            self._audit = None

    def _check_fixed(self, what: str) -> None:
        if self.driver is not None:
            raise RuntimeError(
                f"{what} is not for a Manager-driven sampler: the Manager's ledger runs the epochs and is its state "
                "(healed and checkpointed with the model); step.epoch_end marks an epoch's last step"
            )


def _world(world: WorldInfo | None, num_replicas: int | None, rank: int | None) -> WorldInfo:
    """The world from ``world``, or ``num_replicas`` and ``rank``, else the environment."""
    if num_replicas is None and rank is None:
        if world is not None and not isinstance(world, WorldInfo):
            raise TypeError(f"world must be a WorldInfo or None, got {type(world).__name__}")
        return WorldInfo.from_env() if world is None else world
    if world is not None or num_replicas is None or rank is None:
        raise ValueError(
            f"pass num_replicas and rank together, or world, got num_replicas={num_replicas}, rank={rank}, "
            f"world={world}"
        )
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    return WorldInfo(check_int("rank", rank, minimum=0, maximum=num_replicas - 1), num_replicas)


def _refuse_empty_shares(plan: EpochPlan, layout: list[int], whole_steps: bool) -> None:
    """Raise if some step of an epoch gives a rank of ``layout`` (workers per replica group) an empty share.

    The totals of full steps repeat with a period of at most
    ``local_batch_multiple`` steps, so those steps and the last one cover all.
    """
    steps = plan.steps_per_epoch
    multiple = plan.local_batch_multiple
    ranks = sum(layout)
    for step in [*range(min(steps - 1, multiple)), steps - 1]:
        total = plan.step_total(step)
        group_totals = split_sizes(total, len(layout), multiple)
        sizes = [
            size
            for group, workers in zip(group_totals, layout, strict=True)
            for size in split_sizes(group, workers, multiple)
        ]
        if min(sizes) > 0:
            continue
        empty = [rank for rank, size in enumerate(sizes) if size == 0]
        hang = (
            f"ranks {empty} would get empty shares and a DDP loop would hang waiting for them in the step's collective"
        )
        if step < steps - 1:
            raise ValueError(
                f"global_batch_size={plan.global_batch_size} in chunks of local_batch_multiple={multiple} gives step "
                f"{step} only {total // multiple} chunks for {ranks} ranks: {hang}; use a global batch of at least "
                f"{ranks * multiple} or a smaller local_batch_multiple"
            )
        fixes = "pass drop_last=True (those samples are skipped, other ones each epoch when shuffled)"
        if whole_steps:
            fixes += ", or allow_empty_shares=True for a loop that takes part in a step without samples"
        raise ValueError(
            f"the epoch's last step has {total} samples (dataset_size={plan.dataset_size}), fewer than a chunk of "
            f"local_batch_multiple={multiple} for each of {ranks} ranks: {hang}; {fixes}, or choose a batch that "
            f"leaves a last step of at least {ranks * multiple} samples"
        )


def _dataset_size(dataset: Sized | int) -> int:
    if isinstance(dataset, bool):
        raise TypeError("dataset must be a sized dataset or an int size, got a bool")
    if isinstance(dataset, int):
        return check_int("dataset", dataset, minimum=1)
    if not isinstance(dataset, Sized):
        raise TypeError(f"dataset must be a sized dataset or an int size, got {type(dataset).__name__}")
    return check_int("len(dataset)", len(dataset), minimum=1)
