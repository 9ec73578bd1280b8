"""The tasks the local cluster trains: the digits MLP, and a small GPT on a generated corpus.

A :class:`Task` bundles what a worker and the failure-free reference need:
the training set, the model (seeded: every worker starts from the same
parameters), the optimizer by name (the GPT's over weight-decay parameter
groups), the LR scheduler, the micro-batch's **mean** loss and the clipping
norm. :func:`reference_run` trains a task's plan in this process without
failures, exactly as a worker's loop does (mean gradient over each step's
samples, clip, update, schedule), so any failure-free or failure-transparent
distributed run of the same plan ends on the same parameters up to the order
of floating-point sums.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from stalwart.data.plan import EpochPlan
from stalwart.launch import digits, gpt

GPT_SIZES = {
    "gpt": gpt.GPTConfig(),
    "gpt-tiny": gpt.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32),
}
"""The GPT tasks' model sizes: the example's, and a tiny one for tests on a busy 2-core machine."""
_GPT_CHARACTERS = {"gpt": gpt.DEFAULT_CHARACTERS, "gpt-tiny": 60_000}


@dataclass(frozen=True)
class Task:
    """What a worker trains: data, model, optimizer, scheduler, loss and clipping (see the module docstring)."""

    name: str
    dataset: Callable[[], Dataset[Any]]
    model: Callable[[int], torch.nn.Module]
    optimizer: Callable[[torch.nn.Module, str, float], torch.optim.Optimizer]
    scheduler: Callable[[torch.optim.Optimizer, int], torch.optim.lr_scheduler.LRScheduler]
    loss: Callable[[torch.nn.Module, Sequence[torch.Tensor]], torch.Tensor]
    clip: float | None
    fsdp_units: Callable[[torch.nn.Module], list[torch.nn.Module]]
    """The modules a replica group ``fully_shard``-s one by one before the root (a GPT's blocks)."""
    lr: float = digits.DEFAULT_LR


def _digits_optimizer(model: torch.nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    return digits.OPTIMIZERS[name](model, lr)


def _gpt_model(name: str, seed: int) -> torch.nn.Module:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return gpt.GPT(GPT_SIZES[name])
    finally:
        torch.random.set_rng_state(state)


def _gpt_optimizer(model: torch.nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    """AdamW (or Adam, SGD with momentum, plain SGD) over the GPT's weight-decay and no-decay parameter groups.

    ``plain-sgd`` keeps no state: DiLoCo's groups then hold no inner state of their own that a resume could lose.
    """
    assert isinstance(model, gpt.GPT)
    groups = gpt.optimizer_groups(model, weight_decay=0.1)
    if name in ("sgd", "plain-sgd"):
        return torch.optim.SGD(groups, lr=10 * lr, momentum=0.9 if name == "sgd" else 0.0)
    kind = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return kind(groups, lr=lr, betas=(0.9, 0.95))


def _gpt_scheduler(optimizer: torch.optim.Optimizer, max_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over a tenth of the steps, then a cosine down to a tenth of the peak."""
    warmup = max_steps // 10
    return torch.optim.lr_scheduler.LambdaLR(optimizer, gpt.cosine_schedule(warmup, max(max_steps, warmup + 1), 0.1))


def _gpt_loss(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    _, loss = model(inputs, targets)
    assert loss is not None
    return loss


def _gpt_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A GPT's transformer blocks: the root keeps the tied embedding and output layer in one FSDP unit."""
    assert isinstance(model, gpt.GPT)
    return list(model.blocks)


@functools.cache
def gpt_datasets(name: str) -> tuple[gpt.TextWindows, gpt.TextWindows]:
    """The training and validation windows of GPT task ``name`` (the corpus is generated once per process)."""
    return gpt.text_datasets(GPT_SIZES[name].block_size, characters=_GPT_CHARACTERS[name])


def _gpt_task(name: str) -> Task:
    return Task(
        name=name,
        dataset=lambda: gpt_datasets(name)[0],
        model=functools.partial(_gpt_model, name),
        optimizer=_gpt_optimizer,
        scheduler=_gpt_scheduler,
        loss=_gpt_loss,
        clip=1.0,
        fsdp_units=_gpt_blocks,
        lr=3e-3,
    )


TASKS: dict[str, Task] = {
    "digits": Task(
        name="digits",
        dataset=digits.digits_dataset,
        model=digits.digits_model,
        optimizer=_digits_optimizer,
        scheduler=lambda optimizer, _max_steps: digits.digits_scheduler(optimizer),
        loss=digits.mean_loss,
        clip=None,
        fsdp_units=lambda model: [layer for layer in model.children() if any(True for _ in layer.parameters())],
    ),
    **{name: _gpt_task(name) for name in GPT_SIZES},
}
"""The tasks by name: ``digits`` (the demo's default), ``gpt`` and ``gpt-tiny``."""


def reference_run(
    plan: EpochPlan,
    steps: int,
    seed: int = 0,
    lr: float | None = None,
    optimizer_name: str = "adam",
    clip: float | None = None,
    task: str = "digits",
    max_steps: int | None = None,
    skip_steps: Collection[int] = (),
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train ``task`` without failures in this process: each step on the plan's samples, mean gradient.

    ``clip`` (default: the task's) clips the gradient's global norm before
    each update; ``max_steps`` (default ``steps``) shapes the task's LR
    schedule as the workers' ``--max-steps`` does; at ``skip_steps`` the
    update is skipped (a GradScaler's overflow) and the schedule steps on.
    Returns the final parameters and the loss of each step.
    """
    spec = TASKS[task]
    dataset = spec.dataset()
    model = spec.model(seed)
    optimizer = spec.optimizer(model, optimizer_name, spec.lr if lr is None else lr)
    scheduler = spec.scheduler(optimizer, steps if max_steps is None else max_steps)
    clip = spec.clip if clip is None else clip
    losses: list[float] = []
    epoch, epoch_step = 0, 0
    for _ in range(steps):
        if epoch_step >= plan.steps_per_epoch:
            epoch, epoch_step = epoch + 1, 0
        indices = plan.indices(epoch, plan.step_start(epoch_step), plan.step_start(epoch_step + 1))
        batch = torch.utils.data.default_collate([dataset[int(index)] for index in indices])
        loss = spec.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if len(losses) not in skip_steps:
            optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        epoch_step += 1
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}, losses
