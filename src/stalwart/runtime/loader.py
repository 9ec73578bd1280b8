"""Elastic loading of a step's share, with prefetch that never lags behind the quorum.

Why a sampler-driven DataLoader lags
    A ``DataLoader`` draws batches from its sampler ahead of training
    (``prefetch_factor`` batches per worker), so the batches in flight were cut
    for the world as it was when they were drawn. When the quorum changes, a
    worker's share of the step grows or shrinks, but the batches already
    drawn, and the sampler's idea of the share, belong to the old world.

What this loader does instead
    It loads *samples*, keyed by ``(epoch, index)``, and cuts micro-batches
    only when they are consumed. After each step the Manager asks it to
    :meth:`~ElasticLoader.prefetch` the next step's share as it would be if the
    quorum stays the same; when the real share is known,
    :meth:`~ElasticLoader.microbatches` uses the prefetched samples it needs,
    drops the others, and loads the difference (the extra work after a
    failure) on the spot. Micro-batches are collated from the samples at
    consumption time, so their sizes always follow the real share and
    ``max_microbatch``: prefetch only saves time, it never decides a batch.

Where samples are loaded
    With ``num_workers=0`` one background thread loads the prefetched samples
    (samples not prefetched are loaded by the caller). With ``num_workers > 0``
    a persistent ``DataLoader`` (``persistent_workers=True``) loads them in
    worker processes. Its batch sampler does not sample: before each
    ``iter()`` the main process sets the request (the keys to load, cut into
    at most ``prefetch_factor * num_workers`` chunks, each worker's a
    contiguous run of the request), and ``iter()`` hands every chunk to the
    workers at once, so the whole request loads in the
    background while training goes on. Workers return uncollated
    ``(key, sample)`` pairs; collation happens in the main process. One pass
    runs at a time: to load extra samples, the loader first receives what is
    still in flight (keeping what the step needs), then starts a pass for the
    missing keys. The workers start when the loader is built, so build it
    before anything that starts threads (the Manager's heartbeat) when the
    start method is ``fork``; with ``spawn`` or ``forkserver``, the dataset
    and transform must be picklable.

Reading in groups
    A dataset with ``__getitems__(indices)`` (PyTorch's batched-fetch
    convention: :class:`~stalwart.data.shards.ShardedDataset`, a Hugging Face
    ``datasets.Dataset``) is asked for each micro-batch's missing samples, each
    prefetched request and each worker's chunk in one call, so that it can read
    each shard piece once; other datasets are indexed one sample at a time.

Row keys
    A dataset with ``gather(indices)`` (a :class:`~stalwart.data.shards.ShardedDataset`)
    returns each row's key with it, in the process that read the row; the key's
    64-bit hash travels with the sample, and :meth:`ElasticLoader.take_row_checksum`
    sums ``hash(index, key)`` over the samples handed out
    (:func:`~stalwart.runtime.consistency.row_checksum`), so that the
    Manager's audit covers the rows delivered, not only their positions.

Random augmentation must not depend on which process loads a sample, or a
reassigned sample would be transformed differently: ``transform(sample,
generator)`` receives :func:`sample_generator` seeded by (seed, epoch, index),
in a worker process as in the main process.

The loader is used from one thread (the training loop's).
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from stalwart._validate import check_bool, check_int
from stalwart.data.rowkeys import key_hashes
from stalwart.data.schedule import split_microbatches, split_sizes
from stalwart.runtime.consistency import row_checksum

Transform = Callable[[Any, torch.Generator], Any]
Key = tuple[int, int]
"""A sample to load: (epoch, dataset index)."""
Loaded = tuple[Any, int | None]
"""A loaded sample and the 64-bit hash of its row's key (None when the dataset does not key its rows)."""

_CHUNKS_PER_WORKER = 4
"""A request is cut into at most this many chunks per worker, all handed out at ``iter()`` (the prefetch factor)."""


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator seeded by (seed, epoch, index): the same wherever the sample is loaded."""
    mixed = np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) & ((1 << 63) - 1))


class _KeyedSamples(Dataset[tuple[Key, Any]]):
    """The dataset as seen by the loader: ``(epoch, index)`` -> ``(key, transformed sample)``; picklable."""

    def __init__(self, dataset: Dataset[Any], transform: Transform | None, seed: int) -> None:
        self.dataset = dataset
        self.transform = transform
        self.seed = seed

    def load(self, key: Key) -> Any:
        return self.load_many([key])[0][0]

    def load_many(self, keys: list[Key]) -> list[Loaded]:
        """The samples of ``keys`` in order with their row hashes: one ``gather`` or ``__getitems__`` call when the
        dataset has it."""
        indices = [index for _, index in keys]
        hashes: list[int | None] = [None] * len(keys)
        gather = getattr(self.dataset, "gather", None)
        getitems = getattr(self.dataset, "__getitems__", None)
        if callable(gather):
            samples, row_keys = gather(indices)
            hashes = key_hashes(row_keys).tolist()
        elif getitems is None:
            samples = [self.dataset[index] for index in indices]
        else:
            samples = list(getitems(indices))
        if len(samples) != len(keys):
            raise RuntimeError(f"the dataset returned {len(samples)} samples for {len(keys)} indices")
        if self.transform is not None:
            transform = self.transform
            samples = [
                transform(sample, sample_generator(self.seed, epoch, index))
                for sample, (epoch, index) in zip(samples, keys, strict=True)
            ]
        return list(zip(samples, hashes, strict=True))

    def __getitem__(self, key: Key) -> tuple[Key, Loaded]:
        return key, self.load_many([key])[0]

    def __getitems__(self, keys: list[Key]) -> list[tuple[Key, Loaded]]:
        return list(zip(keys, self.load_many(keys), strict=True))


def _uncollated(pairs: list[tuple[Key, Any]]) -> list[tuple[Key, Any]]:
    """The workers' collate function: samples travel uncollated, micro-batches are cut in the main process."""
    return pairs


class _Requests:
    """The DataLoader's batch sampler: yields the chunks of the request the main process set before ``iter()``."""

    def __init__(self) -> None:
        self.chunks: list[list[Key]] = []

    def __iter__(self) -> Iterator[list[Key]]:
        return iter(self.chunks)


class _ThreadSource:
    """Loads a prefetched request in one background task, other samples on the spot in the caller's thread.

    One task per request, not per sample: a future per sample costs more to
    submit than loading an in-memory sample does.
    """

    def __init__(self, samples: _KeyedSamples) -> None:
        self._samples = samples
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stalwart-prefetch")
        self._prefetched: Future[dict[Key, Loaded]] | None = None
        self._prefetched_keys: frozenset[Key] = frozenset()

    def prefetch(self, keys: list[Key]) -> None:
        self._drop()
        self._prefetched_keys = frozenset(keys)
        self._prefetched = self._executor.submit(self._load_all, keys)

    def request(self, keys: list[Key]) -> None:
        if self._prefetched_keys.isdisjoint(keys):
            self._drop()

    def take(self, keys: list[Key]) -> list[Loaded]:
        prefetched = self._prefetched_keys.intersection(keys)
        if not prefetched:
            return self._samples.load_many(keys)
        ready = self._prefetched.result() if prefetched and self._prefetched is not None else {}
        missing = [key for key in keys if key not in prefetched]
        loaded = dict(zip(missing, self._samples.load_many(missing), strict=True)) if missing else {}
        return [ready[key] if key in prefetched else loaded[key] for key in keys]

    def close(self) -> None:
        self._drop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _load_all(self, keys: list[Key]) -> dict[Key, Loaded]:
        return dict(zip(keys, self._samples.load_many(keys), strict=True))

    def _drop(self) -> None:
        if self._prefetched is not None:
            self._prefetched.cancel()
        self._prefetched = None
        self._prefetched_keys = frozenset()


class _WorkerSource:
    """Loads samples in the worker processes of a persistent DataLoader, one request (pass) at a time."""

    def __init__(self, samples: _KeyedSamples, num_workers: int) -> None:
        self._samples = samples
        self._num_workers = num_workers
        self._requests = _Requests()
        self._loader: DataLoader[Any] = DataLoader(
            samples,
            batch_sampler=self._requests,
            collate_fn=_uncollated,
            num_workers=num_workers,
            persistent_workers=True,
            prefetch_factor=_CHUNKS_PER_WORKER,
        )
        self._pass: Iterator[list[tuple[Key, Any]]] | None = None
        self._pending: set[Key] = set()
        self._wanted: set[Key] = set()
        self._ready: dict[Key, Loaded] = {}
        self._start([])

    def prefetch(self, keys: list[Key]) -> None:
        self._ready = {}
        self._wanted = set(keys)
        self._start(keys)

    def request(self, keys: list[Key]) -> None:
        self._wanted = set(keys)
        self._ready = {key: sample for key, sample in self._ready.items() if key in self._wanted}
        missing = [key for key in keys if key not in self._ready and key not in self._pending]
        if missing:
            while self._pending:
                self._receive()
            self._start(missing)

    def take(self, keys: list[Key]) -> list[Loaded]:
        """The samples of ``keys``: received from the workers where they have them in hand, the rest loaded here."""
        taken = {}
        for key in keys:
            while key not in self._ready and key in self._pending:
                self._receive()
            if key in self._ready:
                taken[key] = self._ready.pop(key)
        missing = [key for key in keys if key not in taken]
        taken.update(zip(missing, self._samples.load_many(missing) if missing else [], strict=True))
        return [taken[key] for key in keys]

    def close(self) -> None:
        if self._pass is not None:
            self._pass._shutdown_workers()  # type: ignore[attr-defined]
            self._pass = None
        self._pending = set()
        self._ready = {}

    def _start(self, keys: list[Key]) -> None:
        """Hand ``keys`` to the workers; whatever the previous pass still had in flight is discarded by ``iter()``."""
        self._requests.chunks = _worker_chunks(keys, self._num_workers)
        self._pass = iter(self._loader)
        self._pending = set(keys)

    def _receive(self) -> None:
        assert self._pass is not None
        for key, sample in next(self._pass):
            self._pending.discard(key)
            if key in self._wanted:
                self._ready[key] = sample


class ElasticLoader:
    """Loads the samples of a share, optionally prefetching the next one (see the module docstring)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        transform: Transform | None = None,
        seed: int = 0,
        prefetch: bool = False,
        num_workers: int = 0,
    ) -> None:
        """``prefetch`` loads the next step's foreseen share in the background: worth it when loading waits on
        I/O or runs in worker processes (``num_workers``); for in-memory data on few cores it costs more than it
        saves (see ``benchmarks/runtime.py``), hence off by default."""
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"dataset must support indexing (a map-style dataset), got {type(dataset).__name__}: for shards or a "
                "Hugging Face IterableDataset use stalwart.data.ShardedDataset (ShardedDataset(stream.shards), "
                "ShardedDataset.from_hf_iterable(dataset)) with a lighthouse plan of --block-size/--window"
            )
        if not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable, got {collate_fn!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable or None, got {transform!r}")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.transform = transform
        self.seed = check_int("seed", seed, minimum=0)
        self.prefetching = check_bool("prefetch", prefetch)
        self.num_workers = check_int("num_workers", num_workers, minimum=0)
        self._samples = _KeyedSamples(dataset, transform, self.seed)
        self._source: _ThreadSource | _WorkerSource
        if self.num_workers:
            self._source = _WorkerSource(self._samples, self.num_workers)
        else:
            self._source = _ThreadSource(self._samples)
        self._closed = False
        self._produced: list[Key] = []
        self._row_sum = 0

    def take_produced(self) -> list[Key]:
        """The ``(epoch, index)`` of every sample in the micro-batches produced since the last call (then forgotten).

        What the loader actually handed out, not what it was asked for: the
        Manager's data audit sums a hash of these.
        """
        produced, self._produced = self._produced, []
        return produced

    def take_row_checksum(self) -> int:
        """:func:`~stalwart.runtime.consistency.row_checksum` of the samples handed out since the last call (then
        reset): 0 when the dataset does not key its rows (it has no ``gather``)."""
        row_sum, self._row_sum = self._row_sum, 0
        return row_sum

    def load(self, epoch: int, index: int) -> Any:
        """One sample, transformed with its own generator, loaded in the calling process."""
        epoch = check_int("epoch", epoch, minimum=0)
        index = check_int("index", index, minimum=0)
        return self._samples.load((epoch, index))

    def prefetch(self, epoch: int, indices: Sequence[int]) -> None:
        """Start loading ``indices`` of ``epoch`` in the background (replacing an earlier prefetch)."""
        keys = _keys(epoch, indices)
        self._check_open()
        if self.prefetching:
            self._source.prefetch(keys)

    def microbatches(self, epoch: int, indices: Sequence[int], max_microbatch: int) -> Iterator[Any]:
        """Collated micro-batches of at most ``max_microbatch`` samples covering ``indices`` in order.

        Prefetched samples are used, prefetched samples not in ``indices`` are
        dropped, and the others are loaded now.
        """
        keys = _keys(epoch, indices)
        chunks = split_microbatches(keys, max_microbatch)
        self._check_open()
        return self._collated(keys, chunks)

    def close(self) -> None:
        """Stop the prefetch thread or the worker processes; the loader cannot be used afterwards."""
        if not self._closed:
            self._closed = True
            self._source.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the ElasticLoader is closed")

    def _collated(self, keys: list[Key], chunks: list[list[Key]]) -> Iterator[Any]:
        self._source.request(keys)
        for chunk in chunks:
            loaded = self._source.take(chunk)
            batch = self.collate_fn([sample for sample, _ in loaded])
            self._produced.extend(chunk)
            hashes = [row_hash for _, row_hash in loaded if row_hash is not None]
            if chunk and len(hashes) == len(chunk):
                row_sum = row_checksum([index for _, index in chunk], hashes)
                self._row_sum = (self._row_sum + row_sum) % (1 << 64)
            yield batch


def _worker_chunks(keys: list[Key], workers: int) -> list[list[Key]]:
    """``keys`` in at most ``_CHUNKS_PER_WORKER`` chunks per worker, listed so that the DataLoader's round-robin
    (chunk ``j`` to worker ``(first + j) % workers``) hands each worker one contiguous run of the keys: a block of
    consecutive positions is then read by one worker instead of by every worker."""
    if len(keys) < workers * _CHUNKS_PER_WORKER:
        return split_microbatches(keys, 1)
    runs, start = [], 0
    for size in split_sizes(len(keys), workers):
        run = keys[start : start + size]
        offsets = np.cumsum([0, *split_sizes(size, _CHUNKS_PER_WORKER)]).tolist()
        runs.append([run[low:high] for low, high in itertools.pairwise(offsets)])
        start += size
    return [run[number] for number in range(_CHUNKS_PER_WORKER) for run in runs]


def _keys(epoch: int, indices: Sequence[int]) -> list[Key]:
    """Checked ``(epoch, index)`` keys; indices must be distinct non-negative integers."""
    epoch = check_int("epoch", epoch, minimum=0)
    if isinstance(indices, (str, bytes)) or not isinstance(indices, (Sequence, np.ndarray)):
        raise TypeError(f"indices must be a sequence of ints, got {type(indices).__name__}")
    array = np.asarray(indices)
    if array.size == 0:
        return []
    has_bool = not isinstance(indices, np.ndarray) and bool in set(map(type, indices))
    if array.ndim != 1 or array.dtype.kind not in "iu" or array.min() < 0 or has_bool:
        bad = next((i for i in indices if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0), indices)
        raise ValueError(f"indices must be non-negative ints, got {bad!r}")
    values, counts = np.unique(array, return_counts=True)
    if values.size != array.size:
        raise ValueError(
            f"indices must be distinct (a share holds each sample once), got repeated {values[counts > 1].tolist()}"
        )
    return list(zip(itertools.repeat(epoch), array.tolist()))
