"""A plain torchrun DDP job with ManagedDistributedSampler as its DistributedSampler (run by test_sampler_dropin).

``--stop-after K`` saves the model, optimizer and sampler state after the
job's K-th step (mid-epoch) and stops, each rank leaving ``OUT/stopped-RANK``
once it has returned; ``--resume`` waits (bounded) for every rank's mark,
loads the state and trains to the end of epoch ``EPOCHS - 1``, then rank 0
saves the final parameters. A test starts both launches together: the
resumed one's interpreters and imports while the first one trains. The
samples each rank trained on are in ``OUT/audit`` for ``stalwart audit``.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from stalwart.data.plan import EpochPlan
from stalwart.data.sampler import ManagedDistributedSampler
from stalwart.testing.waiting import wait_until

SIZE, BATCH, RANKS, EPOCHS, SEED, LR = 26, 3, 2, 2, 7, 0.05
"""26 samples, 3 per rank on 2 ranks: 4 steps of 6 and a last one of 2 (one per rank)."""
STOP_TIMEOUT = 240.0
"""Seconds ``--resume`` waits for the stopped launch's ranks to have returned."""


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    features, targets = torch.randn(SIZE, 4, generator=generator), torch.randn(SIZE, generator=generator)
    return TensorDataset(features, targets, torch.arange(SIZE))


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def reference_parameters() -> dict[str, torch.Tensor]:
    """One process, each step on the mean of its samples' losses: what the DDP job must end with."""
    data = dataset()
    plan = EpochPlan(SIZE, BATCH * RANKS, seed=SEED)
    model, optimizer = model_and_optimizer()
    for epoch in range(EPOCHS):
        for step in range(plan.steps_per_epoch):
            features, targets, _ = data[
                torch.from_numpy(plan.indices(epoch, plan.step_start(step), plan.step_start(step + 1)))
            ]
            optimizer.zero_grad()
            ((model(features).squeeze(-1) - targets) ** 2).mean().backward()
            optimizer.step()
    return model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    if args.resume:
        marks = [args.out / f"stopped-{rank}" for rank in range(RANKS)]
        wait_until(lambda: all(mark.exists() for mark in marks), STOP_TIMEOUT, "the stopped launch's ranks")
    train(args)
    if args.stop_after is not None:  # train's frame, its loader's iterator and audit files closed with it
        (args.out / f"stopped-{os.environ['RANK']}").touch()


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = dataset()
    model, optimizer = model_and_optimizer()
    sampler = ManagedDistributedSampler(
        data,
        batch_size=BATCH,
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=SEED,
        audit_dir=args.out / "audit",
    )
    if args.resume:
        state = torch.load(args.out / "checkpoint.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
    ddp = DistributedDataParallel(model)
    loader = DataLoader(data, sampler=sampler, batch_size=BATCH, num_workers=2)
    steps = 0
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for step, (features, targets, _) in sampler.steps(loader):
            optimizer.zero_grad()
            loss = ((ddp(features).squeeze(-1) - targets) ** 2).sum()
            (loss * step.loss_scale).backward()
            optimizer.step()
            steps += 1
            if steps == args.stop_after:
                if rank == 0:
                    state = {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "sampler": sampler.state_dict(),
                    }
                    torch.save(state, args.out / "checkpoint.pt")
                dist.barrier()
                dist.destroy_process_group()
                return
    if rank == 0:
        torch.save(model.state_dict(), args.out / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
