"""A member's replica: the state a heal copies as one, and the step it is at.

The state is the model, the optimizer, what the user registered
(:meth:`Replica.register`: an LR scheduler, a GradScaler, an EMA), the
random generators (:mod:`stalwart.runtime.state`) and the row audit's
epoch sums (:class:`~stalwart.runtime.consistency.RowDigest`), in that order
on every member. ``applied_step`` is the number of steps this replica holds applied;
``trained_step`` the step it reached by applying steps itself (a heal to a
step does not count): only a replica that trained a step writes its
checkpoint, so that two quorums never write the same step.
"""

from __future__ import annotations

from typing import Any

import torch

from stalwart.runtime.comm import Communicator, device_rng_states
from stalwart.runtime.consistency import RowDigest
from stalwart.runtime.heal import state_specs, transfer_state
from stalwart.runtime.state import INTERNAL_PREFIX, Stateful, check_state_name, host_rng_states
from stalwart.runtime.timeouts import Timeouts


class Replica:
    """The state of one member's replica: what a heal copies, and the step it holds."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.applied_step = 0
        self.trained_step = -1
        self._registered: dict[str, Stateful] = {}
        self._internal: dict[str, Stateful] = {}
        self._rng_states: dict[str, Stateful] = {**host_rng_states(), **device_rng_states()}
        self.row_digest = RowDigest()
        """The quorum's row checksums by epoch (the same on every member: healed and checkpointed with the rest)."""

    def register(self, name: str, obj: Stateful) -> None:
        """Make ``obj`` part of the state under ``name`` (it needs ``state_dict()`` and ``load_state_dict()``)."""
        name = check_state_name(name, set(self._registered))
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"obj must have state_dict() and load_state_dict(), got {type(obj).__name__}")
        self._registered[name] = obj

    def add_internal(self, name: str, obj: Stateful) -> None:
        """Make ``obj`` part of the state under ``name``, a name of the Manager's own (``sync/...``: DiLoCo's)."""
        if not name.startswith(INTERNAL_PREFIX) or name in self._internal:
            raise ValueError(f"internal state names start with {INTERNAL_PREFIX!r} and are unique, got {name!r}")
        self._internal[name] = obj

    @property
    def states(self) -> dict[str, Stateful]:
        """Everything a heal copies, in order: model, optimizer, registered, the Manager's own, random generators."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            **self._registered,
            **self._internal,
            **self._rng_states,
            "audit/rows": self.row_digest,
        }

    @property
    def state_bytes(self) -> int:
        """Bytes of the tensors a heal moves."""
        return sum(spec.nbytes for spec in state_specs(self.states))

    def transfer(
        self,
        comm: Communicator,
        source: int,
        *,
        is_target: bool,
        key: str,
        max_bytes: int | None,
        timeouts: Timeouts,
    ) -> int:
        """Broadcast the state from rank ``source`` of ``comm``; load it if ``is_target``. The source's step."""
        return transfer_state(
            comm,
            source,
            self.states,
            self.applied_step,
            is_target=is_target,
            key=key,
            max_bytes=max_bytes,
            timeout=timeouts.heal_timeout,
            min_bandwidth=timeouts.heal_min_bandwidth,
        )

    def state_dict(self) -> dict[str, Any]:
        """Every state's ``state_dict()``, by name."""
        return {name: obj.state_dict() for name, obj in self.states.items()}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (the same names)."""
        names = set(self.states)
        if not isinstance(states, dict) or set(states) != names:
            given = sorted(states) if isinstance(states, dict) else type(states).__name__
            raise ValueError(f"states {given} differ from this Manager's {sorted(names)}")
        for name, obj in self.states.items():
            obj.load_state_dict(states[name])
