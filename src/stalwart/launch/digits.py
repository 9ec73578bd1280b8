"""The demo's task: an MLP on scikit-learn's handwritten digits.

The data set (1797 8x8 images) ships inside the scikit-learn package, so the
demo needs no download. The model is seeded, so every worker starts from the
same parameters; the loss is summed over samples, as the Manager divides the
reduced gradient by the step's sample count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import TensorDataset

from stalwart.data.plan import EpochPlan


def digits_dataset() -> TensorDataset:
    """The digits as (features scaled to [0, 1], label) pairs."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    features = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    return TensorDataset(features, labels)


def digits_model(seed: int = 0, hidden: int = 64) -> torch.nn.Module:
    """A two-layer MLP with parameters drawn from ``seed``."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    torch.random.set_rng_state(generator_state)
    return model


DEFAULT_LR = 0.01


def digits_optimizer(model: torch.nn.Module, lr: float = DEFAULT_LR) -> torch.optim.Optimizer:
    """Adam: per-parameter moments and a step count, so a heal or a checkpoint must carry its state."""
    return torch.optim.Adam(model.parameters(), lr=lr)


def digits_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Halve the learning rate every 10 steps: state outside the optimizer that a heal must carry too."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)


def summed_loss(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch."""
    features, labels = batch
    return torch.nn.functional.cross_entropy(model(features), labels, reduction="sum")


def reference_run(
    plan: EpochPlan, steps: int, seed: int = 0, lr: float = DEFAULT_LR
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train without failures in this process: each step on the plan's samples, mean gradient.

    Returns the final parameters and the loss of each step. Any failure-free
    or failure-transparent distributed run of the same plan computes the same
    steps, up to the order in which floating-point sums are taken.
    """
    dataset = digits_dataset()
    model = digits_model(seed)
    optimizer = digits_optimizer(model, lr)
    scheduler = digits_scheduler(optimizer)
    losses = []
    epoch, epoch_step = 0, 0
    for _ in range(steps):
        if epoch_step >= plan.steps_per_epoch:
            epoch, epoch_step = epoch + 1, 0
        indices = plan.indices(epoch, plan.step_start(epoch_step), plan.step_start(epoch_step + 1))
        features, labels = dataset[torch.from_numpy(indices)]
        loss = summed_loss(model, (features, labels))
        optimizer.zero_grad()
        (loss / len(indices)).backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()) / len(indices))
        epoch_step += 1
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}, losses
