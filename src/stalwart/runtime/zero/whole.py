"""The user's ``optimizer.state_dict()`` and ``load_state_dict()`` under sharded state: the whole state, torch's format.

With sharded state the user's optimizer holds no state of its own (the
shards do), so torch's ``state_dict()`` alone would hold no moments: a
script's own ``torch.save({"optimizer": optimizer.state_dict()})`` would
lose them without a word. Hooks on the user's optimizer make it what a torch
user expects, as ``ZeroRedundancyOptimizer.consolidate_state_dict()`` or
FSDP2's ``get_optimizer_state_dict(full_state_dict=True)`` do:

- ``state_dict()`` gathers the whole state from the shards, keyed by
  parameter index beside ``param_groups``, equal to a replicated run's: a
  collective of the quorum, so every process calls it at the same point of
  the loop body (they meet on the quorum's store first, and all receive
  it), or the leader alone inside ``Manager.on_leader`` (the waiting
  processes send their shards when asked);
- ``load_state_dict()`` of such a whole dict (or of a replicated run's)
  keeps this process's shards of it, whatever the number of processes that
  saved it; before the first quorum, the first reshard shards it.

The Manager's own state copies (heals, drift heals, its checkpoints) run
:meth:`WholeStateDict.internal`, where the hooks stand aside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stalwart.runtime.zero.step import ShardedOptimizer


class WholeStateDict:
    """Hooks on the user's ``optimizer``: ``state_dict()`` gathers ``sharded``'s state, ``load_state_dict()`` shards it.

    ``gather()`` runs the gather, the Manager's (every process together over
    the quorum's communicator, or the leader's inside ``on_leader``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        sharded: ShardedOptimizer,
        gather: Callable[[], dict[int, dict[str, Any]]],
    ) -> None:
        self._sharded = sharded
        self._gather = gather
        self._internal = 0
        # kept for the optimizer's life: after the Manager's close() only the shards are left, and state_dict()
        # must say so rather than fall back to torch's empty state
        optimizer.register_state_dict_post_hook(self._after_state_dict)
        optimizer.register_load_state_dict_post_hook(self._after_load)

    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """The Manager's own use of the optimizer's state (heal, checkpoint): torch's methods, unchanged."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    def _after_state_dict(self, _optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        # Before the first quorum the user's optimizer holds the whole state itself (a loaded one, or none).
        if self._internal or self._sharded.layout is None:
            return state_dict
        return {**state_dict, "state": self._gather()}

    def _after_load(self, _optimizer: torch.optim.Optimizer) -> None:
        if self._internal or self._sharded.layout is None:
            return
        self._sharded.adopt_loaded()
