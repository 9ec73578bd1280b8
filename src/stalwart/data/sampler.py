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

Without a Manager, for a fixed world, it replaces ``DistributedSampler`` + ``batch_size``::

    sampler = ManagedDistributedSampler(dataset, global_batch_size=256)   # rank and world from torchrun
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=4)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:          # this rank's share of the step's 256 samples
            for micro in split_microbatches(batch, max_microbatch): ...

Unlike ``DistributedSampler``, no rank is padded with repeated samples and
the tail is trained on unless ``drop_last``: each step's samples are the
plan's (``global_batch_size``, adjusted to ``local_batch_multiple``), split
among the ranks with :func:`~stalwart.data.schedule.split_sizes`, and every
sample of the epoch is handed out exactly once. A rank's share can be empty
when a step has fewer chunks of ``local_batch_multiple`` samples than there
are ranks (typically the epoch's last step); the rank must still take part in
the step, so the empty list is yielded, and the DataLoader's ``collate_fn``
must accept it (the default one does not).

Where the shares come from is a :class:`~stalwart.data.info.DataLoadingInfoSource`:
by default :class:`~stalwart.data.info.LocalLedgerSource`, the fixed world
of torchrun, which needs no communication; the fault-tolerant runtime passes
its own.

Prefetching: a DataLoader runs its ``batch_sampler`` in the main process, so
the shares are right with worker processes too. But it draws batches ahead of
training (``prefetch_factor * num_workers`` of them), so a source whose world
changes during an epoch (the runtime's) would be read ahead of the quorum; the
runtime's elastic loader handles that, and this sampler is meant for a world
that holds for the epoch. Likewise the audit records what was handed to the
DataLoader.

``state_dict``/``load_state_dict`` follow torchdata's ``StatefulDataLoader``:
the state says where to resume, and after ``load_state_dict`` the next
iteration yields exactly the steps not yet handed out. Otherwise every
iteration runs the current epoch from its first step, as ``DistributedSampler``
does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sized
from typing import Any, Protocol, overload, runtime_checkable

from stalwart._validate import check_bool, check_int
from stalwart.data.audit import AuditWriter, write_expected
from stalwart.data.info import DataLoadingInfoSource, LocalLedgerSource
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_microbatches
from stalwart.data.world import WorldInfo

__all__ = ["ManagedDistributedSampler", "SamplerDriver", "split_microbatches"]

_STATE_KEYS = {"epoch", "source"}


@runtime_checkable
class SamplerDriver(Protocol):
    """What drives a :class:`ManagedDistributedSampler` from outside: the runtime's ``Manager``."""

    def sampler_pass(self) -> Iterator[list[int]]:
        """Begin a pass of the DataLoader: the dataset indices of each micro-batch to load, in order."""
        ...


class ManagedDistributedSampler:
    """Yields this rank's share (a list of dataset indices) of each step, or the Manager's micro-batches.

    ``ManagedDistributedSampler(manager, dataset)``: driven by ``manager``
    (a :class:`SamplerDriver`), for a DataLoader iterated by
    ``manager.steps(loader)``; the plan is the lighthouse's, so no other
    argument is taken, and the sampler has no length, epoch or state of its
    own (the Manager's ledger holds them).

    ``ManagedDistributedSampler(dataset, global_batch_size, ...)``: the fixed
    world. ``dataset`` is a sized dataset or its size. ``world`` defaults to
    :meth:`WorldInfo.from_env`; ``source`` overrides the fixed-world
    :class:`LocalLedgerSource` and must follow the same plan. With
    ``audit_dir``, every share yielded is recorded with
    :class:`~stalwart.data.audit.AuditWriter` for ``stalwart audit``.
    """

    @overload
    def __init__(self, dataset: SamplerDriver, global_batch_size: Sized | int, /) -> None: ...

    @overload
    def __init__(
        self,
        dataset: Sized | int,
        global_batch_size: int,
        *,
        world: WorldInfo | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        local_batch_multiple: int = 1,
        source: DataLoadingInfoSource | None = None,
        audit_dir: str | os.PathLike[str] | None = None,
    ) -> None: ...

    def __init__(
        self,
        dataset: SamplerDriver | Sized | int,
        global_batch_size: Sized | int,
        *,
        world: WorldInfo | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        local_batch_multiple: int = 1,
        source: DataLoadingInfoSource | None = None,
        audit_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.driver: SamplerDriver | None = None
        if isinstance(dataset, SamplerDriver):
            given = {
                name: value
                for name, value, default in (
                    ("world", world, None),
                    ("seed", seed, 0),
                    ("shuffle", shuffle, True),
                    ("drop_last", drop_last, False),
                    ("local_batch_multiple", local_batch_multiple, 1),
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
            self.driver = dataset
            self.dataset_size = _dataset_size(global_batch_size)
            return
        if isinstance(global_batch_size, Sized):
            raise TypeError(f"global_batch_size must be an int, got {type(global_batch_size).__name__}")
        self.dataset_size = _dataset_size(dataset)
        self.plan = EpochPlan(
            self.dataset_size,
            global_batch_size,
            seed=seed,
            shuffle=check_bool("shuffle", shuffle),
            drop_last=check_bool("drop_last", drop_last),
            local_batch_multiple=local_batch_multiple,
        )
        if world is not None and not isinstance(world, WorldInfo):
            raise TypeError(f"world must be a WorldInfo or None, got {type(world).__name__}")
        self.world = WorldInfo.from_env() if world is None else world
        if source is None:
            source = LocalLedgerSource(self.plan, self.world)
        elif not isinstance(source, DataLoadingInfoSource):
            raise TypeError(f"source must implement DataLoadingInfoSource, got {type(source).__name__}")
        elif source.plan != self.plan:
            raise ValueError(f"source must follow this sampler's plan {self.plan}, but it follows {source.plan}")
        self.source = source
        self.audit_dir = None if audit_dir is None else os.fspath(audit_dir)
        if self.audit_dir is not None:
            write_expected(self.audit_dir, {"plan": self.plan.to_dict()})
        self._epoch = 0
        self._resuming = False
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
        if self._resuming and epoch == self._epoch:
            return
        self._resuming = False
        self._epoch = epoch
        self.source.set_epoch(epoch)

    def __len__(self) -> int:
        """Steps in the epoch, which is also how many batches a full iteration yields."""
        if self.driver is not None:
            raise TypeError("a Manager-driven ManagedDistributedSampler has no length: manager.steps() runs the steps")
        return len(self.source)

    def __iter__(self) -> Iterator[list[int]]:
        """Begin an iteration: the Manager's pass, or where ``load_state_dict`` left off, else the epoch's start."""
        if self.driver is not None:
            return self.driver.sampler_pass()
        if self._resuming:
            self._resuming = False
        else:
            self.source.set_epoch(self._epoch)
        return self._shares()

    def _shares(self) -> Iterator[list[int]]:
        writer = None if self.audit_dir is None else AuditWriter(self.audit_dir, self.world.rank)
        try:
            while (info := self.source.next_step()) is not None:
                if writer is not None:
                    writer.write(info.epoch, info.step, info.indices)
                yield list(info.indices)
        finally:
            if writer is not None:
                writer.close()

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the epoch and the source's state after the steps handed out so far (JSON-serialisable)."""
        self._check_fixed("state_dict()")
        return {"epoch": self._epoch, "source": self.source.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` output: the next iteration yields exactly the steps not yet handed out."""
        self._check_fixed("load_state_dict()")
        if not isinstance(state, Mapping) or set(state) != _STATE_KEYS:
            raise ValueError(f"state must be a ManagedDistributedSampler state_dict with keys {sorted(_STATE_KEYS)}")
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        self.source.load_state_dict(state["source"])
        if self.source.epoch != epoch:
            self.source.set_epoch(self._epoch)
            self._resuming = False
            raise ValueError(f"state['epoch'] is {epoch} but state['source'] is at epoch {self.source.epoch}")
        self._epoch = epoch
        self._resuming = True

    def _check_fixed(self, what: str) -> None:
        if self.driver is not None:
            raise RuntimeError(
                f"{what} is not for a Manager-driven sampler: the Manager's ledger runs the epochs and is its state "
                "(healed and checkpointed with the model); step.epoch_end marks an epoch's last step"
            )


def _dataset_size(dataset: Sized | int) -> int:
    if isinstance(dataset, bool):
        raise TypeError("dataset must be a sized dataset or an int size, got a bool")
    if isinstance(dataset, int):
        return check_int("dataset", dataset, minimum=1)
    if not isinstance(dataset, Sized):
        raise TypeError(f"dataset must be a sized dataset or an int size, got {type(dataset).__name__}")
    return check_int("len(dataset)", len(dataset), minimum=1)
