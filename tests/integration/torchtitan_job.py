"""stalwart's torchtitan trainer as the failure tests run it: held at a step, and its final parameters saved.

``--module tests.integration.torchtitan_job --config llama3_held`` (through
:mod:`stalwart.testing.torchtitan_cpu`) builds :class:`HeldTrainer`, which
adds two test seams on top of :class:`StalwartTrainer` and changes nothing
of its training: at the top of every step it writes ``STEP PID`` to
``RUN_DIR/step-MEMBER.RANK`` (a line per step) and waits while the hold file holds a step
number at most the step's (:func:`stalwart.launch.loop.held_until`: a
membership change ends the wait), and after the last step it saves the
model's full parameters to ``RUN_DIR/final-MEMBER.RANK.pt``. ``RUN_DIR`` and
the hold file come from :data:`RUN_DIR_VARIABLE` and :data:`HOLD_VARIABLE`.
With :data:`GO_VARIABLE` set, it waits (bounded) until that file exists
before building anything (torchtitan's trainer, the process group, the
Manager): a replacement group a test starts early, its interpreters'
torch and torchtitan imports done while the job trains, joins when told.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from stalwart.integrations.torchtitan.config_registry import with_stalwart
from stalwart.integrations.torchtitan.trainer import StalwartTrainer
from stalwart.launch.loop import HOLD_LIMIT, held_until
from stalwart.runtime.sharding import is_dtensor
from stalwart.testing.waiting import wait_until
from tests.integration.torchtitan_seams import GO_VARIABLE, HOLD_VARIABLE, RUN_DIR_VARIABLE


class HeldTrainer(StalwartTrainer):
    """:class:`StalwartTrainer` with the test seams of the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(StalwartTrainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        go = os.environ.get(GO_VARIABLE)
        if go is not None:
            wait_until(Path(go).exists, HOLD_LIMIT, f"the go file {go}")
        super().__init__(config)

    def should_continue_training(self) -> bool:
        going = super().should_continue_training()
        if going:
            number = self.step  # the step about to run (train() adds 1 after this)
            with self.mark_file().open("a") as mark:
                mark.write(f"{number} {os.getpid()}\n")
            hold = os.environ.get(HOLD_VARIABLE)
            held_until(None if hold is None else Path(hold), number, lambda: self.manager.boundary_wanted)
        return going

    def close(self) -> None:
        if self.step >= self.config.training.steps:  # DiLoCo: the inner steps trained for a dead group count too
            finals = {
                name: (value.full_tensor() if is_dtensor(value) else value).detach().clone()
                for name, value in self.model_parts[0].state_dict().items()
            }
            torch.save(finals, self.run_dir() / f"final-{self.name()}.pt")
        super().close()

    def name(self) -> str:
        return f"{self.config.fault_tolerance.member()}.{torch.distributed.get_rank()}"

    def run_dir(self) -> Path:
        return Path(os.environ[RUN_DIR_VARIABLE])

    def mark_file(self) -> Path:
        return self.run_dir() / f"step-{self.name()}"


def llama3_held() -> StalwartTrainer.Config:
    """torchtitan's llama3 debug model under :class:`HeldTrainer`."""
    return with_stalwart(llama3_debugmodel(), trainer=HeldTrainer)
