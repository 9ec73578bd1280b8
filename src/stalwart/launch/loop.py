"""The instrumented training loop every stalwart worker runs: the local cluster's worker and the benchmarks'.

:func:`train` is a user's loop under the Manager (each micro-batch's mean
loss through ``step.backward``; unscale, clip, update, schedule, zero the
gradients) with what tests and benchmarks add to it, all off by default:

- :class:`Faults`: SIGKILL this process at a named point of a step (the
  Manager's ``on_event`` hook reaches the points inside its step: route it
  through :meth:`Faults.manager_event`), perturb the parameters, overflow the
  gradient;
- :class:`Pacing`: simulated compute (per step, per sample) and a hold file
  that keeps the job waiting while a restarted worker starts;
- a :class:`StepProbe`: what a step is seen to do (the worker's step records,
  the benchmarks' phase timings).

One loop, so that what the tests kill and what the benchmarks time is the
same code.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from stalwart.runtime.events import Event
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager
from stalwart.runtime.sharding import is_dtensor, local_tensor
from stalwart.runtime.step import TrainStep

KILL_POINTS = (
    "step_started",
    "before_forward",
    "during_backward",
    "during_reduce",
    "after_reduce",
    "during_update",
    "during_gather",
    "during_parity",
    "during_exchange",
    "during_outer",
    "during_evaluate",
)
"""Where :class:`Faults` can kill: the top of a step (before anything of it), each micro-batch's forward, its
backward, the reduction in flight, after it, before the update, the sharded state's gather and parity,
DiLoCo's exchange and outer step, and the leader's evaluation after the step (inside ``manager.on_leader()``)."""
MANAGER_EVENTS = {
    Event.REDUCE_STARTED: "during_reduce",
    Event.REDUCE_FINISHED: "after_reduce",
    Event.UPDATE_STARTED: "during_update",
    Event.GATHER_STARTED: "during_gather",
    Event.PARITY_STARTED: "during_parity",
    Event.EXCHANGE_STARTED: "during_exchange",
    Event.OUTER_STARTED: "during_outer",
}
"""The Manager's events that are kill points, and the points they are."""
HOLD_LIMIT = 600.0
"""Seconds a worker waits at most on a hold file (a bound, should the holder die)."""


def parse_kill_at(text: str | None) -> tuple[int, str] | None:
    """Parse ``STEP:POINT`` into (step, point) (None stays None)."""
    if text is None:
        return None
    step_text, _, point = text.partition(":")
    if not step_text.isdigit() or point not in KILL_POINTS:
        raise argparse.ArgumentTypeError(f"--kill-at must be STEP:POINT with POINT in {KILL_POINTS}, got {text!r}")
    return int(step_text), point


@dataclass
class Faults:
    """The faults a test injects into this process (none by default).

    ``kill_at``: (step, point) at which the process SIGKILLs itself, after
    ``before_kill()`` (a benchmark's last log line). ``corrupt_at``: the step
    at whose start noise is added to this process's parameters (its shards,
    in an FSDP2 group). ``inf_at``: the step whose loss is made infinite
    here, so that the reduced gradient overflows on every member.
    """

    kill_at: tuple[int, str] | None = None
    corrupt_at: int | None = None
    inf_at: int | None = None
    before_kill: Callable[[], None] = lambda: None

    def __post_init__(self) -> None:
        if self.kill_at is not None and self.kill_at[1] not in KILL_POINTS:
            raise ValueError(f"kill_at's point must be one of {KILL_POINTS}, got {self.kill_at[1]!r}")

    def kill_if(self, point: str, step: int) -> None:
        """SIGKILL this process if ``kill_at`` is ``(step, point)``."""
        if self.kill_at == (step, point):
            self.kill()

    def kill(self) -> None:
        """``before_kill()``, then SIGKILL this process (also where a harness decides it dies all the same)."""
        self.before_kill()
        os.kill(os.getpid(), signal.SIGKILL)

    def manager_event(self, event: Event, step: int) -> bool:
        """The Manager's ``on_event``: kill if ``event`` is the kill point; whether ``event`` is a kill point."""
        point = MANAGER_EVENTS.get(event)
        if point is not None:
            self.kill_if(point, step)
        return point is not None

    def corrupt(self, model: torch.nn.Module, step: int) -> None:
        """At step ``corrupt_at`` (once): add noise of scale 1e-2, seeded by the step, to every local parameter."""
        if self.corrupt_at != step:
            return
        self.corrupt_at = None
        with torch.no_grad():
            for param in model.parameters():
                shard = local_tensor(param)  # an FSDP2 group's process: its own shard
                noise = torch.randn(shard.shape, generator=torch.Generator().manual_seed(step))
                shard.add_(noise.to(shard.device) * 1e-2)


@dataclass(frozen=True)
class Pacing:
    """Simulated compute and holds: ``step_seconds`` at the top of each step, ``sample_seconds`` per sample.

    ``hold_file``: while it exists and holds a step number ``S`` (the
    ledger's: a round under DiLoCo), the loop waits before any step
    ``>= S`` (at most :data:`HOLD_LIMIT` s), except
    when the lighthouse asks for a step boundary (a joiner), see
    :func:`held_until`.
    """

    step_seconds: float = 0.0
    sample_seconds: float = 0.0
    hold_file: Path | None = None


def held_until(hold_file: Path | None, step: int, boundary_wanted: Callable[[], bool] = lambda: False) -> None:
    """Wait while ``hold_file`` exists and holds a step number <= ``step`` (at most ``HOLD_LIMIT`` s).

    A hold never blocks a membership change: when ``boundary_wanted()`` (the
    lighthouse asks the quorum to come to a step boundary, e.g. for a joiner)
    the worker runs this one step, so the change happens at its end, and is
    held again before the next.
    """
    if hold_file is None:
        return
    deadline = time.monotonic() + HOLD_LIMIT
    while time.monotonic() < deadline:
        try:
            hold_from = int(hold_file.read_text(encoding="utf-8").strip() or 0)
        except (FileNotFoundError, ValueError):
            return
        if step < hold_from or boundary_wanted():
            return
        time.sleep(0.05)


class StepProbe:
    """What the loop reports of each step; this base class records nothing (subclasses override what they need)."""

    def step_started(self, manager: Manager, number: int) -> None:
        """The top of step ``number`` (an inner step's number under DiLoCo), before anything of it runs."""

    @contextmanager
    def microbatch(self, manager: Manager, samples: int) -> Iterator[None]:
        """Wraps one micro-batch's forward and backward (``samples`` of them)."""
        yield

    def step_finished(self, manager: Manager, step: TrainStep, scaler: torch.amp.GradScaler | None) -> None:
        """The step is applied (optimizer and scheduler stepped, gradients zeroed); ``step.report`` is known."""


@dataclass
class LoopParts:
    """What :func:`train` steps besides the Manager: the optimizer and the user's usual companions."""

    optimizer: torch.optim.Optimizer
    loss: Callable[[torch.nn.Module, Sequence[torch.Tensor]], torch.Tensor]
    """A micro-batch's **mean** loss."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    scaler: torch.amp.GradScaler | None = None
    clip: float | None = None
    evaluate: Callable[[int], None] | None = None
    """Run on the leader (``manager.on_leader``) after every ``eval_every``-th step, given the steps done."""
    eval_every: int = 0
    eval_first: bool = False
    """Evaluate at the top of the next step's body, before its micro-batches (nanoGPT's place), not after the
    update (an evaluation after the last step is then not run)."""

    def evaluation_after(self, done: int) -> Callable[[int], None] | None:
        """The evaluation the leader runs once ``done`` steps are done (None when none is due)."""
        due = self.eval_every > 0 and done > 0 and done % self.eval_every == 0
        return self.evaluate if due else None


def train(
    manager: Manager,
    loader: ElasticLoader | DataLoader[Any],
    parts: LoopParts,
    *,
    max_steps: int,
    faults: Faults | None = None,
    pacing: Pacing | None = None,
    probe: StepProbe | None = None,
) -> None:
    """Train under ``manager`` until the job has committed ``max_steps`` steps (inner steps under DiLoCo)."""
    faults = faults or Faults()
    pacing = pacing or Pacing()
    probe = probe or StepProbe()
    device, model = manager.device, manager.model
    optimizer, scaler = parts.optimizer, parts.scaler
    diloco = manager.diloco is not None
    for step in manager.steps(loader, max_steps=max_steps):
        number = step.number if diloco else manager.ledger.step
        probe.step_started(manager, number)
        faults.kill_if("step_started", number)
        held_until(pacing.hold_file, manager.ledger.step, lambda: manager.boundary_wanted)
        _pace(pacing.step_seconds)
        faults.corrupt(model, number)
        evaluation = parts.evaluation_after(number) if parts.eval_first else None
        if evaluation is not None:
            manager.on_leader(evaluation, number)
        for batch in step:
            faults.kill_if("before_forward", number)
            tensors = [tensor.to(device, non_blocking=True) for tensor in batch]
            _pace(pacing.sample_seconds * len(tensors[0]))
            with probe.microbatch(manager, len(tensors[0])):
                loss = parts.loss(model, tensors)
                if faults.kill_at == (number, "during_backward"):
                    loss.register_hook(lambda grad, at=number: faults.kill_if("during_backward", at))
                if faults.inf_at == number:
                    loss = loss * math.inf  # this worker's gradient overflows; the reduced one does on every member
                step.backward(loss, scaler=scaler)
        faults.kill_if("during_update", number)
        if scaler is not None:
            scaler.unscale_(optimizer)
        if parts.clip is not None:
            clip_grad_norm(model, parts.clip)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        if parts.scheduler is not None:
            parts.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        evaluation = None if parts.eval_first else parts.evaluation_after(number + 1)
        if evaluation is not None:
            manager.on_leader(evaluation, number + 1)
        probe.step_finished(manager, step, scaler)


def _pace(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> None:
    """Clip the gradient's global norm, also over an FSDP2 group's DTensor shards (as torchtitan does)."""
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if is_dtensor(total):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)


def redundancy_report(manager: Manager) -> dict[str, Any]:
    """Sharded optimizer state: this process's state bytes and what its reshards did (nothing without redundancy)."""
    if manager.redundancy_stats is None:
        return {}
    state_bytes, stats = manager.redundancy_stats
    return {
        "state_bytes": state_bytes,
        "repairs": stats.repairs,
        "repair_seconds": stats.seconds,
        "shards_rebuilt": stats.shards_rebuilt,
    }
