"""``StalwartTrainer``: torchtitan's ``Trainer`` whose replica groups are stalwart members.

One torchrun job is one replica group: torchtitan builds, parallelizes
(FSDP2 over the job's own processes) and initialises the model, the
optimizer, the LR schedulers, the metrics and the checkpointer as it always
does, and :class:`~stalwart.runtime.manager.Manager` joins the group to the
lighthouse's quorum and reduces each step's gradients across the groups.
Written for torchtitan 0.3.0 (docs/guide/torchtitan.md says what breaks if
its seams change). It overrides four of the trainer's public seams and copies
none of its methods:

- ``__init__``: after torchtitan's own, the Manager over the model part and
  its optimizer, the LR schedulers and the trainer's counters healed with
  them, and stalwart's loader over torchtitan's dataset (streamed in
  order, :mod:`stalwart.integrations.torchtitan.data`), in place of the
  data-parallel split of torchtitan's dataloader; a ``min_replica_size``
  set is checked against the lighthouse's ``--min-replicas`` there;
- ``should_continue_training``: the loop's condition takes the next step
  from ``manager.steps()``; that call commits the step before, and joins,
  heals or re-forms the quorum at a step boundary;
- ``train_step``: the step's micro-batches through torchtitan's
  ``batch_generator`` and ``forward_backward_step``, each loss back-propagated
  by ``step.backward`` weighted by its tokens (:class:`StepLoss` wraps
  torchtitan's loss), then torchtitan's clipping, optimizer, LR schedulers
  and metrics on the quorum's reduced gradient;
- ``close``: torchtitan's, then the Manager's and the loader's.

With torchtitan's checkpointer on, the optimizer's state is created before
the Manager hooks it (:func:`fresh_state`): a restarted group loads its own
last torchtitan checkpoint as torchtitan does, and the heal then brings it
to the live groups' step.

torchtitan's ``train()`` loop is kept whole: checkpoint loading and saving,
validation, profiling, garbage collection and timeouts run as they do
without stalwart.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import spmd_types as spmd
import torch
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss
from torchtitan.components.optimizer.utils import init_optim_state
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils as titan_utils
from torchtitan.trainer import Trainer

from stalwart.data.plan import EpochPlan
from stalwart.data.world import WorldInfo
from stalwart.integrations.torchtitan.config import (
    FaultTolerance,
    TrainingShape,
    check_fault_tolerance,
    check_min_replica_size,
    check_training,
)
from stalwart.integrations.torchtitan.data import streamed_text
from stalwart.runtime.config import Checks, ReplicaGroup
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager
from stalwart.runtime.step import TrainStep
from stalwart.runtime.timeouts import Timeouts

RETAINED_STEPS = 2
"""Steps (DiLoCo rounds) of samples the streamed dataset keeps: the step retried after a failure, and the next."""

OTHER_DEGREES = (
    "data_parallel_replicate_degree",
    "tensor_parallel_degree",
    "context_parallel_degree",
    "pipeline_parallel_degree",
    "expert_parallel_degree",
)
"""The parallelism flags that must stay 1 (stalwart splits a group's share among its processes: FSDP only)."""


class StepLoss:
    """torchtitan's loss, back-propagated through the current stalwart step.

    torchtitan divides each micro-batch's summed loss by ``global_valid_tokens``
    and calls ``backward()`` itself. Here the trainer passes the micro-batch's
    own valid tokens: the loss becomes the micro-batch's mean, which
    ``step.backward`` weighs by those tokens, so the quorum's reduced gradient
    is the mean over every token of the global batch, whatever groups trained
    it. torchtitan then gets the mean as a detached leaf, whose ``backward()``
    reaches no parameter.
    """

    def __init__(self, loss: BaseLoss) -> None:
        self.loss = loss
        self.step: TrainStep | None = None

    def __call__(
        self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.step is None:
            raise RuntimeError("StepLoss called outside a stalwart step")
        total, metrics = self.loss(pred, labels, None, **kwargs)  # summed over the micro-batch's tokens
        mean = total / global_valid_tokens.clamp(min=1)  # a micro-batch of no token (FSDP lockstep) weighs 0
        with spmd.no_typecheck():
            self.step.backward(mean, weight=global_valid_tokens)
        return mean.detach().requires_grad_(), metrics


WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})
"""The name parts of activation checkpointing's and ``torch.compile``'s wrappers, which forward attributes to the
module they wrap (torch's distributed state dict drops them from parameter names)."""


class HealedParameters(torch.nn.Module):
    """The model as stalwart heals it: its parameters by name, this process's shards, read and written in place.

    torchtitan's modules reshape their ``state_dict`` for export (the fused
    ``wqkv`` split into ``wq``, ``wk``, ``wv`` after gathering it across the
    FSDP group: a collective), while a heal reads a process's own state on
    some processes only (the source's, the leader's report). The buffers
    (RoPE caches) are not state: every group computes them.

    Keyed by this module's own parameter names (``model.``-prefixed, without
    the wrappers' parts): torch's ``get_state_dict``/``set_state_dict``, which
    stalwart's durable checkpoints use, find each key's module by attribute
    from here.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def parameters_by_name(self) -> dict[str, torch.nn.Parameter]:
        """This module's parameters by the names torch's distributed state dict gives them: a wrapper's part
        (activation checkpointing's, ``torch.compile``'s) left out, as its ``_get_fqns`` does (private there)."""
        return {
            ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS): param
            for name, param in self.named_parameters()
        }

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {name: param.detach() for name, param in self.parameters_by_name().items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        params = self.parameters_by_name()
        if not isinstance(state_dict, dict) or state_dict.keys() != params.keys():
            given = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise KeyError(f"the model's parameters {sorted(params)} differ from the state's {given}")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state_dict[name])


def fresh_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state as it is before its first step (zero moments, step 0), before stalwart hooks it.

    torchtitan's checkpointer creates a missing optimizer state with a
    zero-gradient, zero-learning-rate ``step()`` (``init_optim_state``) when
    it loads a checkpoint (a restarted group finds its own); stalwart's update
    window refuses a step outside a reduced step. So the state is created
    here, with torchtitan's own function, and its step counts are put back to
    0: for Adam, AdamW and SGD the state then equals a fresh one's (a zero
    gradient leaves the moments and the momentum at zero).
    """
    init_optim_state(optimizer)
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


class StalwartTrainer(Trainer):
    """torchtitan's trainer as one replica group of a stalwart job (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
        """Where this torchrun job stands among the replica groups, and how they synchronise."""

    config: Config
    loss_fn: BaseLoss

    def __init__(self, config: Config) -> None:
        flags = config.fault_tolerance
        check_fault_tolerance(flags, device_type=titan_utils.device_type)  # before torchtitan builds anything
        super().__init__(config)
        check_training(
            TrainingShape(
                global_batch_size=config.training.global_batch_size,
                local_batch_size=config.training.local_batch_size,
                steps=config.training.steps,
                degrees={name: getattr(config.parallelism, name) for name in OTHER_DEGREES},
                optimizers=len(self.optimizers.optimizers),
                cuda_graphs=self.device.type == "cuda" and not config.training.disable_cuda_graphs,
                checkpointing=config.checkpoint.enable,
            ),
            flags,
        )
        if config.checkpoint.enable:
            fresh_state(self.optimizers.optimizers[0])
        global_batch = config.training.global_batch_size
        samples_per_step = global_batch * (flags.sync_steps if flags.semi_sync_method else 1)
        dataset = streamed_text(
            config.dataloader,
            self.tokenizer,
            config.training.seq_len,
            length=config.training.steps * global_batch,
            retain=RETAINED_STEPS * samples_per_step,
            anchor_every=samples_per_step,
        )
        self.stalwart_loader = ElasticLoader(dataset)
        timeout_ms = flags.process_group_timeout_ms
        self.manager = Manager(
            HealedParameters(self.model_parts[0]),
            self.optimizers.optimizers[0],
            max_microbatch=config.training.local_batch_size,
            member=flags.member(),
            plan=EpochPlan(len(dataset), global_batch, shuffle=False),
            redundancy=flags.redundancy,
            checks=Checks(audit_dir=flags.audit_dir),
            timeouts=Timeouts.resolve(collective_timeout=None if timeout_ms is None else timeout_ms / 1000),
            group=ReplicaGroup(WorldInfo.from_env()),
            device=self.device,
            sync=flags.sync(),
            checkpoint=flags.checkpointing(),
        )
        if flags.min_replica_size:
            self.check_lighthouse(flags)
        self.manager.register_state("lr_schedulers", self.lr_schedulers)
        self.manager.register_state("train_state", self)
        self.manager.register_state("data_stream", dataset)  # a joiner packs from the live groups' step
        self.step_loss = StepLoss(self.loss_fn)
        self.loss_fn = cast(BaseLoss, self.step_loss)
        self.stalwart_steps: Iterator[TrainStep] = self.manager.steps(
            self.stalwart_loader, max_steps=config.training.steps
        )
        self.stalwart_step: TrainStep | None = None

    def check_lighthouse(self, flags: FaultTolerance) -> None:
        """Refuse a ``min_replica_size`` other than the lighthouse's ``--min-replicas``, closing the Manager first.

        The group's leader asks the lighthouse (the others never talk to it);
        when it raises, torchrun ends the group's other processes.
        """
        status = self.manager.lighthouse_status()
        if status is None:
            return
        try:
            check_min_replica_size(flags, status)
        except ValueError:
            self.manager.close()
            raise

    def should_continue_training(self) -> bool:
        """Take the next step from stalwart (committing the one before; joining or healing at a boundary)."""
        self.stalwart_step = next(self.stalwart_steps, None)
        if self.stalwart_step is None:
            return False
        self.step = self.stalwart_step.number  # torchtitan's train() adds 1: its steps count from 1
        return True

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """One stalwart step: this process's micro-batches (``data_iterator``, torchtitan's split, is not read)."""
        step = self.stalwart_step
        if step is None:
            raise RuntimeError("train_step() runs inside train(), after should_continue_training()")
        self.optimizers.zero_grad()
        lr_metrics = self.lr_schedulers.get_metrics()
        self.step_loss.step = step
        batches = self.batch_generator(step)
        while True:
            try:
                input_dict, labels = next(batches)
            except DataloaderExhaustedError:  # the step's micro-batches ended: stalwart reduced them
                break
            self.forward_backward_step(
                input_dict={name: tensor.to(self.device) for name, tensor in input_dict.items()},
                labels=labels.to(self.device),
                global_valid_tokens=(labels != IGNORE_INDEX).sum().to(self.device),
            )
        self.step_loss.step = None
        grad_norm = dist_utils.clip_grad_norm_(
            [param for part in self.model_parts for param in part.parameters()],
            self.config.training.max_norm,
            foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"),
            ep_enabled=self.parallel_dims.ep_enabled,
        )
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        if not self.metrics_processor.should_log(self.step):
            return
        report = step.report
        if not math.isfinite(report.loss):
            raise RuntimeError(f"Loss is not finite ({report.loss}) at step {self.step}. Stopping training.")
        self.metrics_processor.log(
            self.step,
            report.loss,
            report.loss,
            float(grad_norm.item()),
            extra_metrics={
                "n_tokens_seen": self.ntokens_seen,
                "stalwart/replica_groups": report.world_size,
                "stalwart/samples": report.samples,
                **lr_metrics,
            },
        )

    def close(self) -> None:
        """torchtitan's close, then stalwart's: after the last step, this group leaves the quorum cleanly."""
        super().close()
        self.manager.close()
        self.stalwart_loader.close()
