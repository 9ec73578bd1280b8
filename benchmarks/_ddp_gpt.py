"""The DiLoCo benchmark's baseline: the GPT task trained with plain torch DDP, on the samples stalwart's plan orders.

Run under ``torchrun --nproc-per-node N``: each step's global batch is the
positions ``plan.step_start(s) .. plan.step_start(s + 1)`` of the same
:class:`~stalwart.data.plan.EpochPlan` the lighthouse hands out, split evenly
over the ranks; the gradient is the mean over the whole batch (DDP averages
the ranks' sums scaled by the world size), clipped at the task's norm, and
the task's optimizer and schedule step. So the trajectory is the one stalwart's
every-step mode trains, with torch's ``DistributedDataParallel`` (its default
25 MiB buckets, gradients all-reduced during the last micro-batch's backward)
doing the communication. Rank 0 writes one JSON line per step (its wall
clock) to ``--times`` and the final parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_microbatches
from stalwart.launch.tasks import TASKS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt", "gpt-tiny"], required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--times", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = TASKS[args.model]
    dataset = spec.dataset()
    model = spec.model(args.seed)
    ddp_model = DistributedDataParallel(model)
    optimizer = spec.optimizer(model, "adamw", spec.lr)
    scheduler = spec.scheduler(optimizer, args.steps)
    plan = EpochPlan(len(dataset), args.global_batch, seed=args.seed)
    epoch, epoch_step = 0, 0
    with open(args.times, "w", encoding="utf-8") if rank == 0 else contextlib.nullcontext() as times:
        for step in range(args.steps):
            if epoch_step >= plan.steps_per_epoch:
                epoch, epoch_step = epoch + 1, 0
            indices = plan.indices(epoch, plan.step_start(epoch_step), plan.step_start(epoch_step + 1))
            mine = np.array_split(indices, world)[rank]
            chunks = split_microbatches(mine.tolist(), args.micro_batch)
            for number, chunk in enumerate(chunks, start=1):
                batch = torch.utils.data.default_collate([dataset[int(index)] for index in chunk])
                with contextlib.nullcontext() if number == len(chunks) else ddp_model.no_sync():
                    loss = spec.loss(ddp_model, batch) * (len(chunk) * world / indices.size)
                    loss.backward()
            if spec.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            epoch_step += 1
            if times is not None:
                times.write(json.dumps({"step": step, "time": time.time()}) + "\n")
    if rank == 0:
        torch.save(model.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
