"""``ManagedDistributedSampler``: a DataLoader ``batch_sampler`` with exactly-once shares and a constant global batch.

It replaces ``DistributedSampler`` + ``batch_size``::

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
from typing import Any

from stalwart._validate import check_bool, check_int
from stalwart.data.audit import AuditWriter, write_expected
from stalwart.data.info import DataLoadingInfoSource, LocalLedgerSource
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_microbatches
from stalwart.data.world import WorldInfo

__all__ = ["ManagedDistributedSampler", "split_microbatches"]

_STATE_KEYS = {"epoch", "source"}


class ManagedDistributedSampler:
    """Yields this rank's share (a list of dataset indices) of each step of the epoch.

    ``dataset`` is a sized dataset or its size. ``world`` defaults to
    :meth:`WorldInfo.from_env`; ``source`` overrides the fixed-world
    :class:`LocalLedgerSource` and must follow the same plan. With
    ``audit_dir``, every share yielded is recorded with
    :class:`~stalwart.data.audit.AuditWriter` for ``stalwart audit``.
    """

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
    ) -> None:
        self.plan = EpochPlan(
            _dataset_size(dataset),
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
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Run epoch ``epoch`` next (every rank must use the same); a pending resume of another epoch is dropped."""
        epoch = check_int("epoch", epoch, minimum=0)
        if self._resuming and epoch == self._epoch:
            return
        self._resuming = False
        self._epoch = epoch
        self.source.set_epoch(epoch)

    def __len__(self) -> int:
        """Steps in the epoch, which is also how many batches a full iteration yields."""
        return len(self.source)

    def __iter__(self) -> Iterator[list[int]]:
        """Begin an iteration: where ``load_state_dict`` left off, else at the epoch's first step."""
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
        return {"epoch": self._epoch, "source": self.source.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()`` output: the next iteration yields exactly the steps not yet handed out."""
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


def _dataset_size(dataset: Sized | int) -> int:
    if isinstance(dataset, bool):
        raise TypeError("dataset must be a sized dataset or an int size, got a bool")
    if isinstance(dataset, int):
        return check_int("dataset", dataset, minimum=1)
    if not isinstance(dataset, Sized):
        raise TypeError(f"dataset must be a sized dataset or an int size, got {type(dataset).__name__}")
    return check_int("len(dataset)", len(dataset), minimum=1)
