"""Elastic loading of a step's share, with prefetch that never lags behind the quorum.

A DataLoader prefetches batches from a sampler that runs ahead of training, so
a sampler fed by a changing quorum yields batches sized for an old world. The
elastic loader instead loads *samples*: after each step the Manager asks it to
prefetch the next step's share as it would be if the quorum stays the same;
when the real share is known, the prefetched samples are used and only the
difference (extra work after a failure) is loaded on the spot. Micro-batches
are collated from the samples at consumption time, so their sizes always
follow the real share and ``max_microbatch``.

Random augmentation must not depend on which worker loads a sample, or a
reassigned sample would be transformed differently: ``transform(sample,
generator)`` receives :func:`sample_generator` seeded by (seed, epoch, index).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from stalwart._validate import check_int
from stalwart.data.schedule import split_microbatches

Transform = Callable[[Any, torch.Generator], Any]


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator seeded by (seed, epoch, index): the same wherever the sample is loaded."""
    mixed = np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) & ((1 << 63) - 1))


class ElasticLoader:
    """Loads the samples of a share, prefetching the next one in a background thread."""

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        transform: Transform | None = None,
        seed: int = 0,
        prefetch: bool = True,
    ) -> None:
        if not hasattr(dataset, "__getitem__"):
            raise TypeError(f"dataset must support indexing (a map-style dataset), got {type(dataset).__name__}")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.transform = transform
        self.seed = check_int("seed", seed, minimum=0)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stalwart-prefetch") if prefetch else None
        self._lock = threading.Lock()
        self._prefetched: tuple[int, dict[int, Future[Any]]] | None = None

    def load(self, epoch: int, index: int) -> Any:
        """One sample, transformed with its own generator."""
        sample = self.dataset[index]
        if self.transform is not None:
            sample = self.transform(sample, sample_generator(self.seed, epoch, index))
        return sample

    def prefetch(self, epoch: int, indices: Sequence[int]) -> None:
        """Start loading ``indices`` of ``epoch`` in the background (replacing an earlier prefetch)."""
        if self._executor is None:
            return
        futures = {int(index): self._executor.submit(self.load, epoch, int(index)) for index in indices}
        with self._lock:
            self._prefetched = (epoch, futures)

    def microbatches(self, epoch: int, indices: Sequence[int], max_microbatch: int) -> Iterator[Any]:
        """Collated micro-batches of at most ``max_microbatch`` samples covering ``indices`` in order."""
        with self._lock:
            prefetched = self._prefetched
        ready = prefetched[1] if prefetched is not None and prefetched[0] == epoch else {}
        for chunk in split_microbatches(list(indices), max_microbatch):
            samples = [ready[i].result() if i in ready else self.load(epoch, i) for i in map(int, chunk)]
            yield self.collate_fn(samples)

    def close(self) -> None:
        """Stop the prefetch thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
