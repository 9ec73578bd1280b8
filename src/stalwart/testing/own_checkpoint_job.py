"""A nanoGPT-style loop that saves and resumes its own ``torch.save`` checkpoint, for test_own_checkpoint.py.

Each worker (forked by the test: :func:`run`) trains a tiny MLP with AdamW
over nanoGPT's two weight-decay groups through a :class:`~stalwart.Manager`
(``--redundancy``: ``overlap:F``, ``parity:K,M`` or ``none``); after step
``--save-at`` it saves ``{"model": ..., "optimizer": optimizer.state_dict()}``
to ``OUT/ckpt.pt``, as a script does: ``--save every`` calls
``optimizer.state_dict()`` on every process and the leader saves; ``--save
leader`` calls it only on the leader, inside ``manager.on_leader`` (nanoGPT's
``master_process`` block); ``--save leader-alone`` calls it on the leader
alone outside ``on_leader`` (the contract broken). ``--resume PATH`` loads such a checkpoint into the
model and, before the Manager is built (``--load before``) or in the first
step's update window (``--load in-loop``), the optimizer. Each worker writes
its final parameters to ``OUT/final-MEMBER.pt``, and (with ``--save-at``)
what ``optimizer.state_dict()`` says after ``manager.close()`` to
``OUT/after-close-MEMBER.txt``. :func:`reference` is the same
training in one process without stalwart (a replicated run's state).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch

from stalwart import ElasticLoader, EpochPlan, Manager
from stalwart.redundancy.config import Overlap, Redundancy, parse_parity
from stalwart.testing.forked import run_forked

SAMPLES, FEATURES, BATCH, MICRO = 48, 6, 12, 4
PLAN = EpochPlan(SAMPLES, BATCH, seed=0)


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=generator), torch.randn(SAMPLES, 2, generator=generator)
    )


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """nanoGPT's ``configure_optimizers``: weights decay, biases do not (two groups), AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))
    decay = [param for param in model.parameters() if param.dim() >= 2]
    no_decay = [param for param in model.parameters() if param.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=0.02, betas=(0.9, 0.95))


def loss_of(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(inputs), targets)


def reference(steps: int, resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """One process, no stalwart: ``steps`` steps of the plan (from its start), each on the step's mean loss."""
    data = dataset()
    model, optimizer = model_and_optimizer()
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(copy.deepcopy(resume["optimizer"]))  # loading adopts the tensors themselves
    for step in range(steps):
        epoch, number = divmod(step, PLAN.steps_per_epoch)
        indices = torch.from_numpy(PLAN.indices(epoch, PLAN.step_start(number), PLAN.step_start(number + 1)))
        inputs, targets = data[indices]
        optimizer.zero_grad()
        loss_of(model, inputs, targets).backward()
        optimizer.step()
    # copies: torch's state dicts hold the live tensors
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def redundancy_of(text: str) -> Redundancy | None:
    kind, _, value = text.partition(":")
    if kind == "overlap":
        return Overlap(float(value))
    return parse_parity(value) if kind == "parity" else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--member", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--redundancy", default="none")
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--save", choices=("every", "leader", "leader-alone"), default="every")
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--load", choices=("before", "in-loop"), default="before")
    args = parser.parse_args()
    model, optimizer = model_and_optimizer()
    checkpoint = torch.load(args.resume, weights_only=True) if args.resume is not None else None
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        if args.load == "before":
            optimizer.load_state_dict(checkpoint["optimizer"])
    manager = Manager(
        model,
        optimizer,
        lighthouse=args.lighthouse,
        member=args.member,
        max_microbatch=MICRO,
        plan=PLAN,
        redundancy=redundancy_of(args.redundancy),
    )

    def save() -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.out / "ckpt.pt")

    loader = ElasticLoader(dataset())
    try:
        for step in manager.steps(loader, max_steps=args.steps):
            for inputs, targets in step:
                step.backward(loss_of(model, inputs, targets))
            if checkpoint is not None and args.load == "in-loop" and step.number == 0:
                optimizer.load_state_dict(checkpoint["optimizer"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step.number + 1 == args.save_at and args.save == "leader":
                manager.on_leader(save)
            elif step.number + 1 == args.save_at and args.save == "leader-alone":
                if manager.is_leader:  # the contract broken: the others do not take part
                    save()
            elif step.number + 1 == args.save_at:
                whole = optimizer.state_dict()  # every process, at the same point
                if manager.is_leader:
                    torch.save({"model": model.state_dict(), "optimizer": whole}, args.out / "ckpt.pt")
    finally:
        manager.close()
        loader.close()
    torch.save(model.state_dict(), args.out / f"final-{args.member}.pt")
    if args.save_at is not None:  # too late: the shards' holders are gone
        try:
            optimizer.state_dict()
        except RuntimeError as error:
            (args.out / f"after-close-{args.member}.txt").write_text(str(error))


def run() -> None:
    """A forked worker's entry: :func:`main`, then an exit that skips the interpreter's teardown."""
    run_forked(main)
