"""ManagedDistributedSampler as a drop-in for DistributedSampler: its arguments, ``sampler=`` with ``batch_size=``,
no empty share, the loss scale, and ``state_dict()`` exact with DataLoader workers (in this process, then
plain torchrun DDP with 4 ranks of 2 workers each, stopped mid-epoch and resumed)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

from stalwart.data.audit import audit_directory
from stalwart.data.plan import EpochPlan
from stalwart.data.sampler import ManagedDistributedSampler
from stalwart.data.schedule import split_sizes


def values(batch: list[torch.Tensor]) -> list[int]:
    return [int(value) for value in batch[0]]


@settings(max_examples=120, deadline=None)
@given(
    size=st.integers(1, 200),
    chunks=st.integers(1, 5),
    multiple=st.integers(1, 3),
    world_size=st.integers(1, 5),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_each_batch_of_batch_size_is_one_steps_share_and_no_rank_ever_waits_alone(
    size: int, chunks: int, multiple: int, world_size: int, drop_last: bool, shuffle: bool, seed: int
) -> None:
    batch_size = chunks * multiple
    options = {"batch_size": batch_size, "local_batch_multiple": multiple, "shuffle": shuffle, "seed": seed}
    plan_options = {"local_batch_multiple": multiple, "shuffle": shuffle, "seed": seed}
    if drop_last and size < batch_size * world_size:
        with pytest.raises(ValueError, match="dataset_size must be at least"):
            ManagedDistributedSampler(size, num_replicas=world_size, rank=0, drop_last=True, **options)
        return
    plan = EpochPlan(size, batch_size * world_size, drop_last=drop_last, **plan_options)
    last = split_sizes(plan.step_total(plan.steps_per_epoch - 1), world_size, multiple)
    if min(last) == 0:
        with pytest.raises(ValueError, match=r"last step .* drop_last=True"):
            ManagedDistributedSampler(size, num_replicas=world_size, rank=0, drop_last=drop_last, **options)
        return
    batches = []
    for rank in range(world_size):
        sampler = ManagedDistributedSampler(size, num_replicas=world_size, rank=rank, drop_last=drop_last, **options)
        assert sampler.plan == plan
        rank_batches = list(BatchSampler(sampler, batch_size, drop_last=False))
        assert len(sampler) == sum(len(batch) for batch in rank_batches)
        batches.append(rank_batches)
    assert {len(rank_batches) for rank_batches in batches} == {plan.steps_per_epoch}
    for step in range(plan.steps_per_epoch):
        step_indices = [index for rank_batches in batches for index in rank_batches[step]]
        assert step_indices == plan.indices(0, plan.step_start(step), plan.step_start(step + 1)).tolist()


def test_a_plan_that_would_leave_a_rank_without_a_share_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"step 0 only 2 chunks for 4 ranks: ranks \[2, 3\] .* at least 32"):
        ManagedDistributedSampler(64, 16, num_replicas=4, rank=0, local_batch_multiple=8)
    with pytest.raises(ValueError, match=r"last step has 3 samples .* ranks \[3\] .* drop_last=True"):
        ManagedDistributedSampler(35, batch_size=2, num_replicas=4, rank=0)
    assert len(ManagedDistributedSampler(35, batch_size=2, num_replicas=4, rank=0, drop_last=True)) == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"batch_size": 2, "num_replicas": 2}, ValueError, "num_replicas and rank together"),
        ({"batch_size": 2, "rank": 0}, ValueError, "num_replicas and rank together"),
        ({"batch_size": 2, "num_replicas": 0, "rank": 0}, ValueError, "num_replicas"),
        ({"batch_size": 2, "num_replicas": 2, "rank": 2}, ValueError, r"rank must be in \[0, 1\]"),
        ({"num_replicas": 2, "rank": 0}, ValueError, "exactly one of global_batch_size"),
        ({"global_batch_size": 4, "batch_size": 2, "num_replicas": 2, "rank": 0}, ValueError, "exactly one"),
        ({"batch_size": 0, "num_replicas": 2, "rank": 0}, ValueError, "batch_size"),
        ({"batch_size": 3, "num_replicas": 2, "rank": 0, "local_batch_multiple": 2}, ValueError, "multiple of"),
        ({"batch_size": 2, "num_replicas": 2, "rank": 0, "allow_empty_shares": True}, ValueError, "whole steps"),
    ],
)
def test_distributed_sampler_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named):
        ManagedDistributedSampler(40, **kwargs)


def test_the_loss_scale_weights_unequal_shares_by_the_steps_sample_count() -> None:
    """14 samples, 2 per rank on 4 ranks: a step of 8, then one of 6 split 2, 2, 1, 1."""
    steps = []
    for rank in range(4):
        sampler = ManagedDistributedSampler(14, batch_size=2, num_replicas=4, rank=rank, seed=1)
        loader = DataLoader(TensorDataset(torch.arange(14)), sampler=sampler, batch_size=2)
        steps.append([(step, len(values(batch))) for step, batch in sampler.steps(loader)])
    assert [[size for _, size in rank_steps] for rank_steps in steps] == [[2, 2], [2, 2], [2, 1], [2, 1]]
    last = [rank_steps[1][0] for rank_steps in steps]
    assert {(step.step, step.samples, step.loss_scale) for step in last} == {(1, 6, 4 / 6)}
    # each rank's summed loss times loss_scale, averaged over the 4 ranks: the mean over the step's 6 samples
    assert sum(size * step.loss_scale for step, size in (rank_steps[1] for rank_steps in steps)) / 4 == pytest.approx(1)


def test_steps_refuses_a_loader_whose_batches_are_not_the_shares() -> None:
    dataset = TensorDataset(torch.arange(40))
    sampler = ManagedDistributedSampler(dataset, batch_size=4, num_replicas=2, rank=0)
    for loader in (
        DataLoader(dataset, sampler=sampler, batch_size=3),
        DataLoader(dataset, sampler=sampler, batch_size=4, drop_last=True),
        DataLoader(dataset, batch_size=4),
        DataLoader(dataset, sampler=sampler, batch_size=4, in_order=False),
    ):
        with pytest.raises(ValueError, match=r"sampler=sampler, batch_size=4, drop_last=False"):
            next(sampler.steps(loader))
    whole_steps = ManagedDistributedSampler(dataset, 8, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"batch_sampler=sampler"):
        next(whole_steps.steps(DataLoader(dataset, sampler=whole_steps)))


@pytest.mark.parametrize("batch_sampler", [False, True])
def test_state_dict_counts_what_the_loop_took_not_what_workers_prefetched(tmp_path: Path, batch_sampler: bool) -> None:
    """Two DataLoader workers run 4 batches ahead; a loop stopped after 3 batches resumes at the 4th, exactly once.

    Sample ``i`` is ``i``: each batch shows what was loaded."""
    dataset = TensorDataset(torch.arange(90))

    def sampler_and_loader() -> tuple[ManagedDistributedSampler, DataLoader[Any]]:
        world: dict[str, Any] = {"num_replicas": 3, "rank": 1, "seed": 5, "audit_dir": tmp_path}
        if batch_sampler:
            sampler = ManagedDistributedSampler(dataset, 12, **world)
            return sampler, DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        sampler = ManagedDistributedSampler(dataset, batch_size=4, **world)
        return sampler, DataLoader(dataset, sampler=sampler, batch_size=4, num_workers=2)

    sampler, loader = sampler_and_loader()
    sampler.set_epoch(1)
    full = [values(batch) for _, batch in sampler.steps(loader)]
    (tmp_path / "rank-00001.jsonl").unlink()
    taken = []
    for step, batch in sampler.steps(loader):
        taken.append(values(batch))
        if step.step == 2:
            break
    state = json.loads(json.dumps(sampler.state_dict()))
    resumed, loader = sampler_and_loader()
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    rest = [values(batch) for _, batch in resumed.steps(loader)]
    assert taken + rest == full
    epoch = audit_directory(tmp_path).epochs[0]
    assert epoch.epoch == 1 and not epoch.coverage.duplicates and epoch.rank_batches == {(1, 3): len(full)}
    assert sorted(itertools.chain(*taken, *rest)) == sorted(itertools.chain(*full))


@pytest.mark.slow
def test_plain_torchrun_ddp_stopped_mid_epoch_resumes_exactly_once(tmp_path: Path) -> None:
    """2 ranks x 2 DataLoader workers: 3 steps, stop, resume (a second launch, started with the first and
    waiting for its ranks to return), to the end of epoch 1; the ranks' audit files cover both epochs exactly
    once and the parameters are the single-process mean-gradient run's."""
    from tests.integration.ddp_dropin_job import RANKS, reference_parameters

    job = Path(__file__).resolve().parent / "ddp_dropin_job.py"
    launches = {}
    environ = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, run in (("stop", ["--stop-after", "3"]), ("resume", ["--resume"])):  # together: see the job's doc
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
            str(job), "--out", str(tmp_path), *run,
        ]  # fmt: skip
        with open(tmp_path / f"{name}.log", "wb") as log:
            launches[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True
            )
    try:
        for name, launch in launches.items():
            assert launch.wait(timeout=240) == 0, (tmp_path / f"{name}.log").read_text(errors="replace")[-4000:]
    finally:
        for launch in launches.values():
            if launch.poll() is None:  # its agent and ranks (a resuming launch waits for a failed one's marks)
                os.killpg(launch.pid, signal.SIGKILL)
                launch.wait()
    report = audit_directory(tmp_path / "audit")
    assert report.ok and [epoch.epoch for epoch in report.epochs] == [0, 1]
    assert all(epoch.complete and epoch.coverage.exactly_once for epoch in report.epochs)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, value in reference_parameters().items():
        assert torch.allclose(final[name], value, atol=1e-6), name
