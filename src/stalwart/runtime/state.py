"""What a member's state is made of: the model, the optimizer, user-registered objects and the RNG states.

Anything with ``state_dict()`` and ``load_state_dict()`` can be part of a
member's state (LR schedulers, ``GradScaler``, EMA modules, a user's counters
object); :class:`~stalwart.runtime.manager.Manager` heals all of it together.
The random number generators are part of it by default, under reserved names:

- ``rng/torch``: torch's default CPU generator (``torch.get_rng_state()``);
- ``rng/numpy``: numpy's global legacy generator (``np.random.get_state()``,
  what ``np.random.rand`` and friends draw from; ``np.random.Generator``
  objects a user creates are not global: register them, or seed them per step);
- ``rng/python``: python's ``random`` module (``random.getstate()``);
- ``rng/cuda``: every CUDA device's default generator, when CUDA is available
  (see :func:`stalwart.runtime.comm.device_rng_states`).
"""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

INTERNAL_PREFIX = "sync/"
"""The Manager's own states besides the random generators and the audit (DiLoCo's outer state)."""
RESERVED_PREFIXES = ("rng/", "audit/", INTERNAL_PREFIX)
RESERVED_NAMES = frozenset({"model", "optimizer"})
"""State names the Manager registers itself; user names may not be these nor start with ``rng/``, ``audit/``
or ``sync/``."""


@runtime_checkable
class Stateful(Protocol):
    """An object whose state can be saved and restored (the ``torch.nn.Module`` convention)."""

    def state_dict(self) -> Any:
        """The object's state: nested dicts, lists, tuples, JSON scalars and tensors."""

    def load_state_dict(self, state_dict: Any) -> Any:
        """Restore what ``state_dict()`` returned."""


class TorchRNGState:
    """torch's default CPU generator as a stateful object."""

    def state_dict(self) -> dict[str, Any]:
        """The generator's state (a uint8 tensor)."""
        return {"state": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the generator."""
        torch.set_rng_state(state_dict["state"].cpu())


class NumpyRNGState:
    """numpy's global (legacy ``np.random``) generator as a stateful object, JSON-only."""

    def state_dict(self) -> dict[str, Any]:
        """The MT19937 state: its 624 key words, position and cached Gaussian, as python values."""
        name, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
        return {
            "name": str(name),
            "keys": [int(key) for key in keys],
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the generator."""
        keys = np.asarray(state_dict["keys"], dtype=np.uint32)
        np.random.set_state(
            (
                state_dict["name"],
                keys,
                int(state_dict["position"]),
                int(state_dict["has_gauss"]),
                float(state_dict["cached_gaussian"]),
            )
        )


class PythonRNGState:
    """python's ``random`` module generator as a stateful object (its state is a tuple of ints)."""

    def state_dict(self) -> dict[str, Any]:
        """``random.getstate()``."""
        return {"state": random.getstate()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``random.setstate()``."""
        random.setstate(state_dict["state"])


def host_rng_states() -> dict[str, Stateful]:
    """The host's generators under their reserved names (torch CPU, numpy global, python ``random``)."""
    return {"rng/torch": TorchRNGState(), "rng/numpy": NumpyRNGState(), "rng/python": PythonRNGState()}


def check_state_name(name: Any, taken: set[str] | frozenset[str]) -> str:
    """Return ``name`` if it can name a user state: a non-empty str, not reserved, not ``taken``; else raise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES):
        raise ValueError(
            f"name {name!r} is reserved (the Manager registers {sorted(RESERVED_NAMES)}, 'rng/...', 'audit/...' and "
            "'sync/...' itself)"
        )
    if name in taken:
        raise ValueError(f"name {name!r} is already registered; registered names: {sorted(taken)}")
    return name
