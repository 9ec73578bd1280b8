"""The elastic loader: micro-batches follow the real share, whatever was prefetched, in threads or worker processes."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, TensorDataset

from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.runtime.loader import ElasticLoader, sample_generator

SIZE = 64
WAIT_SECONDS = 10.0
DATASET = TensorDataset(torch.arange(SIZE, dtype=torch.float32).unsqueeze(1) * 10, torch.arange(SIZE))


def noisy(sample: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random augmentation that draws only from the generator it is given."""
    features, label = sample
    return features + torch.rand(features.shape, generator=generator), label


def expected(seed: int, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What loading ``index`` of ``epoch`` must give, computed without the loader."""
    return noisy(DATASET[index], sample_generator(seed, epoch, index))


def check_batches(batches: list[Any], seed: int, epoch: int, indices: list[int], max_microbatch: int) -> None:
    """The micro-batches hold exactly ``indices`` in order, transformed right, in balanced sizes <= max."""
    sizes = [len(labels) for _, labels in batches]
    assert all(0 < size <= max_microbatch for size in sizes)
    assert len(sizes) == -(-len(indices) // max_microbatch)
    assert not sizes or max(sizes) - min(sizes) <= 1
    if not indices:
        assert batches == []
        return
    assert torch.cat([labels for _, labels in batches]).tolist() == indices
    features = torch.cat([features for features, _ in batches])
    assert torch.equal(features, torch.stack([expected(seed, epoch, index)[0] for index in indices]))


@pytest.fixture(scope="module", params=[(0, True), (2, True), (2, False)], ids=["threads", "workers", "no-prefetch"])
def loader(request: pytest.FixtureRequest) -> Iterator[ElasticLoader]:
    num_workers, prefetch = request.param
    elastic = ElasticLoader(DATASET, transform=noisy, seed=7, num_workers=num_workers, prefetch=prefetch)
    yield elastic
    elastic.close()


@st.composite
def guesses(draw: st.DrawFn, share: list[int]) -> list[int]:
    """A prefetched guess at ``share``: some of its indices (in any order) and some others."""
    kept = draw(st.permutations(share))[: draw(st.integers(0, len(share)))]
    others = draw(st.lists(st.sampled_from([i for i in range(SIZE) if i not in share]), unique=True, max_size=8))
    return kept + others


@settings(max_examples=40, deadline=None)
@given(
    share=st.lists(st.integers(0, SIZE - 1), unique=True, max_size=24),
    epoch=st.integers(0, 2),
    prefetch=st.sampled_from(["none", "same epoch", "other epoch"]),
    max_microbatch=st.integers(1, 9),
    data=st.data(),
)
def test_microbatches_are_the_requested_share_whatever_was_prefetched(
    loader: ElasticLoader, share: list[int], epoch: int, prefetch: str, max_microbatch: int, data: st.DataObject
) -> None:
    if prefetch != "none":
        loader.prefetch(epoch if prefetch == "same epoch" else (epoch + 1) % 3, data.draw(guesses(share)))
    batches = list(loader.microbatches(epoch, share, max_microbatch))
    check_batches(batches, loader.seed, epoch, share, max_microbatch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_prefetched_share_then_the_grown_share_after_a_failure(num_workers: int) -> None:
    plan = EpochPlan(SIZE, 12, seed=3)
    members = ["w0", "w1", "w2"]
    ledger = DataLedger(plan)
    ledger.begin_step(members)
    ledger.commit()
    preview = DataLedger.from_state_dict(ledger.state_dict())
    guess = preview.begin_step(members)["w1"]
    ledger.begin_step(members)
    ledger.member_failed("w2")
    ledger.reassign(["w0", "w1"])
    real = ledger.in_flight["w1"]
    assert real.size > guess.size and np.array_equal(real[: guess.size], guess)
    elastic = ElasticLoader(DATASET, transform=noisy, seed=1, num_workers=num_workers, prefetch=True)
    try:
        elastic.prefetch(ledger.epoch, plan.indices_at(ledger.epoch, guess).tolist())
        indices = plan.indices_at(ledger.epoch, real).tolist()
        check_batches(list(elastic.microbatches(ledger.epoch, indices, 3)), 1, ledger.epoch, indices, 3)
        shrunk = indices[1:3]
        elastic.prefetch(ledger.epoch, indices)
        check_batches(list(elastic.microbatches(ledger.epoch, shrunk, 3)), 1, ledger.epoch, shrunk, 3)
        again = list(elastic.microbatches(ledger.epoch, indices, 2))
        check_batches(again, 1, ledger.epoch, indices, 2)
    finally:
        elastic.close()


class LoadLog(Dataset[tuple[int, int, int]]):
    """Samples ``(index, index, loading pid)``; each load leaves a file in ``directory``, so loads can be counted."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        (self.directory / f"{index}-{uuid.uuid4().hex}").touch()
        return index, index, os.getpid()

    def loads(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for path in self.directory.iterdir():
            index = int(path.name.split("-")[0])
            counts[index] = counts.get(index, 0) + 1
        return counts


def wait_until_loaded(dataset: LoadLog, indices: list[int]) -> dict[int, int]:
    """Wait (bounded) until every index was loaded at least once, without consuming anything."""
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline and not set(indices) <= set(dataset.loads()):
        time.sleep(0.01)
    return dataset.loads()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_prefetch_loads_in_the_background_once_and_extra_samples_on_demand(tmp_path: Path, num_workers: int) -> None:
    dataset = LoadLog(tmp_path)
    elastic = ElasticLoader(dataset, num_workers=num_workers, prefetch=True)
    try:
        prefetched = [5, 9, 2, 40, 33, 17]
        elastic.prefetch(0, prefetched)
        assert wait_until_loaded(dataset, prefetched) == dict.fromkeys(prefetched, 1)
        share = [*prefetched, 60, 1]
        batches = list(elastic.microbatches(0, share, 3))
        indices, _, pids = (torch.cat(column).tolist() for column in zip(*batches, strict=True))
        assert indices == share
        assert dataset.loads() == dict.fromkeys(share, 1)
        if num_workers:
            assert os.getpid() not in pids
            assert len(set(pids)) == num_workers
    finally:
        elastic.close()
    if num_workers:
        deadline = time.monotonic() + WAIT_SECONDS
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in set(pids)):
            time.sleep(0.01)
        assert not any(Path(f"/proc/{pid}").exists() for pid in set(pids))


def test_a_transform_depends_only_on_seed_epoch_and_index() -> None:
    blank = TensorDataset(torch.zeros(SIZE, 4), torch.arange(SIZE))
    in_threads = ElasticLoader(blank, transform=noisy, seed=3)
    in_workers = ElasticLoader(blank, transform=noisy, seed=3, num_workers=2)
    other_seed = ElasticLoader(blank, transform=noisy, seed=4)

    def features(elastic: ElasticLoader, epoch: int) -> torch.Tensor:
        """Samples 8 and 3 of ``epoch``, each in its own micro-batch (so loaded by different workers)."""
        return torch.cat([features for features, _ in elastic.microbatches(epoch, [8, 3], 1)])

    try:
        torch.manual_seed(0)
        main_process = [features(in_threads, epoch) for epoch in (0, 1)]
        torch.manual_seed(1)
        worker_processes = [features(in_workers, epoch) for epoch in (0, 1)]
        assert all(torch.equal(a, b) for a, b in zip(main_process, worker_processes, strict=True))
        assert not torch.equal(main_process[0], main_process[1])
        assert not torch.equal(main_process[0][0], main_process[0][1])
        assert torch.equal(main_process[0][0], in_threads.load(0, 8)[0])
        assert not torch.equal(main_process[0], features(other_seed, 0))
    finally:
        for elastic in (in_threads, in_workers, other_seed):
            elastic.close()


@pytest.mark.parametrize(
    ("arguments", "error", "name"),
    [
        ({"num_workers": -1}, ValueError, "num_workers"),
        ({"num_workers": 1.5}, TypeError, "num_workers"),
        ({"seed": -2}, ValueError, "seed"),
        ({"prefetch": "yes"}, TypeError, "prefetch"),
        ({"transform": 3}, TypeError, "transform"),
        ({"collate_fn": None}, TypeError, "collate_fn"),
    ],
)
def test_bad_constructor_arguments_name_the_parameter(arguments: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        ElasticLoader(DATASET, **arguments)


def test_bad_call_arguments_name_the_parameter() -> None:
    with pytest.raises(TypeError, match="dataset"):
        ElasticLoader(object())  # type: ignore[arg-type]
    elastic = ElasticLoader(DATASET)
    try:
        with pytest.raises(ValueError, match="max_microbatch"):
            elastic.microbatches(0, [1, 2], 0)
        with pytest.raises(ValueError, match="epoch"):
            elastic.microbatches(-1, [1, 2], 2)
        with pytest.raises(ValueError, match="indices"):
            elastic.microbatches(0, [1, -2], 2)
        with pytest.raises(ValueError, match="indices"):
            elastic.prefetch(0, [4, 1, 4])
        with pytest.raises(TypeError, match="indices"):
            elastic.prefetch(0, 5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="index"):
            elastic.load(0, -1)
    finally:
        elastic.close()
    elastic.close()
    with pytest.raises(RuntimeError, match="closed"):
        elastic.microbatches(0, [1], 1)
