"""The semi-synchronous mode's configuration: ``Manager(..., sync=DiLoCo(inner_steps=H, ...))``.

Replica groups take ``H`` inner steps each on their own shares (the user's
loop and optimizer: the *inner* optimizer), then an outer step: the
pseudo-gradients (the global parameters at the start of the round minus the
group's parameters now) are averaged across the groups, weighted by the
samples each trained, and the outer optimizer updates the global parameters
that every group then continues from. ``fragments > 1`` is Streaming DiLoCo:
the parameters are cut into fragments, each synchronised once a round at its
own inner step, its exchange overlapped with the next ``overlap`` inner steps.
``pseudo_gradient_dtype`` sends the pseudo-gradients in bfloat16 or 8 bits
(``"int8"``), the rounding error carried into the group's next exchange.

Checked when built (the values alone) and by :func:`check_against` against
the model and a built outer optimizer, so that a bad configuration fails
before any training, naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart._validate import check_int

INT8 = "int8"
_FLOAT_CODECS = (torch.float32, torch.bfloat16)
"""The dtypes ``pseudo_gradient_dtype`` takes besides None (float32) and ``"int8"``."""
DEFAULT_ROUND_TIMEOUT = 600.0


def nesterov_outer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum 0.9 at learning rate 0.7 (Douillard et al., 2023)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True)
class DiLoCo:
    """Semi-synchronous training across replica groups (see the module docstring).

    ``inner_steps``: H, the inner steps of a round. ``outer_optimizer``: builds
    the outer optimizer over the global parameters of one fragment (called once
    per fragment; any ``torch.optim.Optimizer``). ``fragments``: 1 for DiLoCo,
    more for Streaming DiLoCo (at most the model's parameter tensors).
    ``overlap``: inner steps a fragment's exchange runs behind (default 0 for
    one fragment, 1 for more; each fragment's window of ``H // fragments``
    inner steps must hold its launch and its ``overlap`` steps).
    ``pseudo_gradient_dtype``: None / ``torch.float32``, ``torch.bfloat16`` or
    ``"int8"`` (blocks of ``int8_block`` values share a float32 scale).
    ``round_timeout``: seconds a group waits at an exchange for the slowest
    group (a dead group is seen at once through the lighthouse; this bounds a
    hung one).
    """

    inner_steps: int
    outer_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] = field(default=nesterov_outer)
    fragments: int = 1
    overlap: int | None = None
    pseudo_gradient_dtype: Any = None
    int8_block: int = 256
    round_timeout: float = DEFAULT_ROUND_TIMEOUT

    def __post_init__(self) -> None:
        check_int("DiLoCo.inner_steps", self.inner_steps, minimum=1)
        if not callable(self.outer_optimizer):
            raise TypeError(
                "DiLoCo.outer_optimizer must be a callable that builds a torch.optim.Optimizer over a list of "
                f"parameters (e.g. lambda params: torch.optim.SGD(params, lr=0.7)), got {self.outer_optimizer!r}"
            )
        check_int("DiLoCo.fragments", self.fragments, minimum=1)
        if self.overlap is not None:
            check_int("DiLoCo.overlap", self.overlap, minimum=0)
        window = self.inner_steps // self.fragments
        if window < 1:
            raise ValueError(
                f"DiLoCo.fragments={self.fragments} is more than inner_steps={self.inner_steps}: each fragment "
                "synchronises at its own inner step of the round"
            )
        if self.overlap_steps >= window and self.fragments > 1:
            raise ValueError(
                f"DiLoCo.overlap={self.overlap_steps} must be less than inner_steps // fragments = {window}: a "
                "fragment's exchange must finish within its window of the round"
            )
        if self.fragments == 1 and self.overlap_steps:
            raise ValueError(
                f"DiLoCo.overlap={self.overlap_steps} needs fragments > 1 (Streaming DiLoCo): with one fragment the "
                "exchange is the round's end, which every group waits for"
            )
        dtype = self.pseudo_gradient_dtype
        if not _known_codec(dtype):
            raise ValueError(
                f"DiLoCo.pseudo_gradient_dtype must be None, torch.float32, torch.bfloat16 or 'int8', got {dtype!r}"
            )
        check_int("DiLoCo.int8_block", self.int8_block, minimum=1)
        if (
            isinstance(self.round_timeout, bool)
            or not isinstance(self.round_timeout, int | float)
            or not math.isfinite(self.round_timeout)
            or self.round_timeout <= 0
        ):
            raise ValueError(f"DiLoCo.round_timeout must be a positive number of seconds, got {self.round_timeout!r}")

    @property
    def overlap_steps(self) -> int:
        """The overlap in inner steps: as given, else 0 for one fragment and 1 for more."""
        if self.overlap is not None:
            return self.overlap
        return 0 if self.fragments == 1 else 1

    @property
    def codec(self) -> str:
        """How pseudo-gradients travel: ``"float32"``, ``"bfloat16"`` or ``"int8"``."""
        if self.pseudo_gradient_dtype is None or self.pseudo_gradient_dtype is torch.float32:
            return "float32"
        if self.pseudo_gradient_dtype is torch.bfloat16:
            return "bfloat16"
        return INT8

    @property
    def streaming(self) -> bool:
        """Whether this is Streaming DiLoCo (more than one fragment)."""
        return self.fragments > 1

    def describe(self) -> dict[str, Any]:
        """What every member must agree on, as JSON (checked in the quorum's store at every quorum)."""
        return {
            "mode": "diloco",
            "inner_steps": self.inner_steps,
            "fragments": self.fragments,
            "overlap": self.overlap_steps,
            "codec": self.codec,
            "int8_block": self.int8_block,
        }


def check_against(config: DiLoCo, params: list[torch.nn.Parameter]) -> None:
    """Refuse ``config`` for a model with ``params`` (trainable, in order) before training: fragments and optimizer."""
    if config.fragments > len(params):
        raise ValueError(
            f"DiLoCo.fragments={config.fragments} is more than the model's {len(params)} trainable parameter tensors: "
            "a fragment holds whole tensors (layers); use at most that many"
        )
    probe = [torch.nn.Parameter(torch.zeros(1))]
    built = config.outer_optimizer(probe)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(
            "DiLoCo.outer_optimizer must return a torch.optim.Optimizer (e.g. lambda params: torch.optim.SGD(params, "
            f"lr=0.7, momentum=0.9, nesterov=True)), got {type(built).__name__}"
        )


def _known_codec(dtype: Any) -> bool:
    """Whether ``dtype`` is a ``pseudo_gradient_dtype`` this mode sends: None, float32, bfloat16 or ``"int8"``."""
    if dtype is None:
        return True
    if isinstance(dtype, str):
        return dtype == INT8
    return isinstance(dtype, torch.dtype) and dtype in _FLOAT_CODECS
