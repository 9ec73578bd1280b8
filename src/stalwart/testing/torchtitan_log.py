"""What a torchtitan run printed: its step records (step, loss, grad norm) parsed from the log text."""

from __future__ import annotations

import re
from dataclasses import dataclass

# torchtitan's MetricsProcessor line, "step:  3  loss:  7.94935  grad_norm:  0.8943  ...", with or without its colours.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)")


@dataclass(frozen=True)
class StepRecord:
    """One logged training step: its number, the global average loss and the gradient norm."""

    step: int
    loss: float
    grad_norm: float


def step_records(text: str) -> list[StepRecord]:
    """Every training step line of ``text`` in order (each rank prints its own: a step can appear once per rank)."""
    return [StepRecord(int(step), float(loss), float(norm)) for step, loss, norm in _STEP.findall(_ANSI.sub("", text))]


def losses_by_step(text: str) -> dict[int, float]:
    """The loss logged at each step of ``text`` (the last line for a step when several ranks or lives printed it)."""
    return {record.step: record.loss for record in step_records(text)}
